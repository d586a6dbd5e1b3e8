// Paged attention on the CPU (prefill and decode rows), the C++ twin of paged_attention.cu
// (which has decode rows only so far), plus the other kernels of a CPU step.
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
// Dot products and sums run in explicit vectors (namespace mm: AVX512, AVX2 or one lane,
// by the machine's flags, see nanopaged/layers/backends.py) in one fixed order, so a row's
// bits never depend on its batch (chapters/05-llama.md, "Batch invariance"); bf16 K/V are
// widened as they load, fp16 a block at a time. Also here: the cache ops the engine needs
// (reshape_and_cache, copy_blocks, swap_blocks), the Llama layer's elementwise ops fused
// (rms_norm, fused_add_rms_norm, silu_and_mul, rotary_embedding) and the matmuls (linear,
// linear_amx on AMX tiles, gguf_linear on GGUF's quantized blocks, int8_linear). chapters/12-kernels.md,
// "Performance", has the numbers.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <mutex>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

// ---- One vector of fp32 lanes, for the loops whose order of additions we fix ----------
// The matmul and attention's dot products accumulate in `vec`s with explicit fused
// multiply-adds and end with one fixed horizontal sum (vsum): the compiler cannot
// reorder intrinsics, so a dot product's bits depend only on its inputs and length,
// never on which loop or tile computed it. AVX512: 16 lanes, AVX2: 8, else 1.
namespace mm {

#if defined(__AVX512F__)
using vec = __m512;
constexpr int64_t kLanes = 16;
constexpr int kRegisters = 32;   // vector registers: how many sums a loop can keep in them
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vfma(vec a, vec b, vec acc) { return _mm512_fmadd_ps(a, b, acc); }
inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
inline vec vset1(float f) { return _mm512_set1_ps(f); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
inline float vmax_all(vec a) { return _mm512_reduce_max_ps(a); }
inline void vstore(float* p, vec a, int64_t n) {
  if (n >= kLanes) _mm512_storeu_ps(p, a);
  else _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), a);
}
inline vec vload(const float* p, int64_t n) {
  return n >= kLanes ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
}
inline vec vload(const at::BFloat16* p, int64_t n) {     // 16 bf16 widened: the bits shifted up
  const __m256i h = n >= kLanes ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                : _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// vsum of four vectors at once, each by vsum's own tree (GCC's _mm512_reduce_add_ps:
// lane i + lane i+8, then i + i+4, then (0 + 2) + (1 + 3)), the four interleaved in
// shuffles: 13 instructions instead of four reductions' ~32.
inline void vsum4(const vec (&v)[4], float (&out)[4]) {
  const vec ab = _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x44), _mm512_shuffle_f32x4(v[0], v[1], 0xEE));
  const vec cd = _mm512_add_ps(_mm512_shuffle_f32x4(v[2], v[3], 0x44), _mm512_shuffle_f32x4(v[2], v[3], 0xEE));
  const vec s = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  const vec t = _mm512_add_ps(s, _mm512_permute_ps(s, 0x4E));       // 128-bit lane: s0+s2, s1+s3
  const vec u = _mm512_add_ps(t, _mm512_permute_ps(t, 0xB1));       // lane 0 of each: (s0+s2)+(s1+s3)
  alignas(64) float lanes[kLanes];
  _mm512_store_ps(lanes, u);
  out[0] = lanes[0], out[1] = lanes[4], out[2] = lanes[8], out[3] = lanes[12];
}
#elif defined(__AVX2__)
using vec = __m256;
constexpr int64_t kLanes = 8;
constexpr int kRegisters = 16;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vfma(vec a, vec b, vec acc) { return _mm256_fmadd_ps(a, b, acc); }
inline float vsum(vec a) {        // a fixed tree: (lo + hi), then pairs
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
inline vec vset1(float f) { return _mm256_set1_ps(f); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
inline float vmax_all(vec a) {
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, a);
  return *std::max_element(lanes, lanes + kLanes);
}
inline void vstore(float* p, vec a, int64_t n) {
  if (n >= kLanes) return _mm256_storeu_ps(p, a);
  alignas(32) float buf[kLanes];
  _mm256_store_ps(buf, a);
  std::memcpy(p, buf, n * sizeof(float));
}
inline vec vload(const float* p, int64_t n) {
  if (n >= kLanes) return _mm256_loadu_ps(p);
  alignas(32) float buf[kLanes] = {};
  std::memcpy(buf, p, n * sizeof(float));
  return _mm256_load_ps(buf);
}
inline vec vload(const at::BFloat16* p, int64_t n) {     // 8 bf16 widened: the bits shifted up
  __m128i h;
  if (n >= kLanes) {
    h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  } else {                       // a tail: through a zeroed buffer (a copy for every load was 4x slower)
    alignas(16) uint16_t buf[kLanes] = {};
    std::memcpy(buf, p, n * sizeof(uint16_t));
    h = _mm_load_si128(reinterpret_cast<const __m128i*>(buf));
  }
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
// vsum of four vectors at once, each by vsum's tree, the four interleaved in shuffles
inline void vsum4(const vec (&v)[4], float (&out)[4]) {
  const vec ab = _mm256_add_ps(_mm256_permute2f128_ps(v[0], v[1], 0x20), _mm256_permute2f128_ps(v[0], v[1], 0x31));
  const vec cd = _mm256_add_ps(_mm256_permute2f128_ps(v[2], v[3], 0x20), _mm256_permute2f128_ps(v[2], v[3], 0x31));
  // per 128-bit lane: [ab0 + ab2, ab1 + ab3, cd0 + cd2, cd1 + cd3] (a, c low; b, d high)
  const vec t = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, 0x44), _mm256_shuffle_ps(ab, cd, 0xEE));
  const vec u = _mm256_add_ps(t, _mm256_permute_ps(t, 0xB1));
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, u);
  out[0] = lanes[0], out[1] = lanes[4], out[2] = lanes[2], out[3] = lanes[6];
}
#else
using vec = float;               // no vector unit we know: one lane, the same scheme
constexpr int64_t kLanes = 1;
constexpr int kRegisters = 16;
inline vec vzero() { return 0.f; }
inline vec vfma(vec a, vec b, vec acc) { return std::fma(a, b, acc); }
inline float vsum(vec a) { return a; }
inline vec vset1(float f) { return f; }
inline vec vadd(vec a, vec b) { return a + b; }
inline vec vmax(vec a, vec b) { return std::max(a, b); }
inline float vmax_all(vec a) { return a; }
inline void vstore(float* p, vec a, int64_t) { *p = a; }
inline vec vload(const float* p, int64_t) { return *p; }
inline vec vload(const at::BFloat16* p, int64_t) { return static_cast<float>(*p); }
inline void vsum4(const vec (&v)[4], float (&out)[4]) { for (int i = 0; i < 4; ++i) out[i] = v[i]; }
#endif

// x[0] + ... + x[n-1] and x . x in one fixed order (lane i sums i, i + kLanes, ...; then
// vsum): an `omp simd` reduction is free to peel a few elements for alignment, which
// would tie a row's bits to where its buffer happens to start.
inline float sum(const float* x, int64_t n) {
  vec acc = vzero();
  for (int64_t i = 0; i < n; i += kLanes) acc = vadd(acc, vload(x + i, n - i));
  return vsum(acc);
}
// max(x[0], ..., x[n-1]), n >= 1, in vectors (GCC leaves an `omp simd` max reduction a
// scalar chain of maxss: 14% of the attention kernel). Max is exact, so any order agrees.
inline float max(const float* x, int64_t n) {
  float m = x[0];
  int64_t i = 0;
  if (n >= kLanes) {
    vec acc = vload(x, kLanes);
    for (i = kLanes; i + kLanes <= n; i += kLanes) acc = vmax(acc, vload(x + i, kLanes));
    m = vmax_all(acc);
  }
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}
inline float sum_squares(const float* x, int64_t n) {
  vec acc = vzero();
  for (int64_t i = 0; i < n; i += kLanes) {
    const vec v = vload(x + i, n - i);
    acc = vfma(v, v, acc);
  }
  return vsum(acc);
}

}  // namespace mm

// ---- Which instruction-set bodies ran, counted per call ---------------------------------
// A green suite says little about a body it never ran: a pytest run prints these counts
// (nanopaged/layers/build.py, kernel_paths) beside the flags this build was compiled with.
// kVector: any kernel call (its loops run this build's `vec`: AVX512, AVX2 or one lane);
// kAvx512Bf16: a bf16 `linear` on vdpbf16ps; kAmx: a `linear_amx` on the tiles.
namespace paths {
enum Path { kVector, kAvx512Bf16, kAmx, kNumPaths };
inline std::atomic<int64_t> calls[kNumPaths];
inline void ran(Path p) { calls[p].fetch_add(1, std::memory_order_relaxed); }
}  // namespace paths

namespace {

// fp32 <-> the cache's dtype in loops that vectorize. c10's bf16 conversion is scalar
// code (a branch for NaN), and inside an `omp simd` loop it kept silu_and_mul at a tenth
// of its fp32 speed in bf16. The same rounding (to nearest even, NaN -> 0x7fc0) as bit
// operations, so every result keeps its bits.
template <typename T>
inline float to_f32(T v) { return static_cast<float>(v); }
template <>
inline float to_f32(at::BFloat16 v) { return std::bit_cast<float>(static_cast<uint32_t>(v.x) << 16); }
template <typename T>
inline T from_f32(float f) { return static_cast<T>(f); }
template <>
inline at::BFloat16 from_f32(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  at::BFloat16 out;
  out.x = static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
  return out;
}

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

// exp(x) within 2 ulp of std::exp, written so that `omp simd` vectorizes it (std::exp is
// a libm call per element; in the softmax it was the largest share of prefill attention).
// Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-6 polynomial, 2^n put
// straight into the exponent bits. x is clamped to [-87.3, 88.3] (the normal floats);
// below -87.3 the result is 0.
#pragma omp declare simd notinbranch
inline float fast_exp(float x) {
  const float clamped = std::min(std::max(x, -87.3f), 88.3f);
  const float n = std::floor(clamped * 1.44269504088896341f + 0.5f);
  float r = clamped - n * 0.693359375f;             // ln2 split in two for precision
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.f;
  const float two_n = std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
  return x < -87.3f ? 0.f : e * two_n;
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
// (SmolLM2) need 17 on AVX2's 16: GCC stored and reloaded the sums at every key, half of a
// long prompt's attention (perf). Room to spare, by measurement rather than by count: at
// G=3 a 3-vector span (13 live) still spilled (perf; slower again with the head size
// known), while G=2's 4-vector span (13 live too) ran faster than 3 vectors. So on AVX2: 4
// vectors for 1-2 heads, 2 for 3-4; AVX512: 4. At 2, G=3: a 4000-token prompt's attention
// in 512-token chunks 363-389 -> 240-268 ms a layer; G=4 (16 heads, 4 KV heads), with
// with_head_size below too, 161-167 -> 96-111 ms at 2000 tokens (2-core AMD EPYC, AVX2,
// fp32, 2 threads). A span's width never changes a bit: each output element is its own
// chain.
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
// bits. Measured (2-core AMD EPYC, AVX2, fp32, 2 threads), the 4000-token prompt above:
// 197-218 -> 187-205 ms a layer; with kSpan, decode rows of 32 sequences x 256 tokens
// 372-449 -> 286-293 us, x 64 tokens 92-110 -> 70-71 us.
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

void check_cache(const torch::Tensor& cache, const char* name) {
  TORCH_CHECK(cache.dim() == 4, name, " must be [num_blocks, block_size, num_kv_heads, head_size], got ",
              cache.sizes());
  TORCH_CHECK(cache.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(cache.device().is_cpu(), name, " must be on the CPU, got ", cache.device());
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

// ---- The Llama layer's elementwise ops, fused ------------------------------------------
// In PyTorch each of these is 4-7 ops, every one a pass over memory and a trip through the
// dispatcher (~10 us each, which is what a batch-1 decode step is mostly made of). One
// loop each here, in fp32, rounding to the model's dtype where transformers rounds.
// vLLM: csrc/cpu/layernorm.cpp, activation.cpp, pos_encoding.cpp.

namespace {
void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1 && t.device().is_cpu(), name,
              " must be a CPU [num_tokens, n] tensor with dense rows, got ", t.sizes(), " strides ", t.strides());
}
}  // namespace

namespace {
// RMSNorm (transformers' LlamaRMSNorm) of each row, see rms_norm and fused_add_rms_norm.
void rms_norm_impl(torch::Tensor out, torch::Tensor x, std::optional<torch::Tensor> residual,
                   const torch::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  const int64_t rows = x.size(0), hidden = x.size(1);
  TORCH_CHECK(weight.numel() == hidden && weight.is_contiguous() && weight.scalar_type() == x.scalar_type(),
              "weight must be [hidden = ", hidden, "] in x's dtype");
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(), "out must be shaped like x");
  if (residual) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "residual must be shaped like x ", x.sizes(), ", got ", residual->sizes());
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = residual ? xp : out.data_ptr<scalar_t>();
    scalar_t* rp = residual ? residual->data_ptr<scalar_t>() : nullptr;
    const int64_t xs = x.stride(0), os = residual ? xs : out.stride(0), rs = residual ? residual->stride(0) : 0;
    const scalar_t* w = weight.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(hidden);
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t* src = xp + i * xs;
        if (rp) {
          scalar_t* res = rp + i * rs;
          _Pragma("omp simd")
          for (int64_t d = 0; d < hidden; ++d) {
            res[d] = from_f32<scalar_t>(to_f32(res[d]) + to_f32(src[d]));
            buf[d] = to_f32(res[d]);
          }
        } else {
          _Pragma("omp simd")
          for (int64_t d = 0; d < hidden; ++d) buf[d] = to_f32(src[d]);
        }
        const float ss = mm::sum_squares(buf.data(), hidden);
        const float inv = 1.f / std::sqrt(ss / hidden + static_cast<float>(eps));
        scalar_t* dst = op + i * os;
        _Pragma("omp simd")
        for (int64_t d = 0; d < hidden; ++d)
          dst[d] = from_f32<scalar_t>(to_f32(w[d]) * to_f32(from_f32<scalar_t>(buf[d] * inv)));
      }
    });
  });
}
}  // namespace

