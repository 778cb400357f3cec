// Matrix products with weights: mat-vec kernels for a few columns (decode) and tensor-core tiled
// kernels for many (prompt). Weights are [k, n] with row n contiguous (k elements).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "cuda/device_util.cuh"
#include "cuda/kernels.cuh"
#include "cuda/weight_layout.h"

namespace ggraph::cuda {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

constexpr int kMvThreads = 256;  // 8 warps

// Up to three weight matrices launched together: block b of the grid belongs to part 0 below
// blk1, to part 1 below blk2, to part 2 above.
struct PartSel {
  const uint8_t* w;
  int n;
  float* dst;
  int local_block;
};
__device__ __forceinline__ PartSel select_part(const uint8_t* w0, const uint8_t* w1,
                                               const uint8_t* w2, int n0, int n1, int n2, float* d0,
                                               float* d1, float* d2, int blk1, int blk2) {
  const int b = blockIdx.x;
  if (b < blk1) return {w0, n0, d0, b};
  if (b < blk2) return {w1, n1, d1, b - blk1};
  return {w2, n2, d2, b - blk2};
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

template <int TYPE>
struct PieceInfo {
  static constexpr SplitFormat kFormat = split_format(static_cast<DType>(TYPE));
  static constexpr int kScaleBytes = kFormat.scale_bytes;
  static constexpr int kQuantBytes = kFormat.quant_bytes;
  static constexpr int kPerBlock = kQuantBytes / 16;  // 16-byte pieces per block
  static constexpr int kActBytes = 32 / kPerBlock;    // activation bytes a piece meets
};

// Weights are read once: keep them out of L1, where the activation lives.
__device__ __forceinline__ uint4 ldg_stream16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t ldg_scale(const uint8_t* p, int bytes) {
  return bytes == 4 ? __ldg(reinterpret_cast<const uint32_t*>(p))
                    : static_cast<uint32_t>(__ldg(reinterpret_cast<const uint16_t*>(p)));
}

// Four products of unsigned bytes of a with signed bytes of b, added to c.
__device__ __forceinline__ int dp4a_us(uint32_t a, int b, int c) {
  int d;
  asm("dp4a.u32.s32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// The activation words a piece meets, 8 (a whole Q4 block) or 4 (half a Q8_0 block), from ap;
// and the block's (d, d * sum(q)) from dp.
template <int TYPE>
__device__ __forceinline__ void load_piece_act(const int8_t* ap, const float2* dp, int (&a)[8],
                                               float2& ad) {
  const int4 lo = __ldg(reinterpret_cast<const int4*>(ap));
  a[0] = lo.x, a[1] = lo.y, a[2] = lo.z, a[3] = lo.w;
  if constexpr (PieceInfo<TYPE>::kPerBlock == 1) {
    const int4 hi = __ldg(reinterpret_cast<const int4*>(ap) + 1);
    a[4] = hi.x, a[5] = hi.y, a[6] = hi.z, a[7] = hi.w;
  }
  ad = __ldg(dp);
}

// Piece `piece` of column t of the activation.
template <int TYPE>
__device__ __forceinline__ void load_piece_act(const int8_t* aq, const float2* ads, int64_t k,
                                               int nb, int t, int piece, int (&a)[8], float2& ad) {
  using P = PieceInfo<TYPE>;
  load_piece_act<TYPE>(aq + t * k + static_cast<int64_t>(piece) * P::kActBytes,
                       ads + static_cast<int64_t>(t) * nb + piece / P::kPerBlock, a, ad);
}

// One piece's contribution: quants q (4 words), scale word s (f16 d; Q4_1: d | m << 16).
template <int TYPE>
__device__ __forceinline__ void piece_dot(const uint4& q, uint32_t s, const int (&a)[8], float2 ad,
                                          float& acc) {
  const float d = f16_bits_to_float(static_cast<uint16_t>(s & 0xFFFF));
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
  if constexpr (TYPE == kTypeQ8_0) {
    int sum = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) sum = __dp4a(static_cast<int>(w[i]), a[i], sum);
    acc += d * static_cast<float>(sum) * ad.x;
  } else {
    // Byte j of the quants holds element j (low nibble) and element j + 16 (high nibble). The
    // high nibbles are dotted in place, as unsigned bytes 16 times their value, which saves
    // shifting them down: lo + hi / 16 is the sum, 16 * lo + hi is 16 times it, exactly.
    int lo = 0, hi = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      lo = dp4a_us(w[i] & 0x0F0F0F0Fu, a[i], lo);
      hi = dp4a_us(w[i] & 0xF0F0F0F0u, a[i + 4], hi);
    }
    const float sum = static_cast<float>(lo * 16 + hi);
    const float ad16 = ad.x * 0.0625f;  // the same for every row: computed once
    if constexpr (TYPE == kTypeQ4_0) {
      // sum((q - 8) * d * a_i * d8) = d * (d8 * sum(q a) - 8 * d8 * sum(a))
      acc += d * (sum * ad16 - 8.0f * ad.y);
    } else {
      const float m = f16_bits_to_float(static_cast<uint16_t>(s >> 16));
      acc += d * sum * ad16 + m * ad.y;
    }
  }
}

template <int TYPE, int NCOLS, int R, int U, int KS>
__global__ void __launch_bounds__(kMvqThreads)
    mat_vec_q_kernel(const uint8_t* w0, const uint8_t* w1, const uint8_t* w2, int n0, int n1,
                     int n2, float* d0, float* d1, float* d2, int blk1, int blk2, int nb,
                     const int8_t* aq, const float2* ads, int64_t k, int overlap) {
  using P = PieceInfo<TYPE>;
  const PartSel part = select_part(w0, w1, w2, n0, n1, n2, d0, d1, d2, blk1, blk2);
  static_assert(kMvqWarps % KS == 0, "k splits divide the block's warps");
  // KS warps share rows, each taking every KS-th run of pieces; their sums meet in shared memory.
  constexpr int kStep = 32 * U * KS;  // pieces a warp moves on by per round
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wr = warp / KS, ks = warp % KS;
  const int row0 = (part.local_block * (kMvqWarps / KS) + wr) * R;
  const int n_pieces = nb * P::kPerBlock;
  // Pointers to this lane's pieces of the round (pieces base + lane + 32 u), moved on each round,
  // so that every load takes a constant offset from one of them.
  int base = ks * 32 * U;
  const uint8_t* scales = part.w + static_cast<size_t>(part.n) * nb * P::kQuantBytes;
  const uint4* qp[R];
  const uint8_t* sp[R];
#pragma unroll
  for (int j = 0; j < R; ++j) {
    const size_t row = static_cast<size_t>(min(row0 + j, part.n - 1));
    qp[j] = reinterpret_cast<const uint4*>(part.w) + row * n_pieces + base + lane;
    sp[j] = scales + (row * nb + (base + lane) / P::kPerBlock) * P::kScaleBytes;
  }

  float acc[R][NCOLS];
#pragma unroll
  for (int j = 0; j < R; ++j)
#pragma unroll
    for (int t = 0; t < NCOLS; ++t) acc[j][t] = 0.0f;

  uint4 q[U][R];
  uint32_t s[U][R];
  // A full round loads unconditionally; the last may hold fewer pieces than lanes * U.
  auto load = [&]() {
    if (base + 32 * U <= n_pieces) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int j = 0; j < R; ++j) {
          q[u][j] = ldg_stream16(qp[j] + u * 32);
          s[u][j] = ldg_scale(sp[j] + u * 32 / P::kPerBlock * P::kScaleBytes, P::kScaleBytes);
        }
      }
      return;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const bool ok = base + u * 32 + lane < n_pieces;
#pragma unroll
      for (int j = 0; j < R; ++j) {
        q[u][j] = ok ? ldg_stream16(qp[j] + u * 32) : make_uint4(0, 0, 0, 0);
        s[u][j] =
            ok ? ldg_scale(sp[j] + u * 32 / P::kPerBlock * P::kScaleBytes, P::kScaleBytes) : 0u;
      }
    }
  };
  auto advance = [&]() {
    base += kStep;
#pragma unroll
    for (int j = 0; j < R; ++j) {
      qp[j] += kStep;
      sp[j] += kStep / P::kPerBlock * P::kScaleBytes;
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
  const float2* dp = ads + (base + lane) / P::kPerBlock;
  // One round's dot products; a full round (every lane has all U pieces) without bounds checks,
  // which lets the activation loads of all columns be issued together.
  auto dot_round = [&](auto full) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (!full && base + u * 32 >= n_pieces) break;
      const bool ok = full || base + u * 32 + lane < n_pieces;
#pragma unroll
      for (int t = 0; t < NCOLS; ++t) {
        int a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        float2 ad = make_float2(0.0f, 0.0f);
        if (ok)
          load_piece_act<TYPE>(ap + t * k + u * 32 * P::kActBytes,
                               dp + static_cast<int64_t>(t) * nb + u * 32 / P::kPerBlock, a, ad);
#pragma unroll
        for (int j = 0; j < R; ++j) piece_dot<TYPE>(q[u][j], s[u][j], a, ad, acc[j][t]);
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
    dp += kStep / P::kPerBlock;
    if (base < n_pieces) load();
  }

  if (!early) pdl_trigger();
  __shared__ float partial[KS > 1 ? kMvqWarps : 1][R * NCOLS];
#pragma unroll
  for (int j = 0; j < R; ++j) {
#pragma unroll
    for (int t = 0; t < NCOLS; ++t) {
      const float v = warp_sum(acc[j][t]);
      if constexpr (KS == 1) {
        if (lane == 0 && row0 + j < part.n)
          part.dst[static_cast<int64_t>(t) * part.n + row0 + j] = v;
      } else {
        if (lane == 0) partial[warp][j * NCOLS + t] = v;
      }
    }
  }
  if constexpr (KS > 1) {
    static_assert(R * NCOLS <= 32, "a lane per sum");
    __syncthreads();
    if (ks == 0 && lane < R * NCOLS) {
      const int j = lane / NCOLS, t = lane % NCOLS;
      float v = 0.0f;
      for (int i = 0; i < KS; ++i) v += partial[warp + i][lane];
      if (row0 + j < part.n) part.dst[static_cast<int64_t>(t) * part.n + row0 + j] = v;
    }
  }
}
// ---- Quantized mat-vec, activation held in registers (one column, short rows) -----------------
//
// For rows of at most 32 * PL pieces: each lane keeps the activation words of its pieces (lane,
// lane + 32, ...) in registers for good, and the warp walks rows (R at a time, all their pieces'
// loads in flight) with a stride of the whole grid, which is as large as the device holds at
// once. The activation crosses L1 once per warp instead of once per row, and a small matrix
// needs few blocks: the SmolLM2-sized mat-vecs measured faster this way.

template <int TYPE, int PL, int R>
__global__ void __launch_bounds__(kMvqThreads)
    mat_vec_q_rows_kernel(const uint8_t* w0, const uint8_t* w1, const uint8_t* w2, int n0, int n1,
                          int n2, float* d0, float* d1, float* d2, int n_warps, int nb,
                          const int8_t* aq, const float2* ads, int64_t k, int prefetch) {
  using P = PieceInfo<TYPE>;
  const int lane = threadIdx.x % 32;
  const int gw = blockIdx.x * kMvqWarps + threadIdx.x / 32;
  const int n_rows = n0 + n1 + n2;
  const int n_pieces = nb * P::kPerBlock;
  uint4 v[R][PL];
  uint32_t sc[R][PL];
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
      const uint4* q = reinterpret_cast<const uint4*>(w) + static_cast<size_t>(row[j]) * n_pieces;
      const uint8_t* s = w + static_cast<size_t>(n) * nb * P::kQuantBytes +
                         static_cast<size_t>(row[j]) * nb * P::kScaleBytes;
#pragma unroll
      for (int i = 0; i < PL; ++i) {
        const int p = lane + 32 * i;
        v[j][i] = p < n_pieces ? ldg_stream16(q + p) : make_uint4(0, 0, 0, 0);
        sc[j][i] =
            p < n_pieces ? ldg_scale(s + (p / P::kPerBlock) * P::kScaleBytes, P::kScaleBytes) : 0u;
      }
    }
  };
  // Fixed weights: the first rows' are requested before waiting for the grid before this one,
  // so that their latency overlaps its run.
  int g0 = gw * R;
  if (prefetch && g0 < n_rows) load_rows(g0);
  pdl_begin();
  if (!prefetch && g0 < n_rows) load_rows(g0);
  int a[PL][8];
  float2 ad[PL];
