// Causal attention over the KV cache (F16, or ggml's Q8_0 blocks): flash-decoding (KV split over
// blocks, then a reduce) for a few queries, and flash attention on tensor cores for prompts.
#include <cooperative_groups.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "cuda/device_util.cuh"
#include "cuda/kernels.cuh"

namespace ggraph::cuda {

int attention_splits(int max_keys, int kv_blocks, int split_keys) {
  // Enough blocks to fill the GPU at the longest context, each with at least a tile per warp;
  // and splits of at most kAttnMaxSplitKeys keys, so that one long sequence among a batch's
  // short ones (which fill the GPU without splits) does not keep a block for its whole cache.
  // GGRAPH_CUDA_ATTN_BLOCKS sets the target for measuring.
  static const int target =
      env_int("GGRAPH_CUDA_ATTN_BLOCKS", 1, std::numeric_limits<int>::max(), kAttnTargetBlocks);
  const int fill = (target + kv_blocks - 1) / kv_blocks;
  const int least = (max_keys + kAttnMaxSplitKeys - 1) / kAttnMaxSplitKeys;
  const int most = (max_keys + split_keys - 1) / split_keys;
  return std::max(1, std::min({kMaxAttnSplits, std::max(fill, least), most}));
}

size_t attn_partials_bytes(int n_head, int head_dim, int n_tokens, bool seqs) {
  if (n_tokens > kDecodeAttnMaxTokens && !seqs) return 0;
  return static_cast<size_t>(n_head) * n_tokens * kMaxAttnSplits * (head_dim + 2) * sizeof(float);
}

size_t attn_counters_bytes(int n_head, int n_tokens, bool seqs) {
  if (n_tokens > kDecodeAttnMaxTokens && !seqs) return 0;
  return static_cast<size_t>(n_head) * n_tokens * sizeof(unsigned);
}

namespace {

constexpr int kAttnWarps = 4;
constexpr int kDecodeGroup = 8;  // at most this many query heads per block share a KV head
constexpr float kNegInf = -INFINITY;

// The times of a decode attention's phases, in measurement builds (GGRAPH_CUDA_ATTN_TRACE, a
// CMake option): thread 0 of each block of the first KV head and token reads %globaltimer at the
// kernel's start (0), after the wait for the kernel before (1), when its first K tile has landed
// (2), after its keys (3), after the warps' records (4), at three points of the merge (5-7: the
// ticket's partials written, its ticket won, the weights in shared memory; the cluster's barrier
// wait passed, its stores made, its cluster barrier passed; 0 where a block does not get there)
// and at its end (8), in steps whose key count is 4 past a multiple of 64 (68 keys: three warps
// of a short context's block), and prints a line
// "ATT keys cluster split n_used sm t0..t8". tools/attn_trace.py summarizes them per launch.
// Other builds compile it to nothing.
struct AttnTrace {
#ifdef GGRAPH_CUDA_ATTN_TRACE
  int n_kv;
  bool on;
  unsigned long long t[9] = {};
  __device__ explicit AttnTrace(int keys)
      : n_kv(keys), on((keys & 63) == 4 && blockIdx.x == 0 && blockIdx.z == 0 && threadIdx.x == 0) {
    stamp(0);
  }
  __device__ void stamp(int i) {
    if (on) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t[i]));
  }
  __device__ void print(bool cluster, int n_used) {
    if (!on) return;
    stamp(8);
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    printf("ATT %d %d %d %d %u %llu %llu %llu %llu %llu %llu %llu %llu %llu\n", n_kv,
           cluster ? 1 : 0, static_cast<int>(blockIdx.y), n_used, sm, t[0], t[1], t[2], t[3], t[4],
           t[5], t[6], t[7], t[8]);
  }
#else
  __device__ explicit AttnTrace(int) {}
  __device__ void stamp(int) {}
  __device__ void print(bool, int) {}
#endif
};

// Stamp i of a block's trace, where the caller passes one (measurement builds).
__device__ __forceinline__ void trace_stamp(AttnTrace* trace, int i) {
  if (trace) trace->stamp(i);
}

// A KV-position value: from the step's KV record in graph steps (the kernel's arguments then stay
// the same from step to step), by value in launches outside one.
__device__ __forceinline__ int kv_value(const int32_t* at, int by_value) {
  return at ? *at : by_value;
}

// Online-softmax merge of a tile's scores into (m, l); returns the rescale factor for acc and
// sets p to the tile's probabilities relative to the new maximum.
__device__ __forceinline__ float softmax_step(float s, bool valid, float& m, float& l, float& p) {
  const float tile_max = warp_max(valid ? s : kNegInf);
  const float m_new = fmaxf(m, tile_max);
  if (m_new == kNegInf) {  // nothing valid yet
    p = 0.0f;
    return 1.0f;
  }
  p = valid ? expf(s - m_new) : 0.0f;
  const float alpha = m == kNegInf ? 0.0f : expf(m - m_new);
  l = l * alpha + warp_sum(p);
  m = m_new;
  return alpha;
}

// ---- Flash-decoding -------------------------------------------------------------------------
//
// Block (kv head group chunk, split, token): up to G query heads that share one KV head, keys
// [split start, split end) of the causal range. Each lane owns DPL consecutive dimensions of a
// head (head_dim <= 32 * DPL) in every phase. A warp takes TILE keys at a time: it stages their
// K and V rows in shared memory with asynchronous copies issued together (each lane copies and
// later reads only its own dimensions), scores 8 keys at a time (a lane's partial dot products,
// summed over the warp by a transposing reduction: 9 shuffles for 8 keys), runs the online
// softmax with lane j on key j, and accumulates P*V on its own dimensions. Only the innermost
// loops unroll, so the code stays small. The warps are merged in shared memory. At short
// contexts the launch is a few warps' dependent sequences: their length is its latency, which
// is why wide heads take short tiles over more warps (decode_tile, decode_warps).
//
// The grid has n_splits splits, a function of the cache size alone; of them, the step uses as
// many as its keys fill with decode_split_keys each (the others return at once). With one in use
// the block writes the normalized output; otherwise each writes (m, l, acc) partials and the
// last of a head group's splits to finish (a ticket counter, left at zero again) merges them.
// So the launch is the same at every depth, and there is no second kernel.

// Output element i of the attention, and its half and 8-bit forms where asked (the 8-bit one
// needs whole warps over 32 outputs of one quant block; in column tiles where tiles_k is the
// output's row length, q8_index).
__device__ __forceinline__ void emit_attn_out(float v, int64_t i, float* out, __half* out_h,
                                              int8_t* out_q, float2* out_d, int64_t tiles_k) {
  out[i] = v;
  if (out_h) out_h[i] = __float2half_rn(v);
  if (out_q) quantize_warp_block(v, q8_index(i, tiles_k), out_q, out_d);
}

// Parts (m, l, acc) of online softmaxes over parts of the keys, part(s) giving part s's (a
// float3) for s < n <= N, combined: the maximum mm, the sum ll and the value a, both scaled to mm
// (all zero where no part had keys). Every part's loads go out before any is used.
template <int N, typename Part>
__device__ __forceinline__ void merge_parts(Part part, int n, float& mm, float& ll, float& a) {
  float ms[N], ls[N], as[N];
#pragma unroll
  for (int s = 0; s < N; ++s) {
    ms[s] = kNegInf, ls[s] = as[s] = 0.0f;
    if (s < n) {
      const float3 r = part(s);
      ms[s] = r.x, ls[s] = r.y, as[s] = r.z;
    }
  }
  mm = kNegInf;
#pragma unroll
  for (int s = 0; s < N; ++s) mm = fmaxf(mm, ms[s]);
  ll = 0.0f, a = 0.0f;
  if (mm == kNegInf) return;
#pragma unroll
  for (int s = 0; s < N; ++s) {
    const float e = ms[s] == kNegInf ? 0.0f : expf(ms[s] - mm);
    ll += ls[s] * e;
    a += as[s] * e;
  }
}

// merge_parts over records [m, l, acc...], record(s) giving part s's, at dimension d.
template <int N, typename Record>
__device__ __forceinline__ void merge_records(Record record, int n, int d, float& mm, float& ll,
                                              float& a) {
  merge_parts<N>(
      [&](int s) {
        const float* r = record(s);
        return make_float3(r[0], r[1], r[2 + d]);
      },
      n, mm, ll, a);
}

// The warps' records ([kWarps][G][rec]) of head g combined at dimension d (merge_records), of
// which only the first n_w (at least 1) hold keys: the others' (m = -inf, l = 0, acc = 0) add
// nothing, so a block over a short range merges only the warps that read it (one warp's record is
// the result as it stands; at the SmolLM2 shape's short contexts the cluster kernel's block of 16
// warps has one or two with keys).
template <int kWarps, int G>
__device__ __forceinline__ void combine_warps(const float* merge, int rec, int g, int d, int n_w,
                                              float& mm, float& ll, float& a) {
  auto record = [&](int w) { return merge + (w * G + g) * rec; };
  if (n_w <= 1) {
    const float* r = record(0);
    mm = r[0], ll = r[1], a = r[2 + d];
    return;
  }
  if constexpr (kWarps > 2) {
    if (n_w <= 2) return merge_records<2>(record, n_w, d, mm, ll, a);
  }
  if constexpr (kWarps > 4) {
    if (n_w <= 4) return merge_records<4>(record, n_w, d, mm, ll, a);
  }
  merge_records<kWarps>(record, n_w, d, mm, ll, a);
}

// Warps of a flash-decoding block that read keys of [k_begin, k_end), tile keys a warp in turn
// (at least 1, for the merge).
__device__ __forceinline__ int warps_with_keys(int k_begin, int k_end, int tile, int warps) {
  return max(1, min(warps, (k_end - k_begin + tile - 1) / tile));
}

// Where a flash-decoding launch of n_splits splits keeps its splits' partials in part: first every
// split's values, head_dim floats a split ([token][head][split][head_dim], so that a warp's 32
// values of a split are whole sectors for the merge's loads), then every split's (m, l)
// ([token][head][split], a head's side by side). gridDim.z is the launch's tokens.
struct SplitPartials {
  float* values;
  float2* states;
  int n_head, n_splits, head_dim;
  __device__ SplitPartials(float* part, int n_head_, int n_splits_, int head_dim_)
      : values(part),
        states(reinterpret_cast<float2*>(part + static_cast<int64_t>(gridDim.z) * n_head_ *
                                                    n_splits_ * head_dim_)),
        n_head(n_head_),
        n_splits(n_splits_),
        head_dim(head_dim_) {}
  // Split 0's index of head h of token t; split s's is s past it.
  __device__ int64_t first(int t, int h) const {
    return (static_cast<int64_t>(t) * n_head + h) * n_splits;
  }
  __device__ float* value(int t, int h, int s) const {
    return values + (first(t, h) + s) * head_dim;
  }
  __device__ float2* state(int t, int h, int s) const { return states + first(t, h) + s; }
};

