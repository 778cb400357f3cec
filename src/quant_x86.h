// Mat-mul kernels for x86 vector instruction sets, written once and compiled per set: included
// only by quant_avx2.cpp and quant_avx512.cpp, each built with its own -m flags. Everything here
// has internal linkage, so no copy compiled for one set can be linked into code built for another.
//
// Each output element is computed by one fixed sequence of operations whatever the tile shape
// and instruction set: each 32-element block's dot is an exact integer (the 8-bit dots' lanes of
// a pair of blocks, then a tree of horizontal adds that leaves four rows' or columns' whole-block
// sums in one vector), converted and fused with the product of the block scales into an even
// blocks' and an odd blocks' sum, in block order; the two sums added at the end. Register tiles
// only decide how many such sequences run side by side (a vector holds four of them), and the
// AVX512-VNNI dot gives the same integers as the AVX2 one, so both produce the same bits.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "quant.h"
#include "quant_impl.h"

namespace ggraph {
namespace quant_impl {
namespace {

constexpr int kQK = 32;

// Keeps a product from being fused into the addition that consumes it (-ffp-contract), so that
// every instantiation rounds it the same way.
inline __m256 materialize(__m256 v) {
#if defined(__AVX512F__)
  __asm__("" : "+v"(v));
#else
  __asm__("" : "+x"(v));
#endif
  return v;
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

#if defined(__AVX512F__)
// materialize for 512-bit registers.
inline __m512 materialize512(__m512 v) {
  __asm__("" : "+v"(v));
  return v;
}
#endif

// Sum of lanes 1, 3, 5 and 7: (l1 + l5) + (l3 + l7).
inline float odd_lane_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_shuffle_ps(s, s, 1));
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline __m256i load256(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

inline __m128i load128(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

// ----- 8-bit dot products ----------------------------------------------------------------------

// Both give, per 32-bit lane l, the exact sum of the 8 products u*s at bytes 4l..4l+3 of the
// first and of the second pair of operands (u unsigned, s signed).
struct DotAvx2 {
  static constexpr bool kWideSums = false;  // 16-bit pair sums: unsigned bytes up to 128 only
  static constexpr bool kSums16 = true;     // nibbles16 below, then block_sums16
  // u <= 15: each 16-bit sum is at most 4*15*127 = 7,620, so that 16-bit horizontal adds may
  // add four of them (block_sums16) before one widening, where each pair's sums widen alone.
  static __m256i nibbles16(__m256i ulo, __m256i slo, __m256i uhi, __m256i shi) {
    return _mm256_add_epi16(_mm256_maddubs_epi16(ulo, slo), _mm256_maddubs_epi16(uhi, shi));
  }
  // u <= 31: each 16-bit sum of two products is at most 2*31*127, so two of them still fit.
  static __m256i nibbles(__m256i ulo, __m256i slo, __m256i uhi, __m256i shi) {
    const __m256i p16 =
        _mm256_add_epi16(_mm256_maddubs_epi16(ulo, slo), _mm256_maddubs_epi16(uhi, shi));
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
  }
  // u <= 128: 2*128*127 fits 16 bits once, so each half widens to 32 bits on its own.
  static __m256i bytes(__m256i ulo, __m256i slo, __m256i uhi, __m256i shi) {
    const __m256i one = _mm256_set1_epi16(1);
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(ulo, slo), one),
                            _mm256_madd_epi16(_mm256_maddubs_epi16(uhi, shi), one));
  }
};

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
struct DotVnni {
  // 32-bit sums of any unsigned bytes: signed weights may ride as w + 128 (pair_step).
  static constexpr bool kWideSums = true;
  static constexpr bool kSums16 = false;  // one instruction gives the 32-bit sums already
  static __m256i nibbles(__m256i ulo, __m256i slo, __m256i uhi, __m256i shi) {
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), ulo, slo), uhi, shi);
  }
  static __m256i bytes(__m256i ulo, __m256i slo, __m256i uhi, __m256i shi) {
    return nibbles(ulo, slo, uhi, shi);
  }
  // The sums added to `start`.
  static __m256i biased(__m256i start, __m256i ulo, __m256i slo, __m256i uhi, __m256i shi) {
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(start, ulo, slo), uhi, shi);
  }
};
#endif

// ----- activations -----------------------------------------------------------------------------

void prepare_q8_x86(const float* x, void* dst, int64_t k) {
  const int64_t nb = k / kQK;
  uint8_t* q = static_cast<uint8_t*>(dst);
  std::memset(dst, 0, q8_act_size(k));
  float* ds = reinterpret_cast<float*>(q + 64 * act_pairs(k));
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  for (int64_t b = 0; b < nb; ++b, x += kQK) {
    __m256 v[4];
    __m256i amax = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + 8 * i);
      // Unsigned maximum of the magnitude bits: order-free, and NaN ranks above Inf.
      amax = _mm256_max_epu32(amax, _mm256_and_si256(_mm256_castps_si256(v[i]), abs_mask));
    }
    __m128i m4 = _mm_max_epu32(_mm256_castsi256_si128(amax), _mm256_extracti128_si256(amax, 1));
    m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0x4e));
    m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0xb1));
    const uint32_t amax_bits = static_cast<uint32_t>(_mm_cvtsi128_si32(m4));
    if (amax_bits >= 0x7f800000) {
      // A non-finite value makes the whole block NaN so that it shows in every dot it enters.
      ds[2 * b] = ds[2 * b + 1] = __builtin_nanf("");
      continue;
    }
    float amax_f;
    std::memcpy(&amax_f, &amax_bits, sizeof(amax_f));
    const __m256 id = _mm256_set1_ps(amax_f != 0.0f ? 127.0f / amax_f : 0.0f);
    __m256i qi[4];
    for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));
    const __m256i sum8 =
        _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    __m128i sum4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
    sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0x4e));
    sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0xb1));
    // Packing interleaves 128-bit lanes; the permute restores element order.
    const __m256i p8 =
        _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    const __m256i ordered =
        _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    uint8_t* pair = q + 64 * (b / 2) + 16 * (b % 2);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(pair), _mm256_castsi256_si128(ordered));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(pair + 32), _mm256_extracti128_si256(ordered, 1));
    const float d = amax_f / 127.0f;
    ds[2 * b] = d;
    ds[2 * b + 1] = d * static_cast<float>(_mm_cvtsi128_si32(sum4));
  }
}

void prepare_f32_x86(const float* x, void* dst, int64_t k) {
  std::memcpy(dst, x, static_cast<size_t>(k) * sizeof(float));
  std::memset(static_cast<float*>(dst) + k, 0, f32_act_size(k) - static_cast<size_t>(k) * 4);
}

// ----- decoders --------------------------------------------------------------------------------

// F16C converts exactly, NaN payloads included, as f16_to_f32 does.
void to_float_f16_x86(const void* blocks, float* dst, int64_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(blocks);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(load128(p + 2 * i)));
  for (; i < n; ++i) dst[i] = f16_to_f32(static_cast<const uint16_t*>(blocks)[i]);
}

// The F16C instruction rounds every number as f32_to_f16 does (test_quant's
// HalfFloat.F16MatchesTheF16cInstruction); a group of 8 with a NaN goes the scalar way, which
// fixes the NaN's bits.
void f16_from_float_x86(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(src + i);
    if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0) {
      for (int j = 0; j < 8; ++j) dst[i + j] = f32_to_f16(src[i + j]);
      continue;
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  for (; i < n; ++i) dst[i] = f32_to_f16(src[i]);
}

// Each value is one rounding of int8 * scale, as ggml's dequantize_row_q8_0.
void to_float_q8_0_x86(const void* blocks, float* dst, int64_t n_blocks) {
  const BlockQ8_0* b = static_cast<const BlockQ8_0*>(blocks);
  for (int64_t i = 0; i < n_blocks; ++i, dst += kQK) {
    const __m256 d = _mm256_set1_ps(f16_to_f32(b[i].d));
    for (int j = 0; j < kQK; j += 8) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b[i].qs + j));
      _mm256_storeu_ps(dst + j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d));
    }
  }
}

// ----- quantized weights -----------------------------------------------------------------------

enum class Fmt { kQ4_0, kQ4_1, kQ8_0, kQ5_0, kQ5_1, kIQ4_NL };

template <Fmt F>
struct Format {
  static constexpr size_t kBlock = F == Fmt::kQ4_0     ? 18
                                   : F == Fmt::kQ4_1   ? 20
                                   : F == Fmt::kQ5_0   ? 22
                                   : F == Fmt::kQ5_1   ? 24
                                   : F == Fmt::kIQ4_NL ? 18
                                                       : 34;
  // Offsets of the quants and of Q5's fifth bits in a block.
  static constexpr size_t kQs = F == Fmt::kQ4_1 ? 4 : F == Fmt::kQ5_0 ? 6 : F == Fmt::kQ5_1 ? 8 : 2;
  static constexpr size_t kQh = F == Fmt::kQ5_1 ? 4 : 2;
  static constexpr bool kFifthBit = F == Fmt::kQ5_0 || F == Fmt::kQ5_1;
  // Unsigned quants below 32 (the 4- and 5-bit formats) or signed bytes (Q8_0, IQ4_NL's levels).
  static constexpr bool kNibbles = F != Fmt::kQ8_0 && F != Fmt::kIQ4_NL;
  // Q4_0 counts as minimum -8 d and Q5_0 as -16 d; Q4_1 and Q5_1 store theirs.
  static constexpr bool kMin = kNibbles;
  static constexpr bool kStoredMin = F == Fmt::kQ4_1 || F == Fmt::kQ5_1;
};

