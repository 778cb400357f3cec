// Causal attention over the F16 KV cache: flash-decoding (KV split over blocks, then a reduce)
// for a few queries, and a tiled kernel for prompts.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "cuda/device_util.cuh"
#include "cuda/kernels.cuh"

namespace ggraph::cuda {

int kv_bucket(int n_kv) {
  int b = 256;
  while (b < n_kv && b < (1 << 30)) b *= 2;
  return b;
}

int attention_splits(int n_kv_bucket, int n_head_kv) {
  // One split (no reduce launch) up to 256 keys per KV head group, more as the cache grows.
  const int keys_per_split = n_head_kv >= 16 ? 512 : 256;
  return std::max(1, std::min(kMaxAttnSplits, n_kv_bucket / keys_per_split));
}

size_t attn_partials_bytes(int n_head, int head_dim, int n_tokens) {
  if (n_tokens > kDecodeAttnMaxTokens) return 0;
  return static_cast<size_t>(n_head) * n_tokens * kMaxAttnSplits * (head_dim + 2) * sizeof(float);
}

namespace {

constexpr int kAttnWarps = 4;
constexpr int kDecodeGroup = 8;      // at most this many query heads per block share a KV head
constexpr int kShortKvBucket = 256;  // KV buckets up to this take one query head per block
constexpr float kNegInf = -INFINITY;

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
// Block (kv head group chunk, split, token): up to G query heads that share one KV head,
// keys [split start, split end) of the causal range. Each warp takes 32-key tiles: lane j
// computes key j's scores for every head (its K row read once for the whole group), then lanes
// own head dimensions for the P*V update. The 4 warps are merged in shared memory; with one
// split the block writes the normalized output, otherwise (m, l, acc) partials for the reduce.
// DI: head_dim <= 64 * DI.

template <int DI, int G>
__global__ void __launch_bounds__(kAttnWarps * 32)
    attn_decode_kernel(const float* q, const __half* kc, const __half* vc, float* out, float* part,
                       int n_head, int n_head_kv, int head_dim, float scale, int n_kv_value,
                       int first_pos_value, const int32_t* n_kv_at, const int32_t* first_pos_at,
                       int n_splits, int n_gchunks, int8_t* out_q, float2* out_d, int window) {
  pdl_begin();
  extern __shared__ float smem[];
  const int n_kv = kv_value(n_kv_at, n_kv_value);
  const int first_pos = kv_value(first_pos_at, first_pos_value);
  const int group = n_head / n_head_kv;
  const int hkv = blockIdx.x / n_gchunks;
  const int h_first = hkv * group + (blockIdx.x % n_gchunks) * G;
  const int n_g = min(G, hkv * group + group - h_first);
  const int split = blockIdx.y;
  const int t = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t kv_stride = static_cast<int64_t>(n_head_kv) * head_dim;
  const int64_t q_stride = static_cast<int64_t>(n_head) * head_dim;

  float* qs = smem;                    // [G][head_dim], pre-scaled
  float* merge = smem + G * head_dim;  // [warps][G][head_dim + 2]
  for (int i = threadIdx.x; i < n_g * head_dim; i += blockDim.x)
    qs[i] = q[t * q_stride + static_cast<int64_t>(h_first) * head_dim + i] * scale;
  __syncthreads();

  // Keys [lo, lim) are this token's; with a window, the splits divide the keys any token of the
  // batch reads, from range_begin on, and rows before lo are never read.
  const int lim = min(n_kv, first_pos + t + 1);
  const int lo = window > 0 ? max(0, first_pos + t + 1 - window) : 0;
  const int range_begin = window > 0 ? max(0, first_pos + 1 - window) : 0;
  const int split_len = (n_kv - range_begin + n_splits - 1) / n_splits;
  const int k_begin = max(lo, range_begin + split * split_len);
  const int k_end = min(range_begin + (split + 1) * split_len, lim);

  float m[G], l[G], acc[G][DI][2];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = kNegInf;
    l[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < DI; ++i) acc[g][i][0] = acc[g][i][1] = 0.0f;
  }

