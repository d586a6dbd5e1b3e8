// A tiny SIMT emulator: runs a CUDA kernel's source on the CPU, so that its indexing,
// shuffles and block reductions are checked on machines without a GPU (CI here has none).
//
// One thread block runs at a time; each CUDA thread is a coroutine (ucontext) that runs
// until it reaches __syncthreads or a warp shuffle, where it yields until all threads of
// its block (or warp) have arrived. __shared__ variables become function statics, shared
// by the threads of the one running block. Single core and slow: small problems only.
// Not a CUDA implementation: no memory model, no race detection; 1-d thread blocks and
// float shuffles are all our kernels use. tests/layers/test_kernels_cuda.py compiles
// kernels/cuda/attention.cu against it (rewriting only the `extern __shared__` line).
#pragma once
#include <cuda_bf16.h>   // host-side __half / __nv_bfloat16 and their conversions
#include <cuda_fp16.h>
#include <ucontext.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <stdexcept>
#include <vector>

namespace simt {

struct Barrier {
  int arrived = 0;
  long generation = 0;
};
struct Thread {
  ucontext_t ctx;
  dim3 idx;
  bool done = false;
  const Barrier* waiting_on = nullptr;   // resumed only once this barrier's generation moves on
  long waiting_generation = 0;
  bool runnable() const { return !done && (!waiting_on || waiting_on->generation != waiting_generation); }
};
constexpr size_t STACK_BYTES = 64 * 1024;   // per CUDA thread; our kernels need a few KB

inline std::vector<Thread> threads;
inline std::vector<std::vector<char>> stacks;   // kept across blocks: allocating is the slow part
inline int current = 0;
inline ucontext_t scheduler;
inline dim3 block_idx, grid_dim, block_dim;
inline std::vector<char> dynamic_smem;
inline std::function<void()> body;
inline Barrier block_barrier;
inline std::vector<Barrier> warp_barriers;
inline std::vector<std::array<float, 32>> shuffle_slots;
inline void yield() { swapcontext(&threads[current].ctx, &scheduler); }

inline void wait(Barrier& b, int count) {
  if (++b.arrived == count) {
    b.arrived = 0;
    ++b.generation;
  } else {
    threads[current].waiting_on = &b;
    threads[current].waiting_generation = b.generation;
    yield();
    threads[current].waiting_on = nullptr;
  }
}

inline int warp_width(int warp) { return std::min<int>(32, int(threads.size()) - warp * 32); }

inline float shfl_xor(float value, int lane_mask) {
  const int warp = current / 32, lane = current % 32;
  shuffle_slots[warp][lane] = value;
  wait(warp_barriers[warp], warp_width(warp));
  const float other = shuffle_slots[warp][lane ^ lane_mask];
  wait(warp_barriers[warp], warp_width(warp));   // nobody overwrites a slot before it is read
  return other;
}

inline void entry() {
  body();
  threads[current].done = true;
}

// Runs kernel_call() (a call of the kernel with its arguments) for every thread of
// every block of the grid. Dynamic shared memory starts as 0xff bytes (NaN floats), so
// a read of a value nobody wrote shows up in the results.
template <typename F>
void launch(dim3 grid, dim3 block, size_t smem_bytes, F kernel_call) {
  if (block.y != 1 || block.z != 1) throw std::runtime_error("simt: 1-d thread blocks only");
  grid_dim = grid;
  block_dim = block;
  body = kernel_call;
  const int n = block.x;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        block_idx = dim3(x, y, z);
        dynamic_smem.assign(smem_bytes, char(0xff));
        threads.assign(n, Thread{});
        stacks.resize(std::max<size_t>(stacks.size(), n));
        warp_barriers.assign((n + 31) / 32, Barrier{});
        shuffle_slots.assign((n + 31) / 32, {});
        block_barrier = Barrier{};
        for (int i = 0; i < n; ++i) {
          Thread& t = threads[i];
          t.idx = dim3(i, 0, 0);
          stacks[i].resize(STACK_BYTES);
          getcontext(&t.ctx);
          t.ctx.uc_stack.ss_sp = stacks[i].data();
          t.ctx.uc_stack.ss_size = STACK_BYTES;
          t.ctx.uc_link = &scheduler;
          makecontext(&t.ctx, entry, 0);
        }
        // Round robin over the threads that can run; if none can and some are not done,
        // they wait at barriers that not all threads reach: a deadlock (a bug).
        for (int left = n; left > 0;) {
          bool ran = false;
          for (current = 0; current < n; ++current)
            if (threads[current].runnable()) {
              swapcontext(&scheduler, &threads[current].ctx);
              left -= threads[current].done;
              ran = true;
            }
          if (!ran) throw std::runtime_error("simt: deadlock (a barrier that not every thread reaches)");
        }
      }
}

}  // namespace simt

// What the kernel source sees instead of CUDA's built-ins.
#undef __shared__
#define __shared__ static
#define __launch_bounds__(...)
#define threadIdx (::simt::threads[::simt::current].idx)
#define blockIdx (::simt::block_idx)
#define gridDim (::simt::grid_dim)
#define blockDim (::simt::block_dim)
inline void __syncthreads() { simt::wait(simt::block_barrier, int(simt::threads.size())); }
inline float __shfl_xor_sync(unsigned, float value, int lane_mask) { return simt::shfl_xor(value, lane_mask); }
inline float __expf(float x) { return std::exp(x); }
