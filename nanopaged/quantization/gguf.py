"""GGUF's block-quantized linear weights, run as the file stores them. vLLM:
`vllm/model_executor/layers/quantization/gguf.py` (GGUFLinearMethod).

llama.cpp (ggml-quants.c) stores a matrix W [n, k] row by row, each row k / QK blocks of
QK weights along k. A block is fp16 scales and small integers q:

    Q8_0    34 bytes / 32: d, 32 int8                          w = q * d
    Q4_0    18 bytes / 32: d, 16 bytes of nibbles              w = (q - 8) * d
    Q4_1    20 bytes / 32: d, m (fp16), 16 bytes               w = q * d + m
    Q5_0    22 bytes / 32: d, 4 bytes of 5th bits, 16 bytes    w = (q - 16) * d
    Q5_1    24 bytes / 32: d, m, 4 bytes of 5th bits, 16 bytes w = q * d + m
    Q4_K   144 bytes / 256: d, dmin, 12 bytes of 6-bit scales and mins (8 of each),
           128 bytes of nibbles                    w = (d * sc) * q - dmin * mn  (sub-block of 32)
    Q5_K   176 bytes / 256: Q4_K's, plus 32 bytes of 5th bits
    Q6_K   210 bytes / 256: 128 bytes of low nibbles, 64 of high 2 bits, 16 int8
           scales, d                               w = (d * sc) * (q - 32)      (sub-block of 16)

In Q4_0/Q4_1/Q5 blocks the low nibble of byte i is weight i, the high nibble weight i + 16,
and bit i of the 4 bytes (little-endian) a Q5 weight's fifth bit. The K-quants ("super-
blocks") order their nibbles in runs (`dequantize`; kernels/cpu/quant/ggml.h has the bytes). A layer
keeps those bytes (uint8 [rows, k / QK * block bytes]): SmolLM2's Q4_1 file is 5 bits a
weight where fp32 is 32, Q4_K 4.5, and a decode step is a walk through the weights. Its matmul
(`gguf_linear`: the kernel's, kernels/cpu/quant/gguf.cpp) widens each block in registers and
sums exactly as the fp32 matmul does on the dequantized weights, bit for bit; from 3 rows
of x (12 for Q8_0) a task widens its 32 weight rows into an fp32 panel first, and from 1024
rows (long prefill steps) the whole matrix once into an fp32 scratch it keeps between calls
(the largest layer's size, at most 64 MB: SmolLM2's gate_up, 7 MB), running that fp32
matmul on it.
`dequantize` is the plain-PyTorch reference, equal to `gguf.quants.dequantize`.

A fused layer (qkv_proj, gate_up_proj) stacks several of the file's matrices, which may
have different types (a Q4_K_M file mixes Q4_K and Q6_K), so a layer holds segments: runs
of rows of one type, each computing its columns of y. F32/F16/BF16 matrices are widened
to fp32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..layers.parallel import VocabParallelEmbedding
from .kernels import quant_kernel


@dataclass(frozen=True)
class BlockFormat:
    """One GGML block type: its name, GGML's number, bytes per block and the block's
    weight count along k (QK: 32, or 256 for a K-quant super-block)."""

    name: str
    type_id: int
    block_bytes: int
    block_weights: int = 32

    def row_bytes(self, k: int) -> int:
        """Bytes of a packed row of k weights (k a multiple of block_weights)."""
        return k // self.block_weights * self.block_bytes


# GGML's numbers (gguf.GGMLQuantizationType)
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = (BlockFormat("Q4_0", 2, 18), BlockFormat("Q4_1", 3, 20), BlockFormat("Q5_0", 6, 22),
                                BlockFormat("Q5_1", 7, 24), BlockFormat("Q8_0", 8, 34))
Q4_K, Q5_K, Q6_K = (BlockFormat("Q4_K", 12, 144, 256), BlockFormat("Q5_K", 13, 176, 256),
                    BlockFormat("Q6_K", 14, 210, 256))
BLOCK_FORMATS = {f.type_id: f for f in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)}
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


def _half(b: torch.Tensor) -> torch.Tensor:
    """Bytes uint8 [..., 2] holding an fp16 -> float32 [..., 1] (exact)."""
    return b.contiguous().view(torch.float16).float()


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes [..., 12] -> 8 six-bit scales and 8 mins, int [..., 8] each:
    bytes 0-3 hold scales 0-3 (low 6 bits), 4-7 mins 0-3, and 8-11 the low 4 bits of
    scale / min 4-7, whose top 2 bits are the top bits of bytes 0-3 / 4-7."""
    sc, mn, both = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    scales = torch.cat((sc & 0x3F, (both & 0xF) | ((sc >> 2) & 0x30)), dim=-1)
    mins = torch.cat((mn & 0x3F, (both >> 4) | ((mn >> 2) & 0x30)), dim=-1)
    return scales, mins


