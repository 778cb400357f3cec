// The AVX512-VNNI kernel set with the 32-element block formats' register tiles moved onto AMX's
// int8 tile products, for CPUs that have AMX (Sapphire Rapids and later). One tile product gives
// a block's exact integer dot for 16 rows and up to 16 columns at once (the A tile: each row's 32
// quants of the block in element order; the B tile: each column's 32 activation values, four to
// a dword), the whole-block sums every set takes; each is then converted and fused with the
// product of the block scales into the even or odd blocks' sum, the minimums' sums as the VNNI
// tile takes them, so every output element takes the same sequence of operations as in the other
// sets, bit for bit. quant.cpp calls into it only after checking the running CPU and asking the
// OS for the tiles' state (arch_prctl).
#include "quant_impl.h"

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BW__) &&      \
    defined(__AVX512VL__) && defined(__AVX512VNNI__) && defined(__AMX_TILE__) && \
    defined(__AMX_INT8__) && defined(__FMA__) && defined(__F16C__)

#include <vector>

// quant_x86.h's helpers that this set takes from quant_avx512.cpp go unused here; and GCC takes
// the 512-bit intrinsics' own undefined operands for uninitialized values.
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "quant_x86.h"

namespace ggraph {
namespace quant_impl {
namespace {

// The tile registers' shapes (palette 1); the intrinsics take tile numbers as literals.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Fewer columns than this keep the VNNI register tiles (measured: at four columns the tiles'
// trips through memory cost what they save).
constexpr int kMinCols = 6;
// Columns of one pass over a row group's weights (their sums' registers: 16 rows of 8).
constexpr int kCols = 8;

// The VNNI set's tiles, for the products the AMX tiles leave to them.
TileFn g_vnni_tile[kTypeSlots] = {};

struct alignas(64) ZF {
  __m512 v;
};

// A pair of blocks' tile products: block b's into C tile CE, b + 1's (where `two`) into CO,
// their A tiles (16 rows of 32 quants, even block then odd) from a, their B tiles (8 rows of 8
// dwords) from bt; tiles 2 and 3 (6 and 7) take the even (odd) block's operands. GCC's tile
// intrinsics write the tile numbers into the instructions' text, so each pair of C tiles is a
// struct of its own (TILE_PAIR).
#define GGRAPH_TILE_DP(U, C, A, B) \
  do {                             \
    if constexpr (U)               \
      _tile_dpbusd(C, A, B);       \
    else                           \
      _tile_dpbssd(C, A, B);       \
  } while (0)
#define GGRAPH_TILE_PAIR(NAME, CE, CO)                                           \
  template <bool kUnsigned>                                                      \
  struct NAME {                                                                  \
    static void issue(const uint8_t (*a)[16][32], const uint8_t* bt, bool two) { \
      _tile_loadd(2, a[0], 32);                                                  \
      _tile_loadd(3, bt, 32);                                                    \
      _tile_zero(CE);                                                            \
      GGRAPH_TILE_DP(kUnsigned, CE, 2, 3);                                       \
      if (two) {                                                                 \
        _tile_loadd(6, a[1], 32);                                                \
        _tile_loadd(7, bt + 256, 32);                                            \
        _tile_zero(CO);                                                          \
        GGRAPH_TILE_DP(kUnsigned, CO, 6, 7);                                     \
      }                                                                          \
    }                                                                            \
    static void store(int32_t (*c)[16][8], bool two) {                           \
      _tile_stored(CE, c[0], 32);                                                \
      if (two) _tile_stored(CO, c[1], 32);                                       \
    }                                                                            \
  };
GGRAPH_TILE_PAIR(TilePair01, 0, 1)
GGRAPH_TILE_PAIR(TilePair45, 4, 5)
#undef GGRAPH_TILE_PAIR
#undef GGRAPH_TILE_DP

template <Fmt F, DType T>
struct AmxTile {
  static constexpr size_t kBlock = Format<F>::kBlock;
  // Nibbles (and Q5's fifth bits) are unsigned, Q8_0's and IQ4_NL's values signed.
  static constexpr bool kUnsigned = Format<F>::kNibbles;

