"""KV sharing on the real default model (fp32): prefix caching never changing an output,
beam search against transformers' generate(num_beams=...), and these field cases (small
inputs that broke real inference engines; each test is named by its case's id):

C01  a fully cached 32-token prompt on a block boundary (block size 16), run again and
     then as 8 copies in one call: the repeat still computes at least one prompt token
     (so there are logits to sample from) and every output equals the first run's;
C02  a cache entry whose block was recycled (block size 4, 6 blocks): a 12-token prompt
     rerun after two unrelated ones reused every block gives the first run's output,
     and every cache entry names a block that holds the token ids it was hashed from;
C03  cached tokens counted after the prefill length was fixed: a request whose first 16
     tokens are cached computes exactly its other 13 and equals a run without caching;
C09  parallel sampling (n=3, stop ".") under preemption (block size 4, 12 blocks): three
     completions per request, finished siblings keep their text, each shared block's
     ref count equals its live sharers, every block free at the end;
C10  seeded n=4 at temperature 1: the four samples are not all equal, two runs give the
     same four, and the shared partial last block is copied on write after the first
     decode step.
"""
import pytest
import torch

from nanopaged import LLM, BeamSearchParams, SamplingParams

from invariants import check_block_invariants, run_checked
from logit_bounds import beam_score_bound

pytestmark = pytest.mark.slow
SMALL_KV = 64 << 20


def llm_for(folder, **kw):
    kw.setdefault("kv_cache_memory_bytes", SMALL_KV)
    return LLM(str(folder), dtype="float32", **kw)


def ids(out):
    return [c.token_ids for c in out.outputs]


def test_c01_fully_cached_prompt_on_a_block_boundary(default_model_dir):
    llm = llm_for(default_model_dir, block_size=16)
    prompt = list(range(3000, 3032))                                  # 32 tokens = 2 blocks
    params = SamplingParams(temperature=0, max_tokens=8)
    first = ids(llm.generate([prompt], params)[0])
    stats = llm.engine.get_stats()
    again = ids(llm.generate([prompt], params)[0])
    hits = llm.engine.get_stats()["prefix_cache_hits"] - stats["prefix_cache_hits"]
    assert again == first and 0 < hits <= len(prompt) - 1
    assert all(ids(o) == first for o in llm.generate([prompt] * 8, params))


def test_c02_stale_cache_entry_after_a_block_is_recycled(default_model_dir):
    llm = llm_for(default_model_dir, block_size=4, num_gpu_blocks=6, kv_cache_memory_bytes=None)
    eng, params = llm.engine, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    p = list(range(4000, 4012))

    def run(prompt):
        eng.add_request(str(len(eng.requests) + eng.num_steps), prompt, params)
        return ids(next(iter(run_checked(eng).values())))   # run_checked checks the cache after every step

    first = run(p)
    run(list(range(5000, 5012)))
    run(list(range(6000, 6012)))                              # every block has been reused by now
    assert run(p) == first


def test_c03_cached_tokens_counted_after_the_prefill_length_was_fixed(default_model_dir):
    x = list(range(7000, 7016))                                       # one full block
    b_prompt = x + list(range(8000, 8013))
    off = llm_for(default_model_dir, block_size=16, enable_prefix_caching=False)
    expected = ids(off.generate([b_prompt], SamplingParams(temperature=0, max_tokens=8))[0])
    llm = llm_for(default_model_dir, block_size=16)
    llm.generate([x + list(range(9000, 9005))], SamplingParams(temperature=0, max_tokens=4))
    eng = llm.engine
    eng.add_request("B", b_prompt, SamplingParams(temperature=0, max_tokens=8))
    seq = eng.requests["B"].seqs[0]
    scheduled = eng.scheduler.schedule()
    assert scheduled.num_scheduled_tokens == {seq.seq_id: 13}          # X came from the cache
    eng.output_processor.process_outputs(
        eng.scheduler.update_from_output(scheduled, eng.model_runner.execute_model(scheduled)))
    assert seq.num_computed_tokens == 29
    assert ids(run_checked(eng)["B"]) == expected


