// How quantized weights lie in device memory (the split layout). At upload the GGUF blocks of a
// matrix are rearranged into three arrays, each row's part contiguous:
//   quants  per 32 elements (a "piece"): 16 bytes of low 4 bits, byte j holding element j in its
//           low nibble and element j + 16 in its high nibble (Q8_0: the 32 int8 quants, two
//           16-byte pieces);
//   high    per piece, the bits above the low 4: 4 bytes for the 5-bit formats (Q5_0, Q5_1,
//           Q5_K), 8 for Q6_K, none for the others; laid out so that one shift and one mask give
//           the bits of four elements in place (split_high_offset);
//   scales  per GGUF block, the block's scale bytes copied as they are (f16 d; d and m; the
//           K-quants' d, dmin and packed 6-bit scales; Q6_K's int8 scales and d; IQ4_XS's d
//           and packed 6-bit scales), but for Q2_K and Q3_K (split_record): Q2_K's 16 scale and
//           minimum bytes then d and dmin; Q3_K's 16 scales unpacked to int8 then d, the record
//           of Q6_K. IQ4_NL and IQ4_XS keep their 4-bit level indices as the quants (iq4_level
//           gives the level).
// A matrix takes exactly its GGUF bytes, but for Q2_K and Q3_K, whose 2- and 3-bit quants take a
// 4-bit piece each (4.6 and 4.5 bits a weight where the file has 2.6 and 3.4: their pieces go
// through the same kernels as every other format's). Quants start on 16-byte boundaries, so the
// mat-vec lanes load them side by side with 16-byte loads; every K-quant sub-block of 32 is one
// piece, shaped like a Q4_0 block, which is what lets one kernel serve every format. Plain C++ as
// well: the host tests decode the split layout and compare it with the CPU's dequantizer bit for
// bit.
#pragma once

#include <cstddef>
#include <cstdint>

#include "quant.h"

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#endif

