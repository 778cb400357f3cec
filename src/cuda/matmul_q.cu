// Products of quantized weights with a few to kMatMulQ8MaxCols columns (decode batches) on the
// int8 tensor cores: mma.sync m16n8k32 of the weights' 4- or 8-bit quants against the 8-bit
// activation (launch_quantize_act), each 32-element block's integer sums scaled in float.
//
// A block of four warps owns 16 * WM rows and every column; its k is staged SB blocks of 32 at
// a time through a cp.async pipeline (Q8Shape: both by the number of column tiles): the rows'
// quants and scale records (the split layout, cuda/weight_layout.h) and the columns' 8-bit
// values and (d, d * sum) pairs. Warps split the rows (WM of them, 16 rows each) and a stage's
// blocks (4 / WM of them); the k-split warps' sums meet in shared memory at the end, always in
// the same order. Few row blocks also split k over the grid (Q8Plan).
//
// Fragments come from shared memory by ldmatrix, which hands lane 4g + t word t of row g: of a
// 4-bit piece (byte j: element j in the low nibble, j + 16 in the high) that word's low nibbles
// are elements 4t..4t+3 and its high ones 16 + 4t.., exactly the A fragment's k of row g; the
// activation's words t and 4 + t are the B fragment's. Unsigned nibbles dot as they are; the
// formats' offsets and minimums enter through the activation's block sums:
//   sum((s q + m) a d8) = s * d8 * sum(q a) + m * (d8 * sum(a)).
// In shared memory, 16-byte chunks of a row (or column) are swizzled by its low three bits, so
// that the eight row addresses of an ldmatrix fall in distinct banks.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "cuda/device_util.cuh"
#include "cuda/kernels.cuh"
#include "cuda/weight_layout.h"

