// The LoRA extension's kernels, as bindings.cpp binds them: defined, with their shapes, in
// bgmv.cpp.
#pragma once

#include <torch/types.h>

// bgmv.cpp
void lora_shrink(torch::Tensor out, const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& slots);
void lora_expand(torch::Tensor y, const torch::Tensor& t, const torch::Tensor& b, const torch::Tensor& slots,
                 const torch::Tensor& scales);