  const __half* k_head = kc + static_cast<int64_t>(hkv) * head_dim;
  const __half* v_head = vc + static_cast<int64_t>(hkv) * head_dim;
  // V rows of a tile come KC at a time with all their loads in flight together; the first KC
  // are requested before the scores, so that their latency overlaps that of the K rows.
  constexpr int KC = DI <= 2 ? 32 : 16;
  for (int tile = k_begin + warp * 32; tile < k_end; tile += kAttnWarps * 32) {
    const int j = tile + lane;
    const bool valid = j < k_end;
    const int n_valid = min(32, k_end - tile);
    __half2 vr[KC][DI];
    auto load_v = [&](int j0) {
#pragma unroll
      for (int jj = 0; jj < KC; ++jj) {
        const __half2* vrow =
            reinterpret_cast<const __half2*>(v_head + (tile + j0 + jj) * kv_stride);
#pragma unroll
        for (int i = 0; i < DI; ++i) {
          const int d = 64 * i + 2 * lane;
          vr[jj][i] = j0 + jj < n_valid && d < head_dim ? vrow[d / 2] : __float2half2_rn(0.f);
        }
      }
    };
    load_v(0);
    float s[G];
#pragma unroll
    for (int g = 0; g < G; ++g) s[g] = 0.0f;
    if (valid) {
      const uint4* krow = reinterpret_cast<const uint4*>(k_head + j * kv_stride);
#pragma unroll
      for (int c0 = 0; c0 < DI * 64; c0 += 128) {
        uint4 kr[16];
#pragma unroll
        for (int u = 0; u < 16; ++u)
          if (c0 + u * 8 < head_dim) kr[u] = __ldg(krow + c0 / 8 + u);
#pragma unroll
        for (int u = 0; u < 16; ++u) {
          if (c0 + u * 8 >= head_dim) break;
          const __half2* kh = reinterpret_cast<const __half2*>(&kr[u]);
          float kf[8];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float2 f = __half22float2(kh[e]);
            kf[2 * e] = f.x, kf[2 * e + 1] = f.y;
          }
#pragma unroll
          for (int g = 0; g < G; ++g) {
            if (g >= n_g) break;
            const float4* qv = reinterpret_cast<const float4*>(qs + g * head_dim + c0 + u * 8);
            const float4 qa = qv[0], qb = qv[1];
            s[g] += qa.x * kf[0] + qa.y * kf[1] + qa.z * kf[2] + qa.w * kf[3] + qb.x * kf[4] +
                    qb.y * kf[5] + qb.z * kf[6] + qb.w * kf[7];
          }
        }
      }
    }
    float p[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (g >= n_g) break;
      const float alpha = softmax_step(s[g], valid, m[g], l[g], p[g]);
#pragma unroll
      for (int i = 0; i < DI; ++i) acc[g][i][0] *= alpha, acc[g][i][1] *= alpha;
    }
    for (int j0 = 0; j0 < n_valid; j0 += KC) {
      if (j0 > 0) load_v(j0);
#pragma unroll
      for (int jj = 0; jj < KC; ++jj) {
        if (j0 + jj >= n_valid) break;
        float2 v[DI];
#pragma unroll
        for (int i = 0; i < DI; ++i) v[i] = __half22float2(vr[jj][i]);
#pragma unroll
        for (int g = 0; g < G; ++g) {
          if (g >= n_g) break;
          const float pj = __shfl_sync(0xffffffffu, p[g], j0 + jj);
#pragma unroll
          for (int i = 0; i < DI; ++i) acc[g][i][0] += pj * v[i].x, acc[g][i][1] += pj * v[i].y;
        }
      }
    }
  }

