// Element-wise and per-column kernels: get_rows, rms_norm, add/mul, swiglu, rope, KV store, and
// the activation preparation that mat-muls share.
#include <cooperative_groups.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cuda/device_util.cuh"
#include "cuda/kernels.cuh"
#include "cuda/weight_layout.h"

namespace ggraph::cuda {

namespace {

// ---- get_rows --------------------------------------------------------------------------------

template <int TYPE>
__global__ void get_rows_kernel(const uint8_t* table, int64_t ne0, int64_t n_rows,
                                size_t row_stride, const int32_t* ids, float* dst, float scale) {
  pdl_begin();
  const int64_t t = blockIdx.x;
  const int32_t id = ids[t];
  float* out = dst + t * ne0;
  // Host validation rejects out-of-range ids of input tensors; computed ids read as zero rows.
  if (id < 0 || id >= n_rows) {
    for (int64_t i = threadIdx.x; i < ne0; i += blockDim.x) out[i] = 0.0f;
    return;
  }
  if constexpr (is_split_type(TYPE)) {
    // Split layout: all rows' quants (row_stride bytes a row), then high bits, then scales.
    constexpr SplitFormat f = split_format(static_cast<DType>(TYPE));
    const int64_t nb = ne0 / f.block_elems;
    const size_t total = static_cast<size_t>(n_rows) * nb, first = static_cast<size_t>(id) * nb;
    const uint8_t* q = table + static_cast<size_t>(id) * row_stride;
    const uint8_t* h = table + split_high_offset(f, total) + split_pieces(f, first) * f.high_bytes;
    const uint8_t* s = table + split_scales_offset(f, total) + first * f.scale_bytes;
    for (int64_t i = threadIdx.x; i < ne0; i += blockDim.x)
      out[i] = split_elem(static_cast<DType>(TYPE), q, h, s, i) * scale;
  } else {
    const uint8_t* row = table + static_cast<size_t>(id) * row_stride;
    for (int64_t i = threadIdx.x; i < ne0; i += blockDim.x)
      out[i] = load_elem<TYPE>(row, i) * scale;
  }
}

// ---- rms_norm, optionally fused with the residual add before it, the weight multiply after
// it and the 8-bit quantization of the result for the mat-vecs that read it -----------------

// One block per column. add/sum_out: x = src + add is written to sum_out and normalized.
// pre_w (EPT > 0 only): add is itself normalized (pre_eps) and multiplied by pre_w before it is
// added (Gemma's post-norms: x + rms_norm(a) * w, then the next pre-norm).
// w: multiplied in (broadcast when w_cols == 1); w_fixed: it is a weight, which never changes, so
// its loads may go out before the wait for the grid before. qs/ds: also quantize the result (needs
// ne0 a multiple of 32, so that each warp iteration covers one whole quant block), in column tiles
// where tiles_k is ne0 (q8_index).
// EPT > 0: each thread keeps its EPT elements (i = threadIdx.x + j * blockDim.x) in registers,
// so every read precedes the block's barrier and every write follows it: with one column, the
// outputs may overlap the inputs in any way. EPT == 0 (wide rows): two passes over memory, where
// each thread rereads only what it read (or wrote) itself.
// The rms scale 1 / sqrt(mean(v^2) + eps) of a row whose threads hold partial sums of squares
// `sum`; partial is the block's 32 floats of shared memory. Every warp sums the warps' partial
// sums itself, so one barrier suffices (callers with two reductions pass two arrays).
__device__ __forceinline__ float block_rms_scale(float sum, float* partial, int64_t ne0,
                                                 float eps) {
  sum = warp_sum(sum);
  const int lane = threadIdx.x % 32;
  if (lane == 0) partial[threadIdx.x / 32] = sum;
  __syncthreads();
  const int n_warps = blockDim.x / 32;
  float total = lane < n_warps ? partial[lane] : 0.0f;
  total = warp_sum(total);
  return 1.0f / sqrtf(total / static_cast<float>(ne0) + eps);
}

template <int EPT>
__global__ void __launch_bounds__(1024)
    rms_norm_kernel(const float* src, const float* add, float* sum_out, const float* w,
                    int64_t w_cols, int w_fixed, float* dst, int64_t ne0, float eps, int8_t* qs,
                    float2* ds, int64_t tiles_k, const float* pre_w, float pre_eps, __half* ho) {
  constexpr int kRegs = EPT > 0 ? EPT : 1;
  __shared__ float partial[32];
  __shared__ float pre_partial[EPT > 0 ? 32 : 1];
  const int64_t col = blockIdx.x;
  const float* x = src + col * ne0;
  const float* a = add ? add + col * ne0 : nullptr;
  float* xs = sum_out ? sum_out + col * ne0 : nullptr;
  float* y = dst + col * ne0;
  const float* wc = w ? w + (w_cols == 1 ? 0 : col * ne0) : nullptr;
  const int bd = blockDim.x;
  float wv[kRegs];
  if constexpr (EPT > 0) {
    if (wc && w_fixed) {
#pragma unroll
      for (int j = 0; j < EPT; ++j) {
        const int64_t i = threadIdx.x + j * bd;
        wv[j] = i < ne0 ? wc[i] : 0.0f;
      }
    }
  }
  float pw[kRegs];
  if constexpr (EPT > 0) {
    if (pre_w) {
#pragma unroll
      for (int j = 0; j < EPT; ++j) {
        const int64_t i = threadIdx.x + j * bd;
        pw[j] = i < ne0 ? pre_w[i] : 0.0f;
      }
    }
  }
  pdl_begin();
  float v[kRegs];
  float sum = 0.0f;
  if constexpr (EPT > 0) {
    float av[EPT];
    float asum = 0.0f;
#pragma unroll
    for (int j = 0; j < EPT; ++j) {
      const int64_t i = threadIdx.x + j * bd;
      v[j] = av[j] = 0.0f;
      if (i < ne0) {
        v[j] = x[i];
        if (a) av[j] = a[i];
        if (wc && !w_fixed) wv[j] = wc[i];
      }
      asum += av[j] * av[j];
    }
    const float ascale = pre_w ? block_rms_scale(asum, pre_partial, ne0, pre_eps) : 1.0f;
#pragma unroll
    for (int j = 0; j < EPT; ++j) {
      if (a) v[j] += pre_w ? av[j] * ascale * pw[j] : av[j];
      sum += v[j] * v[j];
    }
  } else {
    for (int64_t i = threadIdx.x; i < ne0; i += bd) {
      float u = x[i];
      if (a) {
        u += a[i];
        xs[i] = u;
      }
      sum += u * u;
    }
  }
  const float scale = block_rms_scale(sum, partial, ne0, eps);
  if constexpr (EPT > 0) {
    // Each round j is whole warps when ne0 % 32 == 0 (as quantizing needs): a warp is wholly
    // inside the row or past its end.
    float r[EPT];
    int64_t qi[EPT];
    bool in[EPT];
#pragma unroll
    for (int j = 0; j < EPT; ++j) {
      const int64_t i = threadIdx.x + j * bd;
      in[j] = i < ne0;
      qi[j] = q8_index(col * ne0 + i, tiles_k);
      r[j] = v[j] * scale;
      if (wc) r[j] *= wv[j];
      if (in[j]) {
        if (xs) xs[i] = v[j];
        y[i] = r[j];
        if (ho) ho[col * ne0 + i] = __float2half_rn(r[j]);
      }
    }
    if (qs) quantize_warp_blocks<EPT>(r, qi, in, qs, ds);
  } else {
    for (int64_t i = threadIdx.x; i < ne0; i += bd) {
      float r = (xs ? xs[i] : x[i]) * scale;
      if (wc) r *= wc[i];
      y[i] = r;
      if (ho) ho[col * ne0 + i] = __float2half_rn(r);
      if (qs) quantize_warp_block(r, q8_index(col * ne0 + i, tiles_k), qs, ds);
    }
  }
}

// A decode step's norm of a wide row over a cluster of C blocks (sm_90+): each block a slice of
// ne0 / C values, a thread a value, and the slices' sums of squares reduced through distributed
// shared memory, added in rank order by every block alike. The one-block kernel's time grows
// with the row (each thread's values in turn, one SM's loads, and with 8-bit output a warp
// reduction a value); here C SMs share it. A cluster a column (blockIdx.y: a decode batch's
// few columns), ne0 % (32 C) == 0, ne0 / C <= 1024, one weight column, no normalized add input.
template <int C>
__global__ void GGRAPH_CLUSTER_DIMS(C, 1, 1) __launch_bounds__(1024, 1)
    rms_norm_cluster_kernel(const float* src, const float* add, float* sum_out, const float* w,
                            int w_fixed, float* dst, int64_t ne0, float eps, int8_t* qs, float2* ds,
                            int64_t tiles_k, __half* ho) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  __shared__ float partial[32];
  __shared__ float block_total;
  const int64_t e = static_cast<int64_t>(blockIdx.x) * (ne0 / C) + threadIdx.x;
  const int64_t i = static_cast<int64_t>(blockIdx.y) * ne0 + e;
  float wv = w && w_fixed ? w[e] : 0.0f;
  pdl_begin();
  float v = src[i];
  if (add) v += add[i];
  if (w && !w_fixed) wv = w[e];
  const float sq = warp_sum(v * v);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = sq;
  __syncthreads();
  if (threadIdx.x < 32) {
    const float t = warp_sum(threadIdx.x < blockDim.x / 32 ? partial[threadIdx.x] : 0.0f);
    if (threadIdx.x == 0) block_total = t;
  }
  cluster.sync();
  float total = 0.0f;
#pragma unroll
  for (int r = 0; r < C; ++r) total += *cluster.map_shared_rank(&block_total, r);
  cluster.sync();  // every block's total read before any block goes on and may exit
  const float scale = 1.0f / sqrtf(total / static_cast<float>(ne0) + eps);
  const float r = w ? v * scale * wv : v * scale;
  if (sum_out) sum_out[i] = v;
  dst[i] = r;
  if (ho) ho[i] = __float2half_rn(r);
  if (qs) quantize_warp_block(r, q8_index(i, tiles_k), qs, ds);
#else
  __trap();
#endif
}

// Whether rms_norm_cluster_kernel<C> runs here (an sm_90 build, its cluster size compiled in),
// and for which columns it is wanted: the smallest width (4,096 by default, where it measured
// faster: the 7B shape's decode 479 against 473 tok/s on an H100; at 2,048 it was even), 2,048
// with GGRAPH_CUDA_NORM_CLUSTER=1 or the test hook, none with GGRAPH_CUDA_NORM_CLUSTER=0.
int64_t& norm_cluster_min_width() {
  static int64_t width = [] {
    const char* e = std::getenv("GGRAPH_CUDA_NORM_CLUSTER");
    const std::string v = e ? e : "";
    return v == "0" ? INT64_MAX : v == "1" ? 2048 : 4096;
  }();
  return width;
}
// The most columns (a decode batch's) that take a cluster each: 16 by default, where the
// warp-pipelined products read the norm's 8-bit column tiles; GGRAPH_CUDA_NORM_CLUSTER_COLS=N
// sets another bound, to measure (1: one column only).
int64_t norm_cluster_max_cols() {
  static const int64_t cols = env_int("GGRAPH_CUDA_NORM_CLUSTER_COLS", 1, 4096, 16);
  return cols;
}
template <int C>
bool norm_cluster_runs() {
  static const bool runs = [] {
    cudaFuncAttributes attr = {};
    const bool ok = cudaFuncGetAttributes(&attr, rms_norm_cluster_kernel<C>) == cudaSuccess &&
                    attr.ptxVersion >= 90 && attr.requiredClusterWidth == C;
    cudaGetLastError();
    return ok;
  }();
  return runs;
}

// ---- add / mul ---------------------------------------------------------------------------------

template <int OP>
__global__ void binary_kernel(const float* a, const float* b, int64_t b_cols, float* dst,
                              int64_t ne0, int64_t b_ne0) {
  pdl_begin();
  const int64_t col = blockIdx.y;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= ne0) return;
  const float x = a[col * ne0 + i];
  const float z = b[(b_cols == 1 ? 0 : col * b_ne0) + (b_ne0 == ne0 ? i : i % b_ne0)];
  dst[col * ne0 + i] = OP == 0 ? x + z : x * z;
}