// Merges splits [0, n_used) of the partials of heads [h_first, h_first + n_g) of token t into
// out (and its 8-bit form). Partials are read through L2: other blocks wrote them. Two steps,
// each issuing its loads together rather than one split after another: a warp a head reads its
// splits' (m, l), two a lane, and leaves their weights exp(m - max) / sum(l exp(m - max)) in
// shared memory (smem: n_g * kMaxAttnSplits floats); then each output element sums its splits'
// values with those weights. Called by the whole block.
template <int kChunk>
__device__ void attn_merge_splits(float* part, float* out, int n_head, int head_dim, int t,
                                  int h_first, int n_g, int n_splits, int n_used, int8_t* out_q,
                                  float2* out_d, int64_t tiles_k, __half* out_h, float* smem,
                                  AttnTrace* trace = nullptr) {
  static_assert(kMaxAttnSplits <= 64, "two splits a lane in the weights' step");
  const SplitPartials sp(part, n_head, n_splits, head_dim);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int g = warp; g < n_g; g += blockDim.x / 32) {
    const float2* r = sp.state(t, h_first + g, 0);
    const bool on0 = lane < n_used, on1 = lane + 32 < n_used;
    const float2 s0 = on0 ? __ldcg(r + lane) : make_float2(kNegInf, 0.0f);
    const float2 s1 = on1 ? __ldcg(r + lane + 32) : make_float2(kNegInf, 0.0f);
    const float m0 = s0.x, m1 = s1.x, l0 = s0.y, l1 = s1.y;
    const float mm = warp_max(fmaxf(m0, m1));
    float e0 = 0.0f, e1 = 0.0f;
    if (mm != kNegInf) {
      e0 = m0 == kNegInf ? 0.0f : expf(m0 - mm);
      e1 = m1 == kNegInf ? 0.0f : expf(m1 - mm);
    }
    const float ll = warp_sum(l0 * e0 + l1 * e1);
    const float inv = ll > 0.0f ? 1.0f / ll : 0.0f;
    float* w = smem + g * kMaxAttnSplits;
    if (on0) w[lane] = e0 * inv;
    if (on1) w[lane + 32] = e1 * inv;
  }
  __syncthreads();
  trace_stamp(trace, 7);
  // A thread's two outputs idx and idx + blockDim.x take their splits' values kChunk at a time,
  // every load of a chunk in flight together (a chunk is one trip to L2 whatever n_used is).
  const int n_out = n_g * head_dim;
  auto values_of = [&](int idx) {  // output idx's value in split 0
    return sp.value(t, h_first + idx / head_dim, 0) + idx % head_dim;
  };
  for (int idx0 = threadIdx.x; idx0 < n_out; idx0 += 2 * blockDim.x) {
    const int idx1 = idx0 + blockDim.x;
    const bool has1 = idx1 < n_out;  // the same in every lane of a warp (head_dim % 32 == 0)
    const float* r0 = values_of(idx0);
    const float* r1 = values_of(has1 ? idx1 : idx0);
    const float* w0 = smem + idx0 / head_dim * kMaxAttnSplits;
    const float* w1 = smem + (has1 ? idx1 : idx0) / head_dim * kMaxAttnSplits;
    float a0 = 0.0f, a1 = 0.0f;
    for (int s0 = 0; s0 < n_used; s0 += kChunk) {
      float v0[kChunk], v1[kChunk];
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
        const bool on = s0 + j < n_used;
        v0[j] = on ? __ldcg(r0 + (s0 + j) * head_dim) : 0.0f;
        v1[j] = on && has1 ? __ldcg(r1 + (s0 + j) * head_dim) : 0.0f;
      }
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
        if (s0 + j < n_used) {
          a0 += v0[j] * w0[s0 + j];
          a1 += v1[j] * w1[s0 + j];
        }
      }
    }
    const int64_t o = (static_cast<int64_t>(t) * n_head + h_first) * head_dim;
    emit_attn_out(a0, o + idx0, out, out_h, out_q, out_d, tiles_k);
    if (has1) emit_attn_out(a1, o + idx1, out, out_h, out_q, out_d, tiles_k);
  }
}

// The end of a flash-decoding block, once each warp has left (m, l, acc) of the block's heads in
// merge ([kWarps][G][head_dim + 2], m in the natural base; a warp without keys leaves m = -inf;
// warps n_w on have none) and the block has passed a barrier: threads combine the warps per element
// and write the output (one split in use) or the split's partials, and the last of the head group's
// splits to finish (a ticket counter, left at zero again) merges them all. smem: room for
// attn_merge_splits.
template <int kWarps, int G, int kChunk>
__device__ void decode_block_finish(const float* merge, int n_w, int t, int h_first, int n_g,
                                    int head_dim, int n_head, int split, int n_splits, int n_used,
                                    float* out, __half* out_h, int8_t* out_q, float2* out_d,
                                    int64_t tiles_k, float* part, unsigned* counters, float* smem,
                                    AttnTrace* trace = nullptr) {
  const int rec = head_dim + 2;
  const SplitPartials sp(part, n_head, n_splits, head_dim);
  for (int idx = threadIdx.x; idx < n_g * head_dim; idx += blockDim.x) {
    const int g = idx / head_dim, d = idx % head_dim;
    float mm, ll, a;
    combine_warps<kWarps, G>(merge, rec, g, d, n_w, mm, ll, a);
    const int h = h_first + g;
    if (n_used == 1) {
      emit_attn_out(ll > 0.0f ? a / ll : 0.0f,
                    (static_cast<int64_t>(t) * n_head + h) * head_dim + d, out, out_h, out_q, out_d,
                    tiles_k);
    } else {
      sp.value(t, h, split)[d] = a;
      if (d == 0) *sp.state(t, h, split) = make_float2(mm, ll);
    }
  }
  if (n_used == 1) return;
  trace_stamp(trace, 5);
  if (!last_block_ticket(counters + static_cast<int64_t>(t) * gridDim.x + blockIdx.x,
                         static_cast<unsigned>(n_used)))
    return;
  trace_stamp(trace, 6);
  attn_merge_splits<kChunk>(part, out, n_head, head_dim, t, h_first, n_g, n_splits, n_used, out_q,
                            out_d, tiles_k, out_h, smem, trace);
}

// The end of a block of a cluster whose C blocks are the splits of one head group (sm_90+). With
// one split in use its block combines the warps' records in merge and writes the output.
// Otherwise the outputs are dealt out in chunks of whole warps (32), one a block, and each block
// combines its warps' records and stores each output's (acc), and each head's (m, l), straight
// into the shared memory of the block that owns it (inbox: [C][G][2] (m, l), then [C][chunk]
// values); after one cluster barrier (which also makes the stores visible) each owner merges its
// outputs from its own shared memory. The stores wait for every block of the cluster to have
// started (the barrier's arrival at the kernel's start, decode_mma_body); no block reads another's
// memory, so none waits for the others before it leaves. Where the ticket's merge goes through L2
// four times (partials, fence, ticket, merge), this is one cluster barrier.
template <int kWarps, int G, int C>
__device__ void decode_cluster_finish(const float* merge, int n_w, float* inbox, int t, int h_first,
                                      int n_g, int head_dim, int n_head, int split, int n_used,
                                      float* out, __half* out_h, int8_t* out_q, float2* out_d,
                                      int64_t tiles_k, AttnTrace* trace = nullptr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const int rec = head_dim + 2, total = n_g * head_dim;
  auto emit = [&](int idx, float v) {
    emit_attn_out(v, (static_cast<int64_t>(t) * n_head + h_first) * head_dim + idx, out, out_h,
                  out_q, out_d, tiles_k);
  };
  if (n_used == 1) {
    for (int idx = threadIdx.x; idx < total; idx += blockDim.x) {
      float mm, ll, a;
      combine_warps<kWarps, G>(merge, rec, idx / head_dim, idx % head_dim, n_w, mm, ll, a);
      emit(idx, ll > 0.0f ? a / ll : 0.0f);
    }
    return;
  }
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  const int chunk = ((total + n_used - 1) / n_used + 31) / 32 * 32;
  float* in_ml = inbox;
  float* in_v = inbox + C * G * 2;
  cluster.barrier_wait();  // every block has started: its shared memory takes stores
  trace_stamp(trace, 5);
  // (Blocks past the splits in use store nothing: their slots lie past the inbox.)
  for (int idx = threadIdx.x; split < n_used && idx < total; idx += blockDim.x) {
    const int g = idx / head_dim, d = idx % head_dim;
    float mm, ll, a;
    combine_warps<kWarps, G>(merge, rec, g, d, n_w, mm, ll, a);
    const int owner = idx / chunk;
    cluster.map_shared_rank(in_v, owner)[split * chunk + idx - owner * chunk] = a;
    if (d == 0) {
      for (int o = 0; o < n_used; ++o) {
        float* r = cluster.map_shared_rank(in_ml, o) + (split * G + g) * 2;
        r[0] = mm, r[1] = ll;
      }
    }
  }
  trace_stamp(trace, 6);
  cluster.sync();
  trace_stamp(trace, 7);
  const int end = min(total, (split + 1) * chunk);
  for (int idx = split * chunk + threadIdx.x; idx < end; idx += blockDim.x) {
    const int g = idx / head_dim, p = idx - split * chunk;
    float mm, ll, a;
    merge_parts<C>(
        [&](int s) {
          const float* ml = in_ml + (s * G + g) * 2;
          return make_float3(ml[0], ml[1], in_v[s * chunk + p]);
        },
        n_used, mm, ll, a);
    emit(idx, ll > 0.0f ? a / ll : 0.0f);
  }
#endif
}

// A lane's DPL dimensions of a K or V row.
template <int DPL>
struct alignas(2 * DPL) LaneHalves {
  __half2 h[DPL / 2];
};

template <int DPL>
__device__ __forceinline__ void unpack_lane(const LaneHalves<DPL>& r, float (&f)[DPL]) {
#pragma unroll
  for (int e = 0; e < DPL / 2; ++e) {
    const float2 v = __half22float2(r.h[e]);
    f[2 * e] = v.x, f[2 * e + 1] = v.y;
  }
}

// A Q8_0 cache row: 34-byte blocks (an F16 scale, 32 int8 quants); a head of head_dim values
// (a multiple of 64) is 17 * head_dim / 16 bytes, a whole number of 4-byte words, and starts on
// one, so that it is staged with 4-byte asynchronous copies.
__host__ __device__ constexpr int q8_head_bytes(int head_dim) { return head_dim / 32 * 34; }
// A staged Q8_0 head's row in the decode kernel's raw area. At 128 dims (136 bytes, so that every
// other head starts 8 bytes into a 16-byte unit) a row is copied in nine 16-byte units from the
// unit its head starts in, where the cache's rows allow: 144 bytes.
__host__ __device__ constexpr int q8_staged_row_bytes(int head_dim) {
  return head_dim == 128 ? 144 : q8_head_bytes(head_dim);
}

// A staged Q8_0 block (34 bytes at 2-byte alignment) as 32 halves at dst (16-byte aligned): each
// quant times the scale rounded to half once, as the float product would be. A pair of quants
// becomes the half pair 1024 + 128 + q (q's byte, its sign bit flipped, under the exponent's
// bits 0x64) by a byte permute, less 1152 (exact), times the scale: four instructions a pair,
// where two int-to-float conversions (a quarter of the float units' rate) cost more.
__device__ __forceinline__ void decode_q8_block_to_half(const uint8_t* blk, __half* dst) {
  const __half d = *reinterpret_cast<const __half*>(blk);
  const __half2 d2 = __halves2half2(d, d);
  const __half2 bias = __float2half2_rn(1152.0f);
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(blk + 2);
  uint32_t o[16];
#pragma unroll
  for (int e = 0; e < 16; ++e) {
    const uint32_t w = __byte_perm(static_cast<uint32_t>(qp[e]) ^ 0x8080u, 0x64u, 0x4140);
    const __half2 v = __hmul2(__hsub2(*reinterpret_cast<const __half2*>(&w), bias), d2);
    o[e] = *reinterpret_cast<const uint32_t*>(&v);
  }
#pragma unroll
  for (int c = 0; c < 4; ++c)
    reinterpret_cast<uint4*>(dst)[c] =
        make_uint4(o[4 * c], o[4 * c + 1], o[4 * c + 2], o[4 * c + 3]);
}

// A lane's DPL quants of a staged Q8_0 head (its dims lie in one block) as floats, and their
// block's scale: the values are scale * f. Zeros for lanes past head_dim, whose bytes are not
// the head's. A quant q becomes the float bits of 2^23 + 128 + q (q's byte, its sign bit
// flipped, under the exponent's bytes) less 2^23 + 128: exact, and a byte permute and an add on
// the float units, where the conversion instruction runs at a quarter of their rate.
template <int DPL>
__device__ __forceinline__ float unpack_lane_q8(const uint8_t* head, int lane, bool lane_on,
                                                float (&f)[DPL]) {
  const int b = lane * DPL / 32, j = lane * DPL % 32;
  const float d = lane_on ? __half2float(*reinterpret_cast<const __half*>(head + b * 34)) : 0.0f;
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(head + b * 34 + 2 + j);
#pragma unroll
  for (int e = 0; e < DPL / 2; ++e) {
    const uint32_t w = (lane_on ? qp[e] : 0u) ^ 0x8080u;
    f[2 * e] = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7540)) - 8388736.0f;
    f[2 * e + 1] = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7541)) - 8388736.0f;
  }
  return d;
}

