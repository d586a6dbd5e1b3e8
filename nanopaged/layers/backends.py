"""The kernels' ops: the PyTorch reference, or the compiled kernels of `kernels/`.

One object holds every op a Llama layer runs through a kernel: the KV-cache ops
(`write_kv`, paged attention `forward`, `copy_blocks`, `swap_blocks`) and `linear`,
`rms_norm` (optionally fused with the residual add), `silu_and_mul` and
`rotary_embedding` (vLLM keeps these as CustomOps with per-device forwards).

`TorchOps` is plain PyTorch (attention.py); `KernelOps` calls `kernels/cuda/attention.cu`
on a GPU and its C++ twin in `kernels/cpu/` on the CPU, compiled on first use (build.py).
The CPU kernel takes every row of a step; the CUDA kernel decode rows only, and the layer
ops are CPU-only so far (CUDA runs the reference's).

`get_ops(attention_backend, device)` picks them (config's "auto" | "torch" | "cpu" |
"cuda"); "auto" takes the device's kernel when it builds, else warns once per process
and falls back to the reference. Every layer holds them as `ops`
(`LlamaForCausalLM.set_ops`). vLLM: `vllm/attention/selector.py`, `csrc/attention/`,
`csrc/cpu/attention.cpp`.
"""
from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from ..config import ATTENTION_BACKENDS
from ..utils.math_utils import cdiv
from . import attention, build
from .attention import AttentionMetadata
from .build import KernelBuildError, load_kernels

PACKAGE_DIR = Path(__file__).parents[1]     # nanopaged/, as its frames spell it (_user_stacklevel)


# the kinds "auto" has already warned about falling back from (once per process each)
_warned_kinds: set[str] = set()


def forget_kernel_builds() -> None:
    """Forget loaded kernels, failed builds and warnings: the next load tries again (tests)."""
    build.forget_builds()
    _warned_kinds.clear()