// qs/ds: also quantize the result (n a multiple of 32: warps are wholly in or out of range), in
// column tiles where tiles_k is the row's length (q8_index); ho: also its half form.
template <int ACT>
__global__ void glu_kernel(const float* gate, const float* up, float* dst, int64_t n, int8_t* qs,
                           float2* ds, int64_t tiles_k, __half* ho) {
  pdl_begin();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float v = glu_value<ACT == kGluGelu>(gate[i], up[i]);
  dst[i] = v;
  if (ho) ho[i] = __float2half_rn(v);
  if (qs) quantize_warp_block(v, q8_index(i, tiles_k), qs, ds);
}

__global__ void softcap_kernel(const float* x, float* dst, int64_t n, float cap) {
  pdl_begin();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = cap * tanhf(x[i] / cap);
}

// ---- rope ----------------------------------------------------------------------------------

// One thread per pair slot p < head_dim/2 of one head of one token (angles: rope_angle).
// Rotates the heads of one tensor (n_head1 0) or of two with the same positions (q and k): the
// first n_head0 * head_dim / 2 pairs of a token belong to the first.
// With k_cache set, the second tensor's rows (k) also go to the F16 cache at each token's row
// (kv_store_row: position first_row + token of a cache of kv_rows rows, or with slots its
// sequence's row in a pool of sequences of kv_rows rows), and v's rows (pairs after the ropes'
// pairs) to v_cache: the K/V stores in the same launch. first_row comes from the step's KV
// record, as in kv_store_kernel.
struct RopeArgs {
  const float* src0;
  float* dst0;
  int n_head0;
  const float* src1;
  float* dst1;
  int n_head1;
  int head_dim, n_dims, mode;
  __half* k_cache;
  const float* v_src;
  __half* v_cache;
  int kv_rows;
};

