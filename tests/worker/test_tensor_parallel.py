"""Tensor parallelism (chapter 17): Megatron shards equal the whole model, the engine at
tp=2 and tp=4 equals tp=1 in float32 (every model family) (and in bfloat16 is deterministic and batch-invariant
itself), bad head counts fail before any process starts, dead or raising workers end the
engine cleanly, and no worker outlives its engine.

The first tests run the ranks as threads of this process, each with a gloo
ProcessGroup made directly from a FileStore (fast: no process start). The rest start
real worker processes through LLM(tensor_parallel_size=N). On a CPU every collective
goes over gloo; the NCCL test needs two CUDA devices.
"""
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from nanopaged import LLM, SamplingParams, StructuredOutputsParams
from nanopaged.utils.proc import EngineDeadError
from nanopaged.model.model_loader import load_model
from nanopaged.layers.parallel import TPGroup, shard_heads

from conftest import make_tiny_llama, paged_logits

pytestmark = pytest.mark.timeout(300)

PROMPTS = ["The capital of France", "Hello, my name is", [5, 6, 7, 8, 9, 10, 11, 12, 13]]


def child_pids() -> set[int]:
    """Live child processes of this process (from /proc; zombies excluded)."""
    pids = set()
    for task in Path("/proc/self/task").iterdir():
        pids |= {int(p) for p in (task / "children").read_text().split()}
    return {p for p in pids if _alive(p)}


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids, timeout: float = 15.0) -> set[int]:
    """The pids still alive after waiting up to `timeout` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return {p for p in pids if _alive(p)}


def worker_pids(llm) -> list[int]:
    return [p.pid for p in llm.engine.engine_core.executor.procs]


@pytest.fixture(scope="module")
def tp_model_dir(tmp_path_factory):
    """8 heads, 4 KV heads: splits over 2 and 4 ranks (4: one KV head each)."""
    folder = tmp_path_factory.mktemp("tp-llama")
    make_tiny_llama(folder, tie=False, num_attention_heads=8, num_key_value_heads=4, head_dim=8,
                    intermediate_size=96)
    return folder


@pytest.fixture(scope="module")
def gqa2_model_dir(tmp_path_factory):
    """8 heads, 2 KV heads, tied embeddings: at tp=4 each KV head sits on two ranks."""
    folder = tmp_path_factory.mktemp("tp-gqa2")
    make_tiny_llama(folder, tie=True, num_attention_heads=8, num_key_value_heads=2, head_dim=8)
    return folder


# -- the layers, ranks as threads -------------------------------------------------------

def sharded_logits(folder, tp_size: int, tokens: list[int], block_size: int = 4) -> list[torch.Tensor]:
    """Each rank's logits for every position of `tokens` (a prefill of all but the last
    three, then three decodes), ranks run as threads over a FileStore gloo group."""
    store_path = Path(folder) / f"store-{tp_size}-{time.monotonic_ns()}"
    results, errors = [None] * tp_size, []

    def rank_main(rank):
        try:
            pg = (dist.ProcessGroupGloo(dist.FileStore(str(store_path), tp_size), rank, tp_size)
                  if tp_size > 1 else None)
            model = load_model(folder, torch.float32, torch.device("cpu"), 64, TPGroup(rank, tp_size, pg))
            with torch.inference_mode():
                results[rank] = paged_logits(model, tokens, block_size, len(tokens) - 3)
        except BaseException as e:          # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(tp_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return results


@pytest.mark.parametrize("folder_name, tp_size", [("tp_model_dir", 2), ("tp_model_dir", 4), ("gqa2_model_dir", 4)])
def test_sharded_logits_equal_tp1(request, folder_name, tp_size):
    folder = request.getfixturevalue(folder_name)
    tokens = [3, 17, 42, 99, 5, 250, 7, 8, 19, 300, 1, 64]
    (whole,) = sharded_logits(folder, 1, tokens)
    ranks = sharded_logits(folder, tp_size, tokens)
    for logits in ranks:                           # every rank holds the full logits
        assert logits.shape == whole.shape
        assert torch.allclose(logits, whole, atol=1e-5, rtol=0), (logits - whole).abs().max()
    assert all(torch.equal(ranks[0], r) for r in ranks[1:])   # all-gather: bit-equal on all ranks


@pytest.mark.parametrize("arch, tp_size", [("MistralForCausalLM", 2), ("Qwen2ForCausalLM", 2), ("Qwen2ForCausalLM", 4),
                                           ("Qwen3ForCausalLM", 2), ("Qwen3ForCausalLM", 4)])
def test_each_family_sharded_equals_tp1(tiny_family, arch, tp_size):
    """The family rules under TP: Qwen2's q/k/v bias rows split with their heads (and
    replicate with a replicated KV head at tp=4: 2 KV heads), Qwen3's q_norm/k_norm are
    replicated. 4 heads over 2 KV heads, untied."""
    folder, _ = tiny_family(arch, False)
    tokens = [3, 17, 42, 99, 5, 250, 7, 8, 19, 300, 1, 64]
    (whole,) = sharded_logits(folder, 1, tokens)
    for logits in sharded_logits(folder, tp_size, tokens):
        assert torch.allclose(logits, whole, atol=1e-5, rtol=0), (logits - whole).abs().max()


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_engine_at_tp2_equals_tp1_per_family(tiny_family, arch):
    """Worker processes at tp=2 on the families with their own tensors (Qwen2's bias,
    Qwen3's QK-norm): greedy ids equal tp=1, float32."""
    folder, _ = tiny_family(arch, False)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(folder), num_gpu_blocks=64, block_size=4, dtype="float32")
            .generate(PROMPTS, params, use_tqdm=False)]
    llm = LLM(str(folder), num_gpu_blocks=64, block_size=4, tensor_parallel_size=2, dtype="float32")
    pids = worker_pids(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == want
    llm.shutdown()
    assert not wait_gone(pids)


def test_shard_shapes_and_replicated_kv_heads(gqa2_model_dir):
    """At tp=4 with 2 KV heads, ranks 0,1 hold KV head 0 and ranks 2,3 KV head 1; the
    KV rows a rank loads are that head's rows of k_proj."""
    from safetensors.torch import load_file
    full = load_file(Path(gqa2_model_dir) / "model.safetensors")
    k_proj = full["model.layers.0.self_attn.k_proj.weight"]           # [2 * 8, 64]
    for rank, kv_head in [(0, 0), (1, 0), (2, 1), (3, 1)]:
        s = shard_heads(8, 2, 4, rank)
        assert (s.num_heads, s.num_kv_heads, s.first_head, s.first_kv_head, s.kv_replicas) == (2, 1, 2 * rank, kv_head, 2)
        with torch.device("meta"):
            from nanopaged.model.config import ModelConfig
            from nanopaged.model.llama import LlamaForCausalLM
            model = LlamaForCausalLM(ModelConfig.from_pretrained(gqa2_model_dir), _FakeTP(rank, 4))
        model = model.to_empty(device="cpu")
        model.load_weights(gqa2_model_dir)
        qkv = model.layers[0].self_attn.qkv_proj.weight                 # [(2 + 1 + 1) * 8, 64]
        assert qkv.shape == (32, 64)
        assert torch.equal(qkv[16:24], k_proj[kv_head * 8:(kv_head + 1) * 8])
        assert model.layers[0].mlp.down_proj.weight.shape == (64, 32)   # 128 intermediate / 4 ranks
        assert model.embed_tokens.weight.shape == (80, 64)              # 320 vocab / 4


class _FakeTP(TPGroup):
    """A rank's TPGroup without a process group, for shapes and loading only."""

    def __init__(self, rank, size):
        super().__init__(0, 1)
        self.rank, self.size = rank, size


@pytest.mark.parametrize("heads, kv_heads, tp, words", [
    (9, 3, 2, ["tensor_parallel_size=2", "num_attention_heads=9"]),
    (8, 4, 3, ["tensor_parallel_size=3", "num_attention_heads=8"]),
    (8, 4, 8, ["tensor_parallel_size=8", "num_key_value_heads=4"]),      # 8 % 4 == 0: fine
    (12, 8, 6, ["tensor_parallel_size=6", "num_key_value_heads=8"]),     # neither divides
])
def test_gqa_rules(heads, kv_heads, tp, words):
    if heads % tp == 0 and (kv_heads % tp == 0 or tp % kv_heads == 0):
        assert shard_heads(heads, kv_heads, tp, 0).num_kv_heads == max(1, kv_heads // tp)
        return
    with pytest.raises(ValueError) as e:
        shard_heads(heads, kv_heads, tp)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_bad_tp_fails_before_any_process_starts(tmp_path):
    make_tiny_llama(tmp_path)                       # 4 heads, 2 KV heads
    before = child_pids()
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide num_attention_heads=4"):
        LLM(str(tmp_path), tensor_parallel_size=3)
    assert child_pids() == before
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer, got 0"):
        LLM(str(tmp_path), tensor_parallel_size=0)
    with pytest.raises(ValueError, match="distributed_executor_backend='uni' runs one worker"):
        LLM(str(tmp_path), tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="external_launcher.*torchrun"):
        LLM(str(tmp_path), tensor_parallel_size=2, distributed_executor_backend="external_launcher")


# -- the engine, ranks as processes ---------------------------------------------------------

def run_workload(llm):
    """Greedy with prompt logprobs, and seeded sampling with n=2."""
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, prompt_logprobs=3),
                          use_tqdm=False)
    sampled = llm.generate(PROMPTS[:2], SamplingParams(temperature=1.0, n=2, seed=7, max_tokens=16),
                           use_tqdm=False)
    return greedy, sampled


