// How quantized weights lie in device memory. The GGUF blocks (18, 20 or 34 bytes: scale, then
// quants) are split at upload into two arrays of one matrix: every block's quants, 16 or 32
// bytes each, then every block's scale (f16 d; f16 d and m for Q4_1). Quants then start on
// 16-byte boundaries, so the mat-vec lanes load them side by side with 16-byte loads and no
// realignment. Plain C++ as well: the host tests check the split against the CPU's dequantizer.
#pragma once

#include <cstddef>
#include <cstdint>

#include "quant.h"

#if defined(__CUDACC__)
#define GGRAPH_HD __host__ __device__ __forceinline__
#else
#define GGRAPH_HD inline
#endif

namespace ggraph::cuda {

// Per block: GGUF bytes, quant bytes, scale bytes (what leads the GGUF block).
struct SplitFormat {
  int block_bytes;
  int quant_bytes;
  int scale_bytes;
};
constexpr SplitFormat kSplitQ4_0{18, 16, 2};
constexpr SplitFormat kSplitQ4_1{20, 16, 4};
constexpr SplitFormat kSplitQ8_0{34, 32, 2};

// Byte offset of the scales of a matrix of n_blocks blocks (16-byte aligned: quants are 16 or 32).
GGRAPH_HD size_t split_scales_offset(const SplitFormat& f, size_t n_blocks) {
  return n_blocks * static_cast<size_t>(f.quant_bytes);
}

// Splits the GGUF block at src, block i of a matrix of n_blocks, into the split arrays at dst.
GGRAPH_HD void split_block(const SplitFormat& f, const uint8_t* src, size_t i, size_t n_blocks,
                           uint8_t* dst) {
  uint8_t* q = dst + i * static_cast<size_t>(f.quant_bytes);
  uint8_t* s = dst + split_scales_offset(f, n_blocks) + i * static_cast<size_t>(f.scale_bytes);
  for (int b = 0; b < f.scale_bytes; ++b) s[b] = src[b];
  for (int b = 0; b < f.quant_bytes; ++b) q[b] = src[f.scale_bytes + b];
}

// The split format of a weight type; block_bytes 0 for types that are not split.
constexpr GGRAPH_HD SplitFormat split_format(DType t) {
  return t == DType::Q4_0   ? kSplitQ4_0
         : t == DType::Q4_1 ? kSplitQ4_1
         : t == DType::Q8_0 ? kSplitQ8_0
                            : SplitFormat{0, 0, 0};
}

}  // namespace ggraph::cuda