// out = weight * (x / sqrt(mean(x^2) + eps)), the mean in fp32 and the normalized row
// rounded to x's dtype before the weight multiply, as transformers does.
// x, out: [num_tokens, hidden] (dense rows); weight: [hidden], x's dtype.
void rms_norm(torch::Tensor out, const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  rms_norm_impl(out, x, std::nullopt, weight, eps);
}

// vLLM's fused_add_rms_norm, in place: residual += x (the skip connection, in x's dtype),
// then x = rms_norm(residual). The add costs no pass of its own. x, residual: [num_tokens, hidden].
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, const torch::Tensor& weight, double eps) {
  rms_norm_impl(x, x, residual, weight, eps);
}

// SwiGLU's gate: out = silu(x[:, :d]) * x[:, d:], x: [num_tokens, 2d] (gate_up_proj's
// output), out: [num_tokens, d]. silu(g) = g / (1 + exp(-g)).
void silu_and_mul(torch::Tensor out, const torch::Tensor& x) {
  check_rows(x, "x");
  check_rows(out, "out");
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  TORCH_CHECK(x.size(1) == 2 * d && out.size(0) == rows && out.size(1) == d && out.scalar_type() == x.scalar_type(),
              "silu_and_mul: x must be [n, 2d] and out [n, d], got ", x.sizes(), " and ", out.sizes());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t xs = x.stride(0), os = out.stride(0);
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t* gate = xp + i * xs;
        const scalar_t* up = gate + d;
        scalar_t* dst = op + i * os;
        _Pragma("omp simd")
        for (int64_t j = 0; j < d; ++j) {
          const float g = to_f32(gate[j]);
          const scalar_t act = from_f32<scalar_t>(g / (1.f + fast_exp(-g)));
          dst[j] = from_f32<scalar_t>(to_f32(act) * to_f32(up[j]));
        }
      }
    });
  });
}

// RoPE in place, GPT-NeoX layout (transformers' rotate_half): for each head, with
// h = head_size / 2, x[i] <- x[i] cos[i] - x[i + h] sin[i] and x[i + h] <- x[i + h]
// cos[i + h] + x[i] sin[i + h]. query: [num_tokens, num_heads * head_size], key:
// [num_tokens, num_kv_heads * head_size] (views of qkv_proj's output: strided rows);
// positions: [num_tokens] int64; cos, sin: [max_positions, head_size] in x's dtype.
void rotary_embedding(const torch::Tensor& positions, torch::Tensor query, torch::Tensor key,
                      const torch::Tensor& cos, const torch::Tensor& sin, int64_t head_size) {
  check_rows(query, "query");
  check_rows(key, "key");
  const int64_t rows = query.size(0), half = head_size / 2, max_pos = cos.size(0);
  TORCH_CHECK(head_size % 2 == 0 && query.size(1) % head_size == 0 && key.size(1) % head_size == 0 &&
              key.size(0) == rows, "rotary_embedding: query ", query.sizes(), " and key ", key.sizes(),
              " must be [num_tokens, heads * head_size = ", head_size, "]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == head_size &&
              sin.sizes() == cos.sizes() && cos.scalar_type() == query.scalar_type() &&
              key.scalar_type() == query.scalar_type(), "cos/sin must be contiguous [max_positions, head_size = ",
              head_size, "] in query's dtype");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous() && positions.numel() == rows,
              "positions must be contiguous int64 [num_tokens = ", rows, "]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; ++i)
    TORCH_CHECK(pos[i] >= 0 && pos[i] < max_pos, "positions[", i, "] = ", pos[i], " is outside the RoPE "
                "table [0, ", max_pos, ")");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "rotary_embedding", [&] {
    auto rotate = [&](scalar_t* x, const scalar_t* c, const scalar_t* s) {
      _Pragma("omp simd")
      for (int64_t j = 0; j < half; ++j) {
        const float x1 = to_f32(x[j]), x2 = to_f32(x[j + half]);
        // transformers: x * cos + rotate_half(x) * sin, each product rounded to the dtype
        const auto t1 = from_f32<scalar_t>(x1 * to_f32(c[j]));
        const auto t2 = from_f32<scalar_t>(-x2 * to_f32(s[j]));
        const auto t3 = from_f32<scalar_t>(x2 * to_f32(c[j + half]));
        const auto t4 = from_f32<scalar_t>(x1 * to_f32(s[j + half]));
        x[j] = from_f32<scalar_t>(to_f32(t1) + to_f32(t2));
        x[j + half] = from_f32<scalar_t>(to_f32(t3) + to_f32(t4));
      }
    };
    scalar_t* qp = query.data_ptr<scalar_t>();
    scalar_t* kp = key.data_ptr<scalar_t>();
    const int64_t qs = query.stride(0), ks = key.stride(0);
    const int64_t nq = query.size(1) / head_size, nk = key.size(1) / head_size;
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t* c = cos.data_ptr<scalar_t>() + pos[i] * head_size;
        const scalar_t* s = sin.data_ptr<scalar_t>() + pos[i] * head_size;
        for (int64_t h = 0; h < nq; ++h) rotate(qp + i * qs + h * head_size, c, s);
        for (int64_t h = 0; h < nk; ++h) rotate(kp + i * ks + h * head_size, c, s);
      }
    });
  });
}

// ---- Matmul: y = x W^T, the same bits for a row whatever its batch ------------------------
// x: [m, k], W: [n, k] (fp32 with fp32, or bf16 with bf16), out: [m, n] in x's dtype or fp32.
//
// Batch invariance (chapters/05-llama.md): MKL and oneDNN pick their blocking, and with it
// the order in which a dot product's k terms are added, by the number of rows m, so a
// row's result changes with the batch it shares (measured: MKL's sgemm at m = 1 vs 2,
// oneDNN's bf16 at m = 32 vs 33). Here every dot product x_i . w_j is computed by the same
// instructions in the same order whatever m, i or the thread: a vector accumulator walks
// k in chunks of one vector, fused multiply-adds into it, and one fixed horizontal sum
// ends it. The tile code below only decides which dot products share the loads (R rows of
// x times 4 rows of W in registers); each accumulator is independent, so R = 1 and R = 4
// give the same bits (intrinsics are never reassociated: no -ffast-math).
//
// Speed: a decode step is a walk through the weights (SmolLM2: 270 MB of bf16 per step),
// so each group of 4 weight rows is read from memory once for up to 4 x rows and stays in
// L1 for the next; prefill steps reuse a block of 32 weight rows for every x row.
// bf16 uses AVX512-BF16's dot-product instruction (vdpbf16ps: 32 products per
// instruction, summed in pairs into fp32) where the CPU has it, else widens bf16 to fp32
// and uses fp32 FMAs (exact products; other bits than vdpbf16ps, same on every batch).
namespace mm {

// res[r][c] = x_r . w_c for R rows of x (stride k) and C <= 4 weight rows.
template <typename T, int R, int C = 4>
inline void dot_tile(const T* const* xs, const T* const* ws, int64_t k, float (&res)[4][4]) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {        // vdpbf16ps: 32 bf16 pairs a step
    __m512 acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t d = 0; d < k; d += 32) {
      const int64_t left = k - d;
      const __mmask32 mask = left >= 32 ? ~0u : static_cast<__mmask32>((1ull << left) - 1);
      __m512i w[C];
      for (int c = 0; c < C; ++c) w[c] = _mm512_maskz_loadu_epi16(mask, ws[c] + d);
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_maskz_loadu_epi16(mask, xs[r] + d);
        for (int c = 0; c < C; ++c)
          acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)xv, (__m512bh)w[c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) res[r][c] = _mm512_reduce_add_ps(acc[r][c]);
    return;
  }
#endif
  vec acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vzero();
  const auto step = [&](int64_t d, int64_t left) {
    vec w[C];
    for (int c = 0; c < C; ++c) w[c] = vload(ws[c] + d, left);
    for (int r = 0; r < R; ++r) {
      const vec xv = vload(xs[r] + d, left);
      for (int c = 0; c < C; ++c) acc[r][c] = vfma(xv, w[c], acc[r][c]);
    }
  };
  // whole vectors with a constant length, then the partial one: the same loads and FMAs as
  // one loop with a variable length (measured, AVX2, 1 thread, [1536 x 576], m = 256: this
  // linear ~9% faster; no change end to end)
  int64_t d = 0;
  for (; d + kLanes <= k; d += kLanes) step(d, kLanes);
  if (d < k) step(d, k - d);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) res[r][c] = vsum(acc[r][c]);
}

// linear_kernel's tile: kTileRows rows of x by kTileCols weight rows, their sums in
// registers with a weight vector each and one of x: AVX512's 32 registers hold 4 x 4 (16
// sums), AVX2's 16 hold 4 x 3 (12 sums, 3 weight vectors, x). On AVX2 4 x 3 against the
// 2 x 4 before: 7 loads for 12 FMAs instead of 6 for 8 (measured, 2-core AMD EPYC, 2
// threads, Q4_1 and Q8_0 widened, [3072 x 576] and [576 x 1536], m = 16..1024: 95-125 ->
// 113-158 GFLOP/s, 1.1-1.33x; torch's MKL sgemm 133-177 on such shapes). Same bits: each
// sum is its own accumulator whichever tile holds it.
constexpr int kTileRows = 4, kTileCols = kLanes >= 16 ? 4 : 3;

// out's rows are ldo apart (default n; gguf_linear writes a column slice of a wider out)
template <typename T, typename O>
void linear_kernel(O* out, const T* x, const T* w, int64_t m, int64_t k, int64_t n, int64_t ldo = -1) {
  if (ldo < 0) ldo = n;
  constexpr int64_t kRowsPerTask = 32;          // weight rows a task keeps in cache for every x row
  // x in chunks of ~256 KB, which stay in L2 while the thread's weight rows pass over them
  const int64_t chunk = std::max<int64_t>(kTileRows, (256 * 1024 / (k * sizeof(T))) / kTileRows * kTileRows);
  at::parallel_for(0, (n + kRowsPerTask - 1) / kRowsPerTask, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i0 = 0; i0 < m; i0 += chunk)
    for (int64_t task = begin; task < end; ++task) {
      const int64_t j0 = task * kRowsPerTask, j1 = std::min(n, j0 + kRowsPerTask);
      for (int64_t i = i0; i < std::min(m, i0 + chunk); i += kTileRows) {
        const int64_t rows = std::min<int64_t>(kTileRows, m - i);
        const T* xs[4];
        for (int r = 0; r < 4; ++r) xs[r] = x + std::min(i + r, m - 1) * k;
        for (int64_t j = j0; j < j1; j += kTileCols) {
          const T* ws[4];                        // a short group repeats its last row
          for (int c = 0; c < 4; ++c) ws[c] = w + std::min(j + c, j1 - 1) * k;
          float res[4][4];
          switch (rows) {
            case 1: dot_tile<T, 1, kTileCols>(xs, ws, k, res); break;
            case 2: dot_tile<T, 2, kTileCols>(xs, ws, k, res); break;
            case 3: dot_tile<T, 3, kTileCols>(xs, ws, k, res); break;
            default: dot_tile<T, 4, kTileCols>(xs, ws, k, res);
          }
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < kTileCols && j + c < j1; ++c) out[(i + r) * ldo + j + c] = static_cast<O>(res[r][c]);
        }
      }
    }
  });
}

}  // namespace mm

void linear(torch::Tensor out, const torch::Tensor& x, const torch::Tensor& weight) {
  using mm::linear_kernel;
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "linear: x [m, k] and "
              "weight [n, k] must share k, got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && out.is_contiguous() && x.device().is_cpu() &&
              weight.device().is_cpu() && out.device().is_cpu(),
              "linear: x, weight and out must be contiguous CPU tensors");
  const auto dt = x.scalar_type();
  TORCH_CHECK((dt == torch::kFloat || dt == torch::kBFloat16) && weight.scalar_type() == dt &&
              (out.scalar_type() == dt || out.scalar_type() == torch::kFloat),
              "linear: x and weight both float32 or both bfloat16, out theirs or float32; got ", dt, ", ",
              weight.scalar_type(), " and ", out.scalar_type());
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.size(1) == n, "linear: out must be [", m, ", ", n,
              "], got ", out.sizes());
  if (m == 0 || n == 0) return;