@pytest.fixture(scope="module")
def tp1_reference(tp_model_dir):
    llm = LLM(str(tp_model_dir), num_gpu_blocks=64, block_size=4, preemption_mode="recompute", dtype="float32")
    return run_workload(llm)


class _InterruptOnce:
    """A socket whose first poll raises KeyboardInterrupt (a Ctrl-C mid-step)."""

    def __init__(self, sock):
        self.sock, self.fired = sock, False

    def poll(self, timeout):
        if not self.fired:
            self.fired = True
            time.sleep(0.2)               # the ranks' answers are on their way
            raise KeyboardInterrupt
        return self.sock.poll(timeout)

    def recv(self):
        return self.sock.recv()


@pytest.mark.parametrize("tp_size", [2, 4])      # 4 > this machine's 2 cores: slower, not an error
def test_engine_at_tp_equals_tp1(tp_model_dir, tp1_reference, tp_size):
    llm = LLM(str(tp_model_dir), num_gpu_blocks=64, block_size=4, tensor_parallel_size=tp_size, dtype="float32")
    pids = worker_pids(llm)
    assert len(pids) == tp_size
    greedy, sampled = run_workload(llm)
    ref_greedy, ref_sampled = tp1_reference
    for ours, ref in zip(greedy, ref_greedy):
        assert ours.outputs[0].token_ids == ref.outputs[0].token_ids
        for a, b in zip(ours.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)
    assert [[c.token_ids for c in o.outputs] for o in sampled] == [[c.token_ids for c in o.outputs] for o in ref_sampled]
    stats = llm.engine.engine_core.executor.get_comm_stats()
    assert len(stats) == tp_size and all(s["num_collectives"] > 0 for s in stats)
    assert llm.engine.get_stats()["num_free_gpu_blocks"] == 64
    if tp_size == 4:
        llm.shutdown()
        assert not wait_gone(pids)
        return
    # Ctrl-C while the engine waits for the ranks' answers: that step's late answers are
    # dropped, and the engine goes on serving the same tokens
    executor = llm.engine.engine_core.executor
    executor.output = _InterruptOnce(executor.output)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    executor.output = executor.output.sock
    again = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in ref_greedy]
    # a worker that raises ends the engine: the error names the rank, every worker goes
    with pytest.raises(EngineDeadError, match="rank 0 raised in execute_model"):
        llm.engine.engine_core.executor.execute_model("not a SchedulerOutput")
    assert not wait_gone(pids)
    with pytest.raises(EngineDeadError):             # and it stays dead
        llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)


