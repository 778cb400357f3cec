// Device-side helpers shared by the CUDA backend's kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "quant.h"

// A kernel's thread-block cluster size, compiled in for sm_90 and later only (older GPUs have
// no clusters; their builds of such a kernel must never be launched).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define GGRAPH_CLUSTER_DIMS(x, y, z)
#else
#define GGRAPH_CLUSTER_DIMS(x, y, z) __cluster_dims__(x, y, z)
#endif

namespace ggraph::cuda {

constexpr int kTypeF32 = static_cast<int>(DType::F32);
constexpr int kTypeF16 = static_cast<int>(DType::F16);
constexpr int kTypeBF16 = static_cast<int>(DType::BF16);
constexpr int kTypeQ4_0 = static_cast<int>(DType::Q4_0);
constexpr int kTypeQ4_1 = static_cast<int>(DType::Q4_1);
constexpr int kTypeQ5_0 = static_cast<int>(DType::Q5_0);
constexpr int kTypeQ5_1 = static_cast<int>(DType::Q5_1);
constexpr int kTypeQ8_0 = static_cast<int>(DType::Q8_0);
constexpr int kTypeQ2_K = static_cast<int>(DType::Q2_K);
constexpr int kTypeQ3_K = static_cast<int>(DType::Q3_K);
constexpr int kTypeQ4_K = static_cast<int>(DType::Q4_K);
constexpr int kTypeQ5_K = static_cast<int>(DType::Q5_K);
constexpr int kTypeQ6_K = static_cast<int>(DType::Q6_K);
constexpr int kTypeIQ4_NL = static_cast<int>(DType::IQ4_NL);
constexpr int kTypeIQ4_XS = static_cast<int>(DType::IQ4_XS);
// Whether the kernels read the type in the split layout (cuda/weight_layout.h).
constexpr bool is_split_type(int type) {
  return type != kTypeF32 && type != kTypeF16 && type != kTypeBF16;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ int warp_sum_int(int v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The gated unit's value of one element: act(gate) * up, with act SiLU or (GELU true) GELU's
// tanh approximation, as the CPU backend computes them. The glu kernel and the gate/up
// products' epilogue both take it, so that their results agree bit for bit.
template <bool GELU>
__device__ __forceinline__ float glu_value(float g, float up) {
  float a;
  if constexpr (GELU) {
    a = 0.5f * g * (1.0f + tanhf(0.7978845608028654f * g * (1.0f + 0.044715f * g * g)));
  } else {
    a = g / (1.0f + expf(-g));
  }
  return a * up;
}

// The 8-bit activation blocks the quantized mat-vecs read, N at once: in block j the warp's 32
// elements y[j] of one block (stored at i[j], the same i[j] / 32 in every lane: see q8_index)
// become q = round(y / d), d = max|y| / 127, and block i[j] / 32's ds = (d, d * sum(q)). Every lane
// of the warp takes part; blocks whose ok[j] is false (the same in every lane) store nothing. The N
// reductions interleave, so that their shuffles overlap instead of running one after another.
template <int N>
__device__ __forceinline__ void quantize_warp_blocks(const float (&y)[N], const int64_t (&i)[N],
                                                     const bool (&ok)[N], int8_t* qs, float2* ds) {
  float amax[N];
  int q[N], sum[N];
#pragma unroll
  for (int j = 0; j < N; ++j) amax[j] = fabsf(y[j]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
    for (int j = 0; j < N; ++j) amax[j] = fmaxf(amax[j], __shfl_xor_sync(0xffffffffu, amax[j], o));
  }
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const float d = amax[j] / 127.0f;
    q[j] = amax[j] == 0.0f ? 0 : max(-127, min(127, __float2int_rn(y[j] / d)));
    sum[j] = q[j];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
    for (int j = 0; j < N; ++j) sum[j] += __shfl_xor_sync(0xffffffffu, sum[j], o);
  }
#pragma unroll
  for (int j = 0; j < N; ++j) {
    if (!ok[j]) continue;
    qs[i[j]] = static_cast<int8_t>(q[j]);
    const float d = amax[j] / 127.0f;
    if (threadIdx.x % 32 == 0) ds[i[j] / 32] = make_float2(d, d * static_cast<float>(sum[j]));
  }
}

// Where element i = col * k + e of an activation's 8-bit form lies: at i in the plain layout
// (tiles_k == 0), or (tiles_k == k) in the column tiles of act_q8_tiles: tile col / 8, its block
// e / 32, column col % 8 of it, then the word of e % 32 in the order 0 4 1 5 2 6 3 7. Either
// way the block's pair is at the result / 32, so that quantize_warp_block(s) write both layouts.
__device__ __forceinline__ int64_t q8_index(int64_t i, int64_t tiles_k) {
  if (tiles_k == 0) return i;
  const int64_t col = i / tiles_k, e = i % tiles_k;
  const int word = static_cast<int>(e % 32) / 4;
  return (((col / 8) * (tiles_k / 32) + e / 32) * 8 + col % 8) * 32 +
         ((word & 3) * 2 + (word >> 2)) * 4 + e % 4;
}

// One such block: element i of the activation is y in this lane.
__device__ __forceinline__ void quantize_warp_block(float y, int64_t i, int8_t* qs, float2* ds) {
  const float ys[1] = {y};
  const int64_t is[1] = {i};
  const bool ok[1] = {true};
  quantize_warp_blocks<1>(ys, is, ok, qs, ds);
}

// A Q8_0 cache block (an F16 scale, 32 int8 quants: 34 bytes at blk) of the 32 values the warp
// holds, x in lane `lane`, as quantize_q8_0 (quant.cpp) makes it: d = amax / 127 rounded to F16,
// q = round(x / d) with the float reciprocal, halves away from zero.
__device__ __forceinline__ void store_q8_0_warp_block(float x, uint8_t* blk, int lane) {
  float amax = fabsf(x);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  const float v = roundf(x * id);
  const int q = v >= 127.0f ? 127 : v <= -127.0f ? -127 : v == v ? static_cast<int>(v) : 0;
  if (lane == 0) *reinterpret_cast<__half*>(blk) = __float2half_rn(d);
  blk[2 + lane] = static_cast<uint8_t>(static_cast<int8_t>(q));
}

__device__ __forceinline__ float f16_bits_to_float(uint16_t h) {
  return __half2float(__ushort_as_half(h));
}
__device__ __forceinline__ float bf16_bits_to_float(uint16_t h) {
  return __uint_as_float(static_cast<uint32_t>(h) << 16);
}

// Programmatic dependent launch (sm_90 and newer): every kernel waits until the grid before it
// has completed and its writes are visible (pdl_wait), then lets the next grid launch
// (pdl_trigger), whose start-up then overlaps this kernel's run. Before the wait a kernel may
// only read model weights, which nothing writes after upload (the mat-vecs and rms_norm load
// their first weights there); every other access comes after it, which keeps every
// read-after-write and write-after-read order of plain stream execution. Without the launch
// attribute (or before sm_90) both are no-ops.
//
// In measurement builds (GGRAPH_CUDA_STEP_TRACE, a CMake option) thread 0 of block 0 of every
// grid stamps %globaltimer (ns) before and after its wait into a record of page-locked host
// memory, at its grid id (step_trace_attach in kernels.cu prints them at the process's exit).
// In launch order (the grid ids), one grid's release is the end of the grid before it, so the
// releases are a step's critical path kernel by kernel (tools/step_trace.py). Device printf was
// tried first: its 27 us a call on the critical path made the step 4.7 times longer.
#ifdef GGRAPH_CUDA_STEP_TRACE
struct StepStamp {
  unsigned long long grid, arrived, released;
  unsigned blocks, threads, sm, pad;
};
constexpr unsigned long long kStepStamps = 1ull << 18;  // the latest launches', by grid id
// Each CUDA source's own pointer to the records (without relocatable device code a device
// variable is one source's); step_trace_attach sets every source's through the function each
// registers here at load time.
static __device__ StepStamp* g_step_stamps = nullptr;
void step_trace_register(void (*attach)(StepStamp*));
namespace {
void step_trace_attach_source(StepStamp* p) { cudaMemcpyToSymbol(g_step_stamps, &p, sizeof p); }
[[maybe_unused]] const bool g_step_trace_registered =
    (step_trace_register(&step_trace_attach_source), true);
}  // namespace
#endif
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#ifdef GGRAPH_CUDA_STEP_TRACE
  const bool first = threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0 && blockIdx.x == 0 &&
                     blockIdx.y == 0 && blockIdx.z == 0;
  unsigned long long arrived = 0;
  if (first) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(arrived));
#endif
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#ifdef GGRAPH_CUDA_STEP_TRACE
  if (first && g_step_stamps) {
    unsigned long long released, grid;
    unsigned sm;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(released));
    asm volatile("mov.u64 %0, %%gridid;" : "=l"(grid));
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    StepStamp* r = g_step_stamps + (grid & (kStepStamps - 1));
    r->arrived = arrived;
    r->released = released;
    r->blocks = gridDim.x * gridDim.y * gridDim.z;
    r->threads = blockDim.x * blockDim.y * blockDim.z;
    r->sm = sm;
    r->grid = grid;
  }