#if defined(__AVX512BF16__)
  if (dt == torch::kBFloat16) paths::ran(paths::kAvx512Bf16);
#endif
  if (dt == torch::kFloat) {
    linear_kernel(out.data_ptr<float>(), x.data_ptr<float>(), weight.data_ptr<float>(), m, k, n);
  } else if (out.scalar_type() == torch::kFloat) {
    linear_kernel(out.data_ptr<float>(), x.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(), m, k, n);
  } else {
    linear_kernel(out.data_ptr<at::BFloat16>(), x.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(),
                  m, k, n);
  }
}

// ---- The same matmul on AMX tiles (Sapphire Rapids and later), bf16 ----------------------
// AMX multiplies tiles: C[16 x 16 fp32] += A[16 rows x 32 bf16] . B[32 x 16 bf16], the B
// tile stored in pairs of k ("VNNI" layout: row r holds k = 2r, 2r + 1 of each of the 16
// columns). KernelBackend.pack_weight (layers/backends.py) lays W [n, k] out once as [n / 16, k / 32, 16, 32]
// so each B tile is 1 KB of contiguous memory. Every output element starts at zero and
// gets one tdpbf16ps per 32-wide chunk of k, in order, whatever m, its row's place in the
// tile or the thread: batch-invariant like the loop above (and about ten times faster at
// prefill sizes on our 2-core Xeon). Tail rows of x are copied into a zeroed tile; k must
// be a multiple of 32 (backends.py picks this kernel by the weight's shape alone, never by m).
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

namespace amx {

struct alignas(64) TileConfig {     // ldtilecfg's 64-byte operand
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Linux lets a process use the AMX tile registers only after asking (arch_prctl).
bool permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

// tiles 0-3: C (fp32 16 x 16), 4-5: A (two blocks of 16 x rows), 6-7: B (two column blocks)
void configure() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  // GCC 12 at -O3 drops the stores above as dead (it does not see ldtilecfg read them):
  // an empty asm that takes the address and clobbers memory keeps them.
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// A C tile's rows x cols corner to out (row stride ldo), rounded to O by bit operations:
// with c10's scalar conversion these stores took most of a decode step's matmul time.
template <typename O>
void store(O* out, const float* c, int64_t rows, int64_t cols, int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r) {
    if constexpr (std::is_same_v<O, float>) {
      std::memcpy(out + r * ldo, c + r * 16, cols * sizeof(float));
    } else {
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) out[r * ldo + j] = from_f32<O>(c[r * 16 + j]);
    }
  }
}

template <typename O>
void linear_amx_kernel(O* out, const at::BFloat16* x, const at::BFloat16* packed, int64_t m, int64_t k,
                       int64_t n) {
  const int64_t nb = (n + 15) / 16, kc = k / 32, xs = k * 2;   // column blocks, k chunks, x stride (bytes)
  at::parallel_for(0, (nb + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    configure();
    // A last block of other than 16 or 32 rows is read from a zero-filled copy. The
    // buffer is the thread's own and kept between calls: allocated per call, its pages
    // were faulted in again every time (m = 17 took 1.6x as long as m = 32).
    const int64_t tail = m % 32 == 0 || m % 32 == 16 ? m : m - m % 32;
    thread_local std::vector<at::BFloat16> pad;
    if (tail < m) {
      if (static_cast<int64_t>(pad.size()) < 32 * k) pad.resize(32 * k);
      std::memcpy(pad.data(), x + tail * k, (m - tail) * k * sizeof(at::BFloat16));
      std::memset(static_cast<void*>(pad.data() + (m - tail) * k), 0, (32 - (m - tail)) * k * sizeof(at::BFloat16));
    }
    alignas(64) float c[4][256];
    // x in chunks of 256 rows (300 KB at k = 576) that stay in this core's L2 while
    // every column pair of the task passes over them; a prefill's whole x does not fit
    for (int64_t m0 = 0; m0 < m; m0 += 256)
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t j0 = pair * 32;
      const bool two_cols = 2 * pair + 1 < nb;
      const at::BFloat16* b0 = packed + (2 * pair) * kc * 512;
      const at::BFloat16* b1 = b0 + kc * 512;
      for (int64_t i = m0; i < std::min(m, m0 + 256); i += 32) {
        const int64_t rows = std::min<int64_t>(32, m - i);
        const bool two_rows = rows > 16;
        const at::BFloat16* a = i == tail ? pad.data() : x + i * k;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t q = 0; q < kc; ++q) {
          // B tiles 4 chunks ahead, into L1: at decode sizes the weights stream from
          // memory, and tile loads alone left the prefetcher behind
          for (int64_t line = 0; line < 1024; line += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(b0 + (q + 4) * 512) + line, _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(b1 + (q + 4) * 512) + line, _MM_HINT_T0);
          }
          _tile_loadd(4, a + q * 32, xs);
          _tile_loadd(6, b0 + q * 512, 64);
          _tile_dpbf16ps(0, 4, 6);
          if (two_rows) {
            _tile_loadd(5, a + 16 * k + q * 32, xs);
            _tile_dpbf16ps(2, 5, 6);
          }
          if (two_cols) {
            _tile_loadd(7, b1 + q * 512, 64);
            _tile_dpbf16ps(1, 4, 7);
            if (two_rows) _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, c[0], 64); _tile_stored(1, c[1], 64);
        _tile_stored(2, c[2], 64); _tile_stored(3, c[3], 64);
        const int64_t cols0 = std::min<int64_t>(16, n - j0), cols1 = std::min<int64_t>(16, n - j0 - 16);
        const int64_t rows0 = std::min<int64_t>(16, rows), rows1 = rows - rows0;
        store(out + i * n + j0, c[0], rows0, cols0, n);
        if (two_cols) store(out + i * n + j0 + 16, c[1], rows0, cols1, n);
        if (two_rows) {
          store(out + (i + 16) * n + j0, c[2], rows1, cols0, n);
          if (two_cols) store(out + (i + 16) * n + j0 + 16, c[3], rows1, cols1, n);
        }
      }
    }
    _tile_release();
  });
}

}  // namespace amx

// out [m, n] (bf16 or fp32) = x [m, k] bf16 @ W^T, W given packed by KernelBackend.pack_weight:
// [ceil(n / 16), k / 32, 16, 32] bf16.
void linear_amx(torch::Tensor out, const torch::Tensor& x, const torch::Tensor& packed) {
  TORCH_CHECK(amx::permitted(), "linear_amx: the kernel refused AMX to this process (arch_prctl)");
  paths::ran(paths::kAmx);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kBFloat16 && x.size(1) % 32 == 0,
              "linear_amx: x must be contiguous bf16 [m, k] with k a multiple of 32, got ", x.scalar_type(), " ",
              x.sizes());
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.scalar_type() == torch::kBFloat16 &&
              packed.size(0) == (n + 15) / 16 && packed.size(1) == k / 32 && packed.size(2) == 16 &&
              packed.size(3) == 32, "linear_amx: packed must be bf16 [", (n + 15) / 16, ", ", k / 32,
              ", 16, 32] for out's n = ", n, " and k = ", k, ", got ", packed.sizes());
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == m &&
              (out.scalar_type() == torch::kFloat || out.scalar_type() == torch::kBFloat16),
              "linear_amx: out must be contiguous [m, n] bf16 or float32");
  if (m == 0 || n == 0) return;
  if (out.scalar_type() == torch::kFloat)
    amx::linear_amx_kernel(out.data_ptr<float>(), x.data_ptr<at::BFloat16>(), packed.data_ptr<at::BFloat16>(),
                           m, k, n);
  else
    amx::linear_amx_kernel(out.data_ptr<at::BFloat16>(), x.data_ptr<at::BFloat16>(),
                           packed.data_ptr<at::BFloat16>(), m, k, n);
}
#endif

// ---- Quantized weights, many rows of x: widen the matrix once, then the fp32 matmul ---------
// A quantized matmul (gguf_linear, int8_linear) widens its weights to fp32 as it reads them.
// With many rows of x (prefill, large batches) it widens the whole matrix once instead,
// into a scratch kept from call to call, and runs linear_kernel on that: the same widened
// values through the same FMAs in the same order, so the same bits as its other paths. The
// scratch is grow-only, at most kMaxBytes (a larger matrix keeps the per-tile paths): a
// new buffer of megabytes is fresh pages from the OS at every call (glibc maps it), and
// touching them first cost more than the widening (measured: [3072 x 576], m = 128, 1.4
// ms of 5.0). A call that finds the scratch in use by another thread takes its other path.
namespace widened {

// p rounded up to 64 bytes (in a buffer of 16 floats more), where torch's tensors start:
// from malloc's 16-byte alignment a quarter of the vector loads split a cache line
// (measured, 2-core AMD EPYC, AVX2: linear_kernel on such a copy of [3072 x 576], m =
// 512, 1.35x slower; gguf_linear's per-task panels are aligned the same way)
inline float* align64(float* p) {
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63});
}

constexpr int64_t kMaxBytes = 64 << 20;

inline std::mutex mutex;                                 // one scratch for every format
inline std::vector<float> scratch;

// Runs the matmul into out (rows ldo apart) if m >= from_rows and the matrix fits: widen(wide,
// begin, end) writes rows [begin, end) of the fp32 matrix [n, k] at wide (called in parallel
// over row ranges). Returns false, doing nothing, otherwise.
template <typename Widen>
bool linear(float* out, int64_t ldo, const float* x, int64_t m, int64_t k, int64_t n, int64_t from_rows,
            Widen&& widen) {
  if (m < from_rows || n * k * 4 > kMaxBytes) return false;
  std::unique_lock<std::mutex> lock(mutex, std::try_to_lock);
  if (!lock.owns_lock()) return false;
  if (static_cast<int64_t>(scratch.size()) < n * k + 16) scratch.resize(n * k + 16);
  float* wide = align64(scratch.data());
  at::parallel_for(0, n, 32, [&](int64_t begin, int64_t end) { widen(wide, begin, end); });
  mm::linear_kernel<float, float>(out, x, wide, m, k, n, ldo);
  return true;
}

}  // namespace widened

