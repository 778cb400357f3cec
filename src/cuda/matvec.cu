// Matrix products with weights: mat-vec kernels for a few columns (decode) and tensor-core tiled
// kernels for many (prompt). Weights are [k, n] with row n contiguous (k elements).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#include "cuda/device_util.cuh"
#include "cuda/kernels.cuh"
#include "cuda/weight_layout.h"

namespace ggraph::cuda {

namespace {

constexpr int kMvThreads = 256;  // 8 warps

// Up to three weight matrices launched together: block b of the grid belongs to part 0 below
// blk1, to part 1 below blk2, to part 2 above.
struct PartSel {
  const uint8_t* w;
  int n;
  float* dst;
  int local_block;
  int index;  // 0, 1 or 2
};
__device__ __forceinline__ PartSel select_part(const uint8_t* w0, const uint8_t* w1,
                                               const uint8_t* w2, int n0, int n1, int n2, float* d0,
                                               float* d1, float* d2, int blk1, int blk2) {
  const int b = blockIdx.x;
  if (b < blk1) return {w0, n0, d0, b, 0};
  if (b < blk2) return {w1, n1, d1, b - blk1, 1};
  return {w2, n2, d2, b - blk2, 2};
}

// The rope epilogue (MatVecRope) of rows row and row + 1 (row even) of part `part` (0 q, 1 k,
// 2 v; n rows, output dst), whose products are x0 and x1: the rope kernel's rotation and K/V
// stores of that pair, bit for bit (kernels.cu's rope_slot and rope_write, one token, normal mode).
// The rope angle of that pair (none for v, or past the rotated dimensions: rotate false): from
// the table where it holds the position, else worked out.
__device__ __forceinline__ void rope_pair_angle(const MatVecRope& r, int part, int row, float& sf,
                                                float& cf, bool& rotate) {
  const int i0 = row % r.head_dim;
  rotate = part != 2 && i0 < r.n_dims;
  if (rotate)
    rope_angle_from(r.table, r.table_rows, *r.pos, i0 / 2, r.n_dims, r.freq_base, r.freq_scale,
                    r.freq_factors, sf, cf);
}
// The cache row the epilogue writes: that of position *first_row.
__device__ __forceinline__ int64_t rope_cache_row(const MatVecRope& r) {
  return kv_store_row(r.first_row, nullptr, 0, 1, r.rows);
}
// Q8_0 caches: the ticket of the group of 32 values that holds rows row and row + 1 of part
// `part` (1 k, 2 v), taken by the pair's writer after its stores: whether it was the group's
// last pair.
__device__ __forceinline__ bool rope_q8_ticket(const MatVecRope& r, int part, int row) {
  return last_ticket(r.q8_tickets + (part == 2 ? r.v_tickets : 0) + row / 32, 2, 32);
}
// The same with the angle given (rope_pair_angle's). Returns whether the pair was the last of
// its group of 32 values into a Q8_0 cache (rope_q8_ticket): its warp then stores the group
// (rope_q8_groups).
__device__ __forceinline__ bool rope_epilogue_pair_at(const MatVecRope& r, int part, int n,
                                                      float* dst, int row, float x0, float x1,
                                                      float sf, float cf, bool rotate) {
  const int64_t at = rope_cache_row(r) * n + row;
  if (part == 2) {
    dst[row] = x0;
    dst[row + 1] = x1;
    if (r.q8_tickets) return rope_q8_ticket(r, part, row);
    __half* c = static_cast<__half*>(r.v_cache) + at;
    c[0] = __float2half_rn(x0);
    c[1] = __float2half_rn(x1);
    return false;
  }
  float y0 = x0, y1 = x1;
  if (rotate) rope_rotate(x0, x1, sf, cf, y0, y1);
  float* out = part == 0 ? r.q_out : r.k_out;
  out[row] = y0;
  out[row + 1] = y1;
  if (part != 1) return false;
  if (r.q8_tickets) return rope_q8_ticket(r, part, row);
  __half* c = static_cast<__half*>(r.k_cache) + at;
  c[0] = __float2half_rn(y0);
  c[1] = __float2half_rn(y1);
  return false;
}

// The pair's angle and epilogue, one after the other (the block kernels, after their sums).
__device__ __forceinline__ bool rope_epilogue_pair(const MatVecRope& r, int part, int n, float* dst,
                                                   int row, float x0, float x1) {
  float sf = 0.0f, cf = 1.0f;
  bool rotate = false;
  rope_pair_angle(r, part, row, sf, cf, rotate);
  return rope_epilogue_pair_at(r, part, n, dst, row, x0, x1, sf, cf, rotate);
}

// Q8_0 caches: the whole warp quantizes the groups whose last pair one of its lanes wrote: bit p
// of `lasts` (the same in every lane) names pair p, and pair(p, part, n, dst, row) says which
// part, rows and output it was (k's values are read from k_out, v's from dst).
template <typename Pair>
__device__ __forceinline__ void rope_q8_groups(const MatVecRope& r, unsigned lasts, Pair pair) {
  if (!lasts) return;
  const int lane = threadIdx.x % 32;
  __syncwarp();  // the ticket's acquire, in the lane that took it, before every lane's reads
  for (; lasts; lasts &= lasts - 1) {
    int part, n, row;
    const float* dst;
    pair(__ffs(lasts) - 1, part, n, dst, row);
    const int group = row / 32;
    const float x = __ldcg((part == 2 ? dst : r.k_out) + group * 32 + lane);
    const int64_t at = rope_cache_row(r) * (n / 32) + group;
    store_q8_0_warp_block(x, static_cast<uint8_t*>(part == 2 ? r.v_cache : r.k_cache) + at * 34,
                          lane);
  }
}

// Pair p of a warp's rows from row0 of one part, as rope_q8_groups asks for it.
__device__ __forceinline__ auto part_pairs(const PartSel& part, int row0) {
  return [part, row0](int p, int& pi, int& n, const float*& d, int& row) {
    pi = part.index, n = part.n, d = part.dst, row = row0 + p;
  };
}

// The rope epilogue of a warp's R rows from row0 of one part (R even; every lane holds the
// rows' sums): lane 0 rotates and stores each pair, then the warp quantizes the Q8_0 groups its
// pairs completed.
template <int R>
__device__ __forceinline__ void rope_warp_rows(const MatVecRope& rope, const PartSel& part,
                                               int row0, const float (&sums)[R]) {
  static_assert(R % 2 == 0, "pairs of rows");
  unsigned lasts = 0;
  if (threadIdx.x % 32 == 0) {
#pragma unroll
    for (int j = 0; j < R; j += 2) {
      if (row0 + j < part.n &&
          rope_epilogue_pair(rope, part.index, part.n, part.dst, row0 + j, sums[j], sums[j + 1]))
        lasts |= 1u << j;
    }
  }
  if (rope.q8_tickets)
    rope_q8_groups(rope, __shfl_sync(0xffffffffu, lasts, 0), part_pairs(part, row0));
}

// ---- Quantized mat-vec ------------------------------------------------------------------------
//
// Weights in the split layout (cuda/weight_layout.h): a row's quants are contiguous 16-byte
// pieces (one Q4 block, half a Q8_0 block), its scales a separate array. A warp owns R rows;
// lane j takes pieces j, j + 32, ... of each, U pieces per row in flight, so a warp's loads of
// one row lie side by side (512 contiguous bytes). Each piece is dotted with the 8-bit activation
// (quantized once per mat-mul) by dp4a; the activation words are loaded once for all R rows.

constexpr int kMvqWarps = 4;
constexpr int kMvqThreads = 32 * kMvqWarps;

// A piece is 16 bytes of quants: 32 elements of a 4-, 5- or 6-bit format, 16 of Q8_0.
template <int TYPE>
struct PieceInfo {
  static constexpr SplitFormat kFormat = split_format(static_cast<DType>(TYPE));
  static constexpr int kScaleBytes = kFormat.scale_bytes;
  static constexpr int kHighBytes = kFormat.high_bytes;                // a piece's high bits
  static constexpr int kPer32 = kFormat.quant_bytes / 16;              // pieces per 32 elements
  static constexpr int kPerScale = kFormat.block_elems / 32 * kPer32;  // pieces a scale record
  static constexpr int kActBytes = 32 / kPer32;  // activation bytes a piece meets
  // A scale (Q2_K: and a minimum) for each half of a piece, which needs the activation's sum
  // over each half.
  static constexpr bool kHalfScales = TYPE == kTypeQ2_K || TYPE == kTypeQ3_K || TYPE == kTypeQ6_K;
  // Words of scale a piece keeps: the K-quants' whole 16-byte record (d, dmin, packed 6-bit
  // scales and minimums), IQ4_XS's 8 bytes (d, the scales' high and low bits), Q2_K's two (its
  // two scale-and-minimum bytes, then d and dmin); one word otherwise (Q3_K and Q6_K: their two
  // int8 scales and d).
  static constexpr int kScaleWords = TYPE == kTypeQ4_K || TYPE == kTypeQ5_K     ? 4
                                     : TYPE == kTypeIQ4_XS || TYPE == kTypeQ2_K ? 2
                                                                                : 1;
};

// What a lane holds of one piece of one row: quants, high bits, scales.
template <int TYPE>
struct PieceRegs {
  uint4 q;
  uint32_t h[PieceInfo<TYPE>::kHighBytes > 0 ? PieceInfo<TYPE>::kHighBytes / 4 : 1];
  uint32_t s[PieceInfo<TYPE>::kScaleWords];
};

// Weights are read once: keep them out of L1, where the activation lives.
__device__ __forceinline__ uint4 ldg_stream16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Loads the piece at quants q, high bits h and scale record s; j is the piece's sub-block within
// a K-quant block (which of Q6_K's scales it takes).
template <int TYPE>
__device__ __forceinline__ void load_piece(PieceRegs<TYPE>& r, const uint4* q, const uint8_t* h,
                                           const uint8_t* s, int j) {
  using P = PieceInfo<TYPE>;
  r.q = ldg_stream16(q);
  if constexpr (P::kHighBytes == 4) {
    r.h[0] = __ldg(reinterpret_cast<const uint32_t*>(h));
  } else if constexpr (P::kHighBytes == 8) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(h));
    r.h[0] = v.x, r.h[1] = v.y;
  }
  if constexpr (TYPE == kTypeQ2_K) {
    // Sub-block j's two scale-and-minimum bytes; d and dmin.
    r.s[0] = __ldg(reinterpret_cast<const uint16_t*>(s) + j);
    r.s[1] = __ldg(reinterpret_cast<const uint32_t*>(s + 16));
  } else if constexpr (P::kScaleWords == 4) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(s));
    r.s[0] = v.x, r.s[1] = v.y, r.s[2] = v.z, r.s[3] = v.w;
  } else if constexpr (P::kScaleWords == 2) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(s));
    r.s[0] = v.x, r.s[1] = v.y;
  } else if constexpr (TYPE == kTypeQ6_K || TYPE == kTypeQ3_K) {
    // Sub-block j's two int8 scales, and d above them.
    r.s[0] = static_cast<uint32_t>(__ldg(reinterpret_cast<const uint16_t*>(s) + j)) |
             static_cast<uint32_t>(__ldg(reinterpret_cast<const uint16_t*>(s + 16))) << 16;
  } else if constexpr (P::kScaleBytes == 4) {
    r.s[0] = __ldg(reinterpret_cast<const uint32_t*>(s));
  } else {
    r.s[0] = __ldg(reinterpret_cast<const uint16_t*>(s));
  }
}

template <int TYPE>
__device__ __forceinline__ void zero_piece(PieceRegs<TYPE>& r) {
  r.q = make_uint4(0, 0, 0, 0);
  for (uint32_t& v : r.h) v = 0;
  for (uint32_t& v : r.s) v = 0;
}