def test_tp2_preemption_prefix_caching_async(tp_model_dir):
    """A pool too small for the batch (preemption by swap, and by recompute when the
    small CPU pool is full), a shared prefix (prefix-cache hits), n=3 forks
    (copy-on-write), structured outputs (every rank samples with the same token masks)
    and async scheduling, at tp=2: the same ids as tp=1 with a roomy pool."""
    prefix = list(range(40, 60))
    prompts = [prefix + [i, i + 1] for i in range(3, 9)]
    free = SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=20, ignore_eos=True)
    date = SamplingParams(temperature=0.8, seed=4, n=3, max_tokens=20,
                          structured_outputs=StructuredOutputsParams(regex="[0-9]{4}-[0-9]{2}-[0-9]{2}"))
    params = [free, date] * 3

    def run(llm):       # the first prompt alone, then all: the batch hits its cached prefix
        return [[c.token_ids for c in o.outputs] for batch, ps in ((prompts[:1], params[:1]), (prompts, params))
                for o in llm.generate(batch, ps, use_tqdm=False)]

    expected = run(LLM(str(tp_model_dir), num_gpu_blocks=256, block_size=4, preemption_mode="recompute",
                       dtype="float32"))
    llm = LLM(str(tp_model_dir), num_gpu_blocks=40, num_cpu_blocks=20, block_size=4, tensor_parallel_size=2,
              preemption_mode="swap", async_scheduling=True, dtype="float32")
    assert run(llm) == expected
    stats = llm.engine.get_stats()
    assert stats["num_preemptions_swap"] > 0 and stats["num_preemptions_recompute"] > 0
    assert stats["prefix_cache_hits"] > 0 and stats["num_copy_on_write"] > 0
    assert stats["num_free_gpu_blocks"] == 40
    llm.shutdown()


