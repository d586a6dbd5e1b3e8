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

from ..layers import build

NAME = "nanopaged_cpu_quant"
SOURCES = ("cpu/quant/gguf.cpp", "cpu/quant/gguf_a8.cpp", "cpu/quant/int8.cpp", "cpu/quant/bindings.cpp")


def load_quant_kernels(capability: str | None = None):
    """The extension built for torch's own instruction set, or for `capability` ("AVX2",
    "DEFAULT": build.load_cpu_build's, for the tests that compare the bodies).

    Raises:
        KernelBuildError: as build.load_extension.
        ValueError: as build.load_cpu_build.
    """
    if capability is None:
        return build.load_extension(NAME, SOURCES)
    return build.load_cpu_build(capability, NAME, SOURCES)


def join_quant_kernels(ops) -> None:
    """Join this extension to a CPU kernel backend (KernelOps.add_kernels; once, a second
    call does nothing); other backends are left as they are.

    Raises:
        KernelBuildError: the extension cannot be built (as load_quant_kernels).
    """
    if ops.name == "cpu":
        ops.add_kernels(load_quant_kernels())


def quant_kernel(ops, name: str):
    """The compiled op `name` for a layer whose backend is `ops` (joining this extension
    to a CPU kernel backend the first time), or None where the backend has no kernels
    (the reference, CUDA)."""
    kernel = ops.kernel(name)
    if kernel is None and ops.name == "cpu":
        join_quant_kernels(ops)
        kernel = ops.kernel(name)
    return kernel
