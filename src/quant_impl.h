// Internal to quant.cpp and its instruction-set variants: the prepared-activation layout and the
// kernel table chosen at run time. Not part of the engine's interface.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ggraph {
namespace quant_impl {

// A prepared column for quantized weights (Q8_0, Q4_0, Q4_1) of k elements in nb = k/32 blocks:
//   int8  q[64 * n_pairs]   blocks in pairs (2p, 2p+1), each pair as 64 bytes:
//                           [2p: 0..15][2p+1: 0..15][2p: 16..31][2p+1: 16..31]
//                           (a Q4 block's low nibbles are its elements 0..15, so one 32-byte
//                           load of both blocks' low nibbles lines up with one load here)
//   float ds[2 * n_groups4] per block its scale d = amax/127 and sum s = d * sum(q), interleaved
// n_pairs = ceil(nb / 2) and n_groups4 = nb rounded up to 4; the padding is zero.
// A prepared column for float weights is k floats followed by zeros up to a multiple of 8.
// Both sizes are rounded up to 64 bytes so consecutive columns stay cache-line aligned.
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
// Kernels for x86 instruction sets, or nullptr where they were not compiled in; the caller checks
// that the running CPU supports them.
const Kernels* avx2_kernels();    // AVX2 + FMA + F16C (quant_avx2.cpp)
const Kernels* avx512_kernels();  // the same plus AVX512 F/BW/VL/VNNI (quant_avx512.cpp)
// Whether the running CPU can run a table (the scalar one always).
bool cpu_supports(const Kernels* kernels);
// Makes mul_mat_tile and prepare_act use `kernels`; nullptr restores the best the CPU supports.
// For tests and benchmarks that compare instruction sets.
void use_kernels(const Kernels* kernels);

}  // namespace quant_impl
}  // namespace ggraph
