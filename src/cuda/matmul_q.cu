// Products of quantized weights with a few to kMatMulQMaxCols columns (decode batches) on the
// tensor cores, by three kernels. The int8 kernel: mma.sync m16n8k32 of the weights' 4- or 8-bit
// quants against the 8-bit activation (launch_quantize_act), each 32-element block's integer sums
// scaled in float. Its warp-pipelined form (mat_mul_qw_kernel, below: up to 16 columns) does the
// same arithmetic with each warp streaming its own weights.
//
// A block of eight warps owns 16 * WM rows and every column; its k is staged SB blocks of 32 at
// a time through a cp.async pipeline (Q8Shape: both by the number of column tiles): the rows'
// quants and scale records (the split layout, cuda/weight_layout.h) and the columns' 8-bit
// values and (d, d * sum) pairs. Warps split the rows (WM of them, 16 rows each) and a stage's
// blocks (8 / WM of them); the k-split warps' sums meet in shared memory at the end, always in
// the same order. Few row blocks also split k over the grid (QPlan).
//
// Fragments come from shared memory by ldmatrix, which hands lane 4g + t word t of row g: of a
// 4-bit piece (byte j: element j in the low nibble, j + 16 in the high) that word's low nibbles
// are elements 4t..4t+3 and its high ones 16 + 4t.., exactly the A fragment's k of row g; the
// activation's words t and 4 + t are the B fragment's. Unsigned nibbles dot as they are; the
// formats' offsets and minimums enter through the activation's block sums:
//   sum((s q + m) a d8) = s * d8 * sum(q a) + m * (d8 * sum(a)).
// In shared memory, 16-byte chunks of a row (or column) are swizzled by its low three bits, so
// that the eight row addresses of an ldmatrix fall in distinct banks.
//
// The half kernel (mat_mul_qh_kernel) has the same loads and k-splits, and tiles of eight warps,
// each owning MT row tiles of 16 (QhShape), but decodes the weights to half in registers,
// scales and offsets applied there, and runs mma.sync m16n8k16 in float against the activation in
// half (launch_act_to_half): no per-block float epilogue, whose cost grew with the columns in the
// int8 kernel. Its k order within each 16 is permuted, the same for both operands: lane (g, t)'s
// slots 2t, 2t + 1 take elements 4t, 4t + 1 and slots 2t + 8, 2t + 9 elements 4t + 2, 4t + 3, so
// that the word ldmatrix hands it (4t .. 4t + 3, low nibbles for the first 16 of a block, high for
// the second) is all its A fragment needs, and its B fragment is one 8-byte load of four
// consecutive activation values.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "cuda/device_util.cuh"
#include "cuda/kernels.cuh"
#include "cuda/stage_copy.h"
#include "cuda/weight_layout.h"

namespace ggraph::cuda {
namespace {

// A test's stand-in for the device's limit below (0: none).
size_t& block_smem_override() {
  static size_t v = 0;
  return v;
}

}  // namespace

// The shared memory a block of the current device may opt into (or a test's stand-in); where
// none can be asked (no device: plans and tests on a machine without a GPU), sm_90's.
size_t max_block_smem() {
  static const size_t v = [] {
    int dev = 0, bytes = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) !=
            cudaSuccess) {
      cudaGetLastError();
      return size_t(227) << 10;
    }
    return static_cast<size_t>(bytes);
  }();
  return block_smem_override() ? block_smem_override() : v;
}

namespace {

constexpr int kQ8Warps = 8;
constexpr int kQ8Threads = 32 * kQ8Warps;
// The split-k plan before load_splits (below), kept to measure against it: a product of few row
// blocks splits k over enough blocks to make about this many in all.
constexpr int kTargetBlocks = 256;
// GGRAPH_CUDA_MMQ_BLOCKS sets another target (with GGRAPH_CUDA_MMQ_PLAN=target), to measure.
int target_blocks() {
  static const int v = env_int("GGRAPH_CUDA_MMQ_BLOCKS", 1, 4096, kTargetBlocks);
  return v;
}
constexpr int kMaxSplits = 8;
// GGRAPH_CUDA_MMQ_SPLITS forces every launch's split count (1 to kMaxSplits, at most one a
// stage), to measure; 0 or unset: the plan's.
int forced_splits() {
  static const int v = env_int("GGRAPH_CUDA_MMQ_SPLITS", 1, kMaxSplits, 0);
  return v;
}
// GGRAPH_CUDA_MMQ_PLAN=target takes the block target's count (below) where load_splits' would be
// taken, to measure one against the other in one build.
bool target_plan() {
  static const bool v = [] {
    const char* e = std::getenv("GGRAPH_CUDA_MMQ_PLAN");
    return e && std::string(e) == "target";
  }();
  return v;
}

constexpr bool mma_q_type(int t) {
  return t == kTypeQ4_0 || t == kTypeQ4_1 || t == kTypeQ8_0 || t == kTypeQ4_K;
}

// The int8 kernel's tile of NT column tiles (8 columns each): WM warps of 16 rows, SB blocks of
// 32 a stage, kStages stages. Few columns take short row blocks and long stages (the weights' bytes
// in flight); many take tall row blocks (each activation byte staged serves more rows).
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

// The half kernel's tiles: eight warps a block (the k-split warps, WK = 8 / WM, share a stage's
// blocks), since a product's few row blocks leave too few warps to hide its latencies with
// four; each warp owns MT row tiles of 16, so that each activation fragment it loads serves MT
// products; from 17 columns a block of a product of 4,096 rows or more takes 128 rows, so that
// each staged activation byte serves more rows (4-8% faster than 64 rows on the 7B shape;
// smaller products take QhNarrow's 64), as eight warps of one row tile each: with four warps of
// two row tiles (and two warps of k), a warp's accumulators at 64 columns spilled, and the 7B
// shape's decode batch of 64 ran 10% slower (BENCHMARKS.md). The activation stage is twice the
// int8 kernel's bytes, so the widest tiles take fewer stages. Stages are at least 8 blocks
// (WeightTile checks): a K-quant stage is whole 256-blocks, and a row's quants a stage span the
// 128 bytes of its swizzle.
template <int NT>
struct QhShape;
template <>
struct QhShape<1> {
  static constexpr int kWM = 1, kMT = 1, kSB = 32, kStages = 4;
};
template <>
struct QhShape<2> {
  static constexpr int kWM = 1, kMT = 2, kSB = 16, kStages = 3;
};
template <>
struct QhShape<4> {
  static constexpr int kWM = 8, kMT = 1, kSB = 8, kStages = 3;
};
template <>
struct QhShape<8> {
  static constexpr int kWM = 8, kMT = 1, kSB = 8, kStages = 2;
};
// 17 to 64 columns for products of fewer than kQhWideRows rows, whose 128-row blocks would be
// too few (with k split over at most kMaxSplits) or partly empty (SmolLM2's 576 and 192), and
// where a block cannot take QhShape's 100 KB or more (sm_86, sm_89: 99 KiB): QhShape's tile with
// two warps of rows of two row tiles each, 64 rows a block.
template <int NT>
struct QhNarrow : QhShape<NT> {
  static_assert(NT >= 4, "the narrow tiles are those of 17 to 64 columns");
  static constexpr int kWM = 2, kMT = 2;
};
constexpr int kQhWarps = 8;

// The weight side of a tile: WM warps of MT row tiles of 16, SB blocks of 32 a stage.
template <int TYPE, int WM, int SB, int MT = 1>
struct WeightTile {
  static constexpr SplitFormat kSplit = split_format(static_cast<DType>(TYPE));
  static constexpr int kWM = WM, kSB = SB, kMT = MT;
  static constexpr int kStageK = 32 * kSB;                // elements of k a stage
  static constexpr int kQuantBytes = kSplit.quant_bytes;  // a row's bytes per 32 elements
  static constexpr int kRowBytes = kSB * kQuantBytes;     // a row's quants a stage
  // A row's scale bytes a stage (whole records: a K-quant stage is whole 256-blocks).
  static constexpr int kScaleBytes = kSplit.scale_bytes * kStageK / kSplit.block_elems;
  static constexpr int kRows = 16 * kWM * kMT;
  static constexpr int kW = kRows * kRowBytes;     // quants
  static constexpr int kWS = kRows * kScaleBytes;  // scale records
  static_assert(kRowBytes >= 128, "a row's stage spans the eight chunks of its swizzle");
  static_assert(kStageK % kSplit.block_elems == 0, "a stage holds whole scale records");
};

template <int TYPE, int NT>
struct Q8Tile : WeightTile<TYPE, Q8Shape<NT>::kWM, Q8Shape<NT>::kSB> {
  using W = WeightTile<TYPE, Q8Shape<NT>::kWM, Q8Shape<NT>::kSB>;
  static constexpr int kStages = Q8Shape<NT>::kStages;
  static constexpr int kCols = 8 * NT;
  static constexpr int kA = kCols * W::kStageK;   // activation values
  static constexpr int kAS = kCols * W::kSB * 8;  // activation (d, d * sum) pairs
  static constexpr int kStage = W::kW + W::kWS + kA + kAS;
  static constexpr int kSmem = kStages * kStage;
};

template <int TYPE, int NT, class S = QhShape<NT>>
struct QhTile : WeightTile<TYPE, S::kWM, S::kSB, S::kMT> {
  using W = WeightTile<TYPE, S::kWM, S::kSB, S::kMT>;
  static constexpr int kStages = S::kStages;
  static constexpr int kThreads = 32 * kQhWarps;
  static constexpr int kCols = 8 * NT;
  static constexpr int kA = kCols * W::kStageK * 2;  // activation values in half
  static constexpr int kStage = W::kW + W::kWS + kA;
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

// block_scale's s and m as halves (s low, m high), as the half kernel applies them: Q4_0's,
// Q4_1's and Q8_0's straight from their f16 bits (Q4_0's m, -8 s, exact), Q4_K's rounded.
template <int TYPE>
__device__ __forceinline__ __half2 block_scale_half(const uint8_t* rec, int j) {
  if constexpr (TYPE == kTypeQ4_0) {
    const __half d = reinterpret_cast<const __half*>(rec)[j];
    return __halves2half2(d, __hmul(d, __float2half(-8.0f)));
  } else if constexpr (TYPE == kTypeQ4_1) {
    return reinterpret_cast<const __half2*>(rec)[j];
  } else if constexpr (TYPE == kTypeQ8_0) {
    return __halves2half2(reinterpret_cast<const __half*>(rec)[j], __float2half(0.0f));
  } else {
    const float2 sm = block_scale<TYPE>(rec, j);
    return __floats2half2_rn(sm.x, sm.y);
  }
}

// What the host needs of a tile, whichever kernel and format: its rows, its blocks of 32 a
// stage, its dynamic shared memory.
struct TileSpec {
  int rows, sb;
  size_t smem;
};
template <class T>
constexpr TileSpec spec_of() {
  return {T::kRows, T::kSB, static_cast<size_t>(T::kSmem)};
}

// Rows of a block, the launch's row blocks (every part's), and k splits, of the products of one
// launch (a function of the shapes alone).
struct QPlan {
  int rows, row_blocks, splits;
};
// Blocks of `rows` rows over every part (each part's last one may be partly empty).
int row_blocks_of(const int64_t* n, int n_parts, int rows) {
  int64_t row_blocks = 0;
  for (int p = 0; p < n_parts; ++p) row_blocks += ceil_div(n[p], rows);
  return static_cast<int>(row_blocks);
}
// Plans are functions of the shapes alone (the sums' order follows the splits), so the model
// below counts the SMs of an H100 or H200, not the current GPU's.
constexpr int kPlanSms = 132;
// A block's fixed cost beside its stages, in stages: its pipeline's first trip to memory and
// its end (the k-split warps' meeting, the partials and the ticket).
constexpr int kBlockOverheadStages = 2;
// The split count (1 to kMaxSplits, at least two stages a split) that leaves the least work on
// the busiest SM: the blocks spread evenly over the SMs, the blocks an SM holds at once share its
// throughput, and each block costs its stages and the fixed cost. A launch of at most one block
// an SM costs 5/3 as much (nothing beside a block hides its latencies). The 7B shape's q/k/v at
// 32 and 64 columns, 96 row blocks of 16 stages, take 4 splits (3 blocks on the busiest SM of a
// quarter of k each, against 3 of a third at 3 splits), 21-24% faster than the block target's 3;
// ties go to fewer splits (BENCHMARKS.md, "split-k plan").
int load_splits(int row_blocks, int stages) {
  const int most = std::max(1, std::min(kMaxSplits, stages / 2));
  int best = 1;
  int64_t best_cost = std::numeric_limits<int64_t>::max();
  for (int s = 1; s <= most; ++s) {
    const int64_t blocks = int64_t(row_blocks) * s;
    const int64_t cost = ceil_div(blocks, int64_t(kPlanSms)) *
                         (ceil_div(stages, s) + kBlockOverheadStages) *
                         (blocks <= kPlanSms ? 5 : 3);
    if (cost < best_cost) best = s, best_cost = cost;
  }
  return best;
}
QPlan q_plan(const TileSpec& t, const int64_t* n, int n_parts, int64_t k) {
  const int stages = static_cast<int>(ceil_div(k / 32, t.sb));
  const int row_blocks = row_blocks_of(n, n_parts, t.rows);
  if (forced_splits()) return {t.rows, row_blocks, std::min(forced_splits(), std::max(1, stages))};
  if (!target_plan()) return {t.rows, row_blocks, load_splits(row_blocks, stages)};
  int splits = static_cast<int>(ceil_div(target_blocks(), row_blocks));
  splits = std::max(1, std::min({splits, kMaxSplits, stages / 2}));
  return {t.rows, row_blocks, splits};
}

// Thread threadIdx.x's copies of a stage (StageCopy's, stage_copy.h), as asynchronous copies.
template <class SC, class Dst>
__device__ __forceinline__ void copy_stage(const SC& c, uint8_t* buf, int b0, int nb, Dst dst) {
  c.copies(buf, b0, nb, static_cast<int>(threadIdx.x), dst,
           [](uint8_t* to, const uint8_t* from, int n) { cp_async_n<SC::kBytes>(to, from, n); });
}

// A block's weight rows in a split-layout matrix of n rows and k columns: their quants and
// scale records (no high bits in these formats), staged SB blocks of 32 at a time.
template <class T, int kThreads>
struct WeightCopy {
  static constexpr bool kRecords = T::kSplit.block_elems == 256;  // K-quants: 16-byte records
  static constexpr int kScaleChunk = kRecords ? 16 : 4;           // bytes a scale copy
  using Quants = StageCopy<T::kRows, T::kRowBytes / 16, 16, T::kQuantBytes, kThreads>;
  // A record covers 8 blocks of 32; the other formats' scale bytes are each block's.
  using Scales = StageCopy<T::kRows, T::kScaleBytes / kScaleChunk, kScaleChunk,
                           T::kSplit.scale_bytes / (kRecords ? 8 : 1), kThreads>;
  static_assert(!kRecords || T::kSplit.scale_bytes == 16, "a K-quant record is 16 bytes");
  Quants quants;
  Scales scales;
  int nb;  // k's 32-blocks

