// Quant blocks inside "superblocks": runs of blocks whose bytes are a whole number of 16-byte
// words, so that a thread can load them with aligned 16-byte loads. Splits such a run, held as
// 32-bit words, into each block's header and quant words. Plain C++: the host tests it too.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define GGRAPH_HD __host__ __device__ __forceinline__
#else
#define GGRAPH_HD inline
#endif

namespace ggraph::cuda {

// BS: bytes per block; H: header bytes (f16 d, or d and m); NQ: 32-bit words of quants.
template <int BS, int H, int NQ, int SB>
struct SuperBlockLayout {
  static constexpr int kBlockBytes = BS;
  static constexpr int kHeaderBytes = H;
  static constexpr int kQuantWords = NQ;
  static constexpr int kBlocks = SB;
  static constexpr int kBytes = BS * SB;
  static constexpr int kWords = kBytes / 4;
  static_assert(kBytes % 16 == 0, "a superblock is a whole number of 16-byte words");
};
using SuperQ4_0 = SuperBlockLayout<18, 2, 4, 8>;  // 144 bytes
using SuperQ4_1 = SuperBlockLayout<20, 4, 4, 4>;  // 80 bytes
using SuperQ8_0 = SuperBlockLayout<34, 2, 8, 8>;  // 272 bytes

// Block b of the superblock in w: its header (the low H bytes of `header`) and quant words.
// With b a constant (an unrolled loop), every index is a constant and w stays in registers.
template <typename L>
GGRAPH_HD void split_block(const uint32_t* w, int b, uint32_t& header, uint32_t* q) {
  const int off = L::kBlockBytes * b;
  // Blocks start at even offsets: either on a word or half-way into one.
  header = off % 4 == 0 ? w[off / 4] : w[off / 4] >> 16;
  const int qs = off + L::kHeaderBytes;
  for (int i = 0; i < L::kQuantWords; ++i) {
    q[i] = qs % 4 == 0 ? w[qs / 4 + i] : (w[qs / 4 + i] >> 16) | (w[qs / 4 + i + 1] << 16);
  }
}

}  // namespace ggraph::cuda