// Scale and minimum of 4 consecutive blocks as [d0 m0 d1 m1 d2 m2 d3 m3]; blocks from nb on give
// zeros (b < nb). Q4_0's minimum is -8 d (exact); Q8_0's minimum lanes are unused.
template <Fmt F>
inline __m256 block_scales4(const uint8_t* row, int64_t b, int64_t nb) {
  constexpr size_t B = Format<F>::kBlock;
  const uint8_t* p = row + b * B;
  const int64_t left = nb - b;
  const __m128i zero = _mm_setzero_si128();
  const __m128i x0 = _mm_cvtsi32_si128(static_cast<int>(load_u32(p)));
  const __m128i x1 = left > 1 ? _mm_cvtsi32_si128(static_cast<int>(load_u32(p + B))) : zero;
  const __m128i x2 = left > 2 ? _mm_cvtsi32_si128(static_cast<int>(load_u32(p + 2 * B))) : zero;
  const __m128i x3 = left > 3 ? _mm_cvtsi32_si128(static_cast<int>(load_u32(p + 3 * B))) : zero;
  __m128i v = _mm_unpacklo_epi64(_mm_unpacklo_epi32(x0, x1), _mm_unpacklo_epi32(x2, x3));
  if (!Format<F>::kStoredMin) {
    v = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13));
  }
  __m256 f = _mm256_cvtph_ps(v);
  if (F == Fmt::kQ4_0) f = _mm256_mul_ps(f, _mm256_setr_ps(1, -8, 1, -8, 1, -8, 1, -8));
  if (F == Fmt::kQ5_0) f = _mm256_mul_ps(f, _mm256_setr_ps(1, -16, 1, -16, 1, -16, 1, -16));
  return f;
}

// Quants of blocks b and b+1 (zeros for b+1 when kBoth is false) in the activation's pair order:
// lo = [b: 0..15][b+1: 0..15], hi = [b: 16..31][b+1: 16..31].
template <Fmt F, bool kBoth>
inline void load_pair(const uint8_t* blk, __m256i* lo, __m256i* hi) {
  constexpr size_t B = Format<F>::kBlock, Q = Format<F>::kQs;
  if (Format<F>::kNibbles || F == Fmt::kIQ4_NL) {
    const __m128i q1 = kBoth ? load128(blk + B + Q) : _mm_setzero_si128();
    const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(load128(blk + Q)), q1, 1);
    const __m256i mask = _mm256_set1_epi8(0x0f);
    *lo = _mm256_and_si256(v, mask);
    *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
    if (Format<F>::kFifthBit) {
      // Bit j of a block's 32-bit qh is element j's: bits 0..15 go to lo, 16..31 to hi. Each
      // byte of lo/hi picks its qh byte, keeps its own bit and turns it into 16.
      constexpr size_t H = Format<F>::kQh;
      // Block b's qh in the low lane, block b + 1's in the high lane (broadcast loads).
      const __m256i qh0 = _mm256_set1_epi32(static_cast<int>(load_u32(blk + H)));
      const __m256i all =
          kBoth ? _mm256_blend_epi32(
                      qh0, _mm256_set1_epi32(static_cast<int>(load_u32(blk + B + H))), 0xf0)
                : _mm256_blend_epi32(qh0, _mm256_setzero_si256(), 0xf0);
      const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
      const __m256i pick_lo = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  //
                                               0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
      const __m256i pick_hi = _mm256_setr_epi8(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,  //
                                               2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
      const __m256i sixteen = _mm256_set1_epi8(16);
      const __m256i b_lo = _mm256_and_si256(_mm256_shuffle_epi8(all, pick_lo), bit);
      const __m256i b_hi = _mm256_and_si256(_mm256_shuffle_epi8(all, pick_hi), bit);
      *lo = _mm256_or_si256(*lo, _mm256_and_si256(_mm256_cmpeq_epi8(b_lo, bit), sixteen));
      *hi = _mm256_or_si256(*hi, _mm256_and_si256(_mm256_cmpeq_epi8(b_hi, bit), sixteen));
    }
    if (F == Fmt::kIQ4_NL) {
      const __m256i levels =
          _mm256_broadcastsi128_si256(load128(reinterpret_cast<const uint8_t*>(kIQ4Levels)));
      *lo = _mm256_shuffle_epi8(levels, *lo);
      *hi = _mm256_shuffle_epi8(levels, *hi);
    }
  } else {
    const __m256i x0 = load256(blk + Q);
    const __m256i x1 = kBoth ? load256(blk + B + Q) : _mm256_setzero_si256();
    *lo = _mm256_permute2x128_si256(x0, x1, 0x20);
    *hi = _mm256_permute2x128_si256(x0, x1, 0x31);
  }
}

// Whole-block sums of four pairs' lane vectors (v_i: lanes 0..3 block b's partial sums, 4..7 block
// b + 1's): [v0's block b, v1's, v2's, v3's | the same for block b + 1], exact integers.
inline __m256i block_sums(__m256i v0, __m256i v1, __m256i v2, __m256i v3) {
  return _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
}

// block_sums of four pairs' 16-bit sums of 4-bit quants (DotAvx2::nibbles16: lanes 0..7 block b's,
// 8..15 block b + 1's, each at most 7,620): two 16-bit horizontal adds sum four of them (at most
// 30,480, no wrap), and one multiply-add by ones the last two, into the same exact integers.
inline __m256i block_sums16(__m256i v0, __m256i v1, __m256i v2, __m256i v3) {
  const __m256i quads = _mm256_hadd_epi16(_mm256_hadd_epi16(v0, v1), _mm256_hadd_epi16(v2, v3));
  return _mm256_madd_epi16(quads, _mm256_set1_epi16(1));
}

// Four vectors of [x_b y_b] pairs for blocks b..b+3 (block_scales4's layout, or the
// activation's (d, s) pairs): their even lanes as the block sums' scales, [the four's x_b | their
// x_b+1] (s01) and [x_b+2 | x_b+3] (s23).
inline void pair_scales(__m256 p0, __m256 p1, __m256 p2, __m256 p3, __m256* s01, __m256* s23) {
  const __m256 l01 = _mm256_unpacklo_ps(p0, p1), l23 = _mm256_unpacklo_ps(p2, p3);
  const __m256 h01 = _mm256_unpackhi_ps(p0, p1), h23 = _mm256_unpackhi_ps(p2, p3);
  const __m256 even = _mm256_shuffle_ps(l01, l23, 0x44);  // blocks b | b + 2
  const __m256 odd = _mm256_shuffle_ps(h01, h23, 0x44);   // blocks b + 1 | b + 3
  *s01 = _mm256_permute2f128_ps(even, odd, 0x20);
  *s23 = _mm256_permute2f128_ps(even, odd, 0x31);
}

// Lanes c and c + 4 of v added: one (row, column)'s even blocks' and odd blocks' sums.
inline float pair_lanes(__m256 v, int c) {
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  return t[c] + t[c + 4];
}

template <class Dot, Fmt F>
struct QuantTile {
  static constexpr size_t kBlock = Format<F>::kBlock;
  static constexpr bool kRowTiles = true;  // products() below runs the tiles of a whole call