// ---- GGUF block formats: y = x W^T with W kept as the file's bytes ------------------------
// llama.cpp's ggml-quants: a weight row of k values is k / QK blocks of QK weights, each
// fp16 scales and small integers q (the table in nanopaged/layers/quantization/gguf.py):
//   Q8_0,  34 bytes / 32: d, 32 int8                            w = q * d
//   Q4_0,  18 bytes / 32: d, 16 bytes of nibbles                w = (q - 8) * d
//   Q4_1,  20 bytes / 32: d, m (fp16), 16 bytes                 w = q * d + m
//   Q5_0,  22 bytes / 32: d, qh (uint32: bit i = q_i's 5th), 16 bytes    w = (q - 16) * d
//   Q5_1,  24 bytes / 32: d, m, qh, 16 bytes                    w = q * d + m
// In these the low nibble of byte i is element i and the high nibble element i + 16. The
// K-quants are super-blocks of 256 with 6- or 8-bit scales per sub-block:
//   Q4_K, 144 bytes: d, dmin (fp16), 12 bytes packing 8 six-bit scales sc and mins mn, then
//         128 bytes: byte 32j + l holds element 64j + l (low nibble) and 64j + 32 + l (high);
//         sub-block e / 32:                                 w = (d * sc) * q - dmin * mn
//   Q5_K, 176 bytes: Q4_K's head, 32 bytes qh (bit s of byte l: 5th bit of element 32s + l),
//         then Q4_K's 128 bytes of nibbles
//   Q6_K, 210 bytes: 128 bytes ql, 64 bytes qh, 16 int8 scales, d. Element e = 128h + 32j + l:
//         low 4 bits from byte 64h + (e % 128) % 64 of ql (high nibble when e % 128 >= 64),
//         top 2 from bits 2j of byte 32h + l of qh; sub-block e / 16:  w = (d * sc) * (q - 32)
// Each block is widened to fp32 in registers as it is read, a vector at a time, and fed to
// the same FMAs in the same order as linear_kernel's fp32 loop above: the result is that
// loop's on the dequantized weights, bit for bit (so batch-invariant). The widened values
// are gguf.quants.dequantize's, which rounds each op to fp32. d * sc is exact (11-bit
// fp16 mantissa x 6 or 8 bits); q * d and (d * sc) * q for 4- or 5-bit q are exact too
// (<= 22 bits), so q * d + m and (d * sc) * q - dmin * mn round once: a fused
// multiply-add gives the same bits. Q6_K's (d * sc) * q (up to 25 bits) may round, so it is
// a plain multiply, as numpy's. A decode step reads each packed byte once: Q4_1 is 5 bits
// a weight, Q4_K 4.5, where fp32 is 32. nanopaged/layers/quantization/gguf.py holds the
// layer side.
namespace ggml {

constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8;   // GGML's type numbers
constexpr int64_t kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;
template <int64_t Q>
constexpr int64_t kWeights = Q >= kQ4_K ? 256 : 32;     // weights per block (QK_K or QK)
template <int64_t Q>
constexpr int64_t kBytes = Q == kQ8_0 ? 34 : Q == kQ4_0 ? 18 : Q == kQ4_1 ? 20 : Q == kQ5_0 ? 22
                         : Q == kQ5_1 ? 24 : Q == kQ4_K ? 144 : Q == kQ5_K ? 176 : 210;

inline float half_at(const uint8_t* p) {                // an fp16 stored in the block (exact)
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);                               // one instruction (c10's is bit twiddling)
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// Integer lanes, one per fp32 lane of mm::vec: the quants are assembled in these, then
// converted. bytes(p) widens kLanes consecutive bytes from p (sbytes: as int8).
#if defined(__AVX512F__)
using ivec = __m512i;
inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline ivec bytes(const uint8_t* p) { return _mm512_cvtepu8_epi32(load16(p)); }
inline ivec sbytes(const uint8_t* p) { return _mm512_cvtepi8_epi32(load16(p)); }
inline ivec iset1(int v) { return _mm512_set1_epi32(v); }
inline ivec iand(ivec a, int v) { return _mm512_and_si512(a, iset1(v)); }
inline ivec ior(ivec a, ivec b) { return _mm512_or_si512(a, b); }
inline ivec isub(ivec a, int v) { return _mm512_sub_epi32(a, iset1(v)); }
inline ivec ishr(ivec a, int n) { return _mm512_srl_epi32(a, _mm_cvtsi32_si128(n)); }
inline ivec ishl(ivec a, int n) { return _mm512_sll_epi32(a, _mm_cvtsi32_si128(n)); }
inline ivec ibits(ivec word, int first) {              // lane i: bit first + i of word (a broadcast)
  const ivec at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return iand(_mm512_srlv_epi32(word, _mm512_add_epi32(at, iset1(first))), 1);
}
inline mm::vec to_float(ivec a) { return _mm512_cvtepi32_ps(a); }
inline mm::vec vmul(mm::vec a, mm::vec b) { return _mm512_mul_ps(a, b); }
#elif defined(__AVX2__)
using ivec = __m256i;
inline __m128i load8(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
inline ivec bytes(const uint8_t* p) { return _mm256_cvtepu8_epi32(load8(p)); }
inline ivec sbytes(const uint8_t* p) { return _mm256_cvtepi8_epi32(load8(p)); }
inline ivec iset1(int v) { return _mm256_set1_epi32(v); }
inline ivec iand(ivec a, int v) { return _mm256_and_si256(a, iset1(v)); }
inline ivec ior(ivec a, ivec b) { return _mm256_or_si256(a, b); }
inline ivec isub(ivec a, int v) { return _mm256_sub_epi32(a, iset1(v)); }
inline ivec ishr(ivec a, int n) { return _mm256_srl_epi32(a, _mm_cvtsi32_si128(n)); }
inline ivec ishl(ivec a, int n) { return _mm256_sll_epi32(a, _mm_cvtsi32_si128(n)); }
inline ivec ibits(ivec word, int first) {
  return iand(_mm256_srlv_epi32(word, _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), iset1(first))), 1);
}
inline mm::vec to_float(ivec a) { return _mm256_cvtepi32_ps(a); }
inline mm::vec vmul(mm::vec a, mm::vec b) { return _mm256_mul_ps(a, b); }
#else
using ivec = int32_t;
inline ivec bytes(const uint8_t* p) { return *p; }
inline ivec sbytes(const uint8_t* p) { return static_cast<int8_t>(*p); }
inline ivec iset1(int v) { return v; }
inline ivec iand(ivec a, int v) { return a & v; }
inline ivec ior(ivec a, ivec b) { return a | b; }
inline ivec isub(ivec a, int v) { return a - v; }
inline ivec ishr(ivec a, int n) { return static_cast<ivec>(static_cast<uint32_t>(a) >> n); }
inline ivec ishl(ivec a, int n) { return a << n; }
inline ivec ibits(ivec word, int first) { return (static_cast<uint32_t>(word) >> first) & 1; }
inline mm::vec to_float(ivec a) { return static_cast<float>(a); }
inline mm::vec vmul(mm::vec a, mm::vec b) { return a * b; }
#endif

// One row's block, its scales read once. A block is walked in groups of kGroup elements
// (a run of the K-quants' nibbles: a loop over g), each kGroup / kLanes vectors unrolled
// (widen<T>), so the nibble, bit and byte positions are constants.
// widen<T>(g): elements [g * kGroup + T * kLanes, ... + kLanes), widened and scaled (a
// vector never straddles a sub-block).
template <int64_t Q>
struct Block {                                           // the 32-weight formats: one group
  static constexpr int kGroup = 32;
  static constexpr int kHead = Q == kQ8_0 || Q == kQ4_0 ? 2 : Q == kQ4_1 ? 4 : Q == kQ5_0 ? 6 : 8;  // bytes before qs
  const uint8_t* p;
  float d, m = 0.f;
  ivec qh = iset1(0);                                    // Q5: the fifth bits, in every lane
  explicit Block(const uint8_t* block) : p(block) {
#if defined(__F16C__)
    // d (and Q4_1's and Q5_1's m beside it) by one 4-byte load and one conversion (every
    // block is at least 18 bytes: the load stays inside it). Two half_at calls cost a
    // 2-byte insert and a conversion each, about a tenth of the one-row loop's micro-ops:
    // SmolLM2's Q4_1 matrices at one row, one thread, in cache, went from 10.6-11.2 to
    // 11.5-12.2 G weights/s (2026-12-03, 2-core AMD EPYC, AVX2)
    int32_t word;
    std::memcpy(&word, block, 4);
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(word));
    d = _mm_cvtss_f32(dm);
    if constexpr (Q == kQ4_1 || Q == kQ5_1) m = _mm_cvtss_f32(_mm_movehdup_ps(dm));
#else
    d = half_at(block);
    if constexpr (Q == kQ4_1 || Q == kQ5_1) m = half_at(block + 2);
#endif
    if constexpr (Q == kQ5_0 || Q == kQ5_1) {
      int32_t bits;
      std::memcpy(&bits, block + kHead - 4, 4);
      qh = iset1(bits);
    }
  }
  template <int T>
  mm::vec widen(int) const {
    using namespace mm;
    constexpr int e = T * static_cast<int>(kLanes);
    if constexpr (Q == kQ8_0) return vmul(to_float(sbytes(p + kHead + e)), vset1(d));
    const ivec b = bytes(p + kHead + e % 16);           // element e's byte, in its high nibble from 16
    ivec q = e >= 16 ? ishr(b, 4) : iand(b, 0xF);        // a byte >> 4 is its high nibble alone
    if constexpr (Q == kQ5_0 || Q == kQ5_1) q = ior(q, ishl(ibits(qh, e), 4));
    if constexpr (Q == kQ4_0) return vmul(to_float(isub(q, 8)), vset1(d));
    if constexpr (Q == kQ5_0) return vmul(to_float(isub(q, 16)), vset1(d));
    return vfma(to_float(q), vset1(d), vset1(m));        // q * d exact: one rounding, as numpy's
  }
};

template <int64_t Q>
struct KBlock {                                          // Q4_K and Q5_K: groups of 64, 32 bytes of nibbles
  static constexpr int kGroup = 64;
  float ds[8], ndm[8];                                   // d * sc and -(dmin * mn), exact
  const uint8_t* p;
  explicit KBlock(const uint8_t* block) : p(block) {
    const float d = half_at(block), dmin = half_at(block + 2);
    const uint8_t* s = block + 4;
#if defined(__AVX2__)
    // the loop below in lanes (measured at batch 1: Q4_K's matvec took ~1.5x Q4_0's time
    // with the loop, ~1.1x without)
    int32_t word[3];
    std::memcpy(word, s, 12);
    const __m128i a = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(word[0]));      // scales 0-3, top bits 4-7's
    const __m128i b = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(word[1]));      // mins 0-3, ...
    const __m128i c = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(word[2]));      // low 4 bits of scale / min 4-7
    const __m128i six = _mm_set1_epi32(63), four = _mm_set1_epi32(0xF);
    const __m256i sc = _mm256_setr_m128i(_mm_and_si128(a, six),
                                         _mm_or_si128(_mm_and_si128(c, four), _mm_slli_epi32(_mm_srli_epi32(a, 6), 4)));
    const __m256i mn = _mm256_setr_m128i(_mm_and_si128(b, six),
                                         _mm_or_si128(_mm_srli_epi32(c, 4), _mm_slli_epi32(_mm_srli_epi32(b, 6), 4)));
    _mm256_storeu_ps(ds, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sc)));
    _mm256_storeu_ps(ndm, _mm256_mul_ps(_mm256_set1_ps(-dmin), _mm256_cvtepi32_ps(mn)));   // -(dmin * mn), exact
#else
    for (int i = 0; i < 4; ++i) {
      ds[i] = d * (s[i] & 63);
      ndm[i] = -(dmin * (s[i + 4] & 63));
      ds[i + 4] = d * ((s[i + 8] & 0xF) | ((s[i] >> 6) << 4));
      ndm[i + 4] = -(dmin * ((s[i + 8] >> 4) | ((s[i + 4] >> 6) << 4)));
    }
#endif
  }
  template <int T>
  mm::vec widen(int g) const {
    using namespace mm;
    constexpr int e = T * static_cast<int>(kLanes), high = e >= 32, l = e % 32;
    const int sub = 2 * g + high;
    const ivec b = bytes(p + (Q == kQ5_K ? 48 : 16) + 32 * g + l);
    ivec q = iand(high ? ishr(b, 4) : b, 0xF);
    if constexpr (Q == kQ5_K) q = ior(q, ishl(iand(ishr(bytes(p + 16 + l), sub), 1), 4));
    return vfma(to_float(q), vset1(ds[sub]), vset1(ndm[sub]));   // the product exact: one rounding
  }
};

struct Q6Block {                                         // groups of 128: 64 bytes of ql, 32 of qh
  static constexpr int kGroup = 128;
  float ds[16];                                          // d * sc, exact
  const uint8_t* p;
  explicit Q6Block(const uint8_t* block) : p(block) {
    const float d = half_at(block + 208);
#if defined(__AVX2__)
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192));
    _mm256_storeu_ps(ds, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
    _mm256_storeu_ps(ds + 8, _mm256_mul_ps(_mm256_set1_ps(d),
                                           _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
#else
    for (int i = 0; i < 16; ++i) ds[i] = d * static_cast<int8_t>(block[192 + i]);
#endif
  }
  template <int T>
  mm::vec widen(int g) const {
    using namespace mm;
    constexpr int i = T * static_cast<int>(kLanes);
    const ivec b = bytes(p + 64 * g + i % 64);
    const ivec lo = iand(i >= 64 ? ishr(b, 4) : b, 0xF);
    const ivec hi = iand(ishr(bytes(p + 128 + 32 * g + i % 32), 2 * (i / 32)), 3);
    return vmul(to_float(isub(ior(lo, ishl(hi, 4)), 32)), vset1(ds[8 * g + i / 16]));   // rounds once, as numpy
  }
};

template <int64_t Q>
using BlockOf =
    std::conditional_t<Q == kQ6_K, Q6Block, std::conditional_t<Q == kQ4_K || Q == kQ5_K, KBlock<Q>, Block<Q>>>;

template <int N, typename F>
inline void unroll(F&& f) {                              // f(0), ..., f(N - 1), the index a constant
  [&]<int... I>(std::integer_sequence<int, I...>) { (f(std::integral_constant<int, I>{}), ...); }(
      std::make_integer_sequence<int, N>{});
}

// res[r][c] = x_r . w_c for R rows of x and 4 packed weight rows of `blocks` blocks:
// dot_tile's accumulators, loads and sums, with each weight vector widened from its block.
template <int64_t Q, int R>
inline void qdot_tile(const float* const* xs, const uint8_t* const* ws, int64_t blocks, float (&res)[4][4]) {
  using namespace mm;
  constexpr int64_t kW = kWeights<Q>, kB = kBytes<Q>;
  const int64_t ahead = 4 * blocks * kB;                 // the next 4 rows: they follow in memory
  vec acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = vzero();
  for (int64_t b = 0; b < blocks; ++b) {
#if defined(__AVX2__) || defined(__AVX512F__)
    // at decode sizes the packed rows stream from memory, and (measured) the hardware
    // prefetcher alone left a 30 MB Q8_0 matrix at a third of its in-cache speed
    for (int c = 0; c < 4; ++c)
      for (int64_t o = 0; o < kB; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(ws[c] + b * kB + ahead + o), _MM_HINT_T0);
#endif
    if constexpr (R == 1 && kW == 32) {
      // one row of x on a 32-weight format: x's block in registers, then a weight row's
      // block at a time, its scales live only while its vectors are summed (the four rows'
      // blocks at once held 8 scales and spilled to the stack; measured 2026-12-03, AMD
      // EPYC, AVX2, 2 threads: SmolLM2's 121 matmuls of a batch-1 step 7.8 -> 6.9 ms).
      // Each acc[0][c] gets the same FMAs in the same order as below.
      vec xv[kW / kLanes];
      unroll<kW / kLanes>([&](auto t) { xv[t] = vload(xs[0] + b * kW + t * kLanes, kLanes); });
      for (int c = 0; c < 4; ++c) {
        const BlockOf<Q> blk(ws[c] + b * kB);
        unroll<kW / kLanes>([&](auto t) {
          acc[0][c] = vfma(xv[t], blk.template widen<decltype(t)::value>(0), acc[0][c]);
        });
      }
      continue;
    }
    const BlockOf<Q> blk[4] = {BlockOf<Q>(ws[0] + b * kB), BlockOf<Q>(ws[1] + b * kB),
                               BlockOf<Q>(ws[2] + b * kB), BlockOf<Q>(ws[3] + b * kB)};
    constexpr int kGroup = BlockOf<Q>::kGroup;
    for (int g = 0; g < kW / kGroup; ++g)
      unroll<kGroup / kLanes>([&](auto t) {              // the group's vectors, in k's order
        vec xv[R];
        for (int r = 0; r < R; ++r) xv[r] = vload(xs[r] + b * kW + g * kGroup + t * kLanes, kLanes);
        for (int c = 0; c < 4; ++c) {
          const vec w = blk[c].template widen<decltype(t)::value>(g);
          for (int r = 0; r < R; ++r) acc[r][c] = vfma(xv[r], w, acc[r][c]);
        }
      });
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) res[r][c] = vsum(acc[r][c]);
}

// Rows [0, rows) of packed weights (row_bytes apart) widened into panel [rows, k] fp32:
// the values qdot_tile widens in registers, stored instead.
template <int64_t Q>
inline void widen_rows(float* panel, const uint8_t* w, int64_t rows, int64_t row_bytes, int64_t k) {
  using namespace mm;
  constexpr int64_t kW = kWeights<Q>, kB = kBytes<Q>;
  constexpr int kGroup = BlockOf<Q>::kGroup;
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t b = 0; b < k / kW; ++b) {
      const BlockOf<Q> blk(w + j * row_bytes + b * kB);
      for (int g = 0; g < kW / kGroup; ++g)
        unroll<kGroup / kLanes>([&](auto t) {
          vstore(panel + j * k + b * kW + g * kGroup + t * kLanes, blk.template widen<decltype(t)::value>(g),
                 kLanes);
        });
    }
}