#endif
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
// A load, after pdl_wait, of what an earlier kernel wrote (an activation), through L1. Never
// __ldg for such data: the read-only path (ld.global.nc) promises that nothing writes the data
// while the kernel runs, and ptxas then may and does move the load above griddepcontrol.wait, into
// the time the kernel before still writes it (the warp-pipelined products' rope epilogue read
// stale activation tiles so on an H200, in CUDA graphs only). ld.global.ca stays after the wait.
template <typename T>
__device__ __forceinline__ T load_after_wait(const T* p) {
  return __ldca(p);
}
// Kernels let the next one launch at once: on an H200 that beat triggering the mat-vecs after
// their loads (SmolLM2 shape, patch tg128 1210 against 1086 tok/s; the large mat-vecs' sweep in
// BENCHMARKS.md).
__device__ __forceinline__ void pdl_begin() {
  pdl_wait();
  pdl_trigger();
}

// A ticket of `step` among those that meet at *counter until it holds `total` (left at zero
// again by the last): true for the one that completes it. Its release orders the calling
// thread's writes before it, its acquire the caller's reads after it, at GPU scope.
__device__ __forceinline__ bool last_ticket(unsigned* counter, unsigned step, unsigned total) {
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;"
               : "=r"(old)
               : "l"(counter), "r"(step)
               : "memory");
  if (old + step != total) return false;
  *counter = 0;  // every ticket has arrived: ready for the next use
  return true;
}