// Keys a warp stages at once (TILE rows of K and of V), and warps a block: 64 KiB of staging a
// block at every head size. Heads wider than 128 take 8 keys a warp and 8 warps: a short context
// is then split over twice the warps, each with half the dependent work.
template <int DPL>
constexpr int decode_tile() {
  return DPL == 8 ? 8 : 32;
}
template <int DPL>
constexpr int decode_warps() {
  return DPL == 8 ? 8 : kAttnWarps;
}

// Keys a split takes at the least: a tile for each warp, and no fewer than kAttnMinSplitKeys
// where the tiles are long enough.
template <int DPL, int TILE = decode_tile<DPL>()>
constexpr int decode_split_keys() {
  constexpr int kPass = decode_warps<DPL>() * TILE;
  return kPass < kAttnMinSplitKeys ? kPass : kAttnMinSplitKeys;
}

template <int DPL, int G, int TILE = decode_tile<DPL>()>
constexpr size_t decode_smem_bytes(int head_dim) {
  const size_t staging =
      decode_warps<DPL>() * (2 * TILE * 32 * sizeof(LaneHalves<DPL>) + G * TILE * sizeof(float));
  const size_t merge = decode_warps<DPL>() * G * (head_dim + 2) * sizeof(float);
  const size_t splits = G * kMaxAttnSplits * sizeof(float);  // attn_merge_splits
  return std::max({staging, merge, splits});
}

// v[k] summed over the warp, for k = lane / 4: three exchanges halve the keys a lane holds, two
// more finish the sum over the lanes left. Nine shuffles for eight sums.
__device__ __forceinline__ float warp_sum8_transposed(const float (&v)[8], int lane) {
  float a[4], b[2];
  const bool hi4 = lane & 16, hi3 = lane & 8, hi2 = lane & 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float send = hi4 ? v[i] : v[i + 4];
    a[i] = (hi4 ? v[i + 4] : v[i]) + __shfl_xor_sync(0xffffffffu, send, 16);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float send = hi3 ? a[i] : a[i + 2];
    b[i] = (hi3 ? a[i + 2] : a[i]) + __shfl_xor_sync(0xffffffffu, send, 8);
  }
  float c = (hi2 ? b[1] : b[0]) + __shfl_xor_sync(0xffffffffu, hi2 ? b[0] : b[1], 4);
  c += __shfl_xor_sync(0xffffffffu, c, 2);
  return c + __shfl_xor_sync(0xffffffffu, c, 1);
}

// Where a flash-decoding block of G query heads works: its token t = blockIdx.z's cache (a
// sequence of its own under slots: its rows in the pools, at row_size bytes a cache row, rebasing
// kc and vc, and its position as the only query's), the splits its keys fill with split_keys
// each, its heads and its split's keys [k_begin, k_end). Keys [lo, lim) are the token's; with a
// window, the splits divide the keys any token of the batch reads, from range_begin on, and rows
// before lo are never read. A padding token (sequence -1) attends to the first row of sequence 0;
// its output goes unused.
struct DecodeSpan {
  int n_used;             // splits in use (blocks past them have nothing to do)
  int h_first, n_g, hkv;  // the block's query heads and their KV head
  int k_begin, k_end;     // the split's keys
  int first_new;  // the first position of the token's sequence this step writes (rows before
                  // it are older)
};
__device__ __forceinline__ DecodeSpan decode_span(int G, int split_keys, int n_splits,
                                                  int n_gchunks, int n_head, int n_head_kv,
                                                  int64_t row_size, int window, int cache_rows,
                                                  const int32_t* slots, const int32_t* n_kv_at,
                                                  int n_kv_value, const int32_t* first_pos_at,
                                                  int first_pos_value, const void*& kc,
                                                  const void*& vc, bool spread = false) {
  const int t = blockIdx.z;
  int n_kv = kv_value(n_kv_at, n_kv_value);
  int first_pos = kv_value(first_pos_at, first_pos_value);
  int t_pos = t;  // the query's offset from first_pos
  int first_new = first_pos;
  if (slots) {
    const bool pad = slots[t] < 0;
    const int pos = pad ? 0 : slots[gridDim.z + t];
    n_kv = pos + 1;
    first_pos = first_new = pos;
    t_pos = 0;
    // A sequence may have several tokens in the batch (a prompt's chunk beside others' tokens):
    // its rows from the first of them on are this step's, written by the kernel just before.
    // (The slots are copied in before the graph runs: read before the wait.)
    if (!pad)
      for (int u = 0; u < static_cast<int>(gridDim.z); ++u)
        if (slots[u] == slots[t]) first_new = min(first_new, slots[gridDim.z + u]);
    const int64_t rows_before = pad ? 0 : static_cast<int64_t>(slots[t]) * cache_rows;
    kc = static_cast<const uint8_t*>(kc) + rows_before * row_size;
    vc = static_cast<const uint8_t*>(vc) + rows_before * row_size;
  }
  DecodeSpan sp;
  const int range_begin = window > 0 ? max(0, first_pos + 1 - window) : 0;
  const int range = n_kv - range_begin;
  sp.n_used = max(1, min(n_splits, (range + split_keys - 1) / split_keys));
  // spread (a cluster's splits): a range past one split's keys goes to all of them, fewer tiles
  // an SM, since the cluster's merge costs the same however many of its blocks read keys (the
  // SmolLM2 shape past 2,048 keys: 9.15 us a layer against 9.65 on half the blocks).
  if (spread && range > split_keys) sp.n_used = n_splits;
  const int group = n_head / n_head_kv;
  sp.hkv = blockIdx.x / n_gchunks;
  sp.h_first = sp.hkv * group + (blockIdx.x % n_gchunks) * G;
  sp.n_g = min(G, sp.hkv * group + group - sp.h_first);
  const int lim = min(n_kv, first_pos + t_pos + 1);
  const int lo = window > 0 ? max(0, first_pos + t_pos + 1 - window) : 0;
  const int split_len = ((range + sp.n_used - 1) / sp.n_used + 31) / 32 * 32;  // whole tiles
  sp.k_begin = max(lo, range_begin + static_cast<int>(blockIdx.y) * split_len);
  sp.k_end = min(range_begin + (static_cast<int>(blockIdx.y) + 1) * split_len, lim);
  sp.first_new = first_new;
  return sp;
}

// Q8: the caches hold Q8_0 blocks; a warp stages a tile's head bytes in 8- or 4-byte units, at
// the same row pitch as the F16 lanes' values (which is larger), and lanes decode their values,
// their block's scale applied once to each key's partial score and to each probability.
template <int DPL, int G, bool Q8, int TILE = decode_tile<DPL>()>
__global__ void __launch_bounds__(decode_warps<DPL>() * 32)
    attn_decode_kernel(const float* q, const void* kc, const void* vc, float* out, float* part,
                       int n_head, int n_head_kv, int head_dim, float scale, int n_kv_value,
                       int first_pos_value, const int32_t* n_kv_at, const int32_t* first_pos_at,
                       int n_splits, int n_gchunks, int8_t* out_q, float2* out_d, int64_t tiles_k,
                       __half* out_h, int window, unsigned* counters, int cache_rows,
                       const int32_t* slots) {
  constexpr int kWarps = decode_warps<DPL>();
  // The scores run 8 keys at a time up to a multiple of 8 past a tile's valid rows, which the
  // staging may leave stale: those keys' scores stay in their own slots (the transposed sums
  // add one key's lanes only) and are masked before the softmax and P*V read any.
  static_assert(TILE % 8 == 0, "the score loop's groups of 8 end within the tile");
  using Lane = LaneHalves<DPL>;
  pdl_begin();
  extern __shared__ __align__(16) uint8_t smem_raw[];
  const int t = blockIdx.z;
  const DecodeSpan sp = decode_span(
      G, decode_split_keys<DPL, TILE>(), n_splits, n_gchunks, n_head, n_head_kv,
      Q8 ? static_cast<int64_t>(n_head_kv) * q8_head_bytes(head_dim)
         : static_cast<int64_t>(n_head_kv) * head_dim * 2,
      window, cache_rows, slots, n_kv_at, n_kv_value, first_pos_at, first_pos_value, kc, vc);
  const int n_used = sp.n_used, split = blockIdx.y;
  if (split >= n_used) return;
  const int h_first = sp.h_first, n_g = sp.n_g, hkv = sp.hkv;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t kv_stride = static_cast<int64_t>(n_head_kv) * head_dim;
  const int64_t q_stride = static_cast<int64_t>(n_head) * head_dim;
  const bool lane_on = lane * DPL < head_dim;

  // The lane's dimensions of each head's query, pre-scaled (zero for absent heads).
  float qv[G][DPL];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const float* qh = q + t * q_stride + static_cast<int64_t>(h_first + g) * head_dim + lane * DPL;
#pragma unroll
    for (int e = 0; e < DPL; ++e) qv[g][e] = g < n_g && lane_on ? qh[e] * scale : 0.0f;
  }

  const int k_begin = sp.k_begin, k_end = sp.k_end;

  float m[G], l[G], acc[G][DPL];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = kNegInf;
    l[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < DPL; ++e) acc[g][e] = 0.0f;
  }

  Lane* ks = reinterpret_cast<Lane*>(smem_raw) + warp * 2 * TILE * 32;  // [TILE][32 lanes]
  Lane* vs = ks + TILE * 32;
  float* ps = reinterpret_cast<float*>(reinterpret_cast<Lane*>(smem_raw) + kWarps * 2 * TILE * 32) +
              warp * G * TILE;  // [G][TILE]: scores, then probabilities
  // The head's bytes in each cache row (F16: head_dim halves; Q8: its Q8_0 blocks), where they
  // start, and the rows' bytes; a staged row is those bytes in order, kRowPitch apart, so that
  // lane l's F16 values are a Lane at l.
  constexpr int kRowPitch = 32 * static_cast<int>(sizeof(Lane));
  const int head_bytes = Q8 ? q8_head_bytes(head_dim) : head_dim * 2;
  const int row_bytes = static_cast<int>(Q8 ? kv_stride / 32 * 34 : kv_stride * 2);
  const uint8_t* k_head = static_cast<const uint8_t*>(kc) + static_cast<int64_t>(hkv) * head_bytes;
  const uint8_t* v_head = static_cast<const uint8_t*>(vc) + static_cast<int64_t>(hkv) * head_bytes;
  // A staged row's lane values, unscaled, and the scale they take (Q8: the block's; F16: one,
  // which multiplies exactly). Zeros for lanes past head_dim, whose bytes are not the head's.
  auto unpack = [&](const Lane* rows, int r, float(&f)[DPL]) {
    if constexpr (Q8) {
      return unpack_lane_q8<DPL>(reinterpret_cast<const uint8_t*>(rows) + r * kRowPitch, lane,
                                 lane_on, f);
    } else {
      unpack_lane<DPL>(rows[r * 32 + lane], f);
#pragma unroll
      for (int e = 0; e < DPL; ++e) f[e] = lane_on ? f[e] : 0.0f;
      return 1.0f;
    }
  };
  // A warp copies a tile's head bytes as one run of wide units where the heads' bytes and the
  // caches allow (F16: 16 bytes, head_dim a multiple of 8; Q8: 8 bytes, head_dim a multiple of
  // 128), else 4-byte ones, each lane 32 units after the last: at 128 dims an F16 row is 16 units,
  // two rows a copy instruction, where a lane a row took twice the copies and their addresses.
  constexpr int kWide = Q8 ? 8 : 16;
  const bool wide =
      (head_bytes | row_bytes | reinterpret_cast<uintptr_t>(kc) | reinterpret_cast<uintptr_t>(vc)) %
          kWide ==
      0;

  for (int tile = k_begin + warp * TILE; tile < k_end; tile += kWarps * TILE) {
    const int n_valid = min(TILE, k_end - tile);
    const int row0 = ring_row(tile, cache_rows);  // the tile's rows follow it (ring_row_after)
    auto stage = [&](Lane* dst, const uint8_t* head) {
      uint8_t* d = reinterpret_cast<uint8_t*>(dst);
      auto copy_units = [&](auto unit) {
        constexpr int U = decltype(unit)::value;
        const int units = head_bytes / U;  // a row's
        if (32 % units == 0 && cache_rows >= TILE) {
          // Whole rows a copy instruction (F16 heads of 64, 128 or 256 dims): a lane copies unit
          // u of rows r, r + step_r, ..., an address add each; rows from the ring's end on lie at
          // its start. Rows past the tile's valid ones are left as they are: their scores are
          // masked and they enter no sum.
          const int step_r = 32 / units;
          int r = lane / units;
          const int u = lane - r * units;
          const int wrap_r = cache_rows - row0;
          const int64_t step = static_cast<int64_t>(step_r) * row_bytes;
          const int64_t ring = static_cast<int64_t>(cache_rows) * row_bytes;
          const uint8_t* src = head + (static_cast<int64_t>(row0) + r) * row_bytes + U * u;
          uint8_t* dst_u = d + r * kRowPitch + U * u;
          for (; r < n_valid; r += step_r, src += step, dst_u += step_r * kRowPitch)
            cp_async_n<U>(dst_u, r >= wrap_r ? src - ring : src, U);
          return;
        }
        const int step_r = 32 / units, step_u = 32 - step_r * units;
        int r = lane / units, u = lane - r * units;
        while (r < TILE) {
          const bool ok = r < n_valid;
          const uint8_t* row = head + static_cast<int64_t>(ring_row_after<TILE>(
                                          row0, tile, ok ? r : 0, cache_rows)) *
                                          row_bytes;
          cp_async_n<U>(d + r * kRowPitch + U * u, row + U * u, ok ? U : 0);
          r += step_r, u += step_u;
          if (u >= units) u -= units, ++r;
        }
      };
      if (wide) {
        copy_units(std::integral_constant<int, kWide>());
      } else {
        copy_units(std::integral_constant<int, 4>());
      }
      cp_async_commit();
    };
    stage(ks, k_head);
    stage(vs, v_head);
    cp_async_wait<1>();  // K has landed; V keeps coming during the scores
    // A lane reads bytes other lanes copied, visible to it once they have all waited.
    __syncwarp();

#pragma unroll 1
    for (int c = 0; c < n_valid; c += 8) {
      float dot[G][8];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        float kf[DPL];
        const float ks_scale = unpack(ks, c + k, kf);
#pragma unroll
        for (int g = 0; g < G; ++g) {
          float s = 0.0f;
#pragma unroll
          for (int e = 0; e < DPL; ++e) s += qv[g][e] * kf[e];
          dot[g][k] = s * ks_scale;
        }
      }
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float s = warp_sum8_transposed(dot[g], lane);
        if ((lane & 3) == 0) ps[g * TILE + c + lane / 4] = s;
      }
    }
    __syncwarp();
    const bool valid = lane < n_valid;
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float p;
      const float alpha = softmax_step(valid ? ps[g * TILE + lane] : 0.0f, valid, m[g], l[g], p);