// Three paths by the rows m of x, all feeding the FMAs the same widened values in the same
// order as linear_kernel's dot_tile, so a row's bits do not depend on which path its batch
// took (batch invariance; the tests cross every threshold):
// - m < kPanelFrom (decode): tasks of 32 weight rows, 4 at a time against kTileRows rows
//   of x (a short group repeating its last row), each block widened in registers
//   (qdot_tile): the packed bytes are read once;
// - kPanelFrom <= m < kWholeFrom (batches, prefill chunks): a task first widens its 32
//   weight rows into a panel of fp32 (~32 x k x 4 bytes, in L2), then runs dot_tile on it
//   in linear_kernel's tile for every row of x: a block is widened once, not once per
//   kTileRows rows of x;
// - m >= kWholeFrom (1024: long prefills under a token budget above the CPU's default
//   512): the whole matrix is widened once into a scratch kept between calls
//   (widened::linear; at most 64 MB, else the panels) and linear_kernel runs on it, x in
//   L2-sized chunks. Each weight is widened once a call either way; the scratch is written
//   and read back through L3, where a panel stays in L2 and x is read again per task.
// Measured (2026-12-03, 2-core AMD EPYC, AVX2, 2 threads). Where the panel starts to pay,
// [3072 x 576-768], m = 7: Q4_K 0.61 -> 0.46 ms, Q6_K 0.92 -> 0.52, Q4_1 0.43 -> 0.34;
// Q8_0, cheap to widen, only from 12 rows (the [49152 x 576] head: m = 7 5.0 ms in
// registers, 5.6 on a panel; m = 12 7.9 and 8.4). The whole matrix against the panels,
// Q4_1 [3072 x 576]: m = 32 1.22 -> 1.01 ms, m = 128 4.98 -> 3.77, m = 4600 181 -> 134
// (linear_kernel on fp32 weights: 0.90, 3.62, 131; the panels re-read all of x, which
// outgrows L2, for every task); [576 x 1536] m = 32 0.46 -> 0.51, m = 4600 about equal.
// On the 32-request workload (bench.py --sections quant) the Q4_1 file went from 105 to
// 129 tok/s in one run (134-137 in the bench's later ones), the fp32 folder 124; with
// linear_kernel's 4 x 3 tile (its comment) 161-165 in two runs, 135-163 in four more
// alternating with the 2 x 4 tile's 116-139 (README).
// Those were measured one matrix at a time, called again and again, so its packed bytes
// and the scratch stayed in cache. In a forward each call meets a cold matrix: SmolLM2's
// 120 matrices in turn, Q4_1, m = 17 / 27 / 64 / 96 / 256, whole matrix widened from 16
// rows 94-104 / 127-134 / 97-136 / 125-137 / 121-130 GFLOP/s, panels 111-118 / 135-142 /
// 137-150 / 133-154 / 138-151; about even at 40, 128, 512 and 1024; at 4096 the whole matrix
// 152-157, panels 131-141. Hence kWholeFrom = 1024 (was widened::kFromRows = 16). The 32-request workload
// under the CPU's 512-token budget (nanopaged/config.py), alternating: 143.7 / 143.0 /
// 153.0 -> 170.5 / 168.3 / 167.0 tok/s (2026-12-03, 2-core AMD EPYC, AVX2, 2 threads).
template <int64_t Q>
void gguf_linear_kernel(float* out, int64_t ldo, const float* x, const uint8_t* w, int64_t m, int64_t k,
                        int64_t n) {
  constexpr int64_t kRowsPerTask = 32;
  constexpr int64_t kTileRows = mm::kLanes >= 16 ? 4 : 2;
  constexpr int kPanelCols = mm::kTileCols, kPanelRows = mm::kTileRows;
  constexpr int64_t kPanelFrom = Q == kQ8_0 ? 12 : 3;    // rows of x from which a task widens a panel
  constexpr int64_t kWholeFrom = 1024;                   // rows of x from which the whole matrix is widened
  const int64_t blocks = k / kWeights<Q>, row_bytes = blocks * kBytes<Q>;
  if (widened::linear(out, ldo, x, m, k, n, kWholeFrom, [&](float* wide, int64_t begin, int64_t end) {
        widen_rows<Q>(wide + begin * k, w + begin * row_bytes, end - begin, row_bytes, k);
      }))
    return;
  const bool panel = m >= kPanelFrom;
  at::parallel_for(0, (n + kRowsPerTask - 1) / kRowsPerTask, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(panel ? kRowsPerTask * k + 16 : 0);
    float* const wide = widened::align64(buf.data());
    for (int64_t task = begin; task < end; ++task) {
      const int64_t j0 = task * kRowsPerTask, j1 = std::min(n, j0 + kRowsPerTask);
      if (panel) widen_rows<Q>(wide, w + j0 * row_bytes, j1 - j0, row_bytes, k);
      const int64_t tile_rows = panel ? kPanelRows : kTileRows, tile_cols = panel ? kPanelCols : 4;
      for (int64_t i = 0; i < m; i += tile_rows) {
        const int64_t rows = std::min<int64_t>(tile_rows, m - i);
        const float* xs[4];
        for (int r = 0; r < 4; ++r) xs[r] = x + std::min(i + r, m - 1) * k;
        for (int64_t j = j0; j < j1; j += tile_cols) {
          float res[4][4];
          if (panel) {
            const float* ws[4];                          // a short group repeats its last row
            for (int c = 0; c < 4; ++c) ws[c] = wide + (std::min(j + c, j1 - 1) - j0) * k;
            switch (rows) {
              case 1: mm::dot_tile<float, 1, kPanelCols>(xs, ws, k, res); break;
              case 2: mm::dot_tile<float, 2, kPanelCols>(xs, ws, k, res); break;
              case 3: mm::dot_tile<float, 3, kPanelCols>(xs, ws, k, res); break;
              default: mm::dot_tile<float, 4, kPanelCols>(xs, ws, k, res);
            }
          } else {
            const uint8_t* ws[4];
            for (int c = 0; c < 4; ++c) ws[c] = w + std::min(j + c, j1 - 1) * row_bytes;
            switch (rows) {
              case 1: qdot_tile<Q, 1>(xs, ws, blocks, res); break;
              case 2: qdot_tile<Q, 2>(xs, ws, blocks, res); break;
              case 3: qdot_tile<Q, 3>(xs, ws, blocks, res); break;
              default: qdot_tile<Q, 4>(xs, ws, blocks, res);
            }
          }
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < tile_cols && j + c < j1; ++c) out[(i + r) * ldo + j + c] = res[r][c];
        }
      }
    }
  });
}

// (weights, bytes) of a block of GGML type qtype; (0, 0) for a type not run here
inline std::pair<int64_t, int64_t> geometry(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return {kWeights<kQ4_0>, kBytes<kQ4_0>};
    case kQ4_1: return {kWeights<kQ4_1>, kBytes<kQ4_1>};
    case kQ5_0: return {kWeights<kQ5_0>, kBytes<kQ5_0>};
    case kQ5_1: return {kWeights<kQ5_1>, kBytes<kQ5_1>};
    case kQ8_0: return {kWeights<kQ8_0>, kBytes<kQ8_0>};
    case kQ4_K: return {kWeights<kQ4_K>, kBytes<kQ4_K>};
    case kQ5_K: return {kWeights<kQ5_K>, kBytes<kQ5_K>};
    case kQ6_K: return {kWeights<kQ6_K>, kBytes<kQ6_K>};
    default: return {0, 0};
  }
}

}  // namespace ggml

// gguf_linear's and gguf_linear_a8's shapes (`name` in the messages): x [m, k] fp32 with k
// whole blocks of qk, qweight [n, k / qk * bytes] uint8, out [m, n] fp32 with contiguous rows.
void check_gguf_args(const char* name, const torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& qweight,
                     int64_t qk, int64_t bytes) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat && x.device().is_cpu() &&
              x.size(1) % qk == 0, name, ": x must be contiguous float32 [m, k] on the CPU with k a "
              "multiple of ", qk, ", got ", x.scalar_type(), " ", x.sizes());
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0);
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.scalar_type() == torch::kUInt8 &&
              qweight.size(1) == k / qk * bytes, name, ": qweight must be contiguous uint8 [n, ",
              k / qk * bytes, "] for k = ", k, ", got ", qweight.scalar_type(), " ", qweight.sizes());
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == torch::kFloat && out.size(0) == m && out.size(1) == n &&
              out.stride(1) == 1 && (m <= 1 || out.stride(0) >= n), name, ": out must be float32 [", m,
              ", ", n, "] with contiguous rows, got ", out.scalar_type(), " ", out.sizes());
}

// out [m, n] fp32 (rows may be further apart: a column slice) = x [m, k] fp32 @ W^T, W the
// packed rows of a GGUF tensor: qweight [n, k / QK * block bytes] uint8, of GGML type qtype
// (2 Q4_0, 3 Q4_1, 6 Q5_0, 7 Q5_1, 8 Q8_0, 12 Q4_K, 13 Q5_K, 14 Q6_K).
void gguf_linear(torch::Tensor out, const torch::Tensor& x, const torch::Tensor& qweight, int64_t qtype) {
  using namespace ggml;
  const auto [qk, bytes] = geometry(qtype);
  TORCH_CHECK(qk > 0, "gguf_linear: GGML type ", qtype, " is not supported (Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, "
              "Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14)");
  check_gguf_args("gguf_linear", out, x, qweight, qk, bytes);
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0);
  if (m == 0 || n == 0) return;
  float* o = out.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  const int64_t ldo = out.stride(0);
  switch (qtype) {
    case kQ4_0: return gguf_linear_kernel<kQ4_0>(o, ldo, xp, w, m, k, n);
    case kQ4_1: return gguf_linear_kernel<kQ4_1>(o, ldo, xp, w, m, k, n);
    case kQ5_0: return gguf_linear_kernel<kQ5_0>(o, ldo, xp, w, m, k, n);
    case kQ5_1: return gguf_linear_kernel<kQ5_1>(o, ldo, xp, w, m, k, n);
    case kQ8_0: return gguf_linear_kernel<kQ8_0>(o, ldo, xp, w, m, k, n);
    case kQ4_K: return gguf_linear_kernel<kQ4_K>(o, ldo, xp, w, m, k, n);
    case kQ5_K: return gguf_linear_kernel<kQ5_K>(o, ldo, xp, w, m, k, n);
    default: return gguf_linear_kernel<kQ6_K>(o, ldo, xp, w, m, k, n);
  }
}

