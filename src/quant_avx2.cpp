// AVX2 + FMA + F16C kernels. This file alone is compiled with those instruction sets; quant.cpp
// calls into it only after checking the running CPU. Everything here has internal linkage and
// uses no inline functions from shared headers, so no AVX2 copy of one can leak to other code.
//
// Each output element is computed by one fixed sequence whatever the tile shape: one 8-lane
// accumulator per (row, column), blocks in order, then a fixed horizontal sum. Register tiles
// only decide how many such sequences run side by side.
#include "quant_impl.h"

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

#include <immintrin.h>

#include <cstring>
#include <utility>

namespace ggraph {
namespace quant_impl {
namespace {

constexpr int kQK = 32;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// An f16 scale broadcast to all lanes.
inline __m256 broadcast_f16(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(load_u16(p))));
}

// 16 bytes of packed nibbles to 32 bytes in element order: low nibbles are elements 0..15.
inline __m256i unpack_nibbles(const uint8_t* qs) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

// Sums of four adjacent u8*s8 products as floats. Pair sums stay within int16: the unsigned side
// is at most 128 (|int8| or a nibble) and the signed side at most 127 in magnitude.
inline __m256 dot_u8s8(__m256i u, __m256i s) {
  const __m256i pairs = _mm256_maddubs_epi16(u, s);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// ----- activations --------------------------------------------------------------------------

void prepare_q8_avx2(const float* x, void* dst, int64_t k) {
  const int64_t nb = k / kQK;
  const int64_t nbp = padded_blocks(k);
  int8_t* q = static_cast<int8_t*>(dst);
  float* d = reinterpret_cast<float*>(q + k);
  float* s = d + nbp;
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  for (int64_t b = 0; b < nb; ++b, x += kQK, q += kQK) {
    __m256 v[4];
    __m256i amax = _mm256_setzero_si256();
#pragma GCC unroll 16
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
      std::memset(q, 0, kQK);
      const float nan = __builtin_nanf("");
      d[b] = s[b] = nan;
      continue;
    }
    float amax_f;
    std::memcpy(&amax_f, &amax_bits, sizeof(amax_f));
    const __m256 id = _mm256_set1_ps(amax_f != 0.0f ? 127.0f / amax_f : 0.0f);
    __m256i qi[4];
#pragma GCC unroll 16
    for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));
    const __m256i sum8 =
        _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    __m128i sum4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
    sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0x4e));
    sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0xb1));
    // Packing interleaves 128-bit lanes; the permute restores element order.
    const __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]);
    const __m256i p16b = _mm256_packs_epi32(qi[2], qi[3]);
    const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
    const __m256i ordered =
        _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), ordered);
    d[b] = amax_f / 127.0f;
    s[b] = d[b] * static_cast<float>(_mm_cvtsi128_si32(sum4));
  }
  for (int64_t b = nb; b < nbp; ++b) d[b] = s[b] = 0.0f;
  const size_t used = static_cast<size_t>(k + 8 * nbp);
  std::memset(static_cast<uint8_t*>(dst) + used, 0, q8_act_size(k) - used);
}

void prepare_f32_avx2(const float* x, void* dst, int64_t k) {
  std::memcpy(dst, x, static_cast<size_t>(k) * sizeof(float));
  std::memset(static_cast<float*>(dst) + k, 0, f32_act_size(k) - static_cast<size_t>(k) * 4);
}

// ----- Q4_0 / Q4_1 ---------------------------------------------------------------------------

// Q4_0 is handled as Q4_1 with minimum -8 d. The minimum's term, sum over blocks of m * s, is
// summed apart from the block dots, 8 blocks at a time.
template <bool kQ4_1>
struct Q4 {
  static constexpr size_t kBlock = kQ4_1 ? 20 : 18;
  static constexpr size_t kQs = kQ4_1 ? 4 : 2;
  static constexpr int64_t kChunk = 256;  // blocks of minimums converted per pass