  // The rows' quants of blocks b and b + 1 as the dot below takes them.
  template <int NR, bool kBoth>
  static inline void load_rows(const uint8_t* const* rows, int64_t b, __m256i* lo, __m256i* hi) {
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      load_pair<F, kBoth>(rows[r] + b * kBlock, &lo[r], &hi[r]);
      if (!Format<F>::kNibbles) {
        // Signed weights: with 32-bit sums, as unsigned w + 128, each column's sums starting
        // at -128 * (its 4-byte group sums), so that every sum is w * a exactly; with 16-bit
        // sums, |w| against a * sign(w) (dot below).
        if constexpr (Dot::kWideSums) {
          const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
          lo[r] = _mm256_xor_si256(lo[r], bias);
          hi[r] = _mm256_xor_si256(hi[r], bias);
        }
      }
    }
  }
  // Lane l of a pair's dot (a row's lo/hi against a column's alo/ahi): the exact sum of the
  // products at dword l of both halves.
  static inline __m256i dot(__m256i lo, __m256i hi, __m256i alo, __m256i ahi, __m256i start) {
    if (Format<F>::kNibbles) return Dot::nibbles(lo, alo, hi, ahi);
    if constexpr (Dot::kWideSums) {
      return Dot::biased(start, lo, alo, hi, ahi);
    } else {
      // |w| * (a * sign(w)) = w * a puts the sign on the signed operand.
      return Dot::bytes(_mm256_abs_epi8(lo), _mm256_sign_epi8(alo, lo), _mm256_abs_epi8(hi),
                        _mm256_sign_epi8(ahi, hi));
    }
  }
  // block_sums of four dots (a row against four columns, or four rows against a column): dot i
  // of lo[i], hi[i] against alo[i], ahi[i] (start[i]: dot's), zeros from i = N on. 4-bit quants
  // on AVX2 sum in 16 bits first (block_sums16).
  static constexpr bool kSums16 = Dot::kSums16 && Format<F>::kNibbles && !Format<F>::kFifthBit;
  template <int N>
  static inline __m256i sums4(const __m256i (&lo)[4], const __m256i (&hi)[4],
                              const __m256i (&alo)[4], const __m256i (&ahi)[4],
                              const __m256i (&start)[4]) {
    __m256i v[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      if (i >= N) {
        v[i] = _mm256_setzero_si256();
      } else if constexpr (kSums16) {
        v[i] = Dot::nibbles16(lo[i], alo[i], hi[i], ahi[i]);
      } else {
        v[i] = dot(lo[i], hi[i], alo[i], ahi[i], start[i]);
      }
    }
    if constexpr (kSums16) return block_sums16(v[0], v[1], v[2], v[3]);
    return block_sums(v[0], v[1], v[2], v[3]);
  }
  static inline __m256i start_of(__m256i alo, __m256i ahi) {
    if constexpr (!Format<F>::kNibbles && Dot::kWideSums) {
      const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
      return _mm256_sub_epi32(_mm256_setzero_si256(), Dot::nibbles(bias, alo, bias, ahi));
    }
    return _mm256_setzero_si256();
  }

  // Rows x up to four columns: a row's four columns' block sums in one vector, scaled by the
  // products of the block scales and fused into the row's accumulator (lanes: column c's even
  // blocks at c, odd blocks at c + 4). wscale[r * pairs]: row r's scales of this pair, ascale the
  // columns'.
  template <int NR, int NC, bool kBoth>
  static inline void pair_step(__m256 (&acc)[NR], const __m256* wscale, int64_t pairs,
                               __m256 ascale, const uint8_t* const* rows,
                               const uint8_t* const* cols, int64_t b) {
    __m256i alo[4], ahi[4], start[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      if (c < NC) {
        alo[c] = load256(cols[c] + 32 * b);
        ahi[c] = load256(cols[c] + 32 * b + 32);
        start[c] = start_of(alo[c], ahi[c]);
      }
    }
    __m256i lo[NR], hi[NR];
    load_rows<NR, kBoth>(rows, b, lo, hi);
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const __m256i rlo[4] = {lo[r], lo[r], lo[r], lo[r]}, rhi[4] = {hi[r], hi[r], hi[r], hi[r]};
      const __m256 scale = _mm256_mul_ps(wscale[r * pairs], ascale);
      acc[r] =
          _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sums4<NC>(rlo, rhi, alo, ahi, start)), acc[r]);
    }
  }

  // Rows w, w + w_stride, ... against one column; results to out[0], out[out_stride], ...: the
  // tile's sums with the rows in the lanes' place of the columns (a permutation moves products,
  // it does not round).
  template <int NR>
  static void matvec(int64_t k, const uint8_t* w, size_t w_stride, const uint8_t* act, float* out,
                     size_t out_stride) {
    static_assert(NR <= 4, "four rows' block sums a vector");
    const int64_t nb = k / kQK;
    const uint8_t* rows[NR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) rows[r] = w + r * w_stride;
    const float* ds = act_ds(act, k);
    __m256 acc = _mm256_setzero_ps(), acc_min[NR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) acc_min[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b += 4) {
      const __m256 da = _mm256_loadu_ps(ds + 2 * b);
      // prod[r] = [d_b da_b, m_b s_b, ...] for blocks b..b+3: the even lanes are the scale
      // products, which go to the lanes of block sums ([rows' block b | rows' b + 1], then b + 2
      // and b + 3).
      __m256 prod[4];
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {
        if (r < NR) {
          prod[r] = _mm256_mul_ps(block_scales4<F>(rows[r], b, nb), da);
          if (Format<F>::kMin) acc_min[r] = _mm256_add_ps(acc_min[r], materialize(prod[r]));
        } else {
          prod[r] = _mm256_setzero_ps();
        }
      }
      __m256 s01, s23;
      pair_scales(prod[0], prod[1], prod[2], prod[3], &s01, &s23);
      const int64_t left = nb - b;  // blocks in this group
      for (int h = 0; h < 2 && 2 * h < left; ++h) {
        const int64_t bp = b + 2 * h;
        __m256i lo[4], hi[4];
        if (bp + 1 < nb)
          load_rows<NR, true>(rows, bp, lo, hi);
        else
          load_rows<NR, false>(rows, bp, lo, hi);
        const __m256i a0 = load256(act + 32 * bp), a1 = load256(act + 32 * bp + 32);
        const __m256i s = start_of(a0, a1);
        const __m256i alo[4] = {a0, a0, a0, a0}, ahi[4] = {a1, a1, a1, a1}, start[4] = {s, s, s, s};
        acc = _mm256_fmadd_ps(h == 0 ? s01 : s23,
                              _mm256_cvtepi32_ps(sums4<NR>(lo, hi, alo, ahi, start)), acc);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      float v = pair_lanes(acc, r);
      if (Format<F>::kMin) v += odd_lane_sum(acc_min[r]);
      out[r * out_stride] = v;
    }
  }

  // What a row tile's column groups share, worked out once: per row, each group of four blocks'
  // scales (block_scales4: dm[r * groups + g]) and each pair's, spread over the block sums'
  // lanes (wscale[r * pairs + p]; pairs = 2 * groups).
  template <int NR>
  static void row_scales(const uint8_t* const* rows, int64_t nb, int64_t groups, __m256* dm,
                         __m256* wscale) {
    const __m256i lo_idx = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2);
    const __m256i hi_idx = _mm256_setr_epi32(4, 4, 4, 4, 6, 6, 6, 6);
    for (int r = 0; r < NR; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        const __m256 v = block_scales4<F>(rows[r], 4 * g, nb);
        dm[r * groups + g] = v;
        wscale[r * 2 * groups + 2 * g] = _mm256_permutevar8x32_ps(v, lo_idx);
        wscale[r * 2 * groups + 2 * g + 1] = _mm256_permutevar8x32_ps(v, hi_idx);
      }
    }
  }

  // What every row tile shares with a group of four columns (cols[0..nc)), worked out once a
  // call: each pair's column scales (ascale[p]: [the columns' d_b | their d_b+1]; columns past
  // nc give zeros).
  static void col_scales(const float* const* ds, int nc, int64_t groups, __m256* ascale) {
    for (int64_t g = 0; g < groups; ++g) {
      __m256 da[4];
      for (int c = 0; c < 4; ++c)
        da[c] = c < nc ? _mm256_loadu_ps(ds[c] + 8 * g) : _mm256_setzero_ps();
      pair_scales(da[0], da[1], da[2], da[3], &ascale[2 * g], &ascale[2 * g + 1]);
    }
  }

  // NR rows x NC columns over the whole k, from the scales above.
  template <int NR, int NC>
  static void tile(int64_t nb, const uint8_t* const* rows, const __m256* dm, const __m256* wscale,
                   const uint8_t* const* cols, const float* const* ds, const __m256* ascale,
                   float* out, size_t out_stride) {
    static_assert(NC <= 4, "four columns' block sums a vector");
    const int64_t groups = (nb + 3) / 4, pairs = 2 * groups, full = nb / 2;
    __m256 acc[NR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t p = 0; p < full; ++p)
      pair_step<NR, NC, true>(acc, wscale + p, pairs, ascale[p], rows, cols, 2 * p);
    if (nb % 2)
      pair_step<NR, NC, false>(acc, wscale + full, pairs, ascale[full], rows, cols, 2 * full);
    // Sum over blocks of m * s, in the odd lanes of the same products as the scales; the NR x NC
    // sums advance together so that their additions overlap.
    __m256 m[NR][NC];
    if (Format<F>::kMin) {
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) {
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) m[r][c] = _mm256_setzero_ps();
      }
      for (int64_t g = 0; g < groups; ++g) {
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) {
          const __m256 da = _mm256_loadu_ps(ds[c] + 8 * g);
#pragma GCC unroll 8
          for (int r = 0; r < NR; ++r) {
            m[r][c] = _mm256_add_ps(m[r][c], materialize(_mm256_mul_ps(dm[r * groups + g], da)));
          }
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) {
        float v = pair_lanes(acc[r], c);
        if (Format<F>::kMin) v += odd_lane_sum(m[r][c]);
        out[c * out_stride + r] = v;
      }
    }
  }

  template <int NR>
  static void row_tile(int64_t nb, const uint8_t* w, size_t w_stride, const uint8_t* act,
                       size_t act_stride, int n_cols, const __m256* ascale, __m256* dm,
                       __m256* wscale, float* out, size_t out_stride) {
    const int64_t groups = (nb + 3) / 4;
    const uint8_t* rows[NR];
    for (int r = 0; r < NR; ++r) rows[r] = w + r * w_stride;
    row_scales<NR>(rows, nb, groups, dm, wscale);
    for (int c = 0; c < n_cols; c += 4) {
      const uint8_t* cols[4] = {};
      const float* ds[4] = {};
      const int nc = std::min(4, n_cols - c);
      for (int i = 0; i < nc; ++i) {
        cols[i] = act + (c + i) * act_stride;
        ds[i] = act_ds(cols[i], nb * kQK);
      }
      const __m256* as = ascale + (c / 4) * 2 * groups;
      float* o = out + c * out_stride;
      switch (nc) {
        case 1:
          tile<NR, 1>(nb, rows, dm, wscale, cols, ds, as, o, out_stride);
          break;
        case 2:
          tile<NR, 2>(nb, rows, dm, wscale, cols, ds, as, o, out_stride);
          break;
        case 3:
          tile<NR, 3>(nb, rows, dm, wscale, cols, ds, as, o, out_stride);
          break;
        default:
          tile<NR, 4>(nb, rows, dm, wscale, cols, ds, as, o, out_stride);
          break;
      }
    }
  }

  // Several columns: rows outside, in tiles of kRows (a tile's weights come from memory once and
  // are reused from L1 for every column group), each tile's row scales worked out once for all
  // its column groups and each column group's scales once for all the tiles.
  template <int kRows>
  static void products(int64_t k, const uint8_t* w, size_t w_stride, int n_rows, const uint8_t* act,
                       size_t act_stride, int n_cols, float* out, size_t out_stride) {
    static_assert(kRows >= 1 && kRows <= 4, "up to four rows a tile");
    const int64_t nb = k / kQK, groups = (nb + 3) / 4;
    const int n_cg = (n_cols + 3) / 4;
    // (Floats, 32-byte aligned by hand: a vector of __m256 would drop the type's alignment.)
    thread_local std::vector<float> scratch;
    const size_t need = static_cast<size_t>((2 * n_cg + 3 * kRows) * groups) * 8 + 8;
    if (scratch.size() < need) scratch.resize(need);
    const uintptr_t at = reinterpret_cast<uintptr_t>(scratch.data());
    __m256* ascale = reinterpret_cast<__m256*>((at + 31) & ~uintptr_t(31));
    __m256* dm = ascale + 2 * n_cg * groups;
    __m256* wscale = dm + kRows * groups;
    for (int cg = 0; cg < n_cg; ++cg) {
      const float* ds[4] = {};
      const int nc = std::min(4, n_cols - 4 * cg);
      for (int i = 0; i < nc; ++i) ds[i] = act_ds(act + (4 * cg + i) * act_stride, k);
      col_scales(ds, nc, groups, ascale + 2 * cg * groups);
    }
    for (int r = 0; r < n_rows; r += kRows) {
      const int nr = std::min(kRows, n_rows - r);
      auto run = [&](auto rows) {
        constexpr int NR = decltype(rows)::value;
        row_tile<NR>(nb, w + r * w_stride, w_stride, act, act_stride, n_cols, ascale, dm, wscale,
                     out + r, out_stride);
      };
      if (nr == kRows) {
        run(std::integral_constant<int, kRows>());
      } else if (nr == 1) {
        run(std::integral_constant<int, 1>());
      } else if constexpr (kRows > 2) {
        if (nr == 2) {
          run(std::integral_constant<int, 2>());
        } else {
          run(std::integral_constant<int, 3>());
        }
      }
    }
  }
};