#pragma unroll
      for (int e = 0; e < DPL; ++e) acc[g][e] *= alpha;
      if (valid) ps[g * TILE + lane] = p;
    }
    __syncwarp();
    cp_async_wait<0>();
    __syncwarp();
#pragma unroll 4
    for (int j = 0; j < n_valid; ++j) {
      float vf[DPL];
      const float vs_scale = unpack(vs, j, vf);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float pj = ps[g * TILE + j] * vs_scale;
#pragma unroll
        for (int e = 0; e < DPL; ++e) acc[g][e] += pj * vf[e];
      }
    }
    __syncwarp();  // the next tile's scores overwrite ps
  }

  // Merge the warps: each writes (m, l, acc) for its heads over the staging buffers, then
  // threads combine per element.
  __syncthreads();
  float* merge = reinterpret_cast<float*>(smem_raw);  // [warps][G][head_dim + 2]
  const int rec = head_dim + 2;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (g >= n_g) break;
    float* r = merge + (warp * G + g) * rec;
    if (lane == 0) r[0] = m[g], r[1] = l[g];
    if (lane_on) {
#pragma unroll
      for (int e = 0; e < DPL; ++e) r[2 + lane * DPL + e] = acc[g][e];
    }
  }
  __syncthreads();
  // 8 splits a trip: under the lanes' kernels' register caps 16 and 24 spilled in most of them
  // (at 8, the 256-dim kernel of one query head a KV head stores 8 bytes).
  decode_block_finish<kWarps, G, 8>(merge, warps_with_keys(k_begin, k_end, TILE, kWarps), t,
                                    h_first, n_g, head_dim, n_head, split, n_splits, n_used, out,
                                    out_h, out_q, out_d, tiles_k, part, counters,
                                    reinterpret_cast<float*>(smem_raw));
}

// ---- Fragment steps shared by the tensor-core kernels ---------------------------------------
//
// A warp's 16 rows of scores in NT m16n8 fragments of 8 keys (base 2), and its output in DT
// fragments of 8 dims; a lane holds rows g and g + 8 (g = lane / 4) of each.

// The online softmax of a tile's score fragments: each row's maximum over the quad's lanes, s
// turned into probabilities, l (this lane's share) and o rescaled.
template <int NT, int DT>
__device__ __forceinline__ void frag_softmax(float (&s)[NT][4], float (&m)[2], float (&l)[2],
                                             float (&o)[DT][4]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = m[r];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float base = mx == kNegInf ? 0.0f : mx;  // a row with nothing valid yet
    const float alpha = exp2f(m[r] - base);
    m[r] = mx;
    float sum = 0.0f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      s[nt][2 * r] = exp2f(s[nt][2 * r] - base);
      s[nt][2 * r + 1] = exp2f(s[nt][2 * r + 1] - base);
      sum += s[nt][2 * r] + s[nt][2 * r + 1];
    }
    l[r] = l[r] * alpha + sum;  // this lane's share; the quad's sum at the end
#pragma unroll
    for (int i = 0; i < DT; ++i) o[i][2 * r] *= alpha, o[i][2 * r + 1] *= alpha;
  }
}

// o += P V over a tile: the probabilities as A fragments (two score fragments side by side are
// the A fragment of 16 keys), V's rows (P halves apart) as transposed B fragments from v, the
// lane's ldmatrix offset included. The probabilities are rounded to half, or with kSplit split
// into two halves each (split_half2) and multiplied twice, to within float rounding.
template <int P, bool kSplit = false, int NT, int DT>
__device__ __forceinline__ void frag_pv(const float (&s)[NT][4], const __half* v,
                                        float (&o)[DT][4]) {
#pragma unroll
  for (int kk = 0; kk < NT / 2; ++kk) {
    uint32_t a[4], lo[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float* f = s[2 * kk + e / 2] + 2 * (e % 2);
      if constexpr (kSplit)
        split_half2(f[0], f[1], a[e], lo[e]);
      else
        a[e] = pack_half2(f[0], f[1]);
    }
#pragma unroll
    for (int dp = 0; dp < DT / 2; ++dp) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, v + kk * 16 * P + dp * 16);
      mma_16816(o[2 * dp], a, b[0], b[1]);
      mma_16816(o[2 * dp + 1], a, b[2], b[3]);
      if constexpr (kSplit) {
        mma_16816(o[2 * dp], lo, b[0], b[1]);
        mma_16816(o[2 * dp + 1], lo, b[2], b[3]);
      }
    }
  }
}

// ---- Flash-decoding on tensor cores ---------------------------------------------------------
//
// Heads of 64, 128 or 256 dims take the same blocks, splits and merges as above, with each warp's
// tile scored and weighed by mma.sync instead of by lanes' dot products: the MMA's 16 rows are the
// query heads of one KV head (rows past them are zeros, never written out), its columns a tile's
// keys. q, pre-scaled by scale * log2(e), and the probabilities are each split into two halves
// (split_half2) and multiplied twice, so that a score and an output are the float products of the
// lanes' kernel up to the order of the sums (one half's 11 bits, as the prompt kernel takes them,
// left a relative error of a few 1e-4; the second MMAs cost no measured time). Over a Q8_0 cache,
// whose values are 8-bit, each enters as one half: the low halves' registers (26 of 246 at 128
// dims) and MMAs bought nothing the 8-bit values leave, and without them the 7B shape's decode at
// depth 4,096 ran 3.5% faster. K and V arrive as half (a Q8_0 tile is decoded to half in the warp's
// staging, as the prompt kernel decodes it). A warp stages a tile of K and of V with 16-byte
// asynchronous copies (rows past the tile's keys zero-filled: the P*V product reads every row),
// scores it while V lands, then runs the online softmax on the score fragments (a row's keys lie in
// the four lanes of a quad) and multiplies. Where a warp spent ~30 instructions a key on its lanes'
// dot products, conversions and transposing sums, a tile of 32 keys at 128 dims is 128 MMAs (q and
// P each taken as two halves; 64 over a Q8_0 cache) and 32 ldmatrix.

// W warps a block. CL: the block is one of a cluster of kAttnClusterSplits, which merge their
// splits through distributed shared memory (sm_90+), each block's combined (m, l, acc) left in
// its own shared memory after the warps' records.
template <int D, int W = 4, bool CL = false>
struct DecodeMma {
  static constexpr int kWarps = W;
  static constexpr int kRows = 16;                 // query heads a block: the MMA's rows
  static constexpr int kKeys = D > 128 ? 16 : 32;  // a warp's tile (the registers of D = 256)
  static constexpr int kPitch = D + 8;             // halves: ldmatrix rows in distinct banks
  static constexpr int kRawPitch = q8_staged_row_bytes(D);
  // q's low halves: in registers up to 128 dims, in shared memory (after the tiles) at 256,
  // whose registers hold the output's fragments.
  static constexpr bool kLowInRegs = D <= 128;
  static constexpr size_t tile_bytes(bool q8) {
    // F16: a K and a V tile a warp. Q8: one half tile a warp, which K's decode and then V's take
    // in turn, and K's and V's raw bytes in areas of their own, so that the next tile's bytes
    // are requested as soon as this tile's are decoded.
    return q8 ? kWarps * (kKeys * kPitch * sizeof(__half) + 2 * kKeys * kRawPitch)
              : kWarps * 2 * kKeys * kPitch * sizeof(__half);
  }
  static constexpr int split_keys() {
    return CL || kWarps * kKeys < kAttnMinSplitKeys ? kWarps * kKeys : kAttnMinSplitKeys;
  }
  static constexpr size_t merge_floats() { return static_cast<size_t>(kWarps) * kRows * (D + 2); }
  // CL: where the other blocks' stores for the merge land (decode_cluster_finish's inbox), past
  // the tiles and the records, which are still in use when they arrive.
  static constexpr size_t inbox_offset(bool q8) {
    const size_t tiles = tile_bytes(q8) + (kLowInRegs ? 0 : kRows * kPitch * sizeof(__half));
    return (std::max(tiles, merge_floats() * sizeof(float)) + 15) / 16 * 16;
  }
  static constexpr size_t inbox_floats() {
    return CL ? static_cast<size_t>(kAttnClusterSplits) * (2 * kRows + 32) + kRows * D : 0;
  }
  static constexpr size_t smem_bytes(bool q8) {
    return inbox_offset(q8) + inbox_floats() * sizeof(float);
  }
  static_assert(CL || merge_floats() >= static_cast<size_t>(kRows) * kMaxAttnSplits,
                "the merge area holds attn_merge_splits' weights too");
};
// The 4-warp kernel fits the 99 KiB blocks of sm_86 and sm_89 (16: its static shared memory).
static_assert(DecodeMma<64>::smem_bytes(true) + 16 <= (99 << 10) &&
                  DecodeMma<128>::smem_bytes(true) + 16 <= (99 << 10) &&
                  DecodeMma<256>::smem_bytes(true) + 16 <= (99 << 10),
              "decode tiles within 99 KiB blocks");