namespace ggraph::cuda {
namespace {

constexpr int kQ8Warps = 4;
constexpr int kQ8Threads = 32 * kQ8Warps;
// Split-k: a product of few row blocks splits k over enough blocks to make about this many in
// all (a constant, so that the plan depends on the shape alone).
constexpr int kQ8TargetBlocks = 256;
constexpr int kQ8MaxSplits = 8;

constexpr bool mma_q8_type(int t) {
  return t == kTypeQ4_0 || t == kTypeQ4_1 || t == kTypeQ8_0 || t == kTypeQ4_K;
}

// The tile of NT column tiles (8 columns each): WM warps of 16 rows, SB blocks of 32 a stage,
// STAGES stages. Few columns take short row blocks and long stages (the weights' bytes in
// flight); many take tall row blocks (each activation byte staged serves more rows).
template <int NT>
struct Q8Shape;
template <>
struct Q8Shape<1> {
  static constexpr int kWM = 1, kSB = 32, kStages = 4;
};
template <>
struct Q8Shape<2> {
  static constexpr int kWM = 2, kSB = 16, kStages = 3;
};
template <>
struct Q8Shape<4> {
  static constexpr int kWM = 2, kSB = 8, kStages = 3;
};
template <>
struct Q8Shape<8> {
  static constexpr int kWM = 4, kSB = 8, kStages = 3;
};

template <int TYPE, int NT>
struct Q8Tile {
  static constexpr SplitFormat kSplit = split_format(static_cast<DType>(TYPE));
  static constexpr int kWM = Q8Shape<NT>::kWM, kSB = Q8Shape<NT>::kSB;
  static constexpr int kStages = Q8Shape<NT>::kStages;
  static constexpr int kStageK = 32 * kSB;                // elements of k a stage
  static constexpr int kQuantBytes = kSplit.quant_bytes;  // a row's bytes per 32 elements
  static constexpr int kRowBytes = kSB * kQuantBytes;     // a row's quants a stage
  // A row's scale bytes a stage (whole records: a K-quant stage is whole 256-blocks).
  static constexpr int kScaleBytes = kSplit.scale_bytes * kStageK / kSplit.block_elems;
  static constexpr int kRows = 16 * kWM;
  static constexpr int kCols = 8 * NT;
  static constexpr int kW = kRows * kRowBytes;     // quants
  static constexpr int kWS = kRows * kScaleBytes;  // scale records
  static constexpr int kA = kCols * kStageK;       // activation values
  static constexpr int kAS = kCols * kSB * 8;      // activation (d, d * sum) pairs
  static constexpr int kStage = kW + kWS + kA + kAS;
  static constexpr int kSmem = kStages * kStage;
};

// c += a * b: a 16x32 (row) and b 32x8 (column) signed bytes, c 16x8 in int32.
__device__ __forceinline__ void mma_s8_16832(int (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Scale s and offset m of 32-block j of a row's stage (scale record bytes at rec): the block's
// values are s * q + m.
template <int TYPE>
__device__ __forceinline__ float2 block_scale(const uint8_t* rec, int j) {
  if constexpr (TYPE == kTypeQ4_0) {
    const float d = f16_bits_to_float(reinterpret_cast<const uint16_t*>(rec)[j]);
    return make_float2(d, -8.0f * d);
  } else if constexpr (TYPE == kTypeQ4_1) {
    const uint32_t v = reinterpret_cast<const uint32_t*>(rec)[j];
    return make_float2(f16_bits_to_float(static_cast<uint16_t>(v & 0xFFFF)),
                       f16_bits_to_float(static_cast<uint16_t>(v >> 16)));
  } else if constexpr (TYPE == kTypeQ8_0) {
    return make_float2(f16_bits_to_float(reinterpret_cast<const uint16_t*>(rec)[j]), 0.0f);
  } else {
    static_assert(TYPE == kTypeQ4_K, "a format of the int8 product");
    const uint4 v = reinterpret_cast<const uint4*>(rec)[j / 8];
    const uint32_t s[4] = {v.x, v.y, v.z, v.w};
    const float2 dm = k_scale_min_dev(s, j % 8);
    return make_float2(dm.x, -dm.y);
  }
}

// Rows of a block, and k splits, of a product (a function of the shape alone).
struct Q8Plan {
  int rows, splits;
};
template <int TYPE, int NT>
Q8Plan q8_plan(int64_t n, int64_t k) {
  using T = Q8Tile<TYPE, NT>;
  const int stages = static_cast<int>(ceil_div(k / 32, T::kSB));
  const int64_t row_blocks = ceil_div(n, T::kRows);
  int splits = static_cast<int>(ceil_div(kQ8TargetBlocks, row_blocks));
  splits = std::max(1, std::min({splits, kQ8MaxSplits, stages / 2}));
  return {T::kRows, splits};
}

// Split-k (gridDim.y > 1): each split leaves its sums in partials [split][col][row]; the last
// split of a row block to finish (counters: a ticket a row block, left at zero) adds them in
// split order, so that the result does not depend on which finished last.
template <int TYPE, int NT>
__global__ void __launch_bounds__(kQ8Threads)
    mat_mul_q8_kernel(const uint8_t* w, int n, int k, const int8_t* aq, const float2* ads, int cols,
                      float* dst, float* partials, unsigned* counters) {
  using T = Q8Tile<TYPE, NT>;
  constexpr int WM = T::kWM, WK = kQ8Warps / WM;  // warps sharing a stage's blocks
  constexpr int kSB = T::kSB, kStages = T::kStages;
  constexpr int kPerWarp = kSB / WK;
  static_assert(kPerWarp % 2 == 0, "blocks go in pairs");
  extern __shared__ __align__(16) uint8_t smem[];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = warp % WM, wk = warp / WM;
  const int row0 = blockIdx.x * T::kRows;
  const int nb = k / 32, n_stages = (nb + kSB - 1) / kSB;
  const int s_begin = n_stages * blockIdx.y / gridDim.y;
  const int s_end = n_stages * (blockIdx.y + 1) / gridDim.y;
  const size_t row_q = static_cast<size_t>(nb) * T::kQuantBytes;
  const size_t row_s = static_cast<size_t>(k / T::kSplit.block_elems) * T::kSplit.scale_bytes;
  const uint8_t* scales = w + static_cast<size_t>(n) * row_q;  // no high bits in these formats

  pdl_wait();
  // Stage s: blocks kSB s .. kSB (s + 1) - 1 of k; those past the row's end (k / 32 blocks) are
  // zeros, which add nothing (their scales and activation pairs are zeros too).
  auto load_stage = [&](int s) {
    uint8_t* st = smem + ((s - s_begin) % kStages) * T::kStage;
    uint8_t* sw = st;
    uint8_t* sws = st + T::kW;
    uint8_t* sa = sws + T::kWS;
    uint8_t* sas = sa + T::kA;
    const int b0 = s * kSB;
    constexpr int kWChunks = T::kRowBytes / 16, kChunksPerBlock = T::kQuantBytes / 16;
    for (int c = threadIdx.x; c < T::kRows * kWChunks; c += kQ8Threads) {
      const int r = c / kWChunks, ch = c % kWChunks;
      const bool ok = b0 + ch / kChunksPerBlock < nb;
      const size_t row = static_cast<size_t>(min(row0 + r, n - 1));
      cp_async16(sw + r * T::kRowBytes + ((ch ^ (r & 7)) * 16),
                 ok ? w + row * row_q + static_cast<size_t>(b0) * T::kQuantBytes + ch * 16 : w,
                 ok ? 16 : 0);
    }
    if constexpr (T::kSplit.block_elems == 256) {
      // K-quant blocks (k is whole ones): 16-byte records.
      constexpr int kRecs = T::kScaleBytes / 16;
      for (int c = threadIdx.x; c < T::kRows * kRecs; c += kQ8Threads) {
        const int r = c / kRecs, i = c % kRecs;
        const bool ok = b0 + 8 * i < nb;
        const size_t row = static_cast<size_t>(min(row0 + r, n - 1));
        cp_async16(sws + r * T::kScaleBytes + i * 16,
                   ok ? scales + row * row_s + (static_cast<size_t>(b0 / 8) + i) * 16 : scales,
                   ok ? 16 : 0);
      }
    } else {
      // Scales of 32-blocks in 4-byte words (k a multiple of 64: whole words on every row).
      constexpr int kWords = T::kScaleBytes / 4, kBlocksPerWord = 4 / T::kSplit.scale_bytes;
      for (int c = threadIdx.x; c < T::kRows * kWords; c += kQ8Threads) {
        const int r = c / kWords, wd = c % kWords;
        const bool ok = b0 + wd * kBlocksPerWord < nb;
        const size_t row = static_cast<size_t>(min(row0 + r, n - 1));
        cp_async_n<4>(
            sws + r * T::kScaleBytes + wd * 4,
            ok ? scales + row * row_s + static_cast<size_t>(b0) * T::kSplit.scale_bytes + wd * 4
               : scales,
            ok ? 4 : 0);
      }
    }
    constexpr int kAChunks = T::kStageK / 16;
    for (int c = threadIdx.x; c < T::kCols * kAChunks; c += kQ8Threads) {
      const int col = c / kAChunks, ch = c % kAChunks;
      const bool ok = b0 + ch / 2 < nb;
      const size_t src = static_cast<size_t>(min(col, cols - 1));
      cp_async16(sa + col * T::kStageK + ((ch ^ (col & 7)) * 16),
                 ok ? aq + src * k + static_cast<size_t>(b0) * 32 + ch * 16 : aq, ok ? 16 : 0);
    }
    for (int c = threadIdx.x; c < T::kCols * kSB; c += kQ8Threads) {
      const int col = c / kSB, j = c % kSB;
      const bool ok = b0 + j < nb;
      const size_t src = static_cast<size_t>(min(col, cols - 1));
      cp_async_n<8>(sas + (col * kSB + j) * 8, ok ? ads + src * nb + b0 + j : ads, ok ? 8 : 0);
    }
  };

#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    if (s_begin + i < s_end) load_stage(s_begin + i);
    cp_async_commit();
  }

  const int g = lane / 4, t = lane % 4;
  // ldmatrix row addresses: lane 8m + i gives row i of matrix m.
  const int mi = lane / 8, ri = lane % 8;
  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;

  for (int s = s_begin; s < s_end; ++s) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    if (s + kStages - 1 < s_end) load_stage(s + kStages - 1);
    cp_async_commit();

    const uint8_t* st = smem + ((s - s_begin) % kStages) * T::kStage;
    const uint8_t* sw = st;
    const uint8_t* sws = st + T::kW;
    const uint8_t* sa = sws + T::kWS;
    const float2* sas = reinterpret_cast<const float2*>(sa + T::kA);
    const int wr = wm * 16;
#pragma unroll
    for (int jp = 0; jp < kPerWarp; jp += 2) {
      const int j0 = wk * kPerWarp + jp;  // this pair's first 32-block in the stage
      uint32_t a[2][4];
      if constexpr (T::kQuantBytes == 16) {
        // Matrices: rows 0-7 and 8-15 of block j0, then of block j0 + 1.
        const int r = wr + (mi & 1) * 8 + ri, ch = j0 + (mi >> 1);
        uint32_t q[4];
        ldmatrix_x4(q, sw + r * T::kRowBytes + ((ch ^ (r & 7)) * 16));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          a[h][0] = q[2 * h] & 0x0F0F0F0Fu;
          a[h][1] = q[2 * h + 1] & 0x0F0F0F0Fu;
          a[h][2] = (q[2 * h] >> 4) & 0x0F0F0F0Fu;
          a[h][3] = (q[2 * h + 1] >> 4) & 0x0F0F0F0Fu;
        }
      } else {
        // Q8_0: a block is two chunks; matrices rows 0-7 and 8-15 of its first, then second.
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = wr + (mi & 1) * 8 + ri, ch = 2 * (j0 + h) + (mi >> 1);
          ldmatrix_x4(a[h], sw + r * T::kRowBytes + ((ch ^ (r & 7)) * 16));
        }
      }
      float2 sc[2][2];  // [block][row g, g + 8]
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        sc[h][0] = block_scale<TYPE>(sws + (wr + g) * T::kScaleBytes, j0 + h);
        sc[h][1] = block_scale<TYPE>(sws + (wr + g + 8) * T::kScaleBytes, j0 + h);
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        // Matrices: columns nt*8.. of chunks 2 j0, 2 j0 + 1, 2 j0 + 2, 2 j0 + 3.
        const int col = nt * 8 + ri, ch = 2 * j0 + mi;
        uint32_t b[4];
        ldmatrix_x4(b, sa + col * T::kStageK + ((ch ^ (col & 7)) * 16));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          int c[4] = {0, 0, 0, 0};
          mma_s8_16832(c, a[h], b[2 * h], b[2 * h + 1]);
          const float2 x0 = sas[(nt * 8 + 2 * t) * kSB + j0 + h];
          const float2 x1 = sas[(nt * 8 + 2 * t + 1) * kSB + j0 + h];
          acc[nt][0] += sc[h][0].x * (x0.x * static_cast<float>(c[0])) + sc[h][0].y * x0.y;
          acc[nt][1] += sc[h][0].x * (x1.x * static_cast<float>(c[1])) + sc[h][0].y * x1.y;
          acc[nt][2] += sc[h][1].x * (x0.x * static_cast<float>(c[2])) + sc[h][1].y * x0.y;
          acc[nt][3] += sc[h][1].x * (x1.x * static_cast<float>(c[3])) + sc[h][1].y * x1.y;
        }
      }
    }
  }
  cp_async_wait<0>();
  pdl_trigger();

  __syncthreads();  // the stages' memory is free from here on
  if constexpr (WK > 1) {
    // The k-split warps' sums, added in the order of their splits.
    float* red = reinterpret_cast<float*>(smem);
    if (wk > 0) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i)
          red[(((wk - 1) * WM + wm) * NT * 4 + nt * 4 + i) * 32 + lane] = acc[nt][i];
    }
    __syncthreads();
    if (wk == 0) {
#pragma unroll
      for (int o = 1; o < WK; ++o)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i)
            acc[nt][i] += red[(((o - 1) * WM + wm) * NT * 4 + nt * 4 + i) * 32 + lane];
    }
  }
  const bool split = gridDim.y > 1;
  float* out = split ? partials + static_cast<size_t>(blockIdx.y) * cols * n : dst;
  if (wk == 0) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = row0 + wm * 16 + g + (i >= 2 ? 8 : 0);
        const int col = nt * 8 + 2 * t + (i & 1);
        if (row < n && col < cols) out[static_cast<int64_t>(col) * n + row] = acc[nt][i];
      }
    }
  }
  if (!split) return;
  __shared__ unsigned last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned ticket = atomicAdd(counters + blockIdx.x, 1u);
    last = ticket == gridDim.y - 1;
    if (last) counters[blockIdx.x] = 0;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int rows = min(T::kRows, n - row0);
  for (int e = threadIdx.x; e < rows * cols; e += kQ8Threads) {
    const int col = e / rows, row = row0 + e % rows;
    float v = 0.0f;
    for (unsigned y = 0; y < gridDim.y; ++y)
      v += __ldcg(partials + (static_cast<size_t>(y) * cols + col) * n + row);
    dst[static_cast<int64_t>(col) * n + row] = v;
  }
}

