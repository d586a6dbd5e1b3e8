"""Speculative decoding (chapters/19-speculative-decoding.md) on the tiny model: greedy
output with each proposer is token for token the output without speculation, whatever
the block size, a tight pool (preemption by swap or recompute), a prefix-cache hit,
chunked prefill, n > 1, stop conditions, logprobs, penalties or structured outputs; the
block invariants hold after every step; rejected K/V never enter the prefix cache; and
bad settings are ValueErrors naming the field.

The drafts: n-gram (prompt lookup) over prompts that repeat themselves (the random
model does not copy them, so its drafts are rejected: the rollback path); a draft model
that is the target itself (every draft accepted: the bonus-token path) and one made of
the target's first layer (make_layer_draft: accepts some, rejects some). The n-gram
acceptance on text that is copied is tests/spec_decode/test_spec_decode_real.py's.
"""
import shutil

import pytest

from nanopaged import LLM, BeamSearchParams, SamplingParams
from nanopaged import events as ev
from nanopaged.sampling_params import StructuredOutputsParams
from nanopaged.spec_decode.draft_model import make_layer_draft

from conftest import make_tiny_llama
from invariants import check_block_invariants

pytestmark = pytest.mark.exactness

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
REPEATS = [[5, 6, 7, 8, 9] * 3 + [5, 6], [3, 4] * 6 + [3], list(range(20, 50)), [11, 12, 13, 11, 12]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def drafts(tiny_model_dir, tmp_path_factory):
    """The speculative configs under test: n-gram, the target as its own draft, and its
    first layer as a draft."""
    layer = make_layer_draft(tiny_model_dir, tmp_path_factory.mktemp("layer-draft"), 1)
    return {"ngram": NGRAM,
            "self": {"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 3},
            "layer": {"method": "draft_model", "model": str(layer), "num_speculative_tokens": 3}}


def generate(folder, prompts, params, events=None, **kw):
    """(token ids, logprobs) of every completion, and the engine's stats; the block
    invariants are checked after every step and every block must come back."""
    kw = dict(block_size=4, num_gpu_blocks=256, dtype="float32") | kw
    llm = LLM(str(folder), **kw)
    if events is not None:
        llm.engine.add_observer(events.append)
    step = llm.engine.step

    def checked_step():
        out = step()
        check_block_invariants(llm.engine.engine_core)
        return out
    llm.engine.step = checked_step
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.engine.get_stats()
    assert stats["num_free_gpu_blocks"] == stats["num_total_gpu_blocks"]
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs], stats


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return generate(tiny_model_dir, REPEATS, GREEDY)[0]


@pytest.mark.parametrize("block_size", [16, 4, 1])
@pytest.mark.parametrize("method", ["ngram", "self", "layer"])
def test_greedy_output_equals_the_output_without_speculation(tiny_model_dir, drafts, reference, method,
                                                                block_size):
    got, stats = generate(tiny_model_dir, REPEATS, GREEDY, speculative_config=drafts[method],
                          block_size=block_size)
    assert got == reference
    assert stats["spec_decode_num_draft_tokens"] > 0
    accepted, proposed = stats["spec_decode_num_accepted_tokens"], stats["spec_decode_num_draft_tokens"]
    if method == "self":                   # the target agrees with itself: all accepted
        assert accepted == proposed
    elif method == "layer":                # some accepted, some rejected
        assert 0 < accepted < proposed
    else:                                  # a random model does not copy its prompt: rejected
        assert accepted < proposed


@pytest.mark.parametrize("kw", [
    dict(num_gpu_blocks=14, preemption_mode="recompute"),
    dict(num_gpu_blocks=14, preemption_mode="swap", num_cpu_blocks=64),
    dict(max_num_batched_tokens=6, max_num_seqs=4),                  # chunked prefill, drafts cut to the budget
], ids=["recompute", "swap", "chunked"])
@pytest.mark.parametrize("method", ["ngram", "layer"])
def test_greedy_output_is_unchanged_under_preemption_and_chunking(tiny_model_dir, drafts, reference, method, kw):
    got, stats = generate(tiny_model_dir, REPEATS, GREEDY, speculative_config=drafts[method], **kw)
    assert got == reference
    if "preemption_mode" in kw:
        assert stats[f"num_preemptions_{kw['preemption_mode']}"] > 0


def test_a_prefix_hit_gives_the_same_output(tiny_model_dir, drafts, reference):
    llm = LLM(str(tiny_model_dir), block_size=4, num_gpu_blocks=256, dtype="float32",
              speculative_config=drafts["layer"])
    first = [c.token_ids for o in llm.generate(REPEATS, GREEDY, use_tqdm=False) for c in o.outputs]
    again = [c.token_ids for o in llm.generate(REPEATS, GREEDY, use_tqdm=False) for c in o.outputs]
    assert first == again == [c[0][0] for c in reference]
    assert llm.engine.get_stats()["prefix_cache_hits"] > 0


def test_a_rejected_draft_across_a_block_boundary_gives_its_block_back(tiny_model_dir, reference):
    """At block size 2, a verify step of 1 + 4 positions spans blocks; when drafts are
    rejected, the blocks that hold only their slots are freed (BlockFreed after the
    DraftsVerified), and no cached block ever holds a rejected token."""
    events = []
    got, _ = generate(tiny_model_dir, REPEATS, GREEDY, events, speculative_config=NGRAM, block_size=2)
    assert got == reference
    rejected_then_freed = 0
    for i, e in enumerate(events):
        if isinstance(e, ev.DraftsVerified) and e.num_accepted < len(e.spec_token_ids):
            last_position = e.start + len(e.spec_token_ids)
            if last_position // 2 > (e.num_computed_tokens - 1) // 2:          # a block held only rejected slots
                after = events[i + 1:i + 3]
                assert any(isinstance(f, ev.BlockFreed) and f.seq_id == e.seq_id for f in after), after
                rejected_then_freed += 1
    assert rejected_then_freed > 0
    token_of = {}                     # every named block holds only tokens of the final outputs
    outputs = {tuple(p): c[0][0] for p, c in zip(REPEATS, got)}
    for e in events:
        if isinstance(e, ev.BlockCached):
            token_of[e.block_id] = e.token_ids
            assert any(_contains(list(p) + out, e.token_ids) for p, out in outputs.items()), e


def _contains(tokens, block):
    n = len(block)
    return any(tuple(tokens[i:i + n]) == tuple(block) for i in range(0, len(tokens) - n + 1, n))


def test_stops_logprobs_penalties_and_n_are_the_same_with_speculation(tiny_model_dir, drafts):
    """Stop conditions inside a verified run of tokens (eos, stop ids, max_tokens, min_tokens),
    logprobs of the accepted tokens, penalties (applied to each draft's row as if the
    drafts before it had been generated) and n > 1 (greedy) are what they are without."""
    prompts = REPEATS[:3]
    params = [SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[7], min_tokens=3, logprobs=2),
              SamplingParams(temperature=0, max_tokens=11, ignore_eos=True, repetition_penalty=1.3,
                             frequency_penalty=0.2, n=2),
              SamplingParams(temperature=0, max_tokens=9, presence_penalty=0.5, logprobs=0)]
    want, _ = generate(tiny_model_dir, prompts, params)
    for method in ("ngram", "self"):
        got, stats = generate(tiny_model_dir, prompts, params, speculative_config=drafts[method])
        assert stats["spec_decode_num_draft_tokens"] > 0
        for g, w in zip(got, want):
            for (gt, glp), (wt, wlp) in zip(g, w):
                assert gt == wt
                assert (glp is None) == (wlp is None)
                # the same raw logprobs, to the bit: the C++ kernels compute each row alone,
                # in one order whatever the batch (the matmul for every m, attention per query
                # row), so a verified draft's row is its decode row's ops in the same order
                if glp is not None:
                    assert [list(d) for d in glp] == [list(d) for d in wlp]
                    for gd, wd in zip(glp, wlp):
                        assert [gd[t].logprob for t in gd] == [wd[t].logprob for t in gd]