def test_tp2_in_bf16_is_deterministic_and_batch_invariant(tp_model_dir):
    """In bfloat16, tp=2 need not equal tp=1 bit for bit: its all-reduce adds the two
    ranks' bf16 partial sums of o_proj and down_proj (rounded to bf16 each) where tp=1
    sums the whole dot product in fp32 (chapter 17). It is a function of the request all
    the same: a prompt's per-step logprobs are equal as floats alone, in a batch, and run
    again."""
    llm = LLM(str(tp_model_dir), num_gpu_blocks=64, block_size=4, tensor_parallel_size=2, dtype="bfloat16",
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)

    def target(prompts):
        out = llm.generate(prompts, params, use_tqdm=False)[prompts.index(PROMPTS[2])].outputs[0]
        return out.token_ids, out.logprobs
    alone = target([PROMPTS[2]])
    assert target(PROMPTS) == alone
    assert target([PROMPTS[2], PROMPTS[0]]) == alone
    assert target([PROMPTS[2]]) == alone
    llm.shutdown()


@pytest.mark.parametrize("sig, error", [
    (signal.SIGKILL, "rank 1 .* died: killed by SIGKILL"),
    (signal.SIGSTOP, "rank 0 raised in execute_model"),       # rank 0's all-reduce times out
])
def test_dead_or_stuck_worker_ends_the_engine(tp_model_dir, monkeypatch, sig, error):
    """Rank 1 killed (SIGKILL) or stuck (SIGSTOP) mid-run: a step raises EngineDeadError
    within seconds, naming the rank, and every worker is gone (SIGKILL reaches a stopped
    process too). A stuck rank surfaces through the collective timeout, 3 s here
    (NANOPAGED_COLLECTIVE_TIMEOUT_S), instead of a hang."""
    monkeypatch.setenv("NANOPAGED_COLLECTIVE_TIMEOUT_S", "3")     # read by each worker process
    llm = LLM(str(tp_model_dir), num_gpu_blocks=64, block_size=4, tensor_parallel_size=2,
              preemption_mode="recompute")
    eng, pids = llm.engine, worker_pids(llm)
    for i, p in enumerate(PROMPTS):
        eng.add_request(str(i), p, SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(3):
        eng.step()
    os.kill(pids[1], sig)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match=error):
        for _ in range(1000):
            eng.step()
    assert time.monotonic() - start < 30
    assert not wait_gone(pids)
    with pytest.raises(EngineDeadError):             # and it stays dead
        eng.step()


