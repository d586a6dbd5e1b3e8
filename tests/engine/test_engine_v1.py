"""The v1 split on a tiny random Llama: what crosses each boundary, who changes blocks,
when a block enters the prefix cache, and the sampling front end (stop strings, output
kinds, logprobs, penalties) through the whole engine. Fast; the real-model field cases
are in test_engine_v1_real.py."""
import ast
import pickle
from pathlib import Path

import pytest
import torch

from nanopaged import LLM, BeamSearchParams, EngineConfig, LLMEngine, SamplingParams
from nanopaged.messages import CachedRequestData, SchedulerOutput
from nanopaged.sampling_params import RequestOutputKind

from invariants import run_checked
from logit_bounds import transformers_logprob_bounds

pytestmark = pytest.mark.exactness

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def engine(folder, **kw) -> LLMEngine:
    kw.setdefault("num_gpu_blocks", 64)
    kw.setdefault("block_size", 4)
    kw.setdefault("dtype", "float32")
    return LLMEngine(EngineConfig(model=str(folder), **kw))


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            names.add((node.module or "").split(".")[-1])
        elif isinstance(node, ast.Import):
            names.update(a.name.split(".")[-1] for a in node.names)
    return names


# -- the boundaries -----------------------------------------------------------------------

@pytest.mark.parametrize("module", ["worker/model_runner.py", "worker/sampler.py", "layers/attention.py",
                                    "model/llama.py"])
def test_the_execution_layer_never_imports_the_schedulers_objects(module):
    assert not imported_modules(ROOT / "nanopaged" / module) & {"sequence", "block_manager", "scheduler",
                                                                "block_table", "engine_core"}


def test_the_core_never_imports_a_tokenizer_or_strings_code():
    for module in ["engine/engine_core.py", "core/scheduler.py", "core/block_manager.py", "core/sequence.py"]:
        assert not imported_modules(ROOT / "nanopaged" / module) & {"transformers", "tokenizers", "detokenizer",
                                                                    "output_processor", "processor"}


def test_scheduler_output_sends_a_sequence_in_full_once_then_deltas(tiny_model_dir):
    eng = engine(tiny_model_dir)
    eng.add_request("a", list(range(1, 8)), GREEDY)                 # 7 tokens: blocks of 4
    seq = eng.requests["a"].seqs[0]
    first = eng.scheduler.schedule()
    (new,) = first.scheduled_new_reqs
    assert (new.seq_id, new.prompt_token_ids, new.output_token_ids) == (seq.seq_id, list(range(1, 8)), [])
    assert new.block_ids == seq.block_table.block_ids and len(new.block_ids) == 2
    assert first.num_scheduled_tokens == {seq.seq_id: 7} and first.scheduled_cached_reqs == CachedRequestData()
    eng.scheduler.update_from_output(first, eng.model_runner.execute_model(first))
    second = eng.scheduler.schedule()                                # decode position 7: fills block 1
    c = second.scheduled_cached_reqs
    assert not second.scheduled_new_reqs and c.seq_ids == [seq.seq_id]
    assert c.new_token_ids == [seq.output_token_ids] and c.new_block_ids == [[]] and c.num_computed_tokens == [7]
    eng.scheduler.update_from_output(second, eng.model_runner.execute_model(second))
    third = eng.scheduler.schedule()                                 # position 8 needs a third block
    assert third.scheduled_cached_reqs.new_block_ids == [[seq.block_table.block_ids[2]]]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_scheduler_output_survives_a_pickle_round_trip(tiny_model_dir, async_scheduling):
    """The runner needs nothing but the message: fed a pickled copy of every
    SchedulerOutput (as a worker in another process would be), the engine gives the
    same tokens, under preemption by swap and with n > 1 and beams."""
    def run(pickled):
        eng = engine(tiny_model_dir, num_gpu_blocks=10, num_cpu_blocks=64, preemption_mode="swap", seed=3,
                     async_scheduling=async_scheduling)
        if pickled:
            execute = eng.model_runner.execute_model
            eng.model_runner.execute_model = lambda so: execute(pickle.loads(pickle.dumps(so)))
        eng.add_request("a", list(range(1, 12)), SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=9))
        eng.add_request("b", list(range(20, 30)), GREEDY)
        eng.add_request("c", list(range(40, 45)), BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True))
        outs = run_checked(eng)
        assert eng.get_stats()["num_preemptions"] > 0
        return {rid: [c.token_ids for c in o.outputs] for rid, o in outs.items()}

    assert run(pickled=True) == run(pickled=False)


