// The quantization extension's kernels, as bindings.cpp binds them: each is defined, with
// its shapes, in the file named beside it.
#pragma once

#include <torch/types.h>

#include <vector>

// gguf.cpp
void check_gguf_args(const char* name, const torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& qweight,
                     int64_t qk, int64_t bytes);   // gguf_linear's and gguf_linear_a8's shapes, or an error
void gguf_linear(torch::Tensor out, const torch::Tensor& x, const torch::Tensor& qweight, int64_t qtype);

// gguf_a8.cpp
void gguf_linear_a8(torch::Tensor out, const torch::Tensor& x, const torch::Tensor& qweight, int64_t qtype);
std::vector<torch::Tensor> quantize_activations_a8(const torch::Tensor& x);

// int8.cpp
void int8_linear(torch::Tensor out, const torch::Tensor& x, const torch::Tensor& qweight,
                 const torch::Tensor& scale);
