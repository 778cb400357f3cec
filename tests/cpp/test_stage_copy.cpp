// The tensor-core products' stage copies (cuda/stage_copy.h) on the host: every thread's copies
// against the copy's definition (chunk ch of row r from row0 + r's bytes at ch * BYTES, k's
// block b0 on, to dst(r, ch); zeros past the rows with data and past k's end), for every tile
// the kernels take.
#include <gtest/gtest.h>

#include <cstdint>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "cuda/stage_copy.h"

namespace gc = ggraph::cuda;

namespace {

struct Copy {
  long to, from;  // offsets from the stage buffer and from the source
  int bytes;
};

template <int R, int C, int B, int A, class Dst>
void check_copies(Dst dst, const std::string& name) {
  constexpr int kThreads = 256;
  static const uint8_t src[1] = {};
  uint8_t buf[1];
  int failures = 0;
  for (size_t stride : {size_t(C) * B * 3, size_t(1152) * 8})
    for (int row0 : {0, 128})
      for (int rows : {R, R / 2, 7, R + 5, 0})
        for (int nb : {64, 100})
          for (int b0 : {0, 96, 128}) {
            std::set<std::pair<int, int>> seen;
            for (int tid = 0; tid < kThreads; ++tid) {
              const gc::StageCopy<R, C, B, A, kThreads> copy(src, stride, row0, rows, tid);
              std::vector<Copy> got;
              copy.copies(buf, b0, nb, tid, dst, [&](uint8_t* to, const uint8_t* from, int n) {
                got.push_back({long(to - buf), long(from - src), n});
              });
              const int r0 = tid / C, ch = tid % C;
              for (size_t i = 0; i < got.size(); ++i) {
                const int r = r0 + int(i) * (kThreads / C);
                const bool data = r < rows && b0 + ch * B / A < nb;
                const Copy want{
                    dst(r, ch),
                    data ? long((size_t(row0) + r) * stride + ch * B + size_t(b0) * A) : 0,
                    data ? B : 0};
                const Copy& g = got[i];
                if ((r >= R || !seen.insert({r, ch}).second || g.to != want.to ||
                     g.from != want.from || g.bytes != want.bytes) &&
                    failures++ < 3)
                  ADD_FAILURE() << name << ": thread " << tid << ", row " << r << ", chunk " << ch
                                << " (stride " << stride << ", row0 " << row0 << ", rows " << rows
                                << ", nb " << nb << ", b0 " << b0 << "): to " << g.to << " from "
                                << g.from << " bytes " << g.bytes << ", expected to " << want.to
                                << " from " << want.from << " bytes " << want.bytes;
              }
            }
            // Every chunk of every row of the grid, each by one thread.
            if (seen.size() != size_t(R) * C && failures++ < 3)
              ADD_FAILURE() << name << ": " << seen.size() << " chunks copied, expected " << R * C;
          }
  EXPECT_EQ(failures, 0) << name;
}

// Rows r and r + 8 a fixed distance apart, whatever the chunk: what StageCopy takes of a layout.
template <class Dst>
void check_layout(Dst dst, int chunks, const std::string& name) {
  const int step = dst(8, 0) - dst(0, 0);
  for (int r = 0; r < 64; ++r)
    for (int ch = 0; ch < chunks; ++ch)
      ASSERT_EQ(dst(r + 8, ch) - dst(r, ch), step) << name << ": row " << r << ", chunk " << ch;
}

}  // namespace

