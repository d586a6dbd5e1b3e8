"""Sampling: SamplingParams validation, and the Sampler's stages each against a plain
per-row reference (transformers' processor for the repetition penalty)."""

import pytest
import torch

from nanopaged import SamplingParams
from nanopaged.messages import Logprobs
from nanopaged.messages import NewRequestData
from nanopaged.worker.input_batch import InputBatch
from nanopaged.worker.sampler import Sampler, SamplerOutput, apply_min_p, apply_top_k_top_p, compute_logprobs
from nanopaged.worker.sampling_metadata import SamplingMetadata
from nanopaged.sampling_params import RequestOutputKind

CPU = torch.device("cpu")
NEG_INF = float("-inf")


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def build(params, vocab, outputs=None, generators=None, batch=None):
    """The metadata of rows `params`; from `batch` (row i = its sequence i, with its
    token counts) when given."""
    n = len(params)
    if batch is not None:
        return batch.make_sampling_metadata(list(range(n)))
    return SamplingMetadata.build(params, generators or [None] * n, outputs or [[] for _ in range(n)], vocab, CPU)


def run(logits, params, generators=None, seed=0, outputs=None, batch=None) -> SamplerOutput:
    meta = build(params, logits.shape[-1], outputs, generators, batch)
    return Sampler()(logits, meta, torch.Generator().manual_seed(seed))


def sample(logits, params, generators=None, seed=0, outputs=None, batch=None):
    return run(logits, params, generators, seed, outputs, batch).sampled_token_ids


def processed(logits, params, outputs=None, batch=None):
    """The logits after stages 2-3 (masks, bias, penalties)."""
    return Sampler().apply_logits_processors(logits, build(params, logits.shape[-1], outputs, batch=batch))


def new_seq(seq_id, params, prompt, output=()):
    """The message that makes the worker learn a sequence in full."""
    return NewRequestData(seq_id, 0, list(prompt), list(output), params, [], 0)


def with_counts(params, prompts, outputs, vocab):
    """An InputBatch that knows row i's prompt and output (seq_id i)."""
    batch = InputBatch(vocab, CPU)
    for i, (p, prompt, out) in enumerate(zip(params, prompts, outputs)):
        batch.add_sequence(new_seq(i, p, prompt, out))
    return batch


# -- SamplingParams ----------------------------------------------------------------------

def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.min_tokens) == \
        (1, 1.0, 1.0, -1, 0.0, 16, 0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.stop is p.stop_token_ids is p.bad_words is p.logit_bias is p.allowed_token_ids is None
    assert p.logprobs is p.prompt_logprobs is p.seed is None
    assert p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.include_stop_str_in_output and not p.ignore_eos
    assert p.output_kind is RequestOutputKind.CUMULATIVE and RequestOutputKind.DELTA.value == 1
    assert not p.needs_token_counts


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("presence_penalty", 2.5), ("presence_penalty", float("nan")),
    ("frequency_penalty", -2.01), ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("repetition_penalty", float("inf")), ("temperature", -0.1), ("temperature", float("nan")),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", -0.1), ("min_p", 1.5),
    ("seed", 1.5), ("seed", True), ("stop", ""), ("stop", ["ok", ""]), ("stop", [3]),
    ("stop_token_ids", ["a"]), ("stop_token_ids", [-1]), ("bad_words", "word"),
    ("bad_words", ["  "]), ("include_stop_str_in_output", 1), ("ignore_eos", "yes"),
    ("skip_special_tokens", None), ("spaces_between_special_tokens", 0),
    ("max_tokens", 0), ("max_tokens", -3), ("min_tokens", -1), ("min_tokens", 1.5),
    ("logprobs", -2), ("logprobs", 1.5), ("prompt_logprobs", -3),
    ("logit_bias", {"5": 1.0}), ("logit_bias", {-1: 1.0}), ("logit_bias", {5: "x"}),
    ("logit_bias", [5]), ("allowed_token_ids", []), ("allowed_token_ids", [-1]),
    ("output_kind", "delta"),
])
def test_bad_sampling_params_name_field_and_value(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}") as e:
        SamplingParams(**{field: value})
    assert repr(value) in str(e.value)


