"""Sampling: greedy, temperature, top-k, top-p and per-request seeds."""
import pytest
import torch

from nanopaged import SamplingParams
from nanopaged.sampler import Sampler, SamplingMetadata, apply_top_k_top_p


def sample(logits, params, generators=None, seed=0):
    meta = SamplingMetadata.build(params, generators or [None] * len(params), logits.shape[-1],
                                  torch.device("cpu"))
    return Sampler()(logits, meta, torch.Generator().manual_seed(seed))


def test_greedy_is_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    out = sample(logits, [SamplingParams(temperature=0)] * 5)
    assert torch.equal(out, logits.argmax(-1))


def test_sampling_follows_the_softmax_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    out = sample(logits, [SamplingParams(temperature=1.0)] * 20000)
    freq = torch.bincount(out, minlength=4).float() / 20000
    torch.testing.assert_close(freq, logits[0].softmax(-1), atol=0.015, rtol=0)


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 0.0]]).repeat(20000, 1)
    hot = sample(logits, [SamplingParams(temperature=2.0)] * 20000).float().mean()
    cold = sample(logits, [SamplingParams(temperature=0.25)] * 20000).float().mean()
    assert cold < 0.05 < hot          # P(token 1) is 0.018 at T=0.25, 0.38 at T=2


def test_top_k_keeps_only_the_k_best():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(3)).repeat(3000, 1)
    out = sample(logits, [SamplingParams(temperature=5.0, top_k=3)] * 3000)
    assert set(out.tolist()) == set(logits[0].topk(3).indices.tolist())


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(5000, 1)
    out = sample(logits, [SamplingParams(top_p=0.75)] * 5000)
    assert set(out.tolist()) == {0, 1}         # 0.5 alone is short of 0.75; 0.5 + 0.3 reaches it


@pytest.mark.parametrize("top_p", [1e-9, 1e-6])
def test_c12_top_p_near_zero_is_greedy_and_never_nan(top_p):
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(4))
    filtered = apply_top_k_top_p(logits, None, torch.full((64,), top_p))
    assert not filtered.softmax(-1).isnan().any()
    out = sample(logits, [SamplingParams(temperature=1.0, top_p=top_p)] * 64)
    assert torch.equal(out, logits.argmax(-1))


@pytest.mark.parametrize("top_k", [0, -1])
def test_c12_top_k_zero_or_minus_one_means_no_filter(top_k):
    logits = torch.randn(4, 30)
    assert torch.equal(apply_top_k_top_p(logits, torch.full((4,), 30), None), logits)
    assert SamplingParams(top_k=top_k).top_k == top_k
    meta = SamplingMetadata.build([SamplingParams(top_k=top_k)], [None], 30, torch.device("cpu"))
    assert not meta.any_top_k


def test_c12_mixed_batch_top_k_zero_row_is_unfiltered():
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(6)).repeat(2, 1)
    meta = SamplingMetadata.build([SamplingParams(top_k=0), SamplingParams(top_k=5)], [None, None], 40,
                                  torch.device("cpu"))
    filtered = apply_top_k_top_p(logits, meta.top_k, None)
    assert torch.equal(filtered[0], logits[0])                   # top_k=0: nothing filtered
    assert torch.isfinite(filtered[1]).sum() == 5


def test_seeded_row_ignores_the_rest_of_the_batch():
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(5))
    p = SamplingParams(temperature=1.0, seed=7)
    alone = [sample(logits, [p], [torch.Generator().manual_seed(7)], seed=s).item() for s in range(1)]
    batch = torch.cat([torch.randn(6, 500), logits])
    gens = [None] * 6 + [torch.Generator().manual_seed(7)]
    mixed = sample(batch, [SamplingParams(temperature=1.0)] * 6 + [p], gens, seed=99)
    assert mixed[-1].item() == alone[0]


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("max_tokens", -3), ("temperature", -0.1), ("temperature", float("nan")),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("n", 0), ("seed", 1.5),
    ("stop_token_ids", ["a"]), ("ignore_eos", "yes"),
])
def test_bad_sampling_params_name_field_and_value(field, value):
    with pytest.raises(ValueError, match=field) as e:
        SamplingParams(**{field: value})
    assert repr(value) in str(e.value) or str(value) in str(e.value)


def test_unknown_sampling_param_is_a_type_error():
    with pytest.raises(TypeError, match="top_q"):
        SamplingParams(top_q=0.5)