// Four products of unsigned bytes of a with signed bytes of b, added to c.
__device__ __forceinline__ int dp4a_us(uint32_t a, int b, int c) {
  int d;
  asm("dp4a.u32.s32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// The byte order in which iq4_levels4 leaves the levels (0, 2, 1, 3); an IQ4 piece's activation
// words are permuted the same way when loaded.
constexpr uint32_t kIQ4ActOrder = 0x3120;

// The activation a piece meets: 8 words (a whole 32) or 4 (half a Q8_0 block), its 32's
// (d, d * sum(q)), and for the formats with a scale per 16 the sums of q over each half.
struct PieceAct {
  int a[8];
  float2 ad;
  int sum_lo, sum_hi;
};

// What every path to a piece's activation does last: IQ4's word order, and the sums over each
// half for the formats with a scale per 16.
template <int TYPE>
__device__ __forceinline__ void finish_piece_act(PieceAct& x) {
  if constexpr (TYPE == kTypeIQ4_NL || TYPE == kTypeIQ4_XS) {
#pragma unroll
    for (int& a : x.a) a = static_cast<int>(__byte_perm(static_cast<uint32_t>(a), 0, kIQ4ActOrder));
  }
  if constexpr (PieceInfo<TYPE>::kHalfScales) {
    x.sum_lo = x.sum_hi = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x.sum_lo = __dp4a(x.a[i], 0x01010101, x.sum_lo);
      x.sum_hi = __dp4a(x.a[i + 4], 0x01010101, x.sum_hi);
    }
  }
}

template <int TYPE>
__device__ __forceinline__ void load_piece_act(const int8_t* ap, const float2* dp, PieceAct& x) {
  const int4 lo = load_after_wait(reinterpret_cast<const int4*>(ap));
  x.a[0] = lo.x, x.a[1] = lo.y, x.a[2] = lo.z, x.a[3] = lo.w;
  if constexpr (PieceInfo<TYPE>::kPer32 == 1) {
    const int4 hi = load_after_wait(reinterpret_cast<const int4*>(ap) + 1);
    x.a[4] = hi.x, x.a[5] = hi.y, x.a[6] = hi.z, x.a[7] = hi.w;
  }
  x.ad = load_after_wait(dp);
  finish_piece_act<TYPE>(x);
}

template <int TYPE>
__device__ __forceinline__ void zero_piece_act(PieceAct& x) {
  for (int& v : x.a) v = 0;
  x.ad = make_float2(0.0f, 0.0f);
  x.sum_lo = x.sum_hi = 0;
}

// A lane's piece of a one-column activation of ne0 = 32 * pieces <= 1024 values (a format of
// one piece a 32, kPer32 == 1; lane l takes piece l) made from the float input of the norm before
// it, as the rows kernels take it with a NormFold: the 8-bit blocks of rms_norm(src + add) * w,
// worked out once a block, bit for bit what launch_rms_norm's one-block kernel (a thread a value)
// and its quantization write. Warp j of the block takes pieces j, j + kMvqWarps, ...: a piece's
// 32 values are one warp's, as a warp of that kernel holds them, so each piece's sum of squares
// is that warp's (warp_sum's butterfly, the warp's pieces side by side) and their total the
// kernel's, and the warp quantizes its pieces together (quantize_warp_blocks) into shared memory.
// Every thread of the block must call it. The grid's first block also stores src + add to sum_out.
template <int TYPE>
__device__ __forceinline__ void fold_block_act(const NormFold& f, PieceAct& x) {
  static_assert(PieceInfo<TYPE>::kPer32 == 1, "a whole 32 a piece");
  constexpr int kMax = 32 / kMvqWarps;  // pieces a warp at most
  __shared__ int4 qs[64];
  __shared__ float2 ds[32];
  __shared__ float partial[32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int pieces = f.ne0 / 32;
  // A warp's 32s side by side (zeros past the pieces), so that their reductions interleave.
  float v[kMax], w[kMax], sq[kMax];
  int64_t at[kMax];
  bool ok[kMax];
#pragma unroll
  for (int j = 0; j < kMax; ++j) {
    const int p = warp + kMvqWarps * j;
    ok[j] = p < pieces;
    at[j] = 32 * p + lane;
    v[j] = w[j] = 0.0f;
    if (ok[j]) {
      v[j] = load_after_wait(f.src + at[j]);
      if (f.add) v[j] = __fadd_rn(v[j], load_after_wait(f.add + at[j]));
      w[j] = __ldg(f.w + at[j]);
      if (f.sum_out && blockIdx.x == 0) f.sum_out[at[j]] = v[j];
    }
    sq[j] = __fmul_rn(v[j], v[j]);
  }
  // warp_sum of each, its butterfly step by step for all of them at once.
#pragma unroll
  for (int level = 0; level < 5; ++level) {
#pragma unroll
    for (int j = 0; j < kMax; ++j) sq[j] += __shfl_xor_sync(0xffffffffu, sq[j], 16 >> level);
  }
  if (lane == 0) {
#pragma unroll
    for (int j = 0; j < kMax; ++j) {
      if (ok[j]) partial[warp + kMvqWarps * j] = sq[j];
    }
  }
  __syncthreads();
  const float total = warp_sum(lane < pieces ? partial[lane] : 0.0f);
  const float scale = 1.0f / sqrtf(total / static_cast<float>(f.ne0) + f.eps);
  float r[kMax];
#pragma unroll
  for (int j = 0; j < kMax; ++j) r[j] = __fmul_rn(__fmul_rn(v[j], scale), w[j]);
  quantize_warp_blocks<kMax>(r, at, ok, reinterpret_cast<int8_t*>(qs), ds);
  __syncthreads();
  if (lane < pieces) {
    const int4 lo = qs[2 * lane], hi = qs[2 * lane + 1];
    x.a[0] = lo.x, x.a[1] = lo.y, x.a[2] = lo.z, x.a[3] = lo.w;
    x.a[4] = hi.x, x.a[5] = hi.y, x.a[6] = hi.z, x.a[7] = hi.w;
    x.ad = ds[lane];
    finish_piece_act<TYPE>(x);
  } else {
    zero_piece_act<TYPE>(x);
  }
}

// Piece `piece` of column t of the activation.
template <int TYPE>
__device__ __forceinline__ void load_piece_act(const int8_t* aq, const float2* ads, int64_t k,
                                               int nb, int t, int piece, PieceAct& x) {
  using P = PieceInfo<TYPE>;
  load_piece_act<TYPE>(aq + t * k + static_cast<int64_t>(piece) * P::kActBytes,
                       ads + static_cast<int64_t>(t) * nb + piece / P::kPer32, x);
}

// The high bits of word i of the first (second) half of a piece, as bits 4.. of each byte
// (cuda/weight_layout.h lays them out so that this is a shift and a mask; i is a constant once
// the callers' loops are unrolled).
template <int HB>
__device__ __forceinline__ uint32_t high_lo(const uint32_t* h, int i) {
  if constexpr (HB == 4) return (h[0] >> i) & 0x10101010u;
  // Two bits at 8b + {4, 6, 0, 2}[i].
  const uint32_t v = i == 0 ? h[0] : i == 1 ? h[0] >> 2 : i == 2 ? h[0] << 4 : h[0] << 2;
  return v & 0x30303030u;
}
template <int HB>
__device__ __forceinline__ uint32_t high_hi(const uint32_t* h, int i) {
  if constexpr (HB == 4) return (h[0] << (4 - i)) & 0x10101010u;
  return high_lo<HB>(h + 1, i);
}

// The signed IQ4 levels of four indices, one in the low nibble of each byte of q (the high
// nibbles are ignored), in the byte order 0, 2, 1, 3 (kIQ4ActOrder: the activation words they
// meet are permuted the same way, once for all rows). Two byte permutes pick each index's level
// among the first and the last eight, selected by the indices' low three bits packed as
// t | t >> 12; a third turns each index's bit 3 into a byte mask that chooses between them.
__device__ __forceinline__ int iq4_levels4(uint32_t q) {
  constexpr uint32_t kL0 = 0xBFAD9881u, kL1 = 0xF6EADDCFu;  // levels 0-3, 4-7
  constexpr uint32_t kL2 = 0x26190D01u, kL3 = 0x71594535u;  // levels 8-11, 12-15
  const uint32_t t = q & 0x07070707u;
  const uint32_t sel = t | (t >> 12);
  const uint32_t lo = __byte_perm(kL0, kL1, sel), hi = __byte_perm(kL2, kL3, sel);
  // Bytes 0x80 where bit 3 is set, spread over their byte in the same order by prmt's sign
  // replication (selector nibbles with bit 3 set; __byte_perm ignores that bit).
  uint32_t upper;
  asm("prmt.b32 %0, %1, 0, 0xB9A8;\n" : "=r"(upper) : "r"((q & 0x08080808u) << 4));
  return static_cast<int>((hi & upper) | (lo & ~upper));
}

// IQ4_XS sub-block j's scale (offset by 32 as stored) from the record's words: d | scales_h
// << 16, then scales_l (weight_layout.h's iq4_xs_scale).
__device__ __forceinline__ int iq4_xs_scale_dev(const uint32_t* s, int j) {
  return static_cast<int>(((s[1] >> (4 * j)) & 15) | (((s[0] >> (16 + 2 * j)) & 3) << 4)) - 32;
}

// One piece's contribution to a row's dot product; j is the piece's sub-block in a K-quant block.
template <int TYPE>
__device__ __forceinline__ void piece_dot(const PieceRegs<TYPE>& r, int j, const PieceAct& x,
                                          float& acc) {
  constexpr int HB = PieceInfo<TYPE>::kHighBytes;
  const uint32_t w[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
  const float2 ad = x.ad;
  if constexpr (TYPE == kTypeQ8_0) {
    int sum = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) sum = __dp4a(static_cast<int>(w[i]), x.a[i], sum);
    acc += f16_bits_to_float(static_cast<uint16_t>(r.s[0])) * static_cast<float>(sum) * ad.x;
  } else if constexpr (TYPE == kTypeIQ4_NL || TYPE == kTypeIQ4_XS) {
    // Byte j holds the indices of elements j and j + 16; their levels are signed bytes.
    int sum = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      sum = __dp4a(iq4_levels4(w[i]), x.a[i], sum);
      sum = __dp4a(iq4_levels4(w[i] >> 4), x.a[i + 4], sum);
    }
    float d = f16_bits_to_float(static_cast<uint16_t>(r.s[0] & 0xFFFF));
    if constexpr (TYPE == kTypeIQ4_XS) d *= static_cast<float>(iq4_xs_scale_dev(r.s, j));
    acc += d * ad.x * static_cast<float>(sum);
  } else if constexpr (TYPE == kTypeQ2_K || TYPE == kTypeQ3_K) {
    // 2- and 3-bit quants in nibbles, a scale for each half: the high nibbles dotted in place as
    // 16 times their value, as for the 4-bit formats below, and the sums scaled to match.
    int lo = 0, hi = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      lo = dp4a_us(w[i] & 0x0F0F0F0Fu, x.a[i], lo);
      hi = dp4a_us(w[i] & 0xF0F0F0F0u, x.a[i + 4], hi);
    }
    // Q2_K's second record word is d | dmin; Q3_K keeps d in its first (weight_layout.h).
    acc += half_scaled_piece_dot(static_cast<DType>(TYPE), lo, hi, x.sum_lo, x.sum_hi, r.s[0],
                                 r.s[PieceInfo<TYPE>::kScaleWords - 1], ad.x);
  } else if constexpr (HB == 0) {
    // Byte j of the quants holds element j (low nibble) and element j + 16 (high nibble). The
    // high nibbles are dotted in place, as unsigned bytes 16 times their value, which saves
    // shifting them down: lo + hi / 16 is the sum, 16 * lo + hi is 16 times it, exactly.
    int lo = 0, hi = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      lo = dp4a_us(w[i] & 0x0F0F0F0Fu, x.a[i], lo);
      hi = dp4a_us(w[i] & 0xF0F0F0F0u, x.a[i + 4], hi);
    }
    const float sum = static_cast<float>(lo * 16 + hi);
    const float ad16 = ad.x * 0.0625f;  // the same for every row: computed once
    if constexpr (TYPE == kTypeQ4_0) {
      // sum((q - 8) * d * a_i * d8) = d * (d8 * sum(q a) - 8 * d8 * sum(a))
      const float d = f16_bits_to_float(static_cast<uint16_t>(r.s[0] & 0xFFFF));
      acc += d * (sum * ad16 - 8.0f * ad.y);
    } else if constexpr (TYPE == kTypeQ4_1) {
      const float d = f16_bits_to_float(static_cast<uint16_t>(r.s[0] & 0xFFFF));
      const float m = f16_bits_to_float(static_cast<uint16_t>(r.s[0] >> 16));
      acc += d * sum * ad16 + m * ad.y;
    } else {
      static_assert(TYPE == kTypeQ4_K, "a 4-bit format");
      const float2 dm = k_scale_min_dev(r.s, j);
      acc += dm.x * sum * ad16 - dm.y * ad.y;
    }
  } else {
    // The high bits join the nibbles in bits 4..; both halves dotted as unsigned bytes.
    int lo = 0, hi = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t ql = high_lo<HB>(r.h, i), qh = high_hi<HB>(r.h, i);
      lo = dp4a_us((w[i] & 0x0F0F0F0Fu) | ql, x.a[i], lo);
      hi = dp4a_us(((w[i] >> 4) & 0x0F0F0F0Fu) | qh, x.a[i + 4], hi);
    }
    if constexpr (TYPE == kTypeQ6_K) {
      // Stored offset by 32, a scale per half: sc0 (q_lo - 32) a_lo + sc1 (q_hi - 32) a_hi.
      const int sc0 = static_cast<int8_t>(r.s[0] & 0xFF);
      const int sc1 = static_cast<int8_t>((r.s[0] >> 8) & 0xFF);
      const int isum = sc0 * (lo - 32 * x.sum_lo) + sc1 * (hi - 32 * x.sum_hi);
      const float d = f16_bits_to_float(static_cast<uint16_t>(r.s[0] >> 16));
      acc += d * ad.x * static_cast<float>(isum);
    } else {
      const float sum = static_cast<float>(lo + hi);
      if constexpr (TYPE == kTypeQ5_0) {
        const float d = f16_bits_to_float(static_cast<uint16_t>(r.s[0] & 0xFFFF));
        acc += d * (sum * ad.x - 16.0f * ad.y);
      } else if constexpr (TYPE == kTypeQ5_1) {
        const float d = f16_bits_to_float(static_cast<uint16_t>(r.s[0] & 0xFFFF));
        const float m = f16_bits_to_float(static_cast<uint16_t>(r.s[0] >> 16));
        acc += d * sum * ad.x + m * ad.y;
      } else {
        static_assert(TYPE == kTypeQ5_K, "a 5-bit format");
        const float2 dm = k_scale_min_dev(r.s, j);
        acc += dm.x * sum * ad.x - dm.y * ad.y;
      }
    }
  }
}

// Block part.local_block of a part's mat-vec: the body of mat_vec_q_kernel and of the mixed
// kernel below. ROPE (one column, R even): the rows' pairs go through rope_epilogue_pair.
template <int TYPE, int NCOLS, int R, int U, int KS, bool ROPE = false>
__device__ __forceinline__ void mat_vec_q_body(const PartSel& part, int nb, const int8_t* aq,
                                               const float2* ads, int64_t k, int overlap,
                                               const MatVecRope& rope = MatVecRope{}) {
  static_assert(!ROPE || (NCOLS == 1 && R % 2 == 0), "the rope epilogue takes pairs of rows");
  using P = PieceInfo<TYPE>;
  static_assert(kMvqWarps % KS == 0, "k splits divide the block's warps");
  // KS warps share rows, each taking every KS-th run of pieces; their sums meet in shared memory.
  constexpr int kStep = 32 * U * KS;  // pieces a warp moves on by per round
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wr = warp / KS, ks = warp % KS;
  const int row0 = (part.local_block * (kMvqWarps / KS) + wr) * R;
  const int n_pieces = nb * P::kPer32;
  // A lane's pieces are lane + 32 u of a round, so their sub-block in a K-quant block is fixed.
  const int sub = lane % 8;
  // Pointers to this lane's pieces of the round (pieces base + lane + 32 u), moved on each round,
  // so that every load takes a constant offset from one of them.
  int base = ks * 32 * U;
  const uint8_t* high = part.w + static_cast<size_t>(part.n) * n_pieces * 16;
  const uint8_t* scales = high + static_cast<size_t>(part.n) * n_pieces * P::kHighBytes;
  const uint4* qp[R];
  const uint8_t* hp[R];
  const uint8_t* sp[R];
#pragma unroll
  for (int j = 0; j < R; ++j) {
    const size_t row = static_cast<size_t>(min(row0 + j, part.n - 1));
    const size_t piece = row * n_pieces + base + lane;
    qp[j] = reinterpret_cast<const uint4*>(part.w) + piece;
    hp[j] = high + piece * P::kHighBytes;
    sp[j] = scales + piece / P::kPerScale * P::kScaleBytes;
  }

  float acc[R][NCOLS];
#pragma unroll
  for (int j = 0; j < R; ++j)
#pragma unroll
    for (int t = 0; t < NCOLS; ++t) acc[j][t] = 0.0f;

  PieceRegs<TYPE> pc[U][R];
  auto load_one = [&](int u, int j) {
    load_piece<TYPE>(pc[u][j], qp[j] + u * 32, hp[j] + u * 32 * P::kHighBytes,
                     sp[j] + u * 32 / P::kPerScale * P::kScaleBytes, sub);
  };
  // A full round loads unconditionally; the last may hold fewer pieces than lanes * U.
  auto load = [&]() {
    if (base + 32 * U <= n_pieces) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int j = 0; j < R; ++j) load_one(u, j);
      }
      return;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const bool ok = base + u * 32 + lane < n_pieces;
#pragma unroll
      for (int j = 0; j < R; ++j) {
        if (ok)
          load_one(u, j);
        else
          zero_piece<TYPE>(pc[u][j]);
      }
    }
  };
  auto advance = [&]() {
    base += kStep;
#pragma unroll
    for (int j = 0; j < R; ++j) {
      qp[j] += kStep;
      hp[j] += kStep * P::kHighBytes;
      sp[j] += kStep / P::kPerScale * P::kScaleBytes;
    }
  };
  // The first pieces' weights may be requested before waiting for the grid before this one
  // (they never change after upload): their latency then overlaps its run.
  const bool prefetch = overlap & 1, early = overlap & 2;
  if (prefetch && base < n_pieces) load();
  pdl_wait();
  if (early) pdl_trigger();
  if (!prefetch && base < n_pieces) load();
  const int8_t* ap = aq + static_cast<int64_t>(base + lane) * P::kActBytes;
  const float2* dp = ads + (base + lane) / P::kPer32;
  // One round's dot products; a full round (every lane has all U pieces) without bounds checks,
  // which lets the activation loads of all columns be issued together.
  auto dot_round = [&](auto full) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (!full && base + u * 32 >= n_pieces) break;
      const bool ok = full || base + u * 32 + lane < n_pieces;