TEST(StageCopy, WeightsOfEveryTile) {
  // Quants (Q4_0, Q4_1, Q4_K: 16 bytes a block; Q8_0: 32) of the tiles of both kernels: 16 rows
  // of 32 blocks a stage, 32 of 16 and of 8, 64 and 128 of 8.
  check_copies<16, 32, 16, 16>(gc::SwizzledRows<512>{}, "quants, 16 rows, 32 blocks");
  check_copies<16, 64, 16, 32>(gc::SwizzledRows<1024>{}, "Q8_0 quants, 16 rows, 32 blocks");
  check_copies<32, 16, 16, 16>(gc::SwizzledRows<256>{}, "quants, 32 rows, 16 blocks");
  check_copies<32, 32, 16, 32>(gc::SwizzledRows<512>{}, "Q8_0 quants, 32 rows, 16 blocks");
  check_copies<32, 8, 16, 16>(gc::SwizzledRows<128>{}, "quants, 32 rows, 8 blocks");
  check_copies<64, 8, 16, 16>(gc::SwizzledRows<128>{}, "quants, 64 rows, 8 blocks");
  check_copies<128, 8, 16, 16>(gc::SwizzledRows<128>{}, "quants, 128 rows, 8 blocks");
  check_copies<128, 16, 16, 32>(gc::SwizzledRows<256>{}, "Q8_0 quants, 128 rows, 8 blocks");
  // Scales: Q4_0's and Q8_0's 2 bytes a block and Q4_1's 4, in 4-byte copies; Q4_K's 16-byte
  // records of 256-blocks.
  check_copies<16, 16, 4, 2>(gc::PlainRows<64, 4>{}, "Q4_0 scales, 16 rows, 32 blocks");
  check_copies<32, 8, 4, 2>(gc::PlainRows<32, 4>{}, "Q4_0 scales, 32 rows, 16 blocks");
  check_copies<32, 4, 4, 2>(gc::PlainRows<16, 4>{}, "Q4_0 scales, 32 rows, 8 blocks");
  check_copies<64, 4, 4, 2>(gc::PlainRows<16, 4>{}, "Q4_0 scales, 64 rows, 8 blocks");
  check_copies<128, 4, 4, 2>(gc::PlainRows<16, 4>{}, "Q4_0 scales, 128 rows, 8 blocks");
  check_copies<16, 32, 4, 4>(gc::PlainRows<128, 4>{}, "Q4_1 scales, 16 rows, 32 blocks");
  check_copies<32, 16, 4, 4>(gc::PlainRows<64, 4>{}, "Q4_1 scales, 32 rows, 16 blocks");
  check_copies<32, 8, 4, 4>(gc::PlainRows<32, 4>{}, "Q4_1 scales, 32 rows, 8 blocks");
  check_copies<64, 8, 4, 4>(gc::PlainRows<32, 4>{}, "Q4_1 scales, 64 rows, 8 blocks");
  check_copies<128, 8, 4, 4>(gc::PlainRows<32, 4>{}, "Q4_1 scales, 128 rows, 8 blocks");
  check_copies<16, 4, 16, 2>(gc::PlainRows<64, 16>{}, "Q4_K records, 16 rows, 32 blocks");
  check_copies<32, 2, 16, 2>(gc::PlainRows<32, 16>{}, "Q4_K records, 32 rows, 16 blocks");
  check_copies<32, 1, 16, 2>(gc::PlainRows<16, 16>{}, "Q4_K records, 32 rows, 8 blocks");
  check_copies<64, 1, 16, 2>(gc::PlainRows<16, 16>{}, "Q4_K records, 64 rows, 8 blocks");
  check_copies<128, 1, 16, 2>(gc::PlainRows<16, 16>{}, "Q4_K records, 128 rows, 8 blocks");
}

