// Matrix products with weights: mat-vec kernels for a few columns (decode) and tensor-core tiled
// kernels for many (prompt). Weights are [k, n] with row n contiguous (k elements).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "cuda/device_util.cuh"
#include "cuda/kernels.cuh"
#include "cuda/quant_words.h"

namespace ggraph::cuda {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

constexpr int kMvThreads = 256;  // 8 warps

template <int TYPE>
struct QuantInfo;
template <>
struct QuantInfo<kTypeQ4_0> {
  static constexpr int kBytes = 18;
};
template <>
struct QuantInfo<kTypeQ4_1> {
  static constexpr int kBytes = 20;
};
template <>
struct QuantInfo<kTypeQ8_0> {
  static constexpr int kBytes = 34;
};

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
// A block of 8 warps owns 8*RW consecutive rows. Rows are streamed through shared memory in
// chunks of 32 quant blocks per row with 16-byte cp.async copies (the rows' bytes are contiguous
// in the matrix, so the copies are fully coalesced whatever the 18/20/34-byte block alignment),
// several chunks in flight. Lane l then dots quant block l of the chunk with the activation,
// which was quantized to 8 bits once per mat-mul, using dp4a.

template <int TYPE, int RW>
struct MvqConfig {
  static constexpr int kRows = 8 * RW;
  static constexpr int kChunkBytes = 32 * QuantInfo<TYPE>::kBytes;
  // One spare 16-byte piece: a row's chunk starts at any 2-byte offset inside its first piece.
  static constexpr int kPieces = kChunkBytes / 16 + 2;
  static constexpr int kPitch = kPieces * 16;
  static constexpr int kStages = kRows * kPitch * 3 <= 40 * 1024 ? 3 : 2;
};

// One block's dot product with an 8-bit activation block (a: its 32 int8 as 8 words; ad: its
// d and d * sum(q)), from the block's header and quant words.
template <int TYPE>
__device__ __forceinline__ void quant_dot_words(uint32_t header, const uint32_t* q,
                                                const int (&a)[8], float2 ad, float& acc) {
  const float d = f16_bits_to_float(static_cast<uint16_t>(header & 0xFFFF));
  int s = 0;
  if constexpr (TYPE == kTypeQ8_0) {
#pragma unroll
    for (int i = 0; i < 8; ++i) s = __dp4a(static_cast<int>(q[i]), a[i], s);
    acc += d * static_cast<float>(s) * ad.x;
  } else {
    // Byte j of the quants holds element j (low nibble) and element j + 16 (high nibble).
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int v = static_cast<int>(q[i]);
      s = __dp4a(v & 0x0F0F0F0F, a[i], s);
      s = __dp4a((v >> 4) & 0x0F0F0F0F, a[i + 4], s);
    }
    if constexpr (TYPE == kTypeQ4_0) {
      // sum((q - 8) * d * a_i * d8) = d * (d8 * sum(q a) - 8 * d8 * sum(a))
      acc += d * (static_cast<float>(s) * ad.x - 8.0f * ad.y);
    } else {
      const float m = f16_bits_to_float(static_cast<uint16_t>(header >> 16));
      acc += d * static_cast<float>(s) * ad.x + m * ad.y;
    }
  }
}

// The same from a block in shared memory (2-byte aligned; 4-byte for Q4_1).
template <int TYPE>
__device__ __forceinline__ void quant_dot(const uint8_t* bp, const int (&a)[8], float2 ad,
                                          float& acc) {
  uint32_t q[8];
  uint32_t header;
  if constexpr (TYPE == kTypeQ4_1) {
    const uint32_t* u = reinterpret_cast<const uint32_t*>(bp);
    header = u[0];
#pragma unroll
    for (int i = 0; i < 4; ++i) q[i] = u[1 + i];
  } else {
    constexpr int NQ = TYPE == kTypeQ8_0 ? 8 : 4;
    const uint16_t* h = reinterpret_cast<const uint16_t*>(bp);
    header = h[0];
#pragma unroll
    for (int i = 0; i < NQ; ++i) q[i] = h[1 + 2 * i] | (static_cast<uint32_t>(h[2 + 2 * i]) << 16);
  }
  quant_dot_words<TYPE>(header, q, a, ad, acc);
}

