// y = x W^T on the CPU, fp32 or bf16, the same bits for a row whatever its batch: gemm.h's
// loops behind the checks. AMX tiles: gemm_amx.cpp.

#include <torch/types.h>

#include "gemm.h"
#include "ops.h"
#include "path_counts.h"

void linear(torch::Tensor out, const torch::Tensor& x, const torch::Tensor& weight) {
  using mm::linear_kernel;
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "linear: x [m, k] and "
              "weight [n, k] must share k, got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && out.is_contiguous() && x.device().is_cpu() &&
              weight.device().is_cpu() && out.device().is_cpu(),
              "linear: x, weight and out must be contiguous CPU tensors");
  const auto dt = x.scalar_type();
  TORCH_CHECK((dt == torch::kFloat || dt == torch::kBFloat16) && weight.scalar_type() == dt &&
              (out.scalar_type() == dt || out.scalar_type() == torch::kFloat),
              "linear: x and weight both float32 or both bfloat16, out theirs or float32; got ", dt, ", ",
              weight.scalar_type(), " and ", out.scalar_type());
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.size(1) == n, "linear: out must be [", m, ", ", n,
              "], got ", out.sizes());
  if (m == 0 || n == 0) return;
#if defined(__AVX512BF16__)
  if (dt == torch::kBFloat16) paths::ran(paths::kAvx512Bf16);
#endif
  if (dt == torch::kFloat) {
    linear_kernel(out.data_ptr<float>(), x.data_ptr<float>(), weight.data_ptr<float>(), m, k, n);
  } else if (out.scalar_type() == torch::kFloat) {
    linear_kernel(out.data_ptr<float>(), x.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(), m, k, n);
  } else {
    linear_kernel(out.data_ptr<at::BFloat16>(), x.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(),
                  m, k, n);
  }
}
