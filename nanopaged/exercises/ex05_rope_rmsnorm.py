"""Exercise 5 (chapter 05): RoPE over a flat batch of positions, and RMSNorm in fp32."""
from __future__ import annotations

NUMBER = 5
CHAPTER = "05-llama.md"
TITLE = "The Llama layer's own math: RoPE and RMSNorm"
TARGETS = ["nanopaged.layers.backends:TorchOps.rotary_embedding",
           "nanopaged.layers.backends:TorchOps.rms_norm"]
TASK = """
Write the two pieces of a Llama layer that are neither a matmul nor attention, as the
reference backend computes them. `rotary_embedding` rotates each query and key head by
the angle of its token's own position (RoPE, Su et al. 2021), looked up in the cos/sin
tables that `init_rope` precomputed: no batch dimension, every token carries its
position. `rms_norm` is RMSNorm computed in float32 (with the skip connection's add fused
in when a residual is given). Every layer of the tiny Llama then runs on your code.
"""
HINT = """
RoPE, GPT-NeoX layout (transformers' rotate_half): view x as [num_tokens, heads, head_size]
and split each head in halves x1 = x[..., :d/2], x2 = x[..., d/2:]; the result is
x * cos + cat(-x2, x1) * sin, with cos = cos[positions] and sin = sin[positions]
([num_tokens, head_size], broadcast over the heads). So element i and element i + d/2 of a
head are one pair, rotated by the angle position * inv_freq[i]. Return tensors of the
input shapes, [num_tokens, heads * head_size].

RMSNorm: h = x.float(); h * rsqrt(mean(h^2 over the last dim) + eps); round back to x's
dtype, then multiply by weight. With a residual: first x = residual = x + residual, then
normalize, and return (normalized, residual).
"""


def _tables(max_positions=32, head_size=8, theta=10000.0):
    """cos, sin [max_positions, head_size] as LlamaForCausalLM.init_rope builds them."""
    import torch

    inv_freq = 1.0 / theta ** (torch.arange(0, head_size, 2).float() / head_size)
    freqs = torch.arange(max_positions).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin(), inv_freq


def _backend():
    from nanopaged.layers.backends import TorchOps

    return TorchOps()


def check_rope_rotates_pairs():
    """rotary_embedding turns each pair (x[i], x[i + head_size/2]) of every query and key head by the angle position * inv_freq[i]"""
    import torch

    cos, sin, inv_freq = _tables()
    g = torch.Generator().manual_seed(0)
    positions = torch.tensor([5, 0, 1, 2, 17])                 # a decode, then a prompt, as in a batch
    q, k = torch.randn(5, 4 * 8, generator=g), torch.randn(5, 2 * 8, generator=g)
    got_q, got_k = _backend().rotary_embedding(positions, q.clone(), k.clone(), cos, sin, 8)
    for name, x, got, heads in (("query", q, got_q, 4), ("key", k, got_k, 2)):
        assert tuple(got.shape) == tuple(x.shape), f"{name}: output shape {tuple(got.shape)}, want {tuple(x.shape)}"
        x, got = x.view(5, heads, 8), got.view(5, heads, 8)
        z = torch.complex(x[..., :4], x[..., 4:])              # pair i as one complex number
        turned = z * torch.polar(torch.ones(5, 1, 4), positions[:, None, None].float() * inv_freq)
        want = torch.cat((turned.real, turned.imag), dim=-1)
        for t in range(5):
            assert torch.allclose(got[t], want[t], atol=1e-5), (
                f"{name}, token {t} at position {positions[t].item()}: not rotated by the angle of its position "
                f"(off by {(got[t] - want[t]).abs().max().item():.3g}; position 0 must be left as it is)")


def check_rope_relative():
    """after RoPE, a query at position m and a key at position n score q.k by m - n alone (shifting both changes nothing)"""
    import torch

    cos, sin, _ = _tables(64)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 8, generator=g), torch.randn(1, 8, generator=g)
    scores = []
    for m, n in ((7, 3), (20, 16), (44, 40)):
        rq, _ = _backend().rotary_embedding(torch.tensor([m]), q.clone(), k.clone(), cos, sin, 8)
        _, rk = _backend().rotary_embedding(torch.tensor([n]), q.clone(), k.clone(), cos, sin, 8)
        scores.append((rq * rk).sum().item())
    assert max(scores) - min(scores) < 1e-4, (
        f"query/key at positions (7, 3), (20, 16), (44, 40): scores {[round(s, 5) for s in scores]}, "
        "want three equal numbers (same distance 4)")
    rq, _ = _backend().rotary_embedding(torch.tensor([9]), q.clone(), k.clone(), cos, sin, 8)
    _, rk = _backend().rotary_embedding(torch.tensor([3]), q.clone(), k.clone(), cos, sin, 8)
    assert abs((rq * rk).sum().item() - scores[0]) > 1e-3, \
        "positions (9, 3) score the same as (7, 3): the rotation does not depend on the position"


def check_rms_norm():
    """rms_norm is x / sqrt(mean(x^2) + eps) * weight, in float32: a 400 in an fp16 row does not zero it"""
    import torch

    g = torch.Generator().manual_seed(2)
    x, weight = torch.randn(3, 16, generator=g), torch.randn(16, generator=g)
    got = _backend().rms_norm(x, weight, 1e-5)
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight
    assert isinstance(got, torch.Tensor) and tuple(got.shape) == (3, 16), \
        f"rms_norm without a residual returns the normalized rows [3, 16], you returned {type(got).__name__}"
    assert torch.allclose(got, want, atol=1e-5), \
        f"float32 rows: off by {(got - want).abs().max().item():.3g} from x / sqrt(mean(x^2) + eps) * weight"
    x = torch.full((1, 576), 0.5)
    x[0, 7] = 400.0
    got = _backend().rms_norm(x.half(), torch.ones(576).half(), 1e-5)
    assert got.dtype == torch.float16, f"an fp16 input gives an fp16 output, yours is {got.dtype}"
    assert abs(got[0, 0].item() - 0.03) < 1e-3 and abs(got[0, 7].item() - 23.98) < 0.05, (
        f"fp16 row of 0.5s with one 400 (400**2 overflows fp16): you gave {got[0, 0].item():.4f} and "
        f"{got[0, 7].item():.4f}, want about 0.0300 and 23.98 (compute in float32)")


def check_rms_norm_residual():
    """rms_norm(x, weight, eps, residual) adds the skip connection first: it returns (norm(x + residual), x + residual)"""
    import torch

    g = torch.Generator().manual_seed(3)
    x, residual, weight = (torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g),
                           torch.randn(16, generator=g))
    got = _backend().rms_norm(x.clone(), weight, 1e-6, residual.clone())
    assert isinstance(got, tuple) and len(got) == 2, \
        f"with a residual, rms_norm returns a pair (normalized, new residual); you returned {type(got).__name__}"
    s = x + residual
    want = s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    assert torch.allclose(got[1], s, atol=1e-6), "the second value must be x + residual (the residual stream)"
    assert torch.allclose(got[0], want, atol=1e-5), \
        f"the first value must be RMSNorm of x + residual; off by {(got[0] - want).abs().max().item():.3g}"


def check_engine_runs_on_it():
    """the tiny Llama, every layer on your RoPE and RMSNorm, gives the engine's own tokens"""
    from nanopaged import SamplingParams

    from . import same_as_engines_own

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 6)]
    same_as_engines_own([list(range(1, 20)), [3, 4, 5]], params)


CHECKS = [check_rope_rotates_pairs, check_rope_relative, check_rms_norm, check_rms_norm_residual,
          check_engine_runs_on_it]