def test_unknown_sampling_param_is_a_type_error():
    with pytest.raises(TypeError, match="top_q"):
        SamplingParams(top_q=0.5)


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(ValueError, match=r"SamplingParams.min_tokens.*max_tokens \(10\).*20"):
        SamplingParams(min_tokens=20, max_tokens=10)
    assert SamplingParams(min_tokens=20, max_tokens=None).min_tokens == 20   # None: resolved later


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_logprobs_minus_one_whole_vocab_is_rejected_with_a_clear_error(field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}.*whole vocabulary.*-1"):
        SamplingParams(**{field: -1})


def test_stop_string_is_normalized_to_a_list():
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_logit_bias_values_are_clamped_to_plus_minus_100():
    assert SamplingParams(logit_bias={1: 500, 2: -1e9, 3: 2.5}).logit_bias == {1: 100.0, 2: -100.0, 3: 2.5}


@pytest.mark.parametrize("field", ["repetition_penalty", "presence_penalty", "frequency_penalty"])
def test_any_penalty_needs_token_counts(field):
    assert SamplingParams(**{field: 1.5}).needs_token_counts


@pytest.mark.parametrize("seed", [-2**63, -1, 0, 2**63 - 1])
def test_c42_seed_accepts_all_of_int64(seed):
    assert SamplingParams(seed=seed).seed == seed
    torch.Generator().manual_seed(seed)               # and torch takes it


@pytest.mark.parametrize("seed", [2**64, 2**63, -2**63 - 1])
def test_c42_seed_outside_int64_raises_naming_seed(seed):
    with pytest.raises(ValueError, match=rf"SamplingParams.seed.*int64.*{seed}"):
        SamplingParams(seed=seed)


def test_c42_distinct_seeds_give_distinct_streams():
    logits = torch.zeros(1, 1000)                      # uniform: every draw is pure noise
    seeds = [0, 1, 2, 7, 12345, -1, 2**31]
    streams = {tuple(sample(logits, [SamplingParams(seed=s)], [gen], seed=99).item() for _ in range(8))
               for s in seeds for gen in [torch.Generator().manual_seed(s)]}
    assert len(streams) == len(seeds)


def test_cpu_generator_keeps_only_the_low_32_bits_of_a_seed():
    # why the seed docstring warns: on CPU, seeds equal mod 2**32 share a stream
    a, b = (torch.rand(4, generator=torch.Generator().manual_seed(s)) for s in (5, 5 + 2**32))
    assert torch.equal(a, b)


@pytest.mark.parametrize("field,value", [
    ("stop_token_ids", [3, 100]), ("allowed_token_ids", [100]), ("logit_bias", {100: 1.0}),
])
def test_check_against_vocab_names_field_and_the_id(field, value):
    SamplingParams(**{field: value}).check_against_vocab(101)
    with pytest.raises(ValueError, match=rf"SamplingParams.{field}.*100.*\[0, 100\)"):
        SamplingParams(**{field: value}).check_against_vocab(100)


def test_check_against_vocab_rejects_more_logprobs_than_tokens():
    with pytest.raises(ValueError, match="SamplingParams.logprobs.*50.*51"):
        SamplingParams(logprobs=51).check_against_vocab(50)