// Pair p of head h of token t: what it reads (x[i0], x[i1]) and where it writes. Heads count the
// first tensor's, then the second's, then (with k_cache) V's rows cut into heads of the second's
// width, whose pairs are copied (copy). 32-bit index arithmetic and no division: the one-token
// kernel spends most of its time here.
struct RopeSlot {
  const float* x;
  float* y;
  __half* c;
  int i0, i1, freq_i;
  int head;
  bool rotate, copy, valid;
};

// row: the token's cache row (kv_store_row; negative: none, a padding token's).
__device__ __forceinline__ RopeSlot rope_slot(const RopeArgs& a, int h, int p, int t, int64_t row) {
  RopeSlot r{};
  const int half_dim = a.head_dim / 2;
  const int n01 = a.n_head0 + a.n_head1;
  const int64_t width1 = static_cast<int64_t>(a.n_head1) * a.head_dim;
  r.head = h;
  if (h >= n01) {
    r.valid = a.k_cache && h - n01 < a.n_head1 && row >= 0;
    r.copy = true;
    r.x = a.v_src + t * width1;
    r.c = r.valid ? a.v_cache + row * width1 : nullptr;
    r.i0 = 2 * ((h - n01) * half_dim + p);
    r.i1 = r.i0 + 1;
    return r;
  }
  r.valid = true;
  const bool second = h >= a.n_head0;
  const int hh = second ? h - a.n_head0 : h;
  const int n_head = second ? a.n_head1 : a.n_head0;
  const int64_t base = (static_cast<int64_t>(t) * n_head + hh) * a.head_dim;
  r.x = (second ? a.src1 : a.src0) + base;
  float* y = second ? a.dst1 : a.dst0;  // null: k into the cache only
  r.y = y ? y + base : nullptr;
  r.c = second && a.k_cache && row >= 0
            ? a.k_cache + row * width1 + static_cast<int64_t>(hh) * a.head_dim
            : nullptr;
  if (a.mode == kRopeNeox) {
    const int rot_half = a.n_dims / 2;
    r.rotate = p < rot_half;
    if (r.rotate) {
      r.i0 = p;
      r.i1 = p + rot_half;
    } else {
      r.i0 = a.n_dims + 2 * (p - rot_half);
      r.i1 = r.i0 + 1;
    }
  } else {
    r.i0 = 2 * p;
    r.i1 = r.i0 + 1;
    r.rotate = r.i0 < a.n_dims;
  }
  r.freq_i = p;
  return r;
}

__device__ __forceinline__ void rope_write(const RopeSlot& r, float x0, float x1, float sf,
                                           float cf) {
  if (r.copy) {
    if (r.c) r.c[r.i0] = __float2half_rn(x0), r.c[r.i1] = __float2half_rn(x1);
    return;
  }
  float y0 = x0, y1 = x1;
  if (r.rotate) rope_rotate(x0, x1, sf, cf, y0, y1);
  if (r.y) r.y[r.i0] = y0, r.y[r.i1] = y1;
  if (r.c) r.c[r.i0] = __float2half_rn(y0), r.c[r.i1] = __float2half_rn(y1);
}

// The arguments one by one (a struct's padding would differ between otherwise equal launches).
#define GGRAPH_ROPE_PARAMS                                                                      \
  const float *src0, float *dst0, int n_head0, const float *src1, float *dst1, int n_head1,     \
      int head_dim, int n_dims, int mode, __half *k_cache, const float *v_src, __half *v_cache, \
      const int32_t *pos, float freq_base, const int32_t *first_row_at, int kv_rows,            \
      const float *freq_factors, float freq_scale, const int32_t *slots, const float2 *table,   \
      int table_rows