  __device__ __forceinline__ WeightCopy(const uint8_t* w, int n, int k, int row0)
      : quants(w, static_cast<size_t>(k / 32) * T::kQuantBytes, row0, n - row0,
               static_cast<int>(threadIdx.x)),
        scales(w + static_cast<size_t>(n) * (k / 32) * T::kQuantBytes,
               static_cast<size_t>(k / T::kSplit.block_elems) * T::kSplit.scale_bytes, row0,
               n - row0, static_cast<int>(threadIdx.x)),
        nb(k / 32) {}

  // Blocks b0 .. b0 + SB - 1 of the rows: quants at sw (a row's 16-byte chunks swizzled by its
  // low three bits), scale records at sws.
  __device__ __forceinline__ void operator()(int b0, uint8_t* sw, uint8_t* sws) const {
    copy_stage(quants, sw, b0, nb, SwizzledRows<T::kRowBytes>{});
    copy_stage(scales, sws, b0, nb, PlainRows<T::kScaleBytes, kScaleChunk>{});
  }
};

// A block's share of k under split-k: stages [begin, end) of kSB blocks each, of nb blocks.
struct StageRange {
  int begin, end;
};
__device__ __forceinline__ StageRange stage_range(int nb, int kSB) {
  const int n_stages = (nb + kSB - 1) / kSB;
  return {static_cast<int>(n_stages * blockIdx.y / gridDim.y),
          static_cast<int>(n_stages * (blockIdx.y + 1) / gridDim.y)};
}

// The products of one launch: up to kMatMulQMaxParts weights of one format and k over the same
// activation (q, k and v; gate and up), each with its own rows, output and split-k partials. The
// grid's row blocks are the parts' in order; a part's first row block past the grid marks it
// absent.
struct QParts {
  const uint8_t* w[kMatMulQMaxParts];
  float* dst[kMatMulQMaxParts];
  float* partials[kMatMulQMaxParts];
  int n[kMatMulQMaxParts];
  int first[kMatMulQMaxParts];
};
static_assert(kMatMulQMaxParts == 3, "block_part picks among three parts");

// A block's part: its weights, rows, output and partials, and the block's row block in it.
struct QPart {
  const uint8_t* w;
  float* dst;
  float* partials;
  int n, rb;
  int index;  // the part: 0, 1 or 2
};
// Each field is picked by selects among the three, where an index into the parameter arrays had
// every thread copy them all to local memory first and load its part back (a trip through L1 on
// the way to the block's first weight loads).
__device__ __forceinline__ QPart block_part(const QParts& p, int b) {
  const bool two = b >= p.first[2], one = !two && b >= p.first[1];
  auto pick = [&](const auto& a) { return two ? a[2] : one ? a[1] : a[0]; };
  return {pick(p.w), pick(p.dst),       pick(p.partials),
          pick(p.n), b - pick(p.first), two ? 2 : one ? 1 : 0};
}
__device__ __forceinline__ QPart block_part(const QParts& p) {
  return block_part(p, static_cast<int>(blockIdx.x));
}

// The cp.async pipeline over a block's stages. load_w(s) and load_a(s) issue stage s's copies of
// the weights and of the activation into buffer (s - begin) % kStages, compute(s) reads it once
// they have landed and every thread has passed the barrier. The first kStages stages are
// requested at once (every buffer is free at the start), their weights before the wait for the
// grid before (they never change after upload), so that their trip to memory overlaps its end: a
// decode batch's product is a single wave of blocks of a few stages each, which otherwise all
// start with that trip, and a block of two stages in two buffers (64 columns) would wait for its
// second only once the first had landed. Then stage s + kStages - 1 goes into the buffer that
// stage s - 1 left, kStages - 1 ahead of the one computed. Groups: the early weights' (older
// than any other), one a stage of the first kStages, then one an iteration (empty in the first):
// stage s's is the newest but kStages - 1 among the first kStages, and the newest but kStages - 2
// after them.
// kAsyncReads: compute reads the stage through the async proxy (wgmma), so each thread orders
// its landed copies (the generic proxy's writes) before that proxy's reads ahead of the barrier.
template <int kStages, bool kAsyncReads = false, class LoadW, class LoadA, class Compute>
__device__ __forceinline__ void run_stages(StageRange r, LoadW&& load_w, LoadA&& load_a,
                                           Compute&& compute) {
#pragma unroll
  for (int i = 0; i < kStages; ++i) {
    if (r.begin + i < r.end) load_w(r.begin + i);
  }
  cp_async_commit();
  pdl_wait();
#pragma unroll
  for (int i = 0; i < kStages; ++i) {
    if (r.begin + i < r.end) load_a(r.begin + i);
    cp_async_commit();
  }
  for (int s = r.begin; s < r.end; ++s) {
    if (s - r.begin < kStages)
      cp_async_wait<kStages - 1>();
    else
      cp_async_wait<kStages - 2>();
    if constexpr (kAsyncReads) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    if (s > r.begin && s + kStages - 1 < r.end) {
      load_w(s + kStages - 1);
      load_a(s + kStages - 1);
    }
    cp_async_commit();
    compute(s);
  }
  cp_async_wait<0>();
}

// The half kernels' stages: a block's weight rows and the activation's columns in layout Act
// (HalfActColumns, SwizzledKSegments), stage s in buffer (s - begin) % kStages of smem.
template <class T, class Act>
struct HalfStages {
  WeightCopy<T, T::kThreads> weights;
  // A column's stage: kStageK halves in 16-byte chunks of 8 (64 bytes a block), columns kp =
  // act_half_pitch(k) apart; columns from cols on are zeros.
  StageCopy<T::kCols, T::kStageK / 8, 16, 64, T::kThreads> act;
  int nb;
  StageRange range;
  uint8_t* smem;

