"""The tensor-parallel benchmark (`python bench.py --sections tp`;
chapters/17-tensor-parallelism.md), in one run on this machine:

    throughput   tp=1 vs tp=2 on a random Llama whose heads split in two (SmolLM2-135M's
                 width with 8 heads / 4 KV heads), and tp=1 vs tp=3 on SmolLM2-135M
                 itself (9 heads / 3 KV heads: 2 does not divide 9): tokens/s
    where time   for each tp > 1 run, as shares of the timed generate's wall time: per
    goes         rank, the collectives (all-reduce, all-gather; the time inside the call,
                 which includes waiting for the slowest rank to arrive) and the control
                 message (engine send -> message unpickled on the rank); and the engine's
                 pickling and pushing of it
    transport    our pyzmq push of the pickled SchedulerOutput to every rank vs a
                 torch.distributed broadcast_object_list of the same message over the
                 ranks' process group (rank 0 -> all, what a driver rank would do): the
                 message is a real decode step's, kept as the run passes it to the
                 executor; microseconds per step, rank mean

The workload (fixed seed): 8 requests with random token-id prompts of U[32, 64] tokens,
32 output tokens each, greedy, ignore_eos, fp32. Each engine gets a warm-up generate
first and is shut down (its worker processes ended) before the next one starts.
"""
from __future__ import annotations

import os
import pickle
import statistics
import tempfile
import time

import torch

NUM_REQUESTS, MAX_TOKENS, BROADCAST_ITERS = 8, 32, 50


def make_even_llama(folder, tokenizer_folder) -> str:
    """A random Llama with SmolLM2-135M's hidden and intermediate sizes but 8 heads /
    4 KV heads (so tp=2 and tp=4 split it), 8 layers, a 4096-token vocabulary, saved
    with transformers in `folder` (the tokenizer copied from `tokenizer_folder`: the
    bench sends token ids, it only detokenizes)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=576, intermediate_size=1536, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                         max_position_embeddings=2048, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_folder).save_pretrained(folder)
    return str(folder)


def machine() -> str:
    """CPU model and cores, as /proc/cpuinfo and the affinity mask say, and the load
    average, with a warning when it is already at the number of cores (another job
    runs: every figure of this run is slowed, often several times over)."""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        model = "?"
    cores, load = len(os.sched_getaffinity(0)), os.getloadavg()
    busy = (" (BUSY: the load average is at the cores already; another job runs and every figure "
            "below is slowed; docs/tests.md: OMP_NUM_THREADS=1 on a busy machine)") if load[0] >= cores else ""
    return f"{model}, {cores} cores, load average {' '.join(f'{x:.1f}' for x in load)} at start{busy}"


def _diff(after: list[dict], before: list[dict]) -> list[dict]:
    return [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]


def run_tp(model: str, tp_size: int, prompts: list[list[int]]) -> dict:
    """One engine at tp_size: the timed generate's tokens/s and outputs; for tp > 1 the
    per-rank stats over it, the engine's send seconds and the broadcast comparison."""
    from nanopaged import LLM, SamplingParams

    llm = LLM(model, dtype="float32", tensor_parallel_size=tp_size, num_gpu_blocks=256, num_cpu_blocks=0,
              preemption_mode="recompute")
    try:
        core = llm.engine.engine_core
        executor, seen = core.executor, {"calls": 0, "decode": None}
        execute = executor.execute_model

        def keep_decode_step(scheduler_output):
            """Count the steps; keep the widest pure decode step's message."""
            seen["calls"] += 1
            tokens, widest = scheduler_output.num_scheduled_tokens, seen["decode"]
            decode = not scheduler_output.scheduled_new_reqs and tokens and set(tokens.values()) == {1}
            if decode and (widest is None or len(tokens) >= len(widest.num_scheduled_tokens)):
                seen["decode"] = scheduler_output
            return execute(scheduler_output)

        executor.execute_model = keep_decode_step
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)       # warm-up
        seen["calls"] = 0
        before, send_before = executor.get_comm_stats(), getattr(executor, "send_seconds", 0.0)
        start = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)
        wall = time.perf_counter() - start
        # the stats rpc's own message comes after the timed run: recv_seconds counts steps + 1
        stats = _diff(executor.get_comm_stats(), before)
        send = getattr(executor, "send_seconds", 0.0) - send_before
        outputs = [o.outputs[0].token_ids for o in outs]
        result = dict(wall=wall, tokens=sum(map(len, outputs)), steps=seen["calls"], outputs=outputs,
                      stats=stats, send=send, message=seen["decode"],
                      kv_bytes=executor.collective_rpc("kv_cache_bytes_per_block"))
        if tp_size > 1:
            result["broadcast"] = executor.collective_rpc("time_group_broadcast", (seen["decode"], BROADCAST_ITERS))
        return result
    finally:
        llm.shutdown()