#define GGRAPH_ROPE_ARGS                                                                       \
  const RopeArgs a {                                                                           \
    src0, dst0, n_head0, src1, dst1, n_head1, head_dim, n_dims, mode, k_cache, v_src, v_cache, \
        kv_rows                                                                                \
  }

__global__ void rope_kernel(GGRAPH_ROPE_PARAMS) {
  pdl_begin();
  GGRAPH_ROPE_ARGS;
  const int t = blockIdx.y;
  const int64_t row = k_cache ? kv_store_row(first_row_at, slots, t, gridDim.y, kv_rows) : 0;
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  const int half_dim = head_dim / 2;
  const RopeSlot r = rope_slot(a, idx / half_dim, idx % half_dim, t, row);
  if (!r.valid) return;
  const float x0 = r.x[r.i0], x1 = r.x[r.i1];
  float sf = 0.0f, cf = 1.0f;
  if (!r.copy && r.rotate)
    rope_angle_from(table, table_rows, pos[t], r.freq_i, a.n_dims, freq_base, freq_scale,
                    freq_factors, sf, cf);
  rope_write(r, x0, x1, sf, cf);
}

// A token a block (blockIdx.x): every read of the token's rows (and each frequency's angle, in
// shared memory) before any write, so that an output may take the memory of an input, as the
// planner hands out k's rope output where q's product was: any input with one token, and with
// several the same rows of an input of the same width (the block's own token's). A thread keeps one
// pair p of a head and takes the heads p's threads stride over (rope_token_threads). With
// split_heads > 0 (q and k of as many heads, several tokens) a token's heads are shared by
// gridDim.y blocks: block y takes heads y * split_heads .. + split_heads - 1 of q, of k and of V
// alike, so that where an output takes an input's place (a whole tensor over another of the
// same width, all that several tokens allow) each head's rows are read and written by one block.
// NORM: each
// head is first RMS-normalized over its head_dim elements and multiplied by norm_w0 (the first
// tensor's heads) or norm_w1 (the second's): the per-head q/k norms of Qwen 3 and Gemma 3 in the
// same launch. A head's sum of squares is reduced in a fixed order, so results do not depend on
// scheduling.
template <bool NORM>
__global__ void __launch_bounds__(1024)
    rope_token_kernel(GGRAPH_ROPE_PARAMS, int n_heads, int split_heads, const float* norm_w0,
                      const float* norm_w1, float norm_eps) {
  pdl_begin();
  GGRAPH_ROPE_ARGS;
  const int t = blockIdx.x;
  const int64_t row = k_cache ? kv_store_row(first_row_at, slots, t, gridDim.x, kv_rows) : 0;
  __shared__ float2 angle[kRopeMaxHalfDim];
  __shared__ float squares[NORM ? kRopeNormMaxPairs : 1];
  __shared__ float head_scale[NORM ? kRopeNormMaxHeads : 1];
  const int half_dim = a.head_dim / 2;
  const int p = threadIdx.x % half_dim;
  const int h0 = threadIdx.x / half_dim, stride = blockDim.x / half_dim;
  // The block's heads: u-th of n_local.
  const int n_local = split_heads ? n_heads / a.n_head0 * split_heads : n_heads;
  const int head_at = static_cast<int>(blockIdx.y) * split_heads;
  auto head_of = [&](int u) {
    return split_heads ? u / split_heads * a.n_head0 + head_at + u % split_heads : u;
  };
  float x0[kRopeTokenSlots], x1[kRopeTokenSlots];
  // The loads first: their latency overlaps the angles' computation.
#pragma unroll
  for (int s = 0; s < kRopeTokenSlots; ++s) {
    const int u = h0 + s * stride;
    if (u >= n_local) break;
    const int h = head_of(u);
    const RopeSlot r = rope_slot(a, h, p, t, row);
    x0[s] = r.x[r.i0];
    x1[s] = r.x[r.i1];
    if constexpr (NORM) {
      if (!r.copy) squares[h * half_dim + p] = x0[s] * x0[s] + x1[s] * x1[s];
    }
  }
  if (static_cast<int>(threadIdx.x) < half_dim) {
    float sf, cf;
    rope_angle_from(table, table_rows, pos[t], p, a.n_dims, freq_base, freq_scale, freq_factors, sf,
                    cf);
    angle[p] = make_float2(sf, cf);
  }
  __syncthreads();
  if constexpr (NORM) {
    // A warp a head: lanes sum strided pairs in order, then the warp's butterfly.
    const int n_norm = a.n_head0 + a.n_head1;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int h = warp; h < n_norm; h += blockDim.x / 32) {
      float sum = 0.0f;
      for (int q = lane; q < half_dim; q += 32) sum += squares[h * half_dim + q];
      sum = warp_sum(sum);
      if (lane == 0) head_scale[h] = rsqrtf(sum / static_cast<float>(a.head_dim) + norm_eps);
    }
    __syncthreads();
  }
#pragma unroll
  for (int s = 0; s < kRopeTokenSlots; ++s) {
    const int u = h0 + s * stride;
    if (u >= n_local) break;
    const RopeSlot r = rope_slot(a, head_of(u), p, t, row);
    if constexpr (NORM) {
      const float* w = r.head < a.n_head0 ? norm_w0 : norm_w1;
      if (!r.copy && w) {
        const float sc = head_scale[r.head];
        x0[s] = x0[s] * sc * w[r.i0];
        x1[s] = x1[s] * sc * w[r.i1];
      }
    }
    const float2 sc = r.copy ? make_float2(0.0f, 1.0f) : angle[r.freq_i];
    rope_write(r, x0[s], x1[s], sc.x, sc.y);
  }
}

// ---- KV store ------------------------------------------------------------------------------

