// The KV-cache ops the engine needs around attention, on the CPU: reshape_and_cache (this
// step's K/V into their slots), copy_blocks (copy-on-write within the pool) and
// swap_blocks (between two pools). Plain copies: every build gives the same bytes.
// vLLM: csrc/cpu/cache.cpp.

#include <ATen/Parallel.h>
#include <torch/types.h>

#include <cstdint>
#include <cstring>

#include "ops.h"

void check_cache(const torch::Tensor& cache, const char* name) {
  TORCH_CHECK(cache.dim() == 4, name, " must be [num_blocks, block_size, num_kv_heads, head_size], got ",
              cache.sizes());
  TORCH_CHECK(cache.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(cache.device().is_cpu(), name, " must be on the CPU, got ", cache.device());
}

// key, value: [num_tokens, num_kv_heads, head_size] (rows may be strided: a view of a fused
// qkv output); slot_mapping: [num_tokens] int64, a negative slot is skipped (vLLM's
// padding convention). Copies row t to slot slot_mapping[t] of each cache.
void reshape_and_cache(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor key_cache,
                       torch::Tensor& value_cache, const torch::Tensor& slot_mapping) {
  check_cache(key_cache, "key_cache");
  check_cache(value_cache, "value_cache");
  const int64_t num_tokens = key.size(0), row = key_cache.size(2) * key_cache.size(3);
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  TORCH_CHECK(key.dim() == 3 && key.size(1) * key.size(2) == row && value.sizes() == key.sizes(),
              "key/value must be [num_tokens, num_kv_heads, head_size] matching the cache, got ", key.sizes(),
              " and ", value.sizes());
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.numel() == num_tokens,
              "slot_mapping must be int64 [num_tokens=", num_tokens, "]");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == key.scalar_type(),
              "key/value dtype ", key.scalar_type(), " != cache dtype ", key_cache.scalar_type());
  // A token's heads must be one dense row; tokens may be strided.
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 &&
              value.stride(1) == value.size(2), "key/value rows must be dense per token");
  const auto slots = slot_mapping.contiguous();
  const int64_t* sm = slots.data_ptr<int64_t>();
  const int64_t bytes = row * key.element_size();
  auto* k_src = static_cast<const char*>(key.data_ptr());
  auto* v_src = static_cast<const char*>(value.data_ptr());
  auto* k_dst = static_cast<char*>(key_cache.data_ptr());
  auto* v_dst = static_cast<char*>(value_cache.data_ptr());
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = sm[t];
    if (slot < 0) continue;
    TORCH_CHECK(slot < num_slots, "slot_mapping[", t, "] = ", slot, " >= num_slots ", num_slots);
    std::memcpy(k_dst + slot * bytes, k_src + t * key.stride(0) * key.element_size(), bytes);
    std::memcpy(v_dst + slot * bytes, v_src + t * value.stride(0) * value.element_size(), bytes);
  }
}

namespace {
// Copy block src[i] -> dst[i] for every (layer, K/V) plane of [num_layers, 2, num_blocks, ...]
// caches; each block of a plane is one contiguous chunk.
void copy_planes(const torch::Tensor& src_cache, torch::Tensor dst_cache, const torch::Tensor& src,
                 const torch::Tensor& dst) {
  TORCH_CHECK(src_cache.dim() == 6 && src_cache.is_contiguous() && dst_cache.is_contiguous() &&
              dst_cache.dim() == 6, "caches must be contiguous [num_layers, 2, num_blocks, block_size, "
              "num_kv_heads, head_size], got ", src_cache.sizes(), " and ", dst_cache.sizes());
  TORCH_CHECK(src.numel() == dst.numel() && src.scalar_type() == torch::kInt64 &&
              dst.scalar_type() == torch::kInt64, "src and dst must be int64 of one length");
  const int64_t planes = src_cache.size(0) * 2, n_src = src_cache.size(2), n_dst = dst_cache.size(2);
  const int64_t block_bytes = src_cache[0][0][0].numel() * src_cache.element_size();
  const auto s = src.contiguous(), d = dst.contiguous();
  const int64_t *sp = s.data_ptr<int64_t>(), *dp = d.data_ptr<int64_t>();
  for (int64_t i = 0; i < s.numel(); ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < n_src && dp[i] >= 0 && dp[i] < n_dst, "block pair ", i, " (",
                sp[i], " -> ", dp[i], ") is out of range");
  auto* from = static_cast<const char*>(src_cache.data_ptr());
  auto* to = static_cast<char*>(dst_cache.data_ptr());
  at::parallel_for(0, planes, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t i = 0; i < s.numel(); ++i)
        std::memcpy(to + (p * n_dst + dp[i]) * block_bytes, from + (p * n_src + sp[i]) * block_bytes,
                    block_bytes);
  });
}
}  // namespace

// kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]; src, dst:
// [num_pairs] int64. Copy-on-write: block src[i] -> dst[i] in every layer, K and V.
void copy_blocks(torch::Tensor kv_cache, const torch::Tensor& src, const torch::Tensor& dst) {
  copy_planes(kv_cache, kv_cache, src, dst);
}

// Both caches shaped as kv_cache (on the CPU the "device" pool is host memory too).
void swap_blocks(const torch::Tensor& src_cache, torch::Tensor dst_cache, const torch::Tensor& src,
                 const torch::Tensor& dst) {
  TORCH_CHECK(src_cache.device().is_cpu() && dst_cache.device().is_cpu(), "swap_blocks: both caches "
              "must be on the CPU for the CPU backend");
  TORCH_CHECK(src_cache.scalar_type() == dst_cache.scalar_type() &&
              src_cache[0][0][0].sizes() == dst_cache[0][0][0].sizes(), "swap_blocks: caches differ in "
              "dtype or block shape");
  copy_planes(src_cache, dst_cache, src, dst);
}