// Warps a block of the cluster kernel: one pass of a cluster's blocks covers 4,096 keys at 64
// dims, 2,048 at 128, 1,024 at 256, within the shared memory of one block an SM.
template <int D>
constexpr int cluster_warps() {
  return D == 64 ? 16 : 8;
}

#define GGRAPH_DECODE_MMA_PARAMS                                                        \
  const float *q, const void *kc, const void *vc, float *out, float *part, int n_head,  \
      int n_head_kv, int head_dim, float scale, int n_kv_value, int first_pos_value,    \
      const int32_t *n_kv_at, const int32_t *first_pos_at, int n_splits, int n_gchunks, \
      int8_t *out_q, float2 *out_d, int64_t tiles_k, __half *out_h, int window,         \
      unsigned *counters, int cache_rows, const int32_t *slots
#define GGRAPH_DECODE_MMA_ARGS                                                                    \
  q, kc, vc, out, part, n_head, n_head_kv, head_dim, scale, n_kv_value, first_pos_value, n_kv_at, \
      first_pos_at, n_splits, n_gchunks, out_q, out_d, tiles_k, out_h, window, counters,          \
      cache_rows, slots

template <int D, bool Q8, int W, bool CL>
__device__ __forceinline__ void decode_mma_body(GGRAPH_DECODE_MMA_PARAMS) {
  using S = DecodeMma<D, W, CL>;
  constexpr int BK = S::kKeys, P = S::kPitch, RP = S::kRawPitch, kWarps = S::kWarps;
  constexpr int G = S::kRows;
  constexpr int NT = BK / 8;  // score fragments of 8 keys
  constexpr int DT = D / 8;   // output fragments of 8 dims
  extern __shared__ __align__(16) uint8_t smem_raw[];
  const int t = blockIdx.z;
  constexpr int64_t kHeadBytes = Q8 ? q8_head_bytes(D) : D * 2;
  const int64_t row_bytes = n_head_kv * kHeadBytes;
  const DecodeSpan sp = decode_span(G, S::split_keys(), n_splits, n_gchunks, n_head, n_head_kv,
                                    row_bytes, window, cache_rows, slots, n_kv_at, n_kv_value,
                                    first_pos_at, first_pos_value, kc, vc, CL);
  const int n_used = sp.n_used, split = blockIdx.y;
  // A cluster's blocks past the splits in use read no keys, but take part in its barriers (all
  // of them, or none where one split suffices).
  if (split >= n_used && (!CL || n_used == 1)) return;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // The cluster's merge stores into other blocks' shared memory once all have started: each
  // arrives here and waits before its first store (decode_cluster_finish).
  if constexpr (CL) {
    if (n_used > 1) __cluster_barrier_arrive_relaxed();  // nothing to release yet
  }
#endif
  const int h_first = sp.h_first, n_g = sp.n_g, hkv = sp.hkv;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int k_begin = sp.k_begin, k_end = sp.k_end;

  // The warp's half tiles [BK][P]: F16, K's and V's; Q8, one that K's decode and then V's take.
  // Q8: K's and V's raw bytes [BK][RP] after every warp's half tile.
  __half* ks = reinterpret_cast<__half*>(smem_raw) + warp * (Q8 ? 1 : 2) * BK * P;
  __half* vs = Q8 ? ks : ks + BK * P;
  uint8_t* raw_k =
      reinterpret_cast<uint8_t*>(smem_raw) + kWarps * BK * P * sizeof(__half) + warp * 2 * BK * RP;
  uint8_t* raw = raw_k + BK * RP;  // Q8: V's
  const int g = lane / 4, tig = lane % 4;

  const uint8_t* k_head = static_cast<const uint8_t*>(kc) + hkv * kHeadBytes;
  const uint8_t* v_head = static_cast<const uint8_t*>(vc) + hkv * kHeadBytes;
  // Q8 at 128 dims, where the caches and their rows are 16-byte aligned: a tile's rows in
  // 16-byte units (which bypass L1, as the F16 tiles' do; 8-byte units can only go through it),
  // each row's nine from the unit its head starts in, lead bytes before it. The nine units end
  // within the row: its bytes are a 16-byte multiple, so its heads are an even number, and the
  // last one starts 8 bytes into a unit (lead 8) and ends with its ninth.
  const bool q8_wide =
      Q8 && D == 128 &&
      ((row_bytes | reinterpret_cast<uintptr_t>(kc) | reinterpret_cast<uintptr_t>(vc)) & 15) == 0;
  const int lead = q8_wide ? static_cast<int>((hkv * kHeadBytes) & 15) : 0;
  // A tile's rows [0, n_valid) from the cache, the rest zeros. F16: 16-byte units straight into
  // the half tile; Q8: the raw bytes in 16-byte units (q8_wide), else 8-byte units where the
  // rows allow, else 4-byte ones.
  auto stage = [&](int tile, int n_valid, int row0, const uint8_t* head, __half* dst,
                   uint8_t* raw_dst) {
    // A row's units from head on: a Q8 head's 136 bytes at 128 dims take nine of 16 bytes.
    auto copy = [&](auto unit, uint8_t* d, int pitch) {
      constexpr int U = decltype(unit)::value;
      constexpr int kUnits = (kHeadBytes + U - 1) / U;  // a row's
      // A whole tile that does not wrap: rows row0 on, without the tests. Q8 at 128 dims (17
      // units of 8 bytes a row, or 9 of 16): each row's first 16 (8) units in passes over two
      // (four) rows, a lane keeping its unit column and moving on by an add a pass, then the last
      // unit of each row, a lane each. A unit's row and column by division by 17 were a quarter of
      // the kernel's instructions (the 7B shape's 8-bit decode at depth 4,096: 9.0 M instructions
      // a launch, 6.8 M without; tg128 +1.3-1.6%). At 64 dims (4-byte units) the same form
      // measured below the division on the SmolLM2 shape, and at 256 dims it spilled registers:
      // both keep it.
      if constexpr (Q8 && D == 128 && U >= 8) {
        constexpr int kMain = kUnits - 1, kRowsPass = 32 / kMain;
        static_assert(BK == 32 && 32 % kMain == 0,
                      "passes over whole rows of all but the last unit, then a lane a row");
        if (n_valid == BK && cache_rows - row0 >= BK) {
          const uint8_t* base = head + static_cast<int64_t>(row0) * row_bytes;
          const uint8_t* src = base + (lane / kMain) * row_bytes + U * (lane % kMain);
          uint8_t* dst_u = d + (lane / kMain) * pitch + U * (lane % kMain);
#pragma unroll
          for (int r = 0; r < BK; r += kRowsPass, src += kRowsPass * row_bytes)
            cp_async_n<U>(dst_u + r * pitch, src, U);
          cp_async_n<U>(d + lane * pitch + U * kMain, base + lane * row_bytes + U * kMain, U);
          return;
        }
      } else if (n_valid == BK && cache_rows - row0 >= BK) {
        const uint8_t* base = head + static_cast<int64_t>(row0) * row_bytes;
        for (int i = lane; i < BK * kUnits; i += 32) {
          const int r = i / kUnits, u = i % kUnits;
          cp_async_n<U>(d + r * pitch + U * u, base + r * row_bytes + U * u, U);
        }
        return;
      }
      for (int i = lane; i < BK * kUnits; i += 32) {
        const int r = i / kUnits, u = i % kUnits;
        const bool ok = r < n_valid;
        const int64_t row = ok ? ring_row_after<BK>(row0, tile, r, cache_rows) : 0;
        cp_async_n<U>(d + r * pitch + U * u, head + row * row_bytes + U * u, ok ? U : 0);
      }
    };
    if (q8_wide) {
      if constexpr (D == 128) {
        head -= lead;  // from the unit the head starts in
        copy(std::integral_constant<int, 16>(), raw_dst, RP);
      }
    } else if constexpr (Q8 && kHeadBytes % 8 == 0) {
      if ((row_bytes | reinterpret_cast<uintptr_t>(kc) | reinterpret_cast<uintptr_t>(vc)) % 8 == 0)
        copy(std::integral_constant<int, 8>(), raw_dst, RP);
      else
        copy(std::integral_constant<int, 4>(), raw_dst, RP);
    } else if constexpr (Q8) {
      copy(std::integral_constant<int, 4>(), raw_dst, RP);
    } else if (cache_rows >= BK) {
      // A lane copies unit u of rows r, r + kStepR, ... with an address add each; rows from the
      // ring's end on lie at its start.
      constexpr int kUnits = D * 2 / 16, kStepR = 32 / kUnits;
      const int r0 = lane / kUnits, u = lane % kUnits;
      const int wrap_r = cache_rows - row0;
      const int64_t step = kStepR * row_bytes, ring = static_cast<int64_t>(cache_rows) * row_bytes;
      const uint8_t* src = head + (static_cast<int64_t>(row0) + r0) * row_bytes + 16 * u;
      uint8_t* d = reinterpret_cast<uint8_t*>(dst + r0 * P) + 16 * u;
      if (n_valid == BK && wrap_r >= BK) {
        // A whole tile that does not wrap (every tile but a split's last, outside ring caches):
        // an add and the copy a unit, where the tests and selects below cost 16 instructions.
#pragma unroll
        for (int r = r0; r < BK; r += kStepR, src += step) cp_async16(d + (r - r0) * P * 2, src);
      } else {
#pragma unroll
        for (int r = r0; r < BK; r += kStepR, src += step, d += kStepR * P * 2) {
          const bool ok = r < n_valid;
          cp_async16(d, ok ? (r >= wrap_r ? src - ring : src) : head, ok ? 16 : 0);
        }
      }
    } else {
      copy(std::integral_constant<int, 16>(), reinterpret_cast<uint8_t*>(dst), P * 2);
    }
    cp_async_commit();
  };
  // Q8: a landed raw tile decoded into the half tile, a block of 32 values a lane at a time.
  auto decode = [&](const uint8_t* raw_src, __half* dst) {
    if constexpr (Q8) {
      constexpr int nb = D / 32;
      for (int i = lane; i < BK * nb; i += 32) {
        const int r = i / nb, b = i % nb;
        decode_q8_block_to_half(raw_src + r * RP + lead + b * 34, dst + r * P + b * 32);
      }
      __syncwarp();
    }
  };

  float o[DT][4];
#pragma unroll
  for (int i = 0; i < DT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.0f, 0.0f};  // rows g and g + 8
  // Lane offsets of the ldmatrix row addresses, as the prompt kernel's: K (B), V (B transposed).
  const int k_off = (lane % 8 + lane / 16 * 8) * P + lane / 8 % 2 * 8;
  const int v_off = (lane % 8 + lane / 8 % 2 * 8) * P + lane / 16 * 8;

  // F16: the next tile's K is requested once the scores have read this one's, and its V once
  // P*V has, so that a warp always has a tile's K or V in flight (staged at the top of each
  // tile, a warp waited for each tile's K with nothing else to do). Q8: the next tile's raw K
  // is requested as soon as this tile's is decoded, and its raw V as soon as this tile's is, so
  // that a tile's bytes are on their way through every decode, score and product.
  constexpr int kTileStep = kWarps * BK;
  auto tile_stage = [&](int tile, const uint8_t* head, __half* dst, uint8_t* raw_dst) {
    stage(tile, min(BK, k_end - tile), ring_row(tile, cache_rows), head, dst, raw_dst);
  };
  // The kernel before this one (the q/k/v products, or the ropes and K/V stores) writes q and
  // this step's K and V rows; the rows before them are older, and the KV record and slots that
  // decode_span read above were written before that kernel started (DESIGN.md, invariants).
  // Where each warp of the split has one tile, a warp whose tile holds only older rows requests
  // it before waiting for that kernel, so that its trip to memory overlaps the kernel's end (the
  // SmolLM2 shape at depth 4,096: 1,588-1,592 tok/s against 1,409-1,527 on an H200). With more
  // tiles a warp (the 7B shape's splits of 512 keys) the first tile's early request measured
  // 1-3% slower, and waits as before.
  AttnTrace trace(kv_value(n_kv_at, n_kv_value));
  const int first_tile = k_begin + warp * BK;
  const bool first_early = k_end - k_begin <= kTileStep && first_tile < k_end &&
                           min(first_tile + BK, k_end) <= sp.first_new;
  if (first_early) {
    tile_stage(first_tile, k_head, ks, raw_k);
    tile_stage(first_tile, v_head, vs, raw);
  }
  pdl_begin();
  trace.stamp(1);
  // A first tile with this step's rows is requested before q's loads, so that the two trips to
  // memory overlap (the 7B shape's tg128 on an H200: 628-630 tok/s against 618-620).
  if (first_tile < k_end && !first_early) {
    tile_stage(first_tile, k_head, ks, raw_k);
    tile_stage(first_tile, v_head, vs, raw);
  }
  // The A fragments of q (rows: the block's heads; columns: dims), straight from global memory,
  // pre-scaled (scores in base 2) and split into high and low halves; rows past the heads are
  // zeros. At 256 dims the low halves go to shared memory ([16][P] after the tiles), where each
  // step of the scores reads them back as a fragment.
  // Q8: q and the probabilities as one half each (kSplit off): against 8-bit keys and values
  // their low halves add nothing the bound sees, and cost registers and MMAs.
  constexpr bool kSplit = !Q8;
  uint32_t qa[D / 16][4];
  uint32_t ql[kSplit && S::kLowInRegs ? D / 16 : 1][4];
  __half* q_low = reinterpret_cast<__half*>(smem_raw + S::tile_bytes(Q8));
  {
    const float q_scale = scale * 1.4426950408889634f;
    const float* qt = q + (static_cast<int64_t>(t) * n_head + h_first) * D + 2 * tig;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = g + 8 * (e & 1), col = kk * 16 + 8 * (e >> 1);
        float2 v = make_float2(0.0f, 0.0f);
        if (row < n_g) v = *reinterpret_cast<const float2*>(qt + row * D + col);
        if constexpr (!kSplit) {
          qa[kk][e] = pack_half2(v.x * q_scale, v.y * q_scale);
          continue;
        }
        uint32_t lo;
        split_half2(v.x * q_scale, v.y * q_scale, qa[kk][e], lo);
        if constexpr (S::kLowInRegs)
          ql[kk][e] = lo;
        else if (warp == 0)
          *reinterpret_cast<uint32_t*>(q_low + row * P + col + 2 * tig) = lo;
      }
    }
    if constexpr (kSplit && !S::kLowInRegs) __syncthreads();
  }
  const __half* q_low_frag = q_low + (lane % 8 + lane / 8 % 2 * 8) * P + lane / 16 * 8;
  for (int tile = first_tile; tile < k_end; tile += kTileStep) {
    const int n_valid = min(BK, k_end - tile);
    const bool more = tile + kTileStep < k_end;
    cp_async_wait<1>();  // K has landed; V keeps coming during the scores
    __syncwarp();
    if (tile == first_tile) trace.stamp(2);
    decode(raw_k, ks);  // Q8: ends with the warp's raw K read
    if (Q8 && more) tile_stage(tile + kTileStep, k_head, ks, raw_k);

    float s[NT][4];
#pragma unroll
    for (int i = 0; i < NT; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t lo[4];
      if constexpr (kSplit && S::kLowInRegs) {
#pragma unroll
        for (int e = 0; e < 4; ++e) lo[e] = ql[kk][e];
      } else if constexpr (kSplit) {
        ldmatrix_x4(lo, q_low_frag + kk * 16);
      }
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, ks + np * 16 * P + k_off + kk * 16);
        mma_16816(s[2 * np], qa[kk], b[0], b[1]);
        mma_16816(s[2 * np + 1], qa[kk], b[2], b[3]);
        if constexpr (kSplit) {
          mma_16816(s[2 * np], lo, b[0], b[1]);
          mma_16816(s[2 * np + 1], lo, b[2], b[3]);
        }
      }
    }
    if (n_valid < BK) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (nt * 8 + 2 * tig + (e & 1) >= n_valid) s[nt][e] = kNegInf;
      }
    }
    if (!Q8 && more) {
      __syncwarp();  // every lane's K fragments read
      tile_stage(tile + kTileStep, k_head, ks, raw_k);
    }
    frag_softmax(s, m, l, o);

    if (more)
      cp_async_wait<1>();  // this tile's V, with the next K still coming
    else
      cp_async_wait<0>();
    __syncwarp();  // Q8: also every lane's K fragments read before V's decode takes the tile
    decode(raw, vs);
    if (Q8 && more) tile_stage(tile + kTileStep, v_head, vs, raw);
    frag_pv<P, kSplit>(s, vs + v_off, o);
    __syncwarp();  // the tile fully read before the next one is staged or decoded over it
    if (!Q8 && more) tile_stage(tile + kTileStep, v_head, vs, raw);
  }

  // Each warp's records of its rows (m back in the natural base), then the block's end.
  trace.stamp(3);
  __syncthreads();
  float* merge = reinterpret_cast<float*>(smem_raw);  // [kWarps][G][D + 2]
  constexpr int rec = D + 2;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    const int row = g + 8 * r;
    if (row >= n_g) continue;
    float* rp = merge + (warp * G + row) * rec;
    if (tig == 0) rp[0] = m[r] == kNegInf ? kNegInf : m[r] * 0.6931471805599453f, rp[1] = l[r];
