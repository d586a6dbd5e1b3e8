"""GGUF blocks against int8 activations (`activation_quantization="int8"`, with
quantization="gguf"): llama.cpp's own way to run its files on a CPU (ggml-quants.c: a
Q4_1 matrix's `vec_dot_type` is Q8_1, a Q4_0 / Q8_0 one's Q8_0). vLLM's GGUF kernels do the
same on the GPU (`ggml_mul_mat_vec_a8`: "a8", activations in 8 bits).

Each row of a projection's input x is cut into blocks of 32 and each block rounded to int8:

    dx = max |x_block| / 127,   qx = round(x_block / dx)  (half to even; via x * (1 / dx))

and the block's dot product with a weight block w = dw * q + c (c: Q4_1's m, Q4_0's -8 dw,
Q5_0's -16 dw, Q5_1's m, Q4_K's and Q5_K's -(dmin * mn) of the 32-weight sub-block, Q8_0's 0;
the Q5 types' q 0..31 with its fifth bit) is

    x . w  ~  (dw * dx) * (q . qx)  +  c * (dx * sum(qx))

A Q6_K block is two sub-blocks of 16 with their own scales and signed q - 32 (no c): its
8 lanes of 4 products each take dw * dx with their sub-block's dw (lanes 0-3, then 4-7).
Here q . qx is a sum of small integers, exact in int32: AVX2's vpmaddubsw multiplies 32
unsigned q by 32 signed qx and adds pairs in one instruction, where the exact path widens
each weight to fp32 and spends two FMAs on it. At batch 1 the exact path is bound by that
widening, not by DRAM (chapter 21), so SmolLM2's matmuls of a batch-1 step take less
time here (the kernel: kernels/cpu/quant/gguf_a8.cpp, namespace a8; the runs:
benchmarks/RESULTS.md). The price: x keeps 8 bits a value (a relative error up to 1/254 of its
block's largest value), so the logits move, and the greedy ids can part from the exact
model's (chapter 21's accuracy table: greedy agreement and mean |delta logprob|). The
kernel is deterministic and batch-invariant like the exact one: each (row of x, row of W)
pair is summed in one fixed order whatever the batch.

Every block format the engine loads runs here (float segments keep the exact path); a
Q4_K_M file (Q4_K and Q6_K) or a Q5_K_M one (Q5_K and Q6_K) runs here whole. It gains
most at one row of x, where the widening binds; from 8 rows on, the exact path reuses
each widened weight across the rows and the two come near each other.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from .gguf import Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, GGUFLinearMethod, Segment, dequantize
from .kernels import quant_kernel

logger = logging.getLogger(__name__)
A8_TYPES = frozenset(f.type_id for f in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K))   # run against int8 x
QK = 32                                                    # activations' block


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x float32 [m, k] (k a multiple of 32) -> (qx int8 [m, k], dx float32 [m, k / 32],
    sx float32 [m, k / 32]): per block of 32, dx = max |x| / 127, qx = round(x * (1 / dx))
    (half to even; 0 where dx = 0), sx = dx * sum(qx). The kernel's rounding bit for bit
    (ops.quantize_activations_a8)."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // QK, QK)
    dx = blocks.abs().amax(dim=-1) / 127
    inv = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    q = torch.round(blocks * inv[..., None]).clamp_(-127, 127)
    return q.to(torch.int8).reshape(m, k), dx, dx * q.sum(dim=-1)


def gguf_linear_a8(ops, out: torch.Tensor, x: torch.Tensor, qweight: torch.Tensor, type_id: int) -> None:
    """gguf.gguf_linear with x first rounded to int8 blocks of 32 (every block format).

    With x float32 and a kernel backend that has it (`quant_kernel(ops, "gguf_linear_a8")`,
    the CPU kernel): integer block dots, batch-invariant. Otherwise the PyTorch reference: x's
    rounded values times the dequantized weights, F.linear (the kernel's result within
    fp32 summation error, not its bits)."""
    kernel = quant_kernel(ops, "gguf_linear_a8")
    if kernel is None or x.dtype != torch.float32:
        qx, dx, _ = quantize_activations(x)
        x_hat = (qx.float().view(x.shape[0], -1, 32) * dx[..., None]).view(x.shape)
        out.copy_(F.linear(x_hat, dequantize(qweight, type_id)))
        return
    kernel(out, x.contiguous(), qweight, type_id)


class GGUFA8LinearMethod(GGUFLinearMethod):
    """A GGUFLinearMethod whose block-format segments multiply int8-rounded x
    (`gguf_linear_a8`); apply's shapes and dtypes as GGUFLinearMethod's."""

    def segment_matmul(self, layer, cols: torch.Tensor, x: torch.Tensor, seg: Segment) -> None:
        if seg.type_id in A8_TYPES:
            gguf_linear_a8(layer.ops, cols, x, seg.weight, seg.type_id)
        else:
            super().segment_matmul(layer, cols, x, seg)


class Int8ActivationsModel:
    """A GGUF model (GGUFQuantizedModel, which this class precedes) whose linear methods
    round x to int8 blocks (the feature "int8 activations", features.py):
    after the file's weights are read, each GGUFLinearMethod becomes a GGUFA8LinearMethod
    (the same segments; the LM head's too, as llama.cpp's)."""

    def load_weights(self, folder) -> None:
        super().load_weights(folder)
        segments = []
        for module in self.modules():
            method = getattr(module, "quant_method", None)
            if type(method) is GGUFLinearMethod:
                method.__class__ = GGUFA8LinearMethod
                segments += method.segments
        a8 = sum(s.type_id in A8_TYPES for s in segments)
        rest = len(segments) - a8
        logger.info("activation_quantization='int8': %d of %d weight segments multiply int8 x (the block "
                    "formats)%s", a8, len(segments), f"; the other {rest} (float) stay exact" if rest else "")
