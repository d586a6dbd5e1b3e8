"""RejectionSampler: greedy verification, and the random rule checked statistically
(each output token is distributed exactly as the target's, whatever the proposal),
target_probs against the Sampler's own draws, seeding and the argument checks.

The statistical tests use small hand-made distributions (logits = log p, temperature
1, so target_probs gives p back), thousands of sequences in one call, a fixed seed
and a chi-square bound at significance 0.001."""

import math

import pytest
import torch

from nanopaged import SamplingParams
from nanopaged.worker.sampler import Sampler
from nanopaged.worker.sampling_metadata import SamplingMetadata
from nanopaged.spec_decode.rejection_sampler import RejectionSampler, target_probs

CPU = torch.device("cpu")
N = 20_000
# Chi-square critical values at p = 0.001, by degrees of freedom (scipy is not installed:
# scipy.stats.chi2.ppf(0.999, df)).
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}
Z_999 = 3.291                   # two-sided normal bound at p = 0.001

P0 = [0.05, 0.40, 0.20, 0.00, 0.15, 0.10, 0.10]     # token 3 is impossible
P1 = [0.10, 0.05, 0.60, 0.05, 0.10, 0.05, 0.05]
P2 = [0.30, 0.00, 0.10, 0.25, 0.05, 0.20, 0.10]
Q0 = [0.25, 0.10, 0.20, 0.10, 0.05, 0.25, 0.05]     # proposes token 3, which p never keeps


def meta_for(params, num_rows, generators=None, vocab=7):
    """Metadata of num_rows rows; params is one SamplingParams for all rows or a list."""
    params = params if isinstance(params, list) else [params] * num_rows
    return SamplingMetadata.build(params, generators or [None] * num_rows,
                                  [[] for _ in range(num_rows)], vocab, CPU)


def spec_logits(rows, num_seqs):
    """logits of num_seqs sequences, each with the rows (lists of probabilities)."""
    return torch.tensor(rows, dtype=torch.float32).log().repeat(num_seqs, 1)


def assert_distributed_as(tokens, p):
    """Chi-square goodness of fit of observed tokens to probabilities p; tokens with
    p = 0 must never appear."""
    counts = torch.bincount(torch.tensor(tokens), minlength=len(p)).tolist()
    support = [x for x in range(len(p)) if p[x] > 0]
    assert all(counts[x] == 0 for x in range(len(p)) if p[x] == 0), counts
    n = len(tokens)
    stat = sum((counts[x] - n * p[x]) ** 2 / (n * p[x]) for x in support)
    assert stat < CHI2_999[len(support) - 1], (stat, counts)


def assert_rate(successes, n, prob):
    assert abs(successes / n - prob) < Z_999 * math.sqrt(prob * (1 - prob) / n), (successes / n, prob)


RANDOM = SamplingParams(temperature=1.0)
GREEDY = SamplingParams(temperature=0.0)


def verify(rows, drafts, num_seqs, draft_probs=None, seed=0):
    """num_seqs random sequences, each with the rows (probabilities) and the drafts."""
    logits = spec_logits(rows, num_seqs)
    meta = meta_for(RANDOM, logits.shape[0])
    return RejectionSampler()(logits, [list(drafts) for _ in range(num_seqs)], meta,
                              torch.Generator().manual_seed(seed), draft_probs)


# -- greedy ------------------------------------------------------------------------------

def greedy_logits(argmaxes, vocab=7):
    logits = torch.zeros(len(argmaxes), vocab)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


def run_greedy(argmaxes, drafts):
    logits = greedy_logits([a for seq in argmaxes for a in seq])
    return RejectionSampler()(logits, drafts, meta_for(GREEDY, logits.shape[0]), torch.Generator())


def test_greedy_accepts_all_matching_drafts_and_adds_the_bonus_token():
    assert run_greedy([[4, 2, 6, 1]], [[4, 2, 6]]) == [[4, 2, 6, 1]]


def test_greedy_rejects_at_position_0_with_the_rows_argmax():
    assert run_greedy([[4, 2, 6, 1]], [[5, 2, 6]]) == [[4]]


def test_greedy_rejects_mid_way():
    assert run_greedy([[4, 2, 6, 1]], [[4, 2, 0]]) == [[4, 2, 6]]


def test_greedy_without_drafts_takes_the_argmax():
    assert run_greedy([[3]], [[]]) == [[3]]


def test_sequences_own_consecutive_rows():
    assert run_greedy([[1, 2], [3], [5, 6, 0]], [[1], [], [5, 4]]) == [[1, 2], [3], [5, 6]]


def test_greedy_and_random_sequences_share_a_batch():
    logits = torch.cat([greedy_logits([1, 2]), spec_logits([[0, 0, 0, 1, 0, 0, 0]], 1)])
    meta = meta_for([GREEDY, GREEDY, RANDOM], 3)
    out = RejectionSampler()(logits, [[1], []], meta, torch.Generator().manual_seed(0))
    assert out == [[1, 2], [3]]


# -- random: the output is distributed as the target ----------------------------------------

def test_no_drafts_draws_from_p():
    assert_distributed_as([o[0] for o in verify([P0], [], N)], P0)


def test_first_token_follows_p_with_a_likely_one_hot_draft():
    out = verify([P0, P1], [1], N)                      # p0(1) = 0.4
    assert_distributed_as([o[0] for o in out], P0)
    assert_rate(sum(len(o) == 2 for o in out), N, P0[1])


def test_first_token_follows_p_with_an_unlikely_one_hot_draft():
    out = verify([P0, P1], [0], N)                      # p0(0) = 0.05
    assert_distributed_as([o[0] for o in out], P0)
    assert_rate(sum(len(o) == 2 for o in out), N, P0[0])