class TorchOps:
    """The plain-PyTorch reference (attention.py): every kernel is checked against it."""

    name = "torch"

    def write_kv(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        """See attention.write_kv."""
        attention.write_kv(key, value, key_cache, value_cache, slot_mapping)

    def forward(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """See attention.paged_attention: [num_tokens, num_heads, head_size] out."""
        return attention.paged_attention(query, key_cache, value_cache, meta, scale)

    def copy_blocks(self, kv_cache: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        """kv_cache[:, :, dst] = kv_cache[:, :, src] for each (src, dst) pair (copy-on-write).

        kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_size].
        """
        src, dst = _pair_tensors(pairs, kv_cache.device, kv_cache.device)
        kv_cache[:, :, dst] = kv_cache[:, :, src]

    def swap_blocks(self, src_cache: torch.Tensor, dst_cache: torch.Tensor,
                    pairs: list[tuple[int, int]]) -> None:
        """dst_cache[:, :, dst] = src_cache[:, :, src] between the device pool and the CPU pool."""
        src, dst = _pair_tensors(pairs, src_cache.device, dst_cache.device)
        dst_cache[:, :, dst] = src_cache[:, :, src].to(dst_cache.device)

    def kernel(self, name: str):
        """The compiled op `name` of kernels/ (m.def in the kernel's bindings), or None:
        the reference has none. For a layer that brings its own PyTorch reference and
        uses the kernel where one is compiled."""
        return None

    # -- the Llama layer's other ops (the reference math; KernelOps has kernels) --

    def pack_weight(self, weight: torch.Tensor) -> None:
        """A kernel's own layout of a weight, made once (KernelOps: AMX tiles); none here."""
        return None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None,
               packed: torch.Tensor | None = None) -> torch.Tensor:
        """x [m, k] @ weight [n, k]^T -> [m, n] (no bias: Llama has none), in out_dtype
        (default x's dtype; float32 from bf16 inputs: both are widened first, so the
        products are exact and summed in fp32). MKL / oneDNN / cuBLAS: a row's bits
        can depend on how many rows share the call (the kernels' linear does not)."""
        if out_dtype is None or out_dtype == x.dtype:
            return F.linear(x, weight)
        return F.linear(x.to(out_dtype), weight.to(out_dtype))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
        """RMSNorm as transformers' LlamaRMSNorm (mean of squares in fp32, rounded to x's
        dtype before the weight). x: [num_tokens, hidden]. With `residual`, first
        residual = x + residual (the skip connection), then normalize that; returns
        (normalized, residual) instead of the normalized rows (vLLM's fused_add_rms_norm)."""
        if residual is not None:
            x = residual = x + residual
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        out = weight * h.to(dtype)
        return out if residual is None else (out, residual)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[num_tokens, 2d] (gate, up) -> silu(gate) * up, [num_tokens, d]."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary_embedding(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor, head_size: int):
        """RoPE, GPT-NeoX layout (transformers' rotate_half): x * cos + rotate_half(x) * sin
        per head. query: [num_tokens, heads * head_size], key: [num_tokens, kv_heads *
        head_size]; positions: [num_tokens] int64; cos, sin: [max_positions, head_size].
        Returns the rotated (query, key)."""
        n = positions.shape[0]
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)   # [num_tokens, 1, head_size]

        def rotate(x):
            x = x.view(n, -1, head_size)
            x1, x2 = x.chunk(2, dim=-1)
            return (x * c + torch.cat((-x2, x1), dim=-1) * s).view(n, -1)
        return rotate(query), rotate(key)


class JoinedKernels:
    """Several compiled extension modules called as one (KernelOps.ops after add_kernels):
    each op is an attribute, the first module's that has it."""

    def __init__(self, *modules) -> None:
        self.modules = modules
        for module in reversed(modules):
            vars(self).update((name, getattr(module, name)) for name in dir(module) if not name.startswith("_"))


class KernelOps(TorchOps):
    """The compiled kernels: attention, the three cache ops and (CPU) the layer ops.

    Args:
        ops: the loaded extension module (see load_kernels).
        name: "cpu" or "cuda".
    """

    def __init__(self, ops, name: str) -> None:
        self.ops, self.name = ops, name
        self.fused_layer_ops = hasattr(ops, "rms_norm")     # the CPU kernels have them, CUDA not yet
        self.prefill_kernel = hasattr(ops, "paged_attention")   # CPU: prefill and decode rows

    def kernel(self, name):
        """The compiled op `name`, or None where this build has none (CUDA's has fewer)."""
        return getattr(self.ops, name, None)

    def add_kernels(self, module) -> None:
        """Join a feature's own compiled extension (FeatureKernels: the quantized
        matmuls', the LoRA kernels') to this backend's: kernel(name) finds its ops too,
        through `ops` like every kernel call (a CPU graph records what goes through `ops`,
        so join before a graph is captured: the feature's model joins in set_ops, at load)."""
        if not isinstance(self.ops, (ModuleType, JoinedKernels)):
            raise RuntimeError(f"add_kernels: this backend's ops are wrapped ({type(self.ops).__name__}: a CPU "
                               "graph being captured?); join a feature's kernels before")
        modules = self.ops.modules if isinstance(self.ops, JoinedKernels) else (self.ops,)
        if module not in modules:
            self.ops = JoinedKernels(*modules, module)

    def pack_weight(self, weight):
        """weight [n, k] in the AMX kernel's tile layout, [ceil(n / 16), k / 32, 16, 32]
        bf16 (kernels/cpu/gemm_amx.cpp, linear_amx), or None where that kernel does
        not apply: no AMX, not bf16, or k not a multiple of 32. The choice depends on the
        weight alone, never on a batch, so every row of every step takes the same kernel."""
        if not hasattr(self.ops, "linear_amx") or weight.dtype != torch.bfloat16 or weight.shape[1] % 32:
            return None
        n, k = weight.shape
        nb = cdiv(n, 16)
        padded = F.pad(weight, (0, 0, 0, nb * 16 - n))
        # [column block, 16 columns, k chunk, 16 pairs, 2] -> [column block, k chunk, pair, column, 2]
        return padded.view(nb, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).reshape(nb, k // 32, 16, 32).contiguous()

    def linear(self, x, weight, out_dtype=None, packed=None):
        """x [m, k] @ weight [n, k]^T -> [m, n] in out_dtype (default x's), through the
        kernel's batch-invariant matmul for every m: on AMX tiles when `packed` (from
        pack_weight) is given, else the vector loop (fp32, or bf16 with fp32 sums; the
        output may be fp32 for bf16 inputs: the LM head). Other dtypes and CUDA: the
        reference (F.linear), which is not batch-invariant."""
        out_dtype = out_dtype or x.dtype
        if packed is not None:
            out = torch.empty(x.shape[0], weight.shape[0], dtype=out_dtype)
            self.ops.linear_amx(out, x.contiguous(), packed)
            return out
        if (not self.fused_layer_ops or x.dtype not in (torch.float32, torch.bfloat16)
                or weight.dtype != x.dtype or out_dtype not in (x.dtype, torch.float32)):
            return super().linear(x, weight, out_dtype)
        out = torch.empty(x.shape[0], weight.shape[0], dtype=out_dtype)
        self.ops.linear(out, x.contiguous(), weight)
        return out

    def rms_norm(self, x, weight, eps, residual=None):
        """One fused pass (kernels/cpu/layer_ops.cpp); with `residual`, in place:
        residual += x, x = norm(residual)."""
        if not self.fused_layer_ops or x.stride(-1) != 1:
            return super().rms_norm(x, weight, eps, residual)
        if residual is None:
            out = torch.empty_like(x)
            self.ops.rms_norm(out, x, weight, eps)
            return out
        self.ops.fused_add_rms_norm(x, residual, weight, eps)
        return x, residual

    def silu_and_mul(self, x):
        """One fused pass: silu(gate) * up."""
        if not self.fused_layer_ops:
            return super().silu_and_mul(x)
        out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype, device=x.device)
        self.ops.silu_and_mul(out, x)
        return out

    def rotary_embedding(self, positions, query, key, cos, sin, head_size):
        """RoPE in place on the query and key views (no copies, one pass)."""
        if not self.fused_layer_ops:
            return super().rotary_embedding(positions, query, key, cos, sin, head_size)
        self.ops.rotary_embedding(positions, query, key, cos, sin, head_size)
        return query, key

    def write_kv(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        """vLLM's reshape_and_cache: row t of key/value to slot slot_mapping[t]."""
        self.ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    def forward(self, query, key_cache, value_cache, meta, scale):
        """Every row through the kernel, K/V read in place. The CUDA kernel has decode
        rows only so far: its prefill rows go to the reference."""
        out = torch.empty_like(query)
        if self.prefill_kernel:
            self.ops.paged_attention(out, query.contiguous(), key_cache, value_cache, meta.block_tables,
                                     meta.seq_lens, meta.query_start_loc, scale)
            return out
        nd = meta.num_decodes
        if nd:
            self.ops.paged_attention_decode(out[:nd], query[:nd].contiguous(), key_cache, value_cache,
                                            meta.block_tables[:nd].contiguous(), meta.seq_lens[:nd], scale)
        attention.prefill_attention(out, query, key_cache, value_cache, meta, scale)
        return out

    def copy_blocks(self, kv_cache, pairs) -> None:
        """Copy-on-write copies, every layer, K and V, in one call."""
        src, dst = _pair_tensors(pairs, kv_cache.device, kv_cache.device)
        self.ops.copy_blocks(kv_cache, src, dst)

    def swap_blocks(self, src_cache, dst_cache, pairs) -> None:
        """Whole-block copies between pools (one memcpy per layer, K/V and block)."""
        cpu = torch.device("cpu")
        src, dst = _pair_tensors(pairs, cpu, cpu)
        self.ops.swap_blocks(src_cache, dst_cache, src, dst)


class FeatureKernels:
    """A feature's own CPU extension beside the base's (the quantized matmuls', the LoRA
    kernels'), which only that feature loads: built as the base's is (per instruction
    set, cached, tried once per process: build.py), and joined to a CPU kernel backend
    (KernelOps.add_kernels) so its calls go through the backend's `ops` as every kernel
    call does, and a CPU graph records them. The reference and CUDA backends have none:
    the feature's layer runs its PyTorch reference there.

    Args:
        name: the extension's module name (e.g. "nanopaged_cpu_quant").
        sources: its files under kernels/.
    """

    def __init__(self, name: str, sources: tuple[str, ...]) -> None:
        self.name, self.sources = name, sources

    def load(self, capability: str | None = None):
        """The extension built for torch's own instruction set, or for `capability`
        ("AVX2", "DEFAULT": build.load_cpu_build's, for the tests that compare bodies).

        Raises:
            KernelBuildError: as build.load_extension.
            ValueError: as build.load_cpu_build.
        """
        if capability is None:
            return build.load_extension(self.name, self.sources)
        return build.load_cpu_build(capability, self.name, self.sources)

    def join(self, ops: TorchOps) -> None:
        """Join the extension to a CPU kernel backend (once: a second call does nothing);
        other backends are left as they are. Join before a CPU graph is captured (a
        model's set_ops, at load).

        Raises:
            KernelBuildError: the extension cannot be built.
        """
        if ops.name == "cpu":
            ops.add_kernels(self.load())

    def kernel(self, ops: TorchOps, name: str):
        """The compiled op `name` for a layer whose backend is `ops` (joining the extension
        to a CPU kernel backend the first time, for a layer built alone, as in the tests),
        or None where the backend has no kernels."""
        kernel = ops.kernel(name)
        if kernel is None and ops.name == "cpu":
            self.join(ops)
            kernel = ops.kernel(name)
        return kernel


def _pair_tensors(pairs, src_device, dst_device) -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=src_device)
    dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=dst_device)
    return src, dst