@pytest.mark.parametrize("min_tokens", [0, 20])
def test_c09_parallel_sampling_under_preemption(default_model_dir, min_tokens):
    """The case as written (stop=["."]), and with min_tokens=20: then no sample can stop
    early, six sequences of ~26 tokens need more than the 12 blocks, and the pool must
    preempt (as written, whether it does depends on how soon the samples say ".")."""
    llm = llm_for(default_model_dir, block_size=4, num_gpu_blocks=12, kv_cache_memory_bytes=None)
    eng = llm.engine
    prompts = ["The capital of France is", "My favourite food is"]
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=20, stop=["."],
                                                  min_tokens=min_tokens))
    texts_seen = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            for c in out.outputs:
                key = (out.request_id, c.index)
                if key in texts_seen and texts_seen[key][1] is not None:
                    assert (c.text, c.finish_reason) == texts_seen[key]     # finished siblings keep their text
                texts_seen[key] = (c.text, c.finish_reason)
        check_block_invariants(eng)          # ref counts equal live sharers after every step
    assert len(texts_seen) == 6 and all(reason is not None for _, reason in texts_seen.values())
    assert eng.get_stats()["num_preemptions"] > 0 or not min_tokens    # too small for both at once
    assert eng.get_stats()["num_free_gpu_blocks"] == 12


def test_c10_seeded_n4_gives_different_samples_and_copies_on_write(default_model_dir):
    llm = llm_for(default_model_dir, block_size=16)
    params = SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=16)
    eng = llm.engine
    eng.add_request("a", "The capital of France is", params)
    eng.step()                                                     # prefill: 4 samples, 1 computation
    assert eng.get_stats()["num_copy_on_write"] == 0
    eng.step()                                                     # first decode writes the shared block
    assert eng.get_stats()["num_copy_on_write"] == 3               # the 4th writes it in place
    first = [c.text for c in run_checked(eng)["a"].outputs]
    assert len(set(first)) > 1
    assert [c.text for c in llm.generate("The capital of France is", params)[0].outputs] == first


def test_prefix_caching_never_changes_an_output(default_model_dir, tokenizer_chat_prompts):
    system = "You are a terse assistant. Answer in one short sentence. " * 6
    prompts = [system + q for q in tokenizer_chat_prompts]
    params = SamplingParams(temperature=0, max_tokens=16)
    results = []
    for caching in (False, True):
        llm = llm_for(default_model_dir, block_size=16, enable_prefix_caching=caching)
        results.append([ids(o) for o in llm.generate(prompts, params)] +
                       [ids(llm.generate(p, params)[0]) for p in prompts])
    assert results[0] == results[1]


@pytest.fixture(scope="module")
def tokenizer_chat_prompts():
    return ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?",
            "Who wrote Hamlet?"]


def test_beam_search_matches_transformers(default_model_dir):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    llm = llm_for(default_model_dir)
    tok = llm.get_tokenizer()
    questions = ["What is the capital of France?", "Write a haiku about the sea.",
                 "Why is the sky blue?", "What is 12 times 12?"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                       add_generation_prompt=True) for q in questions]
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=24))
    for prompt, out in zip(prompts, outs):
        x = torch.tensor([tok(prompt).input_ids])
        with torch.no_grad():
            g = hf.generate(x, attention_mask=torch.ones_like(x), num_beams=4, do_sample=False,
                            length_penalty=1.0, early_stopping=True, max_new_tokens=24,
                            num_return_sequences=4, output_scores=True, return_dict_in_generate=True)
        for ours, theirs, score in zip(out.sequences, g.sequences, g.sequences_scores):
            # transformers pads finished beams with the pad token (= EOS here)
            assert ours.tokens == theirs.tolist()[:len(ours.tokens)]
            assert all(t == tok.pad_token_id for t in theirs.tolist()[len(ours.tokens):])
            n_gen = len(ours.tokens) - x.shape[1]
            # both fp32, other orders: each step's logprob within logit_bounds' bound (K = 1536,
            # the MLP's width; V = 49152 terms in each log_softmax's sum), the mean within
            # their mean (beam_score_bound, about 0.08 here: the worst case of 1537 roundings
            # a term); measured at most 1.9e-6
            err = abs(ours.cum_logprob / n_gen - score.item())
            bound = beam_score_bound(hf, ours.tokens, x.shape[1], ours.cum_logprob)
            assert err <= bound, (err, bound)
    assert llm.engine.get_stats()["num_free_gpu_blocks"] == llm.engine.get_stats()["num_total_gpu_blocks"]
