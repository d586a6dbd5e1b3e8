// The batch-invariant matmul's loops (header-only: gemm.cpp's `linear` runs them, and the
// quantized matmuls of quant/ feed them widened weights, so they share its bits).
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "vec.h"

// ---- Matmul: y = x W^T, the same bits for a row whatever its batch ------------------------
// x: [m, k], W: [n, k] (fp32 with fp32, or bf16 with bf16), out: [m, n] in x's dtype or fp32.
//
// Batch invariance (chapters/05-llama.md): MKL and oneDNN pick their blocking, and with it
// the order in which a dot product's k terms are added, by the number of rows m, so a
// row's result changes with the batch it shares (measured: MKL's sgemm at m = 1 vs 2,
// oneDNN's bf16 at m = 32 vs 33). Here every dot product x_i . w_j is computed by the same
// instructions in the same order whatever m, i or the thread: a vector accumulator walks
// k in chunks of one vector, fused multiply-adds into it, and one fixed horizontal sum
// ends it. The tile code below only decides which dot products share the loads (R rows of
// x times 4 rows of W in registers); each accumulator is independent, so R = 1 and R = 4
// give the same bits (intrinsics are never reassociated: no -ffast-math).
//
// Speed: a decode step is a walk through the weights (SmolLM2: 270 MB of bf16 per step),
// so each group of 4 weight rows is read from memory once for up to 4 x rows and stays in
// L1 for the next; prefill steps reuse a block of 32 weight rows for every x row.
// bf16 uses AVX512-BF16's dot-product instruction (vdpbf16ps: 32 products per
// instruction, summed in pairs into fp32) where the CPU has it, else widens bf16 to fp32
// and uses fp32 FMAs (exact products; other bits than vdpbf16ps, same on every batch).
namespace mm {

// res[r][c] = x_r . w_c for R rows of x (stride k) and C <= 4 weight rows.
template <typename T, int R, int C = 4>
inline void dot_tile(const T* const* xs, const T* const* ws, int64_t k, float (&res)[4][4]) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {        // vdpbf16ps: 32 bf16 pairs a step
    __m512 acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t d = 0; d < k; d += 32) {
      const int64_t left = k - d;
      const __mmask32 mask = left >= 32 ? ~0u : static_cast<__mmask32>((1ull << left) - 1);
      __m512i w[C];
      for (int c = 0; c < C; ++c) w[c] = _mm512_maskz_loadu_epi16(mask, ws[c] + d);
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_maskz_loadu_epi16(mask, xs[r] + d);
        for (int c = 0; c < C; ++c)
          acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)xv, (__m512bh)w[c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) res[r][c] = _mm512_reduce_add_ps(acc[r][c]);
    return;
  }
#endif
  vec acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vzero();
  const auto step = [&](int64_t d, int64_t left) {
    vec w[C];
    for (int c = 0; c < C; ++c) w[c] = vload(ws[c] + d, left);
    for (int r = 0; r < R; ++r) {
      const vec xv = vload(xs[r] + d, left);
      for (int c = 0; c < C; ++c) acc[r][c] = vfma(xv, w[c], acc[r][c]);
    }
  };
  // whole vectors with a constant length, then the partial one: the same loads and FMAs as
  // one loop with a variable length, without a length check in every load
  int64_t d = 0;
  for (; d + kLanes <= k; d += kLanes) step(d, kLanes);
  if (d < k) step(d, k - d);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) res[r][c] = vsum(acc[r][c]);
}

// linear_kernel's tile: kTileRows rows of x by kTileCols weight rows, their sums in
// registers with a weight vector each and one of x: AVX512's 32 registers hold 4 x 4 (16
// sums), AVX2's 16 hold 4 x 3 (12 sums, 3 weight vectors, x): 7 loads for 12 FMAs, where
// a 2 x 4 tile takes 6 for 8. Same bits: each sum is its own accumulator whichever tile
// holds it.
constexpr int kTileRows = 4, kTileCols = kLanes >= 16 ? 4 : 3;

// out's rows are ldo apart (default n; gguf_linear writes a column slice of a wider out)
template <typename T, typename O>
void linear_kernel(O* out, const T* x, const T* w, int64_t m, int64_t k, int64_t n, int64_t ldo = -1) {
  if (ldo < 0) ldo = n;
  constexpr int64_t kRowsPerTask = 32;          // weight rows a task keeps in cache for every x row
  // x in chunks of ~256 KB, which stay in L2 while the thread's weight rows pass over them
  const int64_t chunk = std::max<int64_t>(kTileRows, (256 * 1024 / (k * sizeof(T))) / kTileRows * kTileRows);
  at::parallel_for(0, (n + kRowsPerTask - 1) / kRowsPerTask, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i0 = 0; i0 < m; i0 += chunk)
    for (int64_t task = begin; task < end; ++task) {
      const int64_t j0 = task * kRowsPerTask, j1 = std::min(n, j0 + kRowsPerTask);
      for (int64_t i = i0; i < std::min(m, i0 + chunk); i += kTileRows) {
        const int64_t rows = std::min<int64_t>(kTileRows, m - i);
        const T* xs[4];
        for (int r = 0; r < 4; ++r) xs[r] = x + std::min(i + r, m - 1) * k;
        for (int64_t j = j0; j < j1; j += kTileCols) {
          const T* ws[4];                        // a short group repeats its last row
          for (int c = 0; c < 4; ++c) ws[c] = w + std::min(j + c, j1 - 1) * k;
          float res[4][4];
          switch (rows) {
            case 1: dot_tile<T, 1, kTileCols>(xs, ws, k, res); break;
            case 2: dot_tile<T, 2, kTileCols>(xs, ws, k, res); break;
            case 3: dot_tile<T, 3, kTileCols>(xs, ws, k, res); break;
            default: dot_tile<T, 4, kTileCols>(xs, ws, k, res);
          }
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < kTileCols && j + c < j1; ++c) out[(i + r) * ldo + j + c] = static_cast<O>(res[r][c]);
        }
      }
    }
  });
}

}  // namespace mm