// Loads the 8-bit activation block kb of column t.
__device__ __forceinline__ void load_act(const int8_t* aq, const float2* ads, int64_t k, int nb,
                                         int t, int kb, int (&a)[8], float2& ad) {
  const int4* ap = reinterpret_cast<const int4*>(aq + t * k + static_cast<int64_t>(kb) * 32);
  const int4 lo = __ldg(ap), hi = __ldg(ap + 1);
  a[0] = lo.x, a[1] = lo.y, a[2] = lo.z, a[3] = lo.w;
  a[4] = hi.x, a[5] = hi.y, a[6] = hi.z, a[7] = hi.w;
  ad = __ldg(ads + static_cast<int64_t>(t) * nb + kb);
}

// ---- Quantized mat-vec, direct (rows 16-byte aligned) -----------------------------------------
//
// Each lane streams superblocks (8 Q4_0/Q8_0 or 4 Q4_1 blocks: 144, 272 or 80 bytes) of one row
// straight into registers with 16-byte loads, all in flight at once, then dots every block with
// the 8-bit activation. `lpr` lanes share a row (the superblock count rounded up to a power of
// two, at most 32), so short rows still fill the warp; a segmented shuffle sums each row.
// Only with GGRAPH_CUDA_DIRECT_MATVEC=1: on an H200 it reached 23% of copy bandwidth at Q4_0
// 4096x11008 against the staged kernel's 42%, the lanes' loads lying 144 bytes apart rather
// than side by side.

template <int TYPE>
struct SuperOf;
template <>
struct SuperOf<kTypeQ4_0> {
  using L = SuperQ4_0;
};
template <>
struct SuperOf<kTypeQ4_1> {
  using L = SuperQ4_1;
};
template <>
struct SuperOf<kTypeQ8_0> {
  using L = SuperQ8_0;
};

template <int TYPE, int NCOLS>
__global__ void __launch_bounds__(kMvThreads)
    mat_vec_q_direct_kernel(const uint8_t* w0, const uint8_t* w1, const uint8_t* w2, int n0, int n1,
                            int n2, float* d0, float* d1, float* d2, int blk1, int blk2, int nsb,
                            int lpr, const int8_t* aq, const float2* ads, int64_t k) {
  using L = typename SuperOf<TYPE>::L;
  const PartSel part = select_part(w0, w1, w2, n0, n1, n2, d0, d1, d2, blk1, blk2);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int rows_per_warp = 32 / lpr;
  const int row = (part.local_block * 8 + warp) * rows_per_warp + lane / lpr;
  const int nb = nsb * L::kBlocks;
  const uint8_t* wrow = part.w + static_cast<size_t>(min(row, part.n - 1)) * nb * L::kBlockBytes;

  float acc[NCOLS];
#pragma unroll
  for (int t = 0; t < NCOLS; ++t) acc[t] = 0.0f;

  for (int j = lane % lpr; j < nsb; j += lpr) {
    const uint4* src = reinterpret_cast<const uint4*>(wrow + static_cast<size_t>(j) * L::kBytes);
    uint32_t w[L::kWords];
#pragma unroll
    for (int i = 0; i < L::kWords / 4; ++i) {
      const uint4 v = __ldg(src + i);
      w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
    }
#pragma unroll
    for (int b = 0; b < L::kBlocks; ++b) {
      uint32_t header, q[L::kQuantWords];
      split_block<L>(w, b, header, q);
#pragma unroll
      for (int t = 0; t < NCOLS; ++t) {
        int a[8];
        float2 ad;
        load_act(aq, ads, k, nb, t, j * L::kBlocks + b, a, ad);
        quant_dot_words<TYPE>(header, q, a, ad, acc[t]);
      }
    }
  }

#pragma unroll
  for (int t = 0; t < NCOLS; ++t) {
    float v = acc[t];
    for (int o = lpr / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane % lpr == 0 && row < part.n) part.dst[static_cast<int64_t>(t) * part.n + row] = v;
  }
}