// ----- K-quants and IQ4_XS against the kQ8K layout -----------------------------------------------

// Byte masks that pick 16-bit element ch of each 128-bit lane into all of that lane.
alignas(32) constexpr uint8_t kPickWord[8][32] = {
    {0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
     0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1},
    {2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3,
     2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3},
    {4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5,
     4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5},
    {6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7,
     6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7},
    {8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9,
     8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9},
    {10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11,
     10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11},
    {12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13,
     12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13},
    {14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15,
     14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15},
};

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// 16-bit shift of every lane by a count known after unrolling: left for n > 0, right for n < 0.
inline __m256i shift16(__m256i v, int n) {
  return n > 0 ? _mm256_slli_epi16(v, n) : n < 0 ? _mm256_srli_epi16(v, -n) : v;
}

// 16 int8 scales of sub-blocks of 16 as even-in-low, odd-in-high int16 lanes, so that picking
// word ch of each lane gives chunk ch's two scales.
inline __m256i even_odd_scales(__m128i s8, bool is_signed) {
  const __m128i eo =
      _mm_shuffle_epi8(s8, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
  return is_signed ? _mm256_cvtepi8_epi16(eo) : _mm256_cvtepu8_epi16(eo);
}

// The 8 six-bit scales (bytes 0..7) and minimums (bytes 8..15) of Q4_K and Q5_K: see
// quant.h's k_scale_min; four bytes at a time.
inline __m128i k_scales_mins(const uint8_t* s) {
  const uint32_t a = load_u32(s), b = load_u32(s + 4), c = load_u32(s + 8);
  const uint32_t sc_lo = a & 0x3f3f3f3f;
  const uint32_t m_lo = b & 0x3f3f3f3f;
  const uint32_t sc_hi = (c & 0x0f0f0f0f) | ((a >> 2) & 0x30303030);
  const uint32_t m_hi = ((c >> 4) & 0x0f0f0f0f) | ((b >> 2) & 0x30303030);
  return _mm_setr_epi32(static_cast<int>(sc_lo), static_cast<int>(sc_hi), static_cast<int>(m_lo),
                        static_cast<int>(m_hi));
}

// A super-block being decoded. The constructor reads its scales: `lanes` holds the sub-block
// scales as 16-bit words (sub-blocks of 32: the 8 scales in both 128-bit lanes; of 16: even ones
// low, odd ones high), `mins` the 16 sub-blocks' minimum multipliers, d and dmin the f16 scales.
// u(ch) decodes chunk ch of 32 quants in element order. The values are d (sc u) - dmin mn for
// formats with a dmin and d (sc u - mn) for the others, as in quant.cpp's decode_k; IQ4_XS's
// quants are signed.
struct KDecoderBase {
  const uint8_t* blk;
  __m256i lanes, mins;
  float d, dmin;
  __m256i scale(int ch) const { return _mm256_shuffle_epi8(lanes, load256(kPickWord[ch])); }
};

template <DType T>
struct KDecoder;

template <>
struct KDecoder<DType::Q2_K> : KDecoderBase {
  explicit KDecoder(const uint8_t* b) {
    blk = b;
    const __m128i s8 = load128(b + offsetof(BlockQ2_K, scales)), low4 = _mm_set1_epi8(0x0f);
    lanes = even_odd_scales(_mm_and_si128(s8, low4), false);
    mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s8, 4), low4));
    d = half_at(b + offsetof(BlockQ2_K, d));
    dmin = half_at(b + offsetof(BlockQ2_K, dmin));
  }
  __m256i u(int ch) const {
    const __m256i q = load256(blk + offsetof(BlockQ2_K, qs) + 32 * (ch / 4));
    return _mm256_and_si256(shift16(q, -2 * (ch % 4)), _mm256_set1_epi8(3));
  }
};

template <>
struct KDecoder<DType::Q3_K> : KDecoderBase {
  __m256i hm;  // third bits: chunk ch's are bit ch of each byte
  explicit KDecoder(const uint8_t* b) {
    blk = b;
    // The 16 six-bit scales of quant.cpp's q3_k_scale, four at a time, offset back by 32.
    const uint32_t x = load_u32(b + offsetof(BlockQ3_K, scales)),
                   y = load_u32(b + offsetof(BlockQ3_K, scales) + 4),
                   z = load_u32(b + offsetof(BlockQ3_K, scales) + 8);
    const __m128i s8 = _mm_sub_epi8(
        _mm_setr_epi32(static_cast<int>((x & 0x0f0f0f0f) | ((z & 0x03030303) << 4)),
                       static_cast<int>((y & 0x0f0f0f0f) | (((z >> 2) & 0x03030303) << 4)),
                       static_cast<int>(((x >> 4) & 0x0f0f0f0f) | (((z >> 4) & 0x03030303) << 4)),
                       static_cast<int>(((y >> 4) & 0x0f0f0f0f) | (((z >> 6) & 0x03030303) << 4))),
        _mm_set1_epi8(32));
    lanes = even_odd_scales(s8, true);
    mins = _mm256_slli_epi16(_mm256_cvtepi8_epi16(s8), 2);  // value = u - 4
    hm = load256(b + offsetof(BlockQ3_K, hmask));
    d = half_at(b + offsetof(BlockQ3_K, d));
    dmin = 0.0f;
  }
  __m256i u(int ch) const {
    const __m256i q = load256(blk + offsetof(BlockQ3_K, qs) + 32 * (ch / 4));
    const __m256i low = _mm256_and_si256(shift16(q, -2 * (ch % 4)), _mm256_set1_epi8(3));
    return _mm256_or_si256(low, _mm256_and_si256(shift16(hm, 2 - ch), _mm256_set1_epi8(4)));
  }
};

template <>
struct KDecoder<DType::Q4_K> : KDecoderBase {
  explicit KDecoder(const uint8_t* b) {
    blk = b;
    const __m128i sm = k_scales_mins(b + offsetof(BlockQ4_K, scales));
    lanes = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
    mins = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(
        sm, _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15)));
    d = half_at(b + offsetof(BlockQ4_K, d));
    dmin = half_at(b + offsetof(BlockQ4_K, dmin));
  }
  __m256i u(int ch) const {
    const __m256i q = load256(blk + offsetof(BlockQ4_K, qs) + 32 * (ch / 2));
    return _mm256_and_si256(ch % 2 ? _mm256_srli_epi16(q, 4) : q, _mm256_set1_epi8(0x0f));
  }
};

