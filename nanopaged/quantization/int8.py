"""Weight-only int8 for Hugging Face checkpoints (`quantization="int8"`): per output channel,
symmetric. vLLM: `vllm/model_executor/layers/quantization/` (its W8A16 methods; the
per-channel scale is compressed-tensors' "channel" strategy).

Each row of a projection's weight W [n, k] gets one fp32 scale and k int8s:

    scale[row] = max |W[row]| / 127,   q = round(W / scale) clamped to [-127, 127]

and the "dequantized model" is q * scale in fp32 (`dequantize`). A layer keeps q and
scale (1 byte a weight where fp32 keeps 4); its matmul (`int8_linear`: the kernel's,
kernels/cpu/quant/int8.cpp) widens q, multiplies by the row's scale (one rounding,
as here) and sums as the fp32 `linear` does, so it equals the fp32 matmul on the
dequantized weights bit for bit. The embedding and the LM head stay fp32, as vLLM keeps
lm_head unquantized for its weight-only methods: the head's rounding goes straight into
the logits that are sampled, and a tied head is the embedding itself.

The weights load as fp32 (the family's own load_weights, this rank's rows or columns)
and each projection is then quantized (vLLM: process_weights_after_loading). A
row-parallel rank holds only some columns of a row, so its scale is taken from the whole
row, read at load: every rank's q and scale are the tp = 1 model's slices.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..layers.parallel import ColumnParallelLinear, RowParallelLinear
from .kernels import join_quant_kernels, quant_kernel

QMAX = 127                          # symmetric: -127..127 (-128 unused)


def quantize(weight: torch.Tensor, absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [n, k] -> (q int8 [n, k], scale float32 [n]), per row: scale = absmax / 127
    (absmax: max |row|, default this weight's; a zero row gets scale 1 and q = 0),
    q = round(weight / scale) (half to even) clamped to [-127, 127]."""
    w = weight.float()
    if absmax is None:
        absmax = w.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax.float() / QMAX, torch.ones_like(absmax, dtype=torch.float32))
    q = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(q int8 [n, k], scale float32 [n]) -> float32 [n, k] = q * scale, one rounding each."""
    return q.float() * scale[:, None]


def int8_linear(ops, x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [m, k] float32 @ (qweight int8 [n, k] * scale float32 [n] per row)^T -> [m, n]
    float32.

    With x float32 and a kernel backend that has it (`quant_kernel(ops, "int8_linear")`,
    the CPU kernel): each row widened and scaled in registers, summed as `ops.linear` sums the
    dequantized weights (the same bits, batch-invariant). Otherwise the PyTorch
    reference: dequantized, then F.linear."""
    kernel = quant_kernel(ops, "int8_linear")
    if kernel is None or x.dtype != torch.float32:
        return F.linear(x, dequantize(qweight, scale))
    out = torch.empty(x.shape[0], qweight.shape[0], dtype=torch.float32)
    kernel(out, x.contiguous(), qweight, scale)
    return out


class Int8LinearMethod:
    """A linear layer's weight as int8 rows and their scales, and its matmul: the layer's
    `quant_method`, which layers/parallel.py's `_linear` calls instead of its own.

    Args:
        qweight: int8 [n, k], this rank's rows (or columns) of the weight.
        scale: float32 [n], each row's scale (of the whole row).

    apply(layer, x [m, k] float32 or bfloat16) -> y [m, n] in out_dtype (default x's
    dtype): x widened to float32 first, y rounded once at the end.
    """

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        if qweight.dtype != torch.int8 or scale.dtype != torch.float32 or scale.shape != qweight.shape[:1]:
            raise ValueError(f"Int8LinearMethod needs int8 [n, k] and float32 [n], got {qweight.dtype} "
                             f"{tuple(qweight.shape)} and {scale.dtype} {tuple(scale.shape)}")
        self.qweight, self.scale = qweight.contiguous(), scale.contiguous()

    @property
    def nbytes(self) -> int:
        """Bytes the layer's weight takes: the int8 rows and the fp32 scales."""
        return self.qweight.numel() + self.scale.numel() * 4

    def bytes_by_format(self) -> dict[str, int]:
        """nbytes by format, as the tracer and dashboard show it: the rows as "int8", the
        scales as "float32"."""
        return {"int8": self.qweight.numel(), "float32": self.scale.numel() * 4}

    def apply(self, layer, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        out_dtype = out_dtype or x.dtype
        y = int8_linear(layer.ops, x.float(), self.qweight, self.scale)
        return y if out_dtype == torch.float32 else y.to(out_dtype)


def quantized_layers(model: torch.nn.Module):
    """(name, layer) of every projection int8 quantizes: the column- and row-parallel
    linears (qkv_proj, o_proj, gate_up_proj, down_proj); not the embedding or LM head."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]


class Int8QuantizedModel:
    """A model family class whose projections are quantized to int8 after loading (the
    feature "int8 weights", features.py).

    load_weights(folder): the family's load (the projections read in float32, whatever the
    model's dtype), then each projection's fp32 weight is replaced by an Int8LinearMethod
    (the weight freed).
    """

    def set_ops(self, ops) -> None:
        join_quant_kernels(ops)         # at load, before any CPU graph is captured (kernels.py)
        super().set_ops(ops)

    def load_weights(self, folder) -> None:
        self._row_absmax: dict[str, torch.Tensor] = {}
        for _, layer in quantized_layers(self):      # read in float32 whatever the dtype: the same
            layer.weight.data = layer.weight.data.float()    # q and scales in float32 and bfloat16
        super().load_weights(folder)
        for name, layer in quantized_layers(self):
            q, scale = quantize(layer.weight.data, self._row_absmax.pop(name, None))
            layer.weight, layer.quant_method = None, Int8LinearMethod(q, scale)     # the fp32 weight is freed
        del self._row_absmax

    def _load_one(self, name: str, src, file):
        """The family's `_load_one`; for a row-parallel weight split over ranks, also each
        whole row's max |w| (this rank holds only some of its columns)."""
        key = super()._load_one(name, src, file)
        layer_name = key.removesuffix(".weight") if key and key.endswith(".weight") else None
        if layer_name is not None:
            layer = self.get_submodule(layer_name)
            if isinstance(layer, RowParallelLinear) and layer.tp.size > 1:
                self._row_absmax[layer_name] = src[:].float().abs().amax(dim=1)
        return key
