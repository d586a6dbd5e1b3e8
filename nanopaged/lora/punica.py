"""Batched LoRA for a batch whose rows use different adapters: Punica's BGMV (batched
gather matrix-vector, Chen et al. 2023, "Punica: Multi-Tenant LoRA Serving").

The adapters sit stacked in slots, a: [num_slots, r, in] and b: [num_slots, out, r]; row i
uses slot s = slots[i] (-1: no adapter). Its delta is computed in two halves,
    shrink:  t[i] = x[i] @ a[s]^T                  [r], summed in float32
    expand:  y[i] += (t[i] @ b[s]^T) * scale[s]   [out], in place,
so one call serves every row whatever mix of adapters the batch holds. This file is the
plain-PyTorch reference and the dispatch to the compiled kernels (kernels/cpu/lora/: exact
and batch-invariant) where the backend has them. vLLM: `vllm/lora/ops/torch_ops/` (bgmv_shrink,
bgmv_expand, bgmv_expand_slice).
"""
from __future__ import annotations

import torch

from .kernels import lora_kernel


def bgmv_shrink(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> None:
    """out[i] = x[i] @ a[slots[i]]^T in float32 (both widened first: the products are exact);
    zeros where slots[i] is -1.

    out: [n, r] float32, written; x: [n, in]; a: [num_slots, r, in]; slots: [n] int64.
    """
    xf = x.float()
    result = torch.zeros_like(out)
    # One matmul per slot over every row, kept where the row uses that slot: no host read of
    # slots (a CPU or CUDA graph could not replay one), and no [n, r, in] gather of a.
    for s in range(a.shape[0]):
        result = torch.where((slots == s).unsqueeze(1), xf @ a[s].float().T, result)
    out.copy_(result)


def bgmv_expand(y: torch.Tensor, t: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                scales: torch.Tensor) -> None:
    """y[i] = (y[i] + (t[i] @ b[slots[i]]^T) * scales[slots[i]]), summed in float32 and
    rounded once to y's dtype; rows whose slot is -1 keep their bits.

    y: [n, out], updated in place (may be a column slice of a wider output: qkv's q part);
    t: [n, r] float32 (bgmv_shrink's out); b: [num_slots, out, r]; scales: [num_slots] float32.
    """
    delta = torch.zeros(y.shape, dtype=torch.float32, device=y.device)
    for s in range(b.shape[0]):
        delta = torch.where((slots == s).unsqueeze(1), (t @ b[s].float().T) * scales[s], delta)
    y.copy_(torch.where((slots >= 0).unsqueeze(1), (y.float() + delta).to(y.dtype), y))


def add_lora(ops, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             slots: torch.Tensor, scales: torch.Tensor, t: torch.Tensor) -> None:
    """y += each row's LoRA delta, (x[i] @ a[s]^T) @ b[s]^T * scales[s] (s = slots[i]; -1: the
    row is untouched), through the compiled kernels where the backend `ops` has them (the CPU
    kernels), else the reference above.

    y: [n, out] (in place; a column slice is fine); x: [n, in]; a: [num_slots, r, in];
    b: [num_slots, out, r]; slots: [n] int64; scales: [num_slots] float32;
    t: [n, r] float32 scratch the caller owns (the shrink's result).
    """
    shrink = lora_kernel(ops, "lora_shrink")
    if shrink is None:
        bgmv_shrink(t, x, a, slots)
        bgmv_expand(y, t, b, slots, scales)
        return
    shrink(t, x, a, slots)
    lora_kernel(ops, "lora_expand")(y, t, b, slots, scales)
