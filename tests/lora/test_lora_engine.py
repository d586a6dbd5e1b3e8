"""Multi-LoRA serving end to end on the tiny Llama, with adapters made by peft
(conftest.py here).

Close: in float32 each adapter's greedy ids are transformers + peft's token for token,
its logprobs within a bound derived from the reductions' lengths (tests/logit_bounds.py).
Equal, bit for bit (ids and logprobs): a batch whose rows run three adapters and none
gives each row what it gets alone, and the same again under chunked prefill, prefix-cache
hits, preemption by swap and by recompute, n > 1, async scheduling, fewer slots than
adapters, CPU-graph replay against eager steps, and two pipeline stages. The prefix
cache is keyed by adapter.
"""
from __future__ import annotations

import pytest
import torch
from logit_bounds import logprobs_bound, logits_bound, longest_reduction
from peft_adapters import fresh_llama, lora_adapters  # noqa: F401 (a fixture)

from nanopaged import LLM, LoRARequest, SamplingParams
from nanopaged.events import SequenceScheduled, WaitingForLoRASlot

pytestmark = [pytest.mark.exactness, pytest.mark.timeout(600)]

PROMPTS = [list(range(5, 14)), list(range(40, 61)), list(range(100, 113)), list(range(200, 230))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
PAIRS = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, logprobs=2)
# (prompt, adapter or None, params): three adapters and the base, a prompt under two of them
ROWS = [(0, "attn", GREEDY), (0, None, GREEDY), (1, "mlp", GREEDY), (2, "all", PAIRS), (1, "attn", GREEDY),
        (3, None, GREEDY), (3, "all", GREEDY)]


def engine(model_dir, **kw) -> LLM:
    """float32 on the C++ kernels, a budget of 16 tokens (prompts are chunked), 3 slots."""
    kw = dict(block_size=4, dtype="float32", attention_backend="cpu", num_gpu_blocks=256, max_num_batched_tokens=16,
              max_num_seqs=8, enable_lora=True, max_loras=3) | kw
    return LLM(str(model_dir), **kw)


def outputs(llm, rows, adapters):
    """[(token ids, logprobs) per completion] per row, all rows in one batch."""
    outs = llm.generate([PROMPTS[p] for p, _, _ in rows], [params for _, _, params in rows], use_tqdm=False,
                        lora_request=[adapters[a] if a else None for _, a, _ in rows])
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_model_dir, lora_adapters):
    """Each row alone, in a fresh engine without prefix caching (nothing to hit)."""
    llm = engine(tiny_model_dir, enable_prefix_caching=False)
    alone = [outputs(llm, [row], lora_adapters)[0] for row in ROWS]
    llm.shutdown()
    return alone


@pytest.fixture(scope="module")
def default_engine(tiny_model_dir):
    llm = engine(tiny_model_dir)
    yield llm
    llm.shutdown()


def test_each_adapter_changes_the_base_models_ids(reference):
    base = reference[1][0][0]
    assert reference[0][0][0] != base                                  # the same prompt under "attn"
    assert reference[6][0][0] != reference[5][0][0]                    # under "all"
    assert reference[4][0][0] != reference[2][0][0]                    # one prompt, two adapters


def test_rows_without_an_adapter_are_the_base_engines_bit_for_bit(tiny_model_dir, lora_adapters, reference):
    base = LLM(str(tiny_model_dir), block_size=4, dtype="float32", attention_backend="cpu", num_gpu_blocks=256,
               max_num_batched_tokens=16, max_num_seqs=8)
    rows = [row for row in ROWS if row[1] is None]
    assert outputs(base, rows, lora_adapters) == [out for row, out in zip(ROWS, reference) if row[1] is None]
    base.shutdown()


def test_the_pytorch_reference_backend_gives_the_kernels_greedy_ids(tiny_model_dir, lora_adapters, reference):
    """attention_backend="torch": every op, the LoRA halves too (punica.py), in PyTorch;
    another order of additions (close, not equal), the same greedy ids on this model."""
    llm = engine(tiny_model_dir, attention_backend="torch")
    rows = [row for row in ROWS if row[2] is GREEDY]
    assert [[c[0] for c in out] for out in outputs(llm, rows, lora_adapters)] == [
        [c[0] for c in out] for row, out in zip(ROWS, reference) if row[2] is GREEDY]
    llm.shutdown()