#pragma unroll
  for (int i = 0; i < PL; ++i) {
    const int p = lane + 32 * i;
    if (p < n_pieces) {
      load_piece_act<TYPE>(aq, ads, k, nb, 0, p, a[i], ad[i]);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) a[i][e] = 0;
      ad[i] = make_float2(0.0f, 0.0f);
    }
  }
  while (g0 < n_rows) {
#pragma unroll
    for (int j = 0; j < R; ++j) {
      float acc = 0.0f;
#pragma unroll
      for (int i = 0; i < PL; ++i) piece_dot<TYPE>(v[j][i], sc[j][i], a[i], ad[i], acc);
      acc = warp_sum(acc);
      if (lane == 0 && g0 + j < n_rows) dst[j][row[j]] = acc;
    }
    g0 += n_warps * R;
    if (g0 < n_rows) load_rows(g0);
  }
}

// Warps of one instantiation resident on the whole device at once (measured in prepare_kernels,
// outside any capture); 0 until then.
template <int TYPE, int PL, int R>
int& rows_kernel_slots() {
  static int slots = 0;
  return slots;
}

template <int TYPE, int PL, int R>
void measure_rows_kernel(int sms) {
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, mat_vec_q_rows_kernel<TYPE, PL, R>,
                                                    kMvqThreads, 0) != cudaSuccess) {
    cudaGetLastError();
    blocks = 0;
  }
  rows_kernel_slots<TYPE, PL, R>() = blocks * sms * kMvqWarps;
}

