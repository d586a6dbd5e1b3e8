"""The batched LoRA kernels (kernels/cpu/lora/: lora_shrink, lora_expand), one CPU
extension of their own beside the base's, which this package alone loads (layers/build.py
builds it as it builds the base's: per instruction set, cached, tried once per process).

`lora_kernel(ops, name)` joins it to a CPU kernel backend on first use
(KernelOps.add_kernels), so the calls go through the backend's `ops` as the base's kernels
do, and a CPU graph records them. The reference and CUDA backends have none: punica.py runs
its PyTorch reference there (kernels/cuda/lora.cu is compile-checked, and run by
kernels/gpu_check.py, not yet dispatched to). vLLM: `vllm/lora/ops/`.
"""
from __future__ import annotations

from ..layers.backends import FeatureKernels

NAME = "nanopaged_cpu_lora"
SOURCES = ("cpu/lora/bgmv.cpp", "cpu/lora/bindings.cpp")
LORA_KERNELS = FeatureKernels(NAME, SOURCES)

# load_lora_kernels(capability=None), join_lora_kernels(ops), lora_kernel(ops, name):
# FeatureKernels' load, join and kernel (layers/backends.py says what each does and raises)
load_lora_kernels = LORA_KERNELS.load
join_lora_kernels = LORA_KERNELS.join
lora_kernel = LORA_KERNELS.kernel
