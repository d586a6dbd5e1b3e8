// int8 weights, one fp32 scale per output row: y = x (q * scale)^T, int8_linear.
// quantization="int8" (nanopaged/quantization/int8.py): W [n, k] stored as int8 q and
// scale [n] fp32, w = q * scale. Each vector of q is widened to fp32 and multiplied by its
// row's scale (one rounding, as q.float() * scale in PyTorch), then fed to linear_kernel's
// FMAs in linear_kernel's order: the fp32 matmul on the dequantized weights, bit for bit
// (batch-invariant), reading 1 byte a weight where fp32 reads 4.

#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../gemm.h"
#include "../vec.h"
#include "ops.h"
#include "widened.h"

namespace i8 {

// kLanes int8 from p (n of them when n < kLanes, zeros after), widened and scaled.
inline mm::vec dequant(const int8_t* p, int64_t n, float scale) {
  using namespace mm;
#if defined(__AVX512F__)
  const __m128i q = n >= kLanes ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))
                                : _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << n) - 1), p);
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), vset1(scale));
#elif defined(__AVX2__)
  __m128i q;
  if (n >= kLanes) {
    q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  } else {                                              // a tail: through a zeroed buffer
    alignas(16) int8_t buf[16] = {};
    std::memcpy(buf, p, n);
    q = _mm_load_si128(reinterpret_cast<const __m128i*>(buf));
  }
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), vset1(scale));
#else
  (void)n;
  return static_cast<float>(*p) * scale;
#endif
}

// res[r][c] = x_r . w_c for R rows of x and 4 int8 weight rows: dot_tile's loop.
template <int R>
inline void qdot_tile(const float* const* xs, const int8_t* const* ws, const float* scales, int64_t k,
                      float (&res)[4][4]) {
  using namespace mm;
  vec acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = vzero();
  for (int64_t d = 0; d < k; d += kLanes) {
    const int64_t left = k - d;
#if defined(__AVX2__) || defined(__AVX512F__)
    if (d % 64 == 0)                                    // the next 4 rows follow in memory
      for (int c = 0; c < 4; ++c) _mm_prefetch(reinterpret_cast<const char*>(ws[c] + 4 * k + d), _MM_HINT_T0);
#endif
    vec w[4];
    for (int c = 0; c < 4; ++c) w[c] = dequant(ws[c] + d, left, scales[c]);
    for (int r = 0; r < R; ++r) {
      const vec xv = vload(xs[r] + d, left);
      for (int c = 0; c < 4; ++c) acc[r][c] = vfma(xv, w[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) res[r][c] = vsum(acc[r][c]);
}

// linear_kernel's tiling over int8 rows.
void int8_linear_kernel(float* out, const float* x, const int8_t* w, const float* scale, int64_t m, int64_t k,
                        int64_t n) {
  constexpr int64_t kRowsPerTask = 32;
  constexpr int64_t kTileRows = mm::kLanes >= 16 ? 4 : 2;
  // many rows of x: the matrix widened once (widened::linear)
  constexpr int64_t kWholeFrom = 16;   // where it paid on a matrix in cache (GGUF's was set on cold ones)
  if (widened::linear(out, n, x, m, k, n, kWholeFrom, [&](float* wide, int64_t begin, int64_t end) {
        using mm::kLanes;
        for (int64_t j = begin; j < end; ++j) {
          float* row = wide + j * k;
          int64_t d = 0;
          for (; d + kLanes <= k; d += kLanes) mm::vstore(row + d, dequant(w + j * k + d, kLanes, scale[j]), kLanes);
          if (d < k) mm::vstore(row + d, dequant(w + j * k + d, k - d, scale[j]), k - d);
        }
      }))
    return;
  const int64_t chunk = std::max<int64_t>(kTileRows, (256 * 1024 / (k * sizeof(float))) / kTileRows * kTileRows);
  at::parallel_for(0, (n + kRowsPerTask - 1) / kRowsPerTask, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i0 = 0; i0 < m; i0 += chunk)
    for (int64_t task = begin; task < end; ++task) {
      const int64_t j0 = task * kRowsPerTask, j1 = std::min(n, j0 + kRowsPerTask);
      for (int64_t i = i0; i < std::min(m, i0 + chunk); i += kTileRows) {
        const int64_t rows = std::min<int64_t>(kTileRows, m - i);
        const float* xs[4];
        for (int r = 0; r < 4; ++r) xs[r] = x + std::min(i + r, m - 1) * k;
        for (int64_t j = j0; j < j1; j += 4) {
          const int8_t* ws[4];                          // a short group repeats its last row
          float scales[4];
          for (int c = 0; c < 4; ++c) {
            const int64_t row = std::min(j + c, j1 - 1);
            ws[c] = w + row * k, scales[c] = scale[row];
          }
          float res[4][4];
          switch (rows) {
            case 1: qdot_tile<1>(xs, ws, scales, k, res); break;
            case 2: qdot_tile<2>(xs, ws, scales, k, res); break;
            case 3: qdot_tile<3>(xs, ws, scales, k, res); break;
            default: qdot_tile<4>(xs, ws, scales, k, res);
          }
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < 4 && j + c < j1; ++c) out[(i + r) * n + j + c] = res[r][c];
        }
      }
    }
  });
}

}  // namespace i8

// out [m, n] fp32 contiguous = x [m, k] fp32 @ (qweight * scale[:, None])^T, qweight [n, k]
// int8 and scale [n] fp32, all contiguous on the CPU.
void int8_linear(torch::Tensor out, const torch::Tensor& x, const torch::Tensor& qweight,
                 const torch::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat && x.device().is_cpu(),
              "int8_linear: x must be contiguous float32 [m, k] on the CPU, got ", x.scalar_type(), " ", x.sizes());
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0);
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.scalar_type() == torch::kChar &&
              qweight.device().is_cpu() && qweight.size(1) == k, "int8_linear: qweight must be contiguous int8 "
              "[n, ", k, "] on the CPU, got ", qweight.scalar_type(), " ", qweight.sizes());
  TORCH_CHECK(scale.dim() == 1 && scale.is_contiguous() && scale.scalar_type() == torch::kFloat &&
              scale.device().is_cpu() && scale.size(0) == n, "int8_linear: scale must be contiguous float32 [",
              n, "], got ", scale.scalar_type(), " ", scale.sizes());
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == torch::kFloat && out.size(0) == m &&
              out.size(1) == n, "int8_linear: out must be contiguous float32 [", m, ", ", n, "], got ",
              out.scalar_type(), " ", out.sizes());
  if (m == 0 || n == 0) return;
  i8::int8_linear_kernel(out.data_ptr<float>(), x.data_ptr<float>(), qweight.data_ptr<int8_t>(),
                         scale.data_ptr<float>(), m, k, n);
}