#pragma unroll
      for (int t = 0; t < NCOLS; ++t) {
        PieceAct x;
        if (ok)
          load_piece_act<TYPE>(ap + t * k + u * 32 * P::kActBytes,
                               dp + static_cast<int64_t>(t) * nb + u * 32 / P::kPer32, x);
        else
          zero_piece_act<TYPE>(x);
#pragma unroll
        for (int j = 0; j < R; ++j) piece_dot<TYPE>(pc[u][j], sub, x, acc[j][t]);
      }
    }
  };
  while (base < n_pieces) {
    if (base + 32 * U <= n_pieces)
      dot_round(std::true_type{});
    else
      dot_round(std::false_type{});
    advance();
    ap += kStep * P::kActBytes;
    dp += kStep / P::kPer32;
    if (base < n_pieces) load();
  }

  if (!early) pdl_trigger();
  __shared__ float partial[KS > 1 ? kMvqWarps : 1][R * NCOLS];
  float sums[R];  // ROPE with one warp a row: the rows' sums, for their pairs
#pragma unroll
  for (int j = 0; j < R; ++j) {
#pragma unroll
    for (int t = 0; t < NCOLS; ++t) {
      const float v = warp_sum(acc[j][t]);
      if constexpr (KS == 1) {
        if (ROPE)
          sums[j] = v;
        else if (lane == 0 && row0 + j < part.n)
          part.dst[static_cast<int64_t>(t) * part.n + row0 + j] = v;
      } else {
        if (lane == 0) partial[warp][j * NCOLS + t] = v;
      }
    }
  }
  if constexpr (ROPE && KS == 1) rope_warp_rows<R>(rope, part, row0, sums);
  if constexpr (KS > 1) {
    static_assert(R * NCOLS <= 32, "a lane per sum");
    __syncthreads();
    if constexpr (ROPE) {
      // Lane j sums row j; the even lanes take their pairs.
      if (ks == 0) {
        float v = 0.0f;
        for (int i = 0; i < KS; ++i) v += partial[warp + i][min(lane, R - 1)];
        const float next = __shfl_down_sync(0xffffffffu, v, 1);
        const bool last =
            lane < R && lane % 2 == 0 && row0 + lane < part.n &&
            rope_epilogue_pair(rope, part.index, part.n, part.dst, row0 + lane, v, next);
        if (rope.q8_tickets)
          rope_q8_groups(rope, __ballot_sync(0xffffffffu, last), part_pairs(part, row0));
      }
    } else if (ks == 0 && lane < R * NCOLS) {
      const int j = lane / NCOLS, t = lane % NCOLS;
      float v = 0.0f;
      for (int i = 0; i < KS; ++i) v += partial[warp + i][lane];
      if (row0 + j < part.n) part.dst[static_cast<int64_t>(t) * part.n + row0 + j] = v;
    }
  }
}
template <int TYPE, int NCOLS, int R, int U, int KS>
__global__ void __launch_bounds__(kMvqThreads)
    mat_vec_q_kernel(const uint8_t* w0, const uint8_t* w1, const uint8_t* w2, int n0, int n1,
                     int n2, float* d0, float* d1, float* d2, int blk1, int blk2, int nb,
                     const int8_t* aq, const float2* ads, int64_t k, int overlap) {
  const PartSel part = select_part(w0, w1, w2, n0, n1, n2, d0, d1, d2, blk1, blk2);
  mat_vec_q_body<TYPE, NCOLS, R, U, KS>(part, nb, aq, ads, k, overlap);
}

// q, k and v of one token with the rope epilogue: a kernel of its own, so that the others keep
// their registers.
template <int TYPE, int R, int U, int KS>
__global__ void __launch_bounds__(kMvqThreads)
    mat_vec_q_rope_kernel(const uint8_t* w0, const uint8_t* w1, const uint8_t* w2, int n0, int n1,
                          int n2, float* d0, float* d1, float* d2, int blk1, int blk2, int nb,
                          const int8_t* aq, const float2* ads, int64_t k, int overlap,
                          MatVecRope rope) {
  const PartSel part = select_part(w0, w1, w2, n0, n1, n2, d0, d1, d2, blk1, blk2);
  mat_vec_q_body<TYPE, 1, R, U, KS, true>(part, nb, aq, ads, k, overlap, rope);
}

// Products of one activation in two formats (q and k in one, v in another, as K-quant mixes
// store them) in one launch: blocks below blk_b take format A's body, the rest B's (each
// part's blocks are its format's).
template <int TA, int RA, int UA, int KSA, int TB, int RB, int UB, int KSB>
__global__ void __launch_bounds__(kMvqThreads)
    mat_vec_q_mixed_kernel(const uint8_t* w0, const uint8_t* w1, const uint8_t* w2, int n0, int n1,
                           int n2, float* d0, float* d1, float* d2, int blk1, int blk2, int blk_b,
                           int nb, const int8_t* aq, const float2* ads, int64_t k, int overlap) {
  const PartSel part = select_part(w0, w1, w2, n0, n1, n2, d0, d1, d2, blk1, blk2);
  if (static_cast<int>(blockIdx.x) < blk_b)
    mat_vec_q_body<TA, 1, RA, UA, KSA>(part, nb, aq, ads, k, overlap);
  else
    mat_vec_q_body<TB, 1, RB, UB, KSB>(part, nb, aq, ads, k, overlap);
}
// With the rope epilogue (q and k in format A, v in B).
template <int TA, int RA, int UA, int KSA, int TB, int RB, int UB, int KSB>
__global__ void __launch_bounds__(kMvqThreads)
    mat_vec_q_mixed_rope_kernel(const uint8_t* w0, const uint8_t* w1, const uint8_t* w2, int n0,
                                int n1, int n2, float* d0, float* d1, float* d2, int blk1, int blk2,
                                int blk_b, int nb, const int8_t* aq, const float2* ads, int64_t k,
                                int overlap, MatVecRope rope) {
  const PartSel part = select_part(w0, w1, w2, n0, n1, n2, d0, d1, d2, blk1, blk2);
  if (static_cast<int>(blockIdx.x) < blk_b)
    mat_vec_q_body<TA, 1, RA, UA, KSA, true>(part, nb, aq, ads, k, overlap, rope);
  else
    mat_vec_q_body<TB, 1, RB, UB, KSB, true>(part, nb, aq, ads, k, overlap, rope);
}

// ---- Quantized mat-vec, activation held in registers (one column, short rows) -----------------
//
// For rows of at most 32 * PL pieces: each lane keeps the activation words of its pieces (lane,
// lane + 32, ...) in registers for good, and the warp walks rows (R at a time, all their pieces'
// loads in flight) with a stride of the whole grid, which is as large as the device holds at
// once. The activation crosses L1 once per warp instead of once per row, and a small matrix
// needs few blocks: the SmolLM2-sized mat-vecs measured faster this way.

// Whether a rows kernel of this format and pieces a lane takes a NormFold: rows of one piece a
// lane, each a whole 32 of the activation.
template <int TYPE, int PL>
constexpr bool kFoldsNorm = PL == 1 && PieceInfo<TYPE>::kPer32 == 1;

// Issues a lane's loads of row `row` of matrix w (n rows of n_pieces pieces): pieces lane,
// lane + 32, ... (zeros past the row's end).
template <int TYPE, int PL>
__device__ __forceinline__ void load_row_pieces(PieceRegs<TYPE> (&v)[PL], const uint8_t* w, int n,
                                                int row, int n_pieces, int lane) {
  using P = PieceInfo<TYPE>;
  const size_t first = static_cast<size_t>(row) * n_pieces;
  const uint4* q = reinterpret_cast<const uint4*>(w) + first;
  const uint8_t* high = w + static_cast<size_t>(n) * n_pieces * 16;
  const uint8_t* h = high + first * P::kHighBytes;
  const uint8_t* s = high + static_cast<size_t>(n) * n_pieces * P::kHighBytes +
                     first / P::kPerScale * P::kScaleBytes;
#pragma unroll
  for (int i = 0; i < PL; ++i) {
    const int p = lane + 32 * i;
    if (p < n_pieces)
      load_piece<TYPE>(v[i], q + p, h + p * P::kHighBytes, s + p / P::kPerScale * P::kScaleBytes,
                       lane % 8);
    else
      zero_piece<TYPE>(v[i]);
  }
}

// A lane's pieces of a one-column activation (zeros past the row's end).
template <int TYPE, int PL>
__device__ __forceinline__ void load_lane_act(PieceAct (&x)[PL], const int8_t* aq,
                                              const float2* ads, int64_t k, int nb, int n_pieces,
                                              int lane) {
#pragma unroll
  for (int i = 0; i < PL; ++i) {
    const int p = lane + 32 * i;
    if (p < n_pieces)
      load_piece_act<TYPE>(aq, ads, k, nb, 0, p, x[i]);
    else
      zero_piece_act<TYPE>(x[i]);
  }
}

// A row's sum over the warp from the lanes' pieces (every lane gets it).
template <int TYPE, int PL>
__device__ __forceinline__ float row_sum(const PieceRegs<TYPE> (&v)[PL], const PieceAct (&x)[PL],
                                         int lane) {
  float acc = 0.0f;
#pragma unroll
  for (int i = 0; i < PL; ++i) piece_dot<TYPE>(v[i], lane % 8, x[i], acc);
  return warp_sum(acc);
}

// Warp gw of n_warps walking the rows of parts 0.. (the body of the kernels below). ROPE (R
// even, every part's rows even in number): the rows' pairs go through rope_epilogue_pair_at.
template <int TYPE, int PL, int R, bool ROPE = false>
__device__ __forceinline__ void mat_vec_q_rows_body(
    const uint8_t* w0, const uint8_t* w1, const uint8_t* w2, int n0, int n1, int n2, float* d0,
    float* d1, float* d2, int n_warps, int gw, int nb, const int8_t* aq, const float2* ads,
    int64_t k, int prefetch, const NormFold& fold, const MatVecRope& rope = MatVecRope{},
    int first_part = 0) {
  static_assert(!ROPE || R % 2 == 0, "the rope epilogue takes pairs of rows");
  using P = PieceInfo<TYPE>;
  const int lane = threadIdx.x % 32;
  const int n_rows = n0 + n1 + n2;
  const int n_pieces = nb * P::kPer32;
  PieceRegs<TYPE> v[R][PL];
  float* dst[R];
  int row[R];
  // Issues the loads of rows g0.. (weights only: they never change after upload).
  auto load_rows = [&](int g0) {
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const int g = min(g0 + j, n_rows - 1);
      const uint8_t* w = g < n0 ? w0 : g < n0 + n1 ? w1 : w2;
      const int n = g < n0 ? n0 : g < n0 + n1 ? n1 : n2;
      row[j] = g < n0 ? g : g < n0 + n1 ? g - n0 : g - n0 - n1;
      dst[j] = g < n0 ? d0 : g < n0 + n1 ? d1 : d2;
      load_row_pieces<TYPE, PL>(v[j], w, n, row[j], n_pieces, lane);
    }
  };
  // Fixed weights: the first rows' are requested before waiting for the grid before this one,
  // so that their latency overlaps its run. Warps past n_warps (a two-format launch's last
  // block of a format) take no rows: the others' passes cover them all, and a row's rope
  // epilogue must run once (its Q8_0 ticket counts pairs).
  int g0 = gw < n_warps ? gw * R : n_rows;
  if (prefetch && g0 < n_rows) load_rows(g0);
  pdl_begin();
  if (!prefetch && g0 < n_rows) load_rows(g0);
  PieceAct x[PL];
  // With a NormFold, the norm before the products is worked out here, once a block (fold.src
  // is the same for the whole grid: every thread takes part).
  bool folded = false;
  if constexpr (kFoldsNorm<TYPE, PL>) {
    if (fold.src) {
      fold_block_act<TYPE>(fold, x[0]);
      folded = true;
    }
  }
  if (!folded) load_lane_act<TYPE, PL>(x, aq, ads, k, nb, n_pieces, lane);
  // With rope.early_angle, lane 0 works out the rope angles of rows g0.. while their weights or
  // the activation are on their way, not after their sums: each is a few hundred
  // double-precision instructions, which there lie on the launch's critical path.
  constexpr int kPairs = ROPE ? R / 2 : 1;
  float rsf[kPairs], rcf[kPairs];
  bool rrot[kPairs];
  auto part_of = [&](int g) { return g < n0 ? 0 : g < n0 + n1 ? 1 : 2; };  // of this body's parts
  auto early_angles = [&]() {
    if constexpr (ROPE) {
      if (!rope.early_angle || lane != 0) return;
#pragma unroll
      for (int p = 0; p < kPairs; ++p) {
        rsf[p] = 0.0f, rcf[p] = 1.0f, rrot[p] = false;
        if (g0 + 2 * p < n_rows)
          rope_pair_angle(rope, first_part + part_of(g0 + 2 * p), row[2 * p], rsf[p], rcf[p],
                          rrot[p]);
        asm volatile("" : "+f"(rsf[p]), "+f"(rcf[p]));  // here, not sunk to the epilogue
      }
    }
  };
  early_angles();
  while (g0 < n_rows) {
    float sums[R];
#pragma unroll
    for (int j = 0; j < R; ++j) {
      sums[j] = row_sum<TYPE, PL>(v[j], x, lane);
      if (!ROPE && lane == 0 && g0 + j < n_rows) dst[j][row[j]] = sums[j];
    }
    if constexpr (ROPE) {
      unsigned lasts = 0;
      if (lane == 0) {
#pragma unroll
        for (int j = 0; j < R; j += 2) {
          const int g = g0 + j;
          if (g < n_rows) {
            const int part = part_of(g);
            const int n = part == 0 ? n0 : part == 1 ? n1 : n2;
            if (!rope.early_angle)
              rope_pair_angle(rope, first_part + part, row[j], rsf[j / 2], rcf[j / 2], rrot[j / 2]);
            if (rope_epilogue_pair_at(rope, first_part + part, n, dst[j], row[j], sums[j],
                                      sums[j + 1], rsf[j / 2], rcf[j / 2], rrot[j / 2]))
              lasts |= 1u << j;
          }
        }
      }
      if (rope.q8_tickets)
        rope_q8_groups(rope, __shfl_sync(0xffffffffu, lasts, 0),
                       [&](int p, int& pi, int& n, const float*& d, int& r) {
                         const int part = part_of(g0 + p);
                         pi = first_part + part, n = part == 0 ? n0 : part == 1 ? n1 : n2;
                         d = dst[p], r = row[p];
                       });
    }
    g0 += n_warps * R;
    if (g0 < n_rows) {
      load_rows(g0);
      early_angles();
    }
  }
}

