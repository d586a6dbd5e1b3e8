// GGUF blocks against int8 activations (activation_quantization="int8", llama.cpp's way):
// gguf_linear_a8.
//
// The exact path (gguf.cpp) widens every weight to fp32. llama.cpp instead rounds each row of x to
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
// From 8 rows of x it gains little over gguf_linear: a block pair costs vpmaddubsw,
// vpmaddwd, a conversion and an FMA per row of x, as many instructions as the fp32 path's
// four FMAs, and on Zen 3 the two integer multiplies hold the multiply pipes as long as the
// FMAs would. panel_kernel (from 8 rows) unpacks the weights once a task instead of once
// per pair of x's rows.

#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../vec.h"
#include "ggml.h"
#include "ops.h"

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
// (Q6Block). Unpacked again for every pair of x's rows they cost Q4_K up to half its speed
// from 8 rows.
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
// the switch (tests/quantization/test_gguf_a8.py).
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
  // more than the rounding (widened.h's comment)
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
