// The quantization extension as one Python module, beside the base one
// (nanopaged/quantization/kernels.py builds it from this folder's .cpp files): the GGUF
// block formats, GGUF x int8 activations and int8 weights. Every kernel is counted on its
// way in (../path_counts.h); this module has no vdpbf16ps or AMX path of its own.

#include "../bindings.h"
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  def_reports(m, /*special_paths=*/false);
  m.def("gguf_linear", &Counted<&gguf_linear>::call,
        "x W^T, W in a GGUF block format (Q8_0, Q4_0/1, Q5_0/1, Q4_K, Q5_K, Q6_K), fp32 (CPU)");
  m.def("gguf_linear_a8", &Counted<&gguf_linear_a8>::call, "x W^T, W in GGUF blocks (Q4-Q8, K-quants), x rounded "
        "to int8 blocks of 32 first (llama.cpp's Q8_1), fp32 out (CPU)");
  m.def("quantize_activations_a8", &Counted<&quantize_activations_a8>::call,
        "x -> int8 blocks of 32 and their scales (CPU)");
  m.def("int8_linear", &Counted<&int8_linear>::call, "x W^T, W int8 with a float32 scale per row, fp32 (CPU)");
}
