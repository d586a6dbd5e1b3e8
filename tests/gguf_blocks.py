"""K-quant blocks (Q4_K, Q5_K, Q6_K) written in llama.cpp's layout, for the tests: the
`gguf` package reads them (gguf.quants.dequantize) but has no quantizer for them.

`quantize` is a small, honest quantizer: per sub-block the range (Q4_K/Q5_K: scale and
min, Q6_K: a signed scale), the super-block's fp16 d (and dmin) the largest over 63 (127),
each sub-block's 6-bit (int8) multiple of it, and q the nearest level. llama.cpp's own
(make_qkx2_quants) searches for better scales; the bytes' layout is what matters here, and
`test_gguf_linear.py` checks it against gguf's dequantizer: the round trip lands within a
step of each weight. Other types go to gguf.quants.quantize.
"""
from __future__ import annotations

import gguf
import numpy as np
from error_bounds import assert_within, matmul_bound

from nanopaged.quantization.gguf import dequantize
from nanopaged.quantization.gguf_a8 import quantize_activations

T = gguf.GGMLQuantizationType
QK_K = 256


def _f16(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fp16 bytes uint8 [..., 2], the values widened back to float32 [...])."""
    h = a.astype(np.float16)
    return h[..., None].view(np.uint8), h.astype(np.float32)


def _levels(x: np.ndarray, step: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """round(x / step) clipped to [lo, hi]; 0 where step is 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step > 0, np.rint(x / np.where(step > 0, step, 1)), 0)
    return np.clip(q, lo, hi)


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins [..., 8] -> Q4_K's 12 bytes (gguf's Q4_K.get_scale_min inverted)."""
    out = np.empty((*sc.shape[:-1], 12), np.uint8)
    out[..., 0:4] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    out[..., 4:8] = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    return out


def _q45k(x: np.ndarray, bits: int) -> np.ndarray:
    """[n, blocks, 256] -> Q4_K (bits 4) or Q5_K (bits 5) blocks [n, blocks, 144 or 176]."""
    qmax = (1 << bits) - 1
    sub = x.reshape(*x.shape[:-1], 8, 32)
    lo = np.minimum(sub.min(-1), 0)
    scale, mins = (sub.max(-1) - lo) / qmax, -lo                        # [n, blocks, 8]
    d_bytes, d = _f16(scale.max(-1) / 63)
    dmin_bytes, dmin = _f16(mins.max(-1) / 63)
    sc = _levels(scale, d[..., None], 0, 63).astype(np.uint8)
    mn = _levels(mins, dmin[..., None], 0, 63).astype(np.uint8)
    step, offset = d[..., None] * sc, dmin[..., None] * mn
    q = _levels(sub + offset[..., None], step[..., None], 0, qmax).astype(np.uint8)   # [n, blocks, 8, 32]
    low = q & 15
    qs = (low[..., 0::2, :] | (low[..., 1::2, :] << 4)).reshape(*x.shape[:-1], 128)
    parts = [d_bytes, dmin_bytes, _pack_scales(sc, mn)]
    if bits == 5:                                                        # bit s of byte l: q[s, l] >> 4
        parts.append(((q >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(-2, dtype=np.uint8))
    return np.concatenate([*parts, qs], axis=-1)


def _q6k(x: np.ndarray) -> np.ndarray:
    """[n, blocks, 256] -> Q6_K blocks [n, blocks, 210]."""
    sub = x.reshape(*x.shape[:-1], 16, 16)
    scale = np.abs(sub).max(-1) / 31                                     # q in -31..31
    d_bytes, d = _f16(scale.max(-1) / 127)
    sc = _levels(scale, d[..., None], -128, 127).astype(np.int8)
    q = (_levels(sub, (d[..., None] * sc)[..., None], -32, 31) + 32).astype(np.uint8)
    q = q.reshape(*x.shape[:-1], 2, 4, 32)                               # [.., half h, j, l]: element 128h + 32j + l
    low = (q & 15).reshape(*x.shape[:-1], 2, 2, 64)                      # element 128h + 64i + l'
    ql = (low[..., 0, :] | (low[..., 1, :] << 4)).reshape(*x.shape[:-1], 128)
    qh = ((q >> 4) << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(-2, dtype=np.uint8).reshape(*x.shape[:-1], 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d_bytes], axis=-1)


def quantize(w: np.ndarray, qtype: T) -> np.ndarray:
    """float32 [n, k] -> packed rows uint8 [n, k / QK * block bytes] of GGML type `qtype`,
    in llama.cpp's layout (k a multiple of 256 for the K-quants)."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if qtype not in (T.Q4_K, T.Q5_K, T.Q6_K):
        return gguf.quants.quantize(w, qtype)
    if w.shape[-1] % QK_K:
        raise ValueError(f"{qtype.name} needs rows of whole super-blocks of {QK_K}, got {w.shape}")
    x = w.reshape(w.shape[0], -1, QK_K)
    blocks = _q6k(x) if qtype == T.Q6_K else _q45k(x, 4 if qtype == T.Q4_K else 5)
    return blocks.reshape(w.shape[0], -1)


def random_quantized(n: int, k: int, qtype, seed: int = 0):
    """A random [n, k] matrix (N(0.3, 1)) quantized to qtype: (packed uint8 rows, its
    dequantized float32 [n, k], nanopaged's dequantize)."""
    import torch
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) + 0.3
    q = torch.from_numpy(quantize(w, qtype).copy())
    return q, dequantize(q, int(qtype))


def kernel_roundings(k: int) -> int:
    """fp32 roundings a term of gguf_linear_a8's sum passes at most: its block's scales
    (d_x * d_w, the integer sum times it; K-quants a sub-block scale and a min: 4), one
    addition per block of 32 in its lane's chain (k / 32) and the lanes' tree (4)."""
    return k // 32 + 8


def assert_both_near_the_exact_product(got, want, x, qw, type_id: int) -> None:
    """The kernel's `got` and the PyTorch reference's `want` of gguf_linear_a8 on the same x
    are each the product of x's rounded values and the dequantized weights (float64)
    within their own fp32 error: the kernel's chain of blocks (kernel_roundings), the
    reference's x_hat = qx * dx (one rounding) and F.linear's sum of k terms (up to k
    additions and a product)."""
    k = x.shape[1]
    qx, dx, _ = quantize_activations(x)
    x_hat = (qx.double().view(x.shape[0], -1, 32) * dx.double()[..., None]).view(x.shape)
    w = dequantize(qw, type_id)
    exact = x_hat @ w.double().T
    assert_within(got, exact, matmul_bound(x_hat, w, kernel_roundings(k)))
    assert_within(want, exact, matmul_bound(x_hat, w, k + 2))