def test_greedy_ids_equal_transformers_peft_and_logprobs_are_close(tiny_model_dir, lora_adapters, default_engine):
    """float32 both sides. The adapter adds to each projection a second sum over the
    same inputs (its in features, at most K terms) then one of r terms and the add: at
    most K + r + 2 roundings per term, so logits_bound's budget of K + 1 roundings per
    head term is charged with K' = K + r + 1 (r = max_lora_rank), then logprobs_bound."""
    from peft import PeftModel

    prompt = PROMPTS[1]
    for name, lora in lora_adapters.items():
        hf = PeftModel.from_pretrained(fresh_llama(tiny_model_dir), lora.lora_path).eval()
        with torch.no_grad():
            g = hf.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones_like(torch.tensor([prompt])),
                            do_sample=False, max_new_tokens=10, output_logits=True, return_dict_in_generate=True,
                            pad_token_id=0, eos_token_id=None)
        want = g.sequences[0, len(prompt):].tolist()
        out = default_engine.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0].outputs[0]
        base = default_engine.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
        assert out.token_ids != base.token_ids, name
        assert out.token_ids == want, name
        tokens = prompt + want
        inner = hf.base_model.model                   # the Llama with peft's layers in it
        k = longest_reduction(inner.config, len(tokens)) + default_engine.engine.config.lora_config.max_lora_rank + 1
        with torch.no_grad():
            logits = inner(torch.tensor([tokens])).logits[0]
        bound = logprobs_bound(logits_bound(inner, tokens, k), logits)[len(prompt) - 1:-1, 0]
        theirs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(g.logits, want)]
        ours = [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]
        for i, (a, b, limit) in enumerate(zip(ours, theirs, bound.tolist())):
            assert abs(a - b) <= limit, (name, i, a, b, limit)


def test_a_batch_over_three_adapters_equals_each_row_alone_and_hits_equal_misses(
        default_engine, lora_adapters, reference):
    """Chunked prefill (a budget of 16 tokens), n = 2, CPU graphs; then the same batch
    again, every prompt now a prefix-cache hit."""
    assert outputs(default_engine, ROWS, lora_adapters) == reference
    hits = default_engine.engine.get_stats()["prefix_cache_hits"]
    assert outputs(default_engine, ROWS, lora_adapters) == reference
    assert default_engine.engine.get_stats()["prefix_cache_hits"] > hits


def test_a_cpu_graph_replay_equals_the_eager_step_with_adapters_in_the_batch(tiny_model_dir, lora_adapters,
                                                                         default_engine, reference):
    runner = default_engine.engine.model_runner
    assert any(g is not None for g in runner.graphs.values()), "no decode step replayed a graph"
    eager = engine(tiny_model_dir, enforce_eager=True)
    assert not hasattr(eager.engine.model_runner, "graphs")
    assert outputs(eager, ROWS, lora_adapters) == reference
    eager.shutdown()


@pytest.mark.parametrize("kw", [
    dict(preemption_mode="swap", num_gpu_blocks=24, num_cpu_blocks=128, async_scheduling=True),
    dict(preemption_mode="recompute", num_gpu_blocks=24, max_loras=2),
], ids=["swap-async", "recompute-two-slots"])
def test_preemption_async_scheduling_and_fewer_slots_change_no_row(tiny_model_dir, lora_adapters, reference, kw):
    llm = engine(tiny_model_dir, **kw)
    assert outputs(llm, ROWS, lora_adapters) == reference
    stats = llm.engine.get_stats()
    assert stats[f"num_preemptions_{kw['preemption_mode']}"] > 0, stats
    llm.shutdown()


def test_two_pipeline_stages_give_the_same_rows(tiny_model_dir, lora_adapters, reference):
    llm = engine(tiny_model_dir, pipeline_parallel_size=2, distributed_executor_backend="mp")
    try:
        assert outputs(llm, ROWS, lora_adapters) == reference
    finally:
        llm.shutdown()


def test_the_prefix_cache_is_keyed_by_adapter(default_engine, lora_adapters):
    prompt = list(range(260, 290))                    # 7 full blocks of 4
    short = SamplingParams(temperature=0, max_tokens=2)
    cached = []
    for lora in ("attn", "mlp", None, "attn", "mlp", None):
        out = default_engine.generate([prompt], short, use_tqdm=False,
                                      lora_request=lora_adapters[lora] if lora else None)[0]
        cached.append(out.num_cached_tokens)
    assert cached == [0, 0, 0, 28, 28, 28]


def test_one_slot_and_three_adapters_admit_in_arrival_order(tiny_model_dir, lora_adapters):
    """max_loras=1: never two adapters in a step; everyone finishes; a request without an
    adapter runs at once; those with one first run in the order they came."""
    llm = engine(tiny_model_dir, max_loras=1)
    scheduler, events = llm.engine.scheduler, []
    llm.engine.add_observer(events.append)
    schedule, per_step = scheduler.schedule, []

    def watched():
        out = schedule()
        per_step.append({scheduler.slots[slot].lora_int_id for slot in out.lora_slots.values()})
        return out
    scheduler.schedule = watched
    names = ["attn", "mlp", "attn", "all", None, "mlp"]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([PROMPTS[0]] * len(names), params, use_tqdm=False,
                        lora_request=[lora_adapters[n] if n else None for n in names])
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    assert max(len(s) for s in per_step) == 1
    first = list(dict.fromkeys(e.request_id for e in events if isinstance(e, SequenceScheduled)))
    ids = [o.request_id for o in outs]
    assert first == [ids[0], ids[4], ids[1], ids[2], ids[3], ids[5]]
    assert any(isinstance(e, WaitingForLoRASlot) and e.request_id == ids[1] for e in events)
    llm.shutdown()


