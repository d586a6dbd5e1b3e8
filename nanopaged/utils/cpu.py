"""What this CPU can do, as torch's own probe (cpuinfo) sees it: EngineConfig's dtype="auto"
asks it (config.py)."""
from __future__ import annotations

import torch


def cpu_has_bf16_dot_products() -> bool:
    """Whether this CPU multiplies bf16 in hardware: AVX512-BF16 (`vdpbf16ps`, Cooper Lake,
    Zen 4 and later) or AMX tiles (Sapphire Rapids and later), where bf16 matmuls run at
    about twice the fp32 rate; elsewhere bf16 is widened on the fly and slower than fp32.
    Asked of torch's CPU probe (cpuinfo); False if torch lacks it."""
    probes = (getattr(torch.cpu, "_is_avx512_bf16_supported", None),
              getattr(torch.cpu, "_is_amx_tile_supported", None))
    return any(probe is not None and probe() for probe in probes)
