// Batched LoRA on the CPU: Punica's BGMV, batched gather matrix-vector (Chen et al. 2023,
// "Punica: Multi-Tenant LoRA Serving"). One call serves a batch whose rows use different
// LoRA adapters: the adapters sit stacked in slots, and each row gathers its own,
//
//     lora_shrink:  t[i] = x[i] a[s]^T                    a: [num_slots, r, in]
//     lora_expand:  y[i] += (t[i] b[s]^T) * scales[s]    b: [num_slots, out, r]
//
// with s = slots[i] (-1: no adapter; the row is left alone). vLLM: vllm/lora/ops/
// (bgmv_shrink, bgmv_expand); our PyTorch reference is nanopaged/lora/punica.py.
//
// The same operations in the same order in every body, so the same bits, and a row's bits
// depend on that row alone, never on the batch around it:
// - shrink's dot products (length in: hundreds) are summed in 16 fp32 lanes: lane j takes
//   the elements j, j + 16, ... by fused multiply-adds, then one fixed tree adds the lanes
//   (an AVX512 build keeps the 16 lanes in one register, an AVX2 build in two, the
//   portable build in 16 floats);
// - expand's (length r: a handful) are one chain of fused multiply-adds each, k = 0, 1,
//   ..., r - 1, computed for 16 (or 8, or 1) output columns at once from a tile of B
//   transposed and widened once per adapter for all the rows of the batch.

#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../vec.h"
#include "ops.h"

namespace {

constexpr int64_t kWidth = 16;                   // fp32 lanes of every dot product, in every body
constexpr int64_t kRegs = kWidth / mm::kLanes;   // AVX512: 1 register, AVX2: 2, portable: 16 floats
constexpr int64_t kColumns = 64;                 // lora_expand's columns a task (a multiple of 16 lanes)

// The mm::kLanes values p[at, at + kLanes) widened to fp32, those at n and beyond zeros.
template <typename T>
mm::vec load(const T* p, int64_t at, int64_t n) {
  if (at >= n) return mm::vzero();
  if constexpr (std::is_same_v<T, at::Half>) {     // vec.h loads fp32 and bf16; fp16 goes through a buffer
    alignas(64) float buf[mm::kLanes] = {};
    for (int64_t i = 0; i < std::min(n - at, mm::kLanes); ++i) buf[i] = to_f32(p[at + i]);
    return mm::vload(buf, mm::kLanes);
  } else {
    return mm::vload(p + at, n - at);
  }
}

// x[0, n) . w[0, n): lane j of kWidth sums x[k] w[k] for k = j, j + kWidth, ... by FMAs,
// then the lanes are added as j + 8, j + 4, j + 2, j + 1 (a fixed tree, the same in every body).
template <typename T>
float dot(const float* x, const T* w, int64_t n) {
  mm::vec acc[kRegs];
  for (auto& lane : acc) lane = mm::vzero();
  for (int64_t k = 0; k < n; k += kWidth) {
    for (int64_t j = 0; j < kRegs; ++j) {
      const int64_t at = k + j * mm::kLanes;
      acc[j] = mm::vfma(load(x, at, n), load(w, at, n), acc[j]);
    }
  }
  alignas(64) float lanes[kWidth];
  for (int64_t j = 0; j < kRegs; ++j) mm::vstore(lanes + j * mm::kLanes, acc[j], mm::kLanes);
  for (int64_t half = kWidth / 2; half > 0; half /= 2) {
    for (int64_t j = 0; j < half; ++j) lanes[j] += lanes[j + half];
  }
  return lanes[0];
}

// f(T{}) for the model dtype T: float32, bfloat16 or float16.
template <typename F>
void with_dtype(at::ScalarType dtype, const char* fn, F&& f) {
  switch (dtype) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(at::BFloat16{});
    case at::kHalf: return f(at::Half{});
    default: TORCH_CHECK(false, fn, ": dtype ", dtype, " is not supported (float32, bfloat16, float16)");
  }
}

void check_rows(const torch::Tensor& t, const char* fn, const char* name, int64_t n, int64_t width,
                at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.size(0) == n && t.size(1) == width && t.stride(1) == 1,
              fn, ": ", name, " must be a CPU [", n, ", ", width, "] tensor with dense rows, got ", t.sizes(),
              " strides ", t.strides(), " on ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, fn, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
}

void check_stack(const torch::Tensor& w, const char* fn, const char* name, int64_t rows, int64_t cols,
                 at::ScalarType dtype) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 3 && w.size(1) == rows && w.size(2) == cols && w.is_contiguous(),
              fn, ": ", name, " must be a contiguous CPU [num_slots, ", rows, ", ", cols, "] tensor, got ",
              w.sizes(), " on ", w.device());
  TORCH_CHECK(w.scalar_type() == dtype, fn, ": ", name, " must be ", dtype, " (the model's dtype), got ",
              w.scalar_type());
}

// slots' values, each checked to lie in [-1, num_slots): a bad one would read outside a or b.
const int64_t* check_slots(const torch::Tensor& slots, const char* fn, int64_t n, int64_t num_slots) {
  TORCH_CHECK(slots.device().is_cpu() && slots.scalar_type() == at::kLong && slots.dim() == 1 &&
              slots.numel() == n && slots.is_contiguous(), fn, ": slots must be a contiguous CPU int64 [n = ", n,
              "], got ", slots.scalar_type(), " ", slots.sizes(), " on ", slots.device());
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(s[i] >= -1 && s[i] < num_slots, fn, ": slots[", i, "] = ", s[i], " is outside [-1, num_slots = ",
                num_slots, ")");
  }
  return s;
}

}  // namespace