// 0: off; 1: the products it measured faster on (below); 2: every product it can take.
int& q8_mode() {
  static int v = [] {
    const char* e = std::getenv("GGRAPH_CUDA_MMQ");
    if (!e) return 1;
    const std::string s(e);
    return s == "0" ? 0 : s == "all" ? 2 : 1;
  }();
  return v;
}

// Where it runs by default: 8 to 16 columns of rows of 2,048 or more (an H200: the 7B shape's
// decode batches of 8 and 16 gained 23% and 38% over the mat-vec and cuBLAS paths; shorter rows,
// fewer columns and more measured slower, BENCHMARKS.md). GGRAPH_CUDA_MMQ_MIN and _MAX move the
// column bounds.
int q8_env_cols(const char* name, int fallback) {
  const char* e = std::getenv(name);
  const int c = e ? std::atoi(e) : 0;
  return c >= 1 && c <= kMatMulQ8MaxCols ? c : fallback;
}
bool q8_measured_faster(int64_t k, int64_t cols) {
  static const int lo = q8_env_cols("GGRAPH_CUDA_MMQ_MIN", 8);
  static const int hi = q8_env_cols("GGRAPH_CUDA_MMQ_MAX", 16);
  return k >= 2048 && cols >= lo && cols <= hi;
}

