// The CPU paged-attention kernel, grown in steps (llm.c's dev/cuda way): each version is
// checked against the PyTorch reference and timed in chapters/12-kernels.md.
//
//   decode(version, out, query, key_cache, value_cache, block_tables, seq_lens, scale)
//
// fp32 only (the shipped kernel, ../cpu/attention.cpp, adds fp16/bf16). Shapes as
// there: query/out [num_seqs, num_heads, head_size]; caches [num_blocks, block_size,
// num_kv_heads, head_size]; block_tables [num_seqs, max_blocks] int64; seq_lens int64.
//
// v1 naive: one output element (seq, head, d) at a time, and each one recomputes the whole
//    softmax over the context on its own: O(T * D) work per output element.
// v2 one (seq, head) at a time: logits once, softmax once, then out = sum_t p_t v_t.
//    The same math with D times less work; still one thread.
// v3 v2 spread over the cores: at::parallel_for over the (seq, head) pairs.
// v4 GQA sharing and vector loops: work per (seq, kv_head); each K/V row is read once
//    for all the query heads of its group and the head_size loops run as SIMD (omp simd).
//    This is the algorithm of the shipped kernel.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace {

struct Args {
  float* out; const float *q, *k, *v; const int64_t *tables, *lens;
  int64_t num_seqs, heads, kv_heads, D, bs, max_blocks; float scale;
  // Where token t of sequence s keeps its K (or V) row for kv head h.
  int64_t row(int64_t s, int64_t t, int64_t h) const {
    return ((tables[s * max_blocks + t / bs] * bs + t % bs) * kv_heads + h) * D;
  }
};

float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
  for (int64_t d = 0; d < n; ++d) acc += a[d] * b[d];
  return acc;
}

// Softmax-weighted sum for one (seq, head): the body of v2 and v3.
void one_head(const Args& a, int64_t s, int64_t h, std::vector<float>& p) {
  const int64_t T = a.lens[s], kvh = h / (a.heads / a.kv_heads);
  const float* q = a.q + (s * a.heads + h) * a.D;
  p.resize(T);
  float max = -INFINITY, sum = 0.f;
  for (int64_t t = 0; t < T; ++t) max = std::max(max, p[t] = a.scale * dot(q, a.k + a.row(s, t, kvh), a.D));
  for (int64_t t = 0; t < T; ++t) sum += p[t] = std::exp(p[t] - max);
  float* o = a.out + (s * a.heads + h) * a.D;
  for (int64_t d = 0; d < a.D; ++d) o[d] = 0.f;
  for (int64_t t = 0; t < T; ++t) {
    const float* v = a.v + a.row(s, t, kvh);
    for (int64_t d = 0; d < a.D; ++d) o[d] += p[t] * v[d];
  }
  for (int64_t d = 0; d < a.D; ++d) o[d] /= sum;
}

void v1(const Args& a) {
  for (int64_t s = 0; s < a.num_seqs; ++s)
    for (int64_t h = 0; h < a.heads; ++h)
      for (int64_t d = 0; d < a.D; ++d) {            // one output element...
        const int64_t T = a.lens[s], kvh = h / (a.heads / a.kv_heads);
        const float* q = a.q + (s * a.heads + h) * a.D;
        float max = -INFINITY, sum = 0.f, acc = 0.f;  // ...redoes the whole softmax
        for (int64_t t = 0; t < T; ++t) max = std::max(max, a.scale * dot(q, a.k + a.row(s, t, kvh), a.D));
        for (int64_t t = 0; t < T; ++t) {
          const float e = std::exp(a.scale * dot(q, a.k + a.row(s, t, kvh), a.D) - max);
          sum += e;
          acc += e * a.v[a.row(s, t, kvh) + d];
        }
        a.out[(s * a.heads + h) * a.D + d] = acc / sum;
      }
}

void v2(const Args& a) {
  std::vector<float> p;
  for (int64_t s = 0; s < a.num_seqs; ++s)
    for (int64_t h = 0; h < a.heads; ++h) one_head(a, s, h, p);
}

void v3(const Args& a) {
  at::parallel_for(0, a.num_seqs * a.heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p;
    for (int64_t i = begin; i < end; ++i) one_head(a, i / a.heads, i % a.heads, p);
  });
}

void v4(const Args& a) {
  const int64_t G = a.heads / a.kv_heads, D = a.D;
  at::parallel_for(0, a.num_seqs * a.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p, acc(G * D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = i / a.kv_heads, kvh = i % a.kv_heads, T = a.lens[s];
      const float* q = a.q + (s * a.heads + kvh * G) * D;     // the group's G query heads
      p.resize(G * T);
      for (int64_t t = 0; t < T; ++t) {
        const float* k = a.k + a.row(s, t, kvh);               // read once for G heads
        for (int64_t g = 0; g < G; ++g) {
          float x = 0.f;
#pragma omp simd reduction(+ : x)
          for (int64_t d = 0; d < D; ++d) x += q[g * D + d] * k[d];
          p[g * T + t] = a.scale * x;
        }
      }
      std::vector<float> sum(G, 0.f);
      for (int64_t g = 0; g < G; ++g) {
        float max = -INFINITY;
        for (int64_t t = 0; t < T; ++t) max = std::max(max, p[g * T + t]);
        for (int64_t t = 0; t < T; ++t) sum[g] += p[g * T + t] = std::exp(p[g * T + t] - max);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < T; ++t) {
        const float* v = a.v + a.row(s, t, kvh);
        for (int64_t g = 0; g < G; ++g) {
          const float w = p[g * T + t];
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) acc[g * D + d] += w * v[d];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) a.out[(s * a.heads + kvh * G + g) * D + d] = acc[g * D + d] / sum[g];
    }
  });
}

}  // namespace

void decode(int64_t version, torch::Tensor out, const torch::Tensor& query, const torch::Tensor& key_cache,
            const torch::Tensor& value_cache, const torch::Tensor& block_tables,
            const torch::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && key_cache.scalar_type() == torch::kFloat32,
              "the dev kernels are fp32 only");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && seq_lens.scalar_type() == torch::kInt64,
              "block_tables and seq_lens must be int64");
  const Args a{out.data_ptr<float>(), query.data_ptr<float>(), key_cache.data_ptr<float>(),
               value_cache.data_ptr<float>(), block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(),
               query.size(0), query.size(1), key_cache.size(2), query.size(2), key_cache.size(1),
               block_tables.size(1), static_cast<float>(scale)};
  switch (version) {
    case 1: v1(a); break;
    case 2: v2(a); break;
    case 3: v3(a); break;
    case 4: v4(a); break;
    default: TORCH_CHECK(false, "version must be 1, 2, 3 or 4, got ", version);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode", &decode, "paged attention decode, dev version 1-4 (CPU, fp32)");
}