class WordTokenizer:
    """encode() from a fixed table, like a tokenizer with known merges."""

    def __init__(self, table):
        self.table = table

    def encode(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        return list(self.table[text])


def test_update_from_tokenizer_returns_a_filled_copy():
    p = SamplingParams(stop_token_ids=[7], bad_words=["cat"])
    q = p.update_from_tokenizer(WordTokenizer({"cat": [1], " cat": [2]}), frozenset({0}))
    assert q is not p and p._bad_words_token_ids is None and p._all_stop_token_ids == {7}
    assert q._all_stop_token_ids == {0, 7} and q._bad_words_token_ids == [[1], [2]]
    assert q == p                                      # the derived fields are not compared


def test_ignore_eos_keeps_eos_out_of_all_stop_token_ids():
    p = SamplingParams(stop_token_ids=[7], ignore_eos=True).update_from_tokenizer(None, frozenset({0}))
    assert p._all_stop_token_ids == {7}


@pytest.mark.parametrize("table,expected", [
    ({"cat": [1], " cat": [2]}, [[1], [2]]),                  # both spellings banned
    ({"cat": [1], " cat": [1]}, [[1]]),                       # same ids: kept once
    ({"cat": [1, 2], " cat": [3]}, [[1, 2]]),                 # different length: vLLM drops it
    ({"cat": [1, 2], " cat": [1, 3]}, [[1, 2]]),              # same first token: vLLM drops it
    ({"cat": [1, 2], " cat": [4, 2]}, [[1, 2], [4, 2]]),
])
def test_bad_words_are_tokenized_with_and_without_a_leading_space_as_vllm(table, expected):
    p = SamplingParams(bad_words=["cat", "cat"]).update_from_tokenizer(WordTokenizer(table), frozenset())
    assert p._bad_words_token_ids == expected


def test_bad_words_with_a_real_tokenizer_ban_both_spellings(tmp_path):
    from conftest import make_tiny_tokenizer
    tok = make_tiny_tokenizer(tmp_path)
    p = SamplingParams(bad_words=["Paris"]).update_from_tokenizer(tok, frozenset({0}))
    assert tok.encode("Paris", add_special_tokens=False) in p._bad_words_token_ids
    assert all(tok.decode(ids).strip() == "Paris" for ids in p._bad_words_token_ids)


def test_bad_words_without_update_from_tokenizer_fail_at_build():
    with pytest.raises(ValueError, match="update_from_tokenizer"):
        build([SamplingParams(bad_words=["cat"])], 10)


# -- sampling: greedy, temperature, top-k, top-p, seeds (unchanged behaviour) -------------

def test_greedy_is_argmax():
    logits = randn(5, 50)
    assert torch.equal(sample(logits, [SamplingParams(temperature=0)] * 5), logits.argmax(-1))


def test_unconstrained_batch_skips_the_logits_processors():
    logits = randn(3, 50)
    assert processed(logits, [SamplingParams(temperature=0), SamplingParams(top_k=5),
                              SamplingParams(logprobs=2)]) is logits


def test_sampler_does_not_modify_its_input():
    logits = randn(2, 50)
    before = logits.clone()
    run(logits, [SamplingParams(logit_bias={3: 5.0}, allowed_token_ids=[1, 3], min_p=0.1),
                 SamplingParams(temperature=0, logprobs=1)])
    assert torch.equal(logits, before)


def test_sampling_follows_the_softmax_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    out = sample(logits, [SamplingParams(temperature=1.0)] * 20000)
    freq = torch.bincount(out, minlength=4).double() / 20000
    # a frequency is the mean of n = 20000 Bernoulli(p) draws: within z sqrt(p (1 - p) / n)
    # of p but for a normal tail. z = 3.662 leaves 1e-3 / 8 in each tail of each of the 4
    # tokens: a seed fails this with probability at most 1e-3 (Bonferroni)
    p = logits[0].double().softmax(-1)
    assert ((freq - p).abs() <= 3.662 * (p * (1 - p) / 20000).sqrt()).all(), (freq, p)


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 0.0]]).repeat(20000, 1)
    hot = sample(logits, [SamplingParams(temperature=2.0)] * 20000).float().mean()
    cold = sample(logits, [SamplingParams(temperature=0.25)] * 20000).float().mean()
    assert cold < 0.05 < hot          # P(token 1) is 0.018 at T=0.25, 0.38 at T=2


def test_top_k_keeps_only_the_k_best():
    logits = randn(1, 100, seed=3).repeat(3000, 1)
    out = sample(logits, [SamplingParams(temperature=5.0, top_k=3)] * 3000)
    assert set(out.tolist()) == set(logits[0].topk(3).indices.tolist())


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(5000, 1)
    out = sample(logits, [SamplingParams(top_p=0.75)] * 5000)
    assert set(out.tolist()) == {0, 1}         # 0.5 alone is short of 0.75; 0.5 + 0.3 reaches it


@pytest.mark.parametrize("top_p", [1e-9, 1e-6])
def test_c12_top_p_near_zero_is_greedy_and_never_nan(top_p):
    logits = randn(64, 1000, seed=4)
    filtered = apply_top_k_top_p(logits, None, torch.full((64,), top_p))
    assert not filtered.softmax(-1).isnan().any()
    out = sample(logits, [SamplingParams(temperature=1.0, top_p=top_p)] * 64)
    assert torch.equal(out, logits.argmax(-1))