  __device__ __forceinline__ HalfStages(const QPart& part, int k, const __half* a, int cols,
                                        uint8_t* buf)
      : weights(part.w, part.n, k, part.rb * T::kRows),
        act(a, static_cast<size_t>(act_half_pitch(k)) * 2, 0, cols, static_cast<int>(threadIdx.x)),
        nb(k / 32),
        range(stage_range(k / 32, T::kSB)),
        smem(buf) {}
  __device__ __forceinline__ uint8_t* at(int s) const {
    return smem + ((s - range.begin) % T::kStages) * T::kStage;
  }
  __device__ __forceinline__ void load_w(int s) const {
    uint8_t* st = at(s);
    weights(s * T::kSB, st, st + T::kW);
  }
  __device__ __forceinline__ void load_a(int s) const {
    copy_stage(act, at(s) + T::kW + T::kWS, s * T::kSB, nb, Act{});
  }
};

// The end of a tile: the k-split warps' sums meet in shared memory (the stages' memory, free by
// then) in the order of their splits, and the block's rows go to dst, or, split over the grid
// (gridDim.y > 1), to partials [split][col][row]; then the last split of a row block to finish
// (counters: a ticket a row block, left at zero) adds them in split order, so that the result
// does not depend on which finished last. acc is the m16n8 accumulator layout of each column
// tile: rows g and g + 8, columns 2t and 2t + 1; warp (wm, wk) holds row tiles wm MT .. wm MT +
// MT - 1.
template <int WM, int WK, int MT, int NT, int kThreads>
__device__ __forceinline__ void finish_tile(float (&acc)[MT][NT][4], uint8_t* smem, int n, int cols,
                                            int rb, float* dst, float* partials,
                                            unsigned* counters) {
  constexpr int kRows = 16 * WM * MT, kTiles = MT * NT;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = warp % WM, wk = warp / WM, g = lane / 4, t = lane % 4;
  const int row0 = rb * kRows;
  __syncthreads();  // the stages' memory is free from here on
  if constexpr (WK > 1) {
    float* red = reinterpret_cast<float*>(smem);
    if (wk > 0) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i)
            red[(((wk - 1) * WM + wm) * kTiles * 4 + (mt * NT + nt) * 4 + i) * 32 + lane] =
                acc[mt][nt][i];
    }
    __syncthreads();
    if (wk == 0) {
#pragma unroll
      for (int o = 1; o < WK; ++o)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i)
              acc[mt][nt][i] +=
                  red[(((o - 1) * WM + wm) * kTiles * 4 + (mt * NT + nt) * 4 + i) * 32 + lane];
    }
  }
  const bool split = gridDim.y > 1;
  float* out = split ? partials + static_cast<size_t>(blockIdx.y) * cols * n : dst;
  if (wk == 0) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int row = row0 + (wm * MT + mt) * 16 + g + (i >= 2 ? 8 : 0);
          const int col = nt * 8 + 2 * t + (i & 1);
          if (row < n && col < cols) out[static_cast<int64_t>(col) * n + row] = acc[mt][nt][i];
        }
      }
  }
  if (!split || !last_block_ticket(counters + blockIdx.x, gridDim.y)) return;
  // Every load of a round in flight together: the splits of kU elements a thread (4 rows of a
  // column each where rows are whole 4s), then their sums, in split order.
  constexpr int kU = 2;
  const int rows = min(kRows, n - row0);
  const unsigned splits = gridDim.y;
  if (rows % 4 == 0 && n % 4 == 0) {
    const int quads = rows / 4 * cols;
    for (int e0 = threadIdx.x; e0 < quads; e0 += kThreads * kU) {
      float4 p[kMaxSplits][kU];
#pragma unroll
      for (unsigned y = 0; y < kMaxSplits; ++y)
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int e = e0 + u * kThreads, col = e / (rows / 4), row = row0 + 4 * (e % (rows / 4));
          if (y < splits && e < quads)
            p[y][u] = __ldcg(reinterpret_cast<const float4*>(
                partials + (static_cast<size_t>(y) * cols + col) * n + row));
        }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int e = e0 + u * kThreads, col = e / (rows / 4), row = row0 + 4 * (e % (rows / 4));
        if (e >= quads) continue;
        float4 v = p[0][u];
#pragma unroll
        for (unsigned y = 1; y < kMaxSplits; ++y)
          if (y < splits) v.x += p[y][u].x, v.y += p[y][u].y, v.z += p[y][u].z, v.w += p[y][u].w;
        *reinterpret_cast<float4*>(dst + static_cast<int64_t>(col) * n + row) = v;
      }
    }
    return;
  }
  for (int e = threadIdx.x; e < rows * cols; e += kThreads) {
    const int col = e / rows, row = row0 + e % rows;
    float v = 0.0f;
    for (unsigned y = 0; y < splits; ++y)
      v += __ldcg(partials + (static_cast<size_t>(y) * cols + col) * n + row);
    dst[static_cast<int64_t>(col) * n + row] = v;
  }
}

// The int8 kernel (the file's comment); split-k as finish_tile says.
template <int TYPE, int NT>
__global__ void __launch_bounds__(kQ8Threads)
    mat_mul_q8_kernel(QParts parts, int k, const int8_t* aq, const float2* ads, int cols,
                      unsigned* counters) {
  using T = Q8Tile<TYPE, NT>;
  constexpr int WM = T::kWM, WK = kQ8Warps / WM;  // warps sharing a stage's blocks
  constexpr int kSB = T::kSB, kStages = T::kStages;
  constexpr int kPerWarp = kSB / WK;
  static_assert(kPerWarp % 2 == 0, "blocks go in pairs");
  extern __shared__ __align__(16) uint8_t smem[];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = warp % WM, wk = warp / WM;
  const QPart part = block_part(parts);
  const WeightCopy<T, kQ8Threads> load_weights(part.w, part.n, k, part.rb * T::kRows);
  const int nb = k / 32;
  const StageRange range = stage_range(nb, kSB);
  // The columns' 8-bit values (32 bytes a block) and (d, d * sum) pairs (8 bytes a block); columns
  // from cols on are zeros, which add nothing.
  const int tid = static_cast<int>(threadIdx.x);
  const StageCopy<T::kCols, T::kStageK / 16, 16, 32, kQ8Threads> load_act(aq, k, 0, cols, tid);
  const StageCopy<T::kCols, kSB, 8, 8, kQ8Threads> load_pairs(ads, static_cast<size_t>(nb) * 8, 0,
                                                              cols, tid);

  // Stage s: blocks kSB s .. kSB (s + 1) - 1 of k; those past the row's end (k / 32 blocks) are
  // zeros, which add nothing (their scales and activation pairs are zeros too).
  auto stage_at = [&](int s) { return smem + ((s - range.begin) % kStages) * T::kStage; };
  auto load_stage_w = [&](int s) {
    uint8_t* st = stage_at(s);
    load_weights(s * kSB, st, st + T::kW);
  };
  auto load_stage_a = [&](int s) {
    uint8_t* sa = stage_at(s) + T::kW + T::kWS;
    const int b0 = s * kSB;
    copy_stage(load_act, sa, b0, nb, SwizzledRows<T::kStageK>{});
    copy_stage(load_pairs, sa + T::kA, b0, nb, PlainRows<kSB * 8, 8>{});
  };

  const int g = lane / 4, t = lane % 4;
  // ldmatrix row addresses: lane 8m + i gives row i of matrix m.
  const int mi = lane / 8, ri = lane % 8;
  float acc[1][NT][4] = {};

  run_stages<kStages>(range, load_stage_w, load_stage_a, [&](int s) {
    const uint8_t* st = stage_at(s);
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
          acc[0][nt][0] += sc[h][0].x * (x0.x * static_cast<float>(c[0])) + sc[h][0].y * x0.y;
          acc[0][nt][1] += sc[h][0].x * (x1.x * static_cast<float>(c[1])) + sc[h][0].y * x1.y;
          acc[0][nt][2] += sc[h][1].x * (x0.x * static_cast<float>(c[2])) + sc[h][1].y * x0.y;
          acc[0][nt][3] += sc[h][1].x * (x1.x * static_cast<float>(c[3])) + sc[h][1].y * x1.y;
        }
      }
    }
  });
  pdl_trigger();
  finish_tile<WM, WK, 1, NT, kQ8Threads>(acc, smem, part.n, cols, part.rb, part.dst, part.partials,
                                         counters);
}

// The warp-pipelined int8 kernel (mat_mul_qw_kernel): the int8 kernel's mma.sync m16n8k32 and
// epilogue, but each warp streams its own share of k through its own ring of kQwStages stages
// (no barrier between the warps until their sums meet), and the activation comes in column tiles
// ready for the B fragments (act_q8_tiles: from launch_quantize_act_tiles, or written by the
// activation's producer, which leaves the padding columns of the last tile as they were), read
// through L1 and L2 as each stage starts (staged through the ring as well, it measured slower on
// the 7B shape's products). A block is 16 rows and eight warps; warp w takes stages w, w + 8,
// ... of 64 bytes a row (four 32-blocks, two of Q8_0). A block's whole share of a 4,096-long row
// (32 KiB) is in flight at once, and the first stages' weights are requested before the grid
// before it has finished (weights only), so that a short product is not a chain of trips to
// memory.
constexpr int kQwWarps = 8;
constexpr int kQwThreads = 32 * kQwWarps;
constexpr int kQwStages = 4;
constexpr int kQwRowBytes = 64;  // a row's quants a stage: four 16-byte chunks

template <int TYPE>
struct QwTile {
  static constexpr SplitFormat kSplit = split_format(static_cast<DType>(TYPE));
  static constexpr bool kRecords = kSplit.block_elems == 256;       // K-quants: 16-byte records
  static constexpr int kBlocks = kQwRowBytes / kSplit.quant_bytes;  // 32-blocks a stage
  // A row's scale bytes a stage (a K-quant's whole record), copied in chunks of kChunk bytes,
  // the widest its alignment allows (k whole 64s: rows of whole pairs of blocks).
  static constexpr int kScaleBytes = kRecords ? 16 : kBlocks * kSplit.scale_bytes;
  static constexpr int kChunk = kRecords ? 16 : kSplit.scale_bytes == 4 ? 8 : 4;
  static constexpr int kChunks = 16 * kScaleBytes / kChunk;  // a stage's, at most one a lane
  static constexpr int kStage = 16 * kQwRowBytes + 16 * kScaleBytes;
  static constexpr int kSmem = kQwWarps * kQwStages * kStage;
  static_assert(kChunks <= 32, "a lane copies at most one scale chunk a stage");
  static_assert(kSplit.quant_bytes == 16 || kSplit.quant_bytes == 32, "4- and 8-bit quants");
};