template <>
struct KDecoder<DType::Q5_K> : KDecoderBase {
  __m256i qh;  // fifth bits: chunk ch's are bit ch of each byte
  explicit KDecoder(const uint8_t* b) {
    blk = b;
    const __m128i sm = k_scales_mins(b + offsetof(BlockQ5_K, scales));
    lanes = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
    mins = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(
        sm, _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15)));
    qh = load256(b + offsetof(BlockQ5_K, qh));
    d = half_at(b + offsetof(BlockQ5_K, d));
    dmin = half_at(b + offsetof(BlockQ5_K, dmin));
  }
  __m256i u(int ch) const {
    const __m256i q = load256(blk + offsetof(BlockQ5_K, qs) + 32 * (ch / 2));
    const __m256i nib =
        _mm256_and_si256(ch % 2 ? _mm256_srli_epi16(q, 4) : q, _mm256_set1_epi8(0x0f));
    return _mm256_or_si256(nib, _mm256_and_si256(shift16(qh, 4 - ch), _mm256_set1_epi8(0x10)));
  }
};

template <>
struct KDecoder<DType::Q6_K> : KDecoderBase {
  explicit KDecoder(const uint8_t* b) {
    blk = b;
    const __m128i s8 = load128(b + offsetof(BlockQ6_K, scales));
    lanes = even_odd_scales(s8, true);
    mins = _mm256_slli_epi16(_mm256_cvtepi8_epi16(s8), 5);  // value = u - 32
    d = half_at(b + offsetof(BlockQ6_K, d));
    dmin = 0.0f;
  }
  __m256i u(int ch) const {
    const int h = ch / 4, s = ch % 4;
    const __m256i l = load256(blk + offsetof(BlockQ6_K, ql) + 64 * h + 32 * (s % 2));
    const __m256i qh = load256(blk + offsetof(BlockQ6_K, qh) + 32 * h);
    const __m256i lo =
        _mm256_and_si256(s < 2 ? l : _mm256_srli_epi16(l, 4), _mm256_set1_epi8(0x0f));
    return _mm256_or_si256(lo, _mm256_and_si256(shift16(qh, 4 - 2 * s), _mm256_set1_epi8(0x30)));
  }
};

template <>
struct KDecoder<DType::IQ4_XS> : KDecoderBase {
  __m256i levels;
  explicit KDecoder(const uint8_t* b) {
    blk = b;
    // The 8 six-bit scales: low nibbles from scales_l, 2-bit high parts from scales_h, each
    // spread to its own byte by halving the field groups' distances until fields are bytes.
    uint16_t sh;
    std::memcpy(&sh, b + offsetof(BlockIQ4_XS, scales_h), 2);
    uint64_t lo = load_u32(b + offsetof(BlockIQ4_XS, scales_l));
    lo = (lo | (lo << 16)) & 0x0000ffff0000ffffull;
    lo = (lo | (lo << 8)) & 0x00ff00ff00ff00ffull;
    lo = (lo | (lo << 4)) & 0x0f0f0f0f0f0f0f0full;
    uint64_t hi = sh;
    hi = (hi | (hi << 24)) & 0x000000ff000000ffull;
    hi = (hi | (hi << 12)) & 0x000f000f000f000full;
    hi = (hi | (hi << 6)) & 0x0303030303030303ull;
    const __m128i s8 =
        _mm_sub_epi8(_mm_cvtsi64_si128(static_cast<int64_t>(lo | (hi << 4))), _mm_set1_epi8(32));
    lanes = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(s8));
    mins = _mm256_setzero_si256();
    levels = _mm256_broadcastsi128_si256(load128(reinterpret_cast<const uint8_t*>(kIQ4Levels)));
    d = half_at(b + offsetof(BlockIQ4_XS, d));
    dmin = 0.0f;
  }
  __m256i u(int ch) const {
    // Bytes 0..15 hold sub-block 2g (low nibbles its first 16 values), bytes 16..31 sub-block
    // 2g + 1: a lane swap puts each sub-block's 32 values in order.
    const __m256i q = load256(blk + offsetof(BlockIQ4_XS, qs) + 32 * (ch / 2));
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const __m256i lo = _mm256_shuffle_epi8(levels, _mm256_and_si256(q, low4));
    const __m256i hi = _mm256_shuffle_epi8(levels, _mm256_and_si256(_mm256_srli_epi16(q, 4), low4));
    return ch % 2 ? _mm256_permute2x128_si256(lo, hi, 0x31)
                  : _mm256_permute2x128_si256(lo, hi, 0x20);
  }
};

// A super-block decoded whole, for tiles of several columns that reuse it.
struct KSuper {
  __m256i u[8];
  __m256i sc[8];
  __m256i mins;
  float d, dmin;
};

template <DType T>
inline void decode_k(const uint8_t* blk, KSuper* ks) {
  const KDecoder<T> dec(blk);
#pragma GCC unroll 8
  for (int ch = 0; ch < 8; ++ch) {
    ks->u[ch] = dec.u(ch);
    ks->sc[ch] = dec.scale(ch);
  }
  ks->mins = dec.mins;
  ks->d = dec.d;
  ks->dmin = dec.dmin;
}

void prepare_q8k_x86(const float* x, void* dst, int64_t k) {
  std::memset(dst, 0, q8k_act_size(k));
  uint8_t* q = static_cast<uint8_t*>(dst);
  float* d = reinterpret_cast<float*>(q + k);
  int16_t* bsums = reinterpret_cast<int16_t*>(q + k + 4 * (k / 256));
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  for (int64_t b = 0; b < k / 256; ++b, x += 256, q += 256) {
    __m256i amax = _mm256_setzero_si256();
    for (int i = 0; i < 32; ++i) {
      const __m256i v = _mm256_castps_si256(_mm256_loadu_ps(x + 8 * i));
      amax = _mm256_max_epu32(amax, _mm256_and_si256(v, abs_mask));
    }
    __m128i m4 = _mm_max_epu32(_mm256_castsi256_si128(amax), _mm256_extracti128_si256(amax, 1));
    m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0x4e));
    m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0xb1));
    const uint32_t amax_bits = static_cast<uint32_t>(_mm_cvtsi128_si32(m4));
    if (amax_bits >= 0x7f800000) {
      d[b] = __builtin_nanf("");  // the whole super-block shows as NaN in every dot
      continue;
    }
    float amax_f;
    std::memcpy(&amax_f, &amax_bits, sizeof(amax_f));
    const __m256 id = _mm256_set1_ps(amax_f != 0.0f ? 127.0f / amax_f : 0.0f);
    for (int i = 0; i < 8; ++i) {
      __m256i qi[4];
      for (int j = 0; j < 4; ++j) {
        qi[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 32 * i + 8 * j), id));
      }
      // Sums of values 0..15 and 16..31 of this group of 32.
      const __m128i s01 = _mm_add_epi32(
          _mm_add_epi32(_mm256_castsi256_si128(qi[0]), _mm256_extracti128_si256(qi[0], 1)),
          _mm_add_epi32(_mm256_castsi256_si128(qi[1]), _mm256_extracti128_si256(qi[1], 1)));
      const __m128i s23 = _mm_add_epi32(
          _mm_add_epi32(_mm256_castsi256_si128(qi[2]), _mm256_extracti128_si256(qi[2], 1)),
          _mm_add_epi32(_mm256_castsi256_si128(qi[3]), _mm256_extracti128_si256(qi[3], 1)));
      __m128i s = _mm_hadd_epi32(s01, s23);
      s = _mm_hadd_epi32(s, s);
      bsums[16 * b + 2 * i] = static_cast<int16_t>(_mm_cvtsi128_si32(s));
      bsums[16 * b + 2 * i + 1] = static_cast<int16_t>(_mm_extract_epi32(s, 1));
      const __m256i p8 =
          _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
      const __m256i ordered =
          _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * i), ordered);
    }
    d[b] = amax_f / 127.0f;
  }
}

// The arithmetic of quant.cpp's tile_k_scalar, 8 lanes at once: per chunk of 32 the exact
// integer dot of each 4 quants with their activations (maddubs: |u| <= 63 or the signed levels'
// magnitudes, pairs at most 2 * 127 * 127), times the sub-block scale (madd); per super-block the
// minimums dotted with the sums of 16, then one or two fused steps into the float lanes.
template <DType T>
struct KQuantTile {
  static constexpr bool kDmin = T == DType::Q2_K || T == DType::Q4_K || T == DType::Q5_K;
  static constexpr bool kSigned = T == DType::IQ4_XS;
  static constexpr size_t kBlock = T == DType::Q2_K   ? sizeof(BlockQ2_K)
                                   : T == DType::Q3_K ? sizeof(BlockQ3_K)
                                   : T == DType::Q4_K ? sizeof(BlockQ4_K)
                                   : T == DType::Q5_K ? sizeof(BlockQ5_K)
                                   : T == DType::Q6_K ? sizeof(BlockQ6_K)
                                                      : sizeof(BlockIQ4_XS);