template <int TYPE, int NCOLS, int RW>
__global__ void __launch_bounds__(kMvThreads)
    mat_vec_q_kernel(const uint8_t* w0, const uint8_t* w1, const uint8_t* w2, int n0, int n1,
                     int n2, float* d0, float* d1, float* d2, int blk1, int blk2, int nb,
                     const int8_t* aq, const float2* ads, int64_t k) {
  using Cfg = MvqConfig<TYPE, RW>;
  constexpr int BS = QuantInfo<TYPE>::kBytes;
  constexpr int STAGES = Cfg::kStages;
  __shared__ __align__(16) uint8_t stage[STAGES][Cfg::kRows][Cfg::kPitch];

  const PartSel part = select_part(w0, w1, w2, n0, n1, n2, d0, d1, d2, blk1, blk2);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int row0 = part.local_block * Cfg::kRows;
  const size_t rb = static_cast<size_t>(nb) * BS;
  const int n_chunks = (nb + 31) / 32;

  auto issue = [&](int c) {
    const int s = c % STAGES;
    const int len = min(32, nb - c * 32) * BS;
    for (int p = tid; p < Cfg::kRows * Cfg::kPieces; p += kMvThreads) {
      const int r = p / Cfg::kPieces, i = p % Cfg::kPieces;
      const int row = min(row0 + r, part.n - 1);
      const uint8_t* g = part.w + row * rb + static_cast<size_t>(c) * Cfg::kChunkBytes;
      const int shift = static_cast<int>(reinterpret_cast<uintptr_t>(g) & 15);
      if (i * 16 < shift + len) cp_async16(&stage[s][r][i * 16], g - shift + i * 16);
    }
  };

  float acc[RW][NCOLS];
  int shift[RW];
#pragma unroll
  for (int j = 0; j < RW; ++j) {
    const int row = min(row0 + warp * RW + j, part.n - 1);
    // Chunk sizes are multiples of 16 bytes, so a row's offset inside its first piece is fixed.
    shift[j] = static_cast<int>(reinterpret_cast<uintptr_t>(part.w + row * rb) & 15);
#pragma unroll
    for (int t = 0; t < NCOLS; ++t) acc[j][t] = 0.0f;
  }

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < n_chunks) issue(s);
    cp_async_commit();
  }
  for (int c = 0; c < n_chunks; ++c) {
    if (c + STAGES - 1 < n_chunks) issue(c + STAGES - 1);
    cp_async_commit();
    cp_async_wait<STAGES - 1>();
    __syncthreads();
    const int kb = c * 32 + lane;
    if (kb < nb) {
      int a[NCOLS][8];
      float2 ad[NCOLS];
#pragma unroll
      for (int t = 0; t < NCOLS; ++t) load_act(aq, ads, k, nb, t, kb, a[t], ad[t]);
      const int s = c % STAGES;
#pragma unroll
      for (int j = 0; j < RW; ++j) {
        const uint8_t* bp = &stage[s][warp * RW + j][shift[j] + lane * BS];
#pragma unroll
        for (int t = 0; t < NCOLS; ++t) quant_dot<TYPE>(bp, a[t], ad[t], acc[j][t]);
      }
    }
    __syncthreads();
  }

#pragma unroll
  for (int j = 0; j < RW; ++j) {
    const int row = row0 + warp * RW + j;
#pragma unroll
    for (int t = 0; t < NCOLS; ++t) {
      const float v = warp_sum(acc[j][t]);
      if (lane == 0 && row < part.n) part.dst[static_cast<int64_t>(t) * part.n + row] = v;
    }
  }
}

// ---- Quantized mat-vec, warp-streamed (the default) --------------------------------------------
//
// A warp walks its rows (one by default) in chunks of 32 * U quant blocks. All lanes load a
// chunk's 16-byte pieces side by side (fully coalesced, every load in flight before any use) and
// park them in the warp's own shared buffer; while the next chunk's loads are in flight, lane l
// dots blocks l, l + 32, ... of the parked chunk with the 8-bit activation. No block-wide barrier:
// each warp runs at its own pace, and the many resident warps keep the memory system busy. A
// chunk's bytes are a multiple of 16, so a row's offset inside its first piece holds for every
// chunk.

constexpr int kMvwWarps = 4;
constexpr int kMvwThreads = 32 * kMvwWarps;

template <int TYPE>
struct MvwConfig {
  static constexpr int kBS = QuantInfo<TYPE>::kBytes;
  // 4-5 (Q4_0, Q4_1) or 9 (Q8_0) 16-byte loads per lane in flight.
  static constexpr int kU = 4;
  static constexpr int kChunkBlocks = 32 * kU;
  static constexpr int kChunkBytes = kChunkBlocks * kBS;
  // One spare piece: a row starts at any even offset inside its first piece.
  static constexpr int kPieces = kChunkBytes / 16 + 1;
  static constexpr int kLoads = (kPieces + 31) / 32;
  static_assert(kChunkBytes % 16 == 0, "chunks are whole 16-byte pieces");
};

