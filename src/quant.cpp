// Portable half-float conversions, ggml's reference block (de)quantizers, the scalar dot-product
// kernels and the run-time choice between them and the AVX2 kernels.
#include "quant.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.h"
#include "quant_impl.h"

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace ggraph {

namespace {

uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

}  // namespace

float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t mant = h & 0x3ff;
  if (exp == 0x1f) {
    // Inf keeps a zero mantissa; NaN keeps its payload and comes out quiet, as F16C does.
    return bits_float(sign | 0x7f800000 | (mant << 13) | (mant != 0 ? 0x400000 : 0));
  }
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24 is exact in float.
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return bits_float(sign | float_bits(v));
  }
  return bits_float(sign | ((exp + 112) << 23) | (mant << 13));
}

uint16_t f32_to_f16(float f) {
  const uint32_t x = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  const uint32_t abs = x & 0x7fffffff;
  if (abs > 0x7f800000) {
    return static_cast<uint16_t>(sign | 0x7e00 | ((abs >> 13) & 0x3ff));  // quiet NaN
  }
  // 65520 is halfway between the largest half (65504) and 2^16; ties go to the even 2^16 = Inf.
  if (abs >= 0x477ff000) return static_cast<uint16_t>(sign | 0x7c00);
  if (abs < 0x38800000) {
    // Below 2^-14 the result is a multiple of 2^-24: adding 0.5 makes the FPU round at exactly
    // that position (nearest even), and the low mantissa bits are the half's bits.
    const float v = bits_float(abs) + 0.5f;
    return static_cast<uint16_t>(sign | (float_bits(v) - 0x3f000000));
  }
  uint32_t h = (abs >> 13) - (112 << 10);
  const uint32_t rest = abs & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h;  // a carry moves into the exponent
  return static_cast<uint16_t>(sign | h);
}