def test_del_and_interpreter_exit_leave_no_worker(tp_model_dir, tmp_path):
    llm = LLM(str(tp_model_dir), num_gpu_blocks=64, block_size=4, tensor_parallel_size=2,
              preemption_mode="recompute")
    pids = worker_pids(llm)
    llm.generate("Hello", SamplingParams(max_tokens=4), use_tqdm=False)
    del llm
    gc.collect()
    assert not wait_gone(pids)

    script = tmp_path / "no_main_guard.py"        # a plain script, no __main__ guard, no shutdown
    script.write_text(
        "from nanopaged import LLM, SamplingParams\n"
        f"llm = LLM({str(tp_model_dir)!r}, num_gpu_blocks=64, block_size=4, tensor_parallel_size=2,"
        " preemption_mode='recompute')\n"
        "print([p.pid for p in llm.engine.engine_core.executor.procs], flush=True)\n"
        "print(llm.generate('Hello', SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    pids = json.loads(out.stdout.splitlines()[0])
    assert len(pids) == 2 and not wait_gone(pids)


def test_torchrun_external_launcher(tp_model_dir, tp1_reference, tmp_path):
    """torchrun starts two copies of a script; each runs the whole engine with one rank
    (distributed_executor_backend="external_launcher"); both print tp=1's ids."""
    script = tmp_path / "tp_script.py"
    script.write_text(
        "import json, os\n"
        "from nanopaged import LLM, SamplingParams\n"
        f"llm = LLM({str(tp_model_dir)!r}, num_gpu_blocks=64, block_size=4, tensor_parallel_size=2,\n"
        "          distributed_executor_backend='external_launcher', dtype='float32')\n"
        f"outs = llm.generate({PROMPTS!r}, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)\n"
        f"path = os.path.join({str(tmp_path)!r}, 'rank' + os.environ['RANK'] + '.json')\n"
        "with open(path, 'w') as f:\n"
        "    json.dump([o.outputs[0].token_ids for o in outs], f)\n")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    expected = [o.outputs[0].token_ids for o in tp1_reference[0]]
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == expected


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two CUDA devices")
def test_nccl_tp2_equals_tp1(tp_model_dir):
    kw = dict(num_gpu_blocks=64, block_size=4, device="cuda", dtype="float32")
    ref = LLM(str(tp_model_dir), **kw).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    llm = LLM(str(tp_model_dir), tensor_parallel_size=2, **kw)
    got = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    llm.shutdown()


def test_tp2_speculative_decoding_equals_tp1(tp_model_dir, tp1_reference, tmp_path):
    """Speculative decoding at tp=2: every rank verifies with the same rejection sampler
    and proposes the same drafts (n-gram; a draft model, itself split over the ranks, here
    the target as its own draft so every draft is accepted): greedy ids equal tp=1's."""
    spec = [{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2},
            {"method": "draft_model", "model": str(tp_model_dir), "num_speculative_tokens": 3}]
    ref = [o.outputs[0].token_ids for o in tp1_reference[0]]
    for config in spec:
        llm = LLM(str(tp_model_dir), num_gpu_blocks=64, block_size=4, tensor_parallel_size=2, dtype="float32",
                  speculative_config=config)
        out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == ref, config["method"]
        stats = llm.engine.get_stats()
        assert stats["spec_decode_num_draft_tokens"] > 0 and stats["num_free_gpu_blocks"] == 64
        llm.shutdown()
