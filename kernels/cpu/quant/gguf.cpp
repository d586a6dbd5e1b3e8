// y = x W^T with W kept as the GGUF file's bytes (ggml.h's block formats): gguf_linear.
//
// Each block is widened to fp32 in registers as it is read, a vector at a time, and fed to
// the same FMAs in the same order as linear_kernel's fp32 loop (../gemm.h): the result is that
// loop's on the dequantized weights, bit for bit (so batch-invariant). The widened values
// are gguf.quants.dequantize's, which rounds each op to fp32. d * sc is exact (11-bit
// fp16 mantissa x 6 or 8 bits); q * d and (d * sc) * q for 4- or 5-bit q are exact too
// (<= 22 bits), so q * d + m and (d * sc) * q - dmin * mn round once: a fused
// multiply-add gives the same bits. Q6_K's (d * sc) * q (up to 25 bits) may round, so it is
// a plain multiply, as numpy's. A decode step reads each packed byte once: Q4_1 is 5 bits
// a weight, Q4_K 4.5, where fp32 is 32. nanopaged/quantization/gguf.py holds the layer
// side.

#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "../gemm.h"
#include "../vec.h"
#include "ggml.h"
#include "ops.h"
#include "widened.h"

namespace ggml {

template <int N, typename F>
inline void unroll(F&& f) {                              // f(0), ..., f(N - 1), the index a constant
  [&]<int... I>(std::integer_sequence<int, I...>) { (f(std::integral_constant<int, I>{}), ...); }(
      std::make_integer_sequence<int, N>{});
}

// res[r][c] = x_r . w_c for R rows of x and 4 packed weight rows of `blocks` blocks:
// dot_tile's accumulators, loads and sums, with each weight vector widened from its block.
template <int64_t Q, int R>
inline void qdot_tile(const float* const* xs, const uint8_t* const* ws, int64_t blocks, float (&res)[4][4]) {
  using namespace mm;
  constexpr int64_t kW = kWeights<Q>, kB = kBytes<Q>;
  const int64_t ahead = 4 * blocks * kB;                 // the next 4 rows: they follow in memory
  vec acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = vzero();
  for (int64_t b = 0; b < blocks; ++b) {
#if defined(__AVX2__) || defined(__AVX512F__)
    // at decode sizes the packed rows stream from memory, and the hardware prefetcher
    // alone falls behind them
    for (int c = 0; c < 4; ++c)
      for (int64_t o = 0; o < kB; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(ws[c] + b * kB + ahead + o), _MM_HINT_T0);
#endif
    if constexpr (R == 1 && kW == 32) {
      // one row of x on a 32-weight format: x's block in registers, then a weight row's
      // block at a time, its scales live only while its vectors are summed (the four rows'
      // blocks at once held 8 scales and spilled to the stack).
      // Each acc[0][c] gets the same FMAs in the same order as below.
      vec xv[kW / kLanes];
      unroll<kW / kLanes>([&](auto t) { xv[t] = vload(xs[0] + b * kW + t * kLanes, kLanes); });
      for (int c = 0; c < 4; ++c) {
        const BlockOf<Q> blk(ws[c] + b * kB);
        unroll<kW / kLanes>([&](auto t) {
          acc[0][c] = vfma(xv[t], blk.template widen<decltype(t)::value>(0), acc[0][c]);
        });
      }
      continue;
    }
    const BlockOf<Q> blk[4] = {BlockOf<Q>(ws[0] + b * kB), BlockOf<Q>(ws[1] + b * kB),
                               BlockOf<Q>(ws[2] + b * kB), BlockOf<Q>(ws[3] + b * kB)};
    constexpr int kGroup = BlockOf<Q>::kGroup;
    for (int g = 0; g < kW / kGroup; ++g)
      unroll<kGroup / kLanes>([&](auto t) {              // the group's vectors, in k's order
        vec xv[R];
        for (int r = 0; r < R; ++r) xv[r] = vload(xs[r] + b * kW + g * kGroup + t * kLanes, kLanes);
        for (int c = 0; c < 4; ++c) {
          const vec w = blk[c].template widen<decltype(t)::value>(g);
          for (int r = 0; r < R; ++r) acc[r][c] = vfma(xv[r], w, acc[r][c]);
        }
      });
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) res[r][c] = vsum(acc[r][c]);
}

// Rows [0, rows) of packed weights (row_bytes apart) widened into panel [rows, k] fp32:
// the values qdot_tile widens in registers, stored instead.
template <int64_t Q>
inline void widen_rows(float* panel, const uint8_t* w, int64_t rows, int64_t row_bytes, int64_t k) {
  using namespace mm;
  constexpr int64_t kW = kWeights<Q>, kB = kBytes<Q>;
  constexpr int kGroup = BlockOf<Q>::kGroup;
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t b = 0; b < k / kW; ++b) {
      const BlockOf<Q> blk(w + j * row_bytes + b * kB);
      for (int g = 0; g < kW / kGroup; ++g)
        unroll<kGroup / kLanes>([&](auto t) {
          vstore(panel + j * k + b * kW + g * kGroup + t * kLanes, blk.template widen<decltype(t)::value>(g),
                 kLanes);
        });
    }
}

