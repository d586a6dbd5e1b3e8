"""The quantized matmuls' compiled kernels: kernels/cpu/quant/ (gguf_linear, gguf_linear_a8
and quantize_activations_a8, int8_linear), one CPU extension of their own beside the
base's, which this package alone loads (layers/build.py builds both the same way: per
instruction set, cached, tried once per process).

A quantized model joins this extension to its CPU kernel backend when it is given the
backend (`set_ops`, at load: GGUFQuantizedModel, Int8QuantizedModel), so every call goes
through the backend's `ops`, as the base's kernels do, and a CPU graph, which records what
goes through `ops` and is captured later, sees the quantized matmuls too. A layer asks
`quant_kernel(layer.ops, name)`, which joins on first use where no model did (a layer
built alone, as in the tests). The
reference and CUDA backends have none: the layer runs its PyTorch reference.
vLLM: `csrc/quantization/`.
"""
from __future__ import annotations

from ..layers.backends import FeatureKernels

NAME = "nanopaged_cpu_quant"
SOURCES = ("cpu/quant/gguf.cpp", "cpu/quant/gguf_a8.cpp", "cpu/quant/int8.cpp", "cpu/quant/bindings.cpp")
QUANT_KERNELS = FeatureKernels(NAME, SOURCES)

# load_quant_kernels(capability=None), join_quant_kernels(ops), quant_kernel(ops, name):
# FeatureKernels' load, join and kernel (layers/backends.py says what each does and raises)
load_quant_kernels = QUANT_KERNELS.load
join_quant_kernels = QUANT_KERNELS.join
quant_kernel = QUANT_KERNELS.kernel
