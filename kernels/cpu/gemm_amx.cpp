// The batch-invariant matmul on AMX tiles (Sapphire Rapids and later), bf16: linear_amx.
// AMX multiplies tiles: C[16 x 16 fp32] += A[16 rows x 32 bf16] . B[32 x 16 bf16], the B
// tile stored in pairs of k ("VNNI" layout: row r holds k = 2r, 2r + 1 of each of the 16
// columns). KernelOps.pack_weight (layers/backends.py) lays W [n, k] out once as
// [n / 16, k / 32, 16, 32] so each B tile is 1 KB of contiguous memory. Every output
// element starts at zero and gets one tdpbf16ps per 32-wide chunk of k, in order, whatever
// m, its row's place in the tile or the thread: batch-invariant like gemm.h's loop. Tail
// rows of x are copied into a zeroed tile; k must be a multiple of 32 (backends.py picks
// this kernel by the weight's shape alone, never by m).
//
// Built where the flags enable AMX (nanopaged/layers/build.py passes -mamx-tile and
// -mamx-bf16 on CPUs that have them); elsewhere this file compiles to nothing and the
// module has no linear_amx.

#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "path_counts.h"
#include "vec.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

namespace amx {

struct alignas(64) TileConfig {     // ldtilecfg's 64-byte operand
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Linux lets a process use the AMX tile registers only after asking (arch_prctl).
bool permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

// tiles 0-3: C (fp32 16 x 16), 4-5: A (two blocks of 16 x rows), 6-7: B (two column blocks)
void configure() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  // GCC 12 at -O3 drops the stores above as dead (it does not see ldtilecfg read them):
  // an empty asm that takes the address and clobbers memory keeps them.
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// A C tile's rows x cols corner to out (row stride ldo), rounded to O by bit operations:
// with c10's scalar conversion these stores took most of a decode step's matmul time.
template <typename O>
void store(O* out, const float* c, int64_t rows, int64_t cols, int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r) {
    if constexpr (std::is_same_v<O, float>) {
      std::memcpy(out + r * ldo, c + r * 16, cols * sizeof(float));
    } else {
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) out[r * ldo + j] = from_f32<O>(c[r * 16 + j]);
    }
  }
}

template <typename O>
void linear_amx_kernel(O* out, const at::BFloat16* x, const at::BFloat16* packed, int64_t m, int64_t k,
                       int64_t n) {
  const int64_t nb = (n + 15) / 16, kc = k / 32, xs = k * 2;   // column blocks, k chunks, x stride (bytes)
  at::parallel_for(0, (nb + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    configure();
    // A last block of other than 16 or 32 rows is read from a zero-filled copy. The
    // buffer is the thread's own and kept between calls: allocated per call, its pages
    // were faulted in again every time.
    const int64_t tail = m % 32 == 0 || m % 32 == 16 ? m : m - m % 32;
    thread_local std::vector<at::BFloat16> pad;
    if (tail < m) {
      if (static_cast<int64_t>(pad.size()) < 32 * k) pad.resize(32 * k);
      std::memcpy(pad.data(), x + tail * k, (m - tail) * k * sizeof(at::BFloat16));
      std::memset(static_cast<void*>(pad.data() + (m - tail) * k), 0, (32 - (m - tail)) * k * sizeof(at::BFloat16));
    }
    alignas(64) float c[4][256];
    // x in chunks of 256 rows (300 KB at k = 576) that stay in this core's L2 while
    // every column pair of the task passes over them; a prefill's whole x does not fit
    for (int64_t m0 = 0; m0 < m; m0 += 256)
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t j0 = pair * 32;
      const bool two_cols = 2 * pair + 1 < nb;
      const at::BFloat16* b0 = packed + (2 * pair) * kc * 512;
      const at::BFloat16* b1 = b0 + kc * 512;
      for (int64_t i = m0; i < std::min(m, m0 + 256); i += 32) {
        const int64_t rows = std::min<int64_t>(32, m - i);
        const bool two_rows = rows > 16;
        const at::BFloat16* a = i == tail ? pad.data() : x + i * k;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t q = 0; q < kc; ++q) {
          // B tiles 4 chunks ahead, into L1: at decode sizes the weights stream from
          // memory, and tile loads alone left the prefetcher behind
          for (int64_t line = 0; line < 1024; line += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(b0 + (q + 4) * 512) + line, _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(b1 + (q + 4) * 512) + line, _MM_HINT_T0);
          }
          _tile_loadd(4, a + q * 32, xs);
          _tile_loadd(6, b0 + q * 512, 64);
          _tile_dpbf16ps(0, 4, 6);
          if (two_rows) {
            _tile_loadd(5, a + 16 * k + q * 32, xs);
            _tile_dpbf16ps(2, 5, 6);
          }
          if (two_cols) {
            _tile_loadd(7, b1 + q * 512, 64);
            _tile_dpbf16ps(1, 4, 7);
            if (two_rows) _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, c[0], 64); _tile_stored(1, c[1], 64);
        _tile_stored(2, c[2], 64); _tile_stored(3, c[3], 64);
        const int64_t cols0 = std::min<int64_t>(16, n - j0), cols1 = std::min<int64_t>(16, n - j0 - 16);
        const int64_t rows0 = std::min<int64_t>(16, rows), rows1 = rows - rows0;
        store(out + i * n + j0, c[0], rows0, cols0, n);
        if (two_cols) store(out + i * n + j0 + 16, c[1], rows0, cols1, n);
        if (two_rows) {
          store(out + (i + 16) * n + j0, c[2], rows1, cols0, n);
          if (two_cols) store(out + (i + 16) * n + j0 + 16, c[3], rows1, cols1, n);
        }
      }
    }
    _tile_release();
  });
}

}  // namespace amx

// out [m, n] (bf16 or fp32) = x [m, k] bf16 @ W^T, W given packed by KernelOps.pack_weight:
// [ceil(n / 16), k / 32, 16, 32] bf16.
void linear_amx(torch::Tensor out, const torch::Tensor& x, const torch::Tensor& packed) {
  TORCH_CHECK(amx::permitted(), "linear_amx: the kernel refused AMX to this process (arch_prctl)");
  paths::ran(paths::kAmx);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kBFloat16 && x.size(1) % 32 == 0,
              "linear_amx: x must be contiguous bf16 [m, k] with k a multiple of 32, got ", x.scalar_type(), " ",
              x.sizes());
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.scalar_type() == torch::kBFloat16 &&
              packed.size(0) == (n + 15) / 16 && packed.size(1) == k / 32 && packed.size(2) == 16 &&
              packed.size(3) == 32, "linear_amx: packed must be bf16 [", (n + 15) / 16, ", ", k / 32,
              ", 16, 32] for out's n = ", n, " and k = ", k, ", got ", packed.sizes());
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == m &&
              (out.scalar_type() == torch::kFloat || out.scalar_type() == torch::kBFloat16),
              "linear_amx: out must be contiguous [m, n] bf16 or float32");
  if (m == 0 || n == 0) return;
  if (out.scalar_type() == torch::kFloat)
    amx::linear_amx_kernel(out.data_ptr<float>(), x.data_ptr<at::BFloat16>(), packed.data_ptr<at::BFloat16>(),
                           m, k, n);
  else
    amx::linear_amx_kernel(out.data_ptr<at::BFloat16>(), x.data_ptr<at::BFloat16>(),
                           packed.data_ptr<at::BFloat16>(), m, k, n);
}
#endif
