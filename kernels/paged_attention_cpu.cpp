// Paged attention for decode on the CPU: the C++ twin of paged_attention.cu.
//
// Same arguments, same results as the CUDA kernel and as the PyTorch reference
// (nanopaged/attention.py): each sequence's one new query attends to the first seq_len
// tokens of its K/V, which live scattered in a block pool
//
//     key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size]
//
// in the order its block table lists them (PagedAttention paper §4.1; vLLM's
// csrc/cpu/attention.cpp is the production version of this idea).
//
// The reference gathers every sequence's blocks into a fresh contiguous tensor and then
// calls SDPA: it copies the whole KV cache of the batch once per layer per step. Here
// nothing is copied. Work is split over (sequence, kv_head) pairs with at::parallel_for
// (OpenMP underneath, torch's own thread pool), and each pair does, in fp32:
//
//   1. logits[g][t] = scale * q_g . k_t   for the G query heads g that share this kv_head
//      (GQA: K is read once for the whole group, not once per query head),
//   2. softmax over t for each g (max-subtracted, as always),
//   3. out_g = sum_t p[g][t] * v_t, then one division by the sum.
//
// Inner loops over head_size are plain loops the compiler vectorizes (`omp simd`,
// -O3 with the machine's vector flags, see nanopaged/kernels.py); bf16 and fp16 rows are
// widened to fp32 one row at a time. Also here: the cache ops the engine needs
// (reshape_and_cache, copy_blocks, swap_blocks), so the CPU backend has the same four
// functions as the CUDA one.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

namespace {

// One K or V row (head_size elements) widened to fp32.
template <typename scalar_t>
inline void load_row(const scalar_t* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}

template <typename scalar_t>
void decode_kernel(scalar_t* out, const scalar_t* query, const scalar_t* key_cache,
                   const scalar_t* value_cache, const int64_t* block_tables,
                   const int64_t* seq_lens, int64_t num_seqs, int64_t num_heads,
                   int64_t num_kv_heads, int64_t head_size, int64_t block_size,
                   int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;                 // query heads per kv head
  const int64_t slot_stride = num_kv_heads * head_size;           // elements per slot (token)
  // Grain 1: a (sequence, kv_head) pair already walks a whole context.
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * head_size), acc(group * head_size), row(head_size), logits, sum(group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / num_kv_heads, kv_head = item % num_kv_heads;
      const int64_t seq_len = seq_lens[s];
      const int64_t* table = block_tables + s * max_blocks;
      // The group's queries, pre-scaled: q_g . k * scale == (scale * q_g) . k.
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* src = query + (s * num_heads + kv_head * group + g) * head_size;
        for (int64_t d = 0; d < head_size; ++d) q[g * head_size + d] = scale * static_cast<float>(src[d]);
      }
      logits.resize(group * seq_len);

      // 1. logits, walking the block table: token t = b * block_size + o is slot
      //    table[b] * block_size + o, so a block's tokens are consecutive slots.
      for (int64_t b = 0, t = 0; t < seq_len; ++b) {
        const scalar_t* k = key_cache + table[b] * block_size * slot_stride + kv_head * head_size;
        for (int64_t o = 0; o < block_size && t < seq_len; ++o, ++t) {
          load_row(k + o * slot_stride, row.data(), head_size);
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = q.data() + g * head_size;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_size; ++d) dot += qg[d] * row[d];
            logits[g * seq_len + t] = dot;
          }
        }
      }
      // 2. softmax numerators, max-subtracted so exp never overflows.
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t g = 0; g < group; ++g) {
        float* lg = logits.data() + g * seq_len;
        float max = lg[0];
        for (int64_t t = 1; t < seq_len; ++t) max = std::max(max, lg[t]);
        for (int64_t t = 0; t < seq_len; ++t) {
          lg[t] = std::exp(lg[t] - max);
          sum[g] += lg[t];
        }
      }
      // 3. weighted sum of V rows, again reading each row once for the whole group.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = 0, t = 0; t < seq_len; ++b) {
        const scalar_t* v = value_cache + table[b] * block_size * slot_stride + kv_head * head_size;
        for (int64_t o = 0; o < block_size && t < seq_len; ++o, ++t) {
          load_row(v + o * slot_stride, row.data(), head_size);
          for (int64_t g = 0; g < group; ++g) {
            const float p = logits[g * seq_len + t];
            float* ag = acc.data() + g * head_size;
#pragma omp simd
            for (int64_t d = 0; d < head_size; ++d) ag[d] += p * row[d];
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* dst = out + (s * num_heads + kv_head * group + g) * head_size;
        const float inv = 1.f / sum[g];
        for (int64_t d = 0; d < head_size; ++d) dst[d] = static_cast<scalar_t>(acc[g * head_size + d] * inv);
      }
    }
  });
}

