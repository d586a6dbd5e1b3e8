// Batched LoRA on the GPU: Punica's BGMV, batched gather matrix-vector (Chen et al. 2023,
// "Punica: Multi-Tenant LoRA Serving"), the CUDA twin of kernels/cpu/lora/bgmv.cpp. Each
// row i of a batch uses its own adapter slot s = slots[i] (-1: none, the row is left alone):
//
//     lora_shrink:  t[i] = x[i] a[s]^T                    a: [num_slots, r, in]
//     lora_expand:  y[i] += (t[i] b[s]^T) * scales[s]    b: [num_slots, out, r]
//
// shrink: one block per row, one warp per rank index k (k = warp, warp + NUM_WARPS, ...):
// its 32 lanes stride over `in` with fp32 FMAs, then a shuffle tree adds the lanes.
// expand: one block per (row, tile of NUM_THREADS output columns), a thread per column:
// a dot product over r in order, then the scale and the add fused, rounded once.
// A row's block does the same work in the same order whatever the batch around it, so a
// row's bits depend on that row alone (batch-invariant), as on the CPU; the two devices
// sum in different lanes, so they agree closely, not bit for bit. vLLM: vllm/lora/ops/.
// Everything above the "PyTorch bindings" line is plain CUDA.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cassert>
#include <cstdint>

namespace nanopaged_lora {

constexpr int WARP_SIZE = 32;
constexpr int NUM_WARPS = 4;
constexpr int NUM_THREADS = NUM_WARPS * WARP_SIZE;
constexpr unsigned FULL_MASK = 0xffffffffu;

// fp32 math; these convert one element to and from the storage type (PyTorch builds
// extensions with the implicit half/bfloat16 conversions switched off).
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// grid (n), NUM_THREADS threads. out: [n, r] fp32 (rows out_stride apart); x: [n, in] (rows
// x_stride apart); a: [num_slots, r, in] contiguous; slots: [n].
template <typename T>
__global__ void shrink_kernel(float* __restrict__ out, const T* __restrict__ x, const T* __restrict__ a,
                              const int64_t* __restrict__ slots, int64_t num_slots, int64_t r, int64_t in,
                              int64_t out_stride, int64_t x_stride) {
  const int64_t i = blockIdx.x, s = slots[i];
  assert(s < num_slots);                  // checked here: the host cannot read slots without a sync
  float* o = out + i * out_stride;
  if (s < 0) {
    for (int64_t k = threadIdx.x; k < r; k += blockDim.x) o[k] = 0.f;
    return;
  }
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  const T* xi = x + i * x_stride;
  for (int64_t k = warp; k < r; k += NUM_WARPS) {
    const T* w = a + (s * r + k) * in;
    float acc = 0.f;
    for (int64_t d = lane; d < in; d += WARP_SIZE) acc = fmaf(to_float(xi[d]), to_float(w[d]), acc);
    for (int mask = WARP_SIZE / 2; mask >= 1; mask /= 2) acc += __shfl_xor_sync(FULL_MASK, acc, mask);
    if (lane == 0) o[k] = acc;
  }
}

// grid (n, ceil(out / NUM_THREADS)), NUM_THREADS threads. y: [n, out] (rows y_stride apart,
// in place); t: [n, r] fp32 (rows t_stride apart); b: [num_slots, out, r] contiguous;
// slots: [n]; scales: [num_slots].
template <typename T>
__global__ void expand_kernel(T* __restrict__ y, const float* __restrict__ t, const T* __restrict__ b,
                              const int64_t* __restrict__ slots, const float* __restrict__ scales,
                              int64_t num_slots, int64_t out, int64_t r, int64_t y_stride, int64_t t_stride) {
  const int64_t i = blockIdx.x, s = slots[i];
  const int64_t column = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  assert(s < num_slots);
  if (s < 0 || column >= out) return;
  const float* ti = t + i * t_stride;
  const T* w = b + (s * out + column) * r;
  float acc = 0.f;
  for (int64_t k = 0; k < r; ++k) acc = fmaf(ti[k], to_float(w[k]), acc);
  T* target = y + i * y_stride + column;
  *target = from_float<T>(fmaf(acc, scales[s], to_float(*target)));
}

}  // namespace nanopaged_lora