// Three paths by the rows m of x, all feeding the FMAs the same widened values in the same
// order as linear_kernel's dot_tile, so a row's bits do not depend on which path its batch
// took (batch invariance; the tests cross every threshold):
// - m < kPanelFrom (decode): tasks of 32 weight rows, 4 at a time against kTileRows rows
//   of x (a short group repeating its last row), each block widened in registers
//   (qdot_tile): the packed bytes are read once;
// - kPanelFrom <= m < kWholeFrom (batches, prefill chunks): a task first widens its 32
//   weight rows into a panel of fp32 (~32 x k x 4 bytes, in L2), then runs dot_tile on it
//   in linear_kernel's tile for every row of x: a block is widened once, not once per
//   kTileRows rows of x;
// - m >= kWholeFrom (1024: long prefills under a token budget above the CPU's default
//   512): the whole matrix is widened once into a scratch kept between calls
//   (widened::linear; at most 64 MB, else the panels) and linear_kernel runs on it, x in
//   L2-sized chunks. Each weight is widened once a call either way; the scratch is written
//   and read back through L3, where a panel stays in L2 and x is read again per task.
// The thresholds are where each path began to pay when timed: a panel from 3 rows of x
// (Q8_0, cheap to widen, from 12); the whole matrix from 1024, timed on cold matrices as a
// forward meets them (one matrix called again and again, in cache, favours it from 16).
template <int64_t Q>
void gguf_linear_kernel(float* out, int64_t ldo, const float* x, const uint8_t* w, int64_t m, int64_t k,
                        int64_t n) {
  constexpr int64_t kRowsPerTask = 32;
  constexpr int64_t kTileRows = mm::kLanes >= 16 ? 4 : 2;
  constexpr int kPanelCols = mm::kTileCols, kPanelRows = mm::kTileRows;
  constexpr int64_t kPanelFrom = Q == kQ8_0 ? 12 : 3;    // rows of x from which a task widens a panel
  constexpr int64_t kWholeFrom = 1024;                   // rows of x from which the whole matrix is widened
  const int64_t blocks = k / kWeights<Q>, row_bytes = blocks * kBytes<Q>;
  if (widened::linear(out, ldo, x, m, k, n, kWholeFrom, [&](float* wide, int64_t begin, int64_t end) {
        widen_rows<Q>(wide + begin * k, w + begin * row_bytes, end - begin, row_bytes, k);
      }))
    return;
  const bool panel = m >= kPanelFrom;
  at::parallel_for(0, (n + kRowsPerTask - 1) / kRowsPerTask, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(panel ? kRowsPerTask * k + 16 : 0);
    float* const wide = widened::align64(buf.data());
    for (int64_t task = begin; task < end; ++task) {
      const int64_t j0 = task * kRowsPerTask, j1 = std::min(n, j0 + kRowsPerTask);
      if (panel) widen_rows<Q>(wide, w + j0 * row_bytes, j1 - j0, row_bytes, k);
      const int64_t tile_rows = panel ? kPanelRows : kTileRows, tile_cols = panel ? kPanelCols : 4;
      for (int64_t i = 0; i < m; i += tile_rows) {
        const int64_t rows = std::min<int64_t>(tile_rows, m - i);
        const float* xs[4];
        for (int r = 0; r < 4; ++r) xs[r] = x + std::min(i + r, m - 1) * k;
        for (int64_t j = j0; j < j1; j += tile_cols) {
          float res[4][4];
          if (panel) {
            const float* ws[4];                          // a short group repeats its last row
            for (int c = 0; c < 4; ++c) ws[c] = wide + (std::min(j + c, j1 - 1) - j0) * k;
            switch (rows) {
              case 1: mm::dot_tile<float, 1, kPanelCols>(xs, ws, k, res); break;
              case 2: mm::dot_tile<float, 2, kPanelCols>(xs, ws, k, res); break;
              case 3: mm::dot_tile<float, 3, kPanelCols>(xs, ws, k, res); break;
              default: mm::dot_tile<float, 4, kPanelCols>(xs, ws, k, res);
            }
          } else {
            const uint8_t* ws[4];
            for (int c = 0; c < 4; ++c) ws[c] = w + std::min(j + c, j1 - 1) * row_bytes;
            switch (rows) {
              case 1: qdot_tile<Q, 1>(xs, ws, blocks, res); break;
              case 2: qdot_tile<Q, 2>(xs, ws, blocks, res); break;
              case 3: qdot_tile<Q, 3>(xs, ws, blocks, res); break;
              default: qdot_tile<Q, 4>(xs, ws, blocks, res);
            }
          }
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < tile_cols && j + c < j1; ++c) out[(i + r) * ldo + j + c] = res[r][c];
        }
      }
    }
  });
}

}  // namespace ggml