#pragma unroll
    for (int i = 0; i < DT; ++i)
      *reinterpret_cast<float2*>(rp + 2 + i * 8 + 2 * tig) =
          make_float2(o[i][2 * r], o[i][2 * r + 1]);
  }
  __syncthreads();
  const int n_w = warps_with_keys(k_begin, k_end, BK, kWarps);
  trace.stamp(4);
  if constexpr (CL) {
    decode_cluster_finish<kWarps, G, kAttnClusterSplits>(
        merge, n_w, reinterpret_cast<float*>(smem_raw + S::inbox_offset(Q8)), t, h_first, n_g, D,
        n_head, split, n_used, out, out_h, out_q, out_d, tiles_k, &trace);
  } else {
    decode_block_finish<kWarps, G, 24>(merge, n_w, t, h_first, n_g, D, n_head, split, n_splits,
                                       n_used, out, out_h, out_q, out_d, tiles_k, part, counters,
                                       reinterpret_cast<float*>(smem_raw), &trace);
  }
  trace.print(CL, n_used);
}

template <int D, bool Q8>
__global__ void __launch_bounds__(DecodeMma<D>::kWarps * 32)
    attn_decode_mma_kernel(GGRAPH_DECODE_MMA_PARAMS) {
  decode_mma_body<D, Q8, DecodeMma<D>::kWarps, false>(GGRAPH_DECODE_MMA_ARGS);
}

// The cluster's size is the kernel's own (compiled for sm_90 and later only; other GPUs never
// launch it).
template <int D, bool Q8>
__global__ void GGRAPH_CLUSTER_DIMS(1, kAttnClusterSplits, 1)
    __launch_bounds__(cluster_warps<D>() * 32, 1)
        attn_decode_mma_cluster_kernel(GGRAPH_DECODE_MMA_PARAMS) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  decode_mma_body<D, Q8, cluster_warps<D>(), true>(GGRAPH_DECODE_MMA_ARGS);
#else
  __trap();
#endif
}

// ---- Prompt attention on tensor cores -------------------------------------------------------
//
// Flash attention for prompt batches. Block (tile of 64 queries, head): 4 warps of 16 queries.
// Q, times scale * log2(e) and rounded to half, sits in shared memory with head_dim padded with
// zeros to D; K and V tiles of BK keys stream through a two-stage cp.async pipeline (rows past the
// causal limit or n_kv and dims past head_dim arrive as zeros). Each warp takes its 16 x BK scores
// with mma.sync m16n8k16 (float accumulation), runs the online softmax in base 2 on the
// accumulator fragments (a row lies in the four lanes of a quad), and multiplies the
// probabilities, rounded to half as the A operand, by V. Tiles are masked only where a key may
// lie past a query's position, n_kv or its window.

constexpr int kFlashWarps = 4;
constexpr int kFlashRows = 16 * kFlashWarps;

// Q8: K and V tiles arrive as Q8_0 bytes in a raw area of their own (two stages), and each tile
// is decoded to half in place of the F16 path's tile once it has landed. SHORT: half the keys a
// tile, for GPUs whose blocks take less shared memory than the Q8_0 tiles of 128 and 256 dims
// need (sm_86, sm_89: 99 KiB). Keys a tile: 32 at 256 dims for the registers.
template <int D, bool Q8 = false, bool SHORT = false>
struct FlashShape {
  static constexpr int kKeys = (D > 128 ? 32 : 64) / (SHORT ? 2 : 1);
  static constexpr int kPitch = D + 8;                // halves: ldmatrix rows in distinct banks
  static constexpr int kRawPitch = q8_head_bytes(D);  // bytes of a raw Q8_0 row
  static constexpr size_t raw_bytes() { return Q8 ? 2 * 2 * kKeys * kRawPitch : 0; }
  static constexpr size_t smem_bytes() {
    return static_cast<size_t>(kFlashRows + 4 * kKeys) * kPitch * sizeof(__half) + raw_bytes();
  }
};