// One stage of a warp's ring (both warp-pipelined kernels): its 16 rows' quants, loaded by
// ldmatrix at lm_at and lm_at2, against the activation's column tiles b and their scales x, each
// 32-block's integer sums scaled into acc and the format's offsets into off.
template <int TYPE, int NT>
__device__ __forceinline__ void qw_stage(const uint8_t* st, int lm_at, int lm_at2, int b0, int nb,
                                         int g, const uint2 (&b)[QwTile<TYPE>::kBlocks][NT],
                                         const float4 (&x)[QwTile<TYPE>::kBlocks][NT],
                                         float (&acc)[NT][4], float (&off)[NT][4]) {
  using T = QwTile<TYPE>;
  constexpr int kBlocks = T::kBlocks, kQB = T::kSplit.quant_bytes;
  const uint8_t* ss = st + 16 * kQwRowBytes;
  // Matrices of ldmatrix h: chunks 2h and 2h + 1, rows 0-7 and 8-15 of each.
  uint32_t q[2][4];
  ldmatrix_x4(q[0], st + lm_at);
  ldmatrix_x4(q[1], st + lm_at2);
#pragma unroll
  for (int j = 0; j < kBlocks; ++j) {
    if (b0 + j >= nb) break;
    uint32_t a[4];
    if constexpr (kQB == 16) {
      const uint32_t u = q[j / 2][2 * (j % 2)], v = q[j / 2][2 * (j % 2) + 1];
      a[0] = u & 0x0F0F0F0Fu;
      a[1] = v & 0x0F0F0F0Fu;
      a[2] = (u >> 4) & 0x0F0F0F0Fu;
      a[3] = (v >> 4) & 0x0F0F0F0Fu;
    } else {
      a[0] = q[j][0], a[1] = q[j][1], a[2] = q[j][2], a[3] = q[j][3];
    }
    const int js = T::kRecords ? b0 % 8 + j : j;  // the block in the staged scale bytes
    const float2 s0 = block_scale<TYPE>(ss + g * T::kScaleBytes, js);
    const float2 s1 = block_scale<TYPE>(ss + (g + 8) * T::kScaleBytes, js);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      int c[4] = {0, 0, 0, 0};
      mma_s8_16832(c, a, b[j][nt].x, b[j][nt].y);
      const float4 xv = x[j][nt];
      acc[nt][0] = fmaf(s0.x, xv.x * static_cast<float>(c[0]), acc[nt][0]);
      acc[nt][1] = fmaf(s0.x, xv.z * static_cast<float>(c[1]), acc[nt][1]);
      acc[nt][2] = fmaf(s1.x, xv.x * static_cast<float>(c[2]), acc[nt][2]);
      acc[nt][3] = fmaf(s1.x, xv.z * static_cast<float>(c[3]), acc[nt][3]);
      if constexpr (TYPE != kTypeQ8_0) {
        off[nt][0] = fmaf(s0.y, xv.y, off[nt][0]);
        off[nt][1] = fmaf(s0.y, xv.w, off[nt][1]);
        off[nt][2] = fmaf(s1.y, xv.y, off[nt][2]);
        off[nt][3] = fmaf(s1.y, xv.w, off[nt][3]);
      }
    }
  }
}

// The rope epilogue's store of element (row, col) of part `part` (n rows, output dst), x its
// sum and other its pair's (row ^ 1): rope_epilogue_pair_at's, for token col of several, the
// angle from r.table where it holds the position, else from freqs (the pairs' rope_freq).
__device__ __forceinline__ void qw_rope_store(const MatMulQRope& r, const double* freqs, int part,
                                              int n, float* dst, int row, int col, float x,
                                              float other) {
  const int64_t at = static_cast<int64_t>(col) * n + row;
  if (part == 2) {
    dst[at] = x;
    const int64_t kv = kv_store_row(r.first_row, r.slots, col, r.n_tokens, r.rows);
    if (kv >= 0) static_cast<__half*>(r.v_cache)[kv * n + row] = __float2half_rn(x);
    return;
  }
  const int i0 = (row & ~1) % r.head_dim;
  float y = x;
  if (i0 < r.n_dims) {
    float sf, cf, y0, y1;
    const int32_t p = r.pos[col];
    if (!rope_angle_in_table(r.table, r.table_rows, p, i0 / 2, r.n_dims, sf, cf))
      rope_angle_of(p, freqs[i0 / 2], i0 / 2, r.n_dims, r.freq_scale, r.freq_factors, sf, cf);
    if (row & 1) {
      rope_rotate(other, x, sf, cf, y0, y1);
      y = y1;
    } else {
      rope_rotate(x, other, sf, cf, y0, y1);
      y = y0;
    }
  }
  if (part == 0) {
    r.q_out[at] = y;
    return;
  }
  const int64_t kv = kv_store_row(r.first_row, r.slots, col, r.n_tokens, r.rows);
  if (kv >= 0) static_cast<__half*>(r.k_cache)[kv * n + row] = __float2half_rn(y);
}