// ---- GGUF blocks against int8 activations (activation_quantization="int8", llama.cpp's way) -
// The exact path above widens every weight to fp32. llama.cpp instead rounds each row of x to
// int8 in blocks of 32 (its Q8_1) and multiplies the weights' small integers by x's in integer
// arithmetic, applying the two scales once a block. With w = dw_b * q + c_b in block b of 32
// elements (c_b: Q4_1's and Q5_1's m, Q4_0's -8 dw, Q5_0's -16 dw, Q4_K's and Q5_K's
// -(dmin * mn) of the sub-block, Q8_0's 0; the Q5 types' q has its fifth bit put in, 0..31;
// Q6_K: q - 32 signed, c_b 0, and dw_b its sub-block's d * sc, one for lanes 0-3 and one
// for 4-7, the block's two sub-blocks of 16) and x ~ dx_b * qx:
//     x . w  ~  sum_b (dw_b dx_b) (q . qx)_b  +  sum_b c_b (dx_b sum(qx)_b)
// q . qx is exact in int32 (vpmaddubsw: unsigned q times signed qx, pairs summed into int16,
// at most 2 x 31 x 127; then vpmaddwd into int32: 4 elements a lane). Not exact against the
// dequantized model (x loses bits: chapter 21's accuracy table), but deterministic and
// batch-invariant: every (row of x, row of W) pair is summed the same way, in 8 fp32 lanes
// (lane l: elements 4l..4l+3 of each block, one FMA a block) summed by hsum8's fixed tree,
// plus the offsets summed in block order, whatever m and whichever tile or path computed
// the pair. AVX512 builds run the same 256-bit code; without AVX2 plain loops emulate the lanes.
// Measured (2026-12-03, 2-core AMD EPYC, AVX2, 2 threads, a noisy VM), against gguf_linear:
// one row of x, Q4_1 [3072 x 576] in cache 0.106 -> 0.059 ms, [576 x 1536] 0.050 -> 0.028,
// Q4_0 1.4x, Q4_K 1.2x, the Q8_0 head [49152 x 576] 1.2-1.3x (it streams from DRAM);
// SmolLM2's 121 matmuls of a batch-1 step on the file's weights 9.4 -> 6.8 ms; Q6_K (signed
// q, as Q8_0's: vpsignb) [3072 x 1024], [1024 x 3072], [8192 x 2048] 1.7-2.4x (1.5-1.9x at
// 2 rows, 0.7-1.1x from 8), Q4_K 1.5-1.8x (1.0-1.6x from 8 since row_scales, 0.5-0.9x
// before); Q5_0, Q5_1, Q5_K on the same three 1.8-2.2x (2 rows 1.8-2.1x, 8 rows 0.9-1.3x,
// 32 rows 0.7-1.2x). From 8 rows little gain otherwise (Q4_1 0.8-1.2x): a block pair costs
// vpmaddubsw, vpmaddwd, a conversion and an FMA per row of x, as many instructions as the
// fp32 path's four FMAs. panel_kernel (from 8 rows) unpacks the weights once a task instead
// of once per pair of x's rows: 1.1-1.6x the tile at 16-1024 rows, 110-153 GFLOP/s
// (Q4_1, Q8_0, Q4_K, Q6_K, the shapes above). Still no faster than linear_kernel's fp32
// FMAs (113-158 on widened weights at 16-1024 rows) on this Zen 3: the two integer multiplies hold
// its multiply pipes as long as the FMAs would (summing the pairs by shifts instead of
// vpmaddwd, or the scale products once per tile instead of once per pair, were slower).
namespace a8 {

constexpr int64_t kQK = 32;

// One row of x: qx = round_half_even(x * (1 / dx)) int8 [k], and per block b the pair
// xs[2b] = dx = max |x| / 127, xs[2b + 1] = sx = dx * sum(qx) rounded once (qx = 0 where
// dx = 0).
inline void quantize_row(const float* x, int64_t k, int8_t* qx, float* xs) {
  for (int64_t b = 0; b < k / kQK; ++b) {
    const float* v = x + b * kQK;
    float amax = 0.f;
    for (int e = 0; e < kQK; ++e) amax = std::max(amax, std::fabs(v[e]));
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    int32_t sum = 0;
#if defined(__AVX2__)
    const __m256 s = _mm256_set1_ps(id);
    __m256i q[4];
    for (int t = 0; t < 4; ++t) q[t] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * t), s));  // RNE
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes),
                       _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
    for (int l = 0; l < 8; ++l) sum += lanes[l];
    // int32 -> int8 in order: the packs interleave 128-bit halves, the permute undoes it
    const __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qx + b * kQK),
                        _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
    for (int e = 0; e < kQK; ++e) {
      const int32_t q = static_cast<int32_t>(std::nearbyint(v[e] * id));
      qx[b * kQK + e] = static_cast<int8_t>(q);
      sum += q;
    }
#endif
    xs[2 * b] = d;
    xs[2 * b + 1] = d * static_cast<float>(sum);
  }
}

inline float hsum8(const float* a) {                     // a fixed tree: (l + l+4), then pairs
  const float h0 = a[0] + a[4], h1 = a[1] + a[5], h2 = a[2] + a[6], h3 = a[3] + a[7];
  return (h0 + h2) + (h1 + h3);
}

template <int64_t Q>
constexpr bool kSigned = Q == ggml::kQ8_0 || Q == ggml::kQ6_K;   // q signed (else unsigned, 0..31)

// The K-quants' scales come from their super-blocks, unpacked once per weight row and call
// (row_scales) into two floats per block of 32, kp[2b] and kp[2b + 1]: Q4_K's (d * sc,
// -(dmin * mn)) of sub-block b (KBlock), Q6_K's d * sc of its sub-blocks 2b and 2b + 1
// (Q6Block). Unpacked again for every pair of x's rows, as they were, they cost Q4_K up to
// half its speed from 8 rows (measured, two runs: [3072 x 1024] m = 8 1.17 / 1.25 -> 0.69 /
// 0.85 ms, m = 32 4.67 / 4.22 -> 2.65 / 3.26; [1024 x 3072] m = 32 4.51 / 4.35 -> 2.58 / 1.57).
template <int64_t Q>
constexpr bool kUnpacked = Q == ggml::kQ4_K || Q == ggml::kQ5_K || Q == ggml::kQ6_K;

template <int64_t Q>
inline void row_scales(const uint8_t* row, int64_t blocks, float* kp) {
  using namespace ggml;
  for (int64_t s = 0; s < blocks / 8; ++s) {
    if constexpr (Q == kQ4_K || Q == kQ5_K) {
      const KBlock<Q> blk(row + s * kBytes<Q>);
      for (int i = 0; i < 8; ++i) kp[16 * s + 2 * i] = blk.ds[i], kp[16 * s + 2 * i + 1] = blk.ndm[i];
    } else {
      std::memcpy(kp + 16 * s, Q6Block(row + s * kBytes<kQ6_K>).ds, 16 * sizeof(float));
    }
  }
}

// A weight row's block b (of 32 elements): its scale and offset (dw, c), and its q in element
// order (kp: the row's row_scales, for the K-quants).
template <int64_t Q>
inline void scale_pair(const uint8_t* row, int64_t b, const float* kp, float& dw, float& c) {
  using namespace ggml;
  if constexpr (kUnpacked<Q>) {
    dw = kp[2 * b], c = Q == kQ6_K ? 0.f : kp[2 * b + 1];   // Q6_K's second scale: its lanes 4-7
  } else {
    const uint8_t* p = row + b * kBytes<Q>;
    dw = half_at(p);
    c = Q == kQ4_1 || Q == kQ5_1 ? half_at(p + 2) : Q == kQ4_0 ? -8.f * dw : Q == kQ5_0 ? -16.f * dw : 0.f;
  }
}

template <int64_t Q>
inline int32_t quant_at(const uint8_t* row, int64_t b, int e) {
  using namespace ggml;
  if constexpr (Q == kQ8_0) return static_cast<int8_t>(row[b * 34 + 2 + e]);
  if constexpr (Q == kQ6_K) {                            // Q6Block::widen's bits, minus 32
    const uint8_t* blk = row + (b / 8) * kBytes<kQ6_K>;
    const int g = (b % 8) / 4, i = 32 * (b % 4) + e;     // element i of its group of 128
    const int lo = (blk[64 * g + i % 64] >> (i >= 64 ? 4 : 0)) & 0xF;
    return (lo | ((blk[128 + 32 * g + i % 32] >> (2 * (i / 32))) & 3) << 4) - 32;
  }
  if constexpr (Q == kQ4_K || Q == kQ5_K) {
    const uint8_t* blk = row + (b / 8) * kBytes<Q>;
    const uint8_t byte = blk[(Q == kQ5_K ? 48 : 16) + 32 * ((b % 8) / 2) + e];
    const int q = b % 2 ? byte >> 4 : byte & 0xF;
    return Q == kQ5_K ? q | ((blk[16 + e] >> (b % 8)) & 1) << 4 : q;   // bit b % 8 of qh byte e
  }
  const uint8_t* blk = row + b * kBytes<Q>;
  const uint8_t byte = blk[Block<Q>::kHead + e % 16];
  const int q = e < 16 ? byte & 0xF : byte >> 4;
  if constexpr (Q == kQ5_0 || Q == kQ5_1) {              // the fifth bit: bit e of the word before qs
    uint32_t qh;
    std::memcpy(&qh, blk + Block<Q>::kHead - 4, 4);
    return q | ((qh >> e) & 1) << 4;
  }
  return q;
}

#if defined(__AVX2__)
template <int64_t Q>
inline __m128 scale_pair(const uint8_t* row, int64_t b, const float* kp) {   // (dw, c, 0, 0)
  using namespace ggml;
  if constexpr (Q == kQ4_K || Q == kQ5_K) {
    return _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(kp + 2 * b)));
  } else {
    const uint8_t* p = row + b * kBytes<Q>;
    if constexpr (Q == kQ4_1 || Q == kQ5_1) {            // d and m side by side: one conversion
      int32_t dm;
      std::memcpy(&dm, p, 4);
      return _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
    }
    uint16_t d;
    std::memcpy(&d, p, 2);
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(d));      // (d, 0, 0, 0)
    if constexpr (Q == kQ4_0) return _mm_mul_ps(_mm_moveldup_ps(f), _mm_setr_ps(1.f, -8.f, 0.f, 0.f));
    if constexpr (Q == kQ5_0) return _mm_mul_ps(_mm_moveldup_ps(f), _mm_setr_ps(1.f, -16.f, 0.f, 0.f));
    return f;
  }
}

template <int64_t Q>
inline __m256i quants(const uint8_t* row, int64_t b) {
  using namespace ggml;
  if constexpr (Q == kQ8_0) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * 34 + 2));
  const __m256i low = _mm256_set1_epi8(0xF);
  if constexpr (Q == kQ6_K) {                            // quant_at's bytes, 32 at once, as int8
    const uint8_t* blk = row + (b / 8) * kBytes<kQ6_K>;
    const int g = (b % 8) / 4, i = 32 * (b % 4);
    const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * g + i % 64));
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * g));
    const __m256i lo = _mm256_and_si256(i >= 64 ? _mm256_srli_epi16(l, 4) : l, low);
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * (i / 32))), _mm256_set1_epi8(3));
    return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
  }
  if constexpr (Q == kQ4_K || Q == kQ5_K) {              // 32 bytes: sub-block 2g in low nibbles, 2g+1 high
    const uint8_t* blk = row + (b / 8) * kBytes<Q>;
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + (Q == kQ5_K ? 48 : 16) + 32 * ((b % 8) / 2)));
    const __m256i q = _mm256_and_si256(b % 2 ? _mm256_srli_epi16(v, 4) : v, low);
    if constexpr (Q == kQ4_K) return q;
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));   // bit b % 8 of byte e
    const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(b % 8)), _mm256_set1_epi8(1));
    return _mm256_or_si256(q, _mm256_slli_epi16(bit, 4));
  }
  const uint8_t* blk = row + b * kBytes<Q>;
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + Block<Q>::kHead));
  const __m256i q = _mm256_and_si256(_mm256_setr_m128i(v, _mm_srli_epi16(v, 4)), low);   // elements 0-15, 16-31
  if constexpr (Q == kQ5_0 || Q == kQ5_1) {
    // the fifth bits: bit e of the word qh into byte e as 16. Byte e first gets qh's byte
    // e / 8 (a shuffle within each 128-bit half, where the word repeats), then keeps bit e % 8
    int32_t qh;
    std::memcpy(&qh, blk + Block<Q>::kHead - 4, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(qh),
                                               _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                                                  0x0303030303030303));
    const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
    return _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(16)));
  }
  return q;
}

// Q6_K's weight scales of block b by lane: d * sc of its first 16 weights in lanes 0-3 (each
// lane sums 4 products), of the next 16 in lanes 4-7 (kp: the row's row_scales).
inline __m256 lane_scales(const float* kp, int64_t b) {
  return _mm256_setr_m128(_mm_set1_ps(kp[2 * b]), _mm_set1_ps(kp[2 * b + 1]));
}

template <int64_t Q>
inline __m256 block_dot(__m256i q, __m256i qx) {         // 8 lanes, each 4 products summed, as fp32
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i p;
  if constexpr (kSigned<Q>) p = _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(qx, q));
  else p = _mm256_maddubs_epi16(q, qx);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
}
#endif