  // Merge the warps: each writes (m, l, acc) for its heads, then threads combine per element.
  const int rec = head_dim + 2;
  for (int g = 0; g < n_g; ++g) {
    float* r = merge + (warp * G + g) * rec;
    if (lane == 0) r[0] = m[g], r[1] = l[g];
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (g >= n_g) break;
    float* r = merge + (warp * G + g) * rec;
#pragma unroll
    for (int i = 0; i < DI; ++i) {
      const int d = 64 * i + 2 * lane;
      if (d < head_dim) r[2 + d] = acc[g][i][0], r[3 + d] = acc[g][i][1];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < n_g * head_dim; idx += blockDim.x) {
    const int g = idx / head_dim, d = idx % head_dim;
    float mm = kNegInf;
    for (int w = 0; w < kAttnWarps; ++w) mm = fmaxf(mm, merge[(w * G + g) * rec]);
    float ll = 0.0f, a = 0.0f;
    if (mm != kNegInf) {
      for (int w = 0; w < kAttnWarps; ++w) {
        const float* r = merge + (w * G + g) * rec;
        const float e = r[0] == kNegInf ? 0.0f : expf(r[0] - mm);
        ll += r[1] * e;
        a += r[2 + d] * e;
      }
    }
    const int h = h_first + g;
    if (n_splits == 1) {
      const int64_t i = t * q_stride + static_cast<int64_t>(h) * head_dim + d;
      const float v = ll > 0.0f ? a / ll : 0.0f;
      out[i] = v;
      if (out_q) quantize_warp_block(v, i, out_q, out_d);
    } else {
      float* pr = part + ((static_cast<int64_t>(t) * n_head + h) * n_splits + split) * rec;
      if (d == 0) pr[0] = mm, pr[1] = ll;
      pr[2 + d] = a;
    }
  }
}

__global__ void attn_reduce_kernel(const float* part, float* out, int n_head, int head_dim,
                                   int n_splits, int8_t* out_q, float2* out_d) {
  pdl_begin();
  const int h = blockIdx.x, t = blockIdx.y;
  const int rec = head_dim + 2;
  const float* base = part + (static_cast<int64_t>(t) * n_head + h) * n_splits * rec;
  float mm = kNegInf;
  for (int s = 0; s < n_splits; ++s) mm = fmaxf(mm, base[s * rec]);
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float ll = 0.0f, a = 0.0f;
    if (mm != kNegInf) {
      for (int s = 0; s < n_splits; ++s) {
        const float* r = base + s * rec;
        const float e = r[0] == kNegInf ? 0.0f : expf(r[0] - mm);
        ll += r[1] * e;
        a += r[2 + d] * e;
      }
    }
    const int64_t i = (static_cast<int64_t>(t) * n_head + h) * head_dim + d;
    const float v = ll > 0.0f ? a / ll : 0.0f;
    out[i] = v;
    if (out_q) quantize_warp_block(v, i, out_q, out_d);
  }
}

// ---- Prompt attention ---------------------------------------------------------------------
//
// Block (query tile, head): 4 warps of QW queries each. K and V tiles of 32 keys are staged in
// shared memory as half; lane j scores key j against the warp's queries, then lanes own head
// dimensions for P*V. Key tiles stop at the tile's last causal position.