// fn(integral_constant NT) for the column tiles of a product of cols columns.
template <typename Fn>
decltype(auto) with_col_tiles(int64_t cols, Fn&& fn) {
  if (cols <= 8) return fn(std::integral_constant<int, 1>{});
  if (cols <= 16) return fn(std::integral_constant<int, 2>{});
  if (cols <= 32) return fn(std::integral_constant<int, 4>{});
  return fn(std::integral_constant<int, 8>{});
}

template <int TYPE>
void set_q8_smem() {
  auto set = [](auto kernel, int bytes) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  };
  set(mat_mul_q8_kernel<TYPE, 1>, Q8Tile<TYPE, 1>::kSmem);
  set(mat_mul_q8_kernel<TYPE, 2>, Q8Tile<TYPE, 2>::kSmem);
  set(mat_mul_q8_kernel<TYPE, 4>, Q8Tile<TYPE, 4>::kSmem);
  set(mat_mul_q8_kernel<TYPE, 8>, Q8Tile<TYPE, 8>::kSmem);
}

// The plan of a product mat_mul_q8_takes.
Q8Plan plan_of(DType type, int64_t n, int64_t k, int64_t cols) {
  return with_weight_type(type, "mat_mul_q8", [&](auto tc) {
    constexpr int TYPE = decltype(tc)::value;
    if constexpr (mma_q8_type(TYPE)) {
      return with_col_tiles(cols,
                            [&](auto nt) { return q8_plan<TYPE, decltype(nt)::value>(n, k); });
    } else {
      return Q8Plan{16, 1};
    }
  });
}

}  // namespace

