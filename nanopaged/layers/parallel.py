"""Megatron-LM tensor parallelism (Shoeybi et al. 2019, §3): the layers that split a
model's matrices over `tp_size` ranks, and the two collectives that join them again.

A linear layer y = x W^T, W of shape [out, in], splits two ways:

- by output rows (ColumnParallelLinear): rank r holds a slice of W's rows and computes
  that slice of y from the whole x. No communication: each rank ends with a slice of y.
- by input columns (RowParallelLinear): rank r holds a slice of W's columns and gets the
  matching slice of x; it computes a partial y over its share of the inner dimension,
  and the full y is the sum over ranks: one all-reduce.

A Llama block pairs them so that the slice one layer produces is the slice the next one
consumes. qkv_proj is column-parallel by heads (rank r computes q, k, v of its own
heads), attention is per head and needs nothing from other ranks, and o_proj is
row-parallel: its input columns are exactly rank r's heads. One all-reduce. The MLP is
the same: gate_up_proj column-parallel by intermediate rows, SiLU(gate) * up
elementwise on the slice, down_proj row-parallel, one all-reduce. So a layer costs two
all-reduces of a [num_tokens, hidden_size] tensor and nothing else.

The embedding is split by vocabulary rows: a rank looks up the ids in its range, writes
zeros for the others, and an all-reduce adds the rows up. The LM head, split the same
way, gives each rank the logits of its vocabulary slice; an all-gather puts every row
together on every rank (all ranks then sample the same token: chapter 17).

GQA (Ainslie et al. 2023): the KV heads split like the query heads when there are at
least tp of them; with fewer, tp must be a multiple of num_kv_heads and each KV head is
replicated on tp // num_kv_heads ranks (vLLM's rule, `QKVParallelLinear`).

vLLM: `vllm/model_executor/layers/linear.py`, `vocab_parallel_embedding.py`,
`vllm/distributed/parallel_state.py`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..utils.checks import check_int
from ..utils.math_utils import cdiv
from .backends import TorchOps

_REFERENCE = TorchOps()     # plain F.linear until the model is given its kernel backend


def _linear(layer: nn.Module, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x @ layer.weight^T by the layer's backend (`layer.ops`), with the weight in the
    layout that backend wants (AMX tiles: backends.KernelOps.pack_weight), packed on
    first use and again after a new backend or a change to the weight (its version
    counter moves, or `load` clears `_packed_for`).

    A quantized weight brings its own matmul: `layer.quant_method` (vLLM's name), set at
    load by a quantized model's loader (quantization/gguf_loader.py, quantization/), is
    the one hook quantization has in the layers. It has `apply(layer, x, out_dtype)`,
    `nbytes` and `bytes_by_format()` (what the tracer shows: worker.weights_info)."""
    if layer.quant_method is not None:
        return layer.quant_method.apply(layer, x, out_dtype)
    w = layer.weight
    key = (layer.ops, w._version, w.data_ptr())
    if layer._packed_for != key:
        layer._packed, layer._packed_for = layer.ops.pack_weight(w), key
    return layer.ops.linear(x, w, out_dtype, packed=layer._packed)


class TPGroup:
    """This rank's place in its tensor-parallel group, and the collectives over it.

    Args:
        rank: this rank, 0 <= rank < size.
        size: ranks in the group (1: every collective is a no-op).
        process_group: a torch.distributed ProcessGroup of those ranks (gloo on the CPU,
            NCCL on CUDA), made by init_process_group or directly from a Store; None
            when size is 1.

    Attributes:
        comm_seconds: wall time spent in all_reduce and all_gather, seconds (the bench).
        num_collectives: how many were called.
    """

    def __init__(self, rank: int = 0, size: int = 1, process_group=None) -> None:
        if size > 1 and process_group is None:
            raise ValueError(f"TPGroup of size {size} needs a process_group")
        self.rank, self.size, self.process_group = rank, size, process_group
        self.comm_seconds = 0.0
        self.num_collectives = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (every rank gets the sum); returns x."""
        if self.size == 1:
            return x
        start = time.perf_counter()
        self.process_group.allreduce([x]).wait()
        self._count(start)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, d] on each rank -> [n, size * d] on every rank, rank r's at columns
        [r * d, (r + 1) * d)."""
        if self.size == 1:
            return x
        start = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.process_group.allgather([parts], [x]).wait()
        self._count(start)
        return torch.cat(parts, dim=-1)

    def _count(self, start: float) -> None:
        self.comm_seconds += time.perf_counter() - start
        self.num_collectives += 1


