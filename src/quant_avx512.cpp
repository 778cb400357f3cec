// The x86 kernels built for AVX512 F/BW/VL + VNNI on top of AVX2 + FMA + F16C: the same
// arithmetic as quant_avx2.cpp with vpdpbusd for the 8-bit dots of the 32-element block formats
// (the K-quants scale each 4-product sum by its sub-block scale, which maddubs + madd do in as
// many instructions) and 32 vector registers for larger register tiles; the 4-bit formats'
// products of several columns take 16 rows a register instead (GroupTile). quant.cpp calls into
// it only after checking the running CPU.
#include "quant_impl.h"

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512VNNI__) && defined(__FMA__) && defined(__F16C__)

// GCC takes the 512-bit intrinsics' own undefined operands for uninitialized values.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <array>
#include <utility>
#include <vector>

#include "quant_x86.h"

namespace ggraph {
namespace quant_impl {
namespace {

// ----- 16-row groups ----------------------------------------------------------------------------
// Several columns of the 4-bit block formats. Where QuantTile holds four (row, column) block
// sums in a vector and adds each block's lanes across, here one column's 16 rows are the 16
// lanes of one register: a group of 16 rows' quants is transposed once, 4 bytes of a row to a
// lane, so that each vpdpbusd adds 4 products of all 16 rows against 4 bytes of one column
// broadcast from memory, and a block's eight such steps (four dwords of nibble pairs, low and
// high) leave the 16 rows' exact block dots with no horizontal adds. A 576 x 1536 Q4_1 product
// of 8 columns from the cache: 172-184 GFLOP/s a thread, against the four-row tiles' 140; Q8_0,
// with twice the bytes to transpose and no nibbles to unpack, measured slower and keeps them.
// The float steps are every set's (the scale product fused into the even or odd blocks' sum, the
// minimums' products in four sums by block % 4, then (even + odd) + ((0 + 2) + (1 + 3))), so
// the bits are those of the other tiles.
//
// Lane e of a transposed register holds row 4 (e % 4) + e / 4 of the group (what a 4 x 4 dword
// transpose within 128-bit lanes leaves); the outputs are permuted back to row order as they
// store.
constexpr int kGroupRows = 16;
constexpr int kGroupCols = 8;     // columns a pass over a group's blocks
constexpr int kGroupMinCols = 2;  // fewer go to QuantTile's register tiles

inline int group_lane_row(int e) { return 4 * (e % 4) + e / 4; }

// Dwords 0..3 of the 16 bytes at p + r * stride, r = 0..15: out[j] lane e = row
// group_lane_row(e)'s dword j.
inline void transpose16(const uint8_t* p, size_t stride, __m512i* out) {
  __m512i R[4];
  for (int g = 0; g < 4; ++g) {
    const uint8_t* q = p + 4 * g * stride;
    __m512i v = _mm512_castsi128_si512(load128(q));
    v = _mm512_inserti32x4(v, load128(q + stride), 1);
    v = _mm512_inserti32x4(v, load128(q + 2 * stride), 2);
    R[g] = _mm512_inserti32x4(v, load128(q + 3 * stride), 3);
  }
  const __m512i t0 = _mm512_unpacklo_epi32(R[0], R[1]), t1 = _mm512_unpackhi_epi32(R[0], R[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(R[2], R[3]), t3 = _mm512_unpackhi_epi32(R[2], R[3]);
  out[0] = _mm512_unpacklo_epi64(t0, t2);
  out[1] = _mm512_unpackhi_epi64(t0, t2);
  out[2] = _mm512_unpacklo_epi64(t1, t3);
  out[3] = _mm512_unpackhi_epi64(t1, t3);
}

template <Fmt F>
struct GroupTile {
  static_assert(F == Fmt::kQ4_0 || F == Fmt::kQ4_1, "4-bit quants");
  static constexpr size_t kBlock = Format<F>::kBlock;
  // A block of the group as the passes read it: the quants' dwords (nibble pairs, unpacked as
  // they are used), the scales and the minimums.
  struct alignas(64) Block {
    __m512i q[4];
    __m512 d, m;
  };
  using Fallback = Tiler<QuantTile<DotVnni, F>, 4, 4, 4>;

  // Weight slot s of a block (s < 4: the low nibbles of dword s, s >= 4: the high nibbles of
  // dword s - 4) against the activation bytes at this offset from the block's.
  static constexpr int act_offset(int s) { return s < 4 ? 4 * s : 32 + 4 * (s - 4); }

  static void run(int64_t k, const uint8_t* w, size_t w_stride, int n_rows, const uint8_t* act,
                  size_t act_stride, int n_cols, float* out, size_t out_stride) {
    const int64_t nb = k / kQK;
    const int groups = n_rows / kGroupRows;
    if (n_cols < kGroupMinCols || nb == 0 || groups == 0 ||
        kGroupRows * w_stride > size_t(INT32_MAX)) {
      Fallback::run(k, w, w_stride, n_rows, act, act_stride, n_cols, out, out_stride);
      return;
    }
    thread_local std::vector<Block> blocks;
    blocks.resize(size_t(nb));
    alignas(64) int32_t offs[kGroupRows], inv[kGroupRows];
    for (int e = 0; e < kGroupRows; ++e) {
      offs[e] = static_cast<int32_t>(group_lane_row(e) * w_stride);
      inv[group_lane_row(e)] = e;
    }
    const __m512i voff = _mm512_load_si512(offs), vinv = _mm512_load_si512(inv);
    Source src{nullptr, w_stride, voff, vinv, nullptr, 0, 0};
    for (int g = 0; g < groups; ++g) {
      src.rows = w + size_t(g) * kGroupRows * w_stride;
      // The first pass transposes the group's blocks (kept for the passes after it) and requests
      // the next group's lines, a share a block: 16 rows' streams are more than the hardware
      // prefetchers follow.
      src.ahead = src.rows + kGroupRows * w_stride;
      src.lines = g + 1 < groups ? int64_t(kGroupRows * w_stride + 63) / 64 : 0;
      src.per = (src.lines + nb - 1) / nb;
      float* o = out + g * kGroupRows;
      for (int c = 0; c < n_cols; c += kGroupCols) {
        const int nc = n_cols - c < kGroupCols ? n_cols - c : kGroupCols;
        const uint8_t* a = act + c * act_stride;
        float* oc = o + c * out_stride;
        (c == 0 ? kFirstPasses : kLaterPasses)[nc - 1](nb, blocks.data(), src, a, act_stride, k, oc,
                                                       out_stride);
      }
    }
    const int done = groups * kGroupRows;
    if (done < n_rows)
      Fallback::products(k, w + size_t(done) * w_stride, w_stride, n_rows - done, act, act_stride,
                         n_cols, out + done, out_stride);
    _mm256_zeroupper();
  }

  // Block b of the 16 rows from p = the first row's block, stride bytes apart.
  static void load_block(const uint8_t* p, size_t stride, __m512i voff, Block* blk) {
    constexpr size_t Q = Format<F>::kQs;
    transpose16(p + Q, stride, blk->q);
    // Each row's first 4 bytes: the scale (and the minimum) as halves.
    const __m512i head = _mm512_i32gather_epi32(voff, p, 1);
    blk->d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
    if constexpr (Format<F>::kStoredMin)
      blk->m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)));
    else
      blk->m = _mm512_mul_ps(blk->d, _mm512_set1_ps(-8.0f));  // Q4_0: exact
  }

