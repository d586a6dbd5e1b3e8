"""What this CPU can do, as torch dispatches to it: torch's own probe (cpuinfo) for the
units, capped by the instruction set torch runs (ATEN_CPU_CAPABILITY), since the kernels
are built for that set too (layers/build.py). EngineConfig's dtype="auto" asks it
(config.py), and so does the default model's choice of weights (engine/arg_utils.py).

One switch, read here in every process (the servers, EngineCore and worker processes
inherit the environment): NANOPAGED_AUTO_DTYPE=bfloat16 (or float32) makes dtype="auto"
on the CPU pick that dtype whatever the units, so a CPU where auto is float32 can run what
a bf16 CPU runs, and the reverse.
"""
from __future__ import annotations

import os

import torch

AUTO_DTYPE_ENV = "NANOPAGED_AUTO_DTYPE"
_AUTO_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def cpu_has_bf16_dot_products() -> bool:
    """Whether this CPU multiplies bf16 in hardware, as torch runs it: AVX512-BF16
    (`vdpbf16ps`, Cooper Lake, Zen 4 and later) or AMX tiles (Sapphire Rapids and later),
    where bf16 matmuls run at about twice the fp32 rate; elsewhere bf16 is widened on the
    fly and slower than fp32. False under ATEN_CPU_CAPABILITY=avx2 or =default, whose
    kernel builds leave those units out (layers/build.py), and False if torch lacks the
    probes."""
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return False
    probes = (getattr(torch.cpu, "_is_avx512_bf16_supported", None),
              getattr(torch.cpu, "_is_amx_tile_supported", None))
    return any(probe is not None and probe() for probe in probes)


def cpu_class() -> str:
    """This CPU's class as the engine sees it (torch's capability, then the bf16 units):
    "amx" (AMX-BF16 tiles), "avx512_bf16" (AVX512-BF16, no AMX), "avx512", "avx2", or
    "default" (no vector extension torch uses: ATEN_CPU_CAPABILITY=default)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512"):
        if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
            return "amx"
        return "avx512_bf16" if cpu_has_bf16_dot_products() else "avx512"
    return "avx2" if capability == "AVX2" else "default"


def auto_cpu_dtype() -> torch.dtype:
    """dtype="auto" on the CPU: bfloat16 where it has bf16 dot products, else float32;
    $NANOPAGED_AUTO_DTYPE (bfloat16 or float32) decides instead when set.

    Raises:
        ValueError: NANOPAGED_AUTO_DTYPE set to anything else (names the variable and value).
    """
    forced = os.environ.get(AUTO_DTYPE_ENV)
    if forced:
        if forced not in _AUTO_DTYPES:
            raise ValueError(f"{AUTO_DTYPE_ENV}={forced!r}: expected one of {sorted(_AUTO_DTYPES)} (or unset)")
        return _AUTO_DTYPES[forced]
    return torch.bfloat16 if cpu_has_bf16_dot_products() else torch.float32