  struct Scratch {
    std::vector<uint8_t> b;  // B tiles, 256 bytes a block (8 rows of 8 columns' 4 bytes)
    std::vector<ZF> da;      // the columns' activation scales of each block, twice
    std::vector<ZF> sa;      // the columns' d * sum of each block (a float each)
    std::vector<ZF> m;       // a 16-row group's minimums of each block
  };
  static Scratch& scratch() {
    static thread_local Scratch s;
    return s;
  }

  static void run(int64_t k, const uint8_t* w, size_t w_stride, int n_rows, const uint8_t* act,
                  size_t act_stride, int n_cols, float* out, size_t out_stride) {
    int c0 = 0;
    // (An empty product, k = 0, has no block for the tiles: the VNNI tile writes its zeros.)
    for (; k >= kQK && n_cols - c0 >= kMinCols; c0 += kCols) {
      const int nc = n_cols - c0 < kCols ? n_cols - c0 : kCols;
      columns(k, w, w_stride, n_rows, act + c0 * act_stride, act_stride, nc, out + c0 * out_stride,
              out_stride);
    }
    if (c0 < n_cols)
      g_vnni_tile[slot(T)](k, w, w_stride, n_rows, act + c0 * act_stride, act_stride, n_cols - c0,
                           out + c0 * out_stride, out_stride);
  }

  // Up to kCols columns. The C tiles' rows (one weight row's 8 columns) pair up in a 512-bit
  // register, rows 2p and 2p + 1: the even and odd blocks' sums of the 16 rows stay in 16
  // registers through the row group's blocks. The minimums' sums (a product of the row's
  // minimum and the column's d * sum a block, in four sums by block % 4) go after them, a column
  // at a time with its 16 rows in a register.
  static void columns(int64_t k, const uint8_t* w, size_t w_stride, int n_rows, const uint8_t* act,
                      size_t act_stride, int nc, float* out, size_t out_stride) {
    const int64_t nb = k / kQK;
    Scratch& s = scratch();
    s.b.resize(size_t(nb) * 256);
    s.da.resize(size_t(nb));
    s.sa.resize(size_t(nb));
    s.m.resize(size_t(nb));
    // The columns' B tiles and scales, once a call, gathered: column c's elements 4 kd .. 4 kd + 3
    // of block b at row kd, dword c (the activation's pair order: elements 0..15 of block b at
    // 64 (b / 2) + 16 (b % 2), 16..31 32 bytes on); columns from nc on are zeros.
    alignas(64) int32_t cols[16], ds_cols[16];
    for (int i = 0; i < 16; ++i) {
      cols[i] = static_cast<int32_t>((i % 8) * act_stride + (i < 8 ? 0 : 4));
      ds_cols[i] = static_cast<int32_t>((i % 8) * act_stride);
    }
    const __m512i vcols = _mm512_load_si512(cols), vds = _mm512_load_si512(ds_cols);
    const __mmask16 live = static_cast<__mmask16>(((1u << nc) - 1) * 0x0101u);
    const float* ds0 = act_ds(act, k);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* q = act + 64 * (b / 2) + 16 * (b % 2);
      __m512i* bt = reinterpret_cast<__m512i*>(&s.b[size_t(b) * 256]);
      for (int kd = 0; kd < 8; kd += 2)  // rows kd and kd + 1 of the tile
        _mm512_storeu_si512(bt + kd / 2,
                            _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, vcols,
                                                        q + (kd < 4 ? 4 * kd : 16 + 4 * kd), 1));
      // Each column's (d, d * sum) of block b: d in both halves, d * sum in the low one.
      const __m512 d = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, vds, ds0 + 2 * b, 1);
      s.da[size_t(b)].v = d;
      s.sa[size_t(b)].v =
          _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live & 0xff, vds, ds0 + 2 * b + 1, 1);
    }