  // Where a group's first pass finds its blocks: the first row's, stride bytes apart (lane
  // offsets voff; vinv: each row's lane), and the lines to request ahead, per a block.
  struct Source {
    const uint8_t* rows;
    size_t stride;
    __m512i voff, vinv;
    const uint8_t* ahead;
    int64_t lines, per;
  };

  // NC columns against a group's blocks, transposed first (kLoad) or as a pass before left
  // them; out[c * out_stride + r] for its 16 rows.
  template <int NC, bool kLoad>
  static void pass(int64_t nb, Block* blocks, const Source& src, const uint8_t* act,
                   size_t act_stride, int64_t k, float* out, size_t out_stride) {
    const float* ds[NC];
    for (int c = 0; c < NC; ++c) ds[c] = act_ds(act + c * act_stride, k);
    __m512 acc[NC][2];
    for (int c = 0; c < NC; ++c) acc[c][0] = acc[c][1] = _mm512_setzero_ps();
    const __m512i mask = _mm512_set1_epi8(0x0f);
    int64_t next = 0;
    for (int64_t b = 0; b < nb; ++b) {
      if constexpr (kLoad) {
        for (int64_t i = 0; i < src.per && next < src.lines; ++i, ++next)
          _mm_prefetch(reinterpret_cast<const char*>(src.ahead + 64 * next), _MM_HINT_T0);
        load_block(src.rows + b * kBlock, src.stride, src.voff, &blocks[b]);
      }
      const Block& blk = blocks[b];
      const uint8_t* ab = act + 64 * (b / 2) + 16 * (b % 2);
      __m512i is[NC];
      for (int c = 0; c < NC; ++c) is[c] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int s = 0; s < 8; ++s) {
        const __m512i q = s < 4 ? _mm512_and_si512(blk.q[s], mask)
                                : _mm512_and_si512(_mm512_srli_epi16(blk.q[s - 4], 4), mask);
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c)
          is[c] = _mm512_dpbusd_epi32(
              is[c], q,
              _mm512_set1_epi32(static_cast<int>(load_u32(ab + c * act_stride + act_offset(s)))));
      }
      for (int c = 0; c < NC; ++c) {
        const __m512 sc = _mm512_mul_ps(blk.d, _mm512_set1_ps(ds[c][2 * b]));
        acc[c][b % 2] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(is[c]), acc[c][b % 2]);
      }
    }
    for (int c = 0; c < NC; ++c) {
      __m512 m[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
      for (int64_t b = 0; b < nb; ++b)
        m[b % 4] = _mm512_add_ps(
            m[b % 4], materialize512(_mm512_mul_ps(blocks[b].m, _mm512_set1_ps(ds[c][2 * b + 1]))));
      const __m512 v =
          _mm512_add_ps(_mm512_add_ps(acc[c][0], acc[c][1]),
                        _mm512_add_ps(_mm512_add_ps(m[0], m[2]), _mm512_add_ps(m[1], m[3])));
      _mm512_storeu_ps(out + c * out_stride, _mm512_permutexvar_ps(src.vinv, v));
    }
  }

