"""Exercise 6 (chapter 06): the sampler's filters, top-k, top-p and min-p."""
from __future__ import annotations

NUMBER = 6
CHAPTER = "06-sampling.md"
TITLE = "Sampling filters: top-k, top-p and min-p, row by row"
TARGETS = ["nanopaged.worker.sampler:_filter_sorted",
           "nanopaged.worker.sampler:min_p_floor"]
TASK = """
Write the filters that decide which tokens a row may still draw, for a whole batch at
once, each row with its own settings. `_filter_sorted` applies top-k and top-p to logits
already sorted in descending order (the sampler's candidates); `min_p_floor` gives the
smallest logit that min-p keeps, computed on the raw logits before the temperature is
applied, without a softmax. Every sampled (non-greedy) row of the engine goes through them.
"""
HINT = """
top-k: the k-th largest of a sorted row is values[:, k - 1] (gather with top_k - 1,
clamped to the row's length); mask everything smaller with -inf (ties with it stay).
top-p: probs = values.softmax(-1); the mass of the tokens before token j is
cumsum(probs)[j] - probs[j]; drop token j (-inf) when that mass already reaches top_p, so
the first token always stays. Either argument may be None: that filter is off.
Do top-k first, then top-p on what is left.

min-p keeps token i when p_i >= min_p * p_max, i.e. logit_i / T >= logit_max / T + log(min_p)
at temperature T: logit_i >= logit_max + T * log(min_p). Return it as a column
[rows, 1]; with temperature None the logits are already divided (T = 1).
"""

NEG_INF = float("-inf")


def _kept(values):
    return [[j for j, v in enumerate(row) if v != NEG_INF] for row in values.tolist()]


def check_top_k():
    """top-k keeps the k largest logits of each row, ties with the k-th included, and sets the others to -inf"""
    import torch

    from nanopaged.worker.sampler import _filter_sorted

    values = torch.tensor([[3.0, 2.0, 1.0, 0.5, -1.0],
                           [4.0, 2.0, 2.0, 2.0, 1.0],
                           [1.0, 0.9, 0.8, 0.7, 0.6]])
    got = _filter_sorted(values.clone(), torch.tensor([2, 2, 9]), None)
    want = [[0, 1], [0, 1, 2, 3], [0, 1, 2, 3, 4]]
    assert _kept(got) == want, (f"top_k [2, 2, 9] on rows sorted high to low: kept positions {_kept(got)}, want {want} "
                                "(row 1: the k-th value 2.0 has ties; row 2: k larger than the row keeps all)")
    kept = got[got != NEG_INF]
    assert torch.equal(kept, values[got != NEG_INF]), "top-k must leave the logits it keeps unchanged"


def check_top_p():
    """top-p keeps the most likely tokens until their mass reaches top_p (the first token always), each row with its own top_p"""
    import torch

    from nanopaged.worker.sampler import _filter_sorted

    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    values = probs.log().repeat(4, 1)
    got = _filter_sorted(values.clone(), None, torch.tensor([0.75, 0.9, 0.45, 0.01]))
    want = [[0, 1], [0, 1, 2], [0], [0]]
    assert _kept(got) == want, (
        f"probabilities [0.5, 0.3, 0.15, 0.05], top_p [0.75, 0.9, 0.45, 0.01] per row: kept positions {_kept(got)}, "
        f"want {want} (a token stays while the tokens before it hold less than top_p)")
    got = _filter_sorted(torch.zeros(2, 4), None, torch.tensor([0.5, 0.6]))       # four tokens of 0.25
    assert _kept(got) == [[0, 1], [0, 1, 2]], (
        f"four equally likely tokens (0.25 each), top_p [0.5, 0.6]: kept positions {_kept(got)}, want [[0, 1], "
        "[0, 1, 2]] (the third token goes once the two before it hold 0.5 >= top_p)")
    got = _filter_sorted(values.clone(), torch.tensor([3, 1, 4, 2]), torch.tensor([0.9, 0.9, 1.0, 1.0]))
    want = [[0, 1, 2], [0], [0, 1, 2, 3], [0, 1]]
    assert _kept(got) == want, (f"top_k [3, 1, 4, 2] and top_p [0.9, 0.9, 1.0, 1.0]: kept positions {_kept(got)}, "
                                f"want {want}")


def check_min_p_floor():
    """min_p_floor is the smallest logit min_p keeps: logit_max + T * log(min_p) per row, as a column"""
    import math

    import torch

    from nanopaged.worker.sampler import apply_min_p, min_p_floor

    logits = torch.tensor([[2.0, 1.0, 0.0, -3.0], [0.0, 5.0, 4.0, 1.0]])
    min_p, temperature = torch.tensor([0.5, 0.1]), torch.tensor([1.0, 2.0])
    got = min_p_floor(logits, min_p, temperature)
    want = [[2.0 + math.log(0.5)], [5.0 + 2.0 * math.log(0.1)]]
    assert tuple(got.shape) == (2, 1), f"shape {tuple(got.shape)}, want (2, 1): one floor per row, as a column"
    assert torch.allclose(got, torch.tensor(want), atol=1e-5), (
        f"rows with max logit 2.0 (min_p 0.5, T 1) and 5.0 (min_p 0.1, T 2): floors {got.flatten().tolist()}, "
        f"want {[w[0] for w in want]}")
    got = min_p_floor(logits, min_p)
    want = [[2.0 + math.log(0.5)], [5.0 + math.log(0.1)]]
    assert torch.allclose(got, torch.tensor(want), atol=1e-5), \
        f"without a temperature (already divided): floors {got.flatten().tolist()}, want {[w[0] for w in want]}"
    base = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    for m, want in ((0.5, [0, 1]), (0.2, [0, 1, 2]), (1.0, [0])):
        kept = _kept(apply_min_p(base, torch.tensor([m])))[0]
        assert kept == want, f"probabilities [0.5, 0.3, 0.15, 0.05], min_p {m}: kept {kept}, want {want}"


def check_engine_runs_on_it():
    """seeded sampling with top_k, top_p, min_p and temperature draws the engine's own tokens on your filters"""
    from nanopaged import SamplingParams

    from . import same_as_engines_own

    go = dict(max_tokens=12, ignore_eos=True)
    params = [SamplingParams(temperature=1.0, top_p=0.8, seed=1, **go),
              SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=2, **go),
              SamplingParams(temperature=1.5, min_p=0.2, seed=3, **go),
              SamplingParams(temperature=1.0, min_p=0.05, top_k=20, top_p=0.95, seed=4, **go)]
    same_as_engines_own([[1, 2, 3], [40, 41, 42, 43], [7, 8, 9], [100, 101]], params)


CHECKS = [check_top_k, check_top_p, check_min_p_floor, check_engine_runs_on_it]