// Weights are read once: keep them out of L1, where the activation lives.
__device__ __forceinline__ uint4 ldg_stream16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

template <int TYPE, int NCOLS>
__global__ void __launch_bounds__(kMvwThreads)
    mat_vec_q_warp_kernel(const uint8_t* w0, const uint8_t* w1, const uint8_t* w2, int n0, int n1,
                          int n2, float* d0, float* d1, float* d2, int n_warps, int nb,
                          const int8_t* aq, const float2* ads, int64_t k) {
  using C = MvwConfig<TYPE>;
  __shared__ __align__(16) uint4 buf[kMvwWarps][C::kPieces];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gw = blockIdx.x * kMvwWarps + warp;
  const int n_rows = n0 + n1 + n2;
  if (gw >= n_warps || gw >= n_rows) return;  // the whole warp: no block-wide barrier follows
  const int n_chunks = (nb + C::kChunkBlocks - 1) / C::kChunkBlocks;
  const size_t rb = static_cast<size_t>(nb) * C::kBS;
  uint4* sb = buf[warp];

  // Global row g (the parts one after the other): its first byte.
  auto row_ptr = [&](int g) {
    if (g < n0) return w0 + g * rb;
    if (g < n0 + n1) return w1 + (g - n0) * rb;
    return w2 + (g - n0 - n1) * rb;
  };
  // Chunk c of the row at rp: how many 16-byte pieces hold it.
  auto pieces_of = [&](const uint8_t* rp, int c) {
    const int shift = static_cast<int>(reinterpret_cast<uintptr_t>(rp) & 15);
    const int len = min(C::kChunkBlocks, nb - c * C::kChunkBlocks) * C::kBS;
    return (shift + len + 15) / 16;
  };
  uint4 v[C::kLoads];
  auto issue = [&](int g, int c) {
    const uint8_t* rp = row_ptr(g);
    const int pieces = pieces_of(rp, c);
    const uint4* src = reinterpret_cast<const uint4*>(rp - (reinterpret_cast<uintptr_t>(rp) & 15)) +
                       c * (C::kChunkBytes / 16);
#pragma unroll
    for (int i = 0; i < C::kLoads; ++i) {
      const int p = lane + 32 * i;
      if (p < pieces) v[i] = ldg_stream16(src + p);
    }
  };

  float acc[NCOLS];
#pragma unroll
  for (int t = 0; t < NCOLS; ++t) acc[t] = 0.0f;

  // Rows gw, gw + n_warps, ...; each chunk's loads go out before the previous chunk is used.
  int g = gw, c = 0;
  issue(g, c);
  while (true) {
    const uint8_t* rp = row_ptr(g);
    const int pieces = pieces_of(rp, c);
    const uint8_t* sbytes =
        reinterpret_cast<const uint8_t*>(sb) + (reinterpret_cast<uintptr_t>(rp) & 15);
    __syncwarp();  // every lane is done with the previous chunk's buffer
#pragma unroll
    for (int i = 0; i < C::kLoads; ++i) {
      const int p = lane + 32 * i;
      if (p < pieces) sb[p] = v[i];
    }
    __syncwarp();
    int ng = g, nc = c + 1;
    if (nc == n_chunks) nc = 0, ng += n_warps;
    const bool more = ng < n_rows;
    if (more) issue(ng, nc);

    const int c0 = c * C::kChunkBlocks;
    if constexpr (NCOLS == 1) {
      // The first activation block goes out now, each next one while the current is used.
      int a_next[8];
      float2 ad_next;
      if (c0 + lane < nb) load_act(aq, ads, k, nb, 0, c0 + lane, a_next, ad_next);
#pragma unroll
      for (int u = 0; u < C::kU; ++u) {
        const int b = 32 * u + lane;
        const int kb = c0 + b;
        if (kb >= nb) break;
        int a[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) a[e] = a_next[e];
        const float2 ad = ad_next;
        if (u + 1 < C::kU && kb + 32 < nb) load_act(aq, ads, k, nb, 0, kb + 32, a_next, ad_next);
        quant_dot<TYPE>(sbytes + b * C::kBS, a, ad, acc[0]);
      }
    } else {
#pragma unroll
      for (int u = 0; u < C::kU; ++u) {
        const int b = 32 * u + lane;
        const int kb = c0 + b;
        if (kb < nb) {
#pragma unroll
          for (int t = 0; t < NCOLS; ++t) {
            int a[8];
            float2 ad;
            load_act(aq, ads, k, nb, t, kb, a, ad);
            quant_dot<TYPE>(sbytes + b * C::kBS, a, ad, acc[t]);
          }
        }
      }
    }

    if (c == n_chunks - 1) {
      float* dst = g < n0 ? d0 : g < n0 + n1 ? d1 : d2;
      const int n = g < n0 ? n0 : g < n0 + n1 ? n1 : n2;
      const int r = g < n0 ? g : g < n0 + n1 ? g - n0 : g - n0 - n1;
#pragma unroll
      for (int t = 0; t < NCOLS; ++t) {
        const float s = warp_sum(acc[t]);
        if (lane == 0) dst[static_cast<int64_t>(t) * n + r] = s;
        acc[t] = 0.0f;
      }
    }
    if (!more) break;
    g = ng;
    c = nc;
  }
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
                     const float* x) {
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
    for (int64_t v0 = lane; v0 < n_vec; v0 += 32 * U) {
      uint4 raw[U][RW];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t v = v0 + 32 * u;
#pragma unroll
        for (int j = 0; j < RW; ++j)
          raw[u][j] = v < n_vec ? __ldg(reinterpret_cast<const uint4*>(rows[j]) + v)
                                : make_uint4(0, 0, 0, 0);
      }
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
    }
  } else {
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

// Resident warps of mat_vec_q_warp_kernel over the whole device, measured once (in
// prepare_kernels, before any capture); 0 until then.
template <int TYPE, int NCOLS>
int& mat_vec_warp_slots() {
  static int slots = 0;
  return slots;
}

template <int TYPE, int NCOLS>
void measure_warp_slots(int sms) {
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, mat_vec_q_warp_kernel<TYPE, NCOLS>,
                                                    kMvwThreads, 0) != cudaSuccess)
    blocks = 0;
  mat_vec_warp_slots<TYPE, NCOLS>() = blocks * sms * kMvwWarps;
}