  using PassFn = void (*)(int64_t, Block*, const Source&, const uint8_t*, size_t, int64_t, float*,
                          size_t);
  template <bool kLoad, int... I>
  static constexpr std::array<PassFn, kGroupCols> passes(std::integer_sequence<int, I...>) {
    return {&pass<I + 1, kLoad>...};
  }
  // Passes of 1 to kGroupCols columns, a group's first and the ones after it.
  static constexpr std::array<PassFn, kGroupCols> kFirstPasses =
      passes<true>(std::make_integer_sequence<int, kGroupCols>());
  static constexpr std::array<PassFn, kGroupCols> kLaterPasses =
      passes<false>(std::make_integer_sequence<int, kGroupCols>());
};

Kernels make_kernels() {
  Kernels k{};
  k.features = "avx2 fma f16c avx512vl avx512vnni";
  k.tile[slot(DType::F32)] = Tiler<FloatTile<LoadF32>, 4, 4, 4>::run;
  k.tile[slot(DType::F16)] = Tiler<FloatTile<LoadF16>, 4, 4, 4>::run;
  k.tile[slot(DType::BF16)] = Tiler<FloatTile<LoadBF16>, 4, 4, 4>::run;
  set_block_tiles<DotVnni, 4>(k);
  k.tile[slot(DType::Q4_0)] = GroupTile<Fmt::kQ4_0>::run;
  k.tile[slot(DType::Q4_1)] = GroupTile<Fmt::kQ4_1>::run;
  k.tile[slot(DType::Q2_K)] = Tiler<KQuantTile<DType::Q2_K>, 4, 4, 2>::run;
  k.tile[slot(DType::Q3_K)] = Tiler<KQuantTile<DType::Q3_K>, 4, 4, 2>::run;
  k.tile[slot(DType::Q4_K)] = Tiler<KQuantTile<DType::Q4_K>, 4, 4, 2>::run;
  k.tile[slot(DType::Q5_K)] = Tiler<KQuantTile<DType::Q5_K>, 4, 4, 2>::run;
  k.tile[slot(DType::Q6_K)] = Tiler<KQuantTile<DType::Q6_K>, 4, 4, 2>::run;
  k.tile[slot(DType::IQ4_XS)] = Tiler<KQuantTile<DType::IQ4_XS>, 4, 4, 2>::run;
  k.prepare[slot(ActLayout::kFloat)] = prepare_f32_x86;
  k.prepare[slot(ActLayout::kQ8K)] = prepare_q8k_x86;
  k.prepare[slot(ActLayout::kQ8)] = prepare_q8_x86;
  k.to_float[slot(DType::F16)] = to_float_f16_x86;
  k.f16_from_float = f16_from_float_x86;
  k.to_float[slot(DType::Q8_0)] = to_float_q8_0_x86;
  k.attn_rows = attn_rows_x86;
  k.attn_rows_f16 = attn_rows_f16_x86;
  k.glu_mul = glu_mul_x86;
  return k;
}

}  // namespace

const Kernels* avx512_table() {
  static const Kernels kernels = make_kernels();
  return &kernels;
}

}  // namespace quant_impl
}  // namespace ggraph

#else

namespace ggraph {
namespace quant_impl {
const Kernels* avx512_table() { return nullptr; }
}  // namespace quant_impl
}  // namespace ggraph

#endif