@pytest.mark.parametrize("top_k", [0, -1])
def test_c12_top_k_zero_or_minus_one_means_no_filter(top_k):
    logits = torch.randn(4, 30)
    assert torch.equal(apply_top_k_top_p(logits, torch.full((4,), 30), None), logits)
    assert SamplingParams(top_k=top_k).top_k == top_k
    assert not build([SamplingParams(top_k=top_k)], 30).any_top_k


def test_c12_mixed_batch_top_k_zero_row_is_unfiltered():
    logits = randn(1, 40, seed=6).repeat(2, 1)
    meta = build([SamplingParams(top_k=0), SamplingParams(top_k=5)], 40)
    filtered = apply_top_k_top_p(logits, meta.top_k, None)
    assert torch.equal(filtered[0], logits[0])                   # top_k=0: nothing filtered
    assert torch.isfinite(filtered[1]).sum() == 5


def test_seeded_row_ignores_the_rest_of_the_batch():
    logits = randn(1, 500, seed=5)
    p = SamplingParams(temperature=1.0, seed=7)
    alone = sample(logits, [p], [torch.Generator().manual_seed(7)])
    batch = torch.cat([torch.randn(6, 500), logits])
    gens = [None] * 6 + [torch.Generator().manual_seed(7)]
    mixed = sample(batch, [SamplingParams(temperature=1.0)] * 6 + [p], gens, seed=99)
    assert mixed[-1] == alone[0]


# -- min_p -------------------------------------------------------------------------------

def test_min_p_matches_a_per_row_reference():
    logits, min_p = randn(6, 80, seed=8) * 3, torch.tensor([0.0, 0.01, 0.1, 0.3, 0.9, 1.0])
    out = apply_min_p(logits, min_p)
    for i in range(6):
        probs = logits[i].softmax(-1)
        expected = logits[i].clone()
        expected[probs < min_p[i] * probs.max()] = NEG_INF
        assert torch.equal(out[i], expected)


def test_min_p_samples_only_tokens_above_the_threshold():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08]])).repeat(4000, 1)
    out = sample(logits, [SamplingParams(min_p=0.2)] * 4000)      # threshold 0.1
    assert set(out.tolist()) == {0, 1, 2}


# -- logits processors -------------------------------------------------------------------

def test_allowed_token_ids_set_every_other_logit_to_minus_inf():
    logits = randn(2, 30, seed=9)
    out = processed(logits, [SamplingParams(allowed_token_ids=[3, 17]), SamplingParams()])
    expected = torch.full((30,), NEG_INF)
    expected[[3, 17]] = logits[0, [3, 17]]
    assert torch.equal(out[0], expected) and torch.equal(out[1], logits[1])


def test_allowed_token_ids_are_all_that_is_sampled():
    out = sample(torch.zeros(500, 30), [SamplingParams(allowed_token_ids=[3, 17, 29])] * 500)
    assert set(out.tolist()) == {3, 17, 29}


def prepared(**kw):
    return SamplingParams(**kw).update_from_tokenizer(
        WordTokenizer({"a": [5], " a": [6], "bc": [1, 2], " bc": [3, 2]}), frozenset({0}))


def test_single_token_bad_words_are_never_sampled():
    logits = torch.zeros(1, 10)
    logits[0, 5], logits[0, 6], logits[0, 4] = 9.0, 8.0, 7.0
    assert sample(logits, [prepared(bad_words=["a"], temperature=0)]).item() == 4


@pytest.mark.parametrize("output,banned", [
    ([], set()), ([9, 1], {2}), ([9, 3], {2}), ([1, 9], set()), ([2], set()),
])
def test_multi_token_bad_word_bans_its_last_token_only_after_its_prefix(output, banned):
    logits = randn(1, 10, seed=10)
    out = processed(logits, [prepared(bad_words=["bc"])], outputs=[output])
    assert {t for t in range(10) if out[0, t] == NEG_INF} == banned


def test_bad_word_metadata_reads_the_live_output_list():
    output, logits = [9], randn(1, 10, seed=11)
    sampler, meta = Sampler(), build([prepared(bad_words=["bc"])], 10, outputs=[output])
    assert torch.isfinite(sampler.apply_logits_processors(logits, meta)).all()
    output.append(1)                                   # the runner appends; meta sees it
    assert sampler.apply_logits_processors(logits, meta)[0, 2] == NEG_INF