def _nibbles_in_runs(qs: torch.Tensor, run: int) -> torch.Tensor:
    """Bytes [..., r * run] -> 4-bit values [..., 2 * r * run]: each run of bytes gives
    its `run` low nibbles, then its `run` high nibbles (the K-quants' order)."""
    runs = qs.reshape(*qs.shape[:-1], -1, 1, run)
    return torch.cat((runs & 0xF, runs >> 4), dim=-2).reshape(*qs.shape[:-1], -1)


def dequantize(qweight: torch.Tensor, type_id: int) -> torch.Tensor:
    """The packed rows uint8 [n, k / QK * block bytes] of a BLOCK_FORMATS matrix ->
    float32 [n, k]: gguf.quants.dequantize's values bit for bit (scales widened from fp16,
    then each op of the table above rounded to fp32, in that order)."""
    fmt = BLOCK_FORMATS[type_id]
    n = qweight.shape[0]
    b = qweight.reshape(n, -1, fmt.block_bytes)                     # [n, blocks, block bytes]
    if fmt is Q8_0:
        return (b[..., 2:].contiguous().view(torch.int8).float() * _half(b[..., 0:2])).reshape(n, -1)
    if fmt is Q4_1:
        return dequantize_q4_1(qweight)                            # exercise 21 replaces it
    if fmt in (Q4_0, Q5_0, Q5_1):
        d = _half(b[..., 0:2])                                      # [n, blocks, 1]
        m = _half(b[..., 2:4]) if fmt is Q5_1 else None
        head = {Q4_0: 2, Q5_0: 6, Q5_1: 8}[fmt]
        q = _nibbles_in_runs(b[..., head:], 16).int()               # low nibbles: weights 0..15
        if fmt in (Q5_0, Q5_1):                                     # bit i of a uint32: weight i's 5th
            qh = sum(b[..., head - 4 + i].long() << (8 * i) for i in range(4))
            q = q | (((qh[..., None] >> torch.arange(32)) & 1) << 4)
        if m is not None:
            return (q.float() * d + m).reshape(n, -1)
        return ((q - (8 if fmt is Q4_0 else 16)).float() * d).reshape(n, -1)
    if fmt is Q6_K:
        ql = _nibbles_in_runs(b[..., 0:128], 64)                    # [n, blocks, 256] low 4 bits
        qh = b[..., 128:192].reshape(n, -1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
        q = (ql.int() | ((qh & 3).reshape(n, -1, 256).int() << 4)) - 32
        ds = _half(b[..., 208:210]) * b[..., 192:208].contiguous().view(torch.int8).float()  # [n, blocks, 16]
        return (ds[..., None] * q.reshape(n, -1, 16, 16).float()).reshape(n, -1)
    # Q4_K / Q5_K: 8 sub-blocks of 32, w = (d * sc) * q - dmin * mn (both products exact)
    sc, mn = _k_scales(b[..., 4:16])
    ds, dm = _half(b[..., 0:2]) * sc.float(), _half(b[..., 2:4]) * mn.float()       # [n, blocks, 8]
    q = _nibbles_in_runs(b[..., -128:], 32).reshape(n, -1, 8, 32)
    if fmt is Q5_K:                                                 # bit s of byte l: sub-block s, weight l
        qh = b[..., 16:48].reshape(n, -1, 1, 32) >> torch.arange(8, dtype=torch.uint8)[:, None]
        q = q | ((qh & 1) << 4)
    return (ds[..., None] * q.float() - dm[..., None]).reshape(n, -1)


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


def gguf_linear(ops, out: torch.Tensor, x: torch.Tensor, qweight: torch.Tensor, type_id: int) -> None:
    """out [m, n] float32 (a view: rows may be further apart) = x [m, k] @ W^T, W the
    packed rows uint8 [n, k / QK * block bytes] of GGML block type `type_id`.

    With x float32 and a kernel backend that has it (`quant_kernel(ops, "gguf_linear")`,
    the CPU kernel): each block widened in registers, summed as `ops.linear` sums the
    dequantized weights (the same bits, batch-invariant). Otherwise (other dtypes, CUDA,
    the reference backend) the PyTorch reference: dequantized, then F.linear."""
    kernel = quant_kernel(ops, "gguf_linear")
    if kernel is None or x.dtype != torch.float32:
        out.copy_(F.linear(x, dequantize(qweight, type_id)))
        return
    kernel(out, x.contiguous(), qweight, type_id)


@dataclass
class Segment:
    """Rows [start, start + rows) of a layer's weight, in one type.

    Attributes:
        start: the first row (the first column of y it computes).
        type_id: a BLOCK_FORMATS key, or 0 (F32) for a widened matrix.
        weight: uint8 [rows, k / QK * block bytes] packed, or float32 [rows, k].
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
        input_size: k, a multiple of each block type's QK (32, or 256 for K-quants).

    apply(layer, x [m, k] float32 or bfloat16) -> y [m, output_size] in out_dtype (default
    x's dtype): x is widened to float32 first (exact), the products of the widened weights
    summed in float32, and y rounded to out_dtype once at the end.
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
            if k % fmt.block_weights:
                raise ValueError(f"GGUF tensor {name!r} ({fmt.name}): its {k} columns are not whole blocks "
                                 f"of {fmt.block_weights}")
            expected = (data.shape[0], fmt.row_bytes(k))
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
        out_dtype = out_dtype or x.dtype
        x = x.float().contiguous()
        out = torch.empty(x.shape[0], self.output_size, dtype=torch.float32, device=x.device)
        whole = len(self.segments) == 1                 # the usual case: no column slice to cut
        for seg in self.segments:
            cols = out if whole else out[:, seg.start:seg.start + seg.rows]  # [m, rows], rows apart
            self.segment_matmul(layer, cols, x, seg)
        return out if out_dtype == torch.float32 else out.to(out_dtype)

    def segment_matmul(self, layer, cols: torch.Tensor, x: torch.Tensor, seg: Segment) -> None:
        """cols [m, seg.rows] float32 (a view) = x [m, k] float32 @ seg's rows^T: the hook
        activation_quantization="int8" overrides (gguf_a8.py)."""
        if seg.type_id:
            gguf_linear(layer.ops, cols, x, seg.weight, seg.type_id)
        else:
            cols.copy_(layer.ops.linear(x, seg.weight))


class GGUFEmbedding(VocabParallelEmbedding):
    """The embedding (and the LM head tied to it, or an untied one) kept in the file's
    blocks, one rank: a lookup widens only the rows it reads (`dequantize`, the same
    values F.embedding would read from the dequantized matrix) and the head's logits run
    through `quant_method` (`_linear`). The loader turns a loaded VocabParallelEmbedding
    into one (`from_layer`) once its quant_method is set.

    forward(input_ids [n] int64) -> [n, hidden_size] in the model's dtype (float32 or
    bfloat16: the widened rows rounded once).
    """

    @classmethod
    def from_layer(cls, layer: VocabParallelEmbedding, dtype: torch.dtype) -> "GGUFEmbedding":
        """`layer` itself, its class changed: its weight already given up for quant_method;
        `dtype` the model's (what a lookup returns)."""
        if layer.quant_method is None or layer.tp.size != 1 or len(layer.quant_method.segments) != 1:
            raise ValueError("GGUFEmbedding needs one rank and a quant_method of one block type")
        layer.__class__ = cls
        layer.dtype = dtype
        return layer

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seg = self.quant_method.segments[0]
        rows = seg.weight[input_ids]                                          # [n, row bytes] or [n, hidden]
        rows = dequantize(rows, seg.type_id) if seg.type_id in BLOCK_FORMATS else rows
        return rows.to(self.dtype)
