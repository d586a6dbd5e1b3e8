// The base CPU extension's kernels, as bindings.cpp binds them: each is defined, with its
// shapes, in the file named beside it.
#pragma once

#include <torch/types.h>

// attention.cpp
void paged_attention(torch::Tensor out, const torch::Tensor& query, const torch::Tensor& key_cache,
                     const torch::Tensor& value_cache, const torch::Tensor& block_tables,
                     const torch::Tensor& seq_lens, const torch::Tensor& query_start_loc, double scale);
void paged_attention_decode(torch::Tensor out, const torch::Tensor& query,
                            const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                            const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                            double scale);

// cache.cpp
void check_cache(const torch::Tensor& cache, const char* name);   // a [num_blocks, ...] pool, or an error
void reshape_and_cache(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor key_cache,
                       torch::Tensor& value_cache, const torch::Tensor& slot_mapping);
void copy_blocks(torch::Tensor kv_cache, const torch::Tensor& src, const torch::Tensor& dst);
void swap_blocks(const torch::Tensor& src_cache, torch::Tensor dst_cache, const torch::Tensor& src,
                 const torch::Tensor& dst);

// layer_ops.cpp
void rms_norm(torch::Tensor out, const torch::Tensor& x, const torch::Tensor& weight, double eps);
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, const torch::Tensor& weight, double eps);
void silu_and_mul(torch::Tensor out, const torch::Tensor& x);
void rotary_embedding(const torch::Tensor& positions, torch::Tensor query, torch::Tensor key,
                      const torch::Tensor& cos, const torch::Tensor& sin, int64_t head_size);

// gemm.cpp
void linear(torch::Tensor out, const torch::Tensor& x, const torch::Tensor& weight);

// gemm_amx.cpp (built where the flags enable AMX)
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
void linear_amx(torch::Tensor out, const torch::Tensor& x, const torch::Tensor& packed);
#endif