template <int D, bool Q8, bool SHORT = false>
__global__ void __launch_bounds__(kFlashWarps * 32)
    attn_flash_kernel(const float* q, const void* kc_, const void* vc_, float* out, int n_head,
                      int n_head_kv, int head_dim, float scale, int n_kv_value, int first_pos_value,
                      const int32_t* n_kv_at, const int32_t* first_pos_at, int n_tokens, int window,
                      int cache_rows) {
  using Shape = FlashShape<D, Q8, SHORT>;
  constexpr int BK = Shape::kKeys, P = Shape::kPitch, RP = Shape::kRawPitch;
  const auto* kc = static_cast<const __half*>(kc_);
  const auto* vc = static_cast<const __half*>(vc_);
  constexpr int NT = BK / 8;  // score fragments of 8 keys
  constexpr int DT = D / 8;   // output fragments of 8 dims
  pdl_begin();
  const int n_kv = kv_value(n_kv_at, n_kv_value);
  const int first_pos = kv_value(first_pos_at, first_pos_value);
  extern __shared__ __align__(16) uint8_t smem_raw[];
  __half* qs = reinterpret_cast<__half*>(smem_raw);            // [kFlashRows][P]
  __half* ks = qs + kFlashRows * P;                            // [2][BK][P]
  __half* vs = ks + 2 * BK * P;                                // [2][BK][P]
  uint8_t* raw = reinterpret_cast<uint8_t*>(vs + 2 * BK * P);  // Q8: [2 stages][K, V][BK][RP]

  const int h = blockIdx.y;
  const int hkv = h / (n_head / n_head_kv);
  const int t0 = (gridDim.x - 1 - blockIdx.x) * kFlashRows;  // the longest rows start first
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t q_stride = static_cast<int64_t>(n_head) * head_dim;
  const int64_t kv_stride = static_cast<int64_t>(n_head_kv) * head_dim;
  const int t_last = min(n_tokens - 1, t0 + kFlashRows - 1);
  const int k_limit = min(n_kv, first_pos + t_last + 1);
  // With a window, tiles before the first query's first key are skipped unread.
  const int k_first = window > 0 ? max(0, first_pos + t0 + 1 - window) / BK * BK : 0;

  const int head_words = q8_head_bytes(head_dim) / 4;
  const int64_t row_bytes = kv_stride / 32 * 34;
  auto load_tile = [&](int tile, int stage) {
    const int row0 = ring_row(tile, cache_rows);  // the tile's rows follow it (ring_row_after)
    if constexpr (Q8) {
      const uint8_t* kh = static_cast<const uint8_t*>(kc_) + hkv * q8_head_bytes(head_dim);
      const uint8_t* vh = static_cast<const uint8_t*>(vc_) + hkv * q8_head_bytes(head_dim);
      uint8_t* rk = raw + (stage * 2) * BK * RP;
      uint8_t* rv = rk + BK * RP;
      for (int i = threadIdx.x; i < BK * head_words; i += blockDim.x) {
        const int r = i / head_words, w = i % head_words;
        const int j = tile + r;
        const bool ok = j < k_limit;
        const int64_t at =
            static_cast<int64_t>(ok ? ring_row_after<BK>(row0, tile, r, cache_rows) : 0) *
                row_bytes +
            4 * w;
        cp_async_n<4>(rk + r * RP + 4 * w, kh + at, ok ? 4 : 0);
        cp_async_n<4>(rv + r * RP + 4 * w, vh + at, ok ? 4 : 0);
      }
      cp_async_commit();
      return;
    }
    constexpr int kVecs = D / 8;
    for (int i = threadIdx.x; i < BK * kVecs; i += blockDim.x) {
      const int r = i / kVecs, c = i % kVecs;
      const int j = tile + r;
      const bool ok = j < k_limit && c * 8 < head_dim;
      const int64_t at = ok ? ring_row_after<BK>(row0, tile, r, cache_rows) * kv_stride +
                                  static_cast<int64_t>(hkv) * head_dim + c * 8
                            : 0;
      cp_async16(ks + (stage * BK + r) * P + c * 8, kc + at, ok ? 16 : 0);
      cp_async16(vs + (stage * BK + r) * P + c * 8, vc + at, ok ? 16 : 0);
    }
    cp_async_commit();
  };
  if (k_first < k_limit) load_tile(k_first, 0);
  if constexpr (Q8) {
    // Dims past head_dim stay zero in both stages' tiles (the F16 path's copies zero-fill them).
    for (int i = threadIdx.x; i < 4 * BK * (D - head_dim); i += blockDim.x) {
      const int r = i / (D - head_dim), c = head_dim + i % (D - head_dim);
      ks[r * P + c] = __float2half_rn(0.0f);  // ks and vs are adjacent: 4 * BK rows in all
    }
  }
  // Q8: decodes a landed stage's raw rows into its half tiles, a block of 32 values a thread.
  auto decode_stage = [&](int stage) {
    const int nb = head_dim / 32;
    for (int i = threadIdx.x; i < 2 * BK * nb; i += blockDim.x) {
      const int kv = i / (BK * nb), r = i / nb % BK, b = i % nb;
      decode_q8_block_to_half(raw + ((stage * 2 + kv) * BK + r) * RP + b * 34,
                              (kv == 0 ? ks : vs) + (stage * BK + r) * P + b * 32);
    }
  };

  const float q_scale = scale * 1.4426950408889634f;  // scores in base 2
  for (int i = threadIdx.x; i < kFlashRows * (D / 2); i += blockDim.x) {
    const int r = i / (D / 2), d = i % (D / 2) * 2;
    const int t = t0 + r;
    float2 v = make_float2(0.0f, 0.0f);
    if (t < n_tokens && d < head_dim)
      v = *reinterpret_cast<const float2*>(q + t * q_stride + static_cast<int64_t>(h) * head_dim +
                                           d);
    *reinterpret_cast<__half2*>(qs + r * P + d) = __floats2half2_rn(v.x * q_scale, v.y * q_scale);
  }

  float o[DT][4];
#pragma unroll
  for (int i = 0; i < DT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.0f, 0.0f};  // rows g and g + 8 of the warp's 16
  const int g = lane / 4, tig = lane % 4;
  const int pos0 = first_pos + t0 + warp * 16 + g;  // row g's position
  // Lane offsets of the ldmatrix row addresses: Q (A: rows, then k halves), K (B: keys, then k
  // halves), V (B transposed: keys, then dims).
  const __half* q_frag = qs + (warp * 16 + lane % 8 + (lane / 8 % 2) * 8) * P + lane / 16 * 8;
  const int k_off = (lane % 8 + lane / 16 * 8) * P + lane / 8 % 2 * 8;
  const int v_off = (lane % 8 + lane / 8 % 2 * 8) * P + lane / 16 * 8;

  int stage = 0;
  for (int tile = k_first; tile < k_limit; tile += BK, stage ^= 1) {
    // The other stage was released by the barrier that ended the last tile.
    if (tile + BK < k_limit) {
      load_tile(tile + BK, stage ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if constexpr (Q8) {
      decode_stage(stage);
      __syncthreads();
    }
    const __half* kt = ks + stage * BK * P;
    const __half* vt = vs + stage * BK * P;

    float s[NT][4];
#pragma unroll
    for (int i = 0; i < NT; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[4];
      ldmatrix_x4(a, q_frag + kk * 16);
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, kt + np * 16 * P + k_off + kk * 16);
        mma_16816(s[2 * np], a, b[0], b[1]);
        mma_16816(s[2 * np + 1], a, b[2], b[3]);
      }
    }

    const bool edge = tile + BK > first_pos + t0 + 1 || tile + BK > n_kv ||
                      (window > 0 && tile <= first_pos + t0 + kFlashRows - 1 - window);
    if (edge) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = tile + nt * 8 + 2 * tig + (e & 1);
          const int p = pos0 + (e >> 1) * 8;
          if (j >= n_kv || j > p || (window > 0 && j <= p - window)) s[nt][e] = kNegInf;
        }
      }
    }
    frag_softmax(s, m, l, o);

    frag_pv<P>(s, vt + v_off, o);
    __syncthreads();  // this stage fully read before the next load into it
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    const int t = t0 + warp * 16 + g + 8 * r;
    if (t >= n_tokens) continue;
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    float* row = out + t * q_stride + static_cast<int64_t>(h) * head_dim;
#pragma unroll
    for (int i = 0; i < DT; ++i) {
      const int d = i * 8 + 2 * tig;
      if (d < head_dim)
        *reinterpret_cast<float2*>(row + d) = make_float2(o[i][2 * r] * inv, o[i][2 * r + 1] * inv);
    }
  }
}

// Where the decode kernels write the output's 8-bit form (plain, or in column tiles).
ActQ8 attn_out_q8(const AttentionArgs& a) {
  return act_q8_form(a.quant_ws, static_cast<int64_t>(a.n_head) * a.head_dim, a.n_tokens,
                     a.quant_tiles);
}

// The lanes' kernel of 128-dim heads without grouped queries (the decode batches of the 7B
// shape) takes 16-key tiles: half the staging a block (33 KB), so that more blocks share an SM
// (H200: B=64 8,990-8,997 tok/s against 8,651-8,755 with 32-key tiles, B=32 6,645-6,717 against
// 6,579-6,624). GGRAPH_CUDA_ATTN_TILE=32 takes the 32-key tiles, to measure.
bool short_decode_tiles() {
  static const bool v = env_int("GGRAPH_CUDA_ATTN_TILE", 16, 32, 16) == 16;
  return v;
}

template <int DPL, int G, int TILE = decode_tile<DPL>()>
void decode_attention(Launcher& l, const AttentionArgs& a, const void* kc, const void* vc,
                      int32_t n_kv, int32_t first_pos) {
  if constexpr (DPL == 4 && G == 1 && TILE != 16) {
    if (short_decode_tiles()) return decode_attention<DPL, G, 16>(l, a, kc, vc, n_kv, first_pos);
  }
  const int n_gchunks = (a.n_head / a.n_head_kv + G - 1) / G;
  // The batch's tokens are blocks of their own too: a decode batch of 64 sequences fills the GPU
  // with one split each, where splits sized for one token would launch mostly empty blocks.
  const int n_splits = attention_splits(attention_max_keys(a), a.n_head_kv * n_gchunks * a.n_tokens,
                                        decode_split_keys<DPL, TILE>());
  const dim3 grid(a.n_head_kv * n_gchunks, n_splits, a.n_tokens), block(decode_warps<DPL>() * 32);
  // The output's 8-bit form for the products that read it: each warp's 32 outputs are one
  // quant block when head_dim is a multiple of 32.
  const ActQ8 q8 = attn_out_q8(a);
  auto launch = [&](auto kernel) {
    l(kernel, grid, block, decode_smem_bytes<DPL, G, TILE>(a.head_dim), a.q, kc, vc, a.out,
      a.partials, a.n_head, a.n_head_kv, a.head_dim, a.scale, n_kv, first_pos, a.n_kv_at,
      a.first_pos_at, n_splits, n_gchunks, q8.qs, q8.ds, q8.tiles_k,
      reinterpret_cast<__half*>(a.half_ws), a.window, a.counters, a.cache_rows, a.slots);
  };
  if (a.kv_type == DType::Q8_0) {
    launch(attn_decode_kernel<DPL, G, true, TILE>);
  } else {
    launch(attn_decode_kernel<DPL, G, false, TILE>);
  }
}

// How many clusters of each cluster kernel (64, 128, 256 dims; F16, Q8_0) can be resident at once
// on this GPU (0: none, or the kernel was not built for it); set by prepare_attention_kernels.
// mode: -1 automatic, 0 never (set_decode_attention_cluster, GGRAPH_CUDA_ATTN_CLUSTER=0).
struct ClusterSupport {
  int clusters[3][2] = {};
  int mode = -1;
};
ClusterSupport& cluster_support() {
  static ClusterSupport c;
  return c;
}
constexpr int dim_index(int d) { return d == 64 ? 0 : d == 128 ? 1 : 2; }

template <int D>
void launch_decode_mma(Launcher& l, const AttentionArgs& a, const void* kc, const void* vc,
                       int32_t n_kv, int32_t first_pos) {
  using S = DecodeMma<D>;
  const int n_gchunks = (a.n_head / a.n_head_kv + S::kRows - 1) / S::kRows;
  const int kv_blocks = a.n_head_kv * n_gchunks * a.n_tokens;
  const int max_keys = attention_max_keys(a);
  const ActQ8 q8 = attn_out_q8(a);
  const bool is_q8 = a.kv_type == DType::Q8_0;
  auto launch = [&](auto kernel, dim3 grid, dim3 block, size_t smem, int n_splits) {
    l(kernel, grid, block, smem, a.q, kc, vc, a.out, a.partials, a.n_head, a.n_head_kv, a.head_dim,
      a.scale, n_kv, first_pos, a.n_kv_at, a.first_pos_at, n_splits, n_gchunks, q8.qs, q8.ds,
      q8.tiles_k, reinterpret_cast<__half*>(a.half_ws), a.window, a.counters, a.cache_rows,
      a.slots);
  };
  // A grid of clusters that are resident at once, over a cache longer than one block's pass and
  // within one pass of the cluster's blocks (4,096 keys at 64 dims, 2,048 at 128, 1,024 at 256):
  // the splits merge through distributed shared memory. Longer caches take the ticket's splits,
  // whose blocks spread over more SMs (an H100: the SmolLM2 shape's decode at depth 4,096 with a
  // cache of 4,224 rows ran 1,333-1,386 tok/s on clusters, 1,454-1,464 on the ticket; Gemma 3's
  // windows of 512, 1,237-1,294 against 985-1,026). The choice follows the graph's shape (heads,
  // tokens, cache rows, window) alone, never the step's depth.
  const ClusterSupport& cs = cluster_support();
  using SC = DecodeMma<D, cluster_warps<D>(), true>;
  if (cs.mode != 0 && kv_blocks <= cs.clusters[dim_index(D)][is_q8] &&
      max_keys > SC::split_keys() && max_keys <= kAttnClusterSplits * SC::split_keys()) {
    launch(
        is_q8 ? attn_decode_mma_cluster_kernel<D, true> : attn_decode_mma_cluster_kernel<D, false>,
        dim3(a.n_head_kv * n_gchunks, kAttnClusterSplits, a.n_tokens), dim3(SC::kWarps * 32),
        SC::smem_bytes(is_q8), kAttnClusterSplits);
    return;
  }
  const int n_splits = attention_splits(max_keys, kv_blocks, S::split_keys());
  launch(is_q8 ? attn_decode_mma_kernel<D, true> : attn_decode_mma_kernel<D, false>,
         dim3(a.n_head_kv * n_gchunks, n_splits, a.n_tokens), dim3(S::kWarps * 32),
         S::smem_bytes(is_q8), n_splits);
}