def test_a_block_enters_the_prefix_cache_only_after_its_forward(tiny_model_dir):
    eng = engine(tiny_model_dir)
    eng.add_request("a", list(range(1, 10)), GREEDY)                 # 2 full blocks + 1 token
    so = eng.scheduler.schedule()
    assert not eng.block_manager.cached_blocks                       # slots given, K/V not yet written
    eng.scheduler.update_from_output(so, eng.model_runner.execute_model(so))
    assert len(eng.block_manager.cached_blocks) == 2


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("layer", [0, 1])
def test_c39_an_interrupted_forward_leaves_no_named_block(tiny_model_dir, layer, async_scheduling):
    prompt = list(range(100, 117))                                   # 17 tokens: 4 full blocks of 4
    fresh = LLM(str(tiny_model_dir), num_gpu_blocks=64, block_size=4, dtype="float32").generate(prompt, GREEDY)[0]
    llm = LLM(str(tiny_model_dir), num_gpu_blocks=64, block_size=4, dtype="float32", async_scheduling=async_scheduling)
    target = llm.engine.model_runner.model.layers[layer]
    forward = target.forward

    def interrupted(*a, **k):
        target.forward = forward                                     # only once
        raise KeyboardInterrupt

    target.forward = interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompt, GREEDY)
    assert not llm.engine.block_manager.cached_blocks and not llm.engine.has_unfinished_requests()
    assert llm.engine.get_stats()["num_free_gpu_blocks"] == 64
    assert llm.generate(prompt, GREEDY)[0].outputs[0].token_ids == fresh.outputs[0].token_ids


# -- the sampling front end through the engine ------------------------------------------

def test_stop_string_cuts_the_text_and_stops_only_its_sequence(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_gpu_blocks=64, block_size=4, dtype="float32")
    base = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    stop = base.text[3:6]
    assert len(stop) == 3 and base.text.find(stop) == 3
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=stop))[0]
    c = out.outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == (base.text[:3], "stop", stop)
    kept = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop],
                                                include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == base.text[:6]
    assert llm.engine.get_stats()["num_free_gpu_blocks"] == 64 and not llm.engine.requests


def test_delta_outputs_concatenate_to_the_final_text(tiny_model_dir):
    eng = engine(tiny_model_dir)
    base = LLM(str(tiny_model_dir), num_gpu_blocks=64, block_size=4, dtype="float32").generate(
        "The capital", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    stop = base.text[5:8]
    for kind in RequestOutputKind:
        eng.add_request(kind.name, "The capital", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                                stop=stop, output_kind=kind))
    seen = {k.name: [] for k in RequestOutputKind}
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen[out.request_id].append(out)
    final = base.text[:base.text.find(stop)]
    assert "".join(o.outputs[0].text for o in seen["DELTA"] if o.outputs) == final
    assert all(stop[0] not in o.outputs[0].text or stop not in final + o.outputs[0].text
               for o in seen["DELTA"] if o.outputs)
    assert seen["CUMULATIVE"][-1].outputs[0].text == final and len(seen["CUMULATIVE"]) > 1
    assert [o.outputs[0].text for o in seen["FINAL_ONLY"]] == [final] and seen["FINAL_ONLY"][0].finished


def test_logprobs_equal_transformers_log_softmax(tiny_model_dir, tiny_hf_model):
    """Sample and prompt logprobs are the raw log_softmax of the model's logits (vLLM's
    default logprobs_mode), with and without a prefix-cache hit (C40 on the tiny model)."""
    llm = LLM(str(tiny_model_dir), num_gpu_blocks=64, block_size=4, dtype="float32")
    prompt = list(range(60, 80))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    first, again = (llm.generate(prompt, params)[0] for _ in range(2))
    ids = prompt + first.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(tiny_hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    # both fp32, other orders: a row's logprobs within logit_bounds' bound (K = 128, V = 320);
    # measured at most 0.023 of it
    bound = transformers_logprob_bounds(tiny_hf_model, ids).tolist()
    for out in (first, again):
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for pos, d in enumerate(out.prompt_logprobs[1:], start=1):
            assert prompt[pos] in d and len(d) <= 2
            assert abs(d[prompt[pos]].logprob - ref[pos - 1, prompt[pos]].item()) <= bound[pos - 1]
        c = out.outputs[0]
        assert len(c.logprobs) == 4
        total = 0.0                         # the engine adds each step's logprob to a running sum
        for j, (tok, d) in enumerate(zip(c.token_ids, c.logprobs)):
            row = ref[len(prompt) - 1 + j]
            assert tok in d and d[tok].rank == 1 and len(d) == 2 + (tok not in row.topk(2).indices.tolist())
            for t, lp in d.items():
                assert abs(lp.logprob - row[t].item()) <= bound[len(prompt) - 1 + j]
            total += d[tok].logprob
        assert c.cumulative_logprob == total
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in first.outputs]
    # sample logprobs alone do read the cache: the hit run's logprobs equal the miss run's
    sample_only = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    hits = llm.engine.get_stats()["prefix_cache_hits"]
    hit = llm.generate(prompt, sample_only)[0].outputs[0]
    assert llm.engine.get_stats()["prefix_cache_hits"] - hits == 16           # 4 full blocks of 4
    for j, (tok, d) in enumerate(zip(hit.token_ids, hit.logprobs)):
        assert abs(d[tok].logprob - ref[len(prompt) - 1 + j, tok].item()) <= bound[len(prompt) - 1 + j]