void check_cache(const torch::Tensor& cache, const char* name) {
  TORCH_CHECK(cache.dim() == 4, name, " must be [num_blocks, block_size, num_kv_heads, head_size], got ",
              cache.sizes());
  TORCH_CHECK(cache.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(cache.device().is_cpu(), name, " must be on the CPU, got ", cache.device());
}

}  // namespace

// out, query: [num_seqs, num_heads, head_size]; caches: [num_blocks, block_size,
// num_kv_heads, head_size]; block_tables: [num_seqs, max_blocks] int64; seq_lens:
// [num_seqs] int64, each in [1, max_blocks * block_size]. Writes out.
void paged_attention_decode(torch::Tensor out, const torch::Tensor& query,
                            const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                            const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                            double scale) {
  check_cache(key_cache, "key_cache");
  check_cache(value_cache, "value_cache");
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous(), "query must be a contiguous "
              "[num_seqs, num_heads, head_size] tensor, got ", query.sizes());
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous(), "out must be contiguous and shaped "
              "like query ", query.sizes(), ", got ", out.sizes());
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && out.scalar_type() == query.scalar_type()
              && value_cache.scalar_type() == query.scalar_type(), "query, out and the caches must share "
              "one dtype, got ", query.scalar_type(), " and ", key_cache.scalar_type());
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_size, "key_cache head_size ", key_cache.size(3),
              " != query head_size ", head_size);
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes(), "value_cache ", value_cache.sizes(),
              " must be shaped like key_cache ", key_cache.sizes());
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads ", num_heads, " is not a multiple of num_kv_heads ",
              num_kv_heads);
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && block_tables.dim() == 2 &&
              block_tables.size(0) == num_seqs && block_tables.is_contiguous(),
              "block_tables must be contiguous int64 [num_seqs=", num_seqs, ", max_blocks], got ",
              block_tables.scalar_type(), " ", block_tables.sizes());
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt64 && seq_lens.numel() == num_seqs &&
              seq_lens.is_contiguous(), "seq_lens must be contiguous int64 [num_seqs=", num_seqs, "]");
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t s = 0; s < num_seqs; ++s)
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= max_blocks * block_size, "seq_lens[", s, "] = ", lens[s],
                " is outside [1, max_blocks * block_size = ", max_blocks * block_size, "]");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "paged_attention_decode", [&] {
    decode_kernel<scalar_t>(out.data_ptr<scalar_t>(), query.data_ptr<scalar_t>(),
                            key_cache.data_ptr<scalar_t>(), value_cache.data_ptr<scalar_t>(),
                            block_tables.data_ptr<int64_t>(), lens, num_seqs, num_heads, num_kv_heads,
                            head_size, block_size, max_blocks, static_cast<float>(scale));
  });
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_decode", &paged_attention_decode, "Paged attention for decode (CPU)");
  m.def("reshape_and_cache", &reshape_and_cache, "Write K/V rows to their slots (CPU)");
  m.def("copy_blocks", &copy_blocks, "Copy KV blocks within the pool (copy-on-write, CPU)");
  m.def("swap_blocks", &swap_blocks, "Copy KV blocks between two pools (swap, CPU)");
}