def test_impossible_one_hot_draft_is_always_rejected():
    out = verify([P0, P1], [3], 2000)
    assert all(len(o) == 1 for o in out)
    assert_distributed_as([o[0] for o in out], P0)


def test_first_token_follows_p_with_draft_probabilities():
    q = torch.tensor(Q0)
    drafts = torch.multinomial(q, N, replacement=True, generator=torch.Generator().manual_seed(1))
    logits = spec_logits([P0, P1], N)
    out = RejectionSampler()(logits, [[d] for d in drafts.tolist()], meta_for(RANDOM, 2 * N),
                             torch.Generator().manual_seed(2), [q.unsqueeze(0)] * N)
    assert_distributed_as([o[0] for o in out], P0)
    assert_rate(sum(len(o) == 2 for o in out), N, sum(min(p, q) for p, q in zip(P0, Q0)))


def test_bonus_token_follows_p_k_when_all_drafts_are_accepted():
    out = verify([P0, P1, P2], [1, 2], N)               # full acceptance: 0.4 * 0.6
    full = [o for o in out if len(o) == 3]
    assert_rate(len(full), N, P0[1] * P1[2])
    assert all(o[:2] == [1, 2] for o in full)
    assert_distributed_as([o[2] for o in full], P2)


# -- target_probs --------------------------------------------------------------------------

FILTERS = [SamplingParams(temperature=0.7), SamplingParams(top_k=3), SamplingParams(top_p=0.8),
           SamplingParams(min_p=0.2), SamplingParams(temperature=1.5, top_k=5, top_p=0.9, min_p=0.05)]


def reference_probs(logits, params):
    """One row by the definitions: temperature, min_p relative to the most likely token,
    top-k, top-p over what is left (renormalised), then renormalise."""
    p = (logits / params.temperature).softmax(-1).tolist()
    keep = [x >= params.min_p * max(p) for x in p]
    order = sorted(range(len(p)), key=lambda x: -p[x])
    if params.top_k > 0:
        for x in order[params.top_k:]:
            keep[x] = False
    total, mass = sum(p[x] for x in order if keep[x]), 0.0
    for x in order:
        if keep[x]:
            if mass >= params.top_p:
                keep[x] = False
            mass += p[x] / total
    z = sum(p[x] for x in range(len(p)) if keep[x])
    return [p[x] / z if keep[x] else 0.0 for x in range(len(p))]


def test_target_probs_apply_temperature_min_p_top_k_top_p():
    logits = torch.randn(len(FILTERS), 8, generator=torch.Generator().manual_seed(3)) * 2
    probs = target_probs(logits, meta_for(FILTERS, len(FILTERS), vocab=8))
    # Both sides take the same fp32 exp(x / T - max) (the same ops on the same floats).
    # target_probs divides by the sum over the kept tokens in fp32 (V - 1 roundings, then
    # softmax's reciprocal and product: (V + 1) u relative); the reference renormalises
    # fp32 probabilities in float64 (their rounding and the ratio's: 2 u). A probability
    # p <= 1 is apart by at most (V + 3) u p = 11 2^-24 = 6.6e-7 for V = 8: within 1e-6.
    # Measured at most 2.4e-8.
    for row, params in enumerate(FILTERS):
        assert probs[row].tolist() == pytest.approx(reference_probs(logits[row], params), abs=1e-6)


def test_target_probs_is_what_the_sampler_draws_from():
    params = FILTERS[-1]
    logits = (torch.randn(8, generator=torch.Generator().manual_seed(4)) * 2).repeat(N, 1)
    meta = meta_for(params, N, vocab=8)
    drawn = Sampler().sample(logits, meta, torch.Generator().manual_seed(5)).tolist()
    assert_distributed_as(drawn, target_probs(logits[:1], meta_for(params, 1, vocab=8))[0].tolist())


# -- seeding and argument checks ------------------------------------------------------------

def test_seeded_sequence_reproduces_whatever_else_is_in_the_batch():
    def run(engine_seed, others):
        gen = torch.Generator().manual_seed(7)
        rows = 3 + 2 * others
        logits = spec_logits([P0, P1, P2], 1)
        logits = torch.cat([logits, spec_logits([P0, P1], others)])
        meta = meta_for(RANDOM, rows, generators=[gen] * 3 + [None] * (2 * others))
        drafts = [[0, 4]] + [[0]] * others
        return RejectionSampler()(logits, drafts, meta, torch.Generator().manual_seed(engine_seed))[0]
    first = [run(0, 0) for _ in range(2)]
    assert first[0] == first[1]
    assert all(run(seed, others) == first[0] for seed, others in [(1, 3), (2, 5)])


def test_rows_that_do_not_add_up_raise():
    with pytest.raises(ValueError, match="draft_token_ids"):
        RejectionSampler()(torch.zeros(3, 7), [[1, 2], [0]], meta_for(RANDOM, 3), torch.Generator())


def test_draft_id_outside_the_vocabulary_raises():
    with pytest.raises(ValueError, match="draft_token_ids"):
        RejectionSampler()(torch.zeros(2, 7), [[7]], meta_for(RANDOM, 2), torch.Generator())


def test_draft_probs_of_the_wrong_shape_raise():
    with pytest.raises(ValueError, match=r"draft_probs\[0\]"):
        RejectionSampler()(torch.zeros(3, 7), [[1, 2]], meta_for(RANDOM, 3), torch.Generator(),
                           [torch.full((1, 7), 1 / 7)])


def test_draft_probs_of_the_wrong_length_raise():
    with pytest.raises(ValueError, match="draft_probs"):
        RejectionSampler()(torch.zeros(2, 7), [[1]], meta_for(RANDOM, 2), torch.Generator(), [])