// first_row (the first token's position) is read from the step's KV record, so that the
// arguments stay the same from step to step; token t goes to kv_store_row. blockIdx.y picks one
// of two stores of the same rows (K and V).
__global__ void kv_store_kernel(const float* src0, const float* src1, __half* cache0,
                                __half* cache1, int64_t n_embd_kv, int64_t n,
                                const int32_t* first_row_at, int rows, const int32_t* slots) {
  pdl_begin();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float* src = blockIdx.y == 0 ? src0 : src1;
  __half* cache = blockIdx.y == 0 ? cache0 : cache1;
  const int t = static_cast<int>(i / n_embd_kv);
  const int64_t row = kv_store_row(first_row_at, slots, t, static_cast<int>(n / n_embd_kv), rows);
  if (row < 0) return;
  cache[row * n_embd_kv + (i - t * n_embd_kv)] = __float2half_rn(src[i]);
}

// Q8_0 rows: a warp a block of 32 values (store_q8_0_warp_block).
__global__ void kv_store_q8_kernel(const float* src0, const float* src1, uint8_t* cache0,
                                   uint8_t* cache1, int64_t n_embd_kv, int64_t n_blocks,
                                   const int32_t* first_row_at, int rows, const int32_t* slots) {
  pdl_begin();
  const int64_t b = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (b >= n_blocks) return;
  const float* src = blockIdx.y == 0 ? src0 : src1;
  uint8_t* cache = blockIdx.y == 0 ? cache0 : cache1;
  const int64_t per_row = n_embd_kv / 32;
  const int t = static_cast<int>(b / per_row);
  const int64_t row =
      kv_store_row(first_row_at, slots, t, static_cast<int>(n_blocks / per_row), rows);
  if (row < 0) return;
  store_q8_0_warp_block(src[b * 32 + lane], cache + (row * per_row + (b - t * per_row)) * 34, lane);
}

// ---- The step's KV record ----------------------------------------------------------------------

__global__ void kv_params_kernel(KvSlots values, int32_t* record) {
  pdl_begin();
  if (threadIdx.x < kMaxKvSlots) record[threadIdx.x] = values.v[threadIdx.x];
}

// ---- Activation preparation ------------------------------------------------------------------

// One warp per block of 32: q = round(x / d), d = max|x| / 127; ds = (d, d * sum(q)).
__global__ void quantize_act_kernel(const float* x, int64_t n_blocks, int8_t* qs, float2* ds) {
  pdl_begin();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i / 32 >= n_blocks) return;
  quantize_warp_block(x[i], i, qs, ds);
}

// The column tiles of act_q8_tiles: warp w quantizes column w % 8 of tile and block w / 8
// (columns past cols as zeros).
__global__ void quantize_act_tiles_kernel(const float* x, int64_t k, int cols, int64_t n_warps,
                                          int8_t* qs, float2* ds) {
  pdl_begin();
  const int64_t w = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  if (w >= n_warps) return;
  const int64_t nb = k / 32, tb = w / 8;
  const int64_t col = tb / nb * 8 + w % 8, e = tb % nb * 32 + threadIdx.x % 32;
  const float y = col < cols ? x[col * k + e] : 0.0f;
  quantize_warp_block(y, q8_index(col * k + e, k), qs, ds);
}

template <bool BF16>
__global__ void act_to_16_kernel(const float* x, int64_t k, int64_t kp, int64_t n, uint16_t* h) {
  pdl_begin();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t col = i / kp, kk = i % kp;
  const float v = kk < k ? x[col * k + kk] : 0.0f;
  if constexpr (BF16) {
    h[i] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
  } else {
    h[i] = __half_as_ushort(__float2half_rn(v));
  }
}

}  // namespace

void launch_get_rows(Launcher& l, DType type, const void* table, int64_t ne0, int64_t n_rows,
                     const int32_t* ids, int n_ids, float* dst, float scale) {
  const auto* t = static_cast<const uint8_t*>(table);
  // Quantized tables are split (cuda/weight_layout.h): a row's quants are 16 or 32 bytes a 32.
  const size_t rb = is_quantized(type)
                        ? static_cast<size_t>(ne0 / 32) * split_format(type).quant_bytes
                        : row_bytes(type, ne0);
  with_weight_type(type, "get_rows", [&](auto tc) {
    l(get_rows_kernel<decltype(tc)::value>, dim3(n_ids), dim3(256), 0, t, ne0, n_rows, rb, ids, dst,
      scale);
  });
}

void launch_rms_norm(Launcher& l, const NormArgs& a, int64_t ne0, int64_t cols, float eps) {
  // A thread an element up to 1024 of them: a decode step's norm is one block, whose time is
  // its chain of dependent instructions, which more threads with fewer elements each shorten
  // (SmolLM2's 576 under Nsight Compute: 5.0 us with 160 threads of 4 elements, 3.1 with 576).
  const int threads = static_cast<int>(std::min<int64_t>(1024, (ne0 + 31) / 32 * 32));
  const ActQ8 q = act_q8_form(a.quant_ws, ne0, cols, a.quant_tiles);
  const int64_t per_thread = ceil_div(ne0, threads);
  auto launch = [&](auto kernel) {
    l(kernel, dim3(cols), dim3(threads), 0, a.src, a.add, a.sum_out, a.w, a.w_cols,
      a.w_fixed ? 1 : 0, a.dst, ne0, eps, q.qs, q.ds, q.tiles_k, a.add_w, a.add_eps,
      reinterpret_cast<__half*>(a.half_ws));
  };
  if (a.add_w && (cols != 1 || per_thread > 8))
    throw std::logic_error("rms_norm: a normalized add input needs one column in registers");
  // Each wide column over a cluster of blocks, where wide enough and it runs here.
  auto cluster = [&](auto kernel, int c) {
    l(kernel, dim3(c, static_cast<unsigned>(cols)), dim3(static_cast<unsigned>(ne0 / c)), 0, a.src,
      a.add, a.sum_out, a.w, a.w_fixed ? 1 : 0, a.dst, ne0, eps, q.qs, q.ds, q.tiles_k,
      reinterpret_cast<__half*>(a.half_ws));
  };
  if (cols <= norm_cluster_max_cols() && !a.add_w && (!a.w || a.w_cols == 1) &&
      ne0 >= norm_cluster_min_width()) {
    if (ne0 <= 4096 && ne0 % 128 == 0 && norm_cluster_runs<4>())
      return cluster(rms_norm_cluster_kernel<4>, 4);
    if (ne0 <= 8192 && ne0 % 256 == 0 && norm_cluster_runs<8>())
      return cluster(rms_norm_cluster_kernel<8>, 8);
  }
  if (per_thread <= 1) return launch(rms_norm_kernel<1>);
  if (per_thread <= 2) return launch(rms_norm_kernel<2>);
  if (per_thread <= 4) return launch(rms_norm_kernel<4>);
  static_assert(8 * 1024 == kNormRegElems, "rows in registers: at most 8 elements a thread");
  if (per_thread <= 8) return launch(rms_norm_kernel<8>);
  launch(rms_norm_kernel<0>);
}