  template <int NR, int NC>
  static void tile(int64_t k, const uint8_t* w, size_t w_stride, const uint8_t* act,
                   size_t act_stride, float* out, size_t out_stride) {
    const int64_t nb = k / kQK;
    __m256 acc[NR][NC];
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r)
#pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();
    const float* da_col[NC];
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) da_col[c] = act_scales(act + c * act_stride, k);

    for (int64_t b = 0; b < nb; ++b) {
      __m256i wq[NR];
      __m256 dw[NR];
#pragma GCC unroll 16
      for (int r = 0; r < NR; ++r) {
        const uint8_t* blk = w + r * w_stride + b * kBlock;
        wq[r] = unpack_nibbles(blk + kQs);
        dw[r] = broadcast_f16(blk);
      }
#pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) {
        const __m256i aq =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(act + c * act_stride + b * kQK));
        const __m256 da = _mm256_broadcast_ss(da_col[c] + b);
#pragma GCC unroll 16
        for (int r = 0; r < NR; ++r) {
          acc[r][c] = _mm256_fmadd_ps(_mm256_mul_ps(dw[r], da), dot_u8s8(wq[r], aq), acc[r][c]);
        }
      }
    }

    const int64_t nbp = padded_blocks(k);
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) {
      const uint8_t* row = w + r * w_stride;
      __m256 acc_min[NC];
#pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) acc_min[c] = _mm256_setzero_ps();
      alignas(32) uint16_t mins[kChunk];
      for (int64_t b0 = 0; b0 < nbp; b0 += kChunk) {
        const int64_t n = nbp - b0 < kChunk ? nbp - b0 : kChunk;
        for (int64_t i = 0; i < n; ++i) {
          const int64_t b = b0 + i;
          mins[i] = b < nb ? load_u16(row + b * kBlock + (kQ4_1 ? 2 : 0)) : 0;
        }
        for (int64_t i = 0; i < n; i += 8) {
          __m256 m8 = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(mins + i)));
          if (!kQ4_1) m8 = _mm256_mul_ps(m8, _mm256_set1_ps(-8.0f));
#pragma GCC unroll 16
          for (int c = 0; c < NC; ++c) {
            const __m256 s8 = _mm256_loadu_ps(act_sums(act + c * act_stride, k) + b0 + i);
            acc_min[c] = _mm256_fmadd_ps(m8, s8, acc_min[c]);
          }
        }
      }
#pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) out[c * out_stride + r] = hsum(acc[r][c]) + hsum(acc_min[c]);
    }
  }
};

// ----- Q8_0 ----------------------------------------------------------------------------------

struct Q8 {
  static constexpr size_t kBlock = 34;

  template <int NR, int NC>
  static void tile(int64_t k, const uint8_t* w, size_t w_stride, const uint8_t* act,
                   size_t act_stride, float* out, size_t out_stride) {
    const int64_t nb = k / kQK;
    __m256 acc[NR][NC];
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r)
#pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();
    const float* da_col[NC];
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) da_col[c] = act_scales(act + c * act_stride, k);

    for (int64_t b = 0; b < nb; ++b) {
      __m256i wq[NR], wabs[NR];
      __m256 dw[NR];
#pragma GCC unroll 16
      for (int r = 0; r < NR; ++r) {
        const uint8_t* blk = w + r * w_stride + b * kBlock;
        wq[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
        wabs[r] = _mm256_abs_epi8(wq[r]);
        dw[r] = broadcast_f16(blk);
      }
#pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) {
        const __m256i aq =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(act + c * act_stride + b * kQK));
        const __m256 da = _mm256_broadcast_ss(da_col[c] + b);
#pragma GCC unroll 16
        for (int r = 0; r < NR; ++r) {
          // |w| * (a * sign(w)) = w * a, so the unsigned-by-signed multiply applies.
          const __m256 p = dot_u8s8(wabs[r], _mm256_sign_epi8(aq, wq[r]));
          acc[r][c] = _mm256_fmadd_ps(_mm256_mul_ps(dw[r], da), p, acc[r][c]);
        }
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r)
#pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) out[c * out_stride + r] = hsum(acc[r][c]);
  }
};

// ----- float weights -------------------------------------------------------------------------