// gguf_linear's and gguf_linear_a8's shapes (`name` in the messages): x [m, k] fp32 with k
// whole blocks of qk, qweight [n, k / qk * bytes] uint8, out [m, n] fp32 with contiguous rows.
void check_gguf_args(const char* name, const torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& qweight,
                     int64_t qk, int64_t bytes) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat && x.device().is_cpu() &&
              x.size(1) % qk == 0, name, ": x must be contiguous float32 [m, k] on the CPU with k a "
              "multiple of ", qk, ", got ", x.scalar_type(), " ", x.sizes());
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0);
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.scalar_type() == torch::kUInt8 &&
              qweight.size(1) == k / qk * bytes, name, ": qweight must be contiguous uint8 [n, ",
              k / qk * bytes, "] for k = ", k, ", got ", qweight.scalar_type(), " ", qweight.sizes());
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == torch::kFloat && out.size(0) == m && out.size(1) == n &&
              out.stride(1) == 1 && (m <= 1 || out.stride(0) >= n), name, ": out must be float32 [", m,
              ", ", n, "] with contiguous rows, got ", out.scalar_type(), " ", out.sizes());
}

// out [m, n] fp32 (rows may be further apart: a column slice) = x [m, k] fp32 @ W^T, W the
// packed rows of a GGUF tensor: qweight [n, k / QK * block bytes] uint8, of GGML type qtype
// (2 Q4_0, 3 Q4_1, 6 Q5_0, 7 Q5_1, 8 Q8_0, 12 Q4_K, 13 Q5_K, 14 Q6_K).
void gguf_linear(torch::Tensor out, const torch::Tensor& x, const torch::Tensor& qweight, int64_t qtype) {
  using namespace ggml;
  const auto [qk, bytes] = geometry(qtype);
  TORCH_CHECK(qk > 0, "gguf_linear: GGML type ", qtype, " is not supported (Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, "
              "Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14)");
  check_gguf_args("gguf_linear", out, x, qweight, qk, bytes);
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0);
  if (m == 0 || n == 0) return;
  float* o = out.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  const int64_t ldo = out.stride(0);
  switch (qtype) {
    case kQ4_0: return gguf_linear_kernel<kQ4_0>(o, ldo, xp, w, m, k, n);
    case kQ4_1: return gguf_linear_kernel<kQ4_1>(o, ldo, xp, w, m, k, n);
    case kQ5_0: return gguf_linear_kernel<kQ5_0>(o, ldo, xp, w, m, k, n);
    case kQ5_1: return gguf_linear_kernel<kQ5_1>(o, ldo, xp, w, m, k, n);
    case kQ8_0: return gguf_linear_kernel<kQ8_0>(o, ldo, xp, w, m, k, n);
    case kQ4_K: return gguf_linear_kernel<kQ4_K>(o, ldo, xp, w, m, k, n);
    case kQ5_K: return gguf_linear_kernel<kQ5_K>(o, ldo, xp, w, m, k, n);
    default: return gguf_linear_kernel<kQ6_K>(o, ldo, xp, w, m, k, n);
  }
}
