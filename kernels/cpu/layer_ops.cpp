// The Llama layer's elementwise ops, fused, on the CPU: RMSNorm (alone, or after the
// residual add), SiLU-and-mul and RoPE.
//
// In PyTorch each of these is 4-7 ops, every one a pass over memory and a trip through the
// dispatcher (those trips are most of a batch-1 decode step). One loop each here, in fp32,
// rounding to the model's dtype where transformers rounds.
// vLLM: csrc/cpu/layernorm.cpp, activation.cpp, pos_encoding.cpp.

#include <ATen/Parallel.h>
#include <torch/types.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace {
void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1 && t.device().is_cpu(), name,
              " must be a CPU [num_tokens, n] tensor with dense rows, got ", t.sizes(), " strides ", t.strides());
}
}  // namespace

namespace {
// RMSNorm (transformers' LlamaRMSNorm) of each row, see rms_norm and fused_add_rms_norm.
void rms_norm_impl(torch::Tensor out, torch::Tensor x, std::optional<torch::Tensor> residual,
                   const torch::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  const int64_t rows = x.size(0), hidden = x.size(1);
  TORCH_CHECK(weight.numel() == hidden && weight.is_contiguous() && weight.scalar_type() == x.scalar_type(),
              "weight must be [hidden = ", hidden, "] in x's dtype");
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(), "out must be shaped like x");
  if (residual) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "residual must be shaped like x ", x.sizes(), ", got ", residual->sizes());
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = residual ? xp : out.data_ptr<scalar_t>();
    scalar_t* rp = residual ? residual->data_ptr<scalar_t>() : nullptr;
    const int64_t xs = x.stride(0), os = residual ? xs : out.stride(0), rs = residual ? residual->stride(0) : 0;
    const scalar_t* w = weight.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(hidden);
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t* src = xp + i * xs;
        if (rp) {
          scalar_t* res = rp + i * rs;
          _Pragma("omp simd")
          for (int64_t d = 0; d < hidden; ++d) {
            res[d] = from_f32<scalar_t>(to_f32(res[d]) + to_f32(src[d]));
            buf[d] = to_f32(res[d]);
          }
        } else {
          _Pragma("omp simd")
          for (int64_t d = 0; d < hidden; ++d) buf[d] = to_f32(src[d]);
        }
        const float ss = mm::sum_squares(buf.data(), hidden);
        const float inv = 1.f / std::sqrt(ss / hidden + static_cast<float>(eps));
        scalar_t* dst = op + i * os;
        _Pragma("omp simd")
        for (int64_t d = 0; d < hidden; ++d)
          dst[d] = from_f32<scalar_t>(to_f32(w[d]) * to_f32(from_f32<scalar_t>(buf[d] * inv)));
      }
    });
  });
}
}  // namespace

// out = weight * (x / sqrt(mean(x^2) + eps)), the mean in fp32 and the normalized row
// rounded to x's dtype before the weight multiply, as transformers does.
// x, out: [num_tokens, hidden] (dense rows); weight: [hidden], x's dtype.
void rms_norm(torch::Tensor out, const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  rms_norm_impl(out, x, std::nullopt, weight, eps);
}

// vLLM's fused_add_rms_norm, in place: residual += x (the skip connection, in x's dtype),
// then x = rms_norm(residual). The add costs no pass of its own. x, residual: [num_tokens, hidden].
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, const torch::Tensor& weight, double eps) {
  rms_norm_impl(x, x, residual, weight, eps);
}