def get_ops(name: str, device: torch.device | str) -> TorchOps:
    """The ops config.attention_backend `name` picks for a model on `device`.

    "torch": the reference. "cpu" / "cuda": that compiled kernel (it must match the
    device). "auto": the device's kernel if it builds, else the reference with a warning
    (and the reference on devices without a kernel, e.g. "mps").

    Raises:
        ValueError: unknown name, or a kernel for another device than `device`.
        KernelBuildError: "cpu" or "cuda" asked for explicitly and it cannot be built.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={name!r}: expected one of {ATTENTION_BACKENDS}")
    device = torch.device(device)
    if name == "torch":
        return TorchOps()
    kind = device.type if name == "auto" else name
    if kind != device.type:
        raise ValueError(f"attention_backend={name!r} cannot run a model on device {str(device)!r}")
    if kind not in ("cpu", "cuda"):
        return TorchOps()
    try:
        return KernelOps(load_kernels(kind), kind)
    except KernelBuildError as e:
        if name != "auto":
            raise
        if kind not in _warned_kinds:
            _warned_kinds.add(kind)
            warnings.warn(f"nanopaged: the {kind} paged-attention kernel is not available ({e}); "
                          "using the PyTorch reference instead (the same math, slower, and not "
                          "batch-invariant).",
                          stacklevel=_user_stacklevel())
        return TorchOps()


def _user_stacklevel() -> int:
    """The warnings.warn stacklevel, for a warning raised by our caller, that names the
    first frame outside the nanopaged package: the user's line that made the LLM or
    engine, not the engine internals in between (Python 3.12's warn(skip_file_prefixes=)
    does the same). Our caller is level 1. When every frame is nanopaged's (python -m
    nanopaged.serve), the outermost one is named.
    """
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(str(PACKAGE_DIR) + os.sep):
        frame, level = frame.f_back, level + 1
    return level


