// Internal to quant.cpp and its instruction-set variants: the prepared-activation layout and the
// kernel table chosen at run time. Not part of the engine's interface.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ggraph {
namespace quant_impl {

// A prepared column for quantized weights (Q8_0, Q4_0, Q4_1), for k elements in nb = k/32 blocks:
//   int8  q[k]        the 8-bit values, block after block
//   float d[nb_pad]   per block scale (amax / 127), zero past nb
//   float s[nb_pad]   per block d * sum(q), zero past nb
// nb_pad is nb rounded up to 8, so the per-block arrays can be read 8 at a time.
// A prepared column for float weights is k floats followed by zeros up to a multiple of 8.
// Both sizes are rounded up to 64 bytes so consecutive columns stay cache-line aligned.
constexpr int64_t kActAlign = 64;
inline int64_t padded_blocks(int64_t k) { return (k / 32 + 7) / 8 * 8; }
inline size_t q8_act_size(int64_t k) {
  const int64_t bytes = k + 8 * padded_blocks(k);
  return static_cast<size_t>((bytes + kActAlign - 1) / kActAlign * kActAlign);
}
inline size_t f32_act_size(int64_t k) {
  const int64_t bytes = (k + 7) / 8 * 8 * 4;
  return static_cast<size_t>((bytes + kActAlign - 1) / kActAlign * kActAlign);
}
inline const float* act_scales(const void* act, int64_t k) {
  return reinterpret_cast<const float*>(static_cast<const uint8_t*>(act) + k);
}
inline const float* act_sums(const void* act, int64_t k) {
  return act_scales(act, k) + padded_blocks(k);
}

using TileFn = void (*)(int64_t k, const uint8_t* w, size_t w_stride, int n_rows,
                        const uint8_t* act, size_t act_stride, int n_cols, float* out,
                        size_t out_stride);
using PrepareFn = void (*)(const float* x, void* dst, int64_t k);

struct Kernels {
  const char* features;  // what cpu_features() reports while this table is in use
  TileFn f32, f16, bf16, q8_0, q4_0, q4_1;
  PrepareFn prepare_q8;   // quantizes a column into the layout above
  PrepareFn prepare_f32;  // copies a column and zero-pads it
};

// The portable kernels (quant.cpp).
const Kernels& scalar_kernels();
// The AVX2+FMA+F16C kernels (quant_avx2.cpp), or nullptr where they were not compiled in.
// The caller checks that the running CPU supports them.
const Kernels* avx2_kernels();

}  // namespace quant_impl
}  // namespace ggraph