// The warp-pipelined kernel. Block x takes row blocks x, x + gridDim.x, ...: with a grid of
// every row block, one each; resident (up to 8 columns, see qw_persist), a grid of at most two
// blocks an SM, each warp's stages of all its row blocks one stream through its ring, so that
// the next row block's first stages are in flight while this one's last are computed (a block
// of one row block starts with a trip to memory, about three waves of them in a decode batch's
// product). At a row block's end the warps' sums meet in shared memory of their own and are
// added in warp order, each of the tile's 4 (8 at two column tiles) elements a lane by a warp of
// its own, which stores them (where warp 0 alone added and stored them all, SmolLM2 shape B=8
// ran 3-5% slower on an H200).
//
// A lane's copies of a stage are worked out once for a row block's first stage and then moved on
// by constant steps, so that a stage costs an add, a test and the copy a chunk (worked out each
// stage, the addresses' 64-bit products were most of the kernel's instructions). Lane (g, t)
// copies chunk t of rows g and g + 8, chunk c of row r at r * 64 + (c ^ ((r >> 1) & 3)) * 16, so
// that the eight row addresses of an ldmatrix fall in distinct banks; then at most one scale
// chunk. Rows from n on and blocks from nb on arrive as zeros.
// ROPE: the rope epilogue (MatMulQRope) of parts q, k and v.
template <int TYPE, int NT, bool ROPE = false>
__global__ void __launch_bounds__(kQwThreads, NT == 1 ? 2 : 1)
    mat_mul_qw_kernel(QParts parts, int row_blocks, int k, const int8_t* aq, const float2* ads,
                      int cols, MatMulQRope rope) {
  using T = QwTile<TYPE>;
  constexpr int kBlocks = T::kBlocks, kQB = T::kSplit.quant_bytes, kStages = kQwStages;
  constexpr int kStep = kQwWarps * kBlocks;
  extern __shared__ __align__(16) uint8_t smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int nb = k / 32;
  const int n_stages = (nb + kBlocks - 1) / kBlocks;
  const int count = warp < n_stages ? (n_stages - warp + kQwWarps - 1) / kQwWarps : 0;
  const int mine =
      static_cast<int>((row_blocks - static_cast<int>(blockIdx.x) + gridDim.x - 1) / gridDim.x);
  const int total = mine * count;  // the warp's stages over all its row blocks
  uint8_t* ring = smem + warp * kStages * T::kStage;
  // The warps' sums (two buffers of kRed, see finish), then with ROPE the pairs' frequencies,
  // worked out while the kernel before this one still runs (the first row block's barrier comes
  // before any read).
  constexpr int kRed = kQwWarps * NT * 4 * 32;
  float* red = reinterpret_cast<float*>(smem + kQwWarps * kStages * T::kStage);
  double* freqs = reinterpret_cast<double*>(red + 2 * kRed);
  if constexpr (ROPE) {
    for (int p = threadIdx.x; p < rope.n_dims / 2; p += kQwThreads)
      freqs[p] = rope_freq(p, rope.n_dims, rope.freq_base);
  }
  const int b_first = warp * kBlocks;
  constexpr int kPerRow = T::kScaleBytes / T::kChunk;
  const int wblk = t * 16 / kQB;
  const int srow = lane / kPerRow, spart = lane % kPerRow;
  const int sblk = spart * kBlocks / kPerRow;
  const int sdst = 16 * kQwRowBytes + srow * T::kScaleBytes + spart * T::kChunk;
  constexpr int kScaleStep = T::kRecords ? kStep / 8 * 16 : kStep * T::kSplit.scale_bytes;
  int wdst[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    wdst[h] = r * kQwRowBytes + ((t ^ ((r >> 1) & 3)) * 16);
  }

  // The load cursor: row block ordinal lr (of this block's), stage li of it, and its sources.
  int lr = 0, li = 0, w_i = 0, w_b0 = b_first;
  const uint8_t* w = nullptr;
  const uint8_t* wsrc[2];
  bool wrow[2];
  const uint8_t* ssrc = nullptr;
  bool scopy = false;
  auto aim = [&](int r) {  // the sources of row block ordinal r's first stage
    const QPart part = block_part(parts, static_cast<int>(blockIdx.x + r * gridDim.x));
    w = part.w;
    const int n = part.n, row0 = part.rb * 16;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int rr = g + 8 * h;
      wrow[h] = row0 + rr < n;
      wsrc[h] = w + (static_cast<size_t>(min(row0 + rr, n - 1)) * nb + b_first) * kQB + t * 16;
    }
    const uint8_t* scales = w + static_cast<size_t>(n) * nb * kQB;
    scopy = lane < T::kChunks && row0 + srow < n;
    const size_t srow_at = static_cast<size_t>(min(row0 + srow, n - 1));
    ssrc = T::kRecords
               ? scales + (srow_at * (nb / 8) + b_first / 8) * 16
               : scales + (srow_at * nb + b_first) * T::kSplit.scale_bytes + spart * T::kChunk;
    w_b0 = b_first;
  };
  if (mine > 0) aim(0);
  auto load_weights = [&]() {
    uint8_t* st = ring + (w_i % kStages) * T::kStage;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const bool ok = wrow[h] && w_b0 + wblk < nb;
      cp_async_n<16>(st + wdst[h], ok ? wsrc[h] : w, ok ? 16 : 0);
      wsrc[h] += kStep * kQB;
    }
    if (lane < T::kChunks) {
      const bool ok = scopy && w_b0 + sblk < nb;
      cp_async_n<T::kChunk>(st + sdst, ok ? ssrc : w, ok ? T::kChunk : 0);
    }
    ssrc += kScaleStep;
    w_b0 += kStep;
    ++w_i;
    if (++li == count && ++lr < mine) {
      li = 0;
      aim(lr);
    }
  };
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < total) load_weights();
    cp_async_commit();
  }
  pdl_wait();

  const int mi = lane / 8, ri = lane % 8;
  const int lr8 = (mi & 1) * 8 + ri;
  const int lm_at = lr8 * kQwRowBytes + (((mi >> 1) ^ ((lr8 >> 1) & 3)) * 16);
  const int lm_at2 = lr8 * kQwRowBytes + (((2 + (mi >> 1)) ^ ((lr8 >> 1) & 3)) * 16);
  // Where this lane's activation values and pairs lie in the tiles. Output column nt * 8 + c
  // sums the quants and pairs of activation column nt * 8 + c alone, and no column from cols on
  // is stored: the padding columns of the last tile, whatever they hold (NaN pairs included),
  // reach no stored value. A stage's activation: column nt * 8 + g's words t and t + 4 of each
  // block (one 8-byte load), and the (d, d * sum) pairs of columns 2t and 2t + 1 (one 16-byte
  // load), at a constant offset from the stage's first block (blocks past nb read the next tile
  // or act_q8_tiles_bytes's padding, and qw_stage never uses them). NT is 2 only for 9 to 16
  // columns: every tile read holds columns. With one column tile they are requested a stage
  // ahead, so that their trip through L2 overlaps the stage before (with two, the registers
  // that takes measured slower: 4096x4096 at 16 columns 9.58 against 8.65 us on an H200); the
  // two sets of registers take turns, so that no copy waits for the loads in flight.
  const int8_t* aq_w = aq + (static_cast<int64_t>(b_first) * 8 + g) * 32 + 8 * t;
  const float2* ads_w = ads + static_cast<int64_t>(b_first) * 8 + 2 * t;
  auto load_act = [&](int at, uint2(&bb)[kBlocks][NT], float4(&xx)[kBlocks][NT]) {
    const int8_t* pa = aq_w + at * 256;  // at: blocks from b_first to the stage's first
    const float2* px = ads_w + at * 8;
#pragma unroll
    for (int j = 0; j < kBlocks; ++j)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        bb[j][nt] = load_after_wait(reinterpret_cast<const uint2*>(pa + (nt * nb + j) * 256));
        xx[j][nt] = load_after_wait(reinterpret_cast<const float4*>(px + (nt * nb + j) * 8));
      }
  };
  constexpr bool kAhead = NT == 1;
  float acc[NT][4] = {};
  float off[NT][4] = {};
  int r = 0, i = 0;  // the row block ordinal and the warp's stage of it
  // The row block's sums: every warp's into its own shared memory, in one of two buffers that
  // row blocks take in turns (a buffer is free again once every warp has passed the next row
  // block's barrier, so one barrier a row block); then each (column tile, element) of the 16 x 8
  // tile is added in warp order (finish_tile's) by a warp of its own and stored, or with ROPE
  // rotated against its pair's row (four lanes away, in the same warp) and stored by
  // qw_rope_store. acc and off start again for the next. Every warp comes here `mine` times, but
  // from different places (a warp without stages from the loop at the end), so the barrier is the
  // unaligned form, which allows that.
  static_assert(NT * 4 <= kQwWarps, "a warp for each element of each column tile");
  auto finish = [&]() {
    float* rbuf = red + (r & 1) * kRed;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        rbuf[((warp * NT + nt) * 4 + e) * 32 + lane] = acc[nt][e] + off[nt][e];
        acc[nt][e] = off[nt][e] = 0.0f;
      }
    __barrier_sync(0);
    if (warp < NT * 4) {
      const QPart part = block_part(parts, static_cast<int>(blockIdx.x + r * gridDim.x));
      const int nt = warp / 4, e = warp % 4;
      float v = rbuf[warp * 32 + lane];
#pragma unroll
      for (int o = 1; o < kQwWarps; ++o) v += rbuf[(o * NT * 4 + warp) * 32 + lane];
      const int row = part.rb * 16 + g + (e >= 2 ? 8 : 0);
      const int col = nt * 8 + 2 * t + (e & 1);
      if constexpr (ROPE) {
        const float other = __shfl_xor_sync(0xffffffffu, v, 4);
        if (row < part.n && col < cols)
          qw_rope_store(rope, freqs, part.index, part.n, part.dst, row, col, v, other);
      } else if (row < part.n && col < cols) {
        part.dst[static_cast<int64_t>(col) * part.n + row] = v;
      }
    }
    ++r;
  };
  // Stage q of the warp's (stage i of row block r) on the activation in b, x; with kAhead, the
  // next stage's requested into bn, xn first.
  int q = 0;
  auto step = [&](uint2(&b)[kBlocks][NT], float4(&x)[kBlocks][NT], uint2(&bn)[kBlocks][NT],
                  float4(&xn)[kBlocks][NT]) {
    if constexpr (kAhead) {
      if (q + 1 < total) load_act(i + 1 < count ? (i + 1) * kStep : 0, bn, xn);
    }
    cp_async_wait<kStages - 2>();
    __syncwarp();
    if (q + kStages - 1 < total) load_weights();
    cp_async_commit();
    if constexpr (!kAhead) load_act(i * kStep, b, x);
    const uint8_t* st = ring + (q % kStages) * T::kStage;
    qw_stage<TYPE, NT>(st, lm_at, lm_at2, b_first + i * kStep, nb, g, b, x, acc, off);
    ++q;
    if (++i == count) {
      i = 0;
      finish();
    }
  };
  uint2 b0[kBlocks][NT], b1[kBlocks][NT];
  float4 x0[kBlocks][NT], x1[kBlocks][NT];
  if (kAhead && total > 0) load_act(0, b0, x0);
  while (q < total) {
    step(b0, x0, b1, x1);
    if (q < total) step(b1, x1, b0, x0);
  }
  while (r < mine) finish();  // a warp without stages still meets the others' barriers
  cp_async_wait<0>();
  pdl_trigger();
}