void prepare_norm_kernels() {
  norm_cluster_runs<4>();
  norm_cluster_runs<8>();
}

int64_t set_norm_cluster_min_width(int64_t width) {
  return std::exchange(norm_cluster_min_width(), width);
}

void launch_binary(Launcher& l, int op, const float* a, const float* b, int64_t b_cols, float* dst,
                   int64_t ne0, int64_t cols, int64_t b_ne0) {
  const dim3 grid(ceil_div(ne0, 256), cols), block(256);
  if (op == 0) {
    l(binary_kernel<0>, grid, block, 0, a, b, b_cols, dst, ne0, b_ne0);
  } else {
    l(binary_kernel<1>, grid, block, 0, a, b, b_cols, dst, ne0, b_ne0);
  }
}

void launch_glu(Launcher& l, int act, const float* gate, const float* up, float* dst, int64_t ne0,
                int64_t cols, uint8_t* quant_ws, uint8_t* half_ws, bool quant_tiles) {
  const int64_t n = ne0 * cols;
  const ActQ8 q = act_q8_form(quant_ws, ne0, cols, quant_tiles);
  auto* h = reinterpret_cast<__half*>(half_ws);
  const dim3 grid(ceil_div(n, 256)), block(256);
  if (act == kGluGelu) {
    l(glu_kernel<kGluGelu>, grid, block, 0, gate, up, dst, n, q.qs, q.ds, q.tiles_k, h);
  } else {
    l(glu_kernel<kGluSilu>, grid, block, 0, gate, up, dst, n, q.qs, q.ds, q.tiles_k, h);
  }
}

void launch_softcap(Launcher& l, const float* x, float* dst, int64_t n, float cap) {
  l(softcap_kernel, dim3(ceil_div(n, 256)), dim3(256), 0, x, dst, n, cap);
}

namespace {
// The blocks a several-token rope launch aims at (rope_token_kernel's split_heads).
constexpr int kRopeSplitBlocks = 128;
// GGRAPH_CUDA_ROPE_SPLIT=0 keeps a token's heads in one block, to measure.
bool rope_split_on() {
  static const bool on = env_switch_on("GGRAPH_CUDA_ROPE_SPLIT");
  return on;
}

__global__ void rope_table_kernel(float2* table, int rows, int n_dims, float freq_base,
                                  float freq_scale, const float* freq_factors) {
  pdl_begin();  // a plain launch before any capture, but every kernel waits (DESIGN.md)
  const int half = n_dims / 2;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<int64_t>(rows) * half) return;
  const int p = static_cast<int>(i / half), f = static_cast<int>(i % half);
  float sf, cf;
  rope_angle(p, f, n_dims, freq_base, freq_scale, freq_factors, sf, cf);
  table[i] = make_float2(sf, cf);
}
}  // namespace

void launch_rope_table(float2* table, int rows, int n_dims, float freq_base, float freq_scale,
                       const float* freq_factors, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(rows) * (n_dims / 2);
  if (n <= 0) return;
  constexpr int kThreads = 256;
  rope_table_kernel<<<static_cast<unsigned>(ceil_div(n, kThreads)), kThreads, 0, stream>>>(
      table, rows, n_dims, freq_base, freq_scale, freq_factors);
  GGRAPH_CUDA_CHECK(cudaGetLastError());
}

int64_t rope_slots(int n_head, int head_dim, int n_head1, bool with_kv) {
  return static_cast<int64_t>(n_head + n_head1 * (with_kv ? 2 : 1)) * (head_dim / 2);
}