template <int TYPE, int PL, int R>
__global__ void __launch_bounds__(kMvqThreads)
    mat_vec_q_rows_kernel(const uint8_t* w0, const uint8_t* w1, const uint8_t* w2, int n0, int n1,
                          int n2, float* d0, float* d1, float* d2, int n_warps, int nb,
                          const int8_t* aq, const float2* ads, int64_t k, int prefetch,
                          NormFold fold) {
  const int gw = blockIdx.x * kMvqWarps + threadIdx.x / 32;
  mat_vec_q_rows_body<TYPE, PL, R>(w0, w1, w2, n0, n1, n2, d0, d1, d2, n_warps, gw, nb, aq, ads, k,
                                   prefetch, fold);
}

// The rope epilogue's variant (one token's q, k and v).
template <int TYPE, int PL, int R>
__global__ void __launch_bounds__(kMvqThreads)
    mat_vec_q_rows_rope_kernel(const uint8_t* w0, const uint8_t* w1, const uint8_t* w2, int n0,
                               int n1, int n2, float* d0, float* d1, float* d2, int n_warps, int nb,
                               const int8_t* aq, const float2* ads, int64_t k, int prefetch,
                               NormFold fold, MatVecRope rope) {
  const int gw = blockIdx.x * kMvqWarps + threadIdx.x / 32;
  mat_vec_q_rows_body<TYPE, PL, R, true>(w0, w1, w2, n0, n1, n2, d0, d1, d2, n_warps, gw, nb, aq,
                                         ads, k, prefetch, fold, rope);
}

// Two formats in one launch, as mat_vec_q_mixed_kernel: format A's warps take parts 0 and 1
// (n_warps_a of them, in blocks below blk_b), format B's part 2.
template <int TA, int PLA, int TB, int PLB, int R>
__global__ void __launch_bounds__(kMvqThreads)
    mat_vec_q_rows_mixed_kernel(const uint8_t* w0, const uint8_t* w1, const uint8_t* w2, int n0,
                                int n1, int n2, float* d0, float* d1, float* d2, int n_warps_a,
                                int n_warps_b, int blk_b, int nb, const int8_t* aq,
                                const float2* ads, int64_t k, int prefetch, NormFold fold) {
  const int warp = threadIdx.x / 32;
  if (static_cast<int>(blockIdx.x) < blk_b)
    mat_vec_q_rows_body<TA, PLA, R>(w0, w1, w1, n0, n1, 0, d0, d1, d1, n_warps_a,
                                    blockIdx.x * kMvqWarps + warp, nb, aq, ads, k, prefetch, fold);
  else
    mat_vec_q_rows_body<TB, PLB, R>(w2, w2, w2, n2, 0, 0, d2, d2, d2, n_warps_b,
                                    (blockIdx.x - blk_b) * kMvqWarps + warp, nb, aq, ads, k,
                                    prefetch, fold);
}
// With the rope epilogue (q and k in format A, v in B: B's rows are part 2).
template <int TA, int PLA, int TB, int PLB, int R>
__global__ void __launch_bounds__(kMvqThreads)
    mat_vec_q_rows_mixed_rope_kernel(const uint8_t* w0, const uint8_t* w1, const uint8_t* w2,
                                     int n0, int n1, int n2, float* d0, float* d1, float* d2,
                                     int n_warps_a, int n_warps_b, int blk_b, int nb,
                                     const int8_t* aq, const float2* ads, int64_t k, int prefetch,
                                     NormFold fold, MatVecRope rope) {
  const int warp = threadIdx.x / 32;
  if (static_cast<int>(blockIdx.x) < blk_b)
    mat_vec_q_rows_body<TA, PLA, R, true>(w0, w1, w1, n0, n1, 0, d0, d1, d1, n_warps_a,
                                          blockIdx.x * kMvqWarps + warp, nb, aq, ads, k, prefetch,
                                          fold, rope);
  else
    mat_vec_q_rows_body<TB, PLB, R, true>(w2, w2, w2, n2, 0, 0, d2, d2, d2, n_warps_b,
                                          (blockIdx.x - blk_b) * kMvqWarps + warp, nb, aq, ads, k,
                                          prefetch, fold, rope, 2);
}

// ---- The gated unit in the epilogue of gate and up (MatVecGlu) --------------------------------
//
// A block owns 32 outputs, one 8-bit block of the result: each of its 64 / R warps takes R / 2 of
// them, the same R / 2 rows of gate and of up, its R rows' loads in flight at once. A row's sum is
// the rows kernel's (row_sum: the same pieces a lane, the same butterfly), so the products keep
// their bits; the block's warps leave their values in shared memory, and its first warp writes
// the 32 results and quantizes them as the glu kernel's warps do.
template <int R>
constexpr int kGluThreads = 32 * 64 / R;

// Rows of at most 32 * PL pieces (the register-resident kernel's): the activation's pieces in
// registers, every row's loads issued at once.
template <int TYPE, int PL, int R, bool GELU>
__global__ void __launch_bounds__(kGluThreads<R>)
    mat_vec_q_rows_glu_kernel(const uint8_t* gate, const uint8_t* up, int n, int nb,
                              const int8_t* aq, const float2* ads, int64_t k, int prefetch,
                              MatVecGlu glu) {
  static_assert(R % 2 == 0 && 64 % R == 0, "a warp takes R / 2 rows of gate and of up");
  constexpr int kOut = R / 2;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int o0 = blockIdx.x * 32 + warp * kOut;
  const int n_pieces = nb * PieceInfo<TYPE>::kPer32;
  PieceRegs<TYPE> v[R][PL];
  auto load_rows = [&]() {
#pragma unroll
    for (int j = 0; j < R; ++j)
      load_row_pieces<TYPE, PL>(v[j], j < kOut ? gate : up, n, o0 + j % kOut, n_pieces, lane);
  };
  if (prefetch) load_rows();
  pdl_begin();
  if (!prefetch) load_rows();
  PieceAct x[PL];
  load_lane_act<TYPE, PL>(x, aq, ads, k, nb, n_pieces, lane);
  float sums[R];
#pragma unroll
  for (int j = 0; j < R; ++j) sums[j] = row_sum<TYPE, PL>(v[j], x, lane);
  __shared__ float out[32];
  if (lane == 0) {
#pragma unroll
    for (int j = 0; j < kOut; ++j) out[warp * kOut + j] = glu_value<GELU>(sums[j], sums[kOut + j]);
  }
  __syncthreads();
  if (warp != 0) return;
  const float y = out[lane];
  const int64_t i = static_cast<int64_t>(blockIdx.x) * 32 + lane;
  glu.dst[i] = y;
  if (glu.qs) quantize_warp_block(y, i, glu.qs, glu.ds);
}

// Warps of one instantiation (ROPE: its rope epilogue's) resident on the whole device at once
// (measured in prepare_kernels, outside any capture); 0 until then.
template <int TYPE, int PL, int R, bool ROPE = false>
int& rows_kernel_slots() {
  static int slots = 0;
  return slots;
}

// A cap on a register-resident launch's warps (set_rows_kernel_warp_cap; 0: none).
int& rows_warp_cap() {
  static int cap = 0;
  return cap;
}
// The warps a register-resident launch may take of the device's `slots`.
int rows_warps(int slots) { return rows_warp_cap() > 0 ? std::min(slots, rows_warp_cap()) : slots; }

template <int TYPE, int PL, int R, bool ROPE>
void measure_rows_kernel(int sms) {
  int blocks = 0;
  const void* kernel = ROPE ? reinterpret_cast<const void*>(mat_vec_q_rows_rope_kernel<TYPE, PL, R>)
                            : reinterpret_cast<const void*>(mat_vec_q_rows_kernel<TYPE, PL, R>);
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kMvqThreads, 0) !=
      cudaSuccess) {
    cudaGetLastError();
    blocks = 0;
  }
  rows_kernel_slots<TYPE, PL, R, ROPE>() = blocks * sms * kMvqWarps;
}

template <int TYPE>
void measure_rows_kernels(int sms) {
  measure_rows_kernel<TYPE, 1, 2, false>(sms);
  measure_rows_kernel<TYPE, 2, 2, false>(sms);
  measure_rows_kernel<TYPE, 1, 2, true>(sms);
  measure_rows_kernel<TYPE, 2, 2, true>(sms);
}

// ---- Float-weight mat-vec (F32, F16, BF16) ------------------------------------------------------
//
// A warp owns RW rows; lanes read 16 consecutive bytes each (512 bytes per warp load), against
// float activations, two loads per row in flight for one column (measured: BENCHMARKS.md, "Two
// loads in flight in the one-column float mat-vec") and four for more. A lane sums its pieces in
// the same order either way. VEC needs rows aligned to 16 bytes.

template <int TYPE>
struct FloatInfo {
  static constexpr int kElemBytes = TYPE == kTypeF32 ? 4 : 2;
  static constexpr int kVecElems = 16 / kElemBytes;
};

template <int TYPE>
__device__ __forceinline__ void unpack16(const uint4& v, float* out) {
  if constexpr (TYPE == kTypeF32) {
    out[0] = __uint_as_float(v.x), out[1] = __uint_as_float(v.y);
    out[2] = __uint_as_float(v.z), out[3] = __uint_as_float(v.w);
  } else {
    const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (TYPE == kTypeF16) {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&u[i]));
        out[2 * i] = f.x, out[2 * i + 1] = f.y;
      } else {
        out[2 * i] = __uint_as_float(u[i] << 16);
        out[2 * i + 1] = __uint_as_float(u[i] & 0xFFFF0000u);
      }
    }
  }
}

// Block part.local_block of a part's float mat-vec: the body of mat_vec_f_kernel and of the rope
// kernel below. ROPE (one column, RW even): the rows' pairs go through rope_epilogue_pair.
template <int TYPE, int NCOLS, int RW, bool VEC, bool ROPE = false>
__device__ __forceinline__ void mat_vec_f_body(const PartSel& part, int64_t k, const float* x,
                                               int prefetch,
                                               const MatVecRope& rope = MatVecRope{}) {
  static_assert(!ROPE || (NCOLS == 1 && RW % 2 == 0), "the rope epilogue takes pairs of rows");
  constexpr int E = FloatInfo<TYPE>::kVecElems;
  constexpr int U = NCOLS == 1 ? 2 : 4;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row0 = part.local_block * 8 * RW + warp * RW;
  const size_t rb = static_cast<size_t>(k) * FloatInfo<TYPE>::kElemBytes;
  const uint8_t* rows[RW];
#pragma unroll
  for (int j = 0; j < RW; ++j) rows[j] = part.w + min(row0 + j, part.n - 1) * rb;
  float acc[RW][NCOLS];
#pragma unroll
  for (int j = 0; j < RW; ++j)
#pragma unroll
    for (int t = 0; t < NCOLS; ++t) acc[j][t] = 0.0f;

  if constexpr (VEC) {
    const int64_t n_vec = k / E;
    uint4 raw[U][RW];
    auto load = [&](int64_t v0) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t v = v0 + 32 * u;
#pragma unroll
        for (int j = 0; j < RW; ++j)
          raw[u][j] = v < n_vec ? ldg_stream16(reinterpret_cast<const uint4*>(rows[j]) + v)
                                : make_uint4(0, 0, 0, 0);
      }
    };
    // Fixed weights: the first are requested before waiting for the grid before this one.
    int64_t v0 = lane;
    if (prefetch && v0 < n_vec) load(v0);
    pdl_begin();
    if (!prefetch && v0 < n_vec) load(v0);
    while (v0 < n_vec) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t v = v0 + 32 * u;
        if (v >= n_vec) break;
        float wf[RW][E];
#pragma unroll
        for (int j = 0; j < RW; ++j) unpack16<TYPE>(raw[u][j], wf[j]);
#pragma unroll
        for (int t = 0; t < NCOLS; ++t) {
          const float4* xp = reinterpret_cast<const float4*>(x + t * k + v * E);
#pragma unroll
          for (int e4 = 0; e4 < E / 4; ++e4) {
            const float4 xv = load_after_wait(xp + e4);
#pragma unroll
            for (int j = 0; j < RW; ++j) {
              acc[j][t] += wf[j][4 * e4] * xv.x + wf[j][4 * e4 + 1] * xv.y +
                           wf[j][4 * e4 + 2] * xv.z + wf[j][4 * e4 + 3] * xv.w;
            }
          }
        }
      }
      v0 += 32 * U;
      if (v0 < n_vec) load(v0);
    }
  } else {
    pdl_begin();
    for (int64_t i = lane; i < k; i += 32) {
#pragma unroll
      for (int j = 0; j < RW; ++j) {
        const float wv = load_elem<TYPE>(rows[j], i);
#pragma unroll
        for (int t = 0; t < NCOLS; ++t) acc[j][t] += wv * x[t * k + i];
      }
    }
  }

  float sums[RW];  // ROPE: the rows' sums, for their pairs
#pragma unroll
  for (int j = 0; j < RW; ++j) {
#pragma unroll
    for (int t = 0; t < NCOLS; ++t) {
      const float v = warp_sum(acc[j][t]);
      if (ROPE)
        sums[j] = v;
      else if (lane == 0 && row0 + j < part.n)
        part.dst[static_cast<int64_t>(t) * part.n + row0 + j] = v;
    }
  }
  if constexpr (ROPE) rope_warp_rows<RW>(rope, part, row0, sums);
}

template <int TYPE, int NCOLS, int RW, bool VEC>
__global__ void __launch_bounds__(kMvThreads)
    mat_vec_f_kernel(const uint8_t* w0, const uint8_t* w1, const uint8_t* w2, int n0, int n1,
                     int n2, float* d0, float* d1, float* d2, int blk1, int blk2, int64_t k,
                     const float* x, int prefetch) {
  mat_vec_f_body<TYPE, NCOLS, RW, VEC>(select_part(w0, w1, w2, n0, n1, n2, d0, d1, d2, blk1, blk2),
                                       k, x, prefetch);
}

// q, k and v of one token (one float format) with the rope epilogue: two rows a warp, so that a
// pair's sums meet in one lane, each row summed as mat_vec_f_kernel sums it.
template <int TYPE, bool VEC>
__global__ void __launch_bounds__(kMvThreads)
    mat_vec_f_rope_kernel(const uint8_t* w0, const uint8_t* w1, const uint8_t* w2, int n0, int n1,
                          int n2, float* d0, float* d1, float* d2, int blk1, int blk2, int64_t k,
                          const float* x, int prefetch, MatVecRope rope) {
  mat_vec_f_body<TYPE, 1, 2, VEC, true>(select_part(w0, w1, w2, n0, n1, n2, d0, d1, d2, blk1, blk2),
                                        k, x, prefetch, rope);
}

// ---- Launch helpers for the mat-vec kernels -----------------------------------------------------

struct GroupArgs {
  const uint8_t* w[3] = {nullptr, nullptr, nullptr};
  int n[3] = {0, 0, 0};
  float* dst[3] = {nullptr, nullptr, nullptr};
  int blk1 = 0, blk2 = 0, total = 0;
};

// Whether every weight of a launch may be loaded before the wait (MatVecPart::fixed).
bool all_fixed(const MatVecPart* parts, int n_parts) {
  for (int i = 0; i < n_parts; ++i)
    if (!parts[i].fixed) return false;
  return true;
}