// Half pairs from quants. A half whose bits are 0x6400 | b (b < 1024) is 1024 + b exactly, so
// (x & 0x000F000F) | 0x64006400 is the half pair (1024 + nibble at bit 0, 1024 + nibble at bit
// 16), one lop3; (x & 0x00F000F0) | 0x64006400 is 1024 + 16 times the nibbles at bits 4 and 20,
// which scale by 1/16 and less 64 take to the nibbles (every step exact). Q8_0's bytes, their
// top bits flipped, go into the low bytes of 0x6400 halves by one byte permute, 1152 off. Then
// the block's scale and offset: s * q + m, rounded once. Q4_0's, Q4_1's and Q8_0's s and m are
// halves already; a Q4_K sub-block's (d times its 6-bit scale, dmin times its minimum) are
// rounded to half first, so its values carry that rounding too.
__device__ __forceinline__ uint32_t lop3_and_or(uint32_t x, uint32_t mask, uint32_t bits) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(x), "r"(mask), "r"(bits));  // x & m | b
  return r;
}
__device__ __forceinline__ uint32_t scale_half_pair(__half2 q, __half2 s, __half2 m) {
  const __half2 v = __hfma2(q, s, m);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ __half2 as_half2(uint32_t h) {
  return *reinterpret_cast<const __half2*>(&h);
}

// A fragments (m16n8k16, the permuted k order of the file's comment) of one 32-block's two
// 16-element steps, rows g and g + 8. 4-bit formats: xg and xg8 are the words ldmatrix gave rows
// g and g + 8 (bytes 4t .. 4t + 3), low nibbles for step 0, high for step 1; Q8_0: xg[s] and
// xg8[s] the words of its two 16-byte chunks.
template <int TYPE>
__device__ __forceinline__ void half_fragments(uint32_t (&a)[2][4], const uint32_t (&xg)[2],
                                               const uint32_t (&xg8)[2], __half2 sg, __half2 sg8) {
  const __half2 s0 = __low2half2(sg), m0 = __high2half2(sg);
  const __half2 s1 = __low2half2(sg8), m1 = __high2half2(sg8);
  if constexpr (TYPE == kTypeQ8_0) {
    const __half2 bias = __float2half2_rn(1152.0f);
    auto pair = [&](uint32_t x, uint32_t sel, __half2 s, __half2 m) {
      return scale_half_pair(__hsub2(as_half2(__byte_perm(x, 0x64006400u, sel)), bias), s, m);
    };
#pragma unroll
    for (int st = 0; st < 2; ++st) {
      const uint32_t u = xg[st] ^ 0x80808080u, v = xg8[st] ^ 0x80808080u;
      // Bytes (0, 1) and (2, 3) into bit 0 and bit 16, 0x64 above each.
      a[st][0] = pair(u, 0x7150, s0, m0);
      a[st][1] = pair(v, 0x7150, s1, m1);
      a[st][2] = pair(u, 0x7352, s0, m0);
      a[st][3] = pair(v, 0x7352, s1, m1);
    }
  } else {
    // The nibbles of bytes 0 and 1 at bits 0 and 16 (u), those of bytes 2 and 3 there too (u2).
    const uint32_t u = __byte_perm(xg[0], 0, 0x3120), v = __byte_perm(xg8[0], 0, 0x3120);
    const uint32_t u2 = __byte_perm(xg[0], 0, 0x3322), v2 = __byte_perm(xg8[0], 0, 0x3322);
    const __half2 bias = __float2half2_rn(1024.0f);
    const __half2 sixteenth = __float2half2_rn(0.0625f), less64 = __float2half2_rn(-64.0f);
    auto lo = [&](uint32_t x, __half2 s, __half2 m) {
      return scale_half_pair(__hsub2(as_half2(lop3_and_or(x, 0x000F000Fu, 0x64006400u)), bias), s,
                             m);
    };
    auto hi = [&](uint32_t x, __half2 s, __half2 m) {
      const __half2 h = as_half2(lop3_and_or(x, 0x00F000F0u, 0x64006400u));
      return scale_half_pair(__hfma2(h, sixteenth, less64), s, m);
    };
    a[0][0] = lo(u, s0, m0);
    a[0][1] = lo(v, s1, m1);
    a[0][2] = lo(u2, s0, m0);
    a[0][3] = lo(v2, s1, m1);
    a[1][0] = hi(u, s0, m0);
    a[1][1] = hi(v, s1, m1);
    a[1][2] = hi(u2, s0, m0);
    a[1][3] = hi(v2, s1, m1);
  }
}

// Where 16-byte chunk c of activation column col lies in the half kernel's stage (HalfActColumns,
// stage_copy.h): c ^ act_swizzle(col). Its B loads are 8 bytes, served a half-warp at a time: lanes
// 0-15 read columns 0-3 of a column tile, lanes 16-31 columns 4-7. The XOR moves a half-warp's four
// columns' chunks by 0, 2, 4, 6 (the second half-warp's by 1, 3, 5, 7), so that with the two
// neighbouring chunks each column's lanes read, a half-warp covers all 32 banks once.

// The half kernel (the file's comment): the int8 kernel's tiles and split-k, the activation in
// half (columns kp = act_half_pitch(k) apart), the weights decoded in registers.
template <int TYPE, int NT, class S = QhShape<NT>>
__global__ void __launch_bounds__(QhTile<TYPE, NT, S>::kThreads, 2)
    mat_mul_qh_kernel(QParts parts, int k, const __half* act, int cols, unsigned* counters) {
  using T = QhTile<TYPE, NT, S>;
  constexpr int WM = T::kWM, MT = T::kMT, WK = kQhWarps / WM;  // WK: warps sharing a stage
  constexpr int kThreads = T::kThreads;
  constexpr int kSB = T::kSB, kStages = T::kStages, kStageK = T::kStageK;
  constexpr int kPerWarp = kSB / WK;
  static_assert(kPerWarp % 2 == 0, "blocks go in pairs");
  extern __shared__ __align__(16) uint8_t smem[];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = warp % WM, wk = warp / WM;
  const QPart part = block_part(parts);
  const HalfStages<T, HalfActColumns<kStageK * 2>> stages(part, k, act, cols, smem);
  auto load_stage_w = [&](int s) { stages.load_w(s); };
  auto load_stage_a = [&](int s) { stages.load_a(s); };

  const int g = lane / 4, t = lane % 4;
  const int mi = lane / 8, ri = lane % 8;
  // The B loads' offsets in a stage's activation but for the column tile's and the unrolled
  // steps' constant parts. Lane (g, t) reads chunk (4 j + 2 st2 + t/2) ^ act_swizzle(g) of
  // column g's stage (block j = kPerWarp wk + c4 of the warp's, step st2), 8 (t & 1) bytes in.
  // With c = 4 c4 + 2 st2 (even; c & ~7 and c & 7 constants once unrolled) that chunk is
  // 4 kPerWarp wk + (c & ~7) + (((c & 7) | t/2) ^ act_swizzle(g)): the XOR changes only the low
  // three bits, and 4 kPerWarp wk is a multiple of 8. So four offsets, one for each c & 7.
  int b_off[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    b_off[i] = g * kStageK * 2 + 8 * (t & 1) +
               (4 * kPerWarp * wk + (((2 * i) | (t >> 1)) ^ act_swizzle(g))) * 16;
  float acc[MT][NT][4] = {};

  run_stages<kStages>(stages.range, load_stage_w, load_stage_a, [&](int s) {
    const uint8_t* st = stages.at(s);
    const uint8_t* sw = st;
    const uint8_t* sws = st + T::kW;
    const uint8_t* sa = sws + T::kWS;
    const int wr = wm * 16 * MT;
#pragma unroll
    for (int jp = 0; jp < kPerWarp; jp += 2) {
      const int j0 = wk * kPerWarp + jp;  // this pair's first 32-block in the stage
      // Words of rows g and g + 8 of each row tile, blocks j0 and j0 + 1 ([tile][block][chunk];
      // 4-bit formats have one chunk a block).
      uint32_t xg[MT][2][2] = {}, xg8[MT][2][2] = {};
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int r = wr + 16 * mt + (mi & 1) * 8 + ri;
        if constexpr (T::kQuantBytes == 16) {
          // Matrices: rows 0-7 and 8-15 of block j0, then of block j0 + 1.
          const int ch = j0 + (mi >> 1);
          uint32_t q[4];
          ldmatrix_x4(q, sw + r * T::kRowBytes + ((ch ^ (r & 7)) * 16));
          xg[mt][0][0] = q[0], xg8[mt][0][0] = q[1], xg[mt][1][0] = q[2], xg8[mt][1][0] = q[3];
        } else {
          // Q8_0: a block is two chunks; matrices rows 0-7 and 8-15 of its first, then second.
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int ch = 2 * (j0 + h) + (mi >> 1);
            uint32_t q[4];
            ldmatrix_x4(q, sw + r * T::kRowBytes + ((ch ^ (r & 7)) * 16));
            xg[mt][h][0] = q[0], xg8[mt][h][0] = q[1], xg[mt][h][1] = q[2], xg8[mt][h][1] = q[3];
          }
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int j = j0 + h;
        uint32_t a[MT][2][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const uint8_t* rs = sws + (wr + 16 * mt + g) * T::kScaleBytes;
          half_fragments<TYPE>(a[mt], xg[mt][h], xg8[mt][h], block_scale_half<TYPE>(rs, j),
                               block_scale_half<TYPE>(rs + 8 * T::kScaleBytes, j));
        }
        // Column nt*8 + g's values 16 st + 4t .. + 3 of block j (b_off). The steps go outside,
        // so that products in a row add into different accumulators.
#pragma unroll
        for (int st2 = 0; st2 < 2; ++st2) {
          const int c = 4 * (jp + h) + 2 * st2;
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            const uint2 b = *reinterpret_cast<const uint2*>(sa + nt * 8 * kStageK * 2 +
                                                            (c & ~7) * 16 + b_off[(c & 7) / 2]);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) mma_16816(acc[mt][nt], a[mt][st2], b.x, b.y);
          }
        }
      }
    }
  });
  pdl_trigger();
  finish_tile<WM, WK, MT, NT, kThreads>(acc, smem, part.n, cols, part.rb, part.dst, part.partials,
                                        counters);
}

// ---- The warpgroup form of the half kernel (sm_90a) -------------------------------------------
//
// The wide half tiles (QhShape<4> and <8>: eight warps of one 16-row tile each, 128 rows a
// block) as two warpgroups of 64 rows whose products are wgmma's: each warp decodes its rows'
// A fragments in registers exactly as the half kernel does, and one wgmma a 16-element step
// multiplies the warpgroup's 64 rows by the stage's 32 or 64 columns read from shared memory by
// the tensor cores themselves, where the half kernel loads eight B fragments a step into every
// warp's registers and issues eight mma.sync. The activation stage is wgmma's K-major layout
// with the 128-byte swizzle (SwizzledKSegments), in k's own order: each lane gathers the quant
// bytes of k 2t, 2t + 1, 2t + 8 and 2t + 9 of its rows (two 32-bit loads and a byte permute),
// which half_fragments turns into the standard A fragments. The weights, stages, plan and end
// are the half kernel's. A block decodes block j + 1's fragments while block j's wgmma's run
// (two sets of A registers, wgmma.wait_group 1), and waits for all of a stage's before the
// barrier that lets its buffer be refilled.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// d += a * b for the warpgroup: a 64x16 (each warp's 16 rows, mma.sync's A fragment), b 16xN
// from shared memory (desc), d mma.sync's m16n8 accumulators of each column tile in turn.
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], const uint32_t (&a)[4],
                                                uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
__device__ __forceinline__ void wgmma_m64n32k16(float (&d)[16], const uint32_t (&a)[4],
                                                uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
      "{%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <int N>
__device__ __forceinline__ void wgmma_step(float (&d)[N / 2], const uint32_t (&a)[4],
                                           uint64_t desc) {
  if constexpr (N == 64)
    wgmma_m64n64k16(d, a, desc);
  else
    wgmma_m64n32k16(d, a, desc);
}
// The descriptor of a K-major operand with the 128-byte swizzle at smem: 8-row groups 1,024
// bytes apart (the leading offset unused).
__device__ __forceinline__ uint64_t wgmma_desc(const void* smem) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return static_cast<uint64_t>((a & 0x3FFFF) >> 4) | (uint64_t(1) << 16) |
         (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}
#endif

template <int TYPE, int NT>
__global__ void __launch_bounds__(QhTile<TYPE, NT>::kThreads, 2)
    mat_mul_qg_kernel(QParts parts, int k, const __half* act, int cols, unsigned* counters) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = QhTile<TYPE, NT>;
  static_assert(T::kWM == 8 && T::kMT == 1 && NT >= 4, "two warpgroups of four row tiles");
  constexpr int kThreads = T::kThreads, kSB = T::kSB, kStages = T::kStages;
  constexpr int N = T::kCols;
  static_assert((T::kW + T::kWS) % 1024 == 0 && T::kStage % 1024 == 0,
                "each stage's activation starts a swizzle atom");
  extern __shared__ __align__(16) uint8_t smem_raw[];
  // wgmma's swizzle follows the address bits: the stages start on a 1,024-byte boundary.
  uint8_t* const smem =
      smem_raw + ((1024 - static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) % 1024) % 1024);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const QPart part = block_part(parts);
  const HalfStages<T, SwizzledKSegments<N>> stages(part, k, act, cols, smem);
  auto load_stage_w = [&](int s) { stages.load_w(s); };
  auto load_stage_a = [&](int s) { stages.load_a(s); };

  const int g = lane / 4, t = lane % 4;
  const int r = warp * 16 + g;  // the lane's rows r and r + 8
  // Lane t's quant bytes 2t, 2t + 1 (word t / 2 of a 16-byte chunk) and 2t + 8, 2t + 9 (word
  // t / 2 + 2), as one word.
  const int word = (t >> 1) * 4;
  const uint32_t pick = (t & 1) ? 0x7632u : 0x5410u;
  auto gather = [&](const uint8_t* row, int ch) {
    const uint8_t* c = row + ((ch ^ (r & 7)) * 16) + word;
    return __byte_perm(*reinterpret_cast<const uint32_t*>(c),
                       *reinterpret_cast<const uint32_t*>(c + 8), pick);
  };
  float acc[1][NT][4] = {};
  float(&d)[N / 2] = reinterpret_cast<float(&)[N / 2]>(acc);

  run_stages<kStages, true>(stages.range, load_stage_w, load_stage_a, [&](int s) {
    const uint8_t* sw = stages.at(s);
    const uint8_t* sws = sw + T::kW;
    const uint64_t desc = wgmma_desc(sws + T::kWS);
    const uint8_t* row = sw + r * T::kRowBytes;
    const uint8_t* row8 = row + 8 * T::kRowBytes;
    uint32_t a[2][2][4];
#pragma unroll
    for (int j = 0; j < kSB; ++j) {
      uint32_t xg[2] = {}, xg8[2] = {};
      if constexpr (T::kQuantBytes == 16) {
        xg[0] = gather(row, j);
        xg8[0] = gather(row8, j);
      } else {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          xg[h] = gather(row, 2 * j + h);
          xg8[h] = gather(row8, 2 * j + h);
        }
      }
      half_fragments<TYPE>(a[j & 1], xg, xg8, block_scale_half<TYPE>(sws + r * T::kScaleBytes, j),
                           block_scale_half<TYPE>(sws + (r + 8) * T::kScaleBytes, j));
      wgmma_fence();
#pragma unroll
      for (int st2 = 0; st2 < 2; ++st2) {
        // k 32 j + 16 st2 of the stage: segment j / 2, 2 (32 j + 16 st2) % 128 bytes in.
        const int at = (j / 2) * N * 128 + ((j & 1) * 64 + st2 * 32);
        wgmma_step<N>(d, a[j & 1][st2], desc + (at >> 4));
      }
      wgmma_commit();
      wgmma_wait<1>();
    }
    wgmma_wait<0>();
  });
  pdl_trigger();
  finish_tile<8, 1, 1, NT, kThreads>(acc, smem, part.n, cols, part.rb, part.dst, part.partials,
                                     counters);