float bf16_to_f32(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

uint16_t f32_to_bf16(float f) {
  const uint32_t x = float_bits(f);
  if ((x & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((x >> 16) | 0x40);  // quiet NaN
  return static_cast<uint16_t>((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

namespace {

void check_blocks(DType t, int64_t n, int64_t block, const char* what) {
  if (n < 0 || n % block != 0) {
    throw ArgumentError(std::string(what) + " " + type_name(t) + ": expected a multiple of " +
                        std::to_string(block) + " elements, got " + std::to_string(n));
  }
}

[[noreturn]] void not_computable(DType t, const char* what) {
  const TypeTraits* traits = type_traits_or_null(static_cast<uint32_t>(t));
  throw ArgumentError(std::string(what) + ": expected weights of type " + computable_type_names() +
                      ", got " +
                      (traits != nullptr ? std::string(traits->name)
                                         : "type id " + std::to_string(static_cast<uint32_t>(t))));
}

uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// ggml stores (int8_t)(v) clamped to 15; written so that NaN and out-of-range values stay defined.
uint8_t nibble_from(float v) {
  if (!(v > 0.0f)) return 0;
  if (v >= 15.0f) return 15;
  return static_cast<uint8_t>(static_cast<int>(v));
}

void quantize_q4_0(const float* x, BlockQ4_0* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += QK) {
    // The signed extreme maps to -8, so the full range [-8, 7] is used on one side.
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < QK; ++j) {
      if (amax < std::fabs(x[j])) {
        amax = std::fabs(x[j]);
        max = x[j];
      }
    }
    const float d = max / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[i].d = f32_to_f16(d);
    for (int j = 0; j < QK / 2; ++j) {
      const uint8_t lo = nibble_from(x[j] * id + 8.5f);
      const uint8_t hi = nibble_from(x[j + QK / 2] * id + 8.5f);
      y[i].qs[j] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

void quantize_q4_1(const float* x, BlockQ4_1* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += QK) {
    float min = x[0], max = x[0];
    for (int j = 1; j < QK; ++j) {
      if (x[j] < min) min = x[j];
      if (x[j] > max) max = x[j];
    }
    const float d = (max - min) / 15.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[i].d = f32_to_f16(d);
    y[i].m = f32_to_f16(min);
    for (int j = 0; j < QK / 2; ++j) {
      const uint8_t lo = nibble_from((x[j] - min) * id + 0.5f);
      const uint8_t hi = nibble_from((x[j + QK / 2] - min) * id + 0.5f);
      y[i].qs[j] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

void quantize_q8_0(const float* x, BlockQ8_0* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += QK) {
    float amax = 0.0f;
    for (int j = 0; j < QK; ++j) amax = std::fmax(amax, std::fabs(x[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[i].d = f32_to_f16(d);
    for (int j = 0; j < QK; ++j) {
      const float v = std::round(x[j] * id);  // ggml uses roundf: halves away from zero
      y[i].qs[j] = static_cast<int8_t>(v >= 127.0f ? 127 : v <= -127.0f ? -127 : v == v ? v : 0);
    }
  }
}

}  // namespace

namespace quant_impl {

// Each decoder follows ggml's dequantize_row_* operation for operation (a scale times an integer,
// then the minimum subtracted or added), so the floats are the same bits.

void to_float_f32(const void* blocks, float* dst, int64_t n) {
  std::memcpy(dst, blocks, static_cast<size_t>(n) * sizeof(float));
}

void to_float_f16(const void* blocks, float* dst, int64_t n) {
  const uint16_t* h = static_cast<const uint16_t*>(blocks);
  for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(h[i]);
}

void to_float_bf16(const void* blocks, float* dst, int64_t n) {
  const uint16_t* h = static_cast<const uint16_t*>(blocks);
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(h[i]);
}

void to_float_q4_0(const void* blocks, float* dst, int64_t n) {
  const BlockQ4_0* b = static_cast<const BlockQ4_0*>(blocks);
  for (int64_t i = 0; i < n; ++i, dst += QK) {
    const float d = f16_to_f32(b[i].d);
    for (int j = 0; j < QK / 2; ++j) {
      dst[j] = static_cast<float>((b[i].qs[j] & 0x0f) - 8) * d;
      dst[j + QK / 2] = static_cast<float>((b[i].qs[j] >> 4) - 8) * d;
    }
  }
}

void to_float_q4_1(const void* blocks, float* dst, int64_t n) {
  const BlockQ4_1* b = static_cast<const BlockQ4_1*>(blocks);
  for (int64_t i = 0; i < n; ++i, dst += QK) {
    const float d = f16_to_f32(b[i].d), m = f16_to_f32(b[i].m);
    for (int j = 0; j < QK / 2; ++j) {
      dst[j] = static_cast<float>(b[i].qs[j] & 0x0f) * d + m;
      dst[j + QK / 2] = static_cast<float>(b[i].qs[j] >> 4) * d + m;
    }
  }
}

// Element j's fifth bit is bit j of the little-endian word qh.
inline int fifth_bit(const uint8_t* qh, int j) { return (qh[j / 8] >> (j % 8)) & 1; }

void to_float_q5_0(const void* blocks, float* dst, int64_t n) {
  const BlockQ5_0* b = static_cast<const BlockQ5_0*>(blocks);
  for (int64_t i = 0; i < n; ++i, dst += QK) {
    const float d = f16_to_f32(b[i].d);
    for (int j = 0; j < QK / 2; ++j) {
      const int lo = (b[i].qs[j] & 0x0f) | (fifth_bit(b[i].qh, j) << 4);
      const int hi = (b[i].qs[j] >> 4) | (fifth_bit(b[i].qh, j + QK / 2) << 4);
      dst[j] = static_cast<float>(lo - 16) * d;
      dst[j + QK / 2] = static_cast<float>(hi - 16) * d;
    }
  }
}

void to_float_q5_1(const void* blocks, float* dst, int64_t n) {
  const BlockQ5_1* b = static_cast<const BlockQ5_1*>(blocks);
  for (int64_t i = 0; i < n; ++i, dst += QK) {
    const float d = f16_to_f32(b[i].d), m = f16_to_f32(b[i].m);
    for (int j = 0; j < QK / 2; ++j) {
      const int lo = (b[i].qs[j] & 0x0f) | (fifth_bit(b[i].qh, j) << 4);
      const int hi = (b[i].qs[j] >> 4) | (fifth_bit(b[i].qh, j + QK / 2) << 4);
      dst[j] = static_cast<float>(lo) * d + m;
      dst[j + QK / 2] = static_cast<float>(hi) * d + m;
    }
  }
}

void to_float_q8_0(const void* blocks, float* dst, int64_t n) {
  const BlockQ8_0* b = static_cast<const BlockQ8_0*>(blocks);
  for (int64_t i = 0; i < n; ++i, dst += QK) {
    const float d = f16_to_f32(b[i].d);
    for (int j = 0; j < QK; ++j) dst[j] = static_cast<float>(b[i].qs[j]) * d;
  }
}

// Q2_K: element 128h + 32s + l is bits 2s..2s+1 of qs[32h + l]; sub-block e / 16 has the scale in
// the low nibble of scales[e / 16] and the minimum in its high nibble.
void to_float_q2_k(const void* blocks, float* dst, int64_t n) {
  const BlockQ2_K* b = static_cast<const BlockQ2_K*>(blocks);
  for (int64_t i = 0; i < n; ++i, dst += QK_K) {
    const float d = f16_to_f32(b[i].d), dmin = f16_to_f32(b[i].dmin);
    for (int e = 0; e < QK_K; ++e) {
      const int q = (b[i].qs[32 * (e / 128) + e % 32] >> (2 * (e % 128 / 32))) & 3;
      const uint8_t sc = b[i].scales[e / 16];
      const float dl = d * static_cast<float>(sc & 0x0f);
      const float ml = dmin * static_cast<float>(sc >> 4);
      dst[e] = dl * static_cast<float>(q) - ml;
    }
  }
}

// Q3_K: element 128h + 32s + l has low bits 2s..2s+1 of qs[32h + l] and third bit 4h + s of
// hmask[l]; a clear third bit subtracts 4.
void to_float_q3_k(const void* blocks, float* dst, int64_t n) {
  const BlockQ3_K* b = static_cast<const BlockQ3_K*>(blocks);
  for (int64_t i = 0; i < n; ++i, dst += QK_K) {
    const float d = f16_to_f32(b[i].d);
    for (int e = 0; e < QK_K; ++e) {
      const int h = e / 128, s = e % 128 / 32, l = e % 32;
      const int q = (b[i].qs[32 * h + l] >> (2 * s)) & 3;
      const int third = (b[i].hmask[l] >> (4 * h + s)) & 1;
      const float dl = d * static_cast<float>(q3_k_scale(b[i].scales, e / 16));
      dst[e] = dl * static_cast<float>(q - (third ? 0 : 4));
    }
  }
}

// Q4_K: element 64g + l (l < 32) is the low nibble of qs[32g + l], element 64g + 32 + l its high
// nibble; sub-blocks of 32. Q5_K (kHigh): the same plus fifth bits, element 32j + l's in bit j of
// qh[l].
template <typename Block, bool kHigh>
void to_float_q45_k(const void* blocks, float* dst, int64_t n) {
  const Block* b = static_cast<const Block*>(blocks);
  for (int64_t i = 0; i < n; ++i, dst += QK_K) {
    const float d = f16_to_f32(b[i].d), dmin = f16_to_f32(b[i].dmin);
    for (int j = 0; j < QK_K / 32; ++j) {
      int sc, m;
      k_scale_min(b[i].scales, j, &sc, &m);
      const float dl = d * static_cast<float>(sc), ml = dmin * static_cast<float>(m);
      const uint8_t* q = b[i].qs + 32 * (j / 2);
      for (int l = 0; l < 32; ++l) {
        int v = j % 2 ? q[l] >> 4 : q[l] & 0x0f;
        if constexpr (kHigh) v |= ((b[i].qh[l] >> j) & 1) << 4;
        dst[32 * j + l] = dl * static_cast<float>(v) - ml;
      }
    }
  }
}

void to_float_q4_k(const void* blocks, float* dst, int64_t n) {
  to_float_q45_k<BlockQ4_K, false>(blocks, dst, n);
}

void to_float_q5_k(const void* blocks, float* dst, int64_t n) {
  to_float_q45_k<BlockQ5_K, true>(blocks, dst, n);
}

// Q6_K: element 128h + 32s + l (l < 32) has its low 4 bits in ql[64h + 32 (s % 2) + l] (low
// nibble for s < 2, high for s >= 2) and its high 2 bits in bits 2s of qh[32h + l]; stored
// offset by 32, sub-blocks of 16 with int8 scales.
void to_float_q6_k(const void* blocks, float* dst, int64_t n) {
  const BlockQ6_K* b = static_cast<const BlockQ6_K*>(blocks);
  for (int64_t i = 0; i < n; ++i, dst += QK_K) {
    const float d = f16_to_f32(b[i].d);
    for (int e = 0; e < QK_K; ++e) {
      const int h = e / 128, s = e % 128 / 32, l = e % 32;
      const uint8_t lo_byte = b[i].ql[64 * h + 32 * (s % 2) + l];
      const int lo = s < 2 ? lo_byte & 0x0f : lo_byte >> 4;
      const int hi = (b[i].qh[32 * h + l] >> (2 * s)) & 3;
      dst[e] =
          d * static_cast<float>(b[i].scales[e / 16]) * static_cast<float>((lo | (hi << 4)) - 32);
    }
  }
}

void to_float_iq4_nl(const void* blocks, float* dst, int64_t n) {
  const BlockIQ4_NL* b = static_cast<const BlockIQ4_NL*>(blocks);
  for (int64_t i = 0; i < n; ++i, dst += QK) {
    const float d = f16_to_f32(b[i].d);
    for (int j = 0; j < QK / 2; ++j) {
      dst[j] = d * static_cast<float>(kIQ4Levels[b[i].qs[j] & 0x0f]);
      dst[j + QK / 2] = d * static_cast<float>(kIQ4Levels[b[i].qs[j] >> 4]);
    }
  }
}

// IQ4_XS: sub-block j of 32 is laid out as an IQ4_NL block in qs[16j..16j+15]; its six-bit scale
// (offset by 32) has the low nibble in scales_l[j / 2] and the high bits at bit 2j of scales_h.
inline int iq4_xs_scale(const BlockIQ4_XS& b, int j) {
  const int lo = (b.scales_l[j / 2] >> (4 * (j % 2))) & 0x0f;
  const int hi = (b.scales_h >> (2 * j)) & 3;
  return (lo | (hi << 4)) - 32;
}

void to_float_iq4_xs(const void* blocks, float* dst, int64_t n) {
  const BlockIQ4_XS* b = static_cast<const BlockIQ4_XS*>(blocks);
  for (int64_t i = 0; i < n; ++i, dst += QK_K) {
    const float d = f16_to_f32(b[i].d);
    for (int j = 0; j < QK_K / 32; ++j) {
      const float dl = d * static_cast<float>(iq4_xs_scale(b[i], j));
      const uint8_t* q = b[i].qs + 16 * j;
      for (int l = 0; l < 16; ++l) {
        dst[32 * j + l] = dl * static_cast<float>(kIQ4Levels[q[l] & 0x0f]);
        dst[32 * j + 16 + l] = dl * static_cast<float>(kIQ4Levels[q[l] >> 4]);
      }
    }
  }
}

// s[i] = exp(s[i] - m) for the s[i] <= m of a softmax, and their sum, in lanes of 8 (the same
// bits whichever clone runs). exp is 2^t with t = x log2(e) split into an integer and a fraction
// whose 2^f is a degree-6 polynomial (relative error below 2e-7); inputs below -87 give 0. The
// C library's exp, one call a score, was most of the time of attention at depth.
namespace {
__attribute__((target_clones("avx2", "default"))) float softmax_exp_clones(float* s, int64_t n,
                                                                           float m) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  auto one = [m](float v) {
    const float x = std::max(v - m, -87.0f);
    const float t = x * 1.4426950408889634f;
    const float fl = std::floor(t);
    const float f = t - fl;
    const float p =
        1.0f + f * (0.6931471825f +
                    f * (0.2402264923f +
                         f * (0.0555041087f +
                              f * (0.0096181291f + f * (0.0013333558f + f * 0.0001540353f)))));
    const int32_t e = static_cast<int32_t>(fl) + 127;
    uint32_t bits = static_cast<uint32_t>(e) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return v - m < -87.0f ? 0.0f : p * scale;
  };
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += (s[i + j] = one(s[i + j]));
  for (; i < n; ++i) acc[0] += (s[i] = one(s[i]));
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

// The portable attention rows (quant.h's attention_rows): the chunk's keys transposed once into
// kt (hd x n), then four rows share each load of 8 keys' dimension d, and a row's values
// accumulate 32 dimensions at a time, so that no sum crosses vector lanes. Each row's sums run in
// one order (over d for a score, over the keys for a value) whatever rows share the call.
__attribute__((target_clones("avx2", "default"))) void attn_rows_clones(
    const float* q, int R, int hd, const float* k, int64_t ks, const float* v, int64_t vs, int n,
    const int* b, const int* e, float scale, float* scores, float* mx, float* sum, float* acc) {
  thread_local std::vector<float> kt_buf;
  kt_buf.resize(size_t(hd) * size_t(std::max(n, 1)));
  float* kt = kt_buf.data();
  for (int p = 0; p < n; ++p)
    for (int d = 0; d < hd; ++d) kt[size_t(d) * n + p] = k[p * ks + d];
  int r = 0;
  for (; r + 4 <= R; r += 4) {
    const float* q0 = q + int64_t(r) * hd;
    int p = 0;
    for (; p + 8 <= n; p += 8) {
      float l0[8] = {}, l1[8] = {}, l2[8] = {}, l3[8] = {};
      for (int d = 0; d < hd; ++d) {
        const float* kd = kt + int64_t(d) * n + p;
        const float a0 = q0[d], a1 = q0[hd + d], a2 = q0[2 * hd + d], a3 = q0[3 * hd + d];
        for (int j = 0; j < 8; ++j) {
          l0[j] += a0 * kd[j];
          l1[j] += a1 * kd[j];
          l2[j] += a2 * kd[j];
          l3[j] += a3 * kd[j];
        }
      }
      for (int j = 0; j < 8; ++j) {
        scores[int64_t(r) * n + p + j] = l0[j] * scale;
        scores[int64_t(r + 1) * n + p + j] = l1[j] * scale;
        scores[int64_t(r + 2) * n + p + j] = l2[j] * scale;
        scores[int64_t(r + 3) * n + p + j] = l3[j] * scale;
      }
    }
    for (; p < n; ++p)
      for (int i = 0; i < 4; ++i) {
        float l = 0.0f;
        for (int d = 0; d < hd; ++d) l += q0[i * hd + d] * kt[int64_t(d) * n + p];
        scores[int64_t(r + i) * n + p] = l * scale;
      }
  }
  for (; r < R; ++r) {
    const float* qr = q + int64_t(r) * hd;
    int p = 0;
    for (; p + 8 <= n; p += 8) {
      float l[8] = {};
      for (int d = 0; d < hd; ++d) {
        const float* kd = kt + int64_t(d) * n + p;
        for (int j = 0; j < 8; ++j) l[j] += qr[d] * kd[j];
      }
      for (int j = 0; j < 8; ++j) scores[int64_t(r) * n + p + j] = l[j] * scale;
    }
    for (; p < n; ++p) {
      float l = 0.0f;
      for (int d = 0; d < hd; ++d) l += qr[d] * kt[int64_t(d) * n + p];
      scores[int64_t(r) * n + p] = l * scale;
    }
  }
  for (r = 0; r < R; ++r) {
    float* a = acc + int64_t(r) * hd;
    float* w = scores + int64_t(r) * n;
    const int br = b[r], er = e[r];
    softmax_row(w, n, br, er, &mx[r], &sum[r]);
    if (er <= br) {
      std::fill(a, a + hd, 0.0f);
      continue;
    }
    int d0 = 0;
    for (; d0 + 32 <= hd; d0 += 32) {
      float t[32] = {};
      for (int p = br; p < er; ++p) {
        const float wp = w[p];
        const float* vp = v + int64_t(p) * vs + d0;
        for (int i = 0; i < 32; ++i) t[i] += wp * vp[i];
      }
      std::copy(t, t + 32, a + d0);
    }
    for (; d0 < hd; ++d0) {
      float t = 0.0f;
      for (int p = br; p < er; ++p) t += w[p] * v[int64_t(p) * vs + d0];
      a[d0] = t;
    }
  }
}
}  // namespace

void softmax_row(float* w, int n, int b, int e, float* mx, float* sum) {
  if (e <= b) {
    *mx = -INFINITY, *sum = 0.0f;
    std::fill(w, w + n, 0.0f);
    return;
  }
  float m = -INFINITY;
  for (int p = b; p < e; ++p) m = std::max(m, w[p]);
  *mx = m;
  *sum = softmax_exp_clones(w + b, e - b, m);
  std::fill(w, w + b, 0.0f);
  std::fill(w + e, w + n, 0.0f);
}

// A plain entry point to the clones above (a target_clones function must not be shared between
// the library and a program that links it statically as well).
void attn_rows_portable(const float* q, int R, int hd, const float* k, int64_t ks, const float* v,
                        int64_t vs, int n, const int* b, const int* e, float scale, float* scores,
                        float* mx, float* sum, float* acc) {
  attn_rows_clones(q, R, hd, k, ks, v, vs, n, b, e, scale, scores, mx, sum, acc);
}

}  // namespace quant_impl

namespace {
const quant_impl::Kernels& kernels();  // the set in use (below)
}  // namespace

namespace {

const TypeTraits& decodable_traits(DType t, const char* what) {
  const TypeTraits* traits = type_traits_or_null(static_cast<uint32_t>(t));
  if (traits == nullptr || traits->to_float == nullptr) {
    throw ArgumentError(std::string(what) + ": ggraph cannot decode " +
                        (traits != nullptr
                             ? std::string(traits->name) + " weights"
                             : "type id " + std::to_string(static_cast<uint32_t>(t))));
  }
  return *traits;
}

}  // namespace

RowDecoder row_decoder(DType t) {
  const TypeTraits& traits = decodable_traits(t, "row_decoder");
  quant_impl::ToFloatFn fn = kernels().to_float[quant_impl::slot(t)];
  return fn != nullptr ? fn : traits.to_float;
}

void dequantize_row(DType t, const void* src, float* dst, int64_t n) {
  const TypeTraits& traits = decodable_traits(t, "dequantize_row");
  check_blocks(t, n, traits.block_size, "dequantize_row");
  quant_impl::ToFloatFn fn = kernels().to_float[quant_impl::slot(t)];
  (fn != nullptr ? fn : traits.to_float)(src, dst, n / traits.block_size);
}

void quantize_row(DType t, const float* src, void* dst, int64_t n) {
  switch (t) {
    case DType::F32:
      check_blocks(t, n, 1, "quantize_row");
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      return;
    case DType::F16:
    case DType::BF16: {
      check_blocks(t, n, 1, "quantize_row");
      uint16_t* h = static_cast<uint16_t*>(dst);
      if (t == DType::F16) {
        if (const quant_impl::F16FromFloatFn fn = kernels().f16_from_float) {
          fn(src, h, n);
        } else {
          for (int64_t i = 0; i < n; ++i) h[i] = f32_to_f16(src[i]);
        }
      } else {
        for (int64_t i = 0; i < n; ++i) h[i] = f32_to_bf16(src[i]);
      }
      return;
    }
    case DType::Q4_0:
      check_blocks(t, n, QK, "quantize_row");
      quantize_q4_0(src, static_cast<BlockQ4_0*>(dst), n / QK);
      return;
    case DType::Q4_1:
      check_blocks(t, n, QK, "quantize_row");
      quantize_q4_1(src, static_cast<BlockQ4_1*>(dst), n / QK);
      return;
    case DType::Q8_0:
      check_blocks(t, n, QK, "quantize_row");
      quantize_q8_0(src, static_cast<BlockQ8_0*>(dst), n / QK);
      return;
    default: {
      const TypeTraits* traits = type_traits_or_null(static_cast<uint32_t>(t));
      throw ArgumentError(
          std::string("quantize_row: expected F32, F16, BF16, Q8_0, Q4_0 or Q4_1, got ") +
          (traits != nullptr ? std::string(traits->name)
                             : "type id " + std::to_string(static_cast<uint32_t>(t))));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Scalar kernels: the reference for the vector ones and the path on CPUs without AVX2.

namespace {

using quant_impl::act_ds;
using quant_impl::act_q_offset;

// Round to nearest even for |v| < 2^22 without a float-to-int conversion: adding 1.5 * 2^23 moves
// the integer part to the last mantissa bits. Matches the vector code's cvtps2dq in default mode.
int32_t round_even(float v) {
  const float magic = 12582912.0f;
  return static_cast<int32_t>(float_bits(v + magic) - float_bits(magic));
}

void prepare_q8_scalar(const float* x, void* dst, int64_t k) {
  const int64_t nb = k / QK;
  int8_t* q = static_cast<int8_t*>(dst);
  std::memset(dst, 0, quant_impl::q8_act_size(k));
  float* ds = const_cast<float*>(act_ds(dst, k));
  for (int64_t b = 0; b < nb; ++b, x += QK) {
    // The maximum over the magnitude bits is order-free and ranks NaN above Inf above numbers.
    uint32_t amax_bits = 0;
    for (int j = 0; j < QK; ++j) {
      const uint32_t a = float_bits(x[j]) & 0x7fffffff;
      if (a > amax_bits) amax_bits = a;
    }
    if (amax_bits >= 0x7f800000) {
      // A non-finite value makes the whole block NaN so that it shows in every dot it enters.
      ds[2 * b] = ds[2 * b + 1] = bits_float(0x7fc00000);
      continue;
    }
    const float amax = bits_float(amax_bits);
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum = 0;
    for (int j = 0; j < QK; ++j) {
      const int32_t v = round_even(x[j] * id);
      q[act_q_offset(b, j)] = static_cast<int8_t>(v);
      sum += v;
    }
    const float d = amax / 127.0f;
    ds[2 * b] = d;
    ds[2 * b + 1] = d * static_cast<float>(sum);
  }
}

void prepare_f32_scalar(const float* x, void* dst, int64_t k) {
  std::memcpy(dst, x, static_cast<size_t>(k) * sizeof(float));
  std::memset(static_cast<float*>(dst) + k, 0, quant_impl::f32_act_size(k) - k * sizeof(float));
}

void prepare_q8k_scalar(const float* x, void* dst, int64_t k) {
  std::memset(dst, 0, quant_impl::q8k_act_size(k));
  int8_t* q = static_cast<int8_t*>(dst);
  float* d = const_cast<float*>(quant_impl::q8k_d(dst, k));
  int16_t* bsums = const_cast<int16_t*>(quant_impl::q8k_bsums(dst, k));
  for (int64_t b = 0; b < k / QK_K; ++b, x += QK_K, q += QK_K) {
    uint32_t amax_bits = 0;
    for (int j = 0; j < QK_K; ++j) {
      const uint32_t a = float_bits(x[j]) & 0x7fffffff;
      if (a > amax_bits) amax_bits = a;
    }
    if (amax_bits >= 0x7f800000) {
      d[b] = bits_float(0x7fc00000);  // the whole super-block shows as NaN in every dot
      continue;
    }
    const float amax = bits_float(amax_bits);
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    for (int j = 0; j < QK_K; ++j) q[j] = static_cast<int8_t>(round_even(x[j] * id));
    for (int s = 0; s < QK_K / 16; ++s) {
      int sum = 0;
      for (int j = 0; j < 16; ++j) sum += q[16 * s + j];
      bsums[16 * b + s] = static_cast<int16_t>(sum);
    }
    d[b] = amax / 127.0f;
  }
}

// ----- 32-element block formats against the kQ8 layout -----------------------------------------

// Element j of a block as an integer times the block scale d, plus the block's minimum m (added
// as m times the activation block's sum).
template <DType T>
struct Q32Format;
template <>
struct Q32Format<DType::Q4_0> {
  static int value(const uint8_t* b, int j) {
    return j < 16 ? b[2 + j] & 0x0f : b[2 + j - 16] >> 4;
  }
  static float min(const uint8_t*, float d) { return -8.0f * d; }
};
template <>
struct Q32Format<DType::Q4_1> {
  static int value(const uint8_t* b, int j) {
    return j < 16 ? b[4 + j] & 0x0f : b[4 + j - 16] >> 4;
  }
  static float min(const uint8_t* b, float) { return f16_to_f32(load_u16(b + 2)); }
};
template <>
struct Q32Format<DType::Q5_0> {
  static int value(const uint8_t* b, int j) {
    const int nib = j < 16 ? b[6 + j] & 0x0f : b[6 + j - 16] >> 4;
    return nib | (quant_impl::fifth_bit(b + 2, j) << 4);
  }
  static float min(const uint8_t*, float d) { return -16.0f * d; }
};
template <>
struct Q32Format<DType::Q5_1> {
  static int value(const uint8_t* b, int j) {
    const int nib = j < 16 ? b[8 + j] & 0x0f : b[8 + j - 16] >> 4;
    return nib | (quant_impl::fifth_bit(b + 4, j) << 4);
  }
  static float min(const uint8_t* b, float) { return f16_to_f32(load_u16(b + 2)); }
};
template <>
struct Q32Format<DType::Q8_0> {
  static int value(const uint8_t* b, int j) { return static_cast<int8_t>(b[2 + j]); }
  static float min(const uint8_t*, float) { return 0.0f; }
};
template <>
struct Q32Format<DType::IQ4_NL> {
  static int value(const uint8_t* b, int j) {
    return quant_impl::kIQ4Levels[j < 16 ? b[2 + j] & 0x0f : b[2 + j - 16] >> 4];
  }
  static float min(const uint8_t*, float) { return 0.0f; }
};

// The vector kernels' arithmetic (quant_x86.h's QuantTile), step for step, so that they give the
// same bits: each block's exact integer dot with the activation's, converted and fused with the
// product of the two block scales into one of two sums, the even blocks' and the odd ones', in
// block order; the minimum's products m * s summed per group of 4 blocks into odd lanes; the two
// sums added, then the minimum's lanes in a fixed tree.
template <DType T>
void tile_q32_scalar(int64_t k, const uint8_t* w, size_t w_stride, int n_rows, const uint8_t* act,
                     size_t act_stride, int n_cols, float* out, size_t out_stride) {
  const int64_t nb = k / QK;
  const size_t bsize = type_traits(T).type_size;
  constexpr bool kHasMin = T != DType::Q8_0 && T != DType::IQ4_NL;
  for (int r = 0; r < n_rows; ++r) {
    const uint8_t* row = w + r * w_stride;
    for (int c = 0; c < n_cols; ++c) {
      const uint8_t* col = act + c * act_stride;
      const int8_t* q = reinterpret_cast<const int8_t*>(col);
      const float* ds = act_ds(col, k);  // zero past the last block, up to a multiple of 4
      float acc[2] = {0, 0}, acc_min[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t g = 0; g < nb; g += 4) {
        float scale[4];
        for (int i = 0; i < 4; ++i) {
          const int64_t b = g + i;
          float dw = 0.0f, m = 0.0f;
          if (b < nb) {
            dw = f16_to_f32(load_u16(row + b * bsize));
            m = Q32Format<T>::min(row + b * bsize, dw);
          }
          scale[i] = dw * ds[2 * b];
          acc_min[2 * i] += scale[i];
          acc_min[2 * i + 1] += m * ds[2 * b + 1];
        }
        for (int64_t b = g; b < g + 4 && b < nb; ++b) {
          const uint8_t* blk = row + b * bsize;
          int32_t isum = 0;
          for (int j = 0; j < QK; ++j) isum += Q32Format<T>::value(blk, j) * q[act_q_offset(b, j)];
          acc[b % 2] = std::fma(scale[b - g], static_cast<float>(isum), acc[b % 2]);
        }
      }
      float v = acc[0] + acc[1];
      if (kHasMin) v += (acc_min[1] + acc_min[5]) + (acc_min[3] + acc_min[7]);
      out[c * out_stride + r] = v;
    }
  }
}

// ----- K-quants against the kQ8K layout --------------------------------------------------------

// A super-block as the vector kernels see it: value e = d sc[e/16] u[e] - dmin mn[e/16] for
// formats with a dmin, and d (sc[e/16] u[e] - mn[e/16]) for the others.
struct KBlock {
  int u[QK_K];
  int sc[16], mn[16];
  float d, dmin;
  bool has_dmin;
};

template <DType T>
void decode_k(const uint8_t* blk, KBlock* kb);

template <>
void decode_k<DType::Q2_K>(const uint8_t* blk, KBlock* kb) {
  const BlockQ2_K& b = *reinterpret_cast<const BlockQ2_K*>(blk);
  for (int e = 0; e < QK_K; ++e)
    kb->u[e] = (b.qs[32 * (e / 128) + e % 32] >> (2 * (e % 128 / 32))) & 3;
  for (int j = 0; j < 16; ++j) {
    kb->sc[j] = b.scales[j] & 0x0f;
    kb->mn[j] = b.scales[j] >> 4;
  }
  kb->d = f16_to_f32(b.d);
  kb->dmin = f16_to_f32(b.dmin);
  kb->has_dmin = true;
}

template <>
void decode_k<DType::Q3_K>(const uint8_t* blk, KBlock* kb) {
  const BlockQ3_K& b = *reinterpret_cast<const BlockQ3_K*>(blk);
  for (int e = 0; e < QK_K; ++e) {
    const int h = e / 128, s = e % 128 / 32, l = e % 32;
    kb->u[e] = ((b.qs[32 * h + l] >> (2 * s)) & 3) | (((b.hmask[l] >> (4 * h + s)) & 1) << 2);
  }
  for (int j = 0; j < 16; ++j) {
    kb->sc[j] = q3_k_scale(b.scales, j);
    kb->mn[j] = 4 * kb->sc[j];  // value = u - 4
  }
  kb->d = f16_to_f32(b.d);
  kb->dmin = 0.0f;
  kb->has_dmin = false;
}

// Q4_K's and Q5_K's eight 6-bit scales and minimums (each for two 16-element halves) and d, dmin.
void k_scales_mins(const uint8_t* scales, uint16_t d, uint16_t dmin, KBlock* kb) {
  for (int j = 0; j < 8; ++j) {
    k_scale_min(scales, j, &kb->sc[2 * j], &kb->mn[2 * j]);
    kb->sc[2 * j + 1] = kb->sc[2 * j];
    kb->mn[2 * j + 1] = kb->mn[2 * j];
  }
  kb->d = f16_to_f32(d);
  kb->dmin = f16_to_f32(dmin);
  kb->has_dmin = true;
}

template <>
void decode_k<DType::Q4_K>(const uint8_t* blk, KBlock* kb) {
  const BlockQ4_K& b = *reinterpret_cast<const BlockQ4_K*>(blk);
  for (int e = 0; e < QK_K; ++e) {
    const uint8_t q = b.qs[32 * (e / 64) + e % 32];
    kb->u[e] = e % 64 < 32 ? q & 0x0f : q >> 4;
  }
  k_scales_mins(b.scales, b.d, b.dmin, kb);
}

template <>
void decode_k<DType::Q5_K>(const uint8_t* blk, KBlock* kb) {
  const BlockQ5_K& b = *reinterpret_cast<const BlockQ5_K*>(blk);
  for (int e = 0; e < QK_K; ++e) {
    const uint8_t q = b.qs[32 * (e / 64) + e % 32];
    kb->u[e] = (e % 64 < 32 ? q & 0x0f : q >> 4) | (((b.qh[e % 32] >> (e / 32)) & 1) << 4);
  }
  k_scales_mins(b.scales, b.d, b.dmin, kb);
}

template <>
void decode_k<DType::Q6_K>(const uint8_t* blk, KBlock* kb) {
  const BlockQ6_K& b = *reinterpret_cast<const BlockQ6_K*>(blk);
  for (int e = 0; e < QK_K; ++e) {
    const int h = e / 128, s = e % 128 / 32, l = e % 32;
    const uint8_t lo_byte = b.ql[64 * h + 32 * (s % 2) + l];
    const int lo = s < 2 ? lo_byte & 0x0f : lo_byte >> 4;
    kb->u[e] = lo | (((b.qh[32 * h + l] >> (2 * s)) & 3) << 4);
  }
  for (int j = 0; j < 16; ++j) {
    kb->sc[j] = b.scales[j];
    kb->mn[j] = 32 * b.scales[j];  // value = u - 32
  }
  kb->d = f16_to_f32(b.d);
  kb->dmin = 0.0f;
  kb->has_dmin = false;
}

template <>
void decode_k<DType::IQ4_XS>(const uint8_t* blk, KBlock* kb) {
  const BlockIQ4_XS& b = *reinterpret_cast<const BlockIQ4_XS*>(blk);
  for (int e = 0; e < QK_K; ++e) {
    const uint8_t q = b.qs[16 * (e / 32) + e % 16];
    kb->u[e] = quant_impl::kIQ4Levels[e % 32 < 16 ? q & 0x0f : q >> 4];
  }
  for (int j = 0; j < 16; ++j) {
    kb->sc[j] = quant_impl::iq4_xs_scale(b, j / 2);
    kb->mn[j] = 0;
  }
  kb->d = f16_to_f32(b.d);
  kb->dmin = 0.0f;
  kb->has_dmin = false;
}

// The vector kernels' arithmetic, lane for lane, so that they give the same bits: per super-block
// 8 integer lanes, lane l summing sc u a over the elements e with e % 32 / 4 == l and the minimum
// lanes summing mn[2l] bsum[2l] + mn[2l+1] bsum[2l+1]; each lane converted to float and fused into
// its float lane; the 8 float lanes added in a fixed tree at the end.
template <DType T>
void tile_k_scalar(int64_t k, const uint8_t* w, size_t w_stride, int n_rows, const uint8_t* act,
                   size_t act_stride, int n_cols, float* out, size_t out_stride) {
  const int64_t ns = k / QK_K;
  const size_t bsize = type_traits(T).type_size;
  KBlock kb;
  for (int r = 0; r < n_rows; ++r) {
    const uint8_t* row = w + r * w_stride;
    for (int c = 0; c < n_cols; ++c) {
      const uint8_t* col = act + c * act_stride;
      const int8_t* q = reinterpret_cast<const int8_t*>(col);
      const float* da = quant_impl::q8k_d(col, k);
      const int16_t* bsums = quant_impl::q8k_bsums(col, k);
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t b = 0; b < ns; ++b) {
        decode_k<T>(row + b * bsize, &kb);
        int32_t isum[8] = {0, 0, 0, 0, 0, 0, 0, 0}, msum[8];
        for (int e = 0; e < QK_K; ++e)
          isum[e % 32 / 4] += kb.sc[e / 16] * kb.u[e] * q[QK_K * b + e];
        for (int l = 0; l < 8; ++l) {
          msum[l] =
              kb.mn[2 * l] * bsums[16 * b + 2 * l] + kb.mn[2 * l + 1] * bsums[16 * b + 2 * l + 1];
        }
        const float dd = kb.d * da[b];
        if (kb.has_dmin) {
          const float dm = kb.dmin * da[b];
          for (int l = 0; l < 8; ++l) {
            acc[l] = std::fma(dd, static_cast<float>(isum[l]), acc[l]);
            acc[l] = std::fma(-dm, static_cast<float>(msum[l]), acc[l]);
          }
        } else {
          for (int l = 0; l < 8; ++l)
            acc[l] = std::fma(dd, static_cast<float>(isum[l] - msum[l]), acc[l]);
        }
      }
      out[c * out_stride + r] =
          ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    }
  }
}

float load_weight(const float* w, int64_t i) { return w[i]; }
float load_weight(const uint16_t* w, int64_t i) { return f16_to_f32(w[i]); }
struct Bf16 {
  uint16_t bits;
};
float load_weight(const Bf16* w, int64_t i) { return bf16_to_f32(w[i].bits); }

template <typename W>
void tile_float_scalar(int64_t k, const uint8_t* w, size_t w_stride, int n_rows, const uint8_t* act,
                       size_t act_stride, int n_cols, float* out, size_t out_stride) {
  for (int r = 0; r < n_rows; ++r) {
    const W* row = reinterpret_cast<const W*>(w + r * w_stride);
    for (int c = 0; c < n_cols; ++c) {
      const float* x = reinterpret_cast<const float*>(act + c * act_stride);
      // Four partial sums keep the rounding error of long rows down.
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      int64_t i = 0;
      for (; i + 4 <= k; i += 4) {
        for (int j = 0; j < 4; ++j) acc[j] += load_weight(row, i + j) * x[i + j];
      }
      for (; i < k; ++i) acc[i % 4] += load_weight(row, i) * x[i];
      out[c * out_stride + r] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    }
  }
}

quant_impl::Kernels make_scalar_kernels() {
  using quant_impl::slot;
  quant_impl::Kernels k{};
  k.features = "scalar";
  k.tile[slot(DType::F32)] = tile_float_scalar<float>;
  k.tile[slot(DType::F16)] = tile_float_scalar<uint16_t>;
  k.tile[slot(DType::BF16)] = tile_float_scalar<Bf16>;
  k.tile[slot(DType::Q4_0)] = tile_q32_scalar<DType::Q4_0>;
  k.tile[slot(DType::Q4_1)] = tile_q32_scalar<DType::Q4_1>;
  k.tile[slot(DType::Q5_0)] = tile_q32_scalar<DType::Q5_0>;
  k.tile[slot(DType::Q5_1)] = tile_q32_scalar<DType::Q5_1>;
  k.tile[slot(DType::Q8_0)] = tile_q32_scalar<DType::Q8_0>;
  k.tile[slot(DType::IQ4_NL)] = tile_q32_scalar<DType::IQ4_NL>;
  k.tile[slot(DType::Q2_K)] = tile_k_scalar<DType::Q2_K>;
  k.tile[slot(DType::Q3_K)] = tile_k_scalar<DType::Q3_K>;
  k.tile[slot(DType::Q4_K)] = tile_k_scalar<DType::Q4_K>;
  k.tile[slot(DType::Q5_K)] = tile_k_scalar<DType::Q5_K>;
  k.tile[slot(DType::Q6_K)] = tile_k_scalar<DType::Q6_K>;
  k.tile[slot(DType::IQ4_XS)] = tile_k_scalar<DType::IQ4_XS>;
  k.prepare[slot(ActLayout::kFloat)] = prepare_f32_scalar;
  k.prepare[slot(ActLayout::kQ8)] = prepare_q8_scalar;
  k.prepare[slot(ActLayout::kQ8K)] = prepare_q8k_scalar;
  return k;
}

const quant_impl::Kernels kScalar = make_scalar_kernels();

bool cpu_has_avx2() {
#if defined(__x86_64__) || defined(__i386__)
  // libgcc's check also asks the OS whether it saves the AVX registers.
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

bool cpu_has_avx512_vnni() {
#if defined(__x86_64__) || defined(__i386__)
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

// AMX's int8 tiles: the CPU's (CPUID leaf 7: AMX-TILE, AMX-INT8), the OS's (XCR0's tile
// configuration and data bits), and this process's permission to use them, asked of Linux once
// (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA); GGRAPH_CPU_AMX=0 leaves them unused.
bool cpu_has_amx() {
#if defined(__x86_64__) && defined(__linux__)
  static const bool ok = [] {
    const char* e = std::getenv("GGRAPH_CPU_AMX");
    if ((e != nullptr && std::strcmp(e, "0") == 0) || !cpu_has_avx512_vnni()) return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25)))
      return false;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

const quant_impl::Kernels* best_kernels() {
  for (const quant_impl::Kernels* k :
       {quant_impl::amx_kernels(), quant_impl::avx512_kernels(), quant_impl::avx2_kernels()}) {
    if (quant_impl::cpu_supports(k)) return k;
  }
  return &kScalar;
}

bool env_forces_scalar() {
  const char* v = std::getenv("GGRAPH_FORCE_SCALAR");
  return v != nullptr && v[0] != '\0' && std::strcmp(v, "0") != 0;
}

std::atomic<const quant_impl::Kernels*> g_kernels{nullptr};

const quant_impl::Kernels& kernels() {
  const quant_impl::Kernels* k = g_kernels.load(std::memory_order_acquire);
  if (k == nullptr) {
    k = env_forces_scalar() ? &kScalar : best_kernels();
    g_kernels.store(k, std::memory_order_release);
  }
  return *k;
}

// The traits of a type the CPU can compute with; throws for any other.
const TypeTraits& computable_traits(DType t, const char* what) {
  const TypeTraits* traits = type_traits_or_null(static_cast<uint32_t>(t));
  if (traits == nullptr || !traits->computable) not_computable(t, what);
  return *traits;
}

}  // namespace

namespace quant_impl {

const Kernels& scalar_kernels() { return kScalar; }

// Null where the running CPU lacks the instruction set: its table's own code never runs there.
const Kernels* avx2_kernels() { return cpu_has_avx2() ? avx2_table() : nullptr; }
const Kernels* avx512_kernels() { return cpu_has_avx512_vnni() ? avx512_table() : nullptr; }
const Kernels* amx_kernels() { return cpu_has_amx() ? amx_table() : nullptr; }

bool cpu_supports(const Kernels* k) {
  if (k == nullptr) return false;
  return k == &kScalar || k == avx2_kernels() || k == avx512_kernels() || k == amx_kernels();
}

void use_kernels(const Kernels* k) {
  g_kernels.store(k != nullptr ? k : best_kernels(), std::memory_order_release);
}

}  // namespace quant_impl

void force_scalar_kernels(bool scalar) { quant_impl::use_kernels(scalar ? &kScalar : nullptr); }

const char* cpu_features() { return kernels().features; }

void attention_rows(const float* q, int R, int hd, const float* k, int64_t ks, const float* v,
                    int64_t vs, int n, const int* b, const int* e, float scale, float* scores,
                    float* mx, float* sum, float* acc) {
  attention_rows_heads(q, R, 1, hd, k, ks, v, vs, n, b, e, scale, scores, mx, sum, acc);
}

void attention_rows_heads(const float* q, int R, int H, int hd, const float* k, int64_t ks,
                          const float* v, int64_t vs, int n, const int* b, const int* e,
                          float scale, float* scores, float* mx, float* sum, float* acc) {
  const quant_impl::AttnRowsFn f = kernels().attn_rows;
  if (f != nullptr && hd % 8 == 0)
    return f(q, R, H, hd, k, ks, v, vs, n, b, e, scale, scores, mx, sum, acc);
  for (int h = 0; h < H; ++h) {
    const int64_t r0 = int64_t(h) * R;
    quant_impl::attn_rows_portable(q + r0 * hd, R, hd, k + int64_t(h) * hd, ks, v + int64_t(h) * hd,
                                   vs, n, b + r0, e + r0, scale, scores + r0 * n, mx + r0, sum + r0,
                                   acc + r0 * hd);
  }
}

void glu_mul(const float* g, const float* u, float* y, int64_t n, bool gelu) {
  if (const quant_impl::GluMulFn f = kernels().glu_mul) return f(g, u, y, n, gelu);
  for (int64_t i = 0; i < n; ++i) y[i] = quant_impl::glu_mul_one(g[i], u[i], gelu);
}

bool has_attention_rows_f16(int hd) { return kernels().attn_rows_f16 != nullptr && hd % 8 == 0; }

void attention_rows_f16(const float* q, int R, int H, int hd, const uint16_t* k, int64_t ks,
                        const uint16_t* v, int64_t vs, int n, const int* b, const int* e,
                        float scale, float* scores, float* mx, float* sum, float* acc) {
  if (!has_attention_rows_f16(hd))
    throw std::logic_error("attention_rows_f16: the running kernels have no F16 form");
  kernels().attn_rows_f16(q, R, H, hd, k, ks, v, vs, n, b, e, scale, scores, mx, sum, acc);
}

size_t act_row_size(DType weight_type, int64_t n) {
  const TypeTraits& traits = computable_traits(weight_type, "act_row_size");
  check_blocks(weight_type, n, traits.block_size, "act_row_size");
  switch (traits.act) {
    case ActLayout::kFloat:
      return quant_impl::f32_act_size(n);
    case ActLayout::kQ8:
      return quant_impl::q8_act_size(n);
    case ActLayout::kQ8K:
      return quant_impl::q8k_act_size(n);
    case ActLayout::kNone:
      break;
  }
  not_computable(weight_type, "act_row_size");
}

void prepare_act(DType weight_type, const float* x, void* dst, int64_t n) {
  const TypeTraits& traits = computable_traits(weight_type, "prepare_act");
  check_blocks(weight_type, n, traits.block_size, "prepare_act");
  quant_impl::PrepareFn fn = kernels().prepare[quant_impl::slot(traits.act)];
  if (fn == nullptr) fn = kScalar.prepare[quant_impl::slot(traits.act)];
  fn(x, dst, n);
}

void mul_mat_tile(DType weight_type, int64_t k, const void* w, size_t w_stride, int n_rows,
                  const void* act, size_t act_stride, int n_cols, float* out, size_t out_stride) {
  const TypeTraits& traits = computable_traits(weight_type, "mul_mat_tile");
  check_blocks(weight_type, k, traits.block_size, "mul_mat_tile");
  quant_impl::TileFn fn = kernels().tile[quant_impl::slot(weight_type)];
  if (fn == nullptr) fn = kScalar.tile[quant_impl::slot(weight_type)];
  if (n_rows <= 0 || n_cols <= 0) return;
  fn(k, static_cast<const uint8_t*>(w), w_stride, n_rows, static_cast<const uint8_t*>(act),
     act_stride, n_cols, out, out_stride);
}

}  // namespace ggraph