namespace ggraph::cuda {

struct SplitFormat {
  int block_bytes;  // GGUF block; 0 for a type that is not split
  int block_elems;  // 32 or 256
  int quant_bytes;  // per 32 elements: 16 (low 4 bits) or 32 (Q8_0)
  int high_bytes;   // per 32 elements: 0, 4 (a fifth bit) or 8 (a fifth and sixth)
  int scale_bytes;  // per block
  int scale_at;     // where the scale bytes start in the GGUF block (-1: built by split_record)
};
constexpr SplitFormat kSplitQ4_0{18, 32, 16, 0, 2, 0};
constexpr SplitFormat kSplitQ4_1{20, 32, 16, 0, 4, 0};
constexpr SplitFormat kSplitQ5_0{22, 32, 16, 4, 2, 0};
constexpr SplitFormat kSplitQ5_1{24, 32, 16, 4, 4, 0};
constexpr SplitFormat kSplitQ8_0{34, 32, 32, 0, 2, 0};
constexpr SplitFormat kSplitQ2_K{84, 256, 16, 0, 20, -1};
constexpr SplitFormat kSplitQ3_K{110, 256, 16, 0, 18, -1};
constexpr SplitFormat kSplitQ4_K{144, 256, 16, 0, 16, 0};
constexpr SplitFormat kSplitQ5_K{176, 256, 16, 4, 16, 0};
constexpr SplitFormat kSplitQ6_K{210, 256, 16, 8, 18, 192};
constexpr SplitFormat kSplitIQ4_NL{18, 32, 16, 0, 2, 0};
constexpr SplitFormat kSplitIQ4_XS{136, 256, 16, 0, 8, 0};

// The split format of a weight type; block_bytes 0 for types that are not split.
constexpr GGRAPH_HD SplitFormat split_format(DType t) {
  switch (t) {
    case DType::Q4_0:
      return kSplitQ4_0;
    case DType::Q4_1:
      return kSplitQ4_1;
    case DType::Q5_0:
      return kSplitQ5_0;
    case DType::Q5_1:
      return kSplitQ5_1;
    case DType::Q8_0:
      return kSplitQ8_0;
    case DType::Q2_K:
      return kSplitQ2_K;
    case DType::Q3_K:
      return kSplitQ3_K;
    case DType::Q4_K:
      return kSplitQ4_K;
    case DType::Q5_K:
      return kSplitQ5_K;
    case DType::Q6_K:
      return kSplitQ6_K;
    case DType::IQ4_NL:
      return kSplitIQ4_NL;
    case DType::IQ4_XS:
      return kSplitIQ4_XS;
    default:
      return SplitFormat{0, 0, 0, 0, 0, 0};
  }
}

// Offsets of the three arrays in a matrix of n_blocks blocks.
GGRAPH_HD size_t split_pieces(const SplitFormat& f, size_t n_blocks) {
  return n_blocks * static_cast<size_t>(f.block_elems / 32);
}
GGRAPH_HD size_t split_high_offset(const SplitFormat& f, size_t n_blocks) {
  return split_pieces(f, n_blocks) * static_cast<size_t>(f.quant_bytes);
}
GGRAPH_HD size_t split_scales_offset(const SplitFormat& f, size_t n_blocks) {
  return split_high_offset(f, n_blocks) + split_pieces(f, n_blocks) * f.high_bytes;
}
// The bytes of the three arrays together.
GGRAPH_HD size_t split_bytes(const SplitFormat& f, size_t n_blocks) {
  return split_scales_offset(f, n_blocks) + n_blocks * static_cast<size_t>(f.scale_bytes);
}

// Where the high bits of element t (0..31) of a piece lie. Element t is byte b = t % 4 of word
// w = t % 16 / 4 of its half (t / 16) of the quants. 5-bit: one word, the bit at 8b + 4 + w for
// the first half, 8b + w for the second. Q6_K: a word per half, two bits at 8b + {4, 6, 0, 2}[w].
// So the bits of word w's four elements are one shift away from bits 4.. of each byte.
struct HighBits {
  int word, shift;
};
GGRAPH_HD HighBits split_high_bits(int high_bytes, int t) {
  const int half = t / 16, w = t % 16 / 4, b = t % 4;
  if (high_bytes == 4) return {0, 8 * b + (half ? 0 : 4) + w};
  constexpr int kPos[4] = {4, 6, 0, 2};
  return {half, 8 * b + kPos[w]};
}

// The unsigned quant of element e of a GGUF block (Q8_0: the int8 as stored).
GGRAPH_HD int gguf_quant(DType t, const uint8_t* blk, int e) {
  switch (t) {
    case DType::Q8_0:
      return static_cast<int8_t>(blk[2 + e]);
    case DType::Q4_0:
    case DType::IQ4_NL:
    case DType::Q4_1: {
      const uint8_t* qs = blk + (t == DType::Q4_1 ? 4 : 2);
      return e < 16 ? qs[e] & 15 : qs[e - 16] >> 4;
    }
    case DType::IQ4_XS: {  // sub-block e / 32 laid out as an IQ4_NL block's quants
      const uint8_t* qs = blk + 8 + 16 * (e / 32);
      const int l = e % 32;
      return l < 16 ? qs[l] & 15 : qs[l - 16] >> 4;
    }
    case DType::Q5_0:
    case DType::Q5_1: {
      const int at = t == DType::Q5_0 ? 2 : 4;
      const uint8_t* qs = blk + at + 4;
      const int lo = e < 16 ? qs[e] & 15 : qs[e - 16] >> 4;
      return lo | (((blk[at + e / 8] >> (e % 8)) & 1) << 4);
    }
    case DType::Q2_K:
      return (blk[16 + 32 * (e / 128) + e % 32] >> (2 * (e % 128 / 32))) & 3;
    case DType::Q3_K: {  // the low 2 bits and the third, unsigned (the value is this minus 4)
      const int h = e / 128, s = e % 128 / 32, l = e % 32;
      return ((blk[32 + 32 * h + l] >> (2 * s)) & 3) | (((blk[l] >> (4 * h + s)) & 1) << 2);
    }
    case DType::Q4_K:
    case DType::Q5_K: {
      const bool five = t == DType::Q5_K;
      const uint8_t* qs = blk + (five ? 48 : 16);
      const int g = e / 64, r = e % 64;
      const int lo = r < 32 ? qs[32 * g + r] & 15 : qs[32 * g + r - 32] >> 4;
      return five ? lo | (((blk[16 + e % 32] >> (e / 32)) & 1) << 4) : lo;
    }
    case DType::Q6_K: {
      const int h = e / 128, s = e % 128 / 32, l = e % 32;
      const uint8_t lo_byte = blk[64 * h + 32 * (s % 2) + l];
      const int lo = s < 2 ? lo_byte & 15 : lo_byte >> 4;
      return lo | (((blk[128 + 32 * h + l] >> (2 * s)) & 3) << 4);
    }
    default:
      return 0;
  }
}

// The scale record of a Q2_K or Q3_K block (the formats whose record is not a copy of one run of
// the block's bytes): Q2_K's scale and minimum bytes, then d and dmin; Q3_K's scales as int8
// (offset removed), then d, which is how Q6_K keeps its own.
GGRAPH_HD void split_record(DType t, const uint8_t* src, uint8_t* rec) {
  if (t == DType::Q2_K) {
    for (int b = 0; b < 16; ++b) rec[b] = src[b];
    for (int b = 0; b < 4; ++b) rec[16 + b] = src[80 + b];
    return;
  }
  for (int j = 0; j < 16; ++j) rec[j] = static_cast<uint8_t>(q3_k_scale(src + 96, j));
  rec[16] = src[108];
  rec[17] = src[109];
}

// Splits the GGUF block at src, block i of a matrix of n_blocks, into the split arrays at dst.
// The quant and high bytes a block owns are written whole (each byte once), so blocks may be
// split in parallel.
GGRAPH_HD void split_block(DType t, const uint8_t* src, size_t i, size_t n_blocks, uint8_t* dst) {
  const SplitFormat f = split_format(t);
  uint8_t* s = dst + split_scales_offset(f, n_blocks) + i * static_cast<size_t>(f.scale_bytes);
  if (f.scale_at < 0)
    split_record(t, src, s);
  else
    for (int b = 0; b < f.scale_bytes; ++b) s[b] = src[f.scale_at + b];
  const int n_pieces = f.block_elems / 32;
  for (int p = 0; p < n_pieces; ++p) {
    const size_t piece = i * n_pieces + p;
    uint8_t* q = dst + piece * f.quant_bytes;
    if (f.quant_bytes == 32) {
      for (int e = 0; e < 32; ++e) q[e] = static_cast<uint8_t>(gguf_quant(t, src, e));
      continue;
    }
    uint32_t high[2] = {0, 0};
    for (int j = 0; j < 16; ++j) {
      const int lo = gguf_quant(t, src, 32 * p + j), hi = gguf_quant(t, src, 32 * p + j + 16);
      q[j] = static_cast<uint8_t>((lo & 15) | ((hi & 15) << 4));
      if (f.high_bytes == 0) continue;
      const HighBits bl = split_high_bits(f.high_bytes, j);
      const HighBits bh = split_high_bits(f.high_bytes, j + 16);
      high[bl.word] |= static_cast<uint32_t>(lo >> 4) << bl.shift;
      high[bh.word] |= static_cast<uint32_t>(hi >> 4) << bh.shift;
    }
    uint8_t* h = dst + split_high_offset(f, n_blocks) + piece * f.high_bytes;
    for (int b = 0; b < f.high_bytes; ++b)
      h[b] = static_cast<uint8_t>(high[b / 4] >> (8 * (b % 4)));
  }
}

// The level of IQ4_NL and IQ4_XS index q (ggml's kvalues_iq4nl), from two 8-byte constants
// (usable in device code, unlike a table).
GGRAPH_HD int iq4_level(int q) {
  constexpr uint64_t kLow = 0xF6EADDCFBFAD9881ull;   // -127 -104 -83 -65 -49 -35 -22 -10
  constexpr uint64_t kHigh = 0x7159453526190D01ull;  // 1 13 25 38 53 69 89 113
  return static_cast<int8_t>(((q < 8 ? kLow : kHigh) >> (8 * (q & 7))) & 0xFF);
}

// IQ4_XS sub-block j's scale (offset by 32 as stored) from its block's record: d, scales_h,
// scales_l.
GGRAPH_HD int iq4_xs_scale(const uint8_t* rec, int j) {
  const int lo = (rec[4 + j / 2] >> (4 * (j % 2))) & 15;
  const int hi = ((rec[2] | (rec[3] << 8)) >> (2 * j)) & 3;
  return (lo | (hi << 4)) - 32;
}

GGRAPH_HD float split_f16_bits(uint16_t bits) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(bits));
#else
  return f16_to_f32(bits);