def test_structured_outputs_reject_a_draft_the_grammar_forbids(tiny_model_dir, drafts):
    params = [SamplingParams(temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(regex=r"(ab|ba){3,8}")),
              SamplingParams(temperature=0, max_tokens=30,
                             structured_outputs=StructuredOutputsParams(choice=["abab", "a KV cache"]))]
    want, _ = generate(tiny_model_dir, REPEATS[:2], params)
    for method in ("ngram", "self"):
        got, stats = generate(tiny_model_dir, REPEATS[:2], params, speculative_config=drafts[method])
        assert [[t for t, _ in g] for g in got] == [[t for t, _ in w] for w in want]


def test_seeded_sampling_is_reproducible_and_finishes(tiny_model_dir, drafts):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=16, ignore_eos=True, n=2)
    runs = [generate(tiny_model_dir, REPEATS, params, speculative_config=drafts["ngram"])[0] for _ in range(2)]
    assert runs[0] == runs[1]
    assert all(len(c[0]) == 16 for o in runs[0] for c in o)


def test_async_scheduling_falls_back_to_synchronous_steps(tiny_model_dir, reference, caplog):
    got, _ = generate(tiny_model_dir, REPEATS, GREEDY, speculative_config=NGRAM, async_scheduling=True)
    assert got == reference
    assert "speculative decoding runs synchronous steps" in caplog.text