def test_reloading_a_slot_reads_the_host_cache_not_the_disk(tiny_model_dir, lora_adapters):
    """max_loras=1, max_cpu_loras=2: five requests one after another load the slot five
    times; the worker reads the disk only for adapters its two-entry LRU cache lost."""
    llm = engine(tiny_model_dir, max_loras=1, max_cpu_loras=2)
    for name in ("attn", "mlp", "attn", "all", "mlp"):
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=lora_adapters[name])
    assert llm.engine.scheduler.num_slot_loads == 5
    assert llm.engine.model_runner.num_disk_loads == 4          # attn came back from the cache
    assert list(llm.engine.model_runner.cpu_adapters) == [lora_adapters["all"].lora_int_id,
                                                          lora_adapters["mlp"].lora_int_id]
    llm.shutdown()


def test_async_llm_and_chat_take_an_adapter(tiny_model_dir, lora_adapters, reference, default_engine):
    """AsyncLLM (the core in a process of its own: the adapter crosses in the request)
    gives LLM's ids; LLM.chat takes one adapter per conversation."""
    import asyncio

    from nanopaged.engine.async_llm import AsyncLLM

    async def stream():
        llm = AsyncLLM(str(tiny_model_dir), block_size=4, dtype="float32", attention_backend="cpu",
                       num_gpu_blocks=256, enable_lora=True)
        try:
            out = None
            async for out in llm.generate(PROMPTS[0], GREEDY, "a", lora_request=lora_adapters["attn"]):
                pass
            return out.outputs[0].token_ids
        finally:
            llm.shutdown()
    assert asyncio.run(stream()) == reference[0][0][0]
    chat = [{"role": "user", "content": "Hello"}]
    outs = default_engine.chat([chat, chat], GREEDY, use_tqdm=False, lora_request=[lora_adapters["mlp"], None])
    ids = default_engine.get_tokenizer().apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    alone = default_engine.generate([ids], GREEDY, use_tqdm=False, lora_request=lora_adapters["mlp"])
    assert outs[0].outputs[0].token_ids == alone[0].outputs[0].token_ids != outs[1].outputs[0].token_ids


def test_bfloat16_rows_and_structured_outputs_with_an_adapter(tiny_model_dir, lora_adapters):
    """bfloat16 (the slots in the model's dtype): a batch equals its rows alone; a
    constrained request runs its adapter under its grammar."""
    from nanopaged import StructuredOutputsParams

    llm = engine(tiny_model_dir, dtype="bfloat16")
    rows = [(0, "attn", GREEDY), (0, None, GREEDY), (2, "all", GREEDY)]
    alone = [outputs(llm, [row], lora_adapters)[0] for row in rows]
    assert outputs(llm, rows, lora_adapters) == alone and alone[0] != alone[1]
    choice = SamplingParams(temperature=0, max_tokens=10,
                            structured_outputs=StructuredOutputsParams(choice=["Paris", "nanopaged"]))
    outs = llm.generate(["The capital"] * 2, choice, use_tqdm=False, lora_request=[lora_adapters["mlp"], None])
    assert all(o.outputs[0].text in ("Paris", "nanopaged") for o in outs)
    llm.shutdown()


@pytest.mark.parametrize("architecture", ["Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"])
def test_the_other_families_greedy_ids_equal_transformers_peft(tiny_family, tmp_path, architecture):
    """Qwen2's q/k/v biases, Qwen3's per-head norms after q_proj and k_proj (and head_dim
    32, not hidden / heads), Mistral: an adapter on every projection, as peft runs it."""
    from transformers import AutoModelForCausalLM

    from peft_adapters import ADAPTERS, make_adapter

    folder, _ = tiny_family(architecture)
    fresh = lambda: AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()   # noqa: E731
    hf = make_adapter(tmp_path, fresh(), seed=5, **ADAPTERS["all"]).eval()
    prompt = PROMPTS[2]
    with torch.no_grad():
        want = hf.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones_like(torch.tensor([prompt])),
                           do_sample=False, max_new_tokens=10, pad_token_id=0, eos_token_id=None)[0, len(prompt):]
    llm = engine(folder)
    got = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=LoRARequest("all", 1, str(tmp_path)))
    base = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want.tolist() != base[0].outputs[0].token_ids
    llm.shutdown()
