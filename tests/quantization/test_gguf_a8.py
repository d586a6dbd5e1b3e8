"""activation_quantization="int8": GGUF blocks against x rounded to int8 blocks of 32
(quantization/gguf_a8.py, the kernel's namespace a8). Not exact against the
dequantized model by design, so checked against what it claims instead:
- the rounding of x is gguf_a8.quantize_activations' (torch), bit for bit;
- the product is the float64 product of x's rounded values and the dequantized weights,
  within fp32 summation error;
- each row's bits do not depend on the batch (every m, a column slice);
- the PyTorch reference (gguf_linear_a8 on TorchOps) agrees within fp32 error; other types
  are refused.
"""
from __future__ import annotations

import gguf
import pytest
import torch
from error_bounds import matmul_bound
from gguf_blocks import assert_both_near_the_exact_product, kernel_roundings, random_quantized

from nanopaged.layers.backends import TorchOps, get_ops
from nanopaged.quantization.gguf_a8 import A8_TYPES, gguf_linear_a8, quantize_activations
from nanopaged.quantization.kernels import join_quant_kernels

T = gguf.GGMLQuantizationType
TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)                             # rows of whole super-blocks of 256


@pytest.fixture(scope="module")
def ops():
    ops = get_ops("cpu", "cpu")
    join_quant_kernels(ops)                    # as a layer's first quantized matmul does
    assert hasattr(ops.ops, "gguf_linear_a8"), "the CPU kernel has no gguf_linear_a8"
    return ops


def activations(m: int, k: int, seed: int = 1) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[0, :32] = 0                                    # a block of zeros: dx = 0, qx = 0
    if m > 1:
        x[1, 32:64] *= 1e4                           # a block far larger than its neighbours
    return x


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def test_the_types_are_the_kernels():
    assert A8_TYPES == {int(t) for t in TYPES}


def test_rounding_equals_the_torch_reference_bit_for_bit(ops):
    x = activations(9, 320)
    x[2, :32] = torch.arange(32) * 0.5 - 8           # values x / dx = 127 * (j - 16) / 16: ties included
    x[3, :] = -x[3, :]
    got = ops.ops.quantize_activations_a8(x)
    want = quantize_activations(x)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w)
    assert got[0].abs().max() <= 127 and torch.equal(got[1][0, 0], torch.tensor(0.0))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 2, 3, 6])
def test_kernel_is_the_product_of_the_rounded_values(ops, qtype, m):
    k = 512 if qtype in K_QUANTS else 160
    n = 37                                           # not a multiple of 4: a short group
    qw, w = random_quantized(n, k, qtype)
    x = activations(m, k)
    out = torch.full((m, n), float("nan"))
    ops.ops.gguf_linear_a8(out, x, qw, int(qtype))
    qx, dx, _ = quantize_activations(x)
    x_hat = (qx.double().view(m, -1, 32) * dx.double()[..., None]).view(m, k)
    want = x_hat @ w.double().T
    # the kernel: each 32-block's product exact in integers, then per term at most two
    # scale multiplies (K-quants: a sub-block scale and min more) and a chain of one
    # addition per block in its lane, and the lanes' tree
    bound = matmul_bound(x_hat, w, kernel_roundings(k))
    assert ((out.double() - want).abs() <= bound).all()
    exact = x.double() @ w.double().T                            # and x's rounding shows, a little
    assert not torch.equal(out.double(), exact)
    assert (out.double() - exact).abs().max() < 0.05 * exact.abs().max()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_kernel_rows_are_batch_invariant(ops, qtype):
    """Every m from 1 to 18 and 40 (the tiles of 2 rows, a last odd row), and a column slice
    of a wider output: each row's bits are the row's alone."""
    k = 256 if qtype in K_QUANTS else 96
    qw, _ = random_quantized(21, k, qtype)
    x = activations(40, k)
    alone = torch.empty(40, 21)
    for i in range(40):
        ops.ops.gguf_linear_a8(alone[i:i + 1], x[i:i + 1].contiguous(), qw, int(qtype))
    for m in [*range(1, 19), 40]:
        out = torch.empty(m, 21)
        ops.ops.gguf_linear_a8(out, x[:m].contiguous(), qw, int(qtype))
        assert torch.equal(bits(out), bits(alone[:m])), m
    wide = torch.zeros(40, 30)
    ops.ops.gguf_linear_a8(wide[:, 5:26], x, qw, int(qtype))
    assert torch.equal(bits(wide[:, 5:26]), bits(alone))
    assert (wide[:, :5] == 0).all() and (wide[:, 26:] == 0).all()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_pytorch_reference_agrees(ops, qtype):
    k = 256 if qtype in K_QUANTS else 128
    qw, _ = random_quantized(13, k, qtype)
    x = activations(5, k)
    got, want = torch.empty(5, 13), torch.empty(5, 13)
    gguf_linear_a8(ops, got, x, qw, int(qtype))
    gguf_linear_a8(TorchOps(), want, x, qw, int(qtype))
    assert_both_near_the_exact_product(got, want, x, qw, int(qtype))     # row 1 has a 1e4-sized block


def test_other_types_are_refused_by_the_kernel(ops):
    qw = torch.zeros(4, 84, dtype=torch.uint8)      # one Q2_K super-block a row: a type not run here
    with pytest.raises(RuntimeError, match=r"gguf_linear_a8: GGML type 10 is not supported"):
        ops.ops.gguf_linear_a8(torch.empty(1, 4), torch.randn(1, 256), qw, int(T.Q2_K))
