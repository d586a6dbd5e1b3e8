// The scratch a quantized matmul widens a whole matrix into (gguf.cpp, int8.cpp):
// header-only, one scratch per extension.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>
#include <mutex>
#include <vector>

#include "../gemm.h"

// ---- Quantized weights, many rows of x: widen the matrix once, then the fp32 matmul ---------
// A quantized matmul (gguf_linear, int8_linear) widens its weights to fp32 as it reads them.
// With many rows of x (prefill, large batches) it widens the whole matrix once instead,
// into a scratch kept from call to call, and runs linear_kernel on that: the same widened
// values through the same FMAs in the same order, so the same bits as its other paths. The
// scratch is grow-only, at most kMaxBytes (a larger matrix keeps the per-tile paths): a
// new buffer of megabytes is fresh pages from the OS at every call (glibc maps it), and
// touching them first cost more than the widening. A call that finds the scratch in use
// by another thread takes its other path.
namespace widened {

// p rounded up to 64 bytes (in a buffer of 16 floats more), where torch's tensors start:
// from malloc's 16-byte alignment a quarter of the vector loads split a cache line
// (gguf_linear's per-task panels are aligned the same way)
inline float* align64(float* p) {
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63});
}

constexpr int64_t kMaxBytes = 64 << 20;

inline std::mutex mutex;                                 // one scratch for every format
inline std::vector<float> scratch;

// Runs the matmul into out (rows ldo apart) if m >= from_rows and the matrix fits: widen(wide,
// begin, end) writes rows [begin, end) of the fp32 matrix [n, k] at wide (called in parallel
// over row ranges). Returns false, doing nothing, otherwise.
template <typename Widen>
bool linear(float* out, int64_t ldo, const float* x, int64_t m, int64_t k, int64_t n, int64_t from_rows,
            Widen&& widen) {
  if (m < from_rows || n * k * 4 > kMaxBytes) return false;
  std::unique_lock<std::mutex> lock(mutex, std::try_to_lock);
  if (!lock.owns_lock()) return false;
  if (static_cast<int64_t>(scratch.size()) < n * k + 16) scratch.resize(n * k + 16);
  float* wide = align64(scratch.data());
  at::parallel_for(0, n, 32, [&](int64_t begin, int64_t end) { widen(wide, begin, end); });
  mm::linear_kernel<float, float>(out, x, wide, m, k, n, ldo);
  return true;
}

}  // namespace widened