template <int TYPE>
void measure_rows_kernels(int sms) {
  measure_rows_kernel<TYPE, 1, 2>(sms);
  measure_rows_kernel<TYPE, 2, 2>(sms);
}

// ---- Float-weight mat-vec (F32, F16, BF16) ------------------------------------------------------
//
// A warp owns RW rows; lanes read 16 consecutive bytes each (512 bytes per warp load), four loads
// per row in flight, against float activations. VEC needs rows aligned to 16 bytes.

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

template <int TYPE, int NCOLS, int RW, bool VEC>
__global__ void __launch_bounds__(kMvThreads)
    mat_vec_f_kernel(const uint8_t* w0, const uint8_t* w1, const uint8_t* w2, int n0, int n1,
                     int n2, float* d0, float* d1, float* d2, int blk1, int blk2, int64_t k,
                     const float* x, int prefetch) {
  constexpr int E = FloatInfo<TYPE>::kVecElems;
  constexpr int U = 4;
  const PartSel part = select_part(w0, w1, w2, n0, n1, n2, d0, d1, d2, blk1, blk2);
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
            const float4 xv = __ldg(xp + e4);
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

#pragma unroll
  for (int j = 0; j < RW; ++j) {
#pragma unroll
    for (int t = 0; t < NCOLS; ++t) {
      const float v = warp_sum(acc[j][t]);
      if (lane == 0 && row0 + j < part.n) part.dst[static_cast<int64_t>(t) * part.n + row0 + j] = v;
    }
  }
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
template <int TYPE, int PL, int R>
bool mat_vec_q_rows_launch(Launcher& l, const MatVecPart* parts, int n_parts, int64_t k,
                           const int8_t* aq, const float2* ads) {
  const int slots = rows_kernel_slots<TYPE, PL, R>();
  if (slots == 0) return false;
  const GroupArgs g = group_args(parts, n_parts, 1);
  int n[3];
  for (int i = 0; i < 3; ++i) n[i] = i < n_parts ? g.n[i] : 0;
  const int64_t n_rows = int64_t(n[0]) + n[1] + n[2];
  const int n_warps = static_cast<int>(std::min<int64_t>(ceil_div(n_rows, R), slots));
  l(mat_vec_q_rows_kernel<TYPE, PL, R>, dim3(static_cast<unsigned>(ceil_div(n_warps, kMvqWarps))),
    dim3(kMvqThreads), 0, g.w[0], g.w[1], g.w[2], n[0], n[1], n[2], g.dst[0], g.dst[1], g.dst[2],
    n_warps, static_cast<int>(k / 32), aq, ads, k, all_fixed(parts, n_parts) ? 1 : 0);
  return true;
}

// The register-resident kernel for rows of up to 64 pieces; false past that.
template <int TYPE>
bool mat_vec_q_rows(Launcher& l, const MatVecPart* parts, int n_parts, int64_t k, const int8_t* aq,
                    const float2* ads) {
  const int64_t per_lane = ceil_div(k / 32 * PieceInfo<TYPE>::kPerBlock, 32);
  if (per_lane <= 1) return mat_vec_q_rows_launch<TYPE, 1, 2>(l, parts, n_parts, k, aq, ads);
  if (per_lane <= 2) return mat_vec_q_rows_launch<TYPE, 2, 2>(l, parts, n_parts, k, aq, ads);
  return false;
}

template <int TYPE, int NCOLS>
void mat_vec_q(Launcher& l, const MatVecPart* parts, int n_parts, int64_t k, const uint8_t* ws) {
  const ActQ8 act = act_q8(const_cast<uint8_t*>(ws), k, NCOLS);
  const int8_t* aq = act.qs;
  const float2* ads = act.ds;
  const int64_t n_pieces = k / 32 * PieceInfo<TYPE>::kPerBlock;
  // Weights that others may write are loaded only after the wait (MatVecPart::fixed).
  int overlap = mat_vec_override().overlap >= 0 ? mat_vec_override().overlap : kMatVecOverlap;
  if (!all_fixed(parts, n_parts)) overlap &= ~1;
  if constexpr (NCOLS == 1) {
    MatVecConfig c = mat_vec_override();
    // Measured on an H200 (BENCHMARKS.md): short rows (at most 64 pieces) run fastest with the
    // activation in registers. Longer rows: two warps share a row's pieces, over four rows of
    // two pieces in flight for 4-bit weights; 8-bit weights (twice the pieces a row) do best
    // with four warps a row, over two rows of two pieces.
    if (c.rows == 0 && n_pieces <= 64 && mat_vec_q_rows<TYPE>(l, parts, n_parts, k, aq, ads))
      return;
    constexpr bool kQ8 = PieceInfo<TYPE>::kPerBlock == 2;
    if (c.rows == 0) c = kQ8 ? MatVecConfig{2, 2, 4} : MatVecConfig{4, 2, 2};
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
    mat_vec_q_launch<TYPE, NCOLS, 1, 2, 2>(l, parts, n_parts, k, aq, ads, overlap);
  }
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

template <int NCOLS>
void mat_vec_cols(Launcher& l, DType type, const MatVecPart* parts, int n_parts, int64_t k,
                  const float* x, const uint8_t* ws) {
  switch (type) {
    case DType::Q4_0:
      return mat_vec_q<kTypeQ4_0, NCOLS>(l, parts, n_parts, k, ws);
    case DType::Q4_1:
      return mat_vec_q<kTypeQ4_1, NCOLS>(l, parts, n_parts, k, ws);
    case DType::Q8_0:
      return mat_vec_q<kTypeQ8_0, NCOLS>(l, parts, n_parts, k, ws);
    case DType::F32:
      return mat_vec_f<kTypeF32, NCOLS>(l, parts, n_parts, k, x);
    case DType::F16:
      return mat_vec_f<kTypeF16, NCOLS>(l, parts, n_parts, k, x);
    case DType::BF16:
      return mat_vec_f<kTypeBF16, NCOLS>(l, parts, n_parts, k, x);
    default:
      throw ArgumentError(std::string("mul_mat: unsupported weight type ") + dtype_name(type));
  }
}

// ---- Tensor-core tiled product (prompt path) -------------------------------------------------
//
// dst[t, n] = sum_k x[t, k] * w[n, k]: A = activations (half, prepared once per mat-mul), B =
// weights dequantized to half in shared memory, fp32 accumulation with mma.sync m16n8k16.
// Block tile: BT tokens x 128 weights x BK k (64; 32 to compare), double-buffered in dynamic
// shared memory; the next weight tile is loaded into registers while the current one is
// multiplied.

constexpr int kTcBW = 128;

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s)
               : "memory");
}