template <int TYPE>
void measure_warp_slots_type(int sms) {
  measure_warp_slots<TYPE, 1>(sms);
  measure_warp_slots<TYPE, 2>(sms);
  measure_warp_slots<TYPE, 3>(sms);
  measure_warp_slots<TYPE, 4>(sms);
  measure_warp_slots<TYPE, 5>(sms);
  measure_warp_slots<TYPE, 6>(sms);
  measure_warp_slots<TYPE, 7>(sms);
  measure_warp_slots<TYPE, 8>(sms);
}

// ---- Launch helpers for the mat-vec kernels -----------------------------------------------------

struct GroupArgs {
  const uint8_t* w[3] = {nullptr, nullptr, nullptr};
  int n[3] = {0, 0, 0};
  float* dst[3] = {nullptr, nullptr, nullptr};
  int blk1 = 0, blk2 = 0, total = 0;
};

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

template <int TYPE, int NCOLS>
void mat_vec_q(Launcher& l, const MatVecPart* parts, int n_parts, int64_t k, const uint8_t* ws) {
  const int nb = static_cast<int>(k / 32);
  const auto* aq = reinterpret_cast<const int8_t*>(ws);
  const auto* ads =
      reinterpret_cast<const float2*>(ws + static_cast<size_t>(k * NCOLS + 255) / 256 * 256);
  using L = typename SuperOf<TYPE>::L;
  bool direct = nb % L::kBlocks == 0 && direct_mat_vec();
  for (int i = 0; i < n_parts; ++i)
    direct = direct && reinterpret_cast<uintptr_t>(parts[i].w) % 16 == 0;
  if (direct) {
    const int nsb = nb / L::kBlocks;
    int lpr = 1;
    while (lpr < nsb && lpr < 32) lpr *= 2;
    const GroupArgs g = group_args(parts, n_parts, 8 * (32 / lpr));
    l(mat_vec_q_direct_kernel<TYPE, NCOLS>, dim3(g.total), dim3(kMvThreads), 0, g.w[0], g.w[1],
      g.w[2], g.n[0], g.n[1], g.n[2], g.dst[0], g.dst[1], g.dst[2], g.blk1, g.blk2, nsb, lpr, aq,
      ads, k);
    return;
  }
  if (!staged_mat_vec()) {
    const GroupArgs g = group_args(parts, n_parts, kMvwWarps);
    int n[3];
    for (int i = 0; i < 3; ++i) n[i] = i < n_parts ? g.n[i] : 0;
    const int n_rows = n[0] + n[1] + n[2];
    // One row a warp. With GGRAPH_CUDA_MATVEC_FILL_DEVICE=1: as many warps as the device holds
    // at once, each walking an equal share of rows with the next chunk's loads in flight; on
    // an H200 that measured 341 tok/s at Llama-2-7B Q4_0 against 349 for one row a warp.
    int n_warps = n_rows;
    const int max_warps = mat_vec_warp_slots<TYPE, NCOLS>();
    if (fill_device_mat_vec() && max_warps > 0) {
      const int per_warp = static_cast<int>(ceil_div(n_rows, max_warps));
      n_warps = static_cast<int>(ceil_div(n_rows, per_warp));
    }
    l(mat_vec_q_warp_kernel<TYPE, NCOLS>, dim3(static_cast<unsigned>(ceil_div(n_warps, kMvwWarps))),
      dim3(kMvwThreads), 0, g.w[0], g.w[1], g.w[2], n[0], n[1], n[2], g.dst[0], g.dst[1], g.dst[2],
      n_warps, nb, aq, ads, k);
    return;
  }
  constexpr int RW = NCOLS <= 2 ? 1 : 2;
  const GroupArgs g = group_args(parts, n_parts, 8 * RW);
  l(mat_vec_q_kernel<TYPE, NCOLS, RW>, dim3(g.total), dim3(kMvThreads), 0, g.w[0], g.w[1], g.w[2],
    g.n[0], g.n[1], g.n[2], g.dst[0], g.dst[1], g.dst[2], g.blk1, g.blk2, nb, aq, ads, k);
}