GroupArgs group_args(const MatVecPart* parts, int n_parts, int rows_per_block) {
  GroupArgs g;
  int blocks[3] = {0, 0, 0};
  for (int i = 0; i < 3; ++i) {
    // Unused slots repeat the last part with no blocks, so every pointer argument is valid.
    const MatVecPart& p = parts[std::min(i, n_parts - 1)];
    g.w[i] = static_cast<const uint8_t*>(p.w);
    g.n[i] = static_cast<int>(p.n);
    g.dst[i] = p.dst;
    blocks[i] = i < n_parts ? static_cast<int>(ceil_div(p.n, rows_per_block)) : 0;
  }
  g.blk1 = blocks[0];
  g.blk2 = blocks[0] + blocks[1];
  g.total = g.blk2 + blocks[2];
  return g;
}

template <int TYPE, int NCOLS, int R, int U, int KS = 1>
void mat_vec_q_launch(Launcher& l, const MatVecPart* parts, int n_parts, int64_t k,
                      const int8_t* aq, const float2* ads, int overlap) {
  const GroupArgs g = group_args(parts, n_parts, kMvqWarps / KS * R);
  l(mat_vec_q_kernel<TYPE, NCOLS, R, U, KS>, dim3(g.total), dim3(kMvqThreads), 0, g.w[0], g.w[1],
    g.w[2], g.n[0], g.n[1], g.n[2], g.dst[0], g.dst[1], g.dst[2], g.blk1, g.blk2,
    static_cast<int>(k / 32), aq, ads, k, overlap);
}

// MatVecConfig::overlap's default: the first weights loaded before the wait and the next grid
// let in at once measured fastest for every shape and format on an H200 (BENCHMARKS.md).
constexpr int kMatVecOverlap = 3;

MatVecConfig& mat_vec_override() {
  static MatVecConfig c;
  return c;
}

// False when the device's capacity is unknown (prepare_kernels not run): take another kernel.
// With rope (q, k and v of one token): the rope epilogue's variant, in the same shape (the plain
// kernel's capacity decides it, so the sums are the plain launch's; the variant's sizes the grid).
template <int TYPE, int PL, int R>
bool mat_vec_q_rows_launch(Launcher& l, const MatVecPart* parts, int n_parts, int64_t k,
                           const int8_t* aq, const float2* ads, const MatVecRope* rope,
                           const NormFold* fold) {
  const int plain = rows_kernel_slots<TYPE, PL, R>();
  if (plain == 0) return false;
  const int own = rope ? rows_kernel_slots<TYPE, PL, R, true>() : 0;
  const int slots = rows_warps(own > 0 ? own : plain);
  const GroupArgs g = group_args(parts, n_parts, 1);
  int n[3];
  for (int i = 0; i < 3; ++i) n[i] = i < n_parts ? g.n[i] : 0;
  const int64_t n_rows = int64_t(n[0]) + n[1] + n[2];
  const int n_warps = static_cast<int>(std::min<int64_t>(ceil_div(n_rows, R), slots));
  const dim3 grid(static_cast<unsigned>(ceil_div(n_warps, kMvqWarps)));
  const int nb = static_cast<int>(k / 32), prefetch = all_fixed(parts, n_parts) ? 1 : 0;
  const NormFold f = fold ? *fold : NormFold{};
  if (rope)
    l(mat_vec_q_rows_rope_kernel<TYPE, PL, R>, grid, dim3(kMvqThreads), 0, g.w[0], g.w[1], g.w[2],
      n[0], n[1], n[2], g.dst[0], g.dst[1], g.dst[2], n_warps, nb, aq, ads, k, prefetch, f, *rope);
  else
    l(mat_vec_q_rows_kernel<TYPE, PL, R>, grid, dim3(kMvqThreads), 0, g.w[0], g.w[1], g.w[2], n[0],
      n[1], n[2], g.dst[0], g.dst[1], g.dst[2], n_warps, nb, aq, ads, k, prefetch, f);
  return true;
}

// The register-resident kernel for rows of up to 64 pieces; false past that. With a NormFold
// (the norm before worked out by the kernel: rows of one piece a lane, kFoldsNorm), false where
// that kernel does not take it.
template <int TYPE>
bool mat_vec_q_rows(Launcher& l, const MatVecPart* parts, int n_parts, int64_t k, const int8_t* aq,
                    const float2* ads, const MatVecRope* rope = nullptr,
                    const NormFold* fold = nullptr) {
  const int64_t per_lane = ceil_div(k / 32 * PieceInfo<TYPE>::kPer32, 32);
  if (per_lane <= 1 && (!fold || kFoldsNorm<TYPE, 1>))
    return mat_vec_q_rows_launch<TYPE, 1, 2>(l, parts, n_parts, k, aq, ads, rope, fold);
  if (fold) return false;
  if (per_lane <= 2)
    return mat_vec_q_rows_launch<TYPE, 2, 2>(l, parts, n_parts, k, aq, ads, rope, nullptr);
  return false;
}

// The one-column kernel shape of a format (rows, pieces in flight, k splits), measured on an
// H200 (BENCHMARKS.md): two warps share a row's pieces, over four rows of two pieces in flight
// for 4-bit weights; 8-bit weights (twice the pieces a row) do best with four warps a row, over
// two rows of two pieces; the K-quants with high bits or a scale per half (Q5_K, Q6_K, Q2_K,
// Q3_K: more work a piece) with a warp a row, over two rows of four pieces.
template <int TYPE>
struct MatVecShape {
  static constexpr bool kQ8 = PieceInfo<TYPE>::kPer32 == 2;
  static constexpr bool kHighK = TYPE == kTypeQ5_K || PieceInfo<TYPE>::kHalfScales;
  static constexpr int R = kQ8 ? 2 : kHighK ? 2 : 4;
  static constexpr int U = kQ8 ? 2 : kHighK ? 4 : 2;
  static constexpr int KS = kQ8 ? 4 : kHighK ? 1 : 2;
};

// Short rows (at most this many pieces) take the register-resident kernel.
constexpr int64_t kRowsKernelPieces = 64;

int mat_vec_overlap(const MatVecPart* parts, int n_parts) {
  // GGRAPH_CUDA_MATVEC_OVERLAP=0..3 (a measurement setting) gives the block-shaped launches
  // another overlap in a whole step: what the short kernels between the products cost while the
  // next product's early weight loads run beside them (BENCHMARKS.md, the step's critical path).
  static const int setting = env_int("GGRAPH_CUDA_MATVEC_OVERLAP", 0, 3, kMatVecOverlap);
  // Weights that others may write are loaded only after the wait (MatVecPart::fixed).
  int overlap = mat_vec_override().overlap >= 0 ? mat_vec_override().overlap : setting;
  if (!all_fixed(parts, n_parts)) overlap &= ~1;
  return overlap;
}

// parts[0, n_a) of format TA and parts[n_a] of TB, one column, in one launch; false (nothing
// launched) where a kernel shape is forced. With rope (n_a 2): the rope epilogue too.
template <int TA, int TB>
bool mat_vec_q_mixed(Launcher& l, const MatVecPart* parts, int n_a, int64_t k, const uint8_t* ws,
                     const MatVecRope* rope, const NormFold* fold) {
  if (mat_vec_override().rows != 0 || n_a < 1 || n_a > 2 || (rope && n_a != 2)) return false;
  const ActQ8 act = act_q8(const_cast<uint8_t*>(ws), k, 1);
  // Slots: part 0 (and 1) of A, an empty part 1 when A has one, then B.
  const MatVecPart slot[3] = {parts[0], n_a == 2 ? parts[1] : parts[0], parts[n_a]};
  const int64_t pa = k / 32 * PieceInfo<TA>::kPer32, pb = k / 32 * PieceInfo<TB>::kPer32;
  const int nb = static_cast<int>(k / 32);
  if (pa <= kRowsKernelPieces && pb <= kRowsKernelPieces) {
    constexpr int R = 2;
    const int slots_a =
        rows_warps(pa <= 32 ? rows_kernel_slots<TA, 1, R>() : rows_kernel_slots<TA, 2, R>());
    const int slots_b =
        rows_warps(pb <= 32 ? rows_kernel_slots<TB, 1, R>() : rows_kernel_slots<TB, 2, R>());
    if (slots_a > 0 && slots_b > 0) {
      const int n0 = static_cast<int>(slot[0].n), n1 = n_a == 2 ? static_cast<int>(slot[1].n) : 0;
      const int n2 = static_cast<int>(slot[2].n);
      // Each format's warps in proportion to its rows, as far as the device holds at once.
      const int64_t rows = int64_t(n0) + n1 + n2;
      const int wa = static_cast<int>(
          std::max<int64_t>(1, std::min(ceil_div(n0 + n1, R), slots_a * (n0 + n1) / rows)));
      const int wb = static_cast<int>(
          std::max<int64_t>(1, std::min<int64_t>(ceil_div(n2, R), slots_b * n2 / rows)));
      const int blk_b = static_cast<int>(ceil_div(wa, kMvqWarps));
      const int blocks = blk_b + static_cast<int>(ceil_div(wb, kMvqWarps));
      const int prefetch = all_fixed(parts, n_a + 1) ? 1 : 0;
      if (fold && !(pa <= 32 && pb <= 32 && kFoldsNorm<TA, 1> && kFoldsNorm<TB, 1>)) return false;
      const NormFold f = fold ? *fold : NormFold{};
      auto go = [&](auto plain, auto with_rope) {
        const auto w0 = static_cast<const uint8_t*>(slot[0].w);
        const auto w1 = static_cast<const uint8_t*>(slot[1].w);
        const auto w2 = static_cast<const uint8_t*>(slot[2].w);
        if (rope)
          l(with_rope, dim3(blocks), dim3(kMvqThreads), 0, w0, w1, w2, n0, n1, n2, slot[0].dst,
            slot[1].dst, slot[2].dst, wa, wb, blk_b, nb, act.qs, act.ds, k, prefetch, f, *rope);
        else
          l(plain, dim3(blocks), dim3(kMvqThreads), 0, w0, w1, w2, n0, n1, n2, slot[0].dst,
            slot[1].dst, slot[2].dst, wa, wb, blk_b, nb, act.qs, act.ds, k, prefetch, f);
      };
      if (pa <= 32 && pb <= 32)
        go(mat_vec_q_rows_mixed_kernel<TA, 1, TB, 1, R>,
           mat_vec_q_rows_mixed_rope_kernel<TA, 1, TB, 1, R>);
      else if (pa <= 32)
        go(mat_vec_q_rows_mixed_kernel<TA, 1, TB, 2, R>,
           mat_vec_q_rows_mixed_rope_kernel<TA, 1, TB, 2, R>);
      else if (pb <= 32)
        go(mat_vec_q_rows_mixed_kernel<TA, 2, TB, 1, R>,
           mat_vec_q_rows_mixed_rope_kernel<TA, 2, TB, 1, R>);
      else
        go(mat_vec_q_rows_mixed_kernel<TA, 2, TB, 2, R>,
           mat_vec_q_rows_mixed_rope_kernel<TA, 2, TB, 2, R>);
      return true;
    }
  }
  // Otherwise (longer rows, or the device's capacity not yet known) each format's block shape.
  if (fold) return false;
  using A = MatVecShape<TA>;
  using B = MatVecShape<TB>;
  constexpr int kA = kMvqWarps / A::KS * A::R, kB = kMvqWarps / B::KS * B::R;  // rows a block
  const int per_block[3] = {kA, kA, kB};
  int blocks[3];
  for (int i = 0; i < 3; ++i) blocks[i] = static_cast<int>(ceil_div(slot[i].n, per_block[i]));
  if (n_a == 1) blocks[1] = 0;
  const int blk1 = blocks[0], blk2 = blk1 + blocks[1];
  const auto w0 = static_cast<const uint8_t*>(slot[0].w);
  const auto w1 = static_cast<const uint8_t*>(slot[1].w);
  const auto w2 = static_cast<const uint8_t*>(slot[2].w);
  const int n0 = static_cast<int>(slot[0].n), n1 = static_cast<int>(slot[1].n);
  const int n2 = static_cast<int>(slot[2].n), overlap = mat_vec_overlap(parts, n_a + 1);
  if (rope)
    l(mat_vec_q_mixed_rope_kernel<TA, A::R, A::U, A::KS, TB, B::R, B::U, B::KS>,
      dim3(blk2 + blocks[2]), dim3(kMvqThreads), 0, w0, w1, w2, n0, n1, n2, slot[0].dst,
      slot[1].dst, slot[2].dst, blk1, blk2, blk2, nb, act.qs, act.ds, k, overlap, *rope);
  else
    l(mat_vec_q_mixed_kernel<TA, A::R, A::U, A::KS, TB, B::R, B::U, B::KS>, dim3(blk2 + blocks[2]),
      dim3(kMvqThreads), 0, w0, w1, w2, n0, n1, n2, slot[0].dst, slot[1].dst, slot[2].dst, blk1,
      blk2, blk2, nb, act.qs, act.ds, k, overlap);
  return true;
}

// GGRAPH_CUDA_MATVEC_SHAPE=R,U,KS[,K] (a measurement setting): one column's products of long
// rows (of at least K elements where K is given), but for q, k and v with their ropes, take
// that kernel shape in every format instead of MatVecShape's, so that the shapes can be
// compared in a whole step.
MatVecConfig mat_vec_shape_setting(int64_t k) {
  struct Setting {
    MatVecConfig c;
    int min_k = 0;
  };
  static const Setting s = [] {
    Setting v;
    const char* e = std::getenv("GGRAPH_CUDA_MATVEC_SHAPE");
    if (!e || std::sscanf(e, "%d,%d,%d,%d", &v.c.rows, &v.c.unroll, &v.c.ksplit, &v.min_k) < 3)
      v = Setting{};
    return v;
  }();
  return k >= s.min_k ? s.c : MatVecConfig{};
}

template <int TYPE, int NCOLS>
void mat_vec_q(Launcher& l, const MatVecPart* parts, int n_parts, int64_t k, const uint8_t* ws,
               const NormFold* fold) {
  const ActQ8 act = act_q8(const_cast<uint8_t*>(ws), k, NCOLS);
  const int8_t* aq = act.qs;
  const float2* ads = act.ds;
  const int64_t n_pieces = k / 32 * PieceInfo<TYPE>::kPer32;
  const int overlap = mat_vec_overlap(parts, n_parts);
  if constexpr (NCOLS == 1) {
    MatVecConfig c = mat_vec_override();
    // Measured on an H200 (BENCHMARKS.md): short rows run fastest with the activation in
    // registers; longer rows take MatVecShape's.
    if (c.rows == 0 && n_pieces <= kRowsKernelPieces &&
        mat_vec_q_rows<TYPE>(l, parts, n_parts, k, aq, ads, nullptr, fold))
      return;
    if (fold) throw std::logic_error("mat-vec: no kernel here takes the norm before it");
    using S = MatVecShape<TYPE>;
    if (c.rows == 0) c = mat_vec_shape_setting(k);
    if (c.rows == 0) c = MatVecConfig{S::R, S::U, S::KS};
    switch (c.rows * 100 + c.unroll + 1000 * (c.ksplit - 1)) {
      case 1402:
        return mat_vec_q_launch<TYPE, 1, 4, 2, 2>(l, parts, n_parts, k, aq, ads, overlap);
      case 3402:
        return mat_vec_q_launch<TYPE, 1, 4, 2, 4>(l, parts, n_parts, k, aq, ads, overlap);
      case 1204:
        return mat_vec_q_launch<TYPE, 1, 2, 4, 2>(l, parts, n_parts, k, aq, ads, overlap);
      case 3202:
        return mat_vec_q_launch<TYPE, 1, 2, 2, 4>(l, parts, n_parts, k, aq, ads, overlap);
      case 202:
        return mat_vec_q_launch<TYPE, 1, 2, 2>(l, parts, n_parts, k, aq, ads, overlap);
      case 204:
        return mat_vec_q_launch<TYPE, 1, 2, 4>(l, parts, n_parts, k, aq, ads, overlap);
      case 402:
        return mat_vec_q_launch<TYPE, 1, 4, 2>(l, parts, n_parts, k, aq, ads, overlap);
      case 104:
        return mat_vec_q_launch<TYPE, 1, 1, 4>(l, parts, n_parts, k, aq, ads, overlap);
      default:
        throw ArgumentError("mat-vec: no kernel of " + std::to_string(c.rows) + " rows, " +
                            std::to_string(c.unroll) + " pieces in flight and " +
                            std::to_string(c.ksplit) + " k splits");
    }
  } else {
    if (fold) throw std::logic_error("mat-vec: a norm folds into one column's products only");
    mat_vec_q_launch<TYPE, NCOLS, 1, 2, 2>(l, parts, n_parts, k, aq, ads, overlap);
  }
}