__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_half2(float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// What one thread holds of the next weight tile: BK/2 consecutive k of one row (half a quant
// block at BK 32, a whole one at BK 64), raw, with the block's scale and minimum.
struct WeightRegs {
  uint32_t v[32];
  float d, m;
};

template <int TYPE, bool KALIGNED, int BK>
__device__ __forceinline__ void load_weight_regs(WeightRegs& r, const uint8_t* row,
                                                 const uint8_t* srow, int kt, int hsel, int64_t k) {
  constexpr int E = BK / 2;  // elements per thread
  if constexpr (TYPE == kTypeQ4_0 || TYPE == kTypeQ8_0 || TYPE == kTypeQ4_1) {
    // Split layout: the row's quants (16 or 32 bytes a block), its scales in srow.
    constexpr int QB = split_format(static_cast<DType>(TYPE)).quant_bytes;
    // At BK 64 each thread takes block 2 kt + hsel; at BK 32 half of block kt.
    const int blk = BK == 64 ? 2 * kt + hsel : kt;
    const int part = BK == 64 ? 0 : hsel;
    r.d = 0.0f;
    r.m = 0.0f;
#pragma unroll
    for (int i = 0; i < 32; ++i) r.v[i] = 0;
    if (static_cast<int64_t>(blk) * 32 >= k) return;  // past the row's last block: zeros
    if constexpr (TYPE == kTypeQ4_1) {
      const uint32_t dm = __ldg(reinterpret_cast<const uint32_t*>(srow) + blk);
      r.d = f16_bits_to_float(static_cast<uint16_t>(dm & 0xFFFF));
      r.m = f16_bits_to_float(static_cast<uint16_t>(dm >> 16));
    } else {
      r.d = f16_bits_to_float(__ldg(reinterpret_cast<const uint16_t*>(srow) + blk));
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
  if constexpr (TYPE == kTypeQ4_0 || TYPE == kTypeQ4_1) {
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
    mat_mul_tc_kernel(const uint8_t* w, size_t rb, const uint8_t* scales, size_t sb, int n,
                      int64_t k, const __half* xh, int64_t kp, int n_cols, float* dst) {
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
  load_weight_regs<TYPE, KALIGNED, BK>(regs, w_row, s_row, 0, hsel, k);
  store_weight_regs<TYPE, BK>(regs, &bs[0][b_row][0], hsel);
  cp_async_wait<0>();
  __syncthreads();

  for (int kt = 0; kt < n_kt; ++kt) {
    const int cur = kt & 1, nxt = cur ^ 1;
    const bool more = kt + 1 < n_kt;
    if (more) {
      load_a(nxt, kt + 1);
      load_weight_regs<TYPE, KALIGNED, BK>(regs, w_row, s_row, kt + 1, hsel, k);
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
  const int64_t kp = (k + kActPad - 1) / kActPad * kActPad;
  // Quantized weights are split (cuda/weight_layout.h): rows of quants, then rows of scales.
  constexpr SplitFormat f = split_format(static_cast<DType>(TYPE));
  constexpr bool kQuant = f.block_bytes != 0;
  const size_t nb = static_cast<size_t>(k / 32);
  const size_t rb = kQuant ? nb * f.quant_bytes : row_bytes(static_cast<DType>(TYPE), k);
  const size_t sb = kQuant ? nb * f.scale_bytes : 0;
  const uint8_t* sp = kQuant ? wp + static_cast<size_t>(n) * rb : wp;
  const bool aligned = k % 8 == 0 && reinterpret_cast<uintptr_t>(w) % 16 == 0;
  const size_t smem = tc_smem_bytes<BT, BK>();
  if (aligned) {
    l(mat_mul_tc_kernel<TYPE, BK, WT, MT, NT, true>, grid, dim3(256), smem, wp, rb, sp, sb,
      static_cast<int>(n), k, xh, kp, cols, dst);
  } else {
    l(mat_mul_tc_kernel<TYPE, BK, WT, MT, NT, false>, grid, dim3(256), smem, wp, rb, sp, sb,
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

__global__ void split_weight_kernel(SplitFormat f, const uint8_t* src, uint8_t* dst, int64_t first,
                                    int64_t n, int64_t n_blocks) {
  pdl_begin();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n)
    split_block(f, src + i * f.block_bytes, static_cast<size_t>(first + i),
                static_cast<size_t>(n_blocks), dst);
}

}  // namespace

void set_mat_vec_config(MatVecConfig c) { mat_vec_override() = c; }

void launch_split_weight(DType type, const uint8_t* src, uint8_t* dst, int64_t first, int64_t n,
                         int64_t n_blocks, cudaStream_t stream) {
  const SplitFormat f = split_format(type);
  if (f.block_bytes == 0)
    throw ArgumentError(std::string("split_weight: expected a quantized type, got ") +
                        dtype_name(type));
  if (n == 0) return;
  // At load time, outside any step: a plain launch, not through the Launcher.
  split_weight_kernel<<<static_cast<unsigned>(ceil_div(n, 256)), 256, 0, stream>>>(
      f, src, dst, first, n, n_blocks);
  GGRAPH_CUDA_CHECK(cudaGetLastError());
}

void prepare_kernels() {
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) == cudaSuccess &&
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess) {
    measure_rows_kernels<kTypeQ4_0>(sms);
    measure_rows_kernels<kTypeQ4_1>(sms);
    measure_rows_kernels<kTypeQ8_0>(sms);
  }
  cudaGetLastError();
  mat_mul_tc_prepare_type<kTypeQ4_0>();
  mat_mul_tc_prepare_type<kTypeQ4_1>();
  mat_mul_tc_prepare_type<kTypeQ8_0>();
  mat_mul_tc_prepare_type<kTypeF32>();
  mat_mul_tc_prepare_type<kTypeF16>();
  mat_mul_tc_prepare_type<kTypeBF16>();
}

void launch_mat_vec(Launcher& l, DType type, const MatVecPart* parts, int n_parts, int64_t k,
                    const float* x, const uint8_t* ws, int cols) {
  switch (cols) {
    case 1:
      return mat_vec_cols<1>(l, type, parts, n_parts, k, x, ws);
    case 2:
      return mat_vec_cols<2>(l, type, parts, n_parts, k, x, ws);
    case 3:
      return mat_vec_cols<3>(l, type, parts, n_parts, k, x, ws);
    case 4:
      return mat_vec_cols<4>(l, type, parts, n_parts, k, x, ws);
    case 5:
      return mat_vec_cols<5>(l, type, parts, n_parts, k, x, ws);
    case 6:
      return mat_vec_cols<6>(l, type, parts, n_parts, k, x, ws);
    case 7:
      return mat_vec_cols<7>(l, type, parts, n_parts, k, x, ws);
    case 8:
      return mat_vec_cols<8>(l, type, parts, n_parts, k, x, ws);
    default:
      throw ArgumentError("mul_mat: the mat-vec path takes 1 to " + std::to_string(kMatVecMaxCols) +
                          " columns, got " + std::to_string(cols));
  }
}

void launch_mat_mul_tc(Launcher& l, DType type, const void* w, int64_t n, int64_t k,
                       const uint8_t* ws, int cols, float* dst) {
  switch (type) {
    case DType::Q4_0:
      return mat_mul_tc_type<kTypeQ4_0>(l, w, n, k, ws, cols, dst);
    case DType::Q4_1:
      return mat_mul_tc_type<kTypeQ4_1>(l, w, n, k, ws, cols, dst);
    case DType::Q8_0:
      return mat_mul_tc_type<kTypeQ8_0>(l, w, n, k, ws, cols, dst);
    case DType::F32:
      return mat_mul_tc_type<kTypeF32>(l, w, n, k, ws, cols, dst);
    case DType::F16:
      return mat_mul_tc_type<kTypeF16>(l, w, n, k, ws, cols, dst);
    case DType::BF16:
      return mat_mul_tc_type<kTypeBF16>(l, w, n, k, ws, cols, dst);
    default:
      throw ArgumentError(std::string("mul_mat: unsupported weight type ") + dtype_name(type));
  }
}

}  // namespace ggraph::cuda