#endif
}
GGRAPH_HD float split_f16(const uint8_t* p) {
  return split_f16_bits(static_cast<uint16_t>(p[0] | (p[1] << 8)));
}

// What a Q2_K or Q3_K piece's halves dequantize with, value = q * d[h] + m[h] for half h (the
// prompt tiles), from the record words the mat-vec loads (half_scaled_piece_dot).
struct HalfScales {
  float d[2], m[2];
};
GGRAPH_HD HalfScales half_scales(DType t, uint32_t r0, uint32_t r1) {
  HalfScales s{};
  for (int h = 0; h < 2; ++h) {
    const uint32_t b = (r0 >> (8 * h)) & 0xFF;
    if (t == DType::Q3_K) {
      s.d[h] = split_f16_bits(static_cast<uint16_t>(r0 >> 16)) *
               static_cast<float>(static_cast<int8_t>(b));
      s.m[h] = -4.0f * s.d[h];
    } else {
      s.d[h] = split_f16_bits(static_cast<uint16_t>(r1 & 0xFFFF)) * static_cast<float>(b & 15);
      s.m[h] = -split_f16_bits(static_cast<uint16_t>(r1 >> 16)) * static_cast<float>(b >> 4);
    }
  }
  return s;
}

// A Q2_K or Q3_K piece's dot product with 32 activation quants of scale d8, from its integer
// parts: lo, the dot of its low nibbles (elements 0-15) with their quants; hi16, that of its high
// nibbles dotted in place (16 times elements 16-31's dot); sum_lo and sum_hi, the activation
// quants' sums over each half; and the two record words the mat-vec loads for sub-block pair j:
// r0, the pair's bytes (Q2_K: scale in the low nibble, minimum in the high one; Q3_K: int8
// scales) with, for Q3_K, d above them; r1, Q2_K's d and dmin.
GGRAPH_HD float half_scaled_piece_dot(DType t, int lo, int hi16, int sum_lo, int sum_hi,
                                      uint32_t r0, uint32_t r1, float d8) {
  const float d16 = d8 * 0.0625f;
  if (t == DType::Q3_K) {
    // Stored offset by 4: 16 (sc0 (q_lo - 4) a_lo + sc1 (q_hi - 4) a_hi).
    const int sc0 = static_cast<int8_t>(r0 & 0xFF), sc1 = static_cast<int8_t>((r0 >> 8) & 0xFF);
    const int isum = sc0 * (16 * lo - 64 * sum_lo) + sc1 * (hi16 - 64 * sum_hi);
    return split_f16_bits(static_cast<uint16_t>(r0 >> 16)) * d16 * static_cast<float>(isum);
  }
  const int isum = 16 * static_cast<int>(r0 & 15) * lo + static_cast<int>((r0 >> 8) & 15) * hi16;
  const int msum =
      static_cast<int>((r0 >> 4) & 15) * sum_lo + static_cast<int>((r0 >> 12) & 15) * sum_hi;
  return split_f16_bits(static_cast<uint16_t>(r1 & 0xFFFF)) * d16 * static_cast<float>(isum) -
         split_f16_bits(static_cast<uint16_t>(r1 >> 16)) * d8 * static_cast<float>(msum);
}