def report(name: str, tp_size: int, base: dict, r: dict) -> None:
    rate, base_rate = r["tokens"] / r["wall"], base["tokens"] / base["wall"]
    print(f"  tp={tp_size}: {rate:7.1f} tok/s ({r['tokens']} tokens in {r['wall']:.1f} s, {r['steps']} steps), "
          f"{rate / base_rate:.2f}x tp=1; same greedy tokens as tp=1: {r['outputs'] == base['outputs']}; "
          f"KV bytes a block, per rank: {r['kv_bytes']}")
    stats, wall = r["stats"], r["wall"]
    pct = lambda key: " / ".join(f"{100 * s[key] / wall:.1f}%" for s in stats)     # noqa: E731
    print(f"    share of the generate, rank 0 / 1 / ...: collectives {pct('comm_seconds')} "
          f"({int(stats[0]['num_collectives'])} calls a rank), control message {pct('recv_seconds')}, "
          f"in execute_model {pct('execute_seconds')}; engine-side send (pickle + push) "
          f"{100 * r['send'] / wall:.1f}% ({1e6 * r['send'] / r['steps']:.0f} us a step)")
    push_us = 1e6 * statistics.mean(s["recv_seconds"] for s in stats) / (r["steps"] + 1)
    bcast_us = 1e6 * statistics.mean(r["broadcast"])
    size = len(pickle.dumps(r["message"], protocol=pickle.HIGHEST_PROTOCOL))
    print(f"    control message ({name}: a decode step of {len(r['message'].num_scheduled_tokens)} sequences, "
          f"{size} bytes pickled): pyzmq push {push_us:.0f} us a step (send -> unpickled, rank mean over "
          f"{r['steps']} steps) vs group broadcast_object_list {bcast_us:.0f} us (rank mean of "
          f"{BROADCAST_ITERS}; per rank {' / '.join(f'{1e6 * b:.0f}' for b in r['broadcast'])}): "
          f"{'push' if push_us < bcast_us else 'broadcast'} is cheaper by {max(push_us, bcast_us) / min(push_us, bcast_us):.1f}x")


def bench_tp() -> None:
    """tp=1 vs tp=2 (a random even-headed Llama) and tp=1 vs tp=3 (SmolLM2-135M)."""
    import random

    from nanopaged.model.model_loader import ensure_default_model

    smollm2 = str(ensure_default_model(progress=False))
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 4096) for _ in range(rng.randint(32, 64))] for _ in range(NUM_REQUESTS)]
    per_rank = {tp: os.environ.get("OMP_NUM_THREADS") or max(1, len(os.sched_getaffinity(0)) // tp) for tp in (2, 3)}
    print(f"tp: {machine()}; torch threads: tp=1 {torch.get_num_threads()}, per rank at tp=2 {per_rank[2]}, "
          f"tp=3 {per_rank[3]}; gloo over loopback; fp32; {NUM_REQUESTS} requests, prompts U[32, 64] "
          f"({sum(map(len, prompts))} tokens), {MAX_TOKENS} output tokens each, greedy, ignore_eos")
    with tempfile.TemporaryDirectory(prefix="nanopaged-tp-bench-") as folder:
        cases = [("random Llama, hidden 576, 8 heads / 4 KV heads x 64, intermediate 1536, 8 layers, "
                  "vocab 4096", make_even_llama(folder, smollm2), 2),
                 ("SmolLM2-135M-Instruct, 9 heads / 3 KV heads x 64, intermediate 1536, 30 layers, "
                  "vocab 49152", smollm2, 3)]
        for name, model, tp_size in cases:
            print(name + ":")
            base = run_tp(model, 1, prompts)
            print(f"  tp=1: {base['tokens'] / base['wall']:7.1f} tok/s ({base['tokens']} tokens in "
                  f"{base['wall']:.1f} s, {base['steps']} steps); KV bytes a block: {base['kv_bytes'][0]}")
            report(name.split(",")[0], tp_size, base, run_tp(model, tp_size, prompts))