@pytest.mark.parametrize("generated,held_back", [(0, True), (2, True), (3, False), (5, False)])
def test_min_tokens_holds_back_eos_and_stop_ids_until_reached(generated, held_back):
    logits = randn(1, 10, seed=12)
    out = processed(logits, [prepared(min_tokens=3, stop_token_ids=[7])], outputs=[[4] * generated])
    stops = out[0, [0, 7]]                             # 0: the eos given to update_from_tokenizer
    assert (stops == NEG_INF).all() if held_back else torch.equal(stops, logits[0, [0, 7]])
    assert torch.equal(out[0, 1:7], logits[0, 1:7])


def test_min_tokens_with_ignore_eos_holds_back_stop_ids_only():
    out = processed(torch.zeros(1, 10), [prepared(min_tokens=3, stop_token_ids=[7], ignore_eos=True)])
    assert out[0, 7] == NEG_INF and out[0, 0] == 0


def test_logit_bias_adds_to_the_logits_per_row():
    logits = randn(3, 20, seed=13)
    params = [SamplingParams(logit_bias={1: 2.5, 19: -100}), SamplingParams(), SamplingParams(logit_bias={1: -1})]
    expected = logits.clone()
    for i, p in enumerate(params):
        for t, b in (p.logit_bias or {}).items():
            expected[i, t] += b
    assert torch.equal(processed(logits, params), expected)


# -- penalties ---------------------------------------------------------------------------

def test_repetition_penalty_equals_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
    vocab, g = 50, torch.Generator().manual_seed(14)
    logits = randn(3, vocab, seed=14) * 4                 # positive and negative logits
    penalties = [2.0, 1.3, 0.7]
    prompts = [torch.randint(vocab, (8,), generator=g).tolist() for _ in penalties]
    outputs = [torch.randint(vocab, (5,), generator=g).tolist() for _ in penalties]
    params = [SamplingParams(repetition_penalty=r, temperature=0) for r in penalties]
    out = processed(logits, params, outputs, with_counts(params, prompts, outputs, vocab))
    for i, r in enumerate(penalties):
        ids = torch.tensor([prompts[i] + outputs[i]])
        expected = RepetitionPenaltyLogitsProcessor(r)(ids, logits[i:i + 1].clone())
        torch.testing.assert_close(out[i:i + 1], expected, rtol=0, atol=0)


def test_frequency_and_presence_penalties_count_output_tokens_only():
    vocab, logits = 10, randn(1, 10, seed=15)
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=1.5)]
    prompt, output = [1, 1, 2], [2, 3, 3, 3]
    out = processed(logits, params, [output], with_counts(params, [prompt], [output], vocab))
    expected = logits[0].clone()                       # apply_penalties' two float32 subtractions
    expected[2] = expected[2] - 0.5 * 1 - 1.5           # in the prompt too, but counted once
    expected[3] = expected[3] - 0.5 * 3 - 1.5
    assert torch.equal(out[0], expected)               # token 1 (prompt only): untouched


def reference_penalties(logits, p, prompt, output):
    """apply_penalties one token at a time: its float32 operations in its order (a
    negative logit times the penalty, else divided by it; minus frequency * count; minus
    presence), so the result is its bits. A penalty at its default changes nothing
    exactly (x * 1, x / 1, x - 0)."""
    out = logits.clone()
    rep, freq, pres = (torch.tensor(v, dtype=torch.float32)
                       for v in (p.repetition_penalty, p.frequency_penalty, p.presence_penalty))
    for t in range(logits.shape[-1]):
        count = output.count(t)
        if t in prompt or count:
            out[t] = out[t] * rep if out[t] < 0 else out[t] / rep
        out[t] = out[t] - freq * count
        out[t] = out[t] - pres * (count > 0)
    return out


def test_penalties_match_a_per_row_reference_on_random_logits():
    vocab, g = 40, torch.Generator().manual_seed(16)
    logits = randn(5, vocab, seed=16) * 3
    params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=-0.4),
              SamplingParams(), SamplingParams(frequency_penalty=2.0),
              SamplingParams(repetition_penalty=0.8, temperature=0), SamplingParams(presence_penalty=1.0)]
    prompts = [torch.randint(vocab, (12,), generator=g).tolist() for _ in params]
    outputs = [torch.randint(vocab, (9,), generator=g).tolist() for _ in params]
    out = processed(logits, params, outputs, with_counts(params, prompts, outputs, vocab))
    for i, p in enumerate(params):
        assert torch.equal(out[i], reference_penalties(logits[i], p, prompts[i], outputs[i])), i