// out[i] = x[i] a[slots[i]]^T, summed in fp32 (zeros where slots[i] is -1).
// out: [n, r] float32 (rows may be strided); x: [n, in] float32, bfloat16 or float16 (rows
// may be strided); a: [num_slots, r, in] in x's dtype, contiguous; slots: [n] int64.
void lora_shrink(torch::Tensor out, const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& slots) {
  const char* fn = "lora_shrink";
  TORCH_CHECK(x.dim() == 2 && a.dim() == 3, fn, ": x must be [n, in] and a [num_slots, r, in], got ", x.sizes(),
              " and ", a.sizes());
  const int64_t n = x.size(0), in = x.size(1), r = a.size(1);
  check_rows(x, fn, "x", n, in, x.scalar_type());
  check_stack(a, fn, "a", r, in, x.scalar_type());
  check_rows(out, fn, "out", n, r, at::kFloat);
  const int64_t* s = check_slots(slots, fn, n, a.size(0));
  with_dtype(x.scalar_type(), fn, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    const T* ap = a.data_ptr<T>();
    float* op = out.data_ptr<float>();
    const int64_t xs = x.stride(0), os = out.stride(0);
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> row(in);                  // x[i] widened to fp32: exact
      for (int64_t i = begin; i < end; ++i) {
        float* o = op + i * os;
        if (s[i] < 0) {
          std::fill(o, o + r, 0.f);
          continue;
        }
        for (int64_t d = 0; d < in; ++d) row[d] = to_f32(xp[i * xs + d]);
        const T* w = ap + s[i] * r * in;
        for (int64_t k = 0; k < r; ++k) o[k] = dot(row.data(), w + k * in, in);
      }
    });
  });
}

// y[i] = y[i] + (t[i] b[s]^T) * scales[s] with s = slots[i], in fp32 and rounded once to
// y's dtype (the scale and the add fused: std::fma in every body); rows whose slot is -1
// are not touched. y: [n, out] float32, bfloat16 or float16, in place (rows may be strided:
// a column slice of a wider output); t: [n, r] float32 (lora_shrink's out); b: [num_slots,
// out, r] in y's dtype, contiguous; slots: [n] int64; scales: [num_slots] float32.
void lora_expand(torch::Tensor y, const torch::Tensor& t, const torch::Tensor& b, const torch::Tensor& slots,
                 const torch::Tensor& scales) {
  const char* fn = "lora_expand";
  TORCH_CHECK(y.dim() == 2 && b.dim() == 3, fn, ": y must be [n, out] and b [num_slots, out, r], got ", y.sizes(),
              " and ", b.sizes());
  const int64_t n = y.size(0), out = y.size(1), r = b.size(2), num_slots = b.size(0);
  check_rows(y, fn, "y", n, out, y.scalar_type());
  check_rows(t, fn, "t", n, r, at::kFloat);
  check_stack(b, fn, "b", out, r, y.scalar_type());
  TORCH_CHECK(scales.device().is_cpu() && scales.scalar_type() == at::kFloat && scales.dim() == 1 &&
              scales.numel() == num_slots && scales.is_contiguous(), fn, ": scales must be a contiguous CPU "
              "float32 [num_slots = ", num_slots, "], got ", scales.scalar_type(), " ", scales.sizes());
  const int64_t* s = check_slots(slots, fn, n, num_slots);
  with_dtype(y.scalar_type(), fn, [&](auto tag) {
    using T = decltype(tag);
    T* yp = y.data_ptr<T>();
    const float* tp = t.data_ptr<float>();
    const T* bp = b.data_ptr<T>();
    const float* sc = scales.data_ptr<float>();
    const int64_t ys = y.stride(0), ts = t.stride(0), tiles = (out + kColumns - 1) / kColumns;
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      // per slot, b[slot][from, to)^T widened: bt[(slot * r + k) * kColumns + c], made the first
      // time a row of that slot meets this tile, so rows of many adapters in any order share it
      std::vector<float> bt(num_slots * r * kColumns);
      std::vector<int64_t> made(num_slots);
      alignas(64) float delta[kColumns];
      for (int64_t tile = begin; tile < end; ++tile) {
        const int64_t from = tile * kColumns, cols = std::min(kColumns, out - from);
        std::fill(made.begin(), made.end(), -1);
        for (int64_t i = 0; i < n; ++i) {
          const int64_t slot = s[i];
          if (slot < 0) continue;
          float* tile_t = bt.data() + slot * r * kColumns;
          if (made[slot] != tile) {
            const T* w = bp + (slot * out + from) * r;
            for (int64_t c = 0; c < kColumns; ++c) {
              for (int64_t k = 0; k < r; ++k) tile_t[k * kColumns + c] = c < cols ? to_f32(w[c * r + k]) : 0.f;
            }
            made[slot] = tile;
          }
          const float* ti = tp + i * ts;
          for (int64_t c = 0; c < cols; c += mm::kLanes) {     // lane c: output column from + c
            mm::vec acc = mm::vzero();
            for (int64_t k = 0; k < r; ++k) {
              acc = mm::vfma(mm::vset1(ti[k]), mm::vload(tile_t + k * kColumns + c, mm::kLanes), acc);
            }
            mm::vstore(delta + c, acc, mm::kLanes);
          }
          T* row = yp + i * ys + from;
          for (int64_t c = 0; c < cols; ++c) row[c] = from_f32<T>(std::fma(delta[c], sc[slot], to_f32(row[c])));
        }
      }
    });
  });
}
