"""KV sharing on a tiny random Llama: prefix caching, copy-on-write, parallel sampling
and beam search. Real-model checks (field cases, HF beam parity) are in
test_kv_sharing_real.py."""
import pytest

from nanopaged import LLM, BeamSearchParams, EngineConfig, LLMEngine, SamplingParams
from nanopaged.core.block_manager import BlockManager
from nanopaged.core.sequence import Sequence

from invariants import run_checked

pytestmark = pytest.mark.exactness

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def engine(folder, **kw) -> LLMEngine:
    kw.setdefault("dtype", "float32")
    return LLMEngine(EngineConfig(model=str(folder), **kw))


def test_prefix_cache_hit_skips_the_cached_blocks(tiny_model_dir):
    eng = engine(tiny_model_dir, block_size=4, num_gpu_blocks=32)
    prefix = list(range(10, 22))                           # 3 full blocks
    eng.add_request("a", prefix + [1, 2], GREEDY)
    first = run_checked(eng)["a"].outputs[0].token_ids
    eng.add_request("b", prefix + [3, 4, 5], GREEDY)
    eng.step()
    b = eng.requests["b"].seqs[0]
    assert eng.get_stats()["prefix_cache_hits"] == 12      # the three prefix blocks
    assert b.num_computed_tokens == 15 + 1 - 1 and len(b.output_token_ids) == 1
    run_checked(eng)
    eng.add_request("a2", prefix + [1, 2], GREEDY)
    assert run_checked(eng)["a2"].outputs[0].token_ids == first


def test_fully_cached_prompt_still_computes_its_last_token(tiny_model_dir):
    eng = engine(tiny_model_dir, block_size=4, num_gpu_blocks=32)
    prompt = list(range(30, 38))                           # exactly 2 blocks
    eng.add_request("a", prompt, GREEDY)
    first = run_checked(eng)["a"].outputs[0].token_ids
    hits = eng.get_stats()["prefix_cache_hits"]
    eng.add_request("b", prompt, GREEDY)
    assert run_checked(eng)["b"].outputs[0].token_ids == first
    assert eng.get_stats()["prefix_cache_hits"] - hits <= len(prompt) - 1


def test_prefix_caching_never_changes_greedy_output(tiny_model_dir):
    system = list(range(50, 70))
    prompts = [system + [i, i + 1, i + 2] for i in range(1, 30, 4)]
    outs = {}
    for caching in (True, False):
        llm = LLM(str(tiny_model_dir), block_size=4, num_gpu_blocks=64, enable_prefix_caching=caching,
                  dtype="float32")
        outs[caching] = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        outs[caching] += [o.outputs[0].token_ids for o in llm.generate(prompts[::-1], GREEDY)][::-1]
    assert outs[True] == outs[False]


def test_fork_shares_blocks_and_copy_on_write_copies_the_partial_block():
    bm = BlockManager(num_gpu_blocks=8, block_size=4, enable_prefix_caching=False)
    parent, child = Sequence(0, 0, list(range(6)), 4), Sequence(1, 1, list(range(6)), 4)
    bm.append_slots([parent])                              # 6 tokens: blocks [a, b], b half full
    parent.num_computed_tokens = child.num_computed_tokens = 6       # (the scheduler's part)
    bm.fork(parent, child)
    assert child.block_table.block_ids == parent.block_table.block_ids
    assert [bm.ref_count[b] for b in parent.block_table.block_ids] == [2, 2]
    for seq, tok in ((parent, 100), (child, 200)):
        seq.append_token(tok)
    shared = parent.block_table.block_ids[1]
    copies = bm.append_slots([parent])                     # parent writes into the shared block
    assert copies == [(shared, parent.block_table.block_ids[1])] and child.block_table.block_ids[1] == shared
    assert bm.append_slots([child]) == []                  # the last holder writes in place
    assert parent.block_table.block_ids[0] == child.block_table.block_ids[0]
    assert parent.block_table.block_ids[1] != child.block_table.block_ids[1]
    assert bm.ref_count[parent.block_table.block_ids[0]] == 2 and bm.num_copy_on_write == 1
    bm.free(parent)
    bm.free(child)
    assert bm.get_num_free_gpu_blocks() == 8


def test_parallel_sampling_n_completions(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), block_size=4, num_gpu_blocks=64, dtype="float32")
    p = SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=8, ignore_eos=True)
    out = llm.generate("The capital of France is", p)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    texts = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(texts)) > 1                              # own random streams
    again = llm.generate("The capital of France is", p)[0]
    assert [tuple(c.token_ids) for c in again.outputs] == texts
    assert llm.engine.get_stats()["num_copy_on_write"] > 0
    assert llm.engine.get_stats()["num_free_gpu_blocks"] == 64


def test_finished_sibling_keeps_its_text_and_frees_its_blocks(tiny_model_dir):
    eng = engine(tiny_model_dir, block_size=4, num_gpu_blocks=64)
    eng.add_request("r", [5, 6, 7], SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=12,
                                                    stop_token_ids=list(range(0, 320, 3))))
    outs = run_checked(eng)["r"].outputs
    assert len(outs) == 3 and all(o.finish_reason in ("stop", "length") for o in outs)
    for o in outs:     # (a trailing half character is held back by the streaming detokenizer)
        assert eng.tokenizer.decode(o.token_ids, skip_special_tokens=True).startswith(o.text)


def test_beam_search_returns_width_hypotheses_best_first(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), block_size=4, num_gpu_blocks=64, dtype="float32")
    out = llm.beam_search(["Hello, my name is", [5, 6, 7]], BeamSearchParams(beam_width=3, max_tokens=6))
    assert len(out) == 2
    for o in out:
        assert len(o.sequences) == 3
        assert all(s.cum_logprob <= 0 for s in o.sequences)
    assert out[1].sequences[0].tokens[:3] == [5, 6, 7]
    assert llm.engine.get_stats()["num_free_gpu_blocks"] == 64
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0)


def test_beam_search_greedy_width_one_is_greedy(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), block_size=4, num_gpu_blocks=64, dtype="float32")
    greedy = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0]
    beam = llm.beam_search([[5, 6, 7]], BeamSearchParams(beam_width=1, max_tokens=7, ignore_eos=True))[0]
    assert beam.sequences[0].tokens == [5, 6, 7] + greedy.outputs[0].token_ids


@pytest.mark.parametrize("caching", [True, False])
def test_preempted_parallel_sampling_request_is_recomputed_not_stuck(tiny_model_dir, caching):
    eng = engine(tiny_model_dir, block_size=4, num_gpu_blocks=8, enable_prefix_caching=caching)
    eng.add_request("x", [10, 11, 12], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    eng.add_request("y", [50, 51, 52, 53, 54], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8,
                                                               ignore_eos=True))
    outs = run_checked(eng, max_steps=200)
    assert eng.get_stats()["num_preemptions"] > 0
    assert len(outs["y"].outputs) == 3 and all(o.finish_reason == "length" for o in outs["y"].outputs)