// res[r][c] = x_r . w_c for R quantized rows of x (qx, their pairs xs) and 4 weight rows
// (kp: their row_scales for the K-quants).
// Per block b: t = dw * dx and o = c * sx, each rounded once; lane l of the pair's 8 gets
// fma(q . qx over elements 4l..4l+3, t, lane); off += o in block order. Result: hsum8(lanes)
// + off.
template <int64_t Q, int R>
inline void tile(const int8_t* const* qx, const float* const* xs, const uint8_t* const* ws, const float* const* kp,
                 int64_t blocks, int64_t ahead, float (&res)[4][4]) {
  alignas(32) float lanes[R][4][8];
  float off[R][4];
#if defined(__AVX2__)
  __m256 acc[R][4];
  __m128 oacc[4];                                        // rows r's o in lane 2r + 1
  for (int c = 0; c < 4; ++c) {
    oacc[c] = _mm_setzero_ps();
    for (int r = 0; r < R; ++r) acc[r][c] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < blocks; ++b) {
    for (int c = 0; c < 4; ++c)                          // the next rows of W follow in memory
      _mm_prefetch(reinterpret_cast<const char*>(ws[c] + ahead + b * ggml::kBytes<Q> * kQK / ggml::kWeights<Q>),
                   _MM_HINT_T0);
    __m256i xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx[r] + b * kQK));
    __m128 xp = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(xs[0] + 2 * b)));   // (dx, sx) of each row
    if constexpr (R == 2) xp = _mm_movelh_ps(xp, _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(xs[1] + 2 * b))));
    for (int c = 0; c < 4; ++c) {
      if constexpr (Q == ggml::kQ6_K) {                  // a scale per lane (t = (d * sc) * dx), no offset
        const __m256i q = quants<Q>(ws[c], b);
        const __m256 sw = lane_scales(kp[c], b);
        for (int r = 0; r < R; ++r)
          acc[r][c] = _mm256_fmadd_ps(block_dot<Q>(q, xv[r]), _mm256_mul_ps(sw, _mm256_broadcast_ss(xs[r] + 2 * b)),
                                      acc[r][c]);
        continue;
      }
      const __m128 f = scale_pair<Q>(ws[c], b, kp[c]);
      const __m128 prod = _mm_mul_ps(R == 2 ? _mm_movelh_ps(f, f) : f, xp);   // (t, o) of each row
      oacc[c] = _mm_add_ps(oacc[c], prod);
      const __m256i q = quants<Q>(ws[c], b);
      acc[0][c] = _mm256_fmadd_ps(block_dot<Q>(q, xv[0]), _mm256_broadcastss_ps(prod), acc[0][c]);
      if constexpr (R == 2)
        acc[1][c] = _mm256_fmadd_ps(block_dot<Q>(q, xv[1]), _mm256_broadcastss_ps(_mm_movehl_ps(prod, prod)), acc[1][c]);
    }
  }
  for (int c = 0; c < 4; ++c) {
    alignas(16) float o[4];
    _mm_store_ps(o, oacc[c]);
    for (int r = 0; r < R; ++r) _mm256_store_ps(lanes[r][c], acc[r][c]), off[r][c] = o[2 * r + 1];
  }
#else
  (void)ahead;
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) {
      for (int l = 0; l < 8; ++l) lanes[r][c][l] = 0.f;
      off[r][c] = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        float dw, cw;
        scale_pair<Q>(ws[c], b, kp[c], dw, cw);
        const float t = dw * xs[r][2 * b];
        off[r][c] += cw * xs[r][2 * b + 1];
        for (int l = 0; l < 8; ++l) {
          int32_t s = 0;
          for (int e = 4 * l; e < 4 * l + 4; ++e) s += quant_at<Q>(ws[c], b, e) * qx[r][b * kQK + e];
          const float tl = Q == ggml::kQ6_K && l >= 4 ? kp[c][2 * b + 1] * xs[r][2 * b] : t;
          lanes[r][c][l] = std::fma(static_cast<float>(s), tl, lanes[r][c][l]);
        }
      }
    }
#endif
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) res[r][c] = hsum8(lanes[r][c]) + off[r][c];
}

#if defined(__AVX2__)
// Many rows of x (prefill, large batches): tile re-extracts a block's quants (quants<Q>) and
// scales (scale_pair<Q>) for every pair of x's rows, as many instructions as its integer
// products. From kPanelFrom rows a task instead unpacks its 32 weight rows once into a panel
// (unpack: per block the 32 quant bytes quants<Q> returns, then two floats, scale_pair's
// (dw, c), Q6_K's two lane scales), and panel_tile multiplies 4 rows of x by 2 panel rows
// at a time. Each (row of x, row of W) pair gets tile's operations, in tile's order, on the
// same values (t = dw * dx and o = c * sx each rounded once, the FMA into 8 lanes, o added
// in block order), so the same bits whichever path ran it: batch invariance holds across
// the switch (tests/layers/test_gguf_a8.py).
constexpr int64_t kPanelFrom = 8;

template <int64_t Q>
constexpr bool kOffset = Q != ggml::kQ8_0 && Q != ggml::kQ6_K;   // c_b != 0

// One weight row into the panel: quants [blocks * 32] bytes, scales [blocks * 2] floats
// (kp: scratch for row_scales, 2 * blocks floats).
template <int64_t Q>
inline void unpack(const uint8_t* row, int64_t blocks, float* kp, int8_t* quant, float* scales) {
  if constexpr (kUnpacked<Q>) row_scales<Q>(row, blocks, kp);
  for (int64_t b = 0; b < blocks; ++b) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(quant + b * kQK), quants<Q>(row, b));
    if constexpr (Q == ggml::kQ6_K) scales[2 * b] = kp[2 * b], scales[2 * b + 1] = kp[2 * b + 1];
    else _mm_storel_pi(reinterpret_cast<__m64*>(scales + 2 * b), scale_pair<Q>(row, b, kp));
  }
}

// res[r][c] = x_r . w_c for R rows of x and 2 panel rows (wq: quants, wsc: scales).
template <int64_t Q, int R>
inline void panel_tile(const int8_t* const* qx, const float* const* xs, const int8_t* const* wq,
                       const float* const* wsc, int64_t blocks, float (&res)[4][2]) {
  __m256 acc[R][2];
  __m256 oacc = _mm256_setzero_ps();                     // lane 4c + r: o of row r, panel row c
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 sw[2];                                        // the weight scale by lane
    for (int c = 0; c < 2; ++c) {
      const float* s = wsc[c] + 2 * b;
      if constexpr (Q == ggml::kQ6_K) sw[c] = _mm256_setr_m128(_mm_broadcast_ss(s), _mm_broadcast_ss(s + 1));
      else sw[c] = _mm256_broadcast_ss(s);
    }
    if constexpr (kOffset<Q>) {
      const __m128 sx = _mm_setr_ps(xs[0][2 * b + 1], xs[R > 1 ? 1 : 0][2 * b + 1], xs[R > 2 ? 2 : 0][2 * b + 1],
                                    xs[R > 3 ? 3 : 0][2 * b + 1]);
      const __m256 cw = _mm256_setr_m128(_mm_broadcast_ss(wsc[0] + 2 * b + 1), _mm_broadcast_ss(wsc[1] + 2 * b + 1));
      __m256 o = _mm256_mul_ps(cw, _mm256_setr_m128(sx, sx));
      asm("" : "+x"(o));                                 // o rounded: not contracted into an FMA
      oacc = _mm256_add_ps(oacc, o);
    }
    for (int c = 0; c < 2; ++c) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq[c] + b * kQK));
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx[r] + b * kQK));
        acc[r][c] = _mm256_fmadd_ps(block_dot<Q>(q, xv), _mm256_mul_ps(sw[c], _mm256_broadcast_ss(xs[r] + 2 * b)),
                                    acc[r][c]);
      }
    }
  }
  alignas(32) float lanes[8], off[8];
  _mm256_store_ps(off, oacc);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 2; ++c) {
      _mm256_store_ps(lanes, acc[r][c]);
      res[r][c] = hsum8(lanes) + off[4 * c + r];
    }
}

// out's rows [0, m) (rows ldo apart) against the quantized rows of x (qxp, xsp as kernel
// rounds them): tasks of 32 weight rows, each unpacked once.
template <int64_t Q>
void panel_kernel(float* out, int64_t ldo, const int8_t* qxp, const float* xsp, const uint8_t* w, int64_t m,
                  int64_t k, int64_t n) {
  constexpr int64_t kRowsPerTask = 32;
  const int64_t blocks = k / kQK, row_bytes = k / ggml::kWeights<Q> * ggml::kBytes<Q>;
  at::parallel_for(0, (n + kRowsPerTask - 1) / kRowsPerTask, 1, [&](int64_t begin, int64_t end) {
    std::vector<int8_t> quant(kRowsPerTask * k);
    std::vector<float> scales(kRowsPerTask * 2 * blocks), kp(2 * blocks);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t j0 = task * kRowsPerTask, j1 = std::min(n, j0 + kRowsPerTask);
      for (int64_t j = j0; j < j1; ++j)
        unpack<Q>(w + j * row_bytes, blocks, kp.data(), quant.data() + (j - j0) * k, scales.data() + (j - j0) * 2 * blocks);
      for (int64_t i = 0; i < m; i += 4) {
        const int64_t rows = std::min<int64_t>(4, m - i);
        const int8_t* xq[4];
        const float* xp[4];
        for (int r = 0; r < 4; ++r) {
          const int64_t row = std::min(i + r, m - 1);
          xq[r] = qxp + row * k, xp[r] = xsp + row * 2 * blocks;
        }
        for (int64_t j = j0; j < j1; j += 2) {
          const int8_t* wq[2];                           // an odd last row is taken twice
          const float* wsc[2];
          for (int c = 0; c < 2; ++c) {
            const int64_t p = std::min(j + c, j1 - 1) - j0;
            wq[c] = quant.data() + p * k, wsc[c] = scales.data() + p * 2 * blocks;
          }
          float res[4][2];
          switch (rows) {
            case 1: panel_tile<Q, 1>(xq, xp, wq, wsc, blocks, res); break;
            case 2: panel_tile<Q, 2>(xq, xp, wq, wsc, blocks, res); break;
            case 3: panel_tile<Q, 3>(xq, xp, wq, wsc, blocks, res); break;
            default: panel_tile<Q, 4>(xq, xp, wq, wsc, blocks, res);
          }
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < 2 && j + c < j1; ++c) out[(i + r) * ldo + j + c] = res[r][c];
        }
      }
    }
  });
}
#endif

// out [m, n] (rows ldo apart) = x [m, k] . W^T, x rounded to int8 blocks first. Tasks of 32
// weight rows; in a task 4 weight rows at a time against every row of x, 2 at a time.
template <int64_t Q>
void kernel(float* out, int64_t ldo, const float* x, const uint8_t* w, int64_t m, int64_t k, int64_t n) {
  constexpr int64_t kRowsPerTask = 32, kR = 2;
  const int64_t blocks = k / kQK, row_bytes = k / ggml::kWeights<Q> * ggml::kBytes<Q>;
  // grow-only, per calling thread: a prefill's rows are megabytes, and fresh pages cost
  // more than the rounding (widened's comment)
  thread_local std::vector<int8_t> qx;
  thread_local std::vector<float> xs;
  if (static_cast<int64_t>(qx.size()) < m * k) qx.resize(m * k);
  if (static_cast<int64_t>(xs.size()) < m * 2 * blocks) xs.resize(m * 2 * blocks);
  int8_t* const qxp = qx.data();                         // the lambdas run on other threads, which
  float* const xsp = xs.data();                          // have thread_locals of their own
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) quantize_row(x + i * k, k, qxp + i * k, xsp + i * 2 * blocks);
  });
#if defined(__AVX2__)
  if (m >= kPanelFrom) return panel_kernel<Q>(out, ldo, qxp, xsp, w, m, k, n);
#endif
  at::parallel_for(0, (n + kRowsPerTask - 1) / kRowsPerTask, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scales(kUnpacked<Q> ? 4 * 2 * blocks : 0);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t j0 = task * kRowsPerTask, j1 = std::min(n, j0 + kRowsPerTask);
      for (int64_t j = j0; j < j1; j += 4) {
        const uint8_t* ws[4];                            // a short group repeats its last row
        const float* kp[4] = {nullptr, nullptr, nullptr, nullptr};
        for (int c = 0; c < 4; ++c) {
          ws[c] = w + std::min(j + c, j1 - 1) * row_bytes;
          if constexpr (kUnpacked<Q>) {
            float* row = scales.data() + c * 2 * blocks;
            row_scales<Q>(ws[c], blocks, row);
            kp[c] = row;
          }
        }
        for (int64_t i = 0; i < m; i += kR) {
          const int64_t rows = std::min(kR, m - i);
          const int8_t* xq[kR];
          const float* xp[kR];
          for (int r = 0; r < kR; ++r) {
            const int64_t row = std::min(i + r, m - 1);
            xq[r] = qxp + row * k, xp[r] = xsp + row * 2 * blocks;
          }
          float res[4][4];
          if (rows == 1) tile<Q, 1>(xq, xp, ws, kp, blocks, 4 * row_bytes, res);
          else tile<Q, 2>(xq, xp, ws, kp, blocks, 4 * row_bytes, res);
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < 4 && j + c < j1; ++c) out[(i + r) * ldo + j + c] = res[r][c];
        }
      }
    }
  });
}

}  // namespace a8

