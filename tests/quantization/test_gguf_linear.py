"""GGUF's block formats (Q8_0, Q4_0/1, Q5_0/1 and the K-quants Q4_K, Q5_K, Q6_K) in the
layers: the PyTorch dequantizer and the CPU kernel `gguf_linear`
(kernels/cpu/quant/gguf.cpp) against the `gguf` package's reference,
`gguf.quants.dequantize`. gguf has no quantizer for the K-quants: tests/gguf_blocks.py
writes their blocks in llama.cpp's layout (its round trip is checked here).

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
from gguf_blocks import quantize

from nanopaged.layers import build
from nanopaged.layers.backends import TorchOps, get_ops
from nanopaged.quantization.gguf import BLOCK_FORMATS, GGUFLinearMethod, dequantize, gguf_linear
from nanopaged.quantization.kernels import join_quant_kernels, load_quant_kernels, quant_kernel

T = gguf.GGMLQuantizationType
TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]
K_QUANTS = [T.Q4_K, T.Q5_K, T.Q6_K]
# (m, k, n): m = 1 (decode) and batches; k odd and even multiples of 32; n not a multiple of 4
SHAPES = [(1, 32, 1), (1, 96, 7), (2, 64, 13), (3, 160, 45), (5, 96, 33), (17, 96, 6), (40, 64, 9)]
# the K-quants' rows are whole super-blocks of 256
K_SHAPES = [(1, 256, 7), (2, 512, 13), (5, 768, 33), (17, 256, 6)]
CASES = [(t, *shape) for t in TYPES for shape in (K_SHAPES if t in K_QUANTS else SHAPES)]
# where each format keeps its fp16 scales: d, then m / dmin if it has one
HALVES = {T.Q8_0: [0], T.Q4_0: [0], T.Q5_0: [0], T.Q4_1: [0, 2], T.Q5_1: [0, 2], T.Q4_K: [0, 2],
          T.Q5_K: [0, 2], T.Q6_K: [208]}


def qk(qtype) -> int:
    return BLOCK_FORMATS[int(qtype)].block_weights


@pytest.fixture(scope="module")
def ops():
    ops = get_ops("cpu", "cpu")
    join_quant_kernels(ops)                    # as a layer's first quantized matmul does
    assert hasattr(ops.ops, "gguf_linear"), "the CPU kernel has no gguf_linear"
    return ops


def quantized(n: int, k: int, qtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random [n, k] matrix quantized (gguf's quantizer, gguf_blocks' for K-quants):
    (packed uint8 rows, gguf's dequantized fp32)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) + 0.3
    q = quantize(w, qtype)
    return torch.from_numpy(q.copy()), torch.from_numpy(gguf_dequantize(q, qtype).reshape(n, k).copy())


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_equals_gguf_reference_bit_for_bit(qtype):
    """Random bytes (every nibble, 5th bit and packed 6-bit scale pattern, which a
    quantizer would write only some of) with finite fp16 scales and mins of sane size
    (subnormals and negatives included: random fp16 bits would be NaNs and infinities)."""
    rng = np.random.default_rng(int(qtype))
    size, k = BLOCK_FORMATS[int(qtype)].block_bytes, 5 * qk(qtype)
    raw = rng.integers(0, 256, (40, 5 * size), dtype=np.uint8)
    blocks = raw.reshape(40, 5, size)
    scales = (rng.standard_normal((40, 5, 2)) * np.array([1e-2, 1.0])).astype(np.float16)
    scales[0, 0, 0] = np.float16(3e-7)                     # a subnormal scale
    for i, at in enumerate(HALVES[qtype]):
        blocks[..., at:at + 2] = scales[..., i:i + 1].view(np.uint8)
    want = torch.from_numpy(gguf_dequantize(raw, qtype).reshape(40, k).copy())
    got = dequantize(torch.from_numpy(raw), int(qtype))
    assert got.dtype == torch.float32 and got.shape == (40, k)
    assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("qtype,bound", [(T.Q4_K, 0.12), (T.Q5_K, 0.06), (T.Q6_K, 0.03)], ids=lambda t: str(t))
def test_k_quant_blocks_are_written_in_llama_cpps_layout(qtype, bound):
    """gguf_blocks.quantize, read back by gguf's dequantizer, gives the weights within the
    format's rounding (relative RMS error; bytes in a wrong place would scramble them: ~1.4)."""
    w = np.random.default_rng(1).standard_normal((6, 512)).astype(np.float32) + 0.3
    q = quantize(w, qtype)
    assert q.dtype == np.uint8 and q.shape == (6, 2 * BLOCK_FORMATS[int(qtype)].block_bytes)
    back = gguf_dequantize(q, qtype).reshape(w.shape)
    assert np.sqrt(np.mean((back - w) ** 2) / np.mean(w ** 2)) < bound


