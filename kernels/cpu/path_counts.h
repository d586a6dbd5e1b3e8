// Which instruction-set bodies ran, counted per call, in each CPU extension (bindings.cpp,
// quant/bindings.cpp). A green suite says little about a body it never ran: a pytest run
// prints these counts (nanopaged/layers/build.py, kernel_paths) beside the flags each build
// was compiled with (bindings.h reports them). The counters are inline variables: one set
// per extension, shared by its files.
// kVector: any kernel call (its loops run this build's `vec`: AVX512, AVX2 or one lane);
// kAvx512Bf16: a bf16 `linear` on vdpbf16ps; kAmx: a `linear_amx` on the tiles.
#pragma once

#include <atomic>
#include <cstdint>
#include <utility>

namespace paths {
enum Path { kVector, kAvx512Bf16, kAmx, kNumPaths };
inline std::atomic<int64_t> calls[kNumPaths];
inline void ran(Path p) { calls[p].fetch_add(1, std::memory_order_relaxed); }
}  // namespace paths

// Every kernel entry point counted (paths::kVector) on its way in.
template <auto F>
struct Counted;
template <typename R, typename... A, R (*F)(A...)>
struct Counted<F> {
  static R call(A... args) {
    paths::ran(paths::kVector);
    return F(std::forward<A>(args)...);
  }
};
