// GGUF's block formats (llama.cpp's ggml-quants) as the kernels read them, header-only:
// the type numbers and block sizes, and each format's block widened to fp32 vectors
// (Block, KBlock, Q6Block), shared by gguf.cpp and gguf_a8.cpp.
//
// A weight row of k values is k / QK blocks of QK weights, each fp16 scales and small
// integers q (the table in nanopaged/quantization/gguf.py):
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
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "../vec.h"

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
    // 2-byte insert and a conversion each, about a tenth of the one-row loop's micro-ops.
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
    // the loop below in lanes: unpacking the scales was a large share of a Q4_K matvec
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
