// Paged attention on the CPU (prefill and decode rows), the C++ twin of
// ../cuda/attention.cu (which has decode rows only so far).
//
// Same results as the PyTorch reference (nanopaged/layers/attention.py): each query of a
// sequence attends causally to that sequence's K/V, which live scattered in a block pool
//
//     key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size]
//
// in the order its block table lists them (PagedAttention paper §4.1; vLLM's
// csrc/cpu/attention.cpp is the production version of this idea).
//
// The reference gathers every sequence's blocks into a fresh contiguous tensor and then
// calls SDPA: it copies the whole KV cache of the batch once per layer per step. Here
// nothing is copied. Work is split over (sequence, tile of up to 16 queries) with
// at::parallel_for (OpenMP underneath, torch's own thread pool), and each item does, in
// fp32, walking the block table a block at a time:
//
//   1. logits[r][h][t] = scale * q_rh . k_t for its rows r and every head h; a slot's row
//      (all KV heads, contiguous) is read once for the whole tile (GQA: head h reads KV
//      head h / group, and the up to 4 heads of one KV head share each load),
//   2. softmax over each row's own keys (max-subtracted, as always),
//   3. out_rh = sum_t p[r][h][t] * v_t, then one division by the sum.
//
// Dot products and sums run in explicit vectors (vec.h's namespace mm: AVX512, AVX2 or one
// lane, by the flags nanopaged/layers/build.py compiles with) in one fixed order, so a
// row's bits never depend on its batch (chapters/05-llama.md, "Batch invariance"); bf16
// K/V are widened as they load, fp16 a block at a time. The rest of a CPU step sits
// beside this file: cache.cpp (reshape_and_cache, copy_blocks, swap_blocks), layer_ops.cpp
// (the Llama layer's elementwise ops, fused), gemm.cpp and gemm_amx.cpp (the matmuls);
// bindings.cpp makes them one module. The quantized matmuls are an extension of their own
// (quant/). chapters/12-kernels.md says what makes a CPU step fast; benchmarks/RESULTS.md
// has the runs.

#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace {

// n consecutive cache elements (a block's slot rows) as the kernel reads them: fp32 and
// bf16 in place (mm::vload widens bf16 as it loads), fp16 (and fp64) converted into buf.
template <typename scalar_t>
constexpr bool kReadInPlace = std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, at::BFloat16>;
template <typename scalar_t>
using kv_t = std::conditional_t<kReadInPlace<scalar_t>, scalar_t, float>;

template <typename scalar_t>
inline const kv_t<scalar_t>* rows_ptr(const scalar_t* src, float* buf, int64_t n) {
  if constexpr (kReadInPlace<scalar_t>) {
    return src;
  } else {
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) buf[d] = to_f32(src[d]);
    return buf;
  }
}

// Queries per work item in a prefill: they share every K/V row the item reads.
constexpr int64_t kQueryTile = 16;

// The logits of G query heads that share one KV head (GQA), for `seen` keys in a row:
// lg[i * lg_stride + o] = q_i . k_o, where q_i = q + i * head_size and key o's row starts
// at k0 + o * slot_stride. Each key row is loaded once for the G heads, and four keys go
// at a time (4G independent sums keep the FMA units busy; one sum alone is a chain of
// dependent adds). Every logit is one vector sum over head_size in order, then vsum's
// tree, whatever G, the group or the key's place: a short last group of keys repeats its
// last key and drops those sums, so block size never changes a bit.
template <int G, int D, typename K>
inline void head_logits(const float* q, const K* k0, float* lg, int64_t seen, int64_t head_size_,
                        int64_t slot_stride, int64_t lg_stride) {
  const int64_t head_size = D > 0 ? D : head_size_;     // D: the head size known when compiled (0: not)
  for (int64_t o = 0; o < seen; o += 4) {
    const K* kr[4];
    for (int64_t i = 0; i < 4; ++i) kr[i] = k0 + std::min(o + i, seen - 1) * slot_stride;
    mm::vec d[G][4];
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < 4; ++i) d[g][i] = mm::vzero();
    for (int64_t c = 0; c < head_size; c += mm::kLanes) {
      const int64_t left = head_size - c;
      mm::vec kv[4];
      for (int i = 0; i < 4; ++i) kv[i] = mm::vload(kr[i] + c, left);
      for (int g = 0; g < G; ++g) {
        const mm::vec qv = mm::vload(q + g * head_size + c, left);
        for (int i = 0; i < 4; ++i) d[g][i] = mm::vfma(qv, kv[i], d[g][i]);
      }
    }
    for (int g = 0; g < G; ++g) {
      float dots[4];
      mm::vsum4(d[g], dots);
      for (int64_t i = 0; i < 4 && o + i < seen; ++i) lg[g * lg_stride + o + i] = dots[i];
    }
  }
}