@dataclass(frozen=True)
class HeadSharding:
    """Which heads one rank holds.

    Attributes:
        num_heads: query heads on this rank (num_attention_heads // tp).
        num_kv_heads: KV heads on this rank (num_kv_heads // tp, or 1 when replicated).
        first_head: index of its first query head in the full model.
        first_kv_head: index of its first KV head in the full model.
        kv_replicas: ranks that hold each KV head (1 unless tp > num_kv_heads).
    """

    num_heads: int
    num_kv_heads: int
    first_head: int
    first_kv_head: int
    kv_replicas: int


def shard_heads(num_heads: int, num_kv_heads: int, tp_size: int, rank: int = 0) -> HeadSharding:
    """Split the heads over tp_size ranks by vLLM's rules; return rank's share.

    Raises:
        ValueError: num_heads not divisible by tp_size, or num_kv_heads neither divisible
            by tp_size nor a divisor of it (the message names the heads and tp).
    """
    check_int("tensor_parallel_size", tp_size, minimum=1, rule="a positive integer")
    if num_heads % tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} must divide num_attention_heads={num_heads} "
                         f"(num_key_value_heads={num_kv_heads})")
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={tp_size} must divide num_key_value_heads={num_kv_heads} "
                         f"or be a multiple of it (num_attention_heads={num_heads})")
    heads = num_heads // tp_size
    if num_kv_heads >= tp_size:
        kv = num_kv_heads // tp_size
        return HeadSharding(heads, kv, rank * heads, rank * kv, 1)
    replicas = tp_size // num_kv_heads
    return HeadSharding(heads, 1, rank * heads, rank // replicas, replicas)


def valid_tp_size(num_heads: int, num_kv_heads: int, tp_size: int) -> bool:
    """Whether shard_heads accepts tp_size for these heads."""
    return num_heads % tp_size == 0 and (num_kv_heads % tp_size == 0 or tp_size % num_kv_heads == 0)


def _shape(src) -> tuple[int, ...]:
    """Shape of a tensor or of a safetensors slice (which reads nothing until indexed)."""
    return tuple(src.get_shape()) if hasattr(src, "get_shape") else tuple(src.shape)


def _check_shape(name: str, src, expected: tuple[int, ...]) -> None:
    if _shape(src) != expected:
        raise ValueError(f"tensor {name!r} has shape {_shape(src)}, expected {expected}")


class ColumnParallelLinear(nn.Module):
    """y[:, rank's rows] = x @ W[rank's rows]^T: the weight split by output rows.

    Several checkpoint matrices can be stacked in one weight (q/k/v, gate/up), each
    contributing its own slice of rows on this rank.

    Args:
        input_size: in features (every rank sees the whole x).
        parts: name -> (rows of that matrix in the checkpoint, first row this rank holds,
            rows this rank holds), in the order they are stacked.
        tp: the TPGroup (only its rank matters here: no communication).
        bias: whether y gets a bias (Qwen2's q/k/v); it is split by rows like the weight.

    forward(x [n, input_size]) -> [n, sum of held rows], x's dtype.
    """

    quant_method = None         # a quantized weight's matmul (_linear), set at load

    def __init__(self, input_size: int, parts: dict[str, tuple[int, int, int]], tp: TPGroup,
                 bias: bool = False) -> None:
        super().__init__()
        self.input_size, self.parts, self.tp = input_size, parts, tp
        self.offsets, rows = {}, 0
        for name, (_, _, n) in parts.items():
            self.offsets[name], rows = rows, rows + n
        self.weight = nn.Parameter(torch.empty(rows, input_size))
        self.bias = nn.Parameter(torch.empty(rows)) if bias else None
        self.ops = _REFERENCE          # the model's set_ops gives the kernels
        self._packed = self._packed_for = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _linear(self, x)
        return y if self.bias is None else y.add_(self.bias)

    def load(self, part: str, src, name: str, leaf: str = "weight") -> None:
        """Copy this rank's rows of checkpoint matrix `part` ([rows, input_size]; a
        tensor or a safetensors slice, of which only those rows are read), or of its
        bias ([rows]) when leaf is "bias".
        Raises ValueError naming `name` if its shape is wrong or the layer has no bias."""
        full, first, n = self.parts[part]
        param = self.weight if leaf == "weight" else self.bias if leaf == "bias" else None
        if param is None:
            raise ValueError(f"unexpected tensor {name!r} (this layer has no {leaf})")
        _check_shape(name, src, (full, self.input_size) if leaf == "weight" else (full,))
        param.data[self.offsets[part]:self.offsets[part] + n].copy_(src[first:first + n])
        self._packed_for = None


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x[:, rank's columns] @ W[:, rank's columns]^T: the weight
    split by input columns, then one all-reduce.

    Args:
        input_size: in features of the whole matrix (a rank gets input_size // tp of x).
        output_size: out features (every rank ends with all of y).
        tp: the TPGroup whose all_reduce sums the partial products.

    forward(x [n, input_size // tp]) -> [n, output_size], x's dtype.
    """

    quant_method = None         # a quantized weight's matmul (_linear), set at load

    def __init__(self, input_size: int, output_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.input_size, self.output_size, self.tp = input_size, output_size, tp
        self.weight = nn.Parameter(torch.empty(output_size, input_size // tp.size))
        self.ops = _REFERENCE
        self._packed = self._packed_for = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(_linear(self, x))

    def load(self, src, name: str) -> None:
        """Copy this rank's columns of the checkpoint matrix [output_size, input_size]."""
        _check_shape(name, src, (self.output_size, self.input_size))
        n = self.weight.shape[1]
        self.weight.data.copy_(src[:, self.tp.rank * n:(self.tp.rank + 1) * n])
        self._packed_for = None


class VocabParallelEmbedding(nn.Module):
    """The embedding matrix split by vocabulary rows; also the LM head's weight.

    Rank r holds rows [r * per_rank, (r + 1) * per_rank) with per_rank =
    ceil(vocab_size / tp); rows past vocab_size are zero padding.

    Args:
        vocab_size, hidden_size: the full matrix's shape.
        tp: the TPGroup.

    forward(input_ids [n] int64) -> [n, hidden_size]: the all-reduce of each rank's
    lookup, ids outside its rows contributing zeros.
    logits(hidden [n, hidden_size]) -> [n, vocab_size] float32, every rank the full rows.
    """

    quant_method = None         # a quantized weight's matmul (_linear), set at load

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.vocab_size, self.hidden_size, self.tp = vocab_size, hidden_size, tp
        self.per_rank = cdiv(vocab_size, tp.size)
        self.vocab_start = tp.rank * self.per_rank
        self.num_held = max(0, min(vocab_size - self.vocab_start, self.per_rank))
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden_size))
        self.ops = _REFERENCE
        self._packed = self._packed_for = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_held)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> logits [n, vocab_size] float32, summed in float32.

        In bf16 a logit near 30 can only be a multiple of 0.125, so rounding the head's
        output to bf16 (as transformers does) turns near-ties into ties and flips
        argmaxes. The products of a bf16 hidden and a bf16 weight are exact in float32,
        so we sum them in float32 and keep the float32 result: the CPU kernel's matmul
        takes bf16 in and gives fp32 out, reading the 57 MB bf16 head (SmolLM2's 49152
        x 576) rather than a 113 MB fp32 copy. The reference backend (and CUDA) widens
        the inputs instead: ops.linear(..., out_dtype=torch.float32).
        """
        logits = self.tp.all_gather(_linear(self, hidden, out_dtype=torch.float32))
        return logits[:, :self.vocab_size] if logits.shape[1] != self.vocab_size else logits

    def load(self, src, name: str) -> None:
        """Copy this rank's rows of the checkpoint matrix [vocab_size, hidden_size]."""
        _check_shape(name, src, (self.vocab_size, self.hidden_size))
        self.weight.data.zero_()
        n = self.num_held
        self.weight.data[:n].copy_(src[self.vocab_start:self.vocab_start + n])
        self._packed_for = None