// q, k and v of one token with the rope epilogue, in the kernel shape mat_vec_q would take for
// them (the same sums, bit for bit); false where a kernel shape is forced.
template <int TYPE>
bool mat_vec_q_rope(Launcher& l, const MatVecPart* parts, int64_t k, const uint8_t* ws,
                    const MatVecRope& rope, const NormFold* fold) {
  if (mat_vec_override().rows != 0) return false;
  const ActQ8 act = act_q8(const_cast<uint8_t*>(ws), k, 1);
  const int64_t n_pieces = k / 32 * PieceInfo<TYPE>::kPer32;
  const int nb = static_cast<int>(k / 32);
  if (n_pieces <= kRowsKernelPieces &&
      mat_vec_q_rows<TYPE>(l, parts, 3, k, act.qs, act.ds, &rope, fold))
    return true;
  if (fold) return false;
  using S = MatVecShape<TYPE>;
  const GroupArgs g = group_args(parts, 3, kMvqWarps / S::KS * S::R);
  l(mat_vec_q_rope_kernel<TYPE, S::R, S::U, S::KS>, dim3(g.total), dim3(kMvqThreads), 0, g.w[0],
    g.w[1], g.w[2], g.n[0], g.n[1], g.n[2], g.dst[0], g.dst[1], g.dst[2], g.blk1, g.blk2, nb,
    act.qs, act.ds, k, mat_vec_overlap(parts, 3), rope);
  return true;
}

// Rows a warp of the register-resident glu kernel takes (one of gate, one of up: blocks of 32
// warps). Measured on an H200 (BENCHMARKS.md), SmolLM2 shape: 2 rows 2,142-2,206 tok/s, 4 rows
// 2,118-2,176, 8 rows 2,126-2,133.
constexpr int kGluRows = 2;

// gate and up (parts 0 and 1) of one column with the gated unit in the epilogue, for rows
// mat_vec_q gives the register-resident rows kernel (at most kRowsKernelPieces pieces), with its
// sums bit for bit. (That kernel also needs the device's capacity, which prepare_kernels
// measures before any launch; a launch recorded without a device is planned as a device would
// run it.) False, with nothing launched, for longer rows, which keep the glu's launch: their
// products' body in blocks of 8 or 16 warps over gate's and up's rows in passes measured 4-7%
// slower on an H200 (BENCHMARKS.md).
template <int TYPE>
bool mat_vec_q_glu(Launcher& l, const MatVecPart* parts, int64_t k, const uint8_t* ws,
                   const MatVecGlu& glu) {
  const int64_t n = parts[0].n;
  const int64_t n_pieces = k / 32 * PieceInfo<TYPE>::kPer32;
  const int pl = n_pieces <= 32 ? 1 : 2;  // mat_vec_q_rows's pieces a lane
  if (mat_vec_override().rows != 0 || n % 32 != 0 || parts[1].n != n || n > (int64_t{1} << 30) ||
      n_pieces > kRowsKernelPieces)
    return false;
  const ActQ8 act = act_q8(const_cast<uint8_t*>(ws), k, 1);
  const int nb = static_cast<int>(k / 32), ni = static_cast<int>(n);
  const auto gate = static_cast<const uint8_t*>(parts[0].w);
  const auto up = static_cast<const uint8_t*>(parts[1].w);
  const int prefetch = all_fixed(parts, 2) ? 1 : 0;
  const bool gelu = glu.act == kGluGelu;
  auto go = [&](auto kernel) {
    l(kernel, dim3(static_cast<unsigned>(n / 32)), dim3(kGluThreads<kGluRows>), 0, gate, up, ni, nb,
      act.qs, act.ds, k, prefetch, glu);
  };
  if (pl == 1 && gelu)
    go(mat_vec_q_rows_glu_kernel<TYPE, 1, kGluRows, true>);
  else if (pl == 1)
    go(mat_vec_q_rows_glu_kernel<TYPE, 1, kGluRows, false>);
  else if (gelu)
    go(mat_vec_q_rows_glu_kernel<TYPE, 2, kGluRows, true>);
  else
    go(mat_vec_q_rows_glu_kernel<TYPE, 2, kGluRows, false>);
  return true;
}

template <int TYPE, int NCOLS>
void mat_vec_f(Launcher& l, const MatVecPart* parts, int n_parts, int64_t k, const float* x) {
  constexpr int RW = NCOLS <= 2 ? 1 : 2;
  const GroupArgs g = group_args(parts, n_parts, 8 * RW);
  bool vec = k % FloatInfo<TYPE>::kVecElems == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  for (int i = 0; i < 3; ++i) vec = vec && reinterpret_cast<uintptr_t>(g.w[i]) % 16 == 0;
  const int prefetch = all_fixed(parts, n_parts) ? 1 : 0;
  if (vec) {
    l(mat_vec_f_kernel<TYPE, NCOLS, RW, true>, dim3(g.total), dim3(kMvThreads), 0, g.w[0], g.w[1],
      g.w[2], g.n[0], g.n[1], g.n[2], g.dst[0], g.dst[1], g.dst[2], g.blk1, g.blk2, k, x, prefetch);
  } else {
    l(mat_vec_f_kernel<TYPE, NCOLS, RW, false>, dim3(g.total), dim3(kMvThreads), 0, g.w[0], g.w[1],
      g.w[2], g.n[0], g.n[1], g.n[2], g.dst[0], g.dst[1], g.dst[2], g.blk1, g.blk2, k, x, prefetch);
  }
}

// q, k and v of one token in a float format with the rope epilogue.
template <int TYPE>
void mat_vec_f_rope(Launcher& l, const MatVecPart* parts, int64_t k, const float* x,
                    const MatVecRope& rope) {
  const GroupArgs g = group_args(parts, 3, 8 * 2);
  bool vec = k % FloatInfo<TYPE>::kVecElems == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  for (int i = 0; i < 3; ++i) vec = vec && reinterpret_cast<uintptr_t>(g.w[i]) % 16 == 0;
  constexpr int kPrefetch = 1;  // model weights (launch_mat_vec_rope takes no others)
  auto go = [&](auto kernel) {
    l(kernel, dim3(g.total), dim3(kMvThreads), 0, g.w[0], g.w[1], g.w[2], g.n[0], g.n[1], g.n[2],
      g.dst[0], g.dst[1], g.dst[2], g.blk1, g.blk2, k, x, kPrefetch, rope);
  };
  if (vec)
    go(mat_vec_f_rope_kernel<TYPE, true>);
  else
    go(mat_vec_f_rope_kernel<TYPE, false>);
}

template <int NCOLS>
void mat_vec_cols(Launcher& l, DType type, const MatVecPart* parts, int n_parts, int64_t k,
                  const float* x, const uint8_t* ws, const NormFold* fold) {
  with_weight_type(type, "mul_mat", [&](auto tc) {
    constexpr int TYPE = decltype(tc)::value;
    if constexpr (is_split_type(TYPE)) {
      mat_vec_q<TYPE, NCOLS>(l, parts, n_parts, k, ws, fold);
    } else {
      if (fold) throw std::logic_error("mat-vec: a norm folds into quantized products only");
      mat_vec_f<TYPE, NCOLS>(l, parts, n_parts, k, x);
    }
  });
}

// ---- Tensor-core tiled product (prompt path) -------------------------------------------------
//
// dst[t, n] = sum_k x[t, k] * w[n, k]: A = activations (half, prepared once per mat-mul), B =
// weights dequantized to half in shared memory, fp32 accumulation with mma.sync m16n8k16.
// Block tile: BT tokens x 128 weights x BK k (64; 32 to compare), double-buffered in dynamic
// shared memory; the next weight tile is loaded into registers while the current one is
// multiplied.

constexpr int kTcBW = 128;

// What one thread holds of the next weight tile: BK/2 consecutive k of one row (half a quant
// block at BK 32, a whole one at BK 64), raw, with the block's scale and minimum.
struct WeightRegs {
  uint32_t v[32];
  float d, m;
  uint32_t h[2];  // the piece's high bits (5- and 6-bit formats)
  uint32_t s[4];  // its scale record as stored, decoded when the tile is written (new formats)
  int sub;        // which 32 of its K-quant block the piece is
};

template <int TYPE, bool KALIGNED, int BK>
__device__ __forceinline__ void load_weight_regs(WeightRegs& r, const uint8_t* row,
                                                 const uint8_t* hrow, const uint8_t* srow, int kt,
                                                 int hsel, int64_t k) {
  constexpr int E = BK / 2;  // elements per thread
  if constexpr (is_split_type(TYPE)) {
    // Split layout: the row's quants (16 or 32 bytes per 32 elements), high bits in hrow,
    // scale records in srow.
    constexpr SplitFormat f = split_format(static_cast<DType>(TYPE));
    constexpr int QB = f.quant_bytes;
    // At BK 64 each thread takes the 32 elements 2 kt + hsel; at BK 32 half of 32 elements kt.
    const int blk = BK == 64 ? 2 * kt + hsel : kt;
    const int part = BK == 64 ? 0 : hsel;
    r.d = 0.0f;
    r.m = 0.0f;
#pragma unroll
    for (int i = 0; i < 32; ++i) r.v[i] = 0;
    r.h[0] = r.h[1] = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) r.s[i] = 0;
    r.sub = blk % 8;
    if (static_cast<int64_t>(blk) * 32 >= k) return;  // past the row's last block: zeros
    const uint8_t* rec = srow + blk / (f.block_elems / 32) * f.scale_bytes;
    if constexpr (TYPE == kTypeQ4_1) {
      const uint32_t dm = __ldg(reinterpret_cast<const uint32_t*>(rec));
      r.d = f16_bits_to_float(static_cast<uint16_t>(dm & 0xFFFF));
      r.m = f16_bits_to_float(static_cast<uint16_t>(dm >> 16));
    } else if constexpr (TYPE == kTypeQ4_0 || TYPE == kTypeQ8_0) {
      r.d = f16_bits_to_float(__ldg(reinterpret_cast<const uint16_t*>(rec)));
    } else if constexpr (f.scale_bytes == 16) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(rec));
      r.s[0] = v.x, r.s[1] = v.y, r.s[2] = v.z, r.s[3] = v.w;
    } else if constexpr (f.scale_bytes == 8) {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(rec));
      r.s[0] = v.x, r.s[1] = v.y;
    } else if constexpr (TYPE == kTypeQ6_K) {
      r.s[0] = __ldg(reinterpret_cast<const uint16_t*>(rec) + blk % 8);
      r.s[1] = __ldg(reinterpret_cast<const uint16_t*>(rec + 16));
    } else if constexpr (TYPE == kTypeQ3_K) {  // the mat-vec's words (half_scales)
      r.s[0] = static_cast<uint32_t>(__ldg(reinterpret_cast<const uint16_t*>(rec) + blk % 8)) |
               static_cast<uint32_t>(__ldg(reinterpret_cast<const uint16_t*>(rec + 16))) << 16;
    } else if constexpr (TYPE == kTypeQ2_K) {
      r.s[0] = __ldg(reinterpret_cast<const uint16_t*>(rec) + blk % 8);
      r.s[1] = __ldg(reinterpret_cast<const uint32_t*>(rec + 16));
    } else if constexpr (f.scale_bytes == 4) {
      r.s[0] = __ldg(reinterpret_cast<const uint32_t*>(rec));
    } else {
      r.s[0] = __ldg(reinterpret_cast<const uint16_t*>(rec));
    }
    if constexpr (f.high_bytes == 4) {
      r.h[0] = __ldg(reinterpret_cast<const uint32_t*>(hrow) + blk);
    } else if constexpr (f.high_bytes == 8) {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(hrow) + blk);
      r.h[0] = v.x, r.h[1] = v.y;
    }
    // 32-bit words of quants this thread takes: E / 8 (Q4) or E / 4 (Q8), whole 16-byte loads
    // but for Q4 at BK 32 (8 bytes).
    constexpr int NW = TYPE == kTypeQ8_0 ? E / 4 : E / 8;
    const uint32_t* q =
        reinterpret_cast<const uint32_t*>(row + static_cast<size_t>(blk) * QB) + part * NW;
    if constexpr (NW % 4 == 0) {
#pragma unroll
      for (int i = 0; i < NW / 4; ++i) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(q) + i);
        r.v[4 * i] = v.x, r.v[4 * i + 1] = v.y, r.v[4 * i + 2] = v.z, r.v[4 * i + 3] = v.w;
      }
    } else {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(q));
      r.v[0] = v.x, r.v[1] = v.y;
    }
  } else {
    const int64_t e0 = static_cast<int64_t>(kt) * BK + hsel * E;
    if constexpr (TYPE == kTypeF32) {
      const float* f = reinterpret_cast<const float*>(row);
      if constexpr (KALIGNED) {
#pragma unroll
        for (int i = 0; i < E / 4; ++i) {
          const float4 q = e0 + 4 * i < k ? __ldg(reinterpret_cast<const float4*>(f + e0) + i)
                                          : make_float4(0.f, 0.f, 0.f, 0.f);
          r.v[4 * i] = __float_as_uint(q.x), r.v[4 * i + 1] = __float_as_uint(q.y);
          r.v[4 * i + 2] = __float_as_uint(q.z), r.v[4 * i + 3] = __float_as_uint(q.w);
        }
      } else {
#pragma unroll
        for (int i = 0; i < E; ++i) r.v[i] = e0 + i < k ? __float_as_uint(__ldg(f + e0 + i)) : 0u;
      }
    } else {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(row);
      if constexpr (KALIGNED) {
#pragma unroll
        for (int i = 0; i < E / 8; ++i) {
          const uint4 q = e0 + 8 * i < k ? __ldg(reinterpret_cast<const uint4*>(h + e0) + i)
                                         : make_uint4(0, 0, 0, 0);
          r.v[4 * i] = q.x, r.v[4 * i + 1] = q.y, r.v[4 * i + 2] = q.z, r.v[4 * i + 3] = q.w;
        }
      } else {
#pragma unroll
        for (int i = 0; i < E / 2; ++i) {
          const uint32_t lo = e0 + 2 * i < k ? __ldg(h + e0 + 2 * i) : 0u;
          const uint32_t hi = e0 + 2 * i + 1 < k ? __ldg(h + e0 + 2 * i + 1) : 0u;
          r.v[i] = lo | (hi << 16);
        }
      }
    }
  }
}