// acc_i += sum_o p[i * p_stride + o] * v_o for G query heads that share one KV head, on
// NC vectors of the head's output starting at acc + c0 (NC is a template argument so the
// G x NC sums stay in registers over the keys). Each V row is loaded once for the G
// heads. Each output element is one chain of FMAs over the keys in order.
template <int G, int NC, int D, typename V>
inline void head_values_span(const float* p, const V* v0, float* acc, int64_t seen, int64_t head_size_,
                             int64_t slot_stride, int64_t p_stride, int64_t c0) {
  const int64_t head_size = D > 0 ? D : head_size_;
  mm::vec a[G][NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c)
      a[g][c] = mm::vload(acc + g * head_size + c0 + c * mm::kLanes, head_size - c0 - c * mm::kLanes);
  for (int64_t o = 0; o < seen; ++o) {
    const V* v = v0 + o * slot_stride + c0;
    mm::vec vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = mm::vload(v + c * mm::kLanes, head_size - c0 - c * mm::kLanes);
    for (int g = 0; g < G; ++g) {
      const mm::vec po = mm::vset1(p[g * p_stride + o]);
      for (int c = 0; c < NC; ++c) a[g][c] = mm::vfma(po, vv[c], a[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c)
      mm::vstore(acc + g * head_size + c0 + c * mm::kLanes, a[g][c], head_size - c0 - c * mm::kLanes);
}

// The whole head: spans of up to kSpan<G> vectors, narrow enough that the G x NC sums, NC
// vectors of V and the broadcast stay in registers. 4-vector spans for 3 heads a KV head
// (SmolLM2) need 17 on AVX2's 16: GCC stored and reloaded the sums at every key (perf).
// Room to spare, by measurement rather than by count: at G=3 a 3-vector span (13 live)
// still spilled (perf), while G=2's 4-vector span (13 live too) ran faster than 3 vectors.
// So on AVX2: 4 vectors for 1-2 heads, 2 for 3-4; AVX512: 4. A span's width never changes
// a bit: each output element is its own chain.
template <int G>
constexpr int64_t kSpan = std::min(4, (mm::kRegisters - 1) / (G + 1) - 1);

template <int G, int D, typename V>
inline void head_values(const float* p, const V* v0, float* acc, int64_t seen, int64_t head_size_,
                        int64_t slot_stride, int64_t p_stride) {
  const int64_t head_size = D > 0 ? D : head_size_;
  for (int64_t c0 = 0; c0 < head_size; c0 += kSpan<G> * mm::kLanes) {
    const int64_t nc = std::min<int64_t>(kSpan<G>, (head_size - c0 + mm::kLanes - 1) / mm::kLanes);
    if (nc == 4) head_values_span<G, 4, D>(p, v0, acc, seen, head_size, slot_stride, p_stride, c0);
    else if (nc == 3) head_values_span<G, 3, D>(p, v0, acc, seen, head_size, slot_stride, p_stride, c0);
    else if (nc == 2) head_values_span<G, 2, D>(p, v0, acc, seen, head_size, slot_stride, p_stride, c0);
    else head_values_span<G, 1, D>(p, v0, acc, seen, head_size, slot_stride, p_stride, c0);
  }
}

// f(std::integral_constant<int, G>{}) for G = g in 1..4: the head-group kernels above take
// their number of heads as a template argument (so their sums live in registers).
template <typename F>
inline void with_group(int64_t g, F&& f) {
  if (g == 4) f(std::integral_constant<int, 4>{});
  else if (g == 3) f(std::integral_constant<int, 3>{});
  else if (g == 2) f(std::integral_constant<int, 2>{});
  else f(std::integral_constant<int, 1>{});
}

// f(std::integral_constant<int, D>{}): D = head_size for the common 64 and 128 (the head
// loops then have constant bounds: no tail checks, counters or masks), else D = 0 (the
// same loops with head_size at run time). The same operations in the same order: the same
// bits.
template <typename F>
inline void with_head_size(int64_t head_size, F&& f) {
  if (head_size == 64) f(std::integral_constant<int, 64>{});
  else if (head_size == 128) f(std::integral_constant<int, 128>{});
  else f(std::integral_constant<int, 0>{});
}

// Attention for every query row of the batch. Sequence s owns query rows
// [query_start_loc[s], query_start_loc[s + 1]), the last q_len of its seq_len positions,
// so its j-th query attends to keys 0 .. seq_len - q_len + j (causal). A decode is the
// case q_len = 1. Work items are (sequence, tile of up to kQueryTile queries); an item
// walks the sequence's block table once for K and once for V, and each slot's row (all
// KV heads, one contiguous run of memory) serves every query and head of the tile.
// Each query row is computed alone, in the same order whatever the tile: a prompt's
// rows come out bit-identical whether it is computed in one step or after a prefix hit.
template <int D, typename scalar_t>
void attention_kernel(scalar_t* out, const scalar_t* query, const scalar_t* key_cache,
                      const scalar_t* value_cache, const int64_t* block_tables,
                      const int64_t* seq_lens, const int64_t* query_start_loc, int64_t num_seqs,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                      int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;                 // query heads per kv head
  const int64_t slot_stride = num_kv_heads * head_size;           // elements per slot (token)
  const int64_t q_stride = num_heads * head_size;                 // elements per query row
  std::vector<int64_t> kv_offset(num_heads);                      // GQA: head h reads kv head h / group
  for (int64_t h = 0; h < num_heads; ++h) kv_offset[h] = h / group * head_size;
  std::vector<int64_t> item_seq, item_first;                      // the work items
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t j = query_start_loc[s]; j < query_start_loc[s + 1]; j += kQueryTile) {
      item_seq.push_back(s);
      item_first.push_back(j);
    }
  // Items differ in cost (a sequence's length, a tile's rows), so they are handed out one
  // at a time as threads come free (at::parallel_for would give each thread one
  // contiguous range); the threads are torch's OpenMP pool, sized by torch.set_num_threads.
  // Which thread computes an item never changes its bits.
  const int64_t num_items = static_cast<int64_t>(item_seq.size());
#pragma omp parallel if (num_items > 1)
  {
    // the thread's scratch, kept between calls (a prefill tile's logits are ~150 KB,
    // which malloc maps fresh, and faults in page by page, on every call)
    thread_local std::vector<float> q, acc, block, logits, sum;
    if (static_cast<int64_t>(block.size()) < block_size * slot_stride) block.resize(block_size * slot_stride);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_items; ++item) {
      const int64_t s = item_seq[item], first = item_first[item];
      const int64_t last = std::min(first + kQueryTile, query_start_loc[s + 1]);   // rows [first, last)
      const int64_t nq = last - first, seq_len = seq_lens[s];
      // query row r (r = 0..nq-1) sees keys [0, base + r]; the item reads keys [0, len)
      const int64_t base = seq_len - (query_start_loc[s + 1] - first), len = base + nq;
      const int64_t* table = block_tables + s * max_blocks;
      q.resize(nq * q_stride);
      for (int64_t i = 0; i < nq * q_stride; ++i)   // pre-scaled: (scale * q) . k
        q[i] = scale * to_f32(query[first * q_stride + i]);
      logits.resize(nq * num_heads * len);          // [row][head][key]
      sum.assign(nq * num_heads, 0.f);

      // 1. logits, a block at a time: token t = b * block_size + o is slot
      //    table[b] * block_size + o, so a block's tokens are consecutive rows of memory.
      for (int64_t b = 0, t0 = 0; t0 < len; ++b, t0 += block_size) {
        const int64_t nt = std::min(block_size, len - t0);          // tokens of this block in range
        const auto* kb = rows_ptr(key_cache + table[b] * block_size * slot_stride, block.data(),
                                   nt * slot_stride);
        for (int64_t r = std::max<int64_t>(0, t0 - base); r < nq; ++r) {
          const int64_t seen = std::min(nt, base + r + 1 - t0);    // causal: keys <= base + r
          for (int64_t h = 0; h < num_heads;) {                    // up to 4 heads of one kv head
            const int64_t g = std::min<int64_t>(4, group - h % group);
            const float* qh = q.data() + r * q_stride + h * head_size;
            float* lg = logits.data() + (r * num_heads + h) * len + t0;
            const auto* k0 = kb + kv_offset[h];
            with_group(g, [&](auto G) { head_logits<decltype(G)::value, D>(qh, k0, lg, seen, head_size, slot_stride, len); });
            h += g;
          }
        }
      }
      // 2. softmax numerators over each row's own keys, max-subtracted.
      for (int64_t r = 0; r < nq; ++r)
        for (int64_t h = 0; h < num_heads; ++h) {
          float* lg = logits.data() + (r * num_heads + h) * len;
          const int64_t n = base + r + 1;
          const float max = mm::max(lg, n);
#pragma omp simd
          for (int64_t t = 0; t < n; ++t) lg[t] = fast_exp(lg[t] - max);
          sum[r * num_heads + h] = mm::sum(lg, n);
        }
      // 3. weighted sum of V rows, a block at a time, each row read once for the tile.
      acc.assign(nq * q_stride, 0.f);
      for (int64_t b = 0, t0 = 0; t0 < len; ++b, t0 += block_size) {
        const int64_t nt = std::min(block_size, len - t0);
        const auto* vb = rows_ptr(value_cache + table[b] * block_size * slot_stride, block.data(),
                                   nt * slot_stride);
        for (int64_t r = std::max<int64_t>(0, t0 - base); r < nq; ++r) {
          const int64_t seen = std::min(nt, base + r + 1 - t0);
          for (int64_t h = 0; h < num_heads;) {
            const int64_t g = std::min<int64_t>(4, group - h % group);
            const float* p = logits.data() + (r * num_heads + h) * len + t0;
            float* ah = acc.data() + r * q_stride + h * head_size;
            const auto* v0 = vb + kv_offset[h];
            with_group(g, [&](auto G) { head_values<decltype(G)::value, D>(p, v0, ah, seen, head_size, slot_stride, len); });
            h += g;
          }
        }
      }
      for (int64_t r = 0; r < nq; ++r)
        for (int64_t h = 0; h < num_heads; ++h) {
          scalar_t* dst = out + (first + r) * q_stride + h * head_size;
          const float* ah = acc.data() + r * q_stride + h * head_size;
          const float inv = 1.f / sum[r * num_heads + h];
          for (int64_t d = 0; d < head_size; ++d) dst[d] = from_f32<scalar_t>(ah[d] * inv);
        }
    }
  }
}

}  // namespace