struct LoadF32 {
  static __m256 load(const uint8_t* p) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  }
  static constexpr size_t kSize = 4;
};
struct LoadF16 {
  static __m256 load(const uint8_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static constexpr size_t kSize = 2;
};
struct LoadBF16 {
  static __m256 load(const uint8_t* p) {
    const __m256i wide =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static constexpr size_t kSize = 2;
};

template <typename L>
struct Float {
  template <int NR, int NC>
  static void tile(int64_t k, const uint8_t* w, size_t w_stride, const uint8_t* act,
                   size_t act_stride, float* out, size_t out_stride) {
    __m256 acc[NR][NC];
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r)
#pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();
    const int64_t k8 = k / 8 * 8;
    for (int64_t i = 0; i < k8; i += 8) {
      __m256 wv[NR];
#pragma GCC unroll 16
      for (int r = 0; r < NR; ++r) wv[r] = L::load(w + r * w_stride + i * L::kSize);
#pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) {
        const __m256 x = _mm256_loadu_ps(reinterpret_cast<const float*>(act + c * act_stride) + i);
#pragma GCC unroll 16
        for (int r = 0; r < NR; ++r) acc[r][c] = _mm256_fmadd_ps(wv[r], x, acc[r][c]);
      }
    }
    if (k8 < k) {
      // The tail runs as one more 8-wide step over zero-padded weights; prepared activations
      // are zero-padded already, so the extra lanes add exact zeros.
      __m256 wv[NR];
#pragma GCC unroll 16
      for (int r = 0; r < NR; ++r) {
        alignas(32) uint8_t tail[32] = {};
        std::memcpy(tail, w + r * w_stride + k8 * L::kSize, static_cast<size_t>(k - k8) * L::kSize);
        wv[r] = L::load(tail);
      }
#pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) {
        const __m256 x = _mm256_loadu_ps(reinterpret_cast<const float*>(act + c * act_stride) + k8);
#pragma GCC unroll 16
        for (int r = 0; r < NR; ++r) acc[r][c] = _mm256_fmadd_ps(wv[r], x, acc[r][c]);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r)
#pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) out[c * out_stride + r] = hsum(acc[r][c]);
  }
};

// ----- tiling --------------------------------------------------------------------------------

using Micro = void (*)(int64_t, const uint8_t*, size_t, const uint8_t*, size_t, float*, size_t);

// Register tile shapes: kMatVecRows rows for single columns (memory-bound), kRows x kCols
// otherwise.
template <typename K, int kRows, int kCols, int kMatVecRows>
struct Tiler {
  struct Table {
    Micro tiles[kRows][kCols];
    Micro matvec[kMatVecRows];
  };
  template <int... I>
  static void fill_tiles(Table& t, std::integer_sequence<int, I...>) {
    ((t.tiles[I / kCols][I % kCols] = &K::template tile<I / kCols + 1, I % kCols + 1>), ...);
  }
  template <int... I>
  static void fill_matvec(Table& t, std::integer_sequence<int, I...>) {
    ((t.matvec[I] = &K::template tile<I + 1, 1>), ...);
  }
  static Table make_table() {
    Table t{};
    fill_tiles(t, std::make_integer_sequence<int, kRows * kCols>());
    fill_matvec(t, std::make_integer_sequence<int, kMatVecRows>());
    return t;
  }

  static void run(int64_t k, const uint8_t* w, size_t w_stride, int n_rows, const uint8_t* act,
                  size_t act_stride, int n_cols, float* out, size_t out_stride) {
    static const Table table = make_table();
    if (n_cols == 1) {
      int r = 0;
      for (; r + kMatVecRows <= n_rows; r += kMatVecRows) {
        table.matvec[kMatVecRows - 1](k, w + r * w_stride, w_stride, act, act_stride, out + r,
                                      out_stride);
      }
      if (r < n_rows) {
        table.matvec[n_rows - r - 1](k, w + r * w_stride, w_stride, act, act_stride, out + r,
                                     out_stride);
      }
      return;
    }
    // Rows outside, columns inside: a register tile's weights are read once from memory and
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

const Kernels kAvx2 = {
    "avx2 fma f16c",
    Tiler<Float<LoadF32>, 4, 3, 4>::run,
    Tiler<Float<LoadF16>, 4, 3, 4>::run,
    Tiler<Float<LoadBF16>, 4, 3, 4>::run,
    Tiler<Q8, 2, 4, 4>::run,
    Tiler<Q4<false>, 2, 4, 4>::run,
    Tiler<Q4<true>, 2, 4, 4>::run,
    prepare_q8_avx2,
    prepare_f32_avx2,
};

}  // namespace

const Kernels* avx2_kernels() { return &kAvx2; }

}  // namespace quant_impl
}  // namespace ggraph

#else

namespace ggraph {
namespace quant_impl {
const Kernels* avx2_kernels() { return nullptr; }
}  // namespace quant_impl
}  // namespace ggraph

#endif
