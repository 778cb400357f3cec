// Internal to quant.cpp and its instruction-set variants: the prepared-activation layout and the
// kernel table chosen at run time. Not part of the engine's interface.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "quant.h"

namespace ggraph {
namespace quant_impl {

// A prepared column for 32-element block formats (ActLayout::kQ8) of k elements in nb = k/32
// blocks:
//   int8  q[64 * n_pairs]   blocks in pairs (2p, 2p+1), each pair as 64 bytes:
//                           [2p: 0..15][2p+1: 0..15][2p: 16..31][2p+1: 16..31]
//                           (a Q4 block's low nibbles are its elements 0..15, so one 32-byte
//                           load of both blocks' low nibbles lines up with one load here)
//   float ds[2 * n_groups4] per block its scale d = amax/127 and sum s = d * sum(q), interleaved
// n_pairs = ceil(nb / 2) and n_groups4 = nb rounded up to 4; the padding is zero.
// A prepared column for float weights is k floats followed by zeros up to a multiple of 8.
// Both sizes (and the kQ8K one below) are rounded up to 64 bytes so consecutive columns stay
// cache-line aligned.
constexpr int64_t kActAlign = 64;
inline int64_t act_pairs(int64_t k) { return (k / 32 + 1) / 2; }
inline int64_t act_blocks4(int64_t k) { return (k / 32 + 3) / 4 * 4; }
inline size_t round_to_align(int64_t bytes) {
  return static_cast<size_t>((bytes + kActAlign - 1) / kActAlign * kActAlign);
}
inline size_t q8_act_size(int64_t k) {
  return round_to_align(64 * act_pairs(k) + 8 * act_blocks4(k));
}
inline size_t f32_act_size(int64_t k) { return round_to_align((k + 7) / 8 * 8 * 4); }
// Byte offset of element j (0..31) of block b in the q array.
inline int64_t act_q_offset(int64_t b, int j) {
  return 64 * (b / 2) + 16 * (b % 2) + (j < 16 ? j : j + 16);
}
inline const float* act_ds(const void* act, int64_t k) {
  return reinterpret_cast<const float*>(static_cast<const uint8_t*>(act) + 64 * act_pairs(k));
}

// A prepared column for K-quant weights (ActLayout::kQ8K) of k elements in ns = k/256
// super-blocks, each quantized with one scale:
//   int8  q[k]            the values in plain order
//   float d[ns]           per super-block its scale amax/127 (NaN if it holds Inf or NaN)
//   int16 bsums[16 * ns]  per 16 values their sum (the K-quants' minimums are dotted with these)
inline int64_t q8k_blocks(int64_t k) { return k / 256; }
inline size_t q8k_act_size(int64_t k) { return round_to_align(k + 4 * (k / 256) + 32 * (k / 256)); }
inline const float* q8k_d(const void* act, int64_t k) {
  return reinterpret_cast<const float*>(static_cast<const uint8_t*>(act) + k);
}
inline const int16_t* q8k_bsums(const void* act, int64_t k) {
  return reinterpret_cast<const int16_t*>(static_cast<const uint8_t*>(act) + k + 4 * (k / 256));
}

using TileFn = void (*)(int64_t k, const uint8_t* w, size_t w_stride, int n_rows,
                        const uint8_t* act, size_t act_stride, int n_cols, float* out,
                        size_t out_stride);
using PrepareFn = void (*)(const float* x, void* dst, int64_t k);
using ToFloatFn = void (*)(const void* blocks, float* dst, int64_t n_blocks);

// Decoders named by the type table (quant.cpp), bit for bit ggml's dequantize_row_*.
void to_float_f32(const void* blocks, float* dst, int64_t n);
void to_float_f16(const void* blocks, float* dst, int64_t n);
void to_float_bf16(const void* blocks, float* dst, int64_t n);
void to_float_q4_0(const void* blocks, float* dst, int64_t n);
void to_float_q4_1(const void* blocks, float* dst, int64_t n);
void to_float_q5_0(const void* blocks, float* dst, int64_t n);
void to_float_q5_1(const void* blocks, float* dst, int64_t n);
void to_float_q8_0(const void* blocks, float* dst, int64_t n);
void to_float_q2_k(const void* blocks, float* dst, int64_t n);
void to_float_q3_k(const void* blocks, float* dst, int64_t n);
void to_float_q4_k(const void* blocks, float* dst, int64_t n);
void to_float_q5_k(const void* blocks, float* dst, int64_t n);
void to_float_q6_k(const void* blocks, float* dst, int64_t n);
void to_float_iq4_nl(const void* blocks, float* dst, int64_t n);
void to_float_iq4_xs(const void* blocks, float* dst, int64_t n);

// The 16 levels of IQ4_NL and IQ4_XS (ggml's kvalues_iq4nl).
constexpr int8_t kIQ4Levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                   1,    13,   25,  38,  53,  69,  89,  113};

// quant.h's attention_rows_heads (attention_rows: H = 1).
using AttnRowsFn = void (*)(const float* q, int R, int H, int hd, const float* k, int64_t ks,
                            const float* v, int64_t vs, int n, const int* b, const int* e,
                            float scale, float* scores, float* mx, float* sum, float* acc);
// The same over an F16 cache, read in place (element strides), for H heads of R rows each.
using AttnRowsF16Fn = void (*)(const float* q, int R, int H, int hd, const uint16_t* k, int64_t ks,
                               const uint16_t* v, int64_t vs, int n, const int* b, const int* e,
                               float scale, float* scores, float* mx, float* sum, float* acc);
// quant.h's glu_mul.
using GluMulFn = void (*)(const float* g, const float* u, float* y, int64_t n, bool gelu);
// n floats to F16, each as f32_to_f16 gives it.
using F16FromFloatFn = void (*)(const float* src, uint16_t* dst, int64_t n);
namespace {
// The argument a of glu_mul's sigmoid: g for SiLU, 2 sqrt(2 / pi) (g + 0.044715 g^3) for GELU's
// tanh form (0.5 (1 + tanh(z)) is sigmoid(2 z)).
inline float glu_arg(float g, bool gelu) {
  return gelu ? 1.5957691216057308f * (g + 0.044715f * g * g * g) : g;
}
// quant.h's glu_mul of one element (internal linkage: each kernel set compiles its own copy).
inline float glu_mul_one(float g, float u, bool gelu) {
  const float x = std::min(std::max(-glu_arg(g, gelu), -87.0f), 88.0f);
  // The nearest integer m to x log2(e) (by adding and taking away 1.5 * 2^23), then r = x - m ln 2
  // with ln 2 in two parts (m times the first is exact), |r| <= ln(2) / 2.
  const float m = (x * 1.4426950408889634f + 12582912.0f) - 12582912.0f;
  const float r = (x - m * 0.693145751953125f) - m * 1.428606765330187e-06f;
  const float p =
      1.0f +
      r * (1.0f + r * (0.5f + r * (0.16666667f +
                                   r * (0.041666668f + r * (0.008333334f + r * 0.0013888889f)))));
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(m) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return g / (1.0f + p * scale) * u;
}
}  // namespace
// One attention row's softmax over its keys [b, e) of the n scores in w: the max in *mx and the
// sum of exp(w - max) in *sum (-inf and 0 when the row has no keys); w becomes the weights, 0
// outside [b, e).
void softmax_row(float* w, int n, int b, int e, float* mx, float* sum);
// The portable attention rows, for every head size.
void attn_rows_portable(const float* q, int R, int hd, const float* k, int64_t ks, const float* v,
                        int64_t vs, int n, const int* b, const int* e, float scale, float* scores,
                        float* mx, float* sum, float* acc);

constexpr int kTypeSlots = 40;  // ggml type ids are below this
constexpr int kActLayouts = 4;  // ActLayout values
inline int slot(DType t) { return static_cast<int>(t); }
inline int slot(ActLayout a) { return static_cast<int>(a); }

// A kernel set. A null entry of a vector set means that set runs the scalar kernel for it; the
// prepared activations must be the same bytes in every set.
struct Kernels {
  const char* features;            // what cpu_features() reports while this set is in use
  TileFn tile[kTypeSlots];         // by weight type id
  PrepareFn prepare[kActLayouts];  // by activation layout
  // Decoders giving the type table's bits faster (the KV cache's rows, read every step); null:
  // the table's own.
  ToFloatFn to_float[kTypeSlots];
  // Attention rows for heads a multiple of 8 wide; null: the portable kernel.
  AttnRowsFn attn_rows;
  // The same over an F16 cache in place; null: the caller decodes its rows to floats first.
  AttnRowsF16Fn attn_rows_f16;
  // The gated unit's act(g) * u; null: the portable loop.
  GluMulFn glu_mul;
  // F16 rows (the KV cache's stores); null: f32_to_f16 a value at a time.
  F16FromFloatFn f16_from_float;
};

// The portable kernels (quant.cpp).
const Kernels& scalar_kernels();
// Kernels for x86 instruction sets (quant.cpp), or nullptr where they were not compiled in or the
// running CPU lacks them.
const Kernels* avx2_kernels();    // AVX2 + FMA + F16C (quant_avx2.cpp)
const Kernels* avx512_kernels();  // the same plus AVX512 F/BW/VL/VNNI (quant_avx512.cpp)
const Kernels* amx_kernels();     // the same with AMX int8 tile products (quant_amx.cpp)
// The tables themselves, built by code compiled for their instruction sets (nullptr where the
// compiler lacks them): only the functions above, which check the running CPU (and for AMX the
// OS's permission) first, call them.
const Kernels* avx2_table();
const Kernels* avx512_table();
const Kernels* amx_table();
// Whether the running CPU can run a table (the scalar one always).
bool cpu_supports(const Kernels* kernels);
// Makes mul_mat_tile and prepare_act use `kernels`; nullptr restores the best the CPU supports.
// For tests and benchmarks that compare instruction sets.
void use_kernels(const Kernels* kernels);

}  // namespace quant_impl
}  // namespace ggraph
