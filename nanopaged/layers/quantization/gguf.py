"""GGUF's block-quantized linear weights, run as the file stores them. vLLM:
`vllm/model_executor/layers/quantization/gguf.py` (GGUFLinearMethod).

llama.cpp (ggml-quants.c) stores a matrix W [n, k] row by row, each row k / 32 blocks of
32 weights along k. A block is a scale d (fp16) and 32 small integers q:

    Q8_0  34 bytes: d, 32 int8                   w = q * d
    Q4_0  18 bytes: d, 16 bytes of nibbles       w = (q - 8) * d
    Q4_1  20 bytes: d, m (fp16), 16 bytes        w = q * d + m

and in a Q4 block the low nibble of byte i is weight i, the high nibble weight i + 16.
A layer keeps those bytes (uint8 [rows, k / 32 * block bytes]): SmolLM2's Q4_1 file is
5 bits a weight where fp32 is 32, and a decode step is a walk through the weights. Its
matmul (`ops.gguf_linear`, kernels/paged_attention_cpu.cpp) widens each block in
registers and sums exactly as the fp32 matmul does on the dequantized weights, bit for
bit. `dequantize` is the plain-PyTorch reference, equal to `gguf.quants.dequantize`.

A fused layer (qkv_proj, gate_up_proj) stacks several of the file's matrices, which may
have different types (a Q4_K_M file mixes them), so a layer holds segments: runs of rows
of one type, each computing its columns of y. F32/F16/BF16 matrices are widened to fp32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..parallel import VocabParallelEmbedding

QK = 32                                     # weights per block (QK4_0, QK4_1, QK8_0)


@dataclass(frozen=True)
class BlockFormat:
    """One GGML block type: its name, GGML's number and bytes per block of QK weights."""

    name: str
    type_id: int
    block_bytes: int


# GGML's numbers (gguf.GGMLQuantizationType)
Q4_0, Q4_1, Q8_0 = BlockFormat("Q4_0", 2, 18), BlockFormat("Q4_1", 3, 20), BlockFormat("Q8_0", 8, 34)
BLOCK_FORMATS = {f.type_id: f for f in (Q4_0, Q4_1, Q8_0)}
FLOAT_TYPES = {0: "F32", 1: "F16", 30: "BF16"}      # widened to fp32 at load


def type_name(type_id: int) -> str:
    """GGML's name for a type number ("Q4_K" for 12), or the number itself if unknown."""
    import gguf

    try:
        return gguf.GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type {type_id}"


def check_type(name: str, type_id: int) -> None:
    """Raise ValueError naming the tensor and its type unless a layer runs that type."""
    if type_id not in BLOCK_FORMATS and type_id not in FLOAT_TYPES:
        supported = ", ".join([f.name for f in BLOCK_FORMATS.values()] + list(FLOAT_TYPES.values()))
        raise ValueError(f"GGUF tensor {name!r} has type {type_name(type_id)}, which quantization='gguf' "
                         f"does not run yet (supported: {supported})")


def dequantize(qweight: torch.Tensor, type_id: int) -> torch.Tensor:
    """The packed rows uint8 [n, k / 32 * block bytes] of a Q8_0 / Q4_0 / Q4_1 matrix ->
    float32 [n, k]: gguf.quants.dequantize's values bit for bit (d widened from fp16, then
    q * d, (q - 8) * d or q * d + m, each op rounded to fp32)."""
    fmt = BLOCK_FORMATS[type_id]
    n = qweight.shape[0]
    blocks = qweight.reshape(n, -1, fmt.block_bytes)             # [n, k / 32, block bytes]
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [n, k / 32, 1]
    if fmt is Q8_0:
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (q * d).reshape(n, -1)
    if fmt is Q4_1:
        return dequantize_q4_1(qweight)
    nibbles = blocks[..., 2:]
    q = torch.cat((nibbles & 0xF, nibbles >> 4), dim=-1)          # low nibbles: weights 0..15
    return ((q.to(torch.int8) - 8).float() * d).reshape(n, -1)


def dequantize_q4_1(qweight: torch.Tensor) -> torch.Tensor:
    """The packed rows uint8 [n, k / 32 * 20] of a Q4_1 matrix -> float32 [n, k]
    (exercise 21). Each 20-byte block holds 32 weights: d (fp16, bytes 0-1), m (fp16,
    bytes 2-3), then 16 bytes whose low nibble of byte i is q of weight i and high nibble
    q of weight i + 16; w = q * d + m, d and m widened to float32 first, then one fp32
    multiply and one fp32 add (gguf.quants.dequantize's values, bit for bit)."""
    n = qweight.shape[0]
    blocks = qweight.reshape(n, -1, 20)                           # [n, k / 32, 20]
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [n, k / 32, 1]
    m = blocks[..., 2:4].contiguous().view(torch.float16).float()
    nibbles = blocks[..., 4:]                                     # [n, k / 32, 16]
    q = torch.cat((nibbles & 0xF, nibbles >> 4), dim=-1)          # low nibbles: weights 0..15
    return (q.float() * d + m).reshape(n, -1)