// Element i of a row in the split layout, q, h and s pointing at the row's quants, high bits and
// scales; the same float bits as the CPU's dequantizer.
GGRAPH_HD float split_elem(DType t, const uint8_t* q, const uint8_t* h, const uint8_t* s,
                           int64_t i) {
  const SplitFormat f = split_format(t);
  const int64_t piece = i / 32;
  const int e = static_cast<int>(i % 32);
  const uint8_t* rec = s + (i / f.block_elems) * f.scale_bytes;
  if (t == DType::Q8_0)
    return static_cast<float>(static_cast<int8_t>(q[piece * 32 + e])) * split_f16(rec);
  const uint8_t* qp = q + piece * 16;
  int v = e < 16 ? qp[e] & 15 : qp[e - 16] >> 4;
  if (f.high_bytes) {
    const HighBits hb = split_high_bits(f.high_bytes, e);
    const uint8_t* hp = h + piece * f.high_bytes + 4 * hb.word;
    const uint32_t word =
        hp[0] | (hp[1] << 8) | (hp[2] << 16) | (static_cast<uint32_t>(hp[3]) << 24);
    v |= static_cast<int>((word >> hb.shift) & (f.high_bytes == 4 ? 1 : 3)) << 4;
  }
  switch (t) {
    case DType::Q4_0:
      return static_cast<float>(v - 8) * split_f16(rec);
    case DType::Q5_0:
      return static_cast<float>(v - 16) * split_f16(rec);
    case DType::Q4_1:
    case DType::Q5_1:
      return static_cast<float>(v) * split_f16(rec) + split_f16(rec + 2);
    case DType::Q4_K:
    case DType::Q5_K: {
      int sc, m;
      k_scale_min(rec + 4, static_cast<int>(i % 256 / 32), &sc, &m);
      const float dl = split_f16(rec) * static_cast<float>(sc);
      const float ml = split_f16(rec + 2) * static_cast<float>(m);
      return dl * static_cast<float>(v) - ml;
    }
    case DType::Q2_K: {
      const uint8_t sc = rec[i % 256 / 16];
      const float dl = split_f16(rec + 16) * static_cast<float>(sc & 15);
      const float ml = split_f16(rec + 18) * static_cast<float>(sc >> 4);
      return dl * static_cast<float>(v) - ml;
    }
    case DType::Q3_K:
    case DType::Q6_K: {
      const int8_t sc = static_cast<int8_t>(rec[i % 256 / 16]);
      return split_f16(rec + 16) * static_cast<float>(sc) *
             static_cast<float>(v - (t == DType::Q6_K ? 32 : 4));
    }
    case DType::IQ4_NL:
      return split_f16(rec) * static_cast<float>(iq4_level(v));
    case DType::IQ4_XS: {
      const float dl =
          split_f16(rec) * static_cast<float>(iq4_xs_scale(rec, static_cast<int>(i % 256 / 32)));
      return dl * static_cast<float>(iq4_level(v));
    }
    default:
      return 0.0f;
  }
}

}  // namespace ggraph::cuda