    TileConfig cfg;
    for (int t : {0, 1, 4, 5}) cfg.rows[t] = 16, cfg.colsb[t] = 32;  // C: 16 rows of 8 int32
    for (int t : {2, 6}) cfg.rows[t] = 16, cfg.colsb[t] = 32;        // A: 16 rows of 32 quants
    for (int t : {3, 7}) cfg.rows[t] = 8, cfg.colsb[t] = 32;         // B: 8 rows of 8 dwords
    _tile_loadconfig(&cfg);
    alignas(64) uint8_t ab[2][2][16][32];  // two pairs' A tiles, each an even and an odd block
    const uint8_t* bt = s.b.data();
    alignas(64) int32_t cbuf[2][16][8];
    // Row 2p's scale in the low 8 lanes, 2p + 1's in the high 8.
    alignas(64) static const int32_t kPairIdx[8][16] = {
        {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1},
        {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
        {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5},
        {6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7},
        {8, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 9},
        {10, 10, 10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11},
        {12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13},
        {14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15, 15, 15}};
    for (int r0 = 0; r0 < n_rows; r0 += 16) {
      const int nr = n_rows - r0 < 16 ? n_rows - r0 : 16;
      const uint8_t* rows[16];
      alignas(64) int32_t offs[16];
      for (int r = 0; r < 16; ++r) {
        rows[r] = w + size_t(r0 + (r < nr ? r : nr - 1)) * w_stride;
        offs[r] = static_cast<int32_t>(rows[r] - rows[0]);
      }
      const __m512i voff = _mm512_load_si512(offs);
      __m512 acc[2][8];
      for (int p = 0; p < 8; ++p) acc[0][p] = acc[1][p] = _mm512_setzero_ps();
      // Block b's sums (C tile cb) into the rows' even or odd sums, and its minimums kept.
      auto scale = [&](int64_t b, const int32_t(*cb)[8], __m512(&a)[8]) {
        // The 16 rows' first four bytes of block b: the scale (and the minimum) as halves.
        const __m512i g = _mm512_i32gather_epi32(voff, rows[0] + b * kBlock, 1);
        const __m512 dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
        if constexpr (Format<F>::kStoredMin)
          s.m[size_t(b)].v = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16)));
        else if constexpr (Format<F>::kMin)
          s.m[size_t(b)].v = _mm512_mul_ps(dw, _mm512_set1_ps(F == Fmt::kQ4_0 ? -8.0f : -16.0f));
        const __m512 da = s.da[size_t(b)].v;
        for (int p = 0; p < 8; ++p) {
          const __m512 sc =
              _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_load_si512(kPairIdx[p]), dw), da);
          a[p] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(_mm512_load_si512(cb[2 * p])), a[p]);
        }
      };
      // A pair of blocks goes through three stages, each a pair ahead of the next: its A tiles
      // assembled (the rows' quants in element order; rows past the end repeat the last, never
      // stored), its tile products issued, and their sums stored and scaled. So the tile unit
      // runs a pair's products while the vector unit scales the pair before and assembles the
      // pair after, and a tile load never waits on the stores just made to its memory.
      auto assemble = [&](int64_t b, uint8_t(*dst)[16][32]) {
        const bool two = b + 1 < nb;
        for (int r = 0; r < 16; ++r) {
          __m256i lo, hi;
          if (two)
            load_pair<F, true>(rows[r] + b * kBlock, &lo, &hi);
          else
            load_pair<F, false>(rows[r] + b * kBlock, &lo, &hi);
          _mm256_store_si256(reinterpret_cast<__m256i*>(dst[0][r]),
                             _mm256_permute2x128_si256(lo, hi, 0x20));
          _mm256_store_si256(reinterpret_cast<__m256i*>(dst[1][r]),
                             _mm256_permute2x128_si256(lo, hi, 0x31));
        }
      };
      const int64_t n_pairs = (nb + 1) / 2;
      // The weights stream from memory (a decode batch reads each once), and 16 rows' streams
      // are more than the hardware prefetchers follow: each pair requests its share of the next
      // row group's lines into L2, so that the group finds them in the cache. (Into L1 the
      // requests held the core's line-fill buffers: the prefetch took 13% of the kernel's
      // samples, and a decode batch of 8 stepped 5% slower; BENCHMARKS.md.)
      const uint8_t* ahead = rows[0] + 16 * w_stride;
      const int64_t ahead_lines = r0 + 32 <= n_rows ? int64_t(16 * w_stride + 63) / 64
                                  : r0 + 16 < n_rows
                                      ? int64_t((n_rows - r0 - 16) * w_stride + 63) / 64
                                      : 0;
      const int64_t per_pair = (ahead_lines + n_pairs - 1) / n_pairs;
      int64_t next_line = 0;
      assemble(0, ab[0]);
      if (n_pairs > 1) assemble(2, ab[1]);
      TilePair01<kUnsigned>::issue(ab[0], bt, nb > 1);
      for (int64_t j = 0; j < n_pairs; ++j) {
        const int64_t b = 2 * j;
        for (int64_t i = 0; i < per_pair && next_line < ahead_lines; ++i, ++next_line)
          _mm_prefetch(reinterpret_cast<const char*>(ahead + 64 * next_line), _MM_HINT_T1);
        const bool next = j + 1 < n_pairs, two = b + 1 < nb;
        if (j % 2 == 0) {
          if (next) TilePair45<kUnsigned>::issue(ab[1], bt + (b + 2) * 256, b + 3 < nb);
          if (j + 2 < n_pairs) assemble(b + 4, ab[0]);
          TilePair01<kUnsigned>::store(cbuf, two);
        } else {
          if (next) TilePair01<kUnsigned>::issue(ab[0], bt + (b + 2) * 256, b + 3 < nb);
          if (j + 2 < n_pairs) assemble(b + 4, ab[1]);
          TilePair45<kUnsigned>::store(cbuf, two);
        }
        scale(b, cbuf[0], acc[0]);
        if (two) scale(b + 1, cbuf[1], acc[1]);
      }
      // Each (row, column)'s even and odd sums, rows r (lanes 0..7) and r + 1 (8..15) a pair.
      alignas(64) float sum[16][8];
      for (int p = 0; p < 8; ++p) _mm512_store_ps(sum[2 * p], _mm512_add_ps(acc[0][p], acc[1][p]));
      const __m512i row_of = _mm512_mullo_epi32(
          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
          _mm512_set1_epi32(8));
      for (int c = 0; c < nc; ++c) {
        __m512 v = _mm512_i32gather_ps(row_of, &sum[0][c], 4);  // column c's 16 rows
        if constexpr (Format<F>::kMin) {
          // The minimums' products m s, block b's into the sums of blocks b % 4, as the VNNI
          // tile's odd lanes take them (a product, then an addition); then (0 + 2) + (1 + 3).
          __m512 am[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                          _mm512_setzero_ps()};
          const float* sa = reinterpret_cast<const float*>(s.sa.data()) + c;
          for (int64_t b = 0; b < nb; ++b)
            am[b % 4] = _mm512_add_ps(
                am[b % 4],
                materialize512(_mm512_mul_ps(s.m[size_t(b)].v, _mm512_set1_ps(sa[16 * b]))));
          v = _mm512_add_ps(
              v, _mm512_add_ps(_mm512_add_ps(am[0], am[2]), _mm512_add_ps(am[1], am[3])));
        }
        if (nr == 16)
          _mm512_storeu_ps(out + c * out_stride + r0, v);
        else
          _mm512_mask_storeu_ps(out + c * out_stride + r0, (1u << nr) - 1, v);
      }
    }
    _tile_release();
  }
};