void set_mat_mul_q8_everywhere(bool on) { q8_mode() = on ? 2 : 1; }

bool mat_mul_q8_takes(DType t, int64_t k, int64_t cols) {
  // k whole 64s: the scales of 32-blocks copy as 4-byte words (K-quants: whole 256-blocks).
  const int mode = q8_mode();
  return mode > 0 && mma_q8_type(static_cast<int>(t)) && k % 64 == 0 && cols >= 2 &&
         cols <= kMatMulQ8MaxCols && (mode == 2 || q8_measured_faster(k, cols));
}

size_t mat_mul_q8_partials_bytes(DType type, int64_t n, int64_t k, int64_t cols) {
  const Q8Plan p = plan_of(type, n, k, cols);
  return p.splits > 1 ? static_cast<size_t>(p.splits * cols * n) * sizeof(float) : 0;
}

size_t mat_mul_q8_counters_bytes(DType type, int64_t n, int64_t k, int64_t cols) {
  const Q8Plan p = plan_of(type, n, k, cols);
  return p.splits > 1 ? static_cast<size_t>(ceil_div(n, p.rows)) * sizeof(unsigned) : 0;
}

void prepare_mat_mul_q8_kernels() {
  set_q8_smem<kTypeQ4_0>();
  set_q8_smem<kTypeQ4_1>();
  set_q8_smem<kTypeQ8_0>();
  set_q8_smem<kTypeQ4_K>();
  cudaGetLastError();
}