template <int DI, int QW>
__global__ void __launch_bounds__(kAttnWarps * 32)
    attn_prompt_kernel(const float* q, const __half* kc, const __half* vc, float* out, int n_head,
                       int n_head_kv, int head_dim, float scale, int n_kv_value,
                       int first_pos_value, const int32_t* n_kv_at, const int32_t* first_pos_at,
                       int n_tokens, int window) {
  pdl_begin();
  const int n_kv = kv_value(n_kv_at, n_kv_value);
  const int first_pos = kv_value(first_pos_at, first_pos_value);
  constexpr int BQ = kAttnWarps * QW;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  const int kpitch = head_dim + 4;                 // halves; 8-byte row reads spread over all banks
  float* qs = reinterpret_cast<float*>(smem_raw);  // [BQ][head_dim]
  __half* ks = reinterpret_cast<__half*>(qs + BQ * head_dim);  // [32][kpitch]
  __half* vs = ks + 32 * kpitch;                               // [32][head_dim]

  const int h = blockIdx.y;
  const int hkv = h / (n_head / n_head_kv);
  const int t0 = blockIdx.x * BQ;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t q_stride = static_cast<int64_t>(n_head) * head_dim;
  const int64_t kv_stride = static_cast<int64_t>(n_head_kv) * head_dim;

  for (int i = threadIdx.x; i < BQ * head_dim; i += blockDim.x) {
    const int r = i / head_dim, d = i % head_dim;
    const int t = t0 + r;
    qs[i] = t < n_tokens ? q[t * q_stride + static_cast<int64_t>(h) * head_dim + d] * scale : 0.f;
  }

  const int t_last = min(n_tokens - 1, t0 + BQ - 1);
  const int k_limit = min(n_kv, first_pos + t_last + 1);

  float m[QW], l[QW], acc[QW][DI][2];
#pragma unroll
  for (int qi = 0; qi < QW; ++qi) {
    m[qi] = kNegInf;
    l[qi] = 0.0f;
#pragma unroll
    for (int i = 0; i < DI; ++i) acc[qi][i][0] = acc[qi][i][1] = 0.0f;
  }

  const int vec_per_row = head_dim / 8;
  // With a window, tiles before the first query's first key are skipped unread.
  const int k_first = window > 0 ? max(0, first_pos + t0 + 1 - window) / 32 * 32 : 0;
  for (int tile = k_first; tile < k_limit; tile += 32) {
    __syncthreads();  // previous tile fully consumed (and qs written, first time)
    for (int i = threadIdx.x; i < 32 * vec_per_row; i += blockDim.x) {
      const int r = i / vec_per_row, c = i % vec_per_row;
      const int j = tile + r;
      uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
      if (j < k_limit) {
        kv = __ldg(reinterpret_cast<const uint4*>(kc + j * kv_stride + hkv * head_dim) + c);
        vv = __ldg(reinterpret_cast<const uint4*>(vc + j * kv_stride + hkv * head_dim) + c);
      }
      // K rows have a 4-half pad, so only 8-byte alignment holds: store as two halves.
      uint2* kd = reinterpret_cast<uint2*>(ks + r * kpitch + c * 8);
      kd[0] = make_uint2(kv.x, kv.y);
      kd[1] = make_uint2(kv.z, kv.w);
      *reinterpret_cast<uint4*>(vs + r * head_dim + c * 8) = vv;
    }
    __syncthreads();

    const int j = tile + lane;
    float s[QW];
#pragma unroll
    for (int qi = 0; qi < QW; ++qi) s[qi] = 0.0f;
    const __half* krow = ks + lane * kpitch;
    for (int d = 0; d < head_dim; d += 4) {
      const uint2 kr = *reinterpret_cast<const uint2*>(krow + d);
      const float2 k01 = __half22float2(*reinterpret_cast<const __half2*>(&kr.x));
      const float2 k23 = __half22float2(*reinterpret_cast<const __half2*>(&kr.y));
#pragma unroll
      for (int qi = 0; qi < QW; ++qi) {
        const float4 qv = *reinterpret_cast<const float4*>(qs + (warp * QW + qi) * head_dim + d);
        s[qi] += qv.x * k01.x + qv.y * k01.y + qv.z * k23.x + qv.w * k23.y;
      }
    }
    float p[QW];
#pragma unroll
    for (int qi = 0; qi < QW; ++qi) {
      const int t = t0 + warp * QW + qi;
      const bool valid = t < n_tokens && j < n_kv && j <= first_pos + t &&
                         (window <= 0 || j > first_pos + t - window);
      const float alpha = softmax_step(s[qi], valid, m[qi], l[qi], p[qi]);
#pragma unroll
      for (int i = 0; i < DI; ++i) acc[qi][i][0] *= alpha, acc[qi][i][1] *= alpha;
    }
    const int n_valid = min(32, k_limit - tile);
#pragma unroll 4
    for (int jj = 0; jj < n_valid; ++jj) {
      float2 v[DI];
#pragma unroll
      for (int i = 0; i < DI; ++i) {
        const int d = 64 * i + 2 * lane;
        v[i] = d < head_dim
                   ? __half22float2(*reinterpret_cast<const __half2*>(vs + jj * head_dim + d))
                   : make_float2(0.f, 0.f);
      }
#pragma unroll
      for (int qi = 0; qi < QW; ++qi) {
        const float pj = __shfl_sync(0xffffffffu, p[qi], jj);
#pragma unroll
        for (int i = 0; i < DI; ++i) acc[qi][i][0] += pj * v[i].x, acc[qi][i][1] += pj * v[i].y;
      }
    }
  }

#pragma unroll
  for (int qi = 0; qi < QW; ++qi) {
    const int t = t0 + warp * QW + qi;
    if (t >= n_tokens) continue;
    float* o = out + t * q_stride + static_cast<int64_t>(h) * head_dim;
    const float inv = l[qi] > 0.0f ? 1.0f / l[qi] : 0.0f;
#pragma unroll
    for (int i = 0; i < DI; ++i) {
      const int d = 64 * i + 2 * lane;
      if (d < head_dim) o[d] = acc[qi][i][0] * inv, o[d + 1] = acc[qi][i][1] * inv;
    }
  }
}

// n_kv and first_pos as the kernels take them (see kv_value).
struct AttnKvArgs {
  int32_t n_kv, first_pos;
  const int32_t* n_kv_at;
  const int32_t* first_pos_at;
};

