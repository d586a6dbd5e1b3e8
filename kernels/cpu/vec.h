// The SIMD layer every CPU kernel is written in (header-only): one vector of fp32 lanes
// (namespace mm: AVX512, AVX2 or one lane, by the flags the build passes, see
// nanopaged/layers/build.py), the fixed-order sums and max built on it, the fp32 <-> bf16
// conversions and the vectorizable exp. The kernels' batch invariance rests on this file:
// a sum's bits depend only on its inputs and length (chapters/05-llama.md, "Batch
// invariance"). vLLM: csrc/cpu/cpu_types_x86.hpp.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

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
  } else {                       // only a tail goes through a zeroed buffer (copying every load is slower)
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
// scalar chain of maxss). Max is exact, so any order agrees.
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

// fp32 <-> the cache's dtype in loops that vectorize. c10's bf16 conversion is scalar
// code (a branch for NaN), which keeps an `omp simd` loop such as silu_and_mul's scalar in
// bf16. The same rounding (to nearest even, NaN -> 0x7fc0) as bit operations, so every
// result keeps its bits.
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