void launch_rope(Launcher& l, const float* src, const int32_t* pos, float* dst, int n_head,
                 int head_dim, int n_dims, int mode, float freq_base, int n_tokens,
                 const float* src1, float* dst1, int n_head1, const RopeKvStore* kv,
                 const float* freq_factors, float freq_scale, const RopeHeadNorm* norm,
                 const float2* table, int table_rows) {
  if (!src1) n_head1 = 0;
  RopeArgs a{src,
             dst,
             n_head,
             src1 ? src1 : src,
             src1 ? dst1 : dst,
             n_head1,
             head_dim,
             n_dims,
             mode,
             nullptr,
             src,
             nullptr,
             0};
  const int32_t* first_row = nullptr;
  const int32_t* seq_slots = nullptr;
  const bool with_kv = kv && src1;
  if (src1 && !dst1 && !with_kv)
    throw std::logic_error("launch_rope: k rotated nowhere (no output and no cache)");
  if (with_kv) {
    a.k_cache = static_cast<__half*>(kv->k_cache);
    a.v_cache = static_cast<__half*>(kv->v_cache);
    a.v_src = kv->v;
    a.kv_rows = kv->rows;
    first_row = kv->first_row;
    seq_slots = kv->slots;
  }
  const int64_t slots = rope_slots(n_head, head_dim, n_head1, with_kv);
  if (norm && !rope_norm_fits(n_tokens, n_head, n_head1, head_dim))
    throw std::logic_error("launch_rope: head norms of this size do not fit one block");
  if (norm || (src1 && rope_token_fits(slots, head_dim))) {
    const int n_heads = static_cast<int>(slots / (head_dim / 2));
    // Several tokens of q and k of as many heads: each token's heads over up to
    // kRopeSplitBlocks / n_tokens blocks (a power of two dividing the heads), so that a few
    // tokens fill more than a few SMs.
    int split = 1;
    if (!norm && n_tokens >= 2 && n_head1 == n_head && rope_split_on())
      while (split * 2 * n_tokens <= kRopeSplitBlocks && n_head % (split * 2) == 0) split *= 2;
    const int split_heads = split > 1 ? n_head / split : 0;
    const int block_heads = split > 1 ? n_heads / n_head * split_heads : n_heads;
    l(norm ? rope_token_kernel<true> : rope_token_kernel<false>,
      dim3(n_tokens, static_cast<unsigned>(split)), dim3(rope_token_threads(block_heads, head_dim)),
      0, a.src0, a.dst0, a.n_head0, a.src1, a.dst1, a.n_head1, a.head_dim, a.n_dims, a.mode,
      a.k_cache, a.v_src, a.v_cache, pos, freq_base, first_row, a.kv_rows, freq_factors, freq_scale,
      seq_slots, table, table_rows, n_heads, split_heads, norm ? norm->w0 : nullptr,
      norm && src1 ? norm->w1 : nullptr, norm ? norm->eps : 0.0f);
    return;
  }
  l(rope_kernel, dim3(ceil_div(slots, 128), n_tokens), dim3(128), 0, a.src0, a.dst0, a.n_head0,
    a.src1, a.dst1, a.n_head1, a.head_dim, a.n_dims, a.mode, a.k_cache, a.v_src, a.v_cache, pos,
    freq_base, first_row, a.kv_rows, freq_factors, freq_scale, seq_slots, table, table_rows);
}

bool rope_norm_fits(int n_tokens, int n_head, int n_head1, int head_dim) {
  // Every pair slot of both tensors with V's riding along (as wide as the second's).
  const int64_t slots = rope_slots(n_head, head_dim, n_head1, true);
  return rope_reads_first(n_tokens, slots, head_dim) && n_head + n_head1 <= kRopeNormMaxHeads &&
         static_cast<int64_t>(n_head + n_head1) * (head_dim / 2) <= kRopeNormMaxPairs;
}

int rope_token_threads(int n_heads, int head_dim) {
  const int half_dim = head_dim / 2;
  return std::min(n_heads, 1024 / half_dim) * half_dim;
}

bool rope_token_fits(int64_t slots, int head_dim) {
  const int half_dim = head_dim / 2;
  if (half_dim < 1 || half_dim > kRopeMaxHalfDim) return false;
  // Each thread takes one pair of up to kRopeTokenSlots heads.
  return slots <= static_cast<int64_t>(1024 / half_dim) * half_dim * kRopeTokenSlots;
}

bool rope_reads_first(int n_tokens, int64_t slots, int head_dim) {
  return n_tokens == 1 && rope_token_fits(slots, head_dim);
}

void launch_kv_store(Launcher& l, DType cache_type, const float* src0, void* cache0,
                     const float* src1, void* cache1, int64_t n_embd_kv, int n_tokens,
                     const int32_t* first_row, int rows, const int32_t* slots) {
  const int64_t n = n_embd_kv * n_tokens;
  const bool pair = src1 != nullptr;
  if (cache_type == DType::Q8_0) {
    if (n_embd_kv % 32 != 0)
      throw ArgumentError("kv_store: Q8_0 rows must be a multiple of 32 wide, got " +
                          std::to_string(n_embd_kv));
    l(kv_store_q8_kernel, dim3(ceil_div(n, 256), pair ? 2 : 1), dim3(256), 0, src0,
      pair ? src1 : src0, static_cast<uint8_t*>(cache0),
      static_cast<uint8_t*>(pair ? cache1 : cache0), n_embd_kv, n / 32, first_row, rows, slots);
    return;
  }
  l(kv_store_kernel, dim3(ceil_div(n, 256), pair ? 2 : 1), dim3(256), 0, src0, pair ? src1 : src0,
    static_cast<__half*>(cache0), static_cast<__half*>(pair ? cache1 : cache0), n_embd_kv, n,
    first_row, rows, slots);
}

#ifdef GGRAPH_CUDA_STEP_TRACE
namespace {
std::vector<void (*)(StepStamp*)>& step_trace_sources() {
  static std::vector<void (*)(StepStamp*)> v;
  return v;
}
StepStamp* g_host_stamps = nullptr;

// The records in grid order, a line each: "STP gridid blocks threads sm arrived released".
void step_trace_print() {
  std::vector<StepStamp> v;
  for (unsigned long long i = 0; i < kStepStamps; ++i)
    if (g_host_stamps[i].grid) v.push_back(g_host_stamps[i]);
  std::sort(v.begin(), v.end(),
            [](const StepStamp& a, const StepStamp& b) { return a.grid < b.grid; });
  for (const StepStamp& r : v)
    std::printf("STP %llu %u %u %u %llu %llu\n", r.grid, r.blocks, r.threads, r.sm, r.arrived,
                r.released);
  std::fflush(stdout);
}
}  // namespace

void step_trace_register(void (*attach)(StepStamp*)) { step_trace_sources().push_back(attach); }