// out, query: [num_tokens, num_heads, head_size], the query rows of all sequences end to
// end; caches: [num_blocks, block_size, num_kv_heads, head_size], already holding this
// step's K/V; block_tables: [num_seqs, max_blocks] int64; seq_lens: [num_seqs] int64, each
// in [q_len, max_blocks * block_size]; query_start_loc: [num_seqs + 1] int64, sequence s's
// rows are [query_start_loc[s], query_start_loc[s + 1]), its last q_len positions.
// Writes out (causal attention: prefill, chunked prefill and decode rows alike).
void paged_attention(torch::Tensor out, const torch::Tensor& query, const torch::Tensor& key_cache,
                     const torch::Tensor& value_cache, const torch::Tensor& block_tables,
                     const torch::Tensor& seq_lens, const torch::Tensor& query_start_loc, double scale) {
  check_cache(key_cache, "key_cache");
  check_cache(value_cache, "value_cache");
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous(), "query must be a contiguous "
              "[num_tokens, num_heads, head_size] tensor, got ", query.sizes());
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous(), "out must be contiguous and shaped "
              "like query ", query.sizes(), ", got ", out.sizes());
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && out.scalar_type() == query.scalar_type()
              && value_cache.scalar_type() == query.scalar_type(), "query, out and the caches must share "
              "one dtype, got ", query.scalar_type(), " and ", key_cache.scalar_type());
  const int64_t num_seqs = seq_lens.numel(), num_heads = query.size(1), head_size = query.size(2);
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
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt64 && seq_lens.is_contiguous(),
              "seq_lens must be contiguous int64 [num_seqs]");
  TORCH_CHECK(query_start_loc.scalar_type() == torch::kInt64 && query_start_loc.is_contiguous() &&
              query_start_loc.numel() == num_seqs + 1, "query_start_loc must be contiguous int64 "
              "[num_seqs + 1 = ", num_seqs + 1, "], got ", query_start_loc.sizes());
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  TORCH_CHECK(qsl[0] == 0 && qsl[num_seqs] == query.size(0), "query_start_loc must run from 0 to "
              "num_tokens = ", query.size(0), ", got ", qsl[0], " .. ", qsl[num_seqs]);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = qsl[s + 1] - qsl[s];
    TORCH_CHECK(q_len >= 0, "query_start_loc must not decrease (sequence ", s, ")");
    TORCH_CHECK(lens[s] >= std::max<int64_t>(q_len, 1) && lens[s] <= max_blocks * block_size, "seq_lens[",
                s, "] = ", lens[s], " is outside [max(q_len, 1) = ", std::max<int64_t>(q_len, 1),
                ", max_blocks * block_size = ", max_blocks * block_size, "]");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "paged_attention", [&] {
    with_head_size(head_size, [&](auto D) {
      attention_kernel<decltype(D)::value>(out.data_ptr<scalar_t>(), query.data_ptr<scalar_t>(),
                                           key_cache.data_ptr<scalar_t>(), value_cache.data_ptr<scalar_t>(),
                                           block_tables.data_ptr<int64_t>(), lens, qsl, num_seqs, num_heads,
                                           num_kv_heads, head_size, block_size, max_blocks,
                                           static_cast<float>(scale));
    });
  });
}

// Decode only: one query per sequence. out, query: [num_seqs, num_heads, head_size];
// the rest as paged_attention. The same kernel with query_start_loc = 0, 1, ..., num_seqs.
void paged_attention_decode(torch::Tensor out, const torch::Tensor& query,
                            const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                            const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                            double scale) {
  TORCH_CHECK(query.dim() == 3 && seq_lens.numel() == query.size(0), "decode: query must be "
              "[num_seqs, num_heads, head_size] with num_seqs = seq_lens.numel() = ", seq_lens.numel(),
              ", got ", query.sizes());
  paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens,
                  torch::arange(query.size(0) + 1, seq_lens.options().dtype(torch::kInt64)), scale);
}