def test_penalties_apply_to_greedy_rows():
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    p = SamplingParams(temperature=0, repetition_penalty=2.0)
    batch = with_counts([p], [[0]], [[]], 3)
    assert sample(logits, [p], batch=batch).item() == 1      # 3 / 2 < 2


def test_penalty_row_without_counts_is_an_error():
    with pytest.raises(ValueError, match="no token counts"):
        sample(torch.zeros(1, 5), [SamplingParams(presence_penalty=1.0)])


# -- logprobs ----------------------------------------------------------------------------

@pytest.mark.parametrize("k", [0, 3])
def test_compute_logprobs_matches_log_softmax(k):
    logits = randn(4, 30, seed=17).to(torch.bfloat16)
    tokens = torch.tensor([0, 5, 29, 5])
    lp = compute_logprobs(logits, tokens, k)
    ref = torch.log_softmax(logits.float(), dim=-1)
    for i in range(4):
        t = tokens[i].item()
        expected_ids = [t] + ref[i].topk(k).indices.tolist()
        assert lp.token_ids[i] == expected_ids
        assert lp.logprobs[i] == ref[i, expected_ids].tolist()     # the same log_softmax of the same floats
        assert lp.ranks[i] == 1 + int((ref[i] > ref[i, t]).sum())


def test_rank_of_the_best_token_is_one():
    logits = randn(3, 30, seed=18)
    assert compute_logprobs(logits, logits.argmax(-1), 1).ranks == [1, 1, 1]


def test_sampler_returns_raw_logprobs_only_for_rows_that_ask():
    logits = randn(3, 30, seed=19)
    params = [SamplingParams(temperature=0, logprobs=2, repetition_penalty=3.0),
              SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=0)]
    batch = with_counts(params, [list(range(30))] * 3, [[]] * 3, 30)
    out = run(logits, params, batch=batch)
    assert out.logprobs[1] is None
    for i, k in [(0, 2), (2, 0)]:
        expected = compute_logprobs(logits[i:i + 1], out.sampled_token_ids[i:i + 1], k)
        assert out.logprobs[i] == expected           # raw: before the penalty
        assert len(out.logprobs[i].token_ids[0]) == k + 1
    assert isinstance(out.logprobs[0], Logprobs)


# -- batch independence (C41) ------------------------------------------------------------

VOCAB = 64
TRANSITIONS = randn(VOCAB, VOCAB, seed=20) * 2          # a toy "model": logits from the last token


def generate(requests, steps=12):
    """Decode all `requests` (params, prompt) together for `steps` steps, the way the
    runner does: add_sequence once, then sample and append_output_tokens each step."""
    batch, sampler = InputBatch(VOCAB, CPU), Sampler()
    engine_gen = torch.Generator().manual_seed(0)
    for i, (p, prompt) in enumerate(requests):
        batch.add_sequence(new_seq(100 + i, p, prompt))
    seq_ids = [100 + i for i in range(len(requests))]
    outputs = [batch.seqs[i].output_token_ids for i in seq_ids]
    for _ in range(steps):
        last = [(out or prompt)[-1] for out, (_, prompt) in zip(outputs, requests)]
        meta = batch.make_sampling_metadata(seq_ids)
        tokens = sampler(TRANSITIONS[last], meta, engine_gen).sampled_token_ids.tolist()
        batch.append_output_tokens(seq_ids, tokens)
    return outputs


@pytest.mark.parametrize("mate", [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=1.0),
    SamplingParams(temperature=0.7, presence_penalty=0.5, seed=3, min_p=0.05, top_k=10),
])
def test_c41_penalised_tokens_do_not_depend_on_batch_mates(mate):
    greedy = (SamplingParams(temperature=0, repetition_penalty=2.0), [1, 2, 3])
    seeded = (SamplingParams(temperature=0.9, seed=11, frequency_penalty=0.7, top_p=0.9,
                             logit_bias={5: 3.0}), [4, 5])
    other = (mate, [6, 7, 8, 9])
    alone = [generate([r])[0] for r in (greedy, seeded, other)]
    assert generate([greedy, seeded, other]) == alone
    assert generate([other, seeded, greedy]) == alone[::-1]
    assert len(set(alone[0])) > 3                      # the penalty really changed the path