void launch_mat_mul_q8(Launcher& l, DType type, const void* w, int64_t n, int64_t k,
                       const uint8_t* ws, int cols, float* dst, float* partials,
                       unsigned* counters) {
  if (!mat_mul_q8_takes(type, k, cols))
    throw ArgumentError(std::string("mat_mul_q8: expected a product it takes (Q4_0, Q4_1, Q8_0 "
                                    "or Q4_K weights, k a multiple of 64, 2 to ") +
                        std::to_string(kMatMulQ8MaxCols) + " columns), got " + dtype_name(type) +
                        ", k " + std::to_string(k) + ", " + std::to_string(cols) + " columns");
  with_weight_type(type, "mat_mul_q8", [&](auto tc) {
    constexpr int TYPE = decltype(tc)::value;
    if constexpr (mma_q8_type(TYPE)) {
      with_col_tiles(cols, [&](auto nt) {
        constexpr int NT = decltype(nt)::value;
        const Q8Plan p = q8_plan<TYPE, NT>(n, k);
        const ActQ8 q = act_q8(const_cast<uint8_t*>(ws), k, cols);
        l(mat_mul_q8_kernel<TYPE, NT>,
          dim3(static_cast<unsigned>(ceil_div(n, p.rows)), static_cast<unsigned>(p.splits)),
          dim3(kQ8Threads), static_cast<size_t>(Q8Tile<TYPE, NT>::kSmem),
          static_cast<const uint8_t*>(w), static_cast<int>(n), static_cast<int>(k), q.qs, q.ds,
          cols, dst, partials, counters);
      });
    }
  });
}

}  // namespace ggraph::cuda
