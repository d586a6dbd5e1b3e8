// C entry points that run kernels/cuda/attention.cu's kernels under the SIMT emulator,
// for tests/layers/test_kernels_cuda.py (ctypes). Pointers are CPU tensors' data; shapes and
// strides as in the torch bindings. Each returns 0, or -1 on a deadlock.
#include "simt.h"

#define NANOPAGED_NO_TORCH
#include KERNEL_SOURCE   // kernels/cuda/attention.cu, its `extern __shared__` line rewritten

#include <cstdint>
#include <cstdio>

using namespace nanopaged;

// heads_per_block as the bindings choose it (shared memory is no limit here).
template <typename T, int HEAD_SIZE>
void attention(void* out, const void* q, const void* k, const void* v, const int64_t* tables,
               const int64_t* lens, int64_t q_stride_seq, int64_t q_stride_head, int num_seqs, int num_heads,
               int num_kv_heads, int block_size, int max_blocks, float scale) {
  const int64_t per_head = smem_per_head(max_blocks * block_size, HEAD_SIZE);
  const int heads = heads_per_block_for(num_heads / num_kv_heads, per_head, INT64_MAX);
  simt::launch(dim3(num_heads / heads, num_seqs), dim3(heads * NUM_THREADS), heads * per_head, [=] {
    paged_attention_kernel<T, HEAD_SIZE>(static_cast<T*>(out), static_cast<const T*>(q), static_cast<const T*>(k),
                                         static_cast<const T*>(v), tables, lens, q_stride_seq, q_stride_head,
                                         num_kv_heads, block_size, max_blocks, scale);
  });
}

template <typename T>
void attention_for(int head_size, auto... args) {
  switch (head_size) {
    case 16: return attention<T, 16>(args...);
    case 32: return attention<T, 32>(args...);
    case 64: return attention<T, 64>(args...);
    case 128: return attention<T, 128>(args...);
    case 256: return attention<T, 256>(args...);
    default: throw std::runtime_error("head_size");
  }
}

template <typename F>
int guarded(F f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    fprintf(stderr, "%s\n", e.what());
    return -1;
  }
}

extern "C" int simt_paged_attention(int dtype, int head_size, void* out, const void* q, const void* k,
                                    const void* v, const int64_t* tables, const int64_t* lens,
                                    int64_t q_stride_seq, int64_t q_stride_head, int num_seqs, int num_heads,
                                    int num_kv_heads, int block_size, int max_blocks, float scale) {
  return guarded([&] {
    auto args = [&](auto run) {
      run(head_size, out, q, k, v, tables, lens, q_stride_seq, q_stride_head, num_seqs, num_heads, num_kv_heads,
          block_size, max_blocks, scale);
    };
    if (dtype == 0) args([](auto... a) { attention_for<float>(a...); });
    else if (dtype == 1) args([](auto... a) { attention_for<__half>(a...); });
    else args([](auto... a) { attention_for<__nv_bfloat16>(a...); });
  });
}

// element_size 2 or 4; key/value strided as in the bindings.
extern "C" int simt_reshape_and_cache(int element_size, const void* key, const void* value, void* key_cache,
                                      void* value_cache, const int64_t* slots, int64_t k_stride_tok,
                                      int64_t k_stride_head, int64_t v_stride_tok, int64_t v_stride_head,
                                      int num_tokens, int num_kv_heads, int head_size) {
  auto run = [&](auto tag) {
    using W = decltype(tag);
    simt::launch(dim3(num_tokens), dim3(std::min(num_kv_heads * head_size, 512)), 0, [=] {
      reshape_and_cache_kernel<W>(static_cast<const W*>(key), static_cast<const W*>(value),
                                  static_cast<W*>(key_cache), static_cast<W*>(value_cache), slots, k_stride_tok,
                                  k_stride_head, v_stride_tok, v_stride_head, num_kv_heads, head_size);
    });
  };
  return guarded([&] { element_size == 2 ? run(uint16_t{}) : run(uint32_t{}); });
}

// 16-byte words, as the bindings use for every real model.
extern "C" int simt_copy_blocks(void* kv_cache, const int64_t* src, const int64_t* dst, int num_pairs, int planes,
                                int64_t num_blocks, int64_t chunk_bytes) {
  return guarded([&] {
    simt::launch(dim3(num_pairs, planes), dim3(256), 0, [=] {
      copy_blocks_kernel<uint4>(static_cast<uint4*>(kv_cache), src, dst, num_blocks, chunk_bytes / 16);
    });
  });
}