// SwiGLU's gate: out = silu(x[:, :d]) * x[:, d:], x: [num_tokens, 2d] (gate_up_proj's
// output), out: [num_tokens, d]. silu(g) = g / (1 + exp(-g)).
void silu_and_mul(torch::Tensor out, const torch::Tensor& x) {
  check_rows(x, "x");
  check_rows(out, "out");
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  TORCH_CHECK(x.size(1) == 2 * d && out.size(0) == rows && out.size(1) == d && out.scalar_type() == x.scalar_type(),
              "silu_and_mul: x must be [n, 2d] and out [n, d], got ", x.sizes(), " and ", out.sizes());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t xs = x.stride(0), os = out.stride(0);
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t* gate = xp + i * xs;
        const scalar_t* up = gate + d;
        scalar_t* dst = op + i * os;
        _Pragma("omp simd")
        for (int64_t j = 0; j < d; ++j) {
          const float g = to_f32(gate[j]);
          const scalar_t act = from_f32<scalar_t>(g / (1.f + fast_exp(-g)));
          dst[j] = from_f32<scalar_t>(to_f32(act) * to_f32(up[j]));
        }
      }
    });
  });
}

// RoPE in place, GPT-NeoX layout (transformers' rotate_half): for each head, with
// h = head_size / 2, x[i] <- x[i] cos[i] - x[i + h] sin[i] and x[i + h] <- x[i + h]
// cos[i + h] + x[i] sin[i + h]. query: [num_tokens, num_heads * head_size], key:
// [num_tokens, num_kv_heads * head_size] (views of qkv_proj's output: strided rows);
// positions: [num_tokens] int64; cos, sin: [max_positions, head_size] in x's dtype.
void rotary_embedding(const torch::Tensor& positions, torch::Tensor query, torch::Tensor key,
                      const torch::Tensor& cos, const torch::Tensor& sin, int64_t head_size) {
  check_rows(query, "query");
  check_rows(key, "key");
  const int64_t rows = query.size(0), half = head_size / 2, max_pos = cos.size(0);
  TORCH_CHECK(head_size % 2 == 0 && query.size(1) % head_size == 0 && key.size(1) % head_size == 0 &&
              key.size(0) == rows, "rotary_embedding: query ", query.sizes(), " and key ", key.sizes(),
              " must be [num_tokens, heads * head_size = ", head_size, "]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == head_size &&
              sin.sizes() == cos.sizes() && cos.scalar_type() == query.scalar_type() &&
              key.scalar_type() == query.scalar_type(), "cos/sin must be contiguous [max_positions, head_size = ",
              head_size, "] in query's dtype");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous() && positions.numel() == rows,
              "positions must be contiguous int64 [num_tokens = ", rows, "]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; ++i)
    TORCH_CHECK(pos[i] >= 0 && pos[i] < max_pos, "positions[", i, "] = ", pos[i], " is outside the RoPE "
                "table [0, ", max_pos, ")");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "rotary_embedding", [&] {
    auto rotate = [&](scalar_t* x, const scalar_t* c, const scalar_t* s) {
      _Pragma("omp simd")
      for (int64_t j = 0; j < half; ++j) {
        const float x1 = to_f32(x[j]), x2 = to_f32(x[j + half]);
        // transformers: x * cos + rotate_half(x) * sin, each product rounded to the dtype
        const auto t1 = from_f32<scalar_t>(x1 * to_f32(c[j]));
        const auto t2 = from_f32<scalar_t>(-x2 * to_f32(s[j]));
        const auto t3 = from_f32<scalar_t>(x2 * to_f32(c[j + half]));
        const auto t4 = from_f32<scalar_t>(x1 * to_f32(s[j + half]));
        x[j] = from_f32<scalar_t>(to_f32(t1) + to_f32(t2));
        x[j + half] = from_f32<scalar_t>(to_f32(t3) + to_f32(t4));
      }
    };
    scalar_t* qp = query.data_ptr<scalar_t>();
    scalar_t* kp = key.data_ptr<scalar_t>();
    const int64_t qs = query.stride(0), ks = key.stride(0);
    const int64_t nq = query.size(1) / head_size, nk = key.size(1) / head_size;
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t* c = cos.data_ptr<scalar_t>() + pos[i] * head_size;
        const scalar_t* s = sin.data_ptr<scalar_t>() + pos[i] * head_size;
        for (int64_t h = 0; h < nq; ++h) rotate(qp + i * qs + h * head_size, c, s);
        for (int64_t h = 0; h < nk; ++h) rotate(kp + i * ks + h * head_size, c, s);
      }
    });
  });
}