TEST(StageCopy, ActivationsOfEveryTile) {
  // The half kernel's activation in half: 8 columns of 32 blocks a stage, 16 of 16, 32 and 64
  // of 8.
  check_copies<8, 128, 16, 64>(gc::HalfActColumns<2048>{}, "half activation, 8 columns");
  check_copies<16, 64, 16, 64>(gc::HalfActColumns<1024>{}, "half activation, 16 columns");
  check_copies<32, 32, 16, 64>(gc::HalfActColumns<512>{}, "half activation, 32 columns");
  check_copies<64, 32, 16, 64>(gc::HalfActColumns<512>{}, "half activation, 64 columns");
  // The warpgroup kernel's: 32 and 64 columns of 8 blocks in swizzled 64-element segments.
  check_copies<32, 32, 16, 64>(gc::SwizzledKSegments<32>{}, "K segments, 32 columns");
  check_copies<64, 32, 16, 64>(gc::SwizzledKSegments<64>{}, "K segments, 64 columns");
  // The int8 kernel's 8-bit values (32 bytes a block) and (d, d * sum) pairs (8 bytes a block).
  check_copies<8, 64, 16, 32>(gc::SwizzledRows<1024>{}, "8-bit activation, 8 columns");
  check_copies<16, 32, 16, 32>(gc::SwizzledRows<512>{}, "8-bit activation, 16 columns");
  check_copies<32, 16, 16, 32>(gc::SwizzledRows<256>{}, "8-bit activation, 32 columns");
  check_copies<64, 16, 16, 32>(gc::SwizzledRows<256>{}, "8-bit activation, 64 columns");
  check_copies<8, 32, 8, 8>(gc::PlainRows<256, 8>{}, "pairs, 8 columns");
  check_copies<16, 16, 8, 8>(gc::PlainRows<128, 8>{}, "pairs, 16 columns");
  check_copies<32, 8, 8, 8>(gc::PlainRows<64, 8>{}, "pairs, 32 columns");
  check_copies<64, 8, 8, 8>(gc::PlainRows<64, 8>{}, "pairs, 64 columns");
}

TEST(StageCopy, LayoutsPlaceRowsEightApartAtAFixedDistance) {
  check_layout(gc::SwizzledRows<128>{}, 8, "swizzled rows");
  check_layout(gc::PlainRows<16, 4>{}, 4, "plain rows");
  check_layout(gc::HalfActColumns<512>{}, 32, "half activation");
  check_layout(gc::SwizzledKSegments<64>{}, 32, "K segments");
}

// wgmma's 128-byte swizzle, applied by the hardware to an address: bits 4-6 XORed with bits 7-9.
// SwizzledKSegments places each chunk where that swizzle puts the chunk of the plain K-major
// layout (a segment's column at 128 bytes a column, its chunks in order), the segments' starts
// being multiples of 1024.
TEST(StageCopy, KSegmentsAreTheHardwareSwizzleOfTheKMajorLayout) {
  const gc::SwizzledKSegments<64> at;
  for (int col = 0; col < 64; ++col)
    for (int ch = 0; ch < 32; ++ch) {
      const int plain = (ch >> 3) * 64 * 128 + col * 128 + (ch & 7) * 16;
      const int swizzled = plain ^ (((plain >> 7) & 7) << 4);
      ASSERT_EQ(at(col, ch), swizzled) << "column " << col << ", chunk " << ch;
    }
}

// The half kernel's B loads (mat_mul_qh_kernel): lane (g, t) of a warp reads 8 bytes of column g
// of a column tile, 8 (t & 1) bytes into chunk (c + t / 2) ^ act_swizzle(g) for an even c, a
// half-warp (four columns) at a time. Every half-warp's 32 words fall in the 32 banks once.
TEST(StageCopy, HalfActivationLoadsOfAHalfWarpTakeEveryBankOnce) {
  constexpr int kColumnBytes = 512;  // a column's stage (a multiple of the 128 bytes of 32 banks)
  const gc::HalfActColumns<kColumnBytes> at;
  for (int c = 0; c < 16; c += 2)
    for (int half = 0; half < 2; ++half) {
      std::set<int> banks;
      for (int lane = 16 * half; lane < 16 * half + 16; ++lane) {
        const int g = lane / 4, t = lane % 4;
        const int chunk_at = at(g, c + t / 2);  // the chunk's place, swizzled
        for (int word = 0; word < 2; ++word)
          banks.insert((chunk_at + 8 * (t & 1) + 4 * word) / 4 % 32);
      }
      EXPECT_EQ(banks.size(), 32u) << "chunk pair " << c << ", half-warp " << half;
    }
}