def test_stats_count_drafts_and_accepted_tokens(tiny_model_dir, drafts):
    _, stats = generate(tiny_model_dir, REPEATS[:1], GREEDY, speculative_config=drafts["self"])
    # the target as its own draft accepts all 3 drafts a step: 1 + 3 tokens per verify step
    # (the last one's drafts are cut to what max_tokens leaves)
    drafts, proposed = stats["spec_decode_num_drafts"], stats["spec_decode_num_draft_tokens"]
    assert 3 * (drafts - 1) < proposed <= 3 * drafts
    assert stats["spec_decode_num_accepted_tokens"] == proposed
    assert stats["num_steps"] == 1 + drafts == 1 + -(-(GREEDY.max_tokens - 1) // 4)


@pytest.mark.parametrize("spec, words", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer"),
    ({"method": "medusa"}, "speculative_config.method must be one of"),
    ({"method": "draft_model"}, "speculative_config.model is required"),
    ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min=3 is larger"),
    ({"method": "ngram", "k": 2}, "unknown keys"),
    ({"method": "draft_model", "model": "/nonexistent/draft"}, "speculative_config.model: model folder"),
])
def test_bad_settings_are_value_errors_naming_the_field(tiny_model_dir, spec, words):
    with pytest.raises(ValueError, match=words):
        LLM(str(tiny_model_dir), num_gpu_blocks=16, speculative_config=spec)


def test_a_draft_with_another_vocabulary_or_tokenizer_is_refused(tiny_model_dir, tmp_path):
    other_vocab = tmp_path / "vocab"
    make_tiny_llama(other_vocab, vocab_size=400)
    with pytest.raises(ValueError, match="speculative_config.model: the draft's vocab_size 400 differs"):
        LLM(str(tiny_model_dir), num_gpu_blocks=16,
            speculative_config={"method": "draft_model", "model": str(other_vocab)})
    other_tok = tmp_path / "tok"                 # same size, other merges: other ids
    make_tiny_llama(other_tok)
    _retrain_tokenizer(other_tok, ["Speculative decoding checks k drafts in one forward."] * 20)
    with pytest.raises(ValueError, match="the draft's tokenizer differs"):
        LLM(str(tiny_model_dir), num_gpu_blocks=16,
            speculative_config={"method": "draft_model", "model": str(other_tok)})


def test_beam_search_with_speculation_is_refused_and_the_engine_goes_on(tiny_model_dir, reference):
    llm = LLM(str(tiny_model_dir), block_size=4, num_gpu_blocks=256, dtype="float32", speculative_config=NGRAM)
    with pytest.raises(ValueError, match="beam search does not work with speculative_config"):
        llm.beam_search([REPEATS[0]], BeamSearchParams(beam_width=2, max_tokens=4))
    outs = llm.generate(REPEATS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [c[0][0] for c in reference]


def _retrain_tokenizer(folder, text):
    """Replace folder's tokenizer by one of the same vocabulary size trained on `text`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from conftest import TINY_VOCAB

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=TINY_VOCAB, special_tokens=["<eos>"],
                                                      show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(folder)


def test_a_stop_string_inside_a_verified_run_cuts_there(tiny_model_dir, drafts):
    """A step that brings several tokens (drafts accepted) is checked for stop strings
    after each token: text, token ids and finish reason equal those without speculation."""
    llm = LLM(str(tiny_model_dir), block_size=4, num_gpu_blocks=256, dtype="float32")
    text = llm.generate(REPEATS[:1], GREEDY, use_tqdm=False)[0].outputs[0].text
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[text[9:12]])
    want = llm.generate(REPEATS[:1], params, use_tqdm=False)[0].outputs[0]
    spec = LLM(str(tiny_model_dir), block_size=4, num_gpu_blocks=256, dtype="float32",
               speculative_config=drafts["self"])
    got = spec.generate(REPEATS[:1], params, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == \
        (want.text, want.token_ids, want.finish_reason, want.stop_reason)
    assert want.finish_reason == "stop" and len(want.token_ids) < 24
    assert spec.engine.get_stats()["num_free_gpu_blocks"] == 256


def test_a_layer_draft_needs_safetensors(tiny_model_dir, tmp_path):
    """A folder without safetensors (as gguf_model_dir prepares for a file run as
    shipped) is refused by name, not copied into a draft without weights."""
    (tmp_path / "gguf-like").mkdir()
    shutil.copy(tiny_model_dir / "config.json", tmp_path / "gguf-like" / "config.json")
    with pytest.raises(ValueError, match=r"'.*gguf-like' has none .*ensure_default_model"):
        make_layer_draft(tmp_path / "gguf-like", tmp_path / "draft", 1)
    assert not (tmp_path / "draft").exists()