Kernels make_kernels() {
  const Kernels* vnni = avx512_table();
  Kernels k = *vnni;
  k.features = "avx2 fma f16c avx512vl avx512vnni amx-int8";
  for (int i = 0; i < kTypeSlots; ++i) g_vnni_tile[i] = vnni->tile[i];
  k.tile[slot(DType::Q8_0)] = AmxTile<Fmt::kQ8_0, DType::Q8_0>::run;
  k.tile[slot(DType::Q4_0)] = AmxTile<Fmt::kQ4_0, DType::Q4_0>::run;
  k.tile[slot(DType::Q4_1)] = AmxTile<Fmt::kQ4_1, DType::Q4_1>::run;
  k.tile[slot(DType::Q5_0)] = AmxTile<Fmt::kQ5_0, DType::Q5_0>::run;
  k.tile[slot(DType::Q5_1)] = AmxTile<Fmt::kQ5_1, DType::Q5_1>::run;
  k.tile[slot(DType::IQ4_NL)] = AmxTile<Fmt::kIQ4_NL, DType::IQ4_NL>::run;
  return k;
}

}  // namespace

const Kernels* amx_table() {
  if (avx512_table() == nullptr) return nullptr;
  static const Kernels kernels = make_kernels();
  return &kernels;
}

}  // namespace quant_impl
}  // namespace ggraph

#else

namespace ggraph {
namespace quant_impl {
const Kernels* amx_table() { return nullptr; }
}  // namespace quant_impl
}  // namespace ggraph

#endif
