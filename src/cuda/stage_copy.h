// A thread's share of a stage's asynchronous copies in the tensor-core products' pipelines
// (matmul_q.cu), and where a stage's chunks lie in shared memory. Plain C++ as well: the host
// tests check every copy's place, source and size (tests/cpp/test_stage_copy.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "quant.h"  // GGRAPH_HD

// A loop the device compiler unrolls (the host compiler takes it as it is).
#if defined(__CUDA_ARCH__)
#define GGRAPH_UNROLL _Pragma("unroll")
#else
#define GGRAPH_UNROLL
#endif

namespace ggraph::cuda {

// Where chunk ch of row r lies in a stage. StageCopy relies on each layout placing row r + 8 a
// fixed distance after row r, whatever the chunk: they depend on a row's low three bits only,
// beside a multiple of the row.

// Rows of ROW bytes whose 16-byte chunks are swizzled by the row's low three bits, so that the
// eight row addresses of an ldmatrix fall in distinct banks (the weights' quants, the int8
// kernel's activation).
template <int ROW>
struct SwizzledRows {
  GGRAPH_HD int operator()(int r, int ch) const { return r * ROW + ((ch ^ (r & 7)) * 16); }
};

// The warpgroup kernel's activation (wgmma's B operand, K-major with the 128-byte swizzle):
// COLS columns of a stage, their k in 64-element segments; a segment is COLS rows of 128 bytes
// (the column's 64 halves), its 16-byte chunks XORed by the column's low three bits, so that
// eight columns make one 1024-byte swizzle atom. Chunk ch of column col is chunk ch % 8 of
// segment ch / 8.
template <int COLS>
struct SwizzledKSegments {
  GGRAPH_HD int operator()(int col, int ch) const {
    return (ch >> 3) * (COLS * 128) + col * 128 + (((ch & 7) ^ (col & 7)) * 16);
  }
};

// Rows of ROW bytes of BYTES-byte chunks in order (scale records, activation pairs).
template <int ROW, int BYTES>
struct PlainRows {
  GGRAPH_HD int operator()(int r, int ch) const { return r * ROW + ch * BYTES; }
};

// The half kernel's swizzle of activation column col's 16-byte chunks (matmul_q.cu says why).
GGRAPH_HD int act_swizzle(int col) { return ((col & 3) << 1) | ((col >> 2) & 1); }

// The half kernel's activation: columns of ROW bytes, chunk c at c ^ act_swizzle(col).
template <int ROW>
struct HalfActColumns {
  GGRAPH_HD int operator()(int col, int ch) const {
    return col * ROW + ((ch ^ act_swizzle(col)) * 16);
  }
};

// A thread's share of a stage's copies: a grid of R rows (weight rows or activation columns) by
// kChunks chunks of BYTES bytes, from a source whose rows lie `stride` bytes apart and in which
// each 32-block of k takes kAdvance bytes of a row. Thread tid copies chunk ch = tid % kChunks of
// rows tid / kChunks + i * kStep. What its copies share is worked out once: where its first
// chunk lies, how many of its rows hold data; a stage then costs, a chunk, a pointer step, a test
// and the copy (worked out again at each stage, by divisions and 64-bit products, the loads'
// integer work was most of the int8 kernel's instructions at 8 columns, and a seventh of the half
// kernel's stage at 64 columns). Where a thread's rows are a multiple of 8 apart, each copy's
// place is the first's plus a constant (the layouts above). Rows from `rows` on and blocks from
// k's end on arrive as zeros.
template <int R, int kChunks, int BYTES, int kAdvance, int kThreads>
struct StageCopy {
  static constexpr int kBytes = BYTES;
  // Rows from one of a thread's chunks to the next.
  static constexpr int kStep = kThreads / kChunks;
  static constexpr int kIters = (R + kStep - 1) / kStep;
  static_assert(kThreads % kChunks == 0, "a thread copies the same chunk of each of its rows");
  static_assert((kChunks * BYTES) % kAdvance == 0, "a stage's row holds whole 32-blocks");

  const uint8_t* base;   // the source (a valid address for copies that read nothing)
  const uint8_t* first;  // the thread's first chunk, stage at block 0
  size_t step;           // source bytes from one of a thread's chunks to the next
  int left;              // rows with data from the thread's first on (may be 0 or less)

  GGRAPH_HD StageCopy(const void* src, size_t stride, int row0, int rows_with_data, int tid)
      : base(static_cast<const uint8_t*>(src)),
        first(base + (static_cast<size_t>(row0) + tid / kChunks) * stride + tid % kChunks * BYTES),
        step(stride * kStep),
        left(rows_with_data - tid / kChunks) {}

  // Thread tid's copies of the stage of blocks b0 .. (nb: k's blocks) into buf: chunk ch of row
  // r to buf + dst(r, ch), each by copy(to, from, bytes read; the rest of BYTES zeros).
  template <class Dst, class Copy>
  GGRAPH_HD void copies(uint8_t* buf, int b0, int nb, int tid, Dst dst, Copy&& copy) const {
    const int r0 = tid / kChunks, ch = tid % kChunks;
    const bool in_k = b0 + ch * BYTES / kAdvance < nb;
    const uint8_t* p = first + static_cast<size_t>(b0) * kAdvance;
    // The copies' places: the first's plus a constant (folded at compile time) where the rows
    // are a multiple of 8 apart.
    constexpr bool kFixed = kStep % 8 == 0;
    uint8_t* const at = buf + dst(r0, ch);
    GGRAPH_UNROLL
    for (int i = 0; i < kIters; ++i) {
      const int r = r0 + i * kStep;
      if (R % kStep != 0 && r >= R) break;  // a grid smaller than the block, or its last rows
      const bool ok = in_k && i * kStep < left;
      uint8_t* const to = kFixed ? at + i * (dst(kStep, 0) - dst(0, 0)) : buf + dst(r, ch);
      copy(to, ok ? p : base, ok ? BYTES : 0);
      p += step;
    }
  }
};

}  // namespace ggraph::cuda

#undef GGRAPH_UNROLL