// gguf_linear with x rounded to int8 blocks (a8's comment), every block format. Shapes as
// gguf_linear's.
void gguf_linear_a8(torch::Tensor out, const torch::Tensor& x, const torch::Tensor& qweight, int64_t qtype) {
  using namespace ggml;
  const auto [qk, bytes] = geometry(qtype);
  TORCH_CHECK(qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ5_0 || qtype == kQ5_1 || qtype == kQ8_0 ||
                  qtype == kQ4_K || qtype == kQ5_K || qtype == kQ6_K,
              "gguf_linear_a8: GGML type ", qtype, " is not supported (Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, "
              "Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14)");
  check_gguf_args("gguf_linear_a8", out, x, qweight, qk, bytes);
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0);
  if (m == 0 || n == 0) return;
  float* o = out.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  const int64_t ldo = out.stride(0);
  switch (qtype) {
    case kQ4_0: return a8::kernel<kQ4_0>(o, ldo, xp, w, m, k, n);
    case kQ4_1: return a8::kernel<kQ4_1>(o, ldo, xp, w, m, k, n);
    case kQ5_0: return a8::kernel<kQ5_0>(o, ldo, xp, w, m, k, n);
    case kQ5_1: return a8::kernel<kQ5_1>(o, ldo, xp, w, m, k, n);
    case kQ8_0: return a8::kernel<kQ8_0>(o, ldo, xp, w, m, k, n);
    case kQ5_K: return a8::kernel<kQ5_K>(o, ldo, xp, w, m, k, n);
    case kQ6_K: return a8::kernel<kQ6_K>(o, ldo, xp, w, m, k, n);
    default: return a8::kernel<kQ4_K>(o, ldo, xp, w, m, k, n);
  }
}

// x [m, k] fp32 -> (qx int8 [m, k], dx [m, k / 32], sx [m, k / 32]): the rows gguf_linear_a8
// multiplies (a8::quantize_row), for tests and the reference.
std::vector<torch::Tensor> quantize_activations_a8(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat && x.device().is_cpu() &&
              x.size(1) % 32 == 0, "quantize_activations_a8: x must be contiguous float32 [m, k] on the CPU with "
              "k a multiple of 32, got ", x.scalar_type(), " ", x.sizes());
  const int64_t m = x.size(0), k = x.size(1);
  auto qx = torch::empty({m, k}, torch::kChar);
  auto xs = torch::empty({m, k / 32, 2}, torch::kFloat);
  for (int64_t i = 0; i < m; ++i)
    a8::quantize_row(x.data_ptr<float>() + i * k, k, qx.data_ptr<int8_t>() + i * k, xs.data_ptr<float>() + i * (k / 16));
  return {qx, xs.select(2, 0).contiguous(), xs.select(2, 1).contiguous()};
}

// ---- int8 weights, one fp32 scale per output row: y = x (q * scale)^T ---------------------
// quantization="int8" (nanopaged/layers/quantization/int8.py): W [n, k] stored as int8 q and
// scale [n] fp32, w = q * scale. Each vector of q is widened to fp32 and multiplied by its
// row's scale (one rounding, as q.float() * scale in PyTorch), then fed to linear_kernel's
// FMAs in linear_kernel's order: the fp32 matmul on the dequantized weights, bit for bit
// (batch-invariant), reading 1 byte a weight where fp32 reads 4.
namespace i8 {

// kLanes int8 from p (n of them when n < kLanes, zeros after), widened and scaled.
inline mm::vec dequant(const int8_t* p, int64_t n, float scale) {
  using namespace mm;
#if defined(__AVX512F__)
  const __m128i q = n >= kLanes ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))
                                : _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << n) - 1), p);
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), vset1(scale));
#elif defined(__AVX2__)
  __m128i q;
  if (n >= kLanes) {
    q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  } else {                                              // a tail: through a zeroed buffer
    alignas(16) int8_t buf[16] = {};
    std::memcpy(buf, p, n);
    q = _mm_load_si128(reinterpret_cast<const __m128i*>(buf));
  }
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), vset1(scale));
#else
  (void)n;
  return static_cast<float>(*p) * scale;
#endif
}

// res[r][c] = x_r . w_c for R rows of x and 4 int8 weight rows: dot_tile's loop.
template <int R>
inline void qdot_tile(const float* const* xs, const int8_t* const* ws, const float* scales, int64_t k,
                      float (&res)[4][4]) {
  using namespace mm;
  vec acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = vzero();
  for (int64_t d = 0; d < k; d += kLanes) {
    const int64_t left = k - d;
#if defined(__AVX2__) || defined(__AVX512F__)
    if (d % 64 == 0)                                    // the next 4 rows follow in memory
      for (int c = 0; c < 4; ++c) _mm_prefetch(reinterpret_cast<const char*>(ws[c] + 4 * k + d), _MM_HINT_T0);
#endif
    vec w[4];
    for (int c = 0; c < 4; ++c) w[c] = dequant(ws[c] + d, left, scales[c]);
    for (int r = 0; r < R; ++r) {
      const vec xv = vload(xs[r] + d, left);
      for (int c = 0; c < 4; ++c) acc[r][c] = vfma(xv, w[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) res[r][c] = vsum(acc[r][c]);
}

// linear_kernel's tiling over int8 rows.
void int8_linear_kernel(float* out, const float* x, const int8_t* w, const float* scale, int64_t m, int64_t k,
                        int64_t n) {
  constexpr int64_t kRowsPerTask = 32;
  constexpr int64_t kTileRows = mm::kLanes >= 16 ? 4 : 2;
  // many rows of x: the matrix widened once (widened::linear; measured 2026-12-03, 2-core AMD
  // EPYC, AVX2, 2 threads, [3072 x 576]: m = 64 2.65 -> 2.03 ms, m = 512 20.0 -> 15.6; the
  // fp32 matmul on q * scale 1.85 and 15.7)
  constexpr int64_t kWholeFrom = 16;   // timed hot only (the cold timings: gguf_linear_kernel, GGUF)
  if (widened::linear(out, n, x, m, k, n, kWholeFrom, [&](float* wide, int64_t begin, int64_t end) {
        using mm::kLanes;
        for (int64_t j = begin; j < end; ++j) {
          float* row = wide + j * k;
          int64_t d = 0;
          for (; d + kLanes <= k; d += kLanes) mm::vstore(row + d, dequant(w + j * k + d, kLanes, scale[j]), kLanes);
          if (d < k) mm::vstore(row + d, dequant(w + j * k + d, k - d, scale[j]), k - d);
        }
      }))
    return;
  const int64_t chunk = std::max<int64_t>(kTileRows, (256 * 1024 / (k * sizeof(float))) / kTileRows * kTileRows);
  at::parallel_for(0, (n + kRowsPerTask - 1) / kRowsPerTask, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i0 = 0; i0 < m; i0 += chunk)
    for (int64_t task = begin; task < end; ++task) {
      const int64_t j0 = task * kRowsPerTask, j1 = std::min(n, j0 + kRowsPerTask);
      for (int64_t i = i0; i < std::min(m, i0 + chunk); i += kTileRows) {
        const int64_t rows = std::min<int64_t>(kTileRows, m - i);
        const float* xs[4];
        for (int r = 0; r < 4; ++r) xs[r] = x + std::min(i + r, m - 1) * k;
        for (int64_t j = j0; j < j1; j += 4) {
          const int8_t* ws[4];                          // a short group repeats its last row
          float scales[4];
          for (int c = 0; c < 4; ++c) {
            const int64_t row = std::min(j + c, j1 - 1);
            ws[c] = w + row * k, scales[c] = scale[row];
          }
          float res[4][4];
          switch (rows) {
            case 1: qdot_tile<1>(xs, ws, scales, k, res); break;
            case 2: qdot_tile<2>(xs, ws, scales, k, res); break;
            case 3: qdot_tile<3>(xs, ws, scales, k, res); break;
            default: qdot_tile<4>(xs, ws, scales, k, res);
          }
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < 4 && j + c < j1; ++c) out[(i + r) * n + j + c] = res[r][c];
        }
      }
    }
  });
}

}  // namespace i8

// out [m, n] fp32 contiguous = x [m, k] fp32 @ (qweight * scale[:, None])^T, qweight [n, k]
// int8 and scale [n] fp32, all contiguous on the CPU.
void int8_linear(torch::Tensor out, const torch::Tensor& x, const torch::Tensor& qweight,
                 const torch::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat && x.device().is_cpu(),
              "int8_linear: x must be contiguous float32 [m, k] on the CPU, got ", x.scalar_type(), " ", x.sizes());
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0);
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.scalar_type() == torch::kChar &&
              qweight.device().is_cpu() && qweight.size(1) == k, "int8_linear: qweight must be contiguous int8 "
              "[n, ", k, "] on the CPU, got ", qweight.scalar_type(), " ", qweight.sizes());
  TORCH_CHECK(scale.dim() == 1 && scale.is_contiguous() && scale.scalar_type() == torch::kFloat &&
              scale.device().is_cpu() && scale.size(0) == n, "int8_linear: scale must be contiguous float32 [",
              n, "], got ", scale.scalar_type(), " ", scale.sizes());
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == torch::kFloat && out.size(0) == m &&
              out.size(1) == n, "int8_linear: out must be contiguous float32 [", m, ", ", n, "], got ",
              out.scalar_type(), " ", out.sizes());
  if (m == 0 || n == 0) return;
  i8::int8_linear_kernel(out.data_ptr<float>(), x.data_ptr<float>(), qweight.data_ptr<int8_t>(),
                         scale.data_ptr<float>(), m, k, n);
}

// What this build compiled in: the vector body of namespace mm, and the special paths.
// VNNI (vpdpbusd) is in no body: gguf_linear_a8 multiplies int8 with AVX2's vpmaddubsw.
pybind11::dict build_info() {
  pybind11::dict info;
#if defined(__AVX512F__)
  info["vector"] = "avx512";
#elif defined(__AVX2__)
  info["vector"] = "avx2";
#else
  info["vector"] = "portable";
#endif
  info["lanes"] = mm::kLanes;
#if defined(__AVX512BF16__)
  info["avx512_bf16"] = true;
#else
  info["avx512_bf16"] = false;
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  info["amx"] = true;
#else
  info["amx"] = false;
#endif
  info["vnni"] = false;
  return info;
}

// calls per path since the module loaded: {"vector", "avx512_bf16", "amx"}
pybind11::dict path_counts() {
  pybind11::dict counts;
  counts["vector"] = paths::calls[paths::kVector].load();
  counts["avx512_bf16"] = paths::calls[paths::kAvx512Bf16].load();
  counts["amx"] = paths::calls[paths::kAmx].load();
  return counts;
}

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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("build_info", &build_info, "What this build compiled in: its vector body and special paths");
  m.def("path_counts", &path_counts, "Calls per instruction-set path since the module loaded");
  m.def("paged_attention", &Counted<&paged_attention>::call,
        "Causal paged attention, prefill and decode rows (CPU)");
  m.def("paged_attention_decode", &Counted<&paged_attention_decode>::call, "Paged attention for decode (CPU)");
  m.def("reshape_and_cache", &Counted<&reshape_and_cache>::call, "Write K/V rows to their slots (CPU)");
  m.def("copy_blocks", &Counted<&copy_blocks>::call, "Copy KV blocks within the pool (copy-on-write, CPU)");
  m.def("swap_blocks", &Counted<&swap_blocks>::call, "Copy KV blocks between two pools (swap, CPU)");
  m.def("linear", &Counted<&linear>::call, "x W^T, batch-invariant, fp32 or bf16 (CPU)");
  m.def("gguf_linear", &Counted<&gguf_linear>::call,
        "x W^T, W in a GGUF block format (Q8_0, Q4_0/1, Q5_0/1, Q4_K, Q5_K, Q6_K), fp32 (CPU)");
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  m.def("linear_amx", &Counted<&linear_amx>::call, "x W^T on AMX tiles, W packed, bf16 (CPU)");
#endif
  m.def("rms_norm", &Counted<&rms_norm>::call, "RMSNorm (CPU)");
  m.def("fused_add_rms_norm", &Counted<&fused_add_rms_norm>::call,
        "residual += x; x = RMSNorm(residual), in place (CPU)");
  m.def("silu_and_mul", &Counted<&silu_and_mul>::call, "silu(gate) * up (CPU)");
  m.def("rotary_embedding", &Counted<&rotary_embedding>::call, "RoPE in place on query and key (CPU)");
  m.def("gguf_linear_a8", &Counted<&gguf_linear_a8>::call, "x W^T, W in GGUF blocks (Q4-Q8, K-quants), x rounded "
        "to int8 blocks of 32 first (llama.cpp's Q8_1), fp32 out (CPU)");
  m.def("quantize_activations_a8", &Counted<&quantize_activations_a8>::call,
        "x -> int8 blocks of 32 and their scales (CPU)");
  m.def("int8_linear", &Counted<&int8_linear>::call, "x W^T, W int8 with a float32 scale per row, fp32 (CPU)");
}