// The ticket of a block among n that meet at *counter (left at zero again by the last): true, in
// every thread of the block, for the last to arrive, whose reads after it see every arrived
// block's writes before it. The block's barrier orders its threads' writes before thread 0's
// release, and thread 0's acquire before the block's reads after the second barrier, so no
// thread fences on its own (__threadfence is a sequentially consistent fence a thread, and the
// acquire side a second one).
__device__ __forceinline__ bool last_block_ticket(unsigned* counter, unsigned n) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) last = last_ticket(counter, 1, n);
  __syncthreads();
  return last;
}

// The KV cache row of position pos in a cache of `rows` rows: pos itself, or for a sliding-window
// ring (graph.h's kv_row) pos modulo its size. rows <= 0: no cache.
__device__ __forceinline__ int ring_row(int pos, int rows) {
  return rows > 0 && pos >= rows ? pos % rows : pos;
}
// The row of position first + r (0 <= r < N) given row0, the row of position first: one
// compare where the cache holds at least N rows, the division otherwise.
template <int N>
__device__ __forceinline__ int ring_row_after(int row0, int first, int r, int rows) {
  if (rows >= N) {
    const int row = row0 + r;
    return row >= rows ? row - rows : row;
  }
  return ring_row(first + r, rows);
}

// The row token t of n_tokens goes to: with slots (a pool of sequences of `rows` rows each:
// slots[t] is the token's sequence, slots[n_tokens + t] its position), that sequence's row of
// the position, or none (-1) for a padding token (sequence -1); otherwise the row of position
// *first_row_at + t (ring_row).
__device__ __forceinline__ int64_t kv_store_row(const int32_t* first_row_at, const int32_t* slots,
                                                int t, int n_tokens, int rows) {
  if (slots)
    return slots[t] < 0
               ? -1
               : static_cast<int64_t>(slots[t]) * rows + ring_row(slots[n_tokens + t], rows);
  return ring_row(*first_row_at + t, rows);
}

// The rope angle of pair freq_i at position pos (sin, cos). Angles are computed in double
// precision: at positions in the thousands a float angle is off by ~1e-4 rad. freq_factors:
// n_dims/2 values (pairs past them do not rotate, and read none).
// rope_angle in two steps: the pair's frequency, which depends on no position (a kernel may work
// it out once for many), then the angle at a position; the same bits as rope_angle.
__device__ __forceinline__ double rope_freq(int freq_i, int n_dims, float freq_base) {
  return exp(-2.0 * freq_i / n_dims * log(static_cast<double>(freq_base)));
}
__device__ __forceinline__ void rope_angle_of(int32_t pos, double freq, int freq_i, int n_dims,
                                              float freq_scale, const float* freq_factors,
                                              float& sf, float& cf) {
  double theta = static_cast<double>(pos) * static_cast<double>(freq_scale) * freq;
  if (freq_factors && 2 * freq_i < n_dims) theta /= static_cast<double>(freq_factors[freq_i]);
  double s, c;
  sincos(theta, &s, &c);
  sf = static_cast<float>(s);
  cf = static_cast<float>(c);
}
__device__ __forceinline__ void rope_angle(int32_t pos, int freq_i, int n_dims, float freq_base,
                                           float freq_scale, const float* freq_factors, float& sf,
                                           float& cf) {
  rope_angle_of(pos, rope_freq(freq_i, n_dims, freq_base), freq_i, n_dims, freq_scale, freq_factors,
                sf, cf);
}