  static inline __m256i chunk_dot(__m256i u, __m256i a, __m256i sc) {
    const __m256i p16 = kSigned ? _mm256_maddubs_epi16(_mm256_abs_epi8(u), _mm256_sign_epi8(a, u))
                                : _mm256_maddubs_epi16(u, a);
    return _mm256_madd_epi16(p16, sc);
  }

  static inline __m256 step(__m256i mins, float d, float dmin, __m256i isum, __m256i bsums,
                            float da, __m256 acc) {
    const __m256i msum = _mm256_madd_epi16(bsums, mins);
    if (kDmin) {
      acc = _mm256_fmadd_ps(_mm256_set1_ps(d * da), _mm256_cvtepi32_ps(isum), acc);
      return _mm256_fnmadd_ps(_mm256_set1_ps(dmin * da), _mm256_cvtepi32_ps(msum), acc);
    }
    return _mm256_fmadd_ps(_mm256_set1_ps(d * da), _mm256_cvtepi32_ps(_mm256_sub_epi32(isum, msum)),
                           acc);
  }

  // One column: each chunk is decoded right before its dot, so nothing leaves the registers.
  template <int NR>
  static void matvec(int64_t k, const uint8_t* w, size_t w_stride, const uint8_t* act, float* out,
                     size_t out_stride) {
    static_assert(NR <= 2, "two rows at most: their decoders stay in registers");
    const int64_t ns = k / 256;
    const float* da = q8k_d(act, k);
    const int16_t* bsums = q8k_bsums(act, k);
    __m256 acc[NR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < ns; ++b) {
      __m256i isum[NR];
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) isum[r] = _mm256_setzero_si256();
      const KDecoder<T> dec0(w + b * kBlock);
      const KDecoder<T> dec1(w + (NR > 1 ? w_stride : 0) + b * kBlock);
      const KDecoder<T>* dec[2] = {&dec0, &dec1};
#pragma GCC unroll 8
      for (int ch = 0; ch < 8; ++ch) {
        const __m256i a = load256(act + 256 * b + 32 * ch);
#pragma GCC unroll 2
        for (int r = 0; r < NR; ++r) {
          isum[r] = _mm256_add_epi32(isum[r], chunk_dot(dec[r]->u(ch), a, dec[r]->scale(ch)));
        }
      }
      const __m256i bs = load256(reinterpret_cast<const uint8_t*>(bsums + 16 * b));
#pragma GCC unroll 2
      for (int r = 0; r < NR; ++r) {
        acc[r] = step(dec[r]->mins, dec[r]->d, dec[r]->dmin, isum[r], bs, da[b], acc[r]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) out[r * out_stride] = hsum(acc[r]);
  }

  template <int NR, int NC>
  static void tile(int64_t k, const uint8_t* w, size_t w_stride, const uint8_t* act,
                   size_t act_stride, float* out, size_t out_stride) {
    const int64_t ns = k / 256;
    __m256 acc[NR][NC];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();
    }
    KSuper ks[NR];
    for (int64_t b = 0; b < ns; ++b) {
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) decode_k<T>(w + r * w_stride + b * kBlock, &ks[r]);
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) {
        const uint8_t* col = act + c * act_stride;
        __m256i isum[NR];
#pragma GCC unroll 8
        for (int r = 0; r < NR; ++r) isum[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int ch = 0; ch < 8; ++ch) {
          const __m256i a = load256(col + 256 * b + 32 * ch);
#pragma GCC unroll 8
          for (int r = 0; r < NR; ++r) {
            isum[r] = _mm256_add_epi32(isum[r], chunk_dot(ks[r].u[ch], a, ks[r].sc[ch]));
          }
        }
        const __m256i bsums = load256(reinterpret_cast<const uint8_t*>(q8k_bsums(col, k) + 16 * b));
        const float da = q8k_d(col, k)[b];
#pragma GCC unroll 8
        for (int r = 0; r < NR; ++r) {
          acc[r][c] = step(ks[r].mins, ks[r].d, ks[r].dmin, isum[r], bsums, da, acc[r][c]);
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) out[c * out_stride + r] = hsum(acc[r][c]);
    }
  }
};

// ----- float weights ---------------------------------------------------------------------------

struct LoadF32 {
  static constexpr size_t kSize = 4;
  static __m256 load(const uint8_t* p) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  }
};
struct LoadF16 {
  static constexpr size_t kSize = 2;
  static __m256 load(const uint8_t* p) { return _mm256_cvtph_ps(load128(p)); }
};
struct LoadBF16 {
  static constexpr size_t kSize = 2;
  static __m256 load(const uint8_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load128(p)), 16));
  }
};

template <typename L>
struct FloatTile {
  template <int NR>
  static void matvec(int64_t k, const uint8_t* w, size_t w_stride, const uint8_t* act, float* out,
                     size_t out_stride) {
    float v[NR];
    tile<NR, 1>(k, w, w_stride, act, 0, v, 1);
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) out[r * out_stride] = v[r];
  }

  template <int NR, int NC>
  static void tile(int64_t k, const uint8_t* w, size_t w_stride, const uint8_t* act,
                   size_t act_stride, float* out, size_t out_stride) {
    __m256 acc[NR][NC];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();
    }
    const int64_t k8 = k / 8 * 8;
    for (int64_t i = 0; i < k8; i += 8) {
      __m256 wv[NR];
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) wv[r] = L::load(w + r * w_stride + i * L::kSize);
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) {
        const __m256 x = _mm256_loadu_ps(reinterpret_cast<const float*>(act + c * act_stride) + i);
#pragma GCC unroll 8
        for (int r = 0; r < NR; ++r) acc[r][c] = _mm256_fmadd_ps(wv[r], x, acc[r][c]);
      }
    }
    if (k8 < k) {
      // The tail runs as one more 8-wide step over zero-padded weights; prepared activations
      // are zero-padded already, so the extra lanes add exact zeros.
      __m256 wv[NR];
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) {
        alignas(32) uint8_t tail[32] = {};
        std::memcpy(tail, w + r * w_stride + k8 * L::kSize, static_cast<size_t>(k - k8) * L::kSize);
        wv[r] = L::load(tail);
      }
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) {
        const __m256 x = _mm256_loadu_ps(reinterpret_cast<const float*>(act + c * act_stride) + k8);
#pragma GCC unroll 8
        for (int r = 0; r < NR; ++r) acc[r][c] = _mm256_fmadd_ps(wv[r], x, acc[r][c]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) out[c * out_stride + r] = hsum(acc[r][c]);
    }
  }
};

// ----- tiling ----------------------------------------------------------------------------------

using Micro = void (*)(int64_t, const uint8_t*, size_t, const uint8_t*, size_t, float*, size_t);
using MatVec = void (*)(int64_t, const uint8_t*, size_t, const uint8_t*, float*, size_t);

// Whether a kernel runs a whole call's tiles itself (K::kRowTiles, K::products<kRows>), where
// the others give the Tiler register tiles to run.
template <typename K, typename = void>
struct RowTiles : std::false_type {};
template <typename K>
struct RowTiles<K, std::void_t<decltype(K::kRowTiles)>> : std::bool_constant<K::kRowTiles> {};

// Register tiles: kMatVecRows rows for one column (memory-bound), kRows x kCols otherwise.
template <typename K, int kRows, int kCols, int kMatVecRows>
struct Tiler {
  static constexpr size_t kMinStreamGap = 65536;  // bytes between the parts read side by side

  struct Table {
    Micro tiles[kRows][kCols];
    MatVec matvec[kMatVecRows];
  };
  template <int... I>
  static void fill_tiles(Table& t, std::integer_sequence<int, I...>) {
    ((t.tiles[I / kCols][I % kCols] = &K::template tile<I / kCols + 1, I % kCols + 1>), ...);
  }
  template <int... I>
  static void fill_matvec(Table& t, std::integer_sequence<int, I...>) {
    ((t.matvec[I] = &K::template matvec<I + 1>), ...);
  }
  static Table make_table() {
    Table t{};
    if constexpr (!RowTiles<K>::value)
      fill_tiles(t, std::make_integer_sequence<int, kRows * kCols>());
    fill_matvec(t, std::make_integer_sequence<int, kMatVecRows>());
    return t;
  }

  static void run(int64_t k, const uint8_t* w, size_t w_stride, int n_rows, const uint8_t* act,
                  size_t act_stride, int n_cols, float* out, size_t out_stride) {
    products(k, w, w_stride, n_rows, act, act_stride, n_cols, out, out_stride);
    // The callers' code is built for baseline SSE: leave no 256-bit state behind, which would
    // slow every SSE instruction after it.
    _mm256_zeroupper();
  }