// ---------------------------------------------------------------- PyTorch bindings
#ifndef NANOPAGED_NO_TORCH
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace {
using namespace nanopaged_lora;

// c10::Half and __half (c10::BFloat16 and __nv_bfloat16) are the same 16 bits.
template <typename F>
void dispatch_dtype(at::ScalarType dtype, const char* fn, F f) {
  switch (dtype) {
    case at::kFloat: return f(float{});
    case at::kHalf: return f(__half{});
    case at::kBFloat16: return f(__nv_bfloat16{});
    default: TORCH_CHECK(false, fn, ": dtype ", dtype, " is not supported (float32, float16, bfloat16)");
  }
}

void check_rows(const torch::Tensor& t, const char* fn, const char* name, int64_t n, int64_t width,
                at::ScalarType dtype, const torch::Device& device) {
  TORCH_CHECK(t.device() == device && t.dim() == 2 && t.size(0) == n && t.size(1) == width && t.stride(1) == 1,
              fn, ": ", name, " must be a [", n, ", ", width, "] tensor with dense rows on ", device, ", got ",
              t.sizes(), " strides ", t.strides(), " on ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, fn, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
}

void check_vector(const torch::Tensor& t, const char* fn, const char* name, int64_t n, at::ScalarType dtype,
                  const torch::Device& device) {
  TORCH_CHECK(t.device() == device && t.scalar_type() == dtype && t.dim() == 1 && t.numel() == n &&
              t.is_contiguous(), fn, ": ", name, " must be a contiguous ", dtype, " [", n, "] on ", device,
              ", got ", t.scalar_type(), " ", t.sizes(), " on ", t.device());
}

void check_stack(const torch::Tensor& w, const char* fn, const char* name, int64_t rows, int64_t cols,
                 at::ScalarType dtype, const torch::Device& device) {
  TORCH_CHECK(w.device() == device && w.dim() == 3 && w.size(1) == rows && w.size(2) == cols && w.is_contiguous(),
              fn, ": ", name, " must be a contiguous [num_slots, ", rows, ", ", cols, "] tensor on ", device,
              ", got ", w.sizes(), " on ", w.device());
  TORCH_CHECK(w.scalar_type() == dtype, fn, ": ", name, " must be ", dtype, " (the model's dtype), got ",
              w.scalar_type());
}

// out[i] = x[i] a[slots[i]]^T in fp32 (zeros where slots[i] is -1); shapes as the CPU's.
void lora_shrink(torch::Tensor out, const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& slots) {
  const char* fn = "lora_shrink";
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && a.dim() == 3, fn, ": x must be a CUDA [n, in] tensor and a "
              "[num_slots, r, in], got ", x.sizes(), " on ", x.device(), " and ", a.sizes());
  const int64_t n = x.size(0), in = x.size(1), r = a.size(1);
  check_rows(x, fn, "x", n, in, x.scalar_type(), x.device());
  check_stack(a, fn, "a", r, in, x.scalar_type(), x.device());
  check_rows(out, fn, "out", n, r, at::kFloat, x.device());
  check_vector(slots, fn, "slots", n, at::kLong, x.device());
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_dtype(x.scalar_type(), fn, [&](auto tag) {
    using T = decltype(tag);
    shrink_kernel<T><<<n, NUM_THREADS, 0, stream>>>(
        out.data_ptr<float>(), static_cast<const T*>(x.data_ptr()), static_cast<const T*>(a.data_ptr()),
        slots.data_ptr<int64_t>(), a.size(0), r, in, out.stride(0), x.stride(0));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// y[i] += (t[i] b[s]^T) * scales[s], s = slots[i], in place; rows with slot -1 untouched.
void lora_expand(torch::Tensor y, const torch::Tensor& t, const torch::Tensor& b, const torch::Tensor& slots,
                 const torch::Tensor& scales) {
  const char* fn = "lora_expand";
  TORCH_CHECK(y.is_cuda() && y.dim() == 2 && b.dim() == 3, fn, ": y must be a CUDA [n, out] tensor and b "
              "[num_slots, out, r], got ", y.sizes(), " on ", y.device(), " and ", b.sizes());
  const int64_t n = y.size(0), out = y.size(1), r = b.size(2), num_slots = b.size(0);
  check_rows(y, fn, "y", n, out, y.scalar_type(), y.device());
  check_rows(t, fn, "t", n, r, at::kFloat, y.device());
  check_stack(b, fn, "b", out, r, y.scalar_type(), y.device());
  check_vector(slots, fn, "slots", n, at::kLong, y.device());
  check_vector(scales, fn, "scales", num_slots, at::kFloat, y.device());
  const int64_t tiles = (out + NUM_THREADS - 1) / NUM_THREADS;
  TORCH_CHECK(tiles <= 65535, fn, ": out = ", out, " columns exceed the grid's 65535 tiles of ", NUM_THREADS);
  if (n == 0 || out == 0) return;
  const c10::cuda::CUDAGuard guard(y.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_dtype(y.scalar_type(), fn, [&](auto tag) {
    using T = decltype(tag);
    expand_kernel<T><<<dim3(n, tiles), NUM_THREADS, 0, stream>>>(
        static_cast<T*>(y.data_ptr()), t.data_ptr<float>(), static_cast<const T*>(b.data_ptr()),
        slots.data_ptr<int64_t>(), scales.data_ptr<float>(), num_slots, out, r, y.stride(0), t.stride(0));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using pybind11::arg;
  m.doc() = "nanopaged's CUDA LoRA kernels: Punica's BGMV shrink and expand";
  m.def("lora_shrink", &lora_shrink, "out[i] = x[i] a[slots[i]]^T in fp32 (slot -1: zeros)",
        arg("out"), arg("x"), arg("a"), arg("slots"));
  m.def("lora_expand", &lora_expand, "y[i] += (t[i] b[slots[i]]^T) * scales[slots[i]] (slot -1: untouched)",
        arg("y"), arg("t"), arg("b"), arg("slots"), arg("scales"));
}
#endif  // NANOPAGED_NO_TORCH
