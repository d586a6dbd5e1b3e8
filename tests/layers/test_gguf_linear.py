"""GGUF's block formats (Q8_0, Q4_0, Q4_1) in the layers: the PyTorch dequantizer and the
CPU kernel `gguf_linear` (kernels/paged_attention_cpu.cpp) against the `gguf` package's
reference, `gguf.quants.dequantize`.

The kernel must give, bit for bit, what our fp32 `linear` kernel gives on the
dequantized weights (it widens each block in registers and sums in the same order), and
so be batch-invariant; and F.linear's result within fp32 summation error.
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize

from nanopaged.layers.backends import TorchOps, get_ops
from nanopaged.layers.quantization.gguf import BLOCK_FORMATS, GGUFLinearMethod, dequantize

T = gguf.GGMLQuantizationType
TYPES = [T.Q8_0, T.Q4_0, T.Q4_1]
# (m, k, n): m = 1 (decode) and batches; k odd and even multiples of 32; n not a multiple of 4
SHAPES = [(1, 32, 1), (1, 96, 7), (2, 64, 13), (3, 160, 45), (5, 96, 33), (17, 96, 6)]


@pytest.fixture(scope="module")
def ops():
    ops = get_ops("cpu", "cpu")
    assert hasattr(ops.ops, "gguf_linear"), "the CPU kernel has no gguf_linear"
    return ops


def quantized(n: int, k: int, qtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random [n, k] matrix quantized by gguf: (packed uint8 rows, gguf's dequantized fp32)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) + 0.3
    q = quantize(w, qtype)
    return torch.from_numpy(q.copy()), torch.from_numpy(gguf_dequantize(q, qtype).reshape(n, k).copy())


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_equals_gguf_reference_bit_for_bit(qtype):
    """Random blocks (any nibbles, any finite scales and mins, subnormals and negatives)."""
    rng = np.random.default_rng(int(qtype))
    size = BLOCK_FORMATS[int(qtype)].block_bytes
    raw = rng.integers(0, 256, (40, 5 * size), dtype=np.uint8)
    blocks = raw.reshape(40, 5, size)
    scales = (rng.standard_normal((40, 5, 2)) * np.array([1e-2, 1.0])).astype(np.float16)
    scales[0, 0, 0] = np.float16(3e-7)                     # a subnormal scale
    heads = 4 if qtype == T.Q4_1 else 2
    blocks[..., :heads] = scales[..., :heads // 2].view(np.uint8)
    want = torch.from_numpy(gguf_dequantize(raw, qtype).reshape(40, 160).copy())
    got = dequantize(torch.from_numpy(raw), int(qtype))
    assert got.dtype == torch.float32 and got.shape == (40, 160)
    assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_kernel_equals_fp32_linear_on_dequantized_weights(ops, qtype, m, k, n):
    qweight, w = quantized(n, k, qtype, seed=m + k + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    out = torch.empty(m, n)
    ops.gguf_linear(out, x, qweight, int(qtype))
    assert torch.equal(bits(out), bits(ops.linear(x, w)))               # our fp32 kernel, bit for bit
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_kernel_rows_are_batch_invariant(ops, qtype):
    """A row's result alone (m = 1) equals its result in batches of every size, and in a
    column slice of a wider output (a fused layer's segment)."""
    qweight, _ = quantized(21, 96, qtype, seed=3)
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(1))
    alone = torch.empty(9, 21)
    for i in range(9):
        ops.gguf_linear(alone[i:i + 1], x[i:i + 1], qweight, int(qtype))
    for m in range(2, 10):
        batch = torch.empty(m, 21)
        ops.gguf_linear(batch, x[:m], qweight, int(qtype))
        assert torch.equal(bits(batch), bits(alone[:m])), m
    wide = torch.zeros(9, 40)
    ops.gguf_linear(wide[:, 5:26], x, qweight, int(qtype))
    assert torch.equal(bits(wide[:, 5:26]), bits(alone))
    assert not wide[:, :5].any() and not wide[:, 26:].any()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_reference_ops_dequantize_then_matmul(qtype):
    qweight, w = quantized(10, 64, qtype)
    x = torch.randn(3, 64)
    out = torch.empty(3, 10)
    TorchOps().gguf_linear(out, x, qweight, int(qtype))
    assert torch.equal(out, F.linear(x, w))


class _Layer:                      # what GGUFLinearMethod.apply reads of a layer
    def __init__(self, ops):
        self.ops = ops


def test_linear_method_runs_mixed_segments_as_one_dequantized_matrix(ops):
    """q, k, v of three types and an F32 part (a Q4_K_M file mixes types in one fused
    layer): each segment computes its columns; neighbours of one type are joined."""
    parts = [(T.Q8_0, 8), (T.Q4_0, 6), (T.Q4_0, 5), (T.Q4_1, 7), (T.F32, 3)]
    method, whole, start = GGUFLinearMethod(29, 64), [], 0
    for i, (qtype, rows) in enumerate(parts):
        if qtype == T.F32:
            w = torch.randn(rows, 64)
            method.add(f"part{i}", start, int(qtype), w)
        else:
            qweight, w = quantized(rows, 64, qtype, seed=i)
            method.add(f"part{i}", start, int(qtype), qweight)
        whole.append(w)
        start += rows
    method.finalize("layer")
    assert [s.rows for s in method.segments] == [8, 11, 7, 3]
    x = torch.randn(4, 64)
    want = ops.linear(x, torch.cat(whole))
    assert torch.equal(bits(method.apply(_Layer(ops), x)), bits(want))
    assert method.nbytes == 8 * 2 * 34 + 11 * 2 * 18 + 7 * 2 * 20 + 3 * 64 * 4


def test_unsupported_type_is_an_error_naming_tensor_and_type():
    method = GGUFLinearMethod(32, 256)
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_q\.weight'.*Q4_K"):
        method.add("blk.0.attn_q.weight", 0, int(T.Q4_K), torch.zeros(32, 144, dtype=torch.uint8))


def test_missing_rows_are_an_error_naming_the_layer():
    method = GGUFLinearMethod(16, 32)
    method.add("blk.0.attn_k.weight", 0, int(T.Q8_0), quantized(8, 32, T.Q8_0)[0])
    with pytest.raises(ValueError, match="layers.0.self_attn.qkv_proj.*8 of its 16 rows"):
        method.finalize("layers.0.self_attn.qkv_proj")


def test_kernel_refuses_packed_rows_of_the_wrong_width(ops):
    with pytest.raises(RuntimeError, match="qweight must be contiguous uint8"):
        ops.gguf_linear(torch.empty(1, 4), torch.randn(1, 64), torch.zeros(4, 34, dtype=torch.uint8), int(T.Q8_0))