// rope_angle's (sin, cos) of pair freq_i at pos from a table of them (launch_rope_table: n_dims / 2
// pairs a position, positions [0, table_rows)): whether the table holds it.
__device__ __forceinline__ bool rope_angle_in_table(const float2* table, int table_rows,
                                                    int32_t pos, int freq_i, int n_dims, float& sf,
                                                    float& cf) {
  if (!table || pos < 0 || pos >= table_rows || 2 * freq_i >= n_dims) return false;
  const float2 a = table[static_cast<int64_t>(pos) * (n_dims / 2) + freq_i];
  sf = a.x;
  cf = a.y;
  return true;
}
// The same angle from the table where it holds pos, else worked out.
__device__ __forceinline__ void rope_angle_from(const float2* table, int table_rows, int32_t pos,
                                                int freq_i, int n_dims, float freq_base,
                                                float freq_scale, const float* freq_factors,
                                                float& sf, float& cf) {
  if (!rope_angle_in_table(table, table_rows, pos, freq_i, n_dims, sf, cf))
    rope_angle(pos, freq_i, n_dims, freq_base, freq_scale, freq_factors, sf, cf);
}

// The rotation of a rope pair by the angle of (sf, cf): each product and sum rounded on its own
// (no fused multiply-add), so that every kernel that rotates gives the same bits.
__device__ __forceinline__ void rope_rotate(float x0, float x1, float sf, float cf, float& y0,
                                            float& y1) {
  y0 = __fsub_rn(__fmul_rn(x0, cf), __fmul_rn(x1, sf));
  y1 = __fadd_rn(__fmul_rn(x0, sf), __fmul_rn(x1, cf));
}

// Element i of a row of a float type, as float.
template <int TYPE>
__device__ __forceinline__ float load_elem(const uint8_t* row, int64_t i) {
  if constexpr (TYPE == kTypeF32) {
    return reinterpret_cast<const float*>(row)[i];
  } else if constexpr (TYPE == kTypeF16) {
    return f16_bits_to_float(reinterpret_cast<const uint16_t*>(row)[i]);
  } else {
    static_assert(TYPE == kTypeBF16, "a float type");
    return bf16_bits_to_float(reinterpret_cast<const uint16_t*>(row)[i]);
  }
}

// A K-quant sub-block's scale d * sc and minimum dmin * m, from its block's record (d | dmin,
// then the 12 bytes of packed 6-bit values: quant.h's k_scale_min, four bytes a word).
__device__ __forceinline__ float2 k_scale_min_dev(const uint32_t (&s)[4], int j) {
  const int sh = 8 * (j & 3);
  const uint32_t b0 = s[1] >> sh, b1 = s[2] >> sh, b2 = s[3] >> sh;
  const bool low = j < 4;
  const uint32_t sc = low ? b0 & 63 : (b2 & 15) | (((b0 >> 6) & 3) << 4);
  const uint32_t m = low ? b1 & 63 : ((b2 >> 4) & 15) | (((b1 >> 6) & 3) << 4);
  return make_float2(
      f16_bits_to_float(static_cast<uint16_t>(s[0] & 0xFFFF)) * static_cast<float>(sc),
      f16_bits_to_float(static_cast<uint16_t>(s[0] >> 16)) * static_cast<float>(m));
}

// Asynchronous 16-byte global-to-shared copies (sm_80+). src_bytes < 16 zero-fills the rest.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes = 16) {
  uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
               "r"(src_bytes));
}
// The same for BYTES = 4, 8 or 16 (cached in L1 below 16 bytes, as the instruction requires).
template <int BYTES>
__device__ __forceinline__ void cp_async_n(void* smem, const void* gmem, int src_bytes) {
  uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  if constexpr (BYTES == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
                 "r"(src_bytes));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(s), "l"(gmem), "n"(BYTES),
                 "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Tensor-core fragments (sm_80+): four 8x8 b16 matrices from shared memory (lanes 8m..8m+7
// give matrix m's row addresses); the transposed form hands each lane two rows of one column.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s)
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s)
               : "memory");
}

// c += a * b, a 16x16 (row) and b 16x8 (column) half fragments, c 16x8 in float.
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

// (a, b) as the sum of two half pairs, hi the nearest halves and lo the nearest halves to what
// is left: about 22 significant bits, where one half pair keeps 11. Two MMAs over hi and lo
// multiply a float operand by a half one to within float rounding.
__device__ __forceinline__ void split_half2(float a, float b, uint32_t& hi, uint32_t& lo) {
  const __half2 h = __floats2half2_rn(a, b);
  const float2 f = __half22float2(h);
  hi = *reinterpret_cast<const uint32_t*>(&h);
  lo = pack_half2(a - f.x, b - f.y);
}

}  // namespace ggraph::cuda