template <int DI>
void attention_di(Launcher& l, const float* q, const __half* kc, const __half* vc, float* out,
                  int n_head, int n_head_kv, int head_dim, float scale, int n_tokens,
                  int n_kv_bucket, const AttnKvArgs& kv, float* partials, uint8_t* quant_ws,
                  int window) {
  if (n_tokens <= kDecodeAttnMaxTokens) {
    const int group = n_head / n_head_kv;
    // Heads per block: over short contexts one, so that each head's short chain of loads and
    // sums runs in a block of its own; over longer ones the group (rounded up to a power of
    // two, at most kDecodeGroup), whose heads then share each K and V load.
    int g = 1;
    while (n_kv_bucket > kShortKvBucket && g < group && g < kDecodeGroup) g *= 2;
    const int n_gchunks = (group + g - 1) / g;
    const int n_splits = attention_splits(n_kv_bucket, n_head_kv);
    const size_t smem = (g * head_dim + kAttnWarps * g * (head_dim + 2)) * sizeof(float);
    const dim3 grid(n_head_kv * n_gchunks, n_splits, n_tokens), block(kAttnWarps * 32);
    // The output's 8-bit form for the mat-vec that reads it: each warp's 32 outputs are one
    // quant block when head_dim is a multiple of 32.
    const ActQ8 q8 = act_q8(quant_ws, static_cast<int64_t>(n_head) * head_dim, n_tokens);
    auto launch = [&](auto kernel) {
      l(kernel, grid, block, smem, q, kc, vc, out, partials, n_head, n_head_kv, head_dim, scale,
        kv.n_kv, kv.first_pos, kv.n_kv_at, kv.first_pos_at, n_splits, n_gchunks,
        n_splits == 1 ? q8.qs : nullptr, q8.ds, window);
    };
    if (g == 1) launch(attn_decode_kernel<DI, 1>);
    if (g == 2) launch(attn_decode_kernel<DI, 2>);
    if (g == 4) launch(attn_decode_kernel<DI, 4>);
    if (g == 8) launch(attn_decode_kernel<DI, 8>);
    if (n_splits > 1) {
      l(attn_reduce_kernel, dim3(n_head, n_tokens), dim3(128), 0,
        static_cast<const float*>(partials), out, n_head, head_dim, n_splits, q8.qs, q8.ds);
    }
    return;
  }
  constexpr int QW = DI <= 2 ? 4 : 2;
  constexpr int BQ = kAttnWarps * QW;
  const size_t smem =
      BQ * head_dim * sizeof(float) + (32 * (head_dim + 4) + 32 * head_dim) * sizeof(__half);
  l(attn_prompt_kernel<DI, QW>, dim3((n_tokens + BQ - 1) / BQ, n_head), dim3(kAttnWarps * 32), smem,
    q, kc, vc, out, n_head, n_head_kv, head_dim, scale, kv.n_kv, kv.first_pos, kv.n_kv_at,
    kv.first_pos_at, n_tokens, window);
}

}  // namespace

void launch_attention(Launcher& l, const float* q, const void* k_cache, const void* v_cache,
                      float* out, int n_head, int n_head_kv, int head_dim, float scale,
                      int n_tokens, int32_t n_kv, int32_t first_pos, float* partials,
                      const int32_t* n_kv_at, const int32_t* first_pos_at, uint8_t* quant_ws,
                      int window) {
  if (quant_ws && (head_dim % 32 != 0 || n_tokens > kDecodeAttnMaxTokens))
    throw std::logic_error("attention: 8-bit output needs head_dim % 32 == 0 and a decode batch");
  const auto* kc = static_cast<const __half*>(k_cache);
  const auto* vc = static_cast<const __half*>(v_cache);
  // Values the kernels read from the KV record go as zeros, so that the arguments do not move.
  const AttnKvArgs kv{n_kv_at ? 0 : n_kv, first_pos_at ? 0 : first_pos, n_kv_at, first_pos_at};
  // The split choice follows the keys actually read: with a window, at most window + n_tokens - 1.
  const int bucket = kv_bucket(window > 0 ? std::min(n_kv, window + n_tokens - 1) : n_kv);
  switch ((head_dim + 63) / 64) {
    case 1:
      return attention_di<1>(l, q, kc, vc, out, n_head, n_head_kv, head_dim, scale, n_tokens,
                             bucket, kv, partials, quant_ws, window);
    case 2:
      return attention_di<2>(l, q, kc, vc, out, n_head, n_head_kv, head_dim, scale, n_tokens,
                             bucket, kv, partials, quant_ws, window);
    case 3:
      return attention_di<3>(l, q, kc, vc, out, n_head, n_head_kv, head_dim, scale, n_tokens,
                             bucket, kv, partials, quant_ws, window);
    case 4:
      return attention_di<4>(l, q, kc, vc, out, n_head, n_head_kv, head_dim, scale, n_tokens,
                             bucket, kv, partials, quant_ws, window);
    default:
      throw ArgumentError("attention: head_dim must be at most 256, got " +
                          std::to_string(head_dim));
  }
}

}  // namespace ggraph::cuda