template <int D>
void prepare_decode_mma() {
  allow_block_smem(attn_decode_mma_kernel<D, false>, DecodeMma<D>::smem_bytes(false));
  allow_block_smem(attn_decode_mma_kernel<D, true>, DecodeMma<D>::smem_bytes(true));
  using SC = DecodeMma<D, cluster_warps<D>(), true>;
  allow_block_smem(attn_decode_mma_cluster_kernel<D, false>, SC::smem_bytes(false));
  allow_block_smem(attn_decode_mma_cluster_kernel<D, true>, SC::smem_bytes(true));
}

// Clusters of the kernel that can be resident at once: 0 unless the GPU runs its sm_90 build
// (PTX 9.0 or later, the cluster size compiled in); a build for older GPUs JIT-compiled on a
// newer one has neither, and an empty body.
template <int D, bool Q8>
int resident_clusters() {
  cudaFuncAttributes attr = {};
  if (cudaFuncGetAttributes(&attr, attn_decode_mma_cluster_kernel<D, Q8>) != cudaSuccess ||
      attr.ptxVersion < 90 || attr.requiredClusterHeight != kAttnClusterSplits)
    return 0;
  using SC = DecodeMma<D, cluster_warps<D>(), true>;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(1, kAttnClusterSplits, 1);
  config.blockDim = dim3(SC::kWarps * 32);
  config.dynamicSmemBytes = SC::smem_bytes(Q8);
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, attn_decode_mma_cluster_kernel<D, Q8>, &config) !=
      cudaSuccess)
    return 0;
  return clusters;
}

template <int DPL>
void decode_attention_dpl(Launcher& l, const AttentionArgs& a, const void* kc, const void* vc,
                          int32_t n_kv, int32_t first_pos) {
  if constexpr (DPL == 8) {  // wider heads go one to a block (attention_group)
    decode_attention<DPL, 1>(l, a, kc, vc, n_kv, first_pos);
  } else {
    switch (attention_group(a.n_head, a.n_head_kv, a.head_dim)) {
      case 1:
        return decode_attention<DPL, 1>(l, a, kc, vc, n_kv, first_pos);
      case 2:
        return decode_attention<DPL, 2>(l, a, kc, vc, n_kv, first_pos);
      case 4:
        return decode_attention<DPL, 4>(l, a, kc, vc, n_kv, first_pos);
      default:
        return decode_attention<DPL, 8>(l, a, kc, vc, n_kv, first_pos);
    }
  }
}

template <int DPL>
void prepare_decode_dpl() {
  // Each instantiation's largest need, at its largest head_dim.
  for (auto k : {attn_decode_kernel<DPL, 1, false>, attn_decode_kernel<DPL, 1, true>})
    allow_block_smem(k, decode_smem_bytes<DPL, 1>(32 * DPL));
  if constexpr (DPL == 4) {
    for (auto k : {attn_decode_kernel<DPL, 1, false, 16>, attn_decode_kernel<DPL, 1, true, 16>})
      allow_block_smem(k, decode_smem_bytes<DPL, 1, 16>(32 * DPL));
  }
  if constexpr (DPL < 8) {  // wider heads go one to a block (attention_group)
    for (auto k : {attn_decode_kernel<DPL, 2, false>, attn_decode_kernel<DPL, 2, true>})
      allow_block_smem(k, decode_smem_bytes<DPL, 2>(32 * DPL));
    for (auto k : {attn_decode_kernel<DPL, 4, false>, attn_decode_kernel<DPL, 4, true>})
      allow_block_smem(k, decode_smem_bytes<DPL, 4>(32 * DPL));
    for (auto k : {attn_decode_kernel<DPL, 8, false>, attn_decode_kernel<DPL, 8, true>})
      allow_block_smem(k, decode_smem_bytes<DPL, 8>(32 * DPL));
  }
}

template <int D, bool Q8, bool SHORT>
void prompt_attention_as(Launcher& l, const AttentionArgs& a, const void* kc, const void* vc,
                         int32_t n_kv, int32_t first_pos) {
  using Shape = FlashShape<D, Q8, SHORT>;
  if (Shape::smem_bytes() > max_block_smem())
    throw std::runtime_error(
        "attention: a prompt over this cache needs " + std::to_string(Shape::smem_bytes()) +
        " bytes of shared memory a block; this GPU gives " + std::to_string(max_block_smem()));
  l(attn_flash_kernel<D, Q8, SHORT>, dim3((a.n_tokens + kFlashRows - 1) / kFlashRows, a.n_head),
    dim3(kFlashWarps * 32), Shape::smem_bytes(), a.q, kc, vc, a.out, a.n_head, a.n_head_kv,
    a.head_dim, a.scale, n_kv, first_pos, a.n_kv_at, a.first_pos_at, a.n_tokens, a.window,
    a.cache_rows);
}

template <int D>
void prompt_attention(Launcher& l, const AttentionArgs& a, const void* kc, const void* vc,
                      int32_t n_kv, int32_t first_pos) {
  if (a.kv_type != DType::Q8_0)
    return prompt_attention_as<D, false, false>(l, a, kc, vc, n_kv, first_pos);
  if constexpr (D > 64) {  // 64 dims' full Q8_0 tiles fit any sm_80+ block (63.5 KB)
    if (FlashShape<D, true>::smem_bytes() > max_block_smem())
      return prompt_attention_as<D, true, true>(l, a, kc, vc, n_kv, first_pos);
  }
  prompt_attention_as<D, true, false>(l, a, kc, vc, n_kv, first_pos);
}

template <int D>
void prepare_prompt() {
  allow_block_smem(attn_flash_kernel<D, false>, FlashShape<D, false>::smem_bytes());
  allow_block_smem(attn_flash_kernel<D, true>, FlashShape<D, true>::smem_bytes());
  if constexpr (D > 64)
    allow_block_smem(attn_flash_kernel<D, true, true>, FlashShape<D, true, true>::smem_bytes());
}

}  // namespace

void prepare_attention_kernels() {
  prepare_decode_mma<64>();
  prepare_decode_mma<128>();
  prepare_decode_mma<256>();
  ClusterSupport& cs = cluster_support();
  cs.clusters[0][0] = resident_clusters<64, false>();
  cs.clusters[0][1] = resident_clusters<64, true>();
  cs.clusters[1][0] = resident_clusters<128, false>();
  cs.clusters[1][1] = resident_clusters<128, true>();
  cs.clusters[2][0] = resident_clusters<256, false>();
  cs.clusters[2][1] = resident_clusters<256, true>();
  if (!env_switch_on("GGRAPH_CUDA_ATTN_CLUSTER")) cs.mode = 0;
  cudaGetLastError();
  prepare_decode_dpl<2>();
  prepare_decode_dpl<4>();
  prepare_decode_dpl<8>();
  prepare_prompt<64>();
  prepare_prompt<128>();
  prepare_prompt<256>();
}

bool set_decode_attention_cluster(bool on) {
  const bool was = cluster_support().mode != 0;
  cluster_support().mode = on ? -1 : 0;
  return was;
}

bool decode_attention_clusters() { return cluster_support().clusters[0][0] > 0; }

bool decode_attention_mma(int head_dim) {
  // GGRAPH_CUDA_ATTN_MMA=0 keeps every head size on the lanes' kernel (for measuring).
  static const bool on = env_switch_on("GGRAPH_CUDA_ATTN_MMA");
  return on && (head_dim == 64 || head_dim == 128 || head_dim == 256);
}

int attention_group(int n_head, int n_head_kv, int head_dim) {
  // The query heads of a KV head (rounded up to a power of two, at most kDecodeGroup) share
  // each K and V load. Heads wider than 128 go one to a block: a warp's work on a tile grows
  // with G times head_dim, and short contexts, which leave most of the GPU idle, wait on it.
  if (head_dim > 128) return 1;
  const int group = n_head / n_head_kv;
  int g = 1;
  while (g < group && g < kDecodeGroup) g *= 2;
  return g;
}

int attention_max_keys(const AttentionArgs& a) {
  // With a window, a batch reads at most window + n_tokens - 1 keys.
  return a.window > 0 ? std::min(a.cache_rows, a.window + a.n_tokens - 1) : a.cache_rows;
}

void launch_attention(Launcher& l, const AttentionArgs& a) {
  if (a.quant_ws && (a.head_dim % 32 != 0 || (a.n_tokens > kDecodeAttnMaxTokens && !a.slots)))
    throw std::logic_error(
        "attention: 8-bit output needs head_dim % 32 == 0 and the decode kernels");
  if (a.half_ws && a.n_tokens > kDecodeAttnMaxTokens && !a.slots)
    throw std::logic_error("attention: a half output needs the decode kernels");
  if ((a.n_tokens <= kDecodeAttnMaxTokens || a.slots) && (!a.partials || !a.counters))
    throw std::logic_error("attention: a decode batch needs partials and counters");
  if (a.slots  ? a.ring && (a.window <= 0 || a.window > a.cache_rows)
      : a.ring ? a.window <= 0 || a.window + a.n_tokens - 1 > a.cache_rows
               : a.n_kv > a.cache_rows)
    throw std::logic_error("attention: keys beyond the cache rows");
  if (a.head_dim > 256 || a.head_dim % 8 != 0)
    throw ArgumentError("attention: head_dim must be a multiple of 8 and at most 256, got " +
                        std::to_string(a.head_dim));
  if (a.kv_type != DType::F16 && a.kv_type != DType::Q8_0)
    throw ArgumentError(std::string("attention: the cache must be F16 or Q8_0, got ") +
                        dtype_name(a.kv_type));
  if (a.kv_type == DType::Q8_0 && a.head_dim % 64 != 0)
    throw ArgumentError("attention: a Q8_0 cache needs head_dim a multiple of 64, got " +
                        std::to_string(a.head_dim));
  const void* kc = a.k_cache;
  const void* vc = a.v_cache;
  // Values the kernels read from the KV record go as zeros, so that the arguments do not move.
  const int32_t n_kv = a.n_kv_at ? 0 : a.n_kv, first_pos = a.first_pos_at ? 0 : a.first_pos;
  // Tokens of sequences of their own are each one query: the decode kernels, at any count.
  if (a.n_tokens <= kDecodeAttnMaxTokens || a.slots) {
    // The MMA kernel's rows are a KV head's query heads: a decode batch of a model with one
    // query head a KV head (no GQA) uses one row of its 16 and is held by its shared memory to
    // three blocks an SM, where a batch launches a block for each sequence and head. The lanes'
    // kernel runs it faster (the 7B shape, H200: B=32 5,798-5,815 tok/s against 5,502-5,536,
    // B=64 7,608-7,618 against 7,170-7,185); with GQA (the SmolLM2 shape's 3) the MMA kernel
    // wins.
    const bool lanes = a.slots && a.n_head == a.n_head_kv;
    if (!lanes && decode_attention_mma(a.head_dim)) {
      if (a.head_dim == 64) return launch_decode_mma<64>(l, a, kc, vc, n_kv, first_pos);
      if (a.head_dim == 128) return launch_decode_mma<128>(l, a, kc, vc, n_kv, first_pos);
      return launch_decode_mma<256>(l, a, kc, vc, n_kv, first_pos);
    }
    if (a.head_dim <= 64) return decode_attention_dpl<2>(l, a, kc, vc, n_kv, first_pos);
    if (a.head_dim <= 128) return decode_attention_dpl<4>(l, a, kc, vc, n_kv, first_pos);
    return decode_attention_dpl<8>(l, a, kc, vc, n_kv, first_pos);
  }
  if (a.head_dim <= 64) return prompt_attention<64>(l, a, kc, vc, n_kv, first_pos);
  if (a.head_dim <= 128) return prompt_attention<128>(l, a, kc, vc, n_kv, first_pos);
  return prompt_attention<256>(l, a, kc, vc, n_kv, first_pos);
}

}  // namespace ggraph::cuda