// Writes the thread's BK/2 values of the weight tile as half into row `dst` of shared memory.
template <int TYPE, int BK>
__device__ __forceinline__ void store_weight_regs(const WeightRegs& r, __half* dst, int hsel) {
  constexpr int E = BK / 2;
  uint32_t o[E / 2];  // half pairs, in element order of the thread's columns (see below)
  int col[E / 8];     // start column of each 8-wide group of o
  if constexpr (is_split_type(TYPE) && TYPE != kTypeQ8_0 && TYPE != kTypeQ4_0 &&
                TYPE != kTypeQ4_1) {
    // The 5-bit, 6-bit and K formats: each byte's two elements with their high bits, then the
    // piece's scale (and minimum; Q6_K and Q3_K: a scale per half, stored offset by 32 or 4;
    // Q2_K: a scale and a minimum per half).
    constexpr SplitFormat f = split_format(static_cast<DType>(TYPE));
    constexpr int NB = E / 2;
    const int tb = BK == 64 ? 0 : hsel * 8;  // the first quant byte this thread holds
    float d0 = 0.0f, d1 = 0.0f, m = 0.0f, m1 = 0.0f;
    if constexpr (f.scale_bytes == 16) {
      const float2 dm = k_scale_min_dev(r.s, r.sub);
      d0 = d1 = dm.x;
      m = -dm.y;
    } else if constexpr (TYPE == kTypeQ6_K) {
      const float d = f16_bits_to_float(static_cast<uint16_t>(r.s[1]));
      d0 = d * static_cast<float>(static_cast<int8_t>(r.s[0] & 0xFF));
      d1 = d * static_cast<float>(static_cast<int8_t>(r.s[0] >> 8));
    } else if constexpr (TYPE == kTypeQ2_K || TYPE == kTypeQ3_K) {
      const HalfScales hs = half_scales(static_cast<DType>(TYPE), r.s[0], r.s[1]);
      d0 = hs.d[0], d1 = hs.d[1], m = hs.m[0], m1 = hs.m[1];
    } else if constexpr (TYPE == kTypeIQ4_NL || TYPE == kTypeIQ4_XS) {
      d0 = f16_bits_to_float(static_cast<uint16_t>(r.s[0] & 0xFFFF));
      if constexpr (TYPE == kTypeIQ4_XS) d0 *= static_cast<float>(iq4_xs_scale_dev(r.s, r.sub));
    } else {
      d0 = d1 = f16_bits_to_float(static_cast<uint16_t>(r.s[0] & 0xFFFF));
      m = TYPE == kTypeQ5_1 ? f16_bits_to_float(static_cast<uint16_t>(r.s[0] >> 16)) : -16.0f * d0;
    }
    auto value = [&](int t, uint32_t nibble) {
      int q = static_cast<int>(nibble);
      constexpr int HB = PieceInfo<TYPE>::kHighBytes;
      if constexpr (HB > 0) {
        const HighBits hb = split_high_bits(HB, t);
        q |= static_cast<int>((r.h[hb.word] >> hb.shift) & (HB == 4 ? 1u : 3u)) << 4;
      }
      if constexpr (TYPE == kTypeQ6_K) return (t < 16 ? d0 : d1) * static_cast<float>(q - 32);
      if constexpr (TYPE == kTypeQ2_K || TYPE == kTypeQ3_K)
        return t < 16 ? static_cast<float>(q) * d0 + m : static_cast<float>(q) * d1 + m1;
      if constexpr (TYPE == kTypeIQ4_NL || TYPE == kTypeIQ4_XS)
        return d0 * static_cast<float>(iq4_level(q));
      return static_cast<float>(q) * d0 + m;
    };
    auto byte_at = [&](int e) -> uint32_t { return (r.v[e / 4] >> (8 * (e % 4))) & 0xFF; };
#pragma unroll
    for (int p = 0; p < NB / 2; ++p) {
      const uint32_t b0 = byte_at(2 * p), b1 = byte_at(2 * p + 1);
      const int t = tb + 2 * p;
      o[p] = pack_half2(value(t, b0 & 0xF), value(t + 1, b1 & 0xF));
      o[NB / 2 + p] = pack_half2(value(t + 16, b0 >> 4), value(t + 17, b1 >> 4));
    }
    const int first = BK == 64 ? hsel * 32 : hsel * 8;
#pragma unroll
    for (int c = 0; c < E / 8; ++c) col[c] = first + (c < E / 16 ? 8 * c : 16 + 8 * (c - E / 16));
  } else if constexpr (TYPE == kTypeQ4_0 || TYPE == kTypeQ4_1) {
    // Byte j of a block's quants holds element j (low nibble) and element j + 16 (high).
    constexpr int NB = E / 2;  // quant bytes this thread holds: 8 (half block) or 16
    const float m = TYPE == kTypeQ4_1 ? r.m : -8.0f * r.d;
    auto byte_at = [&](int e) -> uint32_t { return (r.v[e / 4] >> (8 * (e % 4))) & 0xFF; };
#pragma unroll
    for (int p = 0; p < NB / 2; ++p) {
      const uint32_t b0 = byte_at(2 * p), b1 = byte_at(2 * p + 1);
      o[p] = pack_half2(static_cast<float>(b0 & 0xF) * r.d + m,
                        static_cast<float>(b1 & 0xF) * r.d + m);
      o[NB / 2 + p] =
          pack_half2(static_cast<float>(b0 >> 4) * r.d + m, static_cast<float>(b1 >> 4) * r.d + m);
    }
    // Low nibbles are elements [first quant byte, +NB), high nibbles the same plus 16.
    const int first = BK == 64 ? hsel * 32 : hsel * 8;
#pragma unroll
    for (int c = 0; c < E / 8; ++c) col[c] = first + (c < E / 16 ? 8 * c : 16 + 8 * (c - E / 16));
  } else {
    if constexpr (TYPE == kTypeQ8_0) {
#pragma unroll
      for (int i = 0; i < E / 2; ++i) {
        const uint32_t pair = r.v[i / 2] >> (16 * (i % 2));
        const int8_t q0 = static_cast<int8_t>(pair & 0xFF);
        const int8_t q1 = static_cast<int8_t>((pair >> 8) & 0xFF);
        o[i] = pack_half2(static_cast<float>(q0) * r.d, static_cast<float>(q1) * r.d);
      }
    } else if constexpr (TYPE == kTypeF32) {
#pragma unroll
      for (int i = 0; i < E / 2; ++i)
        o[i] = pack_half2(__uint_as_float(r.v[2 * i]), __uint_as_float(r.v[2 * i + 1]));
    } else if constexpr (TYPE == kTypeF16) {
#pragma unroll
      for (int i = 0; i < E / 2; ++i) o[i] = r.v[i];
    } else {
#pragma unroll
      for (int i = 0; i < E / 2; ++i)
        o[i] = pack_half2(__uint_as_float(r.v[i] << 16), __uint_as_float(r.v[i] & 0xFFFF0000u));
    }
#pragma unroll
    for (int c = 0; c < E / 8; ++c) col[c] = hsel * E + 8 * c;
  }
#pragma unroll
  for (int c = 0; c < E / 8; ++c)
    *reinterpret_cast<uint4*>(dst + col[c]) =
        make_uint4(o[4 * c], o[4 * c + 1], o[4 * c + 2], o[4 * c + 3]);
}

template <int BT, int BK>
constexpr size_t tc_smem_bytes() {
  return 2 * static_cast<size_t>(BT + kTcBW) * (BK + 8) * sizeof(__half);
}

template <int TYPE, int BK, int WT, int MT, int NT, bool KALIGNED>
__global__ void __launch_bounds__(256)
    mat_mul_tc_kernel(const uint8_t* w, size_t rb, const uint8_t* high, size_t hb,
                      const uint8_t* scales, size_t sb, int n, int64_t k, const __half* xh,
                      int64_t kp, int n_cols, float* dst) {
  pdl_begin();
  constexpr int WW = 8 / WT;
  constexpr int BT = WT * MT * 16;
  constexpr int PITCH = BK + 8;  // halves; rows 16-byte aligned and ldmatrix conflict-free
  static_assert(WW * NT * 8 == kTcBW, "weight tile");
  static_assert(NT % 2 == 0, "ldmatrix.x4 loads two n8 tiles");
  extern __shared__ __align__(16) uint8_t tc_smem[];
  auto as = reinterpret_cast<__half(*)[BT][PITCH]>(tc_smem);
  auto bs = reinterpret_cast<__half(*)[kTcBW][PITCH]>(tc_smem + 2 * BT * PITCH * sizeof(__half));

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int wt = warp % WT, ww = warp / WT;
  const int t0 = blockIdx.x * BT;
  const int n0 = blockIdx.y * kTcBW;
  const int n_kt = static_cast<int>((k + BK - 1) / BK);
  // Weight rows: two threads per row, each half of the BK k of a tile.
  const int b_row = tid / 2, hsel = tid % 2;
  const uint8_t* w_row = w + static_cast<size_t>(min(n0 + b_row, n - 1)) * rb;
  const uint8_t* h_row = high + static_cast<size_t>(min(n0 + b_row, n - 1)) * hb;
  const uint8_t* s_row = scales + static_cast<size_t>(min(n0 + b_row, n - 1)) * sb;

  auto load_a = [&](int s, int kt) {
    constexpr int CH = BK / 8;  // 16-byte pieces per row
    for (int p = tid; p < BT * CH; p += 256) {
      const int r = p / CH, ch = p % CH;
      const int t = t0 + r;
      const __half* src = xh + static_cast<int64_t>(min(t, n_cols - 1)) * kp +
                          static_cast<int64_t>(kt) * BK + ch * 8;
      cp_async16(&as[s][r][ch * 8], src, t < n_cols ? 16 : 0);
    }
    cp_async_commit();
  };

  float c[MT][NT][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) c[i][j][e] = 0.0f;

  WeightRegs regs;
  load_a(0, 0);
  load_weight_regs<TYPE, KALIGNED, BK>(regs, w_row, h_row, s_row, 0, hsel, k);
  store_weight_regs<TYPE, BK>(regs, &bs[0][b_row][0], hsel);
  cp_async_wait<0>();
  __syncthreads();

  for (int kt = 0; kt < n_kt; ++kt) {
    const int cur = kt & 1, nxt = cur ^ 1;
    const bool more = kt + 1 < n_kt;
    if (more) {
      load_a(nxt, kt + 1);
      load_weight_regs<TYPE, KALIGNED, BK>(regs, w_row, h_row, s_row, kt + 1, hsel, k);
    }
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      uint32_t a[MT][4];
#pragma unroll
      for (int i = 0; i < MT; ++i)
        ldmatrix_x4(a[i], &as[cur][wt * MT * 16 + i * 16 + (lane % 16)][kk + (lane / 16) * 8]);
#pragma unroll
      for (int jp = 0; jp < NT / 2; ++jp) {
        uint32_t b[4];
        ldmatrix_x4(b, &bs[cur][ww * NT * 8 + jp * 16 + (lane % 8) + (lane / 16) * 8]
                          [kk + ((lane / 8) % 2) * 8]);
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          mma_16816(c[i][2 * jp], a[i], b[0], b[1]);
          mma_16816(c[i][2 * jp + 1], a[i], b[2], b[3]);
        }
      }
    }
    if (more) {
      store_weight_regs<TYPE, BK>(regs, &bs[nxt][b_row][0], hsel);
      cp_async_wait<0>();
    }
    __syncthreads();
  }

  const int g = lane / 4, q = lane % 4;
#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int wn = n0 + ww * NT * 8 + j * 8 + 2 * q;
#pragma unroll
      for (int hrow = 0; hrow < 2; ++hrow) {
        const int t = t0 + wt * MT * 16 + i * 16 + g + 8 * hrow;
        if (t >= n_cols) continue;
        float* out = dst + static_cast<int64_t>(t) * n + wn;
        const float v0 = c[i][j][2 * hrow], v1 = c[i][j][2 * hrow + 1];
        if ((n & 1) == 0 && wn + 1 < n) {
          *reinterpret_cast<float2*>(out) = make_float2(v0, v1);
        } else {
          if (wn < n) out[0] = v0;
          if (wn + 1 < n) out[1] = v1;
        }
      }
    }
  }
}

// The tile depth of the tiled product: 64, or 32 with GGRAPH_CUDA_MMA_BK=32 (to compare; 64
// measured 5 to 40% faster on an H200).
int mma_bk() {
  static const int bk = [] {
    const char* v = std::getenv("GGRAPH_CUDA_MMA_BK");
    return v && std::strcmp(v, "32") == 0 ? 32 : 64;
  }();
  return bk;
}

template <int TYPE, int BK, int WT, int MT, int NT>
void mat_mul_tc_launch(Launcher& l, const void* w, int64_t n, int64_t k, const uint8_t* ws,
                       int cols, float* dst) {
  constexpr int BT = WT * MT * 16;
  const dim3 grid(static_cast<unsigned>(ceil_div(cols, BT)),
                  static_cast<unsigned>(ceil_div(n, kTcBW)));
  const auto* wp = static_cast<const uint8_t*>(w);
  const auto* xh = reinterpret_cast<const __half*>(ws);
  const int64_t kp = act_half_pitch(k);
  // Quantized weights are split (cuda/weight_layout.h): rows of quants, of high bits, of scales.
  constexpr SplitFormat f = split_format(static_cast<DType>(TYPE));
  constexpr bool kQuant = f.block_bytes != 0;
  const size_t nb = static_cast<size_t>(k / 32);
  const size_t rb = kQuant ? nb * f.quant_bytes : row_bytes(static_cast<DType>(TYPE), k);
  const size_t hb = kQuant ? nb * f.high_bytes : 0;
  const size_t sb = kQuant ? static_cast<size_t>(k / f.block_elems) * f.scale_bytes : 0;
  const uint8_t* hp = kQuant ? wp + static_cast<size_t>(n) * rb : wp;
  const uint8_t* sp = kQuant ? hp + static_cast<size_t>(n) * hb : wp;
  const bool aligned = k % 8 == 0 && reinterpret_cast<uintptr_t>(w) % 16 == 0;
  const size_t smem = tc_smem_bytes<BT, BK>();
  if (aligned) {
    l(mat_mul_tc_kernel<TYPE, BK, WT, MT, NT, true>, grid, dim3(256), smem, wp, rb, hp, hb, sp, sb,
      static_cast<int>(n), k, xh, kp, cols, dst);
  } else {
    l(mat_mul_tc_kernel<TYPE, BK, WT, MT, NT, false>, grid, dim3(256), smem, wp, rb, hp, hb, sp, sb,
      static_cast<int>(n), k, xh, kp, cols, dst);
  }
}