template <int TYPE, int NCOLS>
void mat_vec_f(Launcher& l, const MatVecPart* parts, int n_parts, int64_t k, const float* x) {
  constexpr int RW = NCOLS <= 2 ? 1 : 2;
  const GroupArgs g = group_args(parts, n_parts, 8 * RW);
  bool vec = k % FloatInfo<TYPE>::kVecElems == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  for (int i = 0; i < 3; ++i) vec = vec && reinterpret_cast<uintptr_t>(g.w[i]) % 16 == 0;
  if (vec) {
    l(mat_vec_f_kernel<TYPE, NCOLS, RW, true>, dim3(g.total), dim3(kMvThreads), 0, g.w[0], g.w[1],
      g.w[2], g.n[0], g.n[1], g.n[2], g.dst[0], g.dst[1], g.dst[2], g.blk1, g.blk2, k, x);
  } else {
    l(mat_vec_f_kernel<TYPE, NCOLS, RW, false>, dim3(g.total), dim3(kMvThreads), 0, g.w[0], g.w[1],
      g.w[2], g.n[0], g.n[1], g.n[2], g.dst[0], g.dst[1], g.dst[2], g.blk1, g.blk2, k, x);
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
__device__ __forceinline__ void load_weight_regs(WeightRegs& r, const uint8_t* row, int kt,
                                                 int hsel, int64_t k) {
  constexpr int E = BK / 2;  // elements per thread
  if constexpr (TYPE == kTypeQ4_0 || TYPE == kTypeQ8_0 || TYPE == kTypeQ4_1) {
    constexpr int BS = TYPE == kTypeQ4_0 ? 18 : TYPE == kTypeQ4_1 ? 20 : 34;
    // At BK 64 each thread takes block 2 kt + hsel; at BK 32 half of block kt.
    const int blk = BK == 64 ? 2 * kt + hsel : kt;
    const int part = BK == 64 ? 0 : hsel;
    r.d = 0.0f;
    r.m = 0.0f;
#pragma unroll
    for (int i = 0; i < 32; ++i) r.v[i] = 0;
    if (static_cast<int64_t>(blk) * 32 >= k) return;  // past the row's last block: zeros
    const uint8_t* b = row + static_cast<size_t>(blk) * BS;
    if constexpr (TYPE == kTypeQ4_1) {
      const uint32_t* u = reinterpret_cast<const uint32_t*>(b);
      const uint32_t dm = __ldg(u);
      r.d = f16_bits_to_float(static_cast<uint16_t>(dm & 0xFFFF));
      r.m = f16_bits_to_float(static_cast<uint16_t>(dm >> 16));
      constexpr int NW = E / 8;  // 32-bit words of quants: 2 (half block) or 4
#pragma unroll
      for (int i = 0; i < NW; ++i) r.v[i] = __ldg(u + 1 + part * NW + i);
    } else {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(b);
      r.d = f16_bits_to_float(__ldg(h));
      constexpr int NH = TYPE == kTypeQ4_0 ? E / 4 : E / 2;  // 16-bit words of quants
#pragma unroll
      for (int i = 0; i < NH; ++i) r.v[i] = __ldg(h + 1 + part * NH + i);
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
    auto byte_at = [&](int e) -> uint32_t {
      if constexpr (TYPE == kTypeQ4_0) return (r.v[e / 2] >> (8 * (e % 2))) & 0xFF;
      return (r.v[e / 4] >> (8 * (e % 4))) & 0xFF;
    };
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
        const int8_t q0 = static_cast<int8_t>(r.v[i] & 0xFF);
        const int8_t q1 = static_cast<int8_t>((r.v[i] >> 8) & 0xFF);
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
    mat_mul_tc_kernel(const uint8_t* w, size_t rb, int n, int64_t k, const __half* xh, int64_t kp,
                      int n_cols, float* dst) {
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
  load_weight_regs<TYPE, KALIGNED, BK>(regs, w_row, 0, hsel, k);
  store_weight_regs<TYPE, BK>(regs, &bs[0][b_row][0], hsel);
  cp_async_wait<0>();
  __syncthreads();

  for (int kt = 0; kt < n_kt; ++kt) {
    const int cur = kt & 1, nxt = cur ^ 1;
    const bool more = kt + 1 < n_kt;
    if (more) {
      load_a(nxt, kt + 1);
      load_weight_regs<TYPE, KALIGNED, BK>(regs, w_row, kt + 1, hsel, k);
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
  const size_t rb = row_bytes(static_cast<DType>(TYPE), k);
  const bool aligned = k % 8 == 0 && reinterpret_cast<uintptr_t>(w) % 16 == 0;
  const size_t smem = tc_smem_bytes<BT, BK>();
  if (aligned) {
    l(mat_mul_tc_kernel<TYPE, BK, WT, MT, NT, true>, grid, dim3(256), smem, wp, rb,
      static_cast<int>(n), k, xh, kp, cols, dst);
  } else {
    l(mat_mul_tc_kernel<TYPE, BK, WT, MT, NT, false>, grid, dim3(256), smem, wp, rb,
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

}  // namespace

void prepare_kernels() {
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) == cudaSuccess &&
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess) {
    measure_warp_slots_type<kTypeQ4_0>(sms);
    measure_warp_slots_type<kTypeQ4_1>(sms);
    measure_warp_slots_type<kTypeQ8_0>(sms);
  }
  mat_mul_tc_prepare_type<kTypeQ4_0>();
  mat_mul_tc_prepare_type<kTypeQ4_1>();
  mat_mul_tc_prepare_type<kTypeQ8_0>();
  mat_mul_tc_prepare_type<kTypeF32>();
  mat_mul_tc_prepare_type<kTypeF16>();
  mat_mul_tc_prepare_type<kTypeBF16>();
}

bool direct_mat_vec() {
  static const bool direct = [] {
    const char* v = std::getenv("GGRAPH_CUDA_DIRECT_MATVEC");
    return v && std::strcmp(v, "0") != 0;
  }();
  return direct;
}

bool fill_device_mat_vec() {
  static const bool fill = [] {
    const char* v = std::getenv("GGRAPH_CUDA_MATVEC_FILL_DEVICE");
    return v && std::strcmp(v, "0") != 0;
  }();
  return fill;
}

bool staged_mat_vec() {
  static const bool staged = [] {
    const char* v = std::getenv("GGRAPH_CUDA_STAGED_MATVEC");
    return v && std::strcmp(v, "0") != 0;
  }();
  return staged;
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