#else
  __trap();  // launched only where sm_90a's code runs (qg_available)
#endif
}

// GGRAPH_CUDA_MMQ: unset, the measured choice (below); 0, no kernel; int8 or all, the int8
// kernel for every product it can take; half, the half kernel for every one; warp, the
// warp-pipelined kernel for every one it can take (up to kQwMaxCols columns).
enum class Forced { Default, Off, Int8, Half, Warp };
Forced& forced() {
  static Forced v = [] {
    const char* e = std::getenv("GGRAPH_CUDA_MMQ");
    if (!e) return Forced::Default;
    const std::string s(e);
    return s == "0"                    ? Forced::Off
           : s == "all" || s == "int8" ? Forced::Int8
           : s == "half"               ? Forced::Half
           : s == "warp"               ? Forced::Warp
                                       : Forced::Default;
  }();
  return v;
}

// The warp-pipelined kernel's widest product: two column tiles.
constexpr int kQwMaxCols = 16;

// The measured choice (an H100 and an H200, BENCHMARKS.md): the warp-pipelined kernel for 4 to
// 16 columns (GGRAPH_CUDA_MMQ_WARP=0 turns it off, as before it: the int8 kernel at 8 columns of
// rows of 2,048 or more, the half kernel from 9); the half kernel from 17 columns on (from
// GGRAPH_CUDA_MMQ_MIN where the warp kernel does not take the product), but past 32 only for rows
// of 2,048 or more (the SmolLM2 shape's 576- and 1,536-long rows ran 19% slower at 64 columns
// than through cuBLAS); the mat-vec and cuBLAS elsewhere. Rows shorter than 2,048 kept the
// mat-vec up to 8 columns while the warp kernel's activation tiles took a launch of their own;
// with their producers writing them (GGRAPH_CUDA_TILE_OUTPUT), the SmolLM2 shape's decode batch
// of 8 ran 13-16% faster on the warp kernel.
MatMulQ measured_choice(int64_t k, int64_t cols) {
  static const bool warp = env_switch_on("GGRAPH_CUDA_MMQ_WARP");
  if (warp && cols >= 4 && cols <= kQwMaxCols) return MatMulQ::Int8Warp;
  static const int half_from = env_int("GGRAPH_CUDA_MMQ_MIN", 1, kMatMulQMaxCols, 9);
  if (cols >= half_from && (cols <= 32 || k >= 2048)) return MatMulQ::Half;
  return k >= 2048 && cols >= 8 ? MatMulQ::Int8 : MatMulQ::None;
}

// Whether a block takes the tile (16: the kernels' static shared memory).
bool tile_fits(size_t smem) { return smem + 16 <= max_block_smem(); }

bool qg_available();
// The warpgroup kernel's shared memory: the half tile's and room to start the stages on a
// 1,024-byte boundary.
template <int TYPE, int NT>
constexpr size_t qg_smem() {
  return static_cast<size_t>(QhTile<TYPE, NT>::kSmem) + 1024;
}
// Whether a product of n rows takes the narrow half tile: fewer rows, or a wide tile (the
// warpgroup kernel's where it runs) that a block cannot hold.
constexpr int64_t kQhWideRows = 4096;
template <int TYPE, int NT>
bool qh_narrow(int64_t n) {
  if constexpr (NT >= 4) {
    return n < kQhWideRows ||
           !tile_fits(qg_available() ? qg_smem<TYPE, NT>() : QhTile<TYPE, NT>::kSmem);
  } else {
    return false;
  }
}

// fn(integral_constant NT) for the column tiles of a product of cols columns.
template <typename Fn>
decltype(auto) with_col_tiles(int64_t cols, Fn&& fn) {
  if (cols <= 8) return fn(std::integral_constant<int, 1>{});
  if (cols <= 16) return fn(std::integral_constant<int, 2>{});
  if (cols <= 32) return fn(std::integral_constant<int, 4>{});
  return fn(std::integral_constant<int, 8>{});
}

// The warp-pipelined kernel's shared memory for its warps' sums (nt column tiles, two buffers),
// beside their rings.
constexpr size_t qw_red_bytes(int nt) { return 2 * size_t(kQwWarps) * nt * 4 * 32 * sizeof(float); }
// With the rope epilogue, its pairs' frequencies after them (heads up to kQwRopeMaxDims wide).
constexpr size_t qw_rope_bytes(bool rope) { return rope ? kQwRopeMaxDims / 2 * sizeof(double) : 0; }
// What the host needs of the warp-pipelined kernel's tile (its shared memory at two column
// tiles, the most it takes).
template <int TYPE>
constexpr TileSpec qw_spec() {
  return {16, QwTile<TYPE>::kBlocks, static_cast<size_t>(QwTile<TYPE>::kSmem) + qw_red_bytes(2)};
}

// The warp-pipelined products of up to 8 columns run resident, each block over several row
// blocks (mat_mul_qw_kernel); GGRAPH_CUDA_MMQ_WARP_PERSIST=0 gives them a block a row block. H200,
// tools/batch_bench.py at B=8: 7B Q4_0 +5-6%, 7B Q4_K_M +5-7%, SmolLM2 level (BENCHMARKS.md).
bool qw_persist() {
  static const bool on = [] {
    const char* e = std::getenv("GGRAPH_CUDA_MMQ_WARP_PERSIST");
    return !(e && std::string(e) == "0");
  }();
  return on;
}
// The current device's SMs (132 where none can be asked).
int sm_count() {
  static const int v = [] {
    int dev = 0, n = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n < 1) {
      cudaGetLastError();
      return 132;
    }
    return n;
  }();
  return v;
}

// Writes 1 where the code running is sm_90a's, which alone has the warpgroup kernel's body: a
// GPU of compute capability 9.0 runs the compute_90 PTX instead (its stub, which traps) when the
// driver compiles PTX for it, as it does under CUDA_FORCE_PTX_JIT=1.
__global__ void sm90a_probe_kernel(int* out) {
  pdl_wait();  // (launched alone; every kernel waits before its first access)
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  *out = 1;
#else
  *out = 0;
#endif
}

// Per device (a process may drive GPUs of several kinds): 0 not yet asked, 1 yes, 2 no.
constexpr int kQgDevices = 64;
std::atomic<int> qg_known[kQgDevices] = {};

// Whether the current device runs the warpgroup kernel, asked once a device (prepare_kernels,
// before any capture): compute capability 9.0 and sm_90a's code loaded.
void probe_qg() {
#if defined(GGRAPH_CUDA_SM90A)
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kQgDevices) {
    cudaGetLastError();
    return;
  }
  if (qg_known[dev].load(std::memory_order_relaxed) != 0) return;
  int major = 0, minor = 0, ran = 0;
  int* flag = nullptr;
  bool ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
            cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess &&
            major == 9 && minor == 0;
  if (ok && cudaMalloc(&flag, sizeof(int)) == cudaSuccess) {
    sm90a_probe_kernel<<<1, 1>>>(flag);
    ok = cudaMemcpy(&ran, flag, sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess && ran == 1;
    cudaFree(flag);
  } else {
    ok = false;
  }
  cudaGetLastError();
  qg_known[dev].store(ok ? 1 : 2, std::memory_order_relaxed);
#endif
}

// Whether the wide half tiles take the warpgroup kernel (mat_mul_qg_kernel): a build with
// sm_90a's code (GGRAPH_CUDA_SM90A) on a GPU of compute capability 9.0 that runs it (probe_qg),
// unless GGRAPH_CUDA_MMQ_WGMMA=0 keeps the half kernel. H200, the 7B shape's decode batches:
// B=64 11,132-11,145 tok/s against 8,956-9,031, B=32 7,499-7,506 against 6,717-6,719
// (BENCHMARKS.md). A device not yet probed takes the half kernel.
bool qg_available() {
#if defined(GGRAPH_CUDA_SM90A)
  static const bool on = env_switch_on("GGRAPH_CUDA_MMQ_WGMMA");
  if (!on) return false;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return dev >= 0 && dev < kQgDevices && qg_known[dev].load(std::memory_order_relaxed) == 1;
#else
  return false;
#endif
}

template <int TYPE, int NT>
void set_smem() {
  if constexpr (NT <= 2) {
    allow_block_smem(mat_mul_qw_kernel<TYPE, NT>, QwTile<TYPE>::kSmem + qw_red_bytes(NT));
    allow_block_smem(mat_mul_qw_kernel<TYPE, NT, true>,
                     QwTile<TYPE>::kSmem + qw_red_bytes(NT) + qw_rope_bytes(true));
  }
  allow_block_smem(mat_mul_q8_kernel<TYPE, NT>, Q8Tile<TYPE, NT>::kSmem);
  allow_block_smem(mat_mul_qh_kernel<TYPE, NT>, QhTile<TYPE, NT>::kSmem);
  if constexpr (NT >= 4) {
    allow_block_smem(mat_mul_qh_kernel<TYPE, NT, QhNarrow<NT>>,
                     QhTile<TYPE, NT, QhNarrow<NT>>::kSmem);
    if (qg_available()) allow_block_smem(mat_mul_qg_kernel<TYPE, NT>, qg_smem<TYPE, NT>());
  }
}