// Raises the dynamic shared memory limit of one configuration's kernels (once, at start-up).
template <int TYPE, int BK, int WT, int MT, int NT>
void mat_mul_tc_prepare() {
  constexpr int BT = WT * MT * 16;
  const int smem = static_cast<int>(tc_smem_bytes<BT, BK>());
  GGRAPH_CUDA_CHECK(cudaFuncSetAttribute(mat_mul_tc_kernel<TYPE, BK, WT, MT, NT, true>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  GGRAPH_CUDA_CHECK(cudaFuncSetAttribute(mat_mul_tc_kernel<TYPE, BK, WT, MT, NT, false>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
}

// Batch tiles: 32 tokens up to 32 columns, 64 up to 64, then 128.
template <int TYPE, int BK>
void mat_mul_tc_bk(Launcher& l, const void* w, int64_t n, int64_t k, const uint8_t* ws, int cols,
                   float* dst) {
  if (cols <= 32) {
    mat_mul_tc_launch<TYPE, BK, 1, 2, 2>(l, w, n, k, ws, cols, dst);
  } else if (cols <= 64) {
    mat_mul_tc_launch<TYPE, BK, 2, 2, 4>(l, w, n, k, ws, cols, dst);
  } else {
    mat_mul_tc_launch<TYPE, BK, 2, 4, 4>(l, w, n, k, ws, cols, dst);
  }
}

template <int TYPE>
void mat_mul_tc_type(Launcher& l, const void* w, int64_t n, int64_t k, const uint8_t* ws, int cols,
                     float* dst) {
  if (mma_bk() == 32) {
    mat_mul_tc_bk<TYPE, 32>(l, w, n, k, ws, cols, dst);
  } else {
    mat_mul_tc_bk<TYPE, 64>(l, w, n, k, ws, cols, dst);
  }
}

template <int TYPE>
void mat_mul_tc_prepare_type() {
  mat_mul_tc_prepare<TYPE, 32, 1, 2, 2>();
  mat_mul_tc_prepare<TYPE, 32, 2, 2, 4>();
  mat_mul_tc_prepare<TYPE, 32, 2, 4, 4>();
  mat_mul_tc_prepare<TYPE, 64, 1, 2, 2>();
  mat_mul_tc_prepare<TYPE, 64, 2, 2, 4>();
  mat_mul_tc_prepare<TYPE, 64, 2, 4, 4>();
}

// Decodes rows [row0, row0 + rows) of a weight to half, rows kp apart, a thread for each 32
// elements, through the tile kernel's own loads and conversion: cuBLAS then multiplies them as
// it multiplies F16 weights, with the values the tiled product would have used. kp is a
// multiple of 64, so piece i of the rows lands at out + 32 i: a block's pieces are one run of
// memory, staged in shared memory and written with coalesced 16-byte stores.
constexpr int kDequantThreads = 128;

template <int TYPE>
__global__ void __launch_bounds__(kDequantThreads)
    dequant_half_kernel(const uint8_t* w, size_t rb, const uint8_t* high, size_t hb,
                        const uint8_t* scales, size_t sb, int64_t row0, int64_t rows, int64_t k,
                        int64_t kp, __half* out) {
  __shared__ __align__(16) __half tile[kDequantThreads * 32];
  pdl_begin();
  const int64_t per_row = kp / 32, total = rows * per_row;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kDequantThreads;
  const int64_t i = first + threadIdx.x;
  if (i < total) {
    const int64_t row = row0 + i / per_row;
    const int piece = static_cast<int>(i % per_row), kt = piece / 2, hsel = piece % 2;
    WeightRegs regs;
    load_weight_regs<TYPE, true, 64>(regs, w + row * rb, high + row * hb, scales + row * sb, kt,
                                     hsel, k);
    // The thread's 32 halves at tile[32 t]: store_weight_regs puts them at column 32 hsel.
    store_weight_regs<TYPE, 64>(regs, tile + (static_cast<int>(threadIdx.x) - hsel) * 32, hsel);
  }
  __syncthreads();
  const int64_t n16 = (min(total - first, static_cast<int64_t>(kDequantThreads))) * 4;
  const uint4* src = reinterpret_cast<const uint4*>(tile);
  uint4* dst = reinterpret_cast<uint4*>(out) + first * 4;
  for (int64_t j = threadIdx.x; j < n16; j += kDequantThreads) dst[j] = src[j];
}

__global__ void split_weight_kernel(DType t, const uint8_t* src, uint8_t* dst, int64_t first,
                                    int64_t n, int64_t n_blocks) {
  pdl_begin();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n)
    split_block(t, src + i * split_format(t).block_bytes, static_cast<size_t>(first + i),
                static_cast<size_t>(n_blocks), dst);
}

// Every weight format, for start-up work done per format.
constexpr DType kWeightTypes[] = {DType::F32,  DType::F16,    DType::BF16,  DType::Q4_0,
                                  DType::Q4_1, DType::Q5_0,   DType::Q5_1,  DType::Q8_0,
                                  DType::Q2_K, DType::Q3_K,   DType::Q4_K,  DType::Q5_K,
                                  DType::Q6_K, DType::IQ4_NL, DType::IQ4_XS};

}  // namespace

void set_mat_vec_config(MatVecConfig c) { mat_vec_override() = c; }

void launch_split_weight(DType type, const uint8_t* src, uint8_t* dst, int64_t first, int64_t n,
                         int64_t n_blocks, cudaStream_t stream) {
  if (!is_quantized(type))
    throw ArgumentError(std::string("split_weight: expected a quantized type, got ") +
                        dtype_name(type));
  if (n == 0) return;
  // At load time, outside any step: a plain launch, not through the Launcher.
  split_weight_kernel<<<static_cast<unsigned>(ceil_div(n, 256)), 256, 0, stream>>>(
      type, src, dst, first, n, n_blocks);
  GGRAPH_CUDA_CHECK(cudaGetLastError());
}

void prepare_kernels() {
  int dev = 0, sms = 0;
  const bool have_sms =
      cudaGetDevice(&dev) == cudaSuccess &&
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess;
  cudaGetLastError();
  for (DType t : kWeightTypes) {
    with_weight_type(t, "prepare_kernels", [&](auto tc) {
      constexpr int TYPE = decltype(tc)::value;
      if constexpr (is_split_type(TYPE)) {
        if (have_sms) measure_rows_kernels<TYPE>(sms);
      }
      mat_mul_tc_prepare_type<TYPE>();
    });
  }
  prepare_attention_kernels();
  prepare_mat_mul_q_kernels();
  prepare_norm_kernels();
  step_trace_attach();
  cudaGetLastError();
}

// mat_vec_q_mixed for the pairs llama.cpp's K-quant mixes make: Q4_K_M and Q5_K_M (q, k; v in
// Q6_K), and their fallbacks for rows that are not whole 256-blocks (Q5_0; v in Q8_0). False
// for other pairs.
bool mixed_pair(DType type_a, DType type_b, const MatVecPart* parts, int n_a, int64_t k,
                const uint8_t* ws, const MatVecRope* rope, const NormFold* fold, Launcher& l) {
#define GGRAPH_MIXED_PAIR(A, B)                                                     \
  if (type_a == DType::A && type_b == DType::B)                                     \
    return mat_vec_q_mixed<static_cast<int>(DType::A), static_cast<int>(DType::B)>( \
        l, parts, n_a, k, ws, rope, fold);
  GGRAPH_MIXED_PAIR(Q4_K, Q6_K)
  GGRAPH_MIXED_PAIR(Q5_K, Q6_K)
  GGRAPH_MIXED_PAIR(Q5_0, Q8_0)
#undef GGRAPH_MIXED_PAIR
  return false;
}

bool& rope_epilogue_flag() {
  static bool on = env_switch_on("GGRAPH_CUDA_ROPE_EPILOGUE");
  return on;
}

bool set_rope_epilogue(bool on) { return std::exchange(rope_epilogue_flag(), on); }

int set_rows_kernel_warp_cap(int cap) { return std::exchange(rows_warp_cap(), cap); }
bool rope_epilogue_enabled() { return rope_epilogue_flag(); }

bool& warp_rope_epilogue_flag() {
  static bool on = env_switch_on("GGRAPH_CUDA_WARP_ROPE_EPILOGUE");
  return on;
}
bool set_warp_rope_epilogue(bool on) { return std::exchange(warp_rope_epilogue_flag(), on); }
bool warp_rope_epilogue_enabled() { return warp_rope_epilogue_flag() && rope_epilogue_flag(); }

bool& rope_angle_early_flag() {
  static bool on = env_switch_on("GGRAPH_CUDA_ROPE_ANGLE_EARLY");
  return on;
}
bool set_rope_angle_early(bool on) { return std::exchange(rope_angle_early_flag(), on); }

bool& rope_table_flag() {
  static bool on = env_switch_on("GGRAPH_CUDA_ROPE_TABLE");
  return on;
}
bool set_rope_table(bool on) { return std::exchange(rope_table_flag(), on); }
bool rope_table_enabled() { return rope_table_flag(); }

bool launch_mat_vec_rope(Launcher& l, DType type, DType v_type, const MatVecPart* parts, int64_t k,
                         const uint8_t* ws, const MatVecRope& given, const NormFold* fold,
                         const float* x) {
  if (!rope_epilogue_flag()) return false;
  MatVecRope rope = given;
  rope.early_angle = rope_angle_early_flag() ? 1 : 0;
  if (!is_quantized(type)) {
    // Model weights only: the kernel reads them with non-coherent loads while it writes.
    if (v_type != type || fold || !x || !all_fixed(parts, 3)) return false;
    bool launched = false;
    with_weight_type(type, "mul_mat", [&](auto tc) {
      constexpr int TYPE = decltype(tc)::value;
      if constexpr (!is_split_type(TYPE)) {
        mat_vec_f_rope<TYPE>(l, parts, k, x, rope);
        launched = true;
      }
    });
    return launched;
  }
  if (v_type != type) return mixed_pair(type, v_type, parts, 2, k, ws, &rope, fold, l);
  bool launched = false;
  with_weight_type(type, "mul_mat", [&](auto tc) {
    constexpr int TYPE = decltype(tc)::value;
    if constexpr (is_split_type(TYPE)) launched = mat_vec_q_rope<TYPE>(l, parts, k, ws, rope, fold);
  });
  return launched;
}

bool& glu_epilogue_flag() {
  static bool on = env_switch_on("GGRAPH_CUDA_GLU_EPILOGUE");
  return on;
}

bool set_glu_epilogue(bool on) { return std::exchange(glu_epilogue_flag(), on); }

bool launch_mat_vec_glu(Launcher& l, DType type, const MatVecPart* parts, int64_t k,
                        const uint8_t* ws, const MatVecGlu& glu) {
  if (!glu_epilogue_flag() || !is_quantized(type)) return false;
  bool launched = false;
  with_weight_type(type, "mul_mat", [&](auto tc) {
    constexpr int TYPE = decltype(tc)::value;
    if constexpr (is_split_type(TYPE)) launched = mat_vec_q_glu<TYPE>(l, parts, k, ws, glu);
  });
  return launched;
}

// Off unless GGRAPH_CUDA_NORM_FOLD=1: on an H200 the SmolLM2 shape's decode ran 15-17% slower
// with it (BENCHMARKS.md): the norm's work lengthens the products' start, where its own launch
// overlapped it.
bool& norm_fold_flag() {
  static bool on = env_int("GGRAPH_CUDA_NORM_FOLD", 0, 1, 0) == 1;
  return on;
}

bool set_norm_fold(bool on) { return std::exchange(norm_fold_flag(), on); }

bool norm_fold_enabled() { return norm_fold_flag(); }

bool mat_vec_folds_norm(DType type, DType type_b, int64_t k) {
  if (!norm_fold_flag() || k % 32 != 0 || k > 1024 || mat_vec_override().rows != 0) return false;
  auto folds = [&](DType t) {
    bool ok = false;
    with_weight_type(t, "mul_mat", [&](auto tc) {
      constexpr int TYPE = decltype(tc)::value;
      if constexpr (is_split_type(TYPE)) {
        if constexpr (kFoldsNorm<TYPE, 1>) ok = rows_kernel_slots<TYPE, 1, 2>() > 0;
      }
    });
    return ok;
  };
  return folds(type) && (type_b == type || folds(type_b));
}

bool launch_mat_vec_mixed(Launcher& l, DType type_a, DType type_b, const MatVecPart* parts, int n_a,
                          int64_t k, const uint8_t* ws, const NormFold* fold) {
  return mixed_pair(type_a, type_b, parts, n_a, k, ws, nullptr, fold, l);
}

void launch_mat_vec(Launcher& l, DType type, const MatVecPart* parts, int n_parts, int64_t k,
                    const float* x, const uint8_t* ws, int cols, const NormFold* fold) {
  if (fold && cols != 1) throw std::logic_error("mat-vec: a norm folds into one column only");
  switch (cols) {
    case 1:
      return mat_vec_cols<1>(l, type, parts, n_parts, k, x, ws, fold);
    case 2:
      return mat_vec_cols<2>(l, type, parts, n_parts, k, x, ws, nullptr);
    case 3:
      return mat_vec_cols<3>(l, type, parts, n_parts, k, x, ws, nullptr);
    case 4:
      return mat_vec_cols<4>(l, type, parts, n_parts, k, x, ws, nullptr);
    case 5:
      return mat_vec_cols<5>(l, type, parts, n_parts, k, x, ws, nullptr);
    case 6:
      return mat_vec_cols<6>(l, type, parts, n_parts, k, x, ws, nullptr);
    case 7:
      return mat_vec_cols<7>(l, type, parts, n_parts, k, x, ws, nullptr);
    case 8:
      return mat_vec_cols<8>(l, type, parts, n_parts, k, x, ws, nullptr);
    default:
      throw ArgumentError("mul_mat: the mat-vec path takes 1 to " + std::to_string(kMatVecMaxCols) +
                          " columns, got " + std::to_string(cols));
  }
}

void launch_dequant_half(Launcher& l, DType type, const void* w, int64_t n, int64_t k, int64_t row0,
                         int64_t rows, uint8_t* out) {
  if (!is_quantized(type))
    throw ArgumentError(std::string("dequant_half: expected a quantized type, got ") +
                        dtype_name(type));
  with_weight_type(type, "dequant_half", [&](auto tc) {
    constexpr int TYPE = decltype(tc)::value;
    if constexpr (is_split_type(TYPE)) {
      constexpr SplitFormat f = split_format(static_cast<DType>(TYPE));
      const size_t nb = static_cast<size_t>(k / 32);
      const size_t rb = nb * f.quant_bytes, hb = nb * f.high_bytes;
      const size_t sb = static_cast<size_t>(k / f.block_elems) * f.scale_bytes;
      const auto* wp = static_cast<const uint8_t*>(w);
      const uint8_t* hp = wp + static_cast<size_t>(n) * rb;
      const uint8_t* sp = hp + static_cast<size_t>(n) * hb;
      const int64_t kp = act_half_pitch(k);
      const int64_t threads = rows * (kp / 32);
      l(dequant_half_kernel<TYPE>, dim3(static_cast<unsigned>(ceil_div(threads, kDequantThreads))),
        dim3(kDequantThreads), 0, wp, rb, hp, hb, sp, sb, row0, rows, k, kp,
        reinterpret_cast<__half*>(out));
    }
  });
}

void launch_mat_mul_tc(Launcher& l, DType type, const void* w, int64_t n, int64_t k,
                       const uint8_t* ws, int cols, float* dst) {
  with_weight_type(type, "mul_mat", [&](auto tc) {
    mat_mul_tc_type<decltype(tc)::value>(l, w, n, k, ws, cols, dst);
  });
}

}  // namespace ggraph::cuda