  static void products(int64_t k, const uint8_t* w, size_t w_stride, int n_rows, const uint8_t* act,
                       size_t act_stride, int n_cols, float* out, size_t out_stride) {
    static const Table table = make_table();
    if (n_cols == 1) {
      // kMatVecRows rows at a time from as many distant parts of the range, each part read in
      // order: one sequential stream per part keeps the hardware prefetcher effective, where
      // neighbouring rows read side by side would not.
      // Parts closer than a few pages make interleaved streams again: then kMatVecRows
      // neighbouring rows at a time (one stream), the last few one by one.
      const int per = static_cast<size_t>(n_rows / kMatVecRows) * w_stride >= kMinStreamGap
                          ? n_rows / kMatVecRows
                          : 0;
      for (int i = 0; i < per; ++i) {
        table.matvec[kMatVecRows - 1](k, w + i * w_stride, per * w_stride, act, out + i, per);
      }
      int r = per * kMatVecRows;
      for (; r + kMatVecRows <= n_rows; r += kMatVecRows) {
        table.matvec[kMatVecRows - 1](k, w + r * w_stride, w_stride, act, out + r, 1);
      }
      for (; r < n_rows; ++r) {
        table.matvec[0](k, w + r * w_stride, w_stride, act, out + r, 1);
      }
      return;
    }
    if constexpr (RowTiles<K>::value) {
      return K::template products<kRows>(k, w, w_stride, n_rows, act, act_stride, n_cols, out,
                                         out_stride);
    }
    // Rows outside, columns inside: a register tile's weights come from memory once and are
    // reused from L1 for every column group of the call.
    for (int r = 0; r < n_rows; r += kRows) {
      const int nr = n_rows - r < kRows ? n_rows - r : kRows;
      for (int c = 0; c < n_cols; c += kCols) {
        const int nc = n_cols - c < kCols ? n_cols - c : kCols;
        table.tiles[nr - 1][nc - 1](k, w + r * w_stride, w_stride, act + c * act_stride, act_stride,
                                    out + c * out_stride + r, out_stride);
      }
    }
  }
};

// The 32-element block formats' products of a kernel set: register tiles of kRows rows and four
// columns (the block sums' vector holds four), the mat-vec four rows at a time.
template <class Dot, int kRows>
void set_block_tiles(Kernels& k) {
  k.tile[slot(DType::Q8_0)] = Tiler<QuantTile<Dot, Fmt::kQ8_0>, kRows, 4, 4>::run;
  k.tile[slot(DType::Q4_0)] = Tiler<QuantTile<Dot, Fmt::kQ4_0>, kRows, 4, 4>::run;
  k.tile[slot(DType::Q4_1)] = Tiler<QuantTile<Dot, Fmt::kQ4_1>, kRows, 4, 4>::run;
  k.tile[slot(DType::Q5_0)] = Tiler<QuantTile<Dot, Fmt::kQ5_0>, kRows, 4, 4>::run;
  k.tile[slot(DType::Q5_1)] = Tiler<QuantTile<Dot, Fmt::kQ5_1>, kRows, 4, 4>::run;
  k.tile[slot(DType::IQ4_NL)] = Tiler<QuantTile<Dot, Fmt::kIQ4_NL>, kRows, 4, 4>::run;
}

// ---- Attention rows (quant.h's attention_rows), heads a multiple of 8 wide -------------------

// The lanes of eight vectors summed, vector j's sum in lane j: every sum is ((x0 + x1) + (x2 +
// x3)) + ((x4 + x5) + (x6 + x7)) whichever lane it lands in.
inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                    __m256 a7) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// quant_impl's softmax_row in lanes of 8, with its bits: the max of a row is the same whichever
// order finds it, and each exponential takes softmax_exp's steps (its multiplies rounded on their
// own, not fused), lane j summing the elements j, j + 8, ... and the tail added to lane 0, as
// there. Compilers do not vectorize that loop (its select and float-to-int steps), and at one
// exponential in ten cycles the softmax was half of a decode task's time.
inline void softmax_row_x86(float* w, int n, int b, int e, float* mx, float* sum) {
  if (e <= b) {
    softmax_row(w, n, b, e, mx, sum);
    return;
  }
  float m = -INFINITY;
  int p = b;
  if (e - b >= 8) {
    // max(x, m) keeps m where x is NaN, as std::max(m, x) does.
    __m256 vm = _mm256_set1_ps(-INFINITY);
    for (; p + 8 <= e; p += 8) vm = _mm256_max_ps(_mm256_loadu_ps(w + p), vm);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vm);
    for (float x : lanes) m = std::max(m, x);
  }
  for (; p < e; ++p) m = std::max(m, w[p]);
  *mx = m;
  const __m256 vm = _mm256_set1_ps(m), lo = _mm256_set1_ps(-87.0f);
  const __m256 log2e = _mm256_set1_ps(1.4426950408889634f), one = _mm256_set1_ps(1.0f);
  const __m256 c1 = _mm256_set1_ps(0.6931471825f), c2 = _mm256_set1_ps(0.2402264923f),
               c3 = _mm256_set1_ps(0.0555041087f), c4 = _mm256_set1_ps(0.0096181291f),
               c5 = _mm256_set1_ps(0.0013333558f), c6 = _mm256_set1_ps(0.0001540353f);
  // exp(d) for d = x - m, 0 where d < -87 (false for NaN, as the scalar test is).
  auto exp8 = [&](__m256 d) {
    // max(-87, d) is std::max(d, -87.0f): d where d is NaN.
    const __m256 t = materialize(_mm256_mul_ps(_mm256_max_ps(lo, d), log2e));
    const __m256 fl = _mm256_floor_ps(t);
    const __m256 f = _mm256_sub_ps(t, fl);
    __m256 q = materialize(_mm256_mul_ps(f, c6));
    q = materialize(_mm256_mul_ps(f, _mm256_add_ps(c5, q)));
    q = materialize(_mm256_mul_ps(f, _mm256_add_ps(c4, q)));
    q = materialize(_mm256_mul_ps(f, _mm256_add_ps(c3, q)));
    q = materialize(_mm256_mul_ps(f, _mm256_add_ps(c2, q)));
    q = materialize(_mm256_mul_ps(f, _mm256_add_ps(c1, q)));
    q = _mm256_add_ps(one, q);
    const __m256 scale = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fl), _mm256_set1_epi32(127)), 23));
    return _mm256_andnot_ps(_mm256_cmp_ps(d, lo, _CMP_LT_OQ), materialize(_mm256_mul_ps(q, scale)));
  };
  __m256 acc = _mm256_setzero_ps();
  float* s = w + b;
  const int count = e - b;
  int i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256 r = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), vm));
    _mm256_storeu_ps(s + i, r);
    acc = _mm256_add_ps(acc, r);
  }
  alignas(32) float a[8];
  _mm256_store_ps(a, acc);
  if (i < count) {
    // The last few in the same steps, added to lane 0 one after another.
    alignas(32) float t[8];
    std::fill(t, t + 8, m);
    std::copy(s + i, s + count, t);
    _mm256_store_ps(t, exp8(_mm256_sub_ps(_mm256_load_ps(t), vm)));
    for (int j = 0; i + j < count; ++j) a[0] += (s[i + j] = t[j]);
  }
  *sum = ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
  std::fill(w, w + b, 0.0f);
  std::fill(w + e, w + n, 0.0f);
}

// Cache rows ahead that the attention's value loop asks for.
constexpr int kAttnAhead = 8;