@pytest.mark.parametrize("qtype,m,k,n", CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_kernel_equals_fp32_linear_on_dequantized_weights(ops, qtype, m, k, n):
    qweight, w = quantized(n, k, qtype, seed=m + k + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    out = torch.empty(m, n)
    gguf_linear(ops, out, x, qweight, int(qtype))
    assert torch.equal(bits(out), bits(ops.linear(x, w)))               # our fp32 kernel, bit for bit
    tol = 1e-5 * max(1, k / 256)                                        # fp32 summation error grows with k
    torch.testing.assert_close(out, F.linear(x, w), rtol=tol, atol=tol)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_kernel_rows_are_batch_invariant(ops, qtype):
    """A row's result alone (m = 1) equals its result in batches of every size, across all
    three of the kernel's paths (widened in registers below kPanelFrom rows, 3 or 12; a
    32-row panel below kWholeFrom, 1024; the whole matrix widened from there, its rows of
    x in linear_kernel's L2-sized chunks: 85 rows at this k of 768), and in a column slice
    of a wider output (a fused layer's segment). 33 weight rows: tasks of 32 and 1, so the
    tiles' short last groups (AVX2's 3 weight rows a tile: 2 left, then 1) are run too."""
    k = 768                                              # three K-quant super-blocks, 24 blocks of 32
    qweight, _ = quantized(33, k, qtype, seed=3)
    x = torch.randn(1100, k, generator=torch.Generator().manual_seed(1))
    alone = torch.empty(1100, 33)
    for i in range(1100):
        gguf_linear(ops, alone[i:i + 1], x[i:i + 1], qweight, int(qtype))
    for m in [*range(2, 19), 85, 86, 190, 1023, 1024, 1100]:
        batch = torch.empty(m, 33)
        gguf_linear(ops, batch, x[:m], qweight, int(qtype))
        assert torch.equal(bits(batch), bits(alone[:m])), m
    for m in (13, 190, 1100):
        wide = torch.zeros(m, 44)
        gguf_linear(ops, wide[:, 5:38], x[:m], qweight, int(qtype))
        assert torch.equal(bits(wide[:, 5:38]), bits(alone[:m])), m
        assert not wide[:, :5].any() and not wide[:, 38:].any()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_reference_ops_dequantize_then_matmul(qtype):
    qweight, w = quantized(10, 256, qtype)
    x = torch.randn(3, 256)
    out = torch.empty(3, 10)
    gguf_linear(TorchOps(), out, x, qweight, int(qtype))
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


def test_linear_method_runs_a_q4_k_m_mix(ops):
    """A Q4_K_M file's layer: Q4_K and Q6_K matrices (and a Q8_0 one) side by side."""
    parts = [(T.Q4_K, 8), (T.Q4_K, 4), (T.Q6_K, 5), (T.Q8_0, 3)]
    method, whole, start = GGUFLinearMethod(20, 512), [], 0
    for i, (qtype, rows) in enumerate(parts):
        qweight, w = quantized(rows, 512, qtype, seed=i)
        method.add(f"part{i}", start, int(qtype), qweight)
        whole.append(w)
        start += rows
    method.finalize("layer")
    assert [(s.type_id, s.rows) for s in method.segments] == [(int(T.Q4_K), 12), (int(T.Q6_K), 5), (int(T.Q8_0), 3)]
    x = torch.randn(3, 512)
    assert torch.equal(bits(method.apply(_Layer(ops), x)), bits(ops.linear(x, torch.cat(whole))))
    assert method.nbytes == 12 * 2 * 144 + 5 * 2 * 210 + 3 * 16 * 34


def test_k_quant_rows_must_be_whole_super_blocks():
    method = GGUFLinearMethod(4, 96)
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_up\.weight' \(Q4_K\): its 96 columns are not whole "
                                         r"blocks of 256"):
        method.add("blk.0.ffn_up.weight", 0, int(T.Q4_K), torch.zeros(4, 54, dtype=torch.uint8))


def test_unsupported_type_is_an_error_naming_tensor_and_type():
    method = GGUFLinearMethod(32, 256)
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_q\.weight'.*Q2_K"):
        method.add("blk.0.attn_q.weight", 0, int(T.Q2_K), torch.zeros(32, 84, dtype=torch.uint8))


def test_missing_rows_are_an_error_naming_the_layer():
    method = GGUFLinearMethod(16, 32)
    method.add("blk.0.attn_k.weight", 0, int(T.Q8_0), quantized(8, 32, T.Q8_0)[0])
    with pytest.raises(ValueError, match="layers.0.self_attn.qkv_proj.*8 of its 16 rows"):
        method.finalize("layers.0.self_attn.qkv_proj")


def test_kernel_refuses_packed_rows_of_the_wrong_width(ops):
    with pytest.raises(RuntimeError, match="qweight must be contiguous uint8"):
        gguf_linear(ops, torch.empty(1, 4), torch.randn(1, 64), torch.zeros(4, 34, dtype=torch.uint8), int(T.Q8_0))
    with pytest.raises(RuntimeError, match="k a multiple of 256"):
        gguf_linear(ops, torch.empty(1, 4), torch.randn(1, 96), torch.zeros(4, 54, dtype=torch.uint8), int(T.Q4_K))
    with pytest.raises(RuntimeError, match="GGML type 10 is not supported"):
        gguf_linear(ops, torch.empty(1, 4), torch.randn(1, 256), torch.zeros(4, 84, dtype=torch.uint8), int(T.Q2_K))


def test_the_kernels_are_an_extension_of_their_own_joined_to_the_cpu_backend():
    """The base CPU extension has no quantized matmul. A layer's first one joins the
    quantization extension to its backend, so its calls go through the backend's `ops` as
    the base's do (what a CPU graph records); the reference backend has none."""
    ops = get_ops("cpu", "cpu")
    assert ops.kernel("gguf_linear") is None and not hasattr(build.load_kernels("cpu"), "int8_linear")
    assert quant_kernel(ops, "gguf_linear") is ops.ops.gguf_linear is load_quant_kernels().gguf_linear
    assert ops.ops.paged_attention is build.load_kernels("cpu").paged_attention
    assert quant_kernel(TorchOps(), "gguf_linear") is None