template <int TYPE>
void set_q_smem() {
  set_smem<TYPE, 1>();
  set_smem<TYPE, 2>();
  set_smem<TYPE, 4>();
  set_smem<TYPE, 8>();
}

// The tile a product of the given kernel takes (its format, columns and rows pick it).
TileSpec tile_spec(MatMulQ kind, DType type, int64_t cols, int64_t n) {
  return with_weight_type(type, "mat_mul_q", [&](auto tc) {
    constexpr int TYPE = decltype(tc)::value;
    if constexpr (mma_q_type(TYPE)) {
      return with_col_tiles(cols, [&](auto nt) {
        constexpr int NT = decltype(nt)::value;
        if (kind == MatMulQ::Int8Warp) return qw_spec<TYPE>();
        if (kind != MatMulQ::Half) return spec_of<Q8Tile<TYPE, NT>>();
        if constexpr (NT >= 4) {
          if (qh_narrow<TYPE, NT>(n)) return spec_of<QhTile<TYPE, NT, QhNarrow<NT>>>();
        }
        return spec_of<QhTile<TYPE, NT>>();
      });
    } else {
      return TileSpec{16, 1, 0};
    }
  });
}

}  // namespace

void set_block_smem_limit(size_t bytes) { block_smem_override() = bytes; }

void set_mat_mul_q_everywhere(MatMulQ kind) {
  forced() = kind == MatMulQ::Int8       ? Forced::Int8
             : kind == MatMulQ::Half     ? Forced::Half
             : kind == MatMulQ::Int8Warp ? Forced::Warp
                                         : Forced::Default;
}

MatMulQ mat_mul_q_kind(DType t, int64_t k, int64_t cols) {
  // k whole 64s: the scales of 32-blocks copy as 4-byte words (K-quants: whole 256-blocks).
  const Forced f = forced();
  if (f == Forced::Off || !mma_q_type(static_cast<int>(t)) || k % 64 != 0 || cols < 2 ||
      cols > kMatMulQMaxCols)
    return MatMulQ::None;
  if (f == Forced::Warp) return cols <= kQwMaxCols ? MatMulQ::Int8Warp : MatMulQ::None;
  const MatMulQ kind = f == Forced::Int8   ? MatMulQ::Int8
                       : f == Forced::Half ? MatMulQ::Half
                                           : measured_choice(k, cols);
  // A tile that needs more shared memory than the GPU gives a block (sm_86 and sm_89: 99 KiB)
  // leaves the product to the mat-vec or cuBLAS.
  // (Any row count: the narrow tile, where the wide one does not fit, is what counts.)
  return kind != MatMulQ::None && !tile_fits(tile_spec(kind, t, cols, kQhWideRows).smem)
             ? MatMulQ::None
             : kind;
}

namespace {
int64_t total_rows(const int64_t* n, int n_parts) {
  int64_t rows = 0;
  for (int p = 0; p < n_parts; ++p) rows += n[p];
  return rows;
}

// A part's split-k partials (floats), rounded up to whole float4s: the next part's start is
// 16-byte aligned for finish_tile's vector loads.
size_t part_partials(const QPlan& p, int64_t cols, int64_t n) {
  return (static_cast<size_t>(p.splits) * cols * n + 3) / 4 * 4;
}
}  // namespace

size_t mat_mul_q_partials_bytes(DType type, const int64_t* n, int n_parts, int64_t k,
                                int64_t cols) {
  const MatMulQ kind = mat_mul_q_kind(type, k, cols);
  if (kind == MatMulQ::None || kind == MatMulQ::Int8Warp) return 0;
  const QPlan p = q_plan(tile_spec(kind, type, cols, total_rows(n, n_parts)), n, n_parts, k);
  if (p.splits <= 1) return 0;
  size_t floats = 0;
  for (int i = 0; i < n_parts; ++i) floats += part_partials(p, cols, n[i]);
  return floats * sizeof(float);
}

size_t mat_mul_q_counters_bytes(DType type, const int64_t* n, int n_parts, int64_t k,
                                int64_t cols) {
  const MatMulQ kind = mat_mul_q_kind(type, k, cols);
  if (kind == MatMulQ::None || kind == MatMulQ::Int8Warp) return 0;
  const QPlan p = q_plan(tile_spec(kind, type, cols, total_rows(n, n_parts)), n, n_parts, k);
  return p.splits > 1 ? static_cast<size_t>(p.row_blocks) * sizeof(unsigned) : 0;
}

void prepare_mat_mul_q_kernels() {
  probe_qg();
  set_q_smem<kTypeQ4_0>();
  set_q_smem<kTypeQ4_1>();
  set_q_smem<kTypeQ8_0>();
  set_q_smem<kTypeQ4_K>();
  cudaGetLastError();
}

void launch_mat_mul_q(Launcher& l, DType type, const MatMulQPart* parts, int n_parts, int64_t k,
                      const uint8_t* ws, int cols, float* partials, unsigned* counters,
                      const MatMulQRope* rope) {
  const MatMulQ kind = mat_mul_q_kind(type, k, cols);
  if (kind == MatMulQ::None)
    throw ArgumentError(std::string("mat_mul_q: expected a product it takes (Q4_0, Q4_1, Q8_0 "
                                    "or Q4_K weights, k a multiple of 64, 2 to ") +
                        std::to_string(kMatMulQMaxCols) + " columns), got " + dtype_name(type) +
                        ", k " + std::to_string(k) + ", " + std::to_string(cols) + " columns");
  if (n_parts < 1 || n_parts > kMatMulQMaxParts)
    throw ArgumentError("mat_mul_q: expected 1 to " + std::to_string(kMatMulQMaxParts) +
                        " products in a launch, got " + std::to_string(n_parts));
  if (rope && (kind != MatMulQ::Int8Warp || n_parts != 3 || rope->n_dims > kQwRopeMaxDims))
    throw std::logic_error("mat_mul_q: the rope epilogue takes q, k and v on the warp kernel");
  int64_t n[kMatMulQMaxParts];
  for (int p = 0; p < n_parts; ++p) n[p] = parts[p].n;
  const int64_t rows = total_rows(n, n_parts);
  // The warp-pipelined kernel's row blocks are 16 rows, unsplit.
  const QPlan p = kind == MatMulQ::Int8Warp
                      ? QPlan{16, row_blocks_of(n, n_parts, 16), 1}
                      : q_plan(tile_spec(kind, type, cols, rows), n, n_parts, k);
  QParts qp{};
  int first = 0;
  float* partials_at = partials;
  for (int i = 0; i < kMatMulQMaxParts; ++i) {
    if (i < n_parts) {
      qp.w[i] = static_cast<const uint8_t*>(parts[i].w);
      qp.dst[i] = parts[i].dst;
      qp.partials[i] = partials_at;
      qp.n[i] = static_cast<int>(n[i]);
      qp.first[i] = first;
      first += static_cast<int>(ceil_div(n[i], p.rows));  // (p.row_blocks after the last)
      if (p.splits > 1) partials_at += part_partials(p, cols, n[i]);
    } else {
      qp.first[i] = std::numeric_limits<int>::max();
    }
  }
  const dim3 grid(static_cast<unsigned>(p.row_blocks), static_cast<unsigned>(p.splits));
  with_weight_type(type, "mat_mul_q", [&](auto tc) {
    constexpr int TYPE = decltype(tc)::value;
    if constexpr (mma_q_type(TYPE)) {
      if (kind == MatMulQ::Int8Warp) {
        const ActQ8 q = act_q8_tiles(const_cast<uint8_t*>(ws), k, cols);
        // Resident (two blocks an SM) up to 8 columns, else a block a row block.
        const int blocks = cols <= 8 && qw_persist()
                               ? std::min<int>(static_cast<int>(grid.x), 2 * sm_count())
                               : static_cast<int>(grid.x);
        auto launch = [&](auto kernel, int nt) {
          l(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kQwThreads),
            static_cast<size_t>(QwTile<TYPE>::kSmem) + qw_red_bytes(nt) + qw_rope_bytes(rope), qp,
            static_cast<int>(grid.x), static_cast<int>(k), q.qs, q.ds, cols,
            rope ? *rope : MatMulQRope{});
        };
        if (rope) {
          if (cols <= 8) return launch(mat_mul_qw_kernel<TYPE, 1, true>, 1);
          return launch(mat_mul_qw_kernel<TYPE, 2, true>, 2);
        }
        if (cols <= 8) return launch(mat_mul_qw_kernel<TYPE, 1>, 1);
        return launch(mat_mul_qw_kernel<TYPE, 2>, 2);
      }
      with_col_tiles(cols, [&](auto nt) {
        constexpr int NT = decltype(nt)::value;
        if (kind == MatMulQ::Half) {
          // (Every half tile and the warpgroup kernel take kQhWarps warps.)
          auto launch = [&](auto kernel, size_t smem) {
            l(kernel, grid, dim3(32 * kQhWarps), smem, qp, static_cast<int>(k),
              reinterpret_cast<const __half*>(ws), cols, counters);
          };
          if constexpr (NT >= 4) {
            if (qh_narrow<TYPE, NT>(rows))
              return launch(mat_mul_qh_kernel<TYPE, NT, QhNarrow<NT>>,
                            QhTile<TYPE, NT, QhNarrow<NT>>::kSmem);
            if (qg_available()) return launch(mat_mul_qg_kernel<TYPE, NT>, qg_smem<TYPE, NT>());
          }
          launch(mat_mul_qh_kernel<TYPE, NT>, QhTile<TYPE, NT>::kSmem);
        } else {
          const ActQ8 q = act_q8(const_cast<uint8_t*>(ws), k, cols);
          l(mat_mul_q8_kernel<TYPE, NT>, grid, dim3(kQ8Threads),
            static_cast<size_t>(Q8Tile<TYPE, NT>::kSmem), qp, static_cast<int>(k), q.qs, q.ds, cols,
            counters);
        }
      });
    }
  });
}

}  // namespace ggraph::cuda