// Weighted values of NR rows (weights w, n apart; zero outside each row's keys) over keys [pb, pe)
// for dimensions [d0, d0 + 8 DB): each row's lanes add one key after another, so a row's result
// does not depend on the rows beside it. One load of a value vector serves every row. The cache
// rows are L's elements (F32, or F16 converted exactly as they load), vs elements apart.
template <class L, int NR, int DB>
inline void attn_values_x86(const float* w, int n, const uint8_t* v, int64_t vs, int pb, int pe,
                            int d0, float* acc, int hd) {
  __m256 a[NR][DB];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < DB; ++i) a[r][i] = _mm256_setzero_ps();
  const int64_t row = vs * int64_t(L::kSize);
  for (int p = pb; p < pe; ++p) {
    const uint8_t* vp = v + p * row + d0 * int64_t(L::kSize);
    // A cache's rows lie a stride apart (a head's part of each): ask for the ones ahead.
    _mm_prefetch(reinterpret_cast<const char*>(vp + kAttnAhead * row), _MM_HINT_T0);
    if (DB * 8 * L::kSize > 64)
      _mm_prefetch(reinterpret_cast<const char*>(vp + kAttnAhead * row + 64), _MM_HINT_T0);
    __m256 x[DB];
    for (int i = 0; i < DB; ++i) x[i] = L::load(vp + 8 * i * L::kSize);
    for (int r = 0; r < NR; ++r) {
      const __m256 wr = _mm256_broadcast_ss(w + int64_t(r) * n + p);
      for (int i = 0; i < DB; ++i) a[r][i] = _mm256_fmadd_ps(wr, x[i], a[r][i]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < DB; ++i) _mm256_storeu_ps(acc + int64_t(r) * hd + d0 + 8 * i, a[r][i]);
}

// Blocks of 8 dimensions a pass of attn_values_x86 takes for NR rows: 4 where its loop's vectors
// fit the registers (NR x 4 accumulators, the weight, and an F16 cache's 4 converted values; an
// F32 value is the multiply-add's memory operand), else 2. Past AVX2's 16 registers one
// accumulator lived on the stack, and its load, add and store set the loop's pace: over an F16
// cache the prompt attention ran 17% slower than over F32.
template <class L, int NR>
constexpr int attn_values_blocks() {
#if defined(__AVX512F__)
  constexpr int kRegs = 32;
#else
  constexpr int kRegs = 16;
#endif
  return NR * 4 + 1 + (L::kSize == 4 ? 0 : 4) <= kRegs ? 4 : 2;
}

template <class L, int NR>
inline void attn_values_rows_x86(const float* w, int n, const uint8_t* v, int64_t vs, int pb,
                                 int pe, float* acc, int hd) {
  constexpr int DB = attn_values_blocks<L, NR>();
  int d0 = 0;
  for (; d0 + 8 * DB <= hd; d0 += 8 * DB)
    attn_values_x86<L, NR, DB>(w, n, v, vs, pb, pe, d0, acc, hd);
  for (; d0 < hd; d0 += 8) attn_values_x86<L, NR, 1>(w, n, v, vs, pb, pe, d0, acc, hd);
}

// Scores eight keys at a time, one row after another (the eight keys' rows stay in L1): each
// key's dot product in lanes of 8 over d, then hsum8. The last block repeats its last key where
// the chunk ends, and keeps only the real ones. K and V rows are L's elements, ks and vs apart.
// H heads of R rows each (row h R + r; head h's keys and values hd elements into each cache
// row): each block of eight keys is scored for every head while its rows are in L1, and with
// several heads the blocks' whole rows, values too, are asked for ahead, so that the cache's rows
// stream from memory once rather than one head's slice of each at a time.
template <class L>
void attn_rows_x86_t(const float* q, int R, int H, int hd, const uint8_t* k, int64_t ks,
                     const uint8_t* v, int64_t vs, int n, const int* b, const int* e, float scale,
                     float* scores, float* mx, float* sum, float* acc) {
  const __m256 vscale = _mm256_set1_ps(scale);
  const int64_t krow = ks * int64_t(L::kSize), vrow = vs * int64_t(L::kSize);
  const int64_t head = int64_t(hd) * int64_t(L::kSize);  // a head's bytes in a row
  const int rows = R * H;
  for (int p0 = 0; p0 < n; p0 += 8) {
    const uint8_t* kp[8];
    for (int j = 0; j < 8; ++j) kp[j] = k + std::min(p0 + j, n - 1) * krow;
    // The next eight keys' rows, a stride apart (the heads' part of each), asked for ahead into
    // L2 (T1): into L1 (T0), a task of 256 keys over rows in memory took 1.5x as long, and one
    // sequence after 2,048 tokens decoded 1.18x slower.
    if (p0 + 8 < n)
      for (int j = 0; j < 8; ++j) {
        const int64_t at = std::min(p0 + 8 + j, n - 1);
        const char* row = reinterpret_cast<const char*>(k + at * krow);
        for (int off = 0; off < H * head; off += 64) _mm_prefetch(row + off, _MM_HINT_T1);
        if (H > 1) {
          const char* vr = reinterpret_cast<const char*>(v + at * vrow);
          for (int off = 0; off < H * head; off += 64) _mm_prefetch(vr + off, _MM_HINT_T1);
        }
      }
    for (int r = 0; r < rows; ++r) {
      const float* qr = q + int64_t(r) * hd;
      const int64_t hk = (r / R) * head;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
             a7 = a0;
      for (int d = 0; d < hd; d += 8) {
        const __m256 qv = _mm256_loadu_ps(qr + d);
        const int64_t at = hk + d * int64_t(L::kSize);
        a0 = _mm256_fmadd_ps(qv, L::load(kp[0] + at), a0);
        a1 = _mm256_fmadd_ps(qv, L::load(kp[1] + at), a1);
        a2 = _mm256_fmadd_ps(qv, L::load(kp[2] + at), a2);
        a3 = _mm256_fmadd_ps(qv, L::load(kp[3] + at), a3);
        a4 = _mm256_fmadd_ps(qv, L::load(kp[4] + at), a4);
        a5 = _mm256_fmadd_ps(qv, L::load(kp[5] + at), a5);
        a6 = _mm256_fmadd_ps(qv, L::load(kp[6] + at), a6);
        a7 = _mm256_fmadd_ps(qv, L::load(kp[7] + at), a7);
      }
      const __m256 s = _mm256_mul_ps(hsum8(a0, a1, a2, a3, a4, a5, a6, a7), vscale);
      float* out = scores + int64_t(r) * n + p0;
      if (p0 + 8 <= n) {
        _mm256_storeu_ps(out, s);
      } else {
        alignas(32) float t[8];
        _mm256_store_ps(t, s);
        std::memcpy(out, t, sizeof(float) * size_t(n - p0));
      }
    }
  }
  // Softmax per row; weights outside the row's keys become 0, so rows of different ranges can
  // share the value loads below (a zero weight adds nothing: fma(0, v, a) is a, for the finite
  // values a cache holds).
  for (int r = 0; r < rows; ++r)
    softmax_row_x86(scores + int64_t(r) * n, n, b[r], e[r], &mx[r], &sum[r]);
  for (int h = 0; h < H; ++h) {
    const uint8_t* vh = v + h * head;
    for (int r0 = h * R; r0 < (h + 1) * R; r0 += 3) {
      const int nr = std::min(3, (h + 1) * R - r0);
      int pb = n, pe = 0;
      for (int r = r0; r < r0 + nr; ++r)
        if (e[r] > b[r]) pb = std::min(pb, b[r]), pe = std::max(pe, e[r]);
      const float* w = scores + int64_t(r0) * n;
      float* a = acc + int64_t(r0) * hd;
      if (nr == 3)
        attn_values_rows_x86<L, 3>(w, n, vh, vs, pb, pe, a, hd);
      else if (nr == 2)
        attn_values_rows_x86<L, 2>(w, n, vh, vs, pb, pe, a, hd);
      else
        attn_values_rows_x86<L, 1>(w, n, vh, vs, pb, pe, a, hd);
    }
  }
}

void attn_rows_x86(const float* q, int R, int H, int hd, const float* k, int64_t ks, const float* v,
                   int64_t vs, int n, const int* b, const int* e, float scale, float* scores,
                   float* mx, float* sum, float* acc) {
  attn_rows_x86_t<LoadF32>(q, R, H, hd, reinterpret_cast<const uint8_t*>(k), ks,
                           reinterpret_cast<const uint8_t*>(v), vs, n, b, e, scale, scores, mx, sum,
                           acc);
}

// The same over an F16 cache read in place: each element converted exactly as it loads, so the
// bits are those of attn_rows_x86 over the rows decoded to floats.
void attn_rows_f16_x86(const float* q, int R, int H, int hd, const uint16_t* k, int64_t ks,
                       const uint16_t* v, int64_t vs, int n, const int* b, const int* e,
                       float scale, float* scores, float* mx, float* sum, float* acc) {
  attn_rows_x86_t<LoadF16>(q, R, H, hd, reinterpret_cast<const uint8_t*>(k), ks,
                           reinterpret_cast<const uint8_t*>(v), vs, n, b, e, scale, scores, mx, sum,
                           acc);
}

// quant.h's glu_mul, eight elements a step: glu_mul_one's steps, the polynomial in fused
// multiply-adds.
template <bool kGelu>
void glu_mul_x86_t(const float* g, const float* u, float* y, int64_t n) {
  const __m256 lo = _mm256_set1_ps(-87.0f), hi = _mm256_set1_ps(88.0f);
  const __m256 log2e = _mm256_set1_ps(1.4426950408889634f), round = _mm256_set1_ps(12582912.0f);
  const __m256 ln2_hi = _mm256_set1_ps(0.693145751953125f);
  const __m256 ln2_lo = _mm256_set1_ps(1.428606765330187e-06f);
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 c2 = _mm256_set1_ps(0.5f), c3 = _mm256_set1_ps(0.16666667f),
               c4 = _mm256_set1_ps(0.041666668f), c5 = _mm256_set1_ps(0.008333334f),
               c6 = _mm256_set1_ps(0.0013888889f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    __m256 a = gv;
    if constexpr (kGelu) {
      const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(gv, gv), gv);
      a = _mm256_mul_ps(_mm256_set1_ps(1.5957691216057308f),
                        _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), cube, gv));
    }
    // max and min take their second operand where the first is NaN: a NaN g gives -87 here, and
    // NaN below (g itself is the numerator).
    const __m256 x = _mm256_min_ps(_mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), a), lo), hi);
    const __m256 m = _mm256_sub_ps(_mm256_fmadd_ps(x, log2e, round), round);
    const __m256 r = _mm256_fnmadd_ps(m, ln2_lo, _mm256_fnmadd_ps(m, ln2_hi, x));
    __m256 p = _mm256_fmadd_ps(r, c6, c5);
    p = _mm256_fmadd_ps(r, p, c4);
    p = _mm256_fmadd_ps(r, p, c3);
    p = _mm256_fmadd_ps(r, p, c2);
    p = _mm256_fmadd_ps(r, p, one);
    p = _mm256_fmadd_ps(r, p, one);
    const __m256 scale = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(m), _mm256_set1_epi32(127)), 23));
    const __m256 e = _mm256_fmadd_ps(p, scale, one);
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_div_ps(gv, e), _mm256_loadu_ps(u + i)));
  }
  for (; i < n; ++i) y[i] = glu_mul_one(g[i], u[i], kGelu);
}
void glu_mul_x86(const float* g, const float* u, float* y, int64_t n, bool gelu) {
  (gelu ? glu_mul_x86_t<true> : glu_mul_x86_t<false>)(g, u, y, n);
}

}  // namespace
}  // namespace quant_impl
}  // namespace ggraph