@dataclass
class Segment:
    """Rows [start, start + rows) of a layer's weight, in one type.

    Attributes:
        start: the first row (the first column of y it computes).
        type_id: a BLOCK_FORMATS key, or 0 (F32) for a widened matrix.
        weight: uint8 [rows, k / 32 * block bytes] packed, or float32 [rows, k].
    """

    start: int
    type_id: int
    weight: torch.Tensor

    @property
    def rows(self) -> int:
        return self.weight.shape[0]


class GGUFLinearMethod:
    """A linear layer's weight as GGUF stores it, and its matmul: the layer's
    `quant_method`, which layers/parallel.py's `_linear` calls instead of its own.

    Args:
        output_size: rows of the layer's whole weight (columns of y).
        input_size: k, a multiple of 32 for the block types.

    apply(layer, x [m, k] float32) -> y [m, output_size] float32 (out_dtype if given).
    """

    def __init__(self, output_size: int, input_size: int) -> None:
        self.output_size, self.input_size = output_size, input_size
        self.segments: list[Segment] = []

    def add(self, name: str, start: int, type_id: int, data: torch.Tensor) -> None:
        """Rows [start, start + len(data)) from the file's tensor `name`: packed bytes
        (uint8 [rows, row bytes]) of a block type, or float values ([rows, k]) of F32/F16/BF16.

        Raises:
            ValueError: an unsupported type, or a shape that does not fit the layer
                (each naming the tensor).
        """
        check_type(name, type_id)
        fmt = BLOCK_FORMATS.get(type_id)
        k = self.input_size
        if fmt is not None:
            if k % QK:
                raise ValueError(f"GGUF tensor {name!r}: its {k} columns are not whole blocks of {QK}")
            expected = (data.shape[0], k // QK * fmt.block_bytes)
        else:
            data, type_id = data.float(), 0
            expected = (data.shape[0], k)
        if data.dim() != 2 or tuple(data.shape) != expected or start + data.shape[0] > self.output_size:
            raise ValueError(f"GGUF tensor {name!r} ({type_name(type_id)}) has shape {tuple(data.shape)}, "
                             f"expected {expected} at rows {start}.. of {self.output_size}")
        self.segments.append(Segment(start, type_id, data.contiguous()))

    def finalize(self, layer_name: str) -> None:
        """Order the segments, join neighbours of one type (one kernel call for q, k and v
        when they share a type), and check they cover every row once.

        Raises:
            ValueError: rows missing or given twice (naming the layer).
        """
        merged: list[Segment] = []
        for seg in sorted(self.segments, key=lambda s: s.start):
            last = merged[-1] if merged else None
            if last is not None and last.type_id == seg.type_id and last.start + last.rows == seg.start:
                merged[-1] = Segment(last.start, last.type_id, torch.cat((last.weight, seg.weight)))
            else:
                merged.append(seg)
        row = 0
        for seg in merged:
            if seg.start != row:
                raise ValueError(f"{layer_name}: the GGUF file gives rows from {seg.start}, expected {row}")
            row += seg.rows
        if row != self.output_size:
            raise ValueError(f"{layer_name}: the GGUF file gives {row} of its {self.output_size} rows")
        self.segments = merged

    @property
    def nbytes(self) -> int:
        """Bytes the layer's weight takes (the packed bytes, and any widened matrix)."""
        return sum(s.weight.numel() * s.weight.element_size() for s in self.segments)

    def bytes_by_format(self) -> dict[str, int]:
        """nbytes by format: GGML's block type names ("Q4_1"), "float32" for a widened matrix."""
        held: dict[str, int] = {}
        for s in self.segments:
            name = BLOCK_FORMATS[s.type_id].name if s.type_id in BLOCK_FORMATS else "float32"
            held[name] = held.get(name, 0) + s.weight.numel() * s.weight.element_size()
        return held

    def apply(self, layer, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty(x.shape[0], self.output_size, dtype=torch.float32, device=x.device)
        for seg in self.segments:
            cols = out[:, seg.start:seg.start + seg.rows]                    # [m, rows], rows apart
            if seg.type_id in BLOCK_FORMATS:
                layer.ops.gguf_linear(cols, x, seg.weight, seg.type_id)
            else:
                cols.copy_(layer.ops.linear(x, seg.weight))
        return out if out_dtype in (None, torch.float32) else out.to(out_dtype)


class GGUFEmbedding(VocabParallelEmbedding):
    """The embedding (and the LM head tied to it, or an untied one) kept in the file's
    blocks, one rank: a lookup widens only the rows it reads (`dequantize`, the same
    values F.embedding would read from the dequantized matrix) and the head's logits run
    through `quant_method` (`_linear`). The loader turns a loaded VocabParallelEmbedding
    into one (`from_layer`) once its quant_method is set.

    forward(input_ids [n] int64) -> [n, hidden_size] float32.
    """

    @classmethod
    def from_layer(cls, layer: VocabParallelEmbedding) -> "GGUFEmbedding":
        """`layer` itself, its class changed: its weight already given up for quant_method."""
        if layer.quant_method is None or layer.tp.size != 1 or len(layer.quant_method.segments) != 1:
            raise ValueError("GGUFEmbedding needs one rank and a quant_method of one block type")
        layer.__class__ = cls
        return layer

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seg = self.quant_method.segments[0]
        rows = seg.weight[input_ids]                                          # [n, row bytes] or [n, hidden]
        return dequantize(rows, seg.type_id) if seg.type_id in BLOCK_FORMATS else rows