def test_repetition_penalty_equals_transformers(tiny_model_dir, tiny_hf_model):
    llm = LLM(str(tiny_model_dir), num_gpu_blocks=64, block_size=4, dtype="float32")
    prompt = [7, 8, 9, 7, 8, 9, 7, 8]
    ours = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                               repetition_penalty=1.5))[0].outputs[0].token_ids
    x = torch.tensor([prompt])
    with torch.no_grad():
        ref = tiny_hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=10, do_sample=False,
                                     repetition_penalty=1.5, eos_token_id=None, pad_token_id=0)
    assert ours == ref[0, len(prompt):].tolist()


def test_penalised_request_does_not_depend_on_its_batch(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_gpu_blocks=64, block_size=4, dtype="float32")
    pen = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=2.0,
                         presence_penalty=0.5, frequency_penalty=0.5)
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    a, b = [5, 6, 7, 5, 6], [30, 31, 32]
    alone = llm.generate(a, pen)[0].outputs[0].token_ids
    first = llm.generate([a, b], [pen, plain])
    second = llm.generate([b, a], [plain, pen])
    assert first[0].outputs[0].token_ids == second[1].outputs[0].token_ids == alone
    assert first[1].outputs[0].token_ids == second[0].outputs[0].token_ids == llm.generate(b, plain)[0].outputs[0].token_ids


def test_max_tokens_none_runs_to_max_model_len(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_gpu_blocks=64, block_size=4, dtype="float32", max_model_len=24)
    c = llm.generate(list(range(1, 11)), SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0].outputs[0]
    assert len(c.token_ids) == 14 and c.finish_reason == "length"


def test_min_tokens_holds_back_eos_and_stop_ids(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_gpu_blocks=64, block_size=4, dtype="float32")
    base = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    stop_id = base.token_ids[1]
    early = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id]))[0]
    late = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id],
                                                min_tokens=5))[0]
    assert early.outputs[0].token_ids == base.token_ids[:2] and early.outputs[0].stop_reason == stop_id
    assert len(late.outputs[0].token_ids) >= 5 and stop_id not in late.outputs[0].token_ids[:4]


def test_bad_sampling_fields_for_this_model_are_named(tiny_model_dir):
    eng = engine(tiny_model_dir)
    for params, match in [(SamplingParams(stop_token_ids=[320]), "stop_token_ids"),
                          (SamplingParams(logit_bias={999: 1.0}), "logit_bias"),
                          (SamplingParams(allowed_token_ids=[5, 400]), "allowed_token_ids"),
                          (SamplingParams(logprobs=21), "logprobs")]:
        with pytest.raises(ValueError, match=match):
            eng.add_request("x", "Hello", params)
    assert not eng.requests
    eng.add_request("ok", "Hello", GREEDY)
    assert run_checked(eng)["ok"].finished


def test_c24s_beam_scores_are_length_penalised_and_ordered(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_gpu_blocks=64, block_size=4, dtype="float32")
    for penalty in (1.0, 2.0):
        (out,) = llm.beam_search([list(range(10, 16))], BeamSearchParams(beam_width=3, max_tokens=4,
                                                                         length_penalty=penalty))
        seqs = out.sequences
        assert len(seqs) == 3
        for s in seqs:
            gen = len(s.tokens) - 6
            assert s.score == pytest.approx(s.cum_logprob / gen ** penalty) and s.score != 0.0
        assert [s.score for s in seqs] == sorted((s.score for s in seqs), reverse=True)