void step_trace_attach() {
  static std::once_flag once;
  std::call_once(once, [] {
    void* host = nullptr;
    void* dev = nullptr;
    const size_t bytes = kStepStamps * sizeof(StepStamp);
    if (cudaHostAlloc(&host, bytes, cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess ||
        cudaHostGetDevicePointer(&dev, host, 0) != cudaSuccess) {
      cudaGetLastError();
      std::fprintf(stderr, "step trace: no page-locked records; no stamps\n");
      return;
    }
    std::memset(host, 0, bytes);
    g_host_stamps = static_cast<StepStamp*>(host);
    for (auto attach : step_trace_sources()) attach(static_cast<StepStamp*>(dev));
    std::atexit(step_trace_print);
  });
}
#else
void step_trace_attach() {}
#endif

bool env_switch_on(const char* name) {
  const char* e = std::getenv(name);
  return !(e && std::strcmp(e, "0") == 0);
}

int env_int(const char* name, int lo, int hi, int fallback) {
  const char* e = std::getenv(name);
  const int v = e ? std::atoi(e) : 0;
  return e && v >= lo && v <= hi ? v : fallback;
}

void prefer_carveout(const void* func) {
  // -2: unset. On sm_90 every kernel prefers all of the SM's shared memory: an SM runs blocks of
  // one shared-memory configuration at a time, and a decode step's kernels asked for 8 to 164
  // KiB (the products little, the decode attention much), so that the attention's blocks waited
  // for SMs to empty and reconfigure, not launching early beside the products (BENCHMARKS.md,
  // "one shared-memory configuration"). Other GPUs keep the driver's choice, unmeasured.
  static const int setting = env_int("GGRAPH_CUDA_CARVEOUT", -1, 100, -2);
  if (setting == -1) return;  // the driver's choice everywhere
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return;
  }
  // A function's attributes are its own on each device.
  static std::mutex mu;
  static std::set<std::pair<const void*, int>> done;
  std::lock_guard<std::mutex> lock(mu);
  if (!done.emplace(func, device).second) return;
  int carveout = setting;
  if (carveout == -2) {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess)
      cudaGetLastError();
    carveout = major == 9 ? 100 : -1;
  }
  // A kernel not built for this GPU fails here and at its launch, which reports it.
  if (carveout >= 0 && cudaFuncSetAttribute(func, cudaFuncAttributePreferredSharedMemoryCarveout,
                                            carveout) != cudaSuccess)
    cudaGetLastError();
}

bool use_programmatic_launch(const cudaDeviceProp& prop) {
  if (prop.major < 9 || !env_switch_on("GGRAPH_CUDA_PDL")) return false;
  // pdl_wait compiles to griddepcontrol.wait only for sm_90 and newer virtual architectures: a
  // build without them must not launch early, whatever the GPU.
  cudaFuncAttributes a;
  if (cudaFuncGetAttributes(&a, kv_params_kernel) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return a.ptxVersion >= 90;
}

void launch_kv_params(Launcher& l, const KvSlots& values, int32_t* record) {
  l(kv_params_kernel, dim3(1), dim3(kMaxKvSlots), 0, values, record);
}

// The quants first, then the pairs at the next multiple of 256 bytes.
size_t act_q8_bytes(int64_t k, int64_t cols) {
  const size_t qs = static_cast<size_t>(k * cols + 255) / 256 * 256;
  return qs + static_cast<size_t>(k / 32 * cols) * sizeof(float2);
}

ActQ8 act_q8(uint8_t* ws, int64_t k, int64_t cols) {
  if (!ws) return {};
  return {reinterpret_cast<int8_t*>(ws),
          reinterpret_cast<float2*>(ws + static_cast<size_t>(k * cols + 255) / 256 * 256)};
}

void launch_quantize_act(Launcher& l, const float* x, int64_t k, int64_t cols, uint8_t* ws) {
  const int64_t n_blocks = k / 32 * cols;
  const ActQ8 q = act_q8(ws, k, cols);
  l(quantize_act_kernel, dim3(ceil_div(n_blocks, 8)), dim3(256), 0, x, n_blocks, q.qs, q.ds);
}

// The warp-pipelined product reads a stage's blocks at constant offsets, past the last tile's
// end where a row's last stage is short: for k a multiple of 64, two blocks at most, whose
// quants reach up to 384 bytes past the pairs' end.
constexpr size_t kActTilesPad = 1024;
size_t act_q8_tiles_bytes(int64_t k, int64_t cols) {
  return act_q8_bytes(k, ceil_div(cols, 8) * 8) + kActTilesPad;
}

ActQ8 act_q8_tiles(uint8_t* ws, int64_t k, int64_t cols) {
  ActQ8 q = act_q8(ws, k, ceil_div(cols, 8) * 8);
  q.tiles_k = k;
  return q;
}

ActQ8 act_q8_form(uint8_t* ws, int64_t k, int64_t cols, bool tiles) {
  return tiles ? act_q8_tiles(ws, k, cols) : act_q8(ws, k, cols);
}

void launch_quantize_act_tiles(Launcher& l, const float* x, int64_t k, int64_t cols, uint8_t* ws) {
  const int64_t n_warps = k / 32 * ceil_div(cols, 8) * 8;
  const ActQ8 q = act_q8_tiles(ws, k, cols);
  l(quantize_act_tiles_kernel, dim3(ceil_div(n_warps, 8)), dim3(256), 0, x, k,
    static_cast<int>(cols), n_warps, q.qs, q.ds);
}

size_t act_half_bytes(int64_t k, int64_t cols) {
  const int64_t kp = act_half_pitch(k);
  return static_cast<size_t>(kp * cols) * sizeof(__half);
}

void launch_act_to_half(Launcher& l, const float* x, int64_t k, int64_t cols, uint8_t* ws,
                        bool bf16) {
  const int64_t kp = act_half_pitch(k);
  const int64_t n = kp * cols;
  auto* h = reinterpret_cast<uint16_t*>(ws);
  if (bf16) {
    l(act_to_16_kernel<true>, dim3(ceil_div(n, 256)), dim3(256), 0, x, k, kp, n, h);
  } else {
    l(act_to_16_kernel<false>, dim3(ceil_div(n, 256)), dim3(256), 0, x, k, kp, n, h);
  }
}

}  // namespace ggraph::cuda
