// Weight formats and CPU dot-product kernels: block layouts against the format definitions,
// half-float rounding, quantizer error bounds, and mul_mat_tile against float64 references.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common.h"
#include "quant.h"
#include "quant_impl.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace ggraph {
namespace {

constexpr DType kComputable[] = {DType::F32,  DType::F16,    DType::BF16,  DType::Q8_0,
                                 DType::Q4_0, DType::Q4_1,   DType::Q5_0,  DType::Q5_1,
                                 DType::Q2_K, DType::Q3_K,   DType::Q4_K,  DType::Q5_K,
                                 DType::Q6_K, DType::IQ4_NL, DType::IQ4_XS};
bool is_quantized(DType t) { return type_traits(t).block_size > 1; }
bool has_quantizer(DType t) {
  return !is_quantized(t) || t == DType::Q8_0 || t == DType::Q4_0 || t == DType::Q4_1;
}
// Elements per activation scale: 32, or 256 for the super-block formats.
int64_t act_block(DType t) { return type_traits(t).block_size == 256 ? 256 : 32; }

// The format's f16 scale fields and the byte ranges of its quants (ggml's block structs).
struct FormatLayout {
  std::vector<int> halves;                  // offsets of f16 fields
  std::vector<std::pair<int, int>> quants;  // [begin, end) of the quant bytes
};
FormatLayout layout_of(DType t) {
  switch (t) {
    case DType::Q4_0:
    case DType::Q8_0:
    case DType::IQ4_NL:
      return {{0}, {{2, int(type_traits(t).type_size)}}};
    case DType::Q4_1:
      return {{0, 2}, {{4, 20}}};
    case DType::Q5_0:
      return {{0}, {{2, 22}}};
    case DType::Q5_1:
      return {{0, 2}, {{4, 24}}};
    case DType::Q2_K:
      return {{80, 82}, {{16, 80}}};
    case DType::Q3_K:
      return {{108}, {{0, 96}}};
    case DType::Q4_K:
    case DType::Q5_K:
      return {{0, 2}, {{16, int(type_traits(t).type_size)}}};
    case DType::Q6_K:
      return {{208}, {{0, 192}}};
    case DType::IQ4_XS:
      return {{0}, {{8, 136}}};
    default:
      return {};
  }
}

float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// IEEE half decoded from its definition, in double: sign, 5-bit exponent (bias 15), 10-bit
// fraction.
double half_value(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1f, frac = h & 0x3ff;
  double v;
  if (exp == 0x1f) {
    v = frac == 0 ? std::numeric_limits<double>::infinity() : std::nan("");
  } else if (exp == 0) {
    v = std::ldexp(frac, -24);
  } else {
    v = std::ldexp(1024 + frac, exp - 25);
  }
  return sign ? -v : v;
}

uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Restores the kernels the CPU offers after a test that forced the scalar ones.
class KernelModeGuard {
 public:
  ~KernelModeGuard() { force_scalar_kernels(false); }
};

// ---------------------------------------------------------------------------------------------
// Half floats

TEST(HalfFloat, EveryF16DecodesToItsDefinedValue) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = f16_to_f32(static_cast<uint16_t>(h));
    const double want = half_value(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(f)) << std::hex << h;
    } else {
      EXPECT_EQ(static_cast<double>(f), want) << std::hex << h;
      EXPECT_EQ(std::signbit(f), (h & 0x8000) != 0) << std::hex << h;
    }
  }
}

TEST(HalfFloat, EveryF16RoundTripsThroughF32) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t back = f32_to_f16(f16_to_f32(static_cast<uint16_t>(h)));
    if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0) {
      EXPECT_EQ(back & 0x7c00, 0x7c00) << std::hex << h;  // NaN stays NaN
      EXPECT_NE(back & 0x3ff, 0) << std::hex << h;
    } else {
      EXPECT_EQ(back, h) << std::hex << h;
    }
  }
}

TEST(HalfFloat, F16RoundingEdgeCases) {
  const float two_m24 = std::ldexp(1.0f, -24);  // smallest subnormal half
  struct Case {
    float in;
    uint16_t want;
  } cases[] = {
      {0.0f, 0x0000},
      {-0.0f, 0x8000},
      {1.0f, 0x3c00},
      {std::ldexp(1.0f, -11) + 1.0f, 0x3c00},      // tie between 0x3c00 and 0x3c01: even
      {3 * std::ldexp(1.0f, -11) + 1.0f, 0x3c02},  // tie between 0x3c01 and 0x3c02: even
      {std::nextafter(std::ldexp(1.0f, -11) + 1.0f, 2.0f), 0x3c01},  // just above a tie
      {65504.0f, 0x7bff},                                            // largest half
      {65519.996f, 0x7bff},                                          // below the Inf threshold
      {65520.0f, 0x7c00},                                            // tie rounds to even: Inf
      {-65520.0f, 0xfc00},
      {1e10f, 0x7c00},
      {std::numeric_limits<float>::infinity(), 0x7c00},
      {-std::numeric_limits<float>::infinity(), 0xfc00},
      {two_m24, 0x0001},
      {two_m24 / 2, 0x0000},                        // tie with zero: even
      {std::nextafter(two_m24 / 2, 1.0f), 0x0001},  // just above it
      {3 * two_m24 / 2, 0x0002},                    // tie between 1 and 2: even
      {5 * two_m24 / 2, 0x0002},                    // tie between 2 and 3: even
      {1023 * two_m24, 0x03ff},                     // largest subnormal
      {1023.5f * two_m24, 0x0400},                  // tie with the smallest normal: even
      {std::ldexp(1.0f, -14), 0x0400},              // smallest normal
      {1e-30f, 0x0000},
      {-1e-30f, 0x8000},
      {bits_float(1), 0x0000},  // f32 subnormal
  };
  for (const Case& c : cases) {
    EXPECT_EQ(f32_to_f16(c.in), c.want) << c.in;
  }
  const uint16_t nan = f32_to_f16(std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(nan & 0x7c00, 0x7c00);
  EXPECT_NE(nan & 0x3ff, 0);
  const uint16_t snan = f32_to_f16(bits_float(0x7f800001));  // payload only in the low bits
  EXPECT_EQ(snan & 0x7c00, 0x7c00);
  EXPECT_NE(snan & 0x3ff, 0);
}

// For random floats the result must be a nearest half, ties to the even one: checked against the
// neighbours of the returned value, with exact arithmetic in double.
TEST(HalfFloat, F16IsNearestEvenForRandomFloats) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> bits(0, 0xffffffffu);
  for (int i = 0; i < 200000; ++i) {
    // Exponents concentrated around the half range so that subnormals and overflow are covered.
    uint32_t u = bits(rng);
    const uint32_t exp = 100 + (u >> 23) % 45;  // 2^-27 .. 2^17
    u = (u & 0x807fffffu) | (exp << 23);
    const float f = bits_float(u);
    const uint16_t h = f32_to_f16(f);
    const double x = f, got = half_value(h);
    if (std::isinf(got)) {
      EXPECT_GE(std::fabs(x), 65520.0) << f;
      continue;
    }
    const double err = std::fabs(got - x);
    const uint16_t mag = h & 0x7fff;
    for (int step : {-1, 1}) {
      if (mag == 0 && step < 0) continue;
      const uint16_t nb = static_cast<uint16_t>((h & 0x8000) | (mag + step));
      const double other = half_value(nb);
      if (std::isinf(other)) continue;
      const double other_err = std::fabs(other - x);
      ASSERT_LE(err, other_err) << f;
      if (err == other_err) {
        ASSERT_EQ(h & 1, 0) << "tie must go to even " << f;
      }
    }
  }
}

#if defined(__x86_64__)
__attribute__((target("f16c"))) uint16_t hardware_f16(float f) {
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}

TEST(HalfFloat, F16MatchesTheF16cInstruction) {
  if (!__builtin_cpu_supports("f16c")) GTEST_SKIP() << "CPU has no F16C";
  std::mt19937 rng(11);
  std::uniform_int_distribution<uint32_t> bits(0, 0xffffffffu);
  for (int i = 0; i < 1000000; ++i) {
    const float f = bits_float(bits(rng));
    if (std::isnan(f)) continue;
    ASSERT_EQ(f32_to_f16(f), hardware_f16(f)) << std::hexfloat << f;
  }
}
#endif

TEST(BFloat16, EveryBF16RoundTrips) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = bf16_to_f32(static_cast<uint16_t>(h));
    EXPECT_EQ(float_bits(f), h << 16);
    const uint16_t back = f32_to_bf16(f);
    if ((h & 0x7f80) == 0x7f80 && (h & 0x7f) != 0) {
      EXPECT_TRUE(std::isnan(bf16_to_f32(back))) << std::hex << h;
    } else {
      EXPECT_EQ(back, h) << std::hex << h;
    }
  }
}

TEST(BFloat16, RoundingEdgeCases) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(f32_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);      // tie: even
  EXPECT_EQ(f32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);  // tie: even
  EXPECT_EQ(f32_to_bf16(std::nextafter(1.0f + std::ldexp(1.0f, -8), 2.0f)), 0x3f81);
  EXPECT_EQ(f32_to_bf16(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::max()), 0x7f80);  // rounds up to Inf
  EXPECT_EQ(f32_to_bf16(-std::numeric_limits<float>::infinity()), 0xff80);
  EXPECT_EQ(f32_to_bf16(bits_float(0x00018000)), 0x0002);    // subnormal tie: even
  const uint16_t nan = f32_to_bf16(bits_float(0x7f800001));  // NaN whose payload is below bf16
  EXPECT_EQ(nan & 0x7f80, 0x7f80);
  EXPECT_NE(nan & 0x7f, 0);
}

// ---------------------------------------------------------------------------------------------
// Block formats

// Random blocks: random quants and scales drawn from a normal distribution, stored as halves.
std::vector<uint8_t> random_blocks(DType t, int64_t nb, std::mt19937& rng) {
  const size_t bsize = row_size(t, QK);
  std::vector<uint8_t> data(bsize * nb);
  std::uniform_int_distribution<int> byte(0, 255);
  std::normal_distribution<float> scale(0.0f, 0.02f);
  for (uint8_t& b : data) b = static_cast<uint8_t>(byte(rng));
  for (int64_t i = 0; i < nb; ++i) {
    uint8_t* blk = data.data() + i * bsize;
    const uint16_t d = f32_to_f16(scale(rng)), m = f32_to_f16(scale(rng) * 8);
    std::memcpy(blk, &d, 2);
    if (t == DType::Q4_1) std::memcpy(blk + 2, &m, 2);
  }
  return data;
}

// Element j of a block from the format definitions, in double.
double reference_element(DType t, const uint8_t* blk, int j) {
  const double d = half_value(load_u16(blk));
  switch (t) {
    case DType::Q8_0:
      return static_cast<int8_t>(blk[2 + j]) * d;
    case DType::Q4_0: {
      const uint8_t byte = blk[2 + j % 16];
      const int q = j < 16 ? byte & 0x0f : byte >> 4;
      return (q - 8) * d;
    }
    case DType::Q4_1: {
      const uint8_t byte = blk[4 + j % 16];
      const int q = j < 16 ? byte & 0x0f : byte >> 4;
      return q * d + half_value(load_u16(blk + 2));
    }
    default:
      return std::nan("");
  }
}

TEST(Dequantize, QuantizedBlocksMatchTheFormatDefinition) {
  std::mt19937 rng(3);
  for (DType t : {DType::Q8_0, DType::Q4_0, DType::Q4_1}) {
    const int64_t nb = 64;
    const std::vector<uint8_t> data = random_blocks(t, nb, rng);
    std::vector<float> out(nb * QK);
    dequantize_row(t, data.data(), out.data(), nb * QK);
    const size_t bsize = row_size(t, QK);
    for (int64_t i = 0; i < nb; ++i) {
      for (int j = 0; j < QK; ++j) {
        // Products of a 4- or 8-bit integer and a half are exact in float; Q4_1 adds one rounding.
        const float want = static_cast<float>(reference_element(t, data.data() + i * bsize, j));
        ASSERT_EQ(out[i * QK + j], want) << type_name(t) << " block " << i << " element " << j;
      }
    }
  }
}

TEST(Dequantize, FloatRowsMatchTheirDefinition) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<uint32_t> bits(0, 0xffff);
  std::vector<uint16_t> h(1000);
  for (uint16_t& v : h) v = static_cast<uint16_t>(bits(rng));
  std::vector<float> out(h.size());
  dequantize_row(DType::F16, h.data(), out.data(), static_cast<int64_t>(h.size()));
  for (size_t i = 0; i < h.size(); ++i) {
    if (std::isnan(half_value(h[i]))) {
      EXPECT_TRUE(std::isnan(out[i]));
    } else {
      EXPECT_EQ(out[i], half_value(h[i]));
    }
  }
  dequantize_row(DType::BF16, h.data(), out.data(), static_cast<int64_t>(h.size()));
  for (size_t i = 0; i < h.size(); ++i) EXPECT_EQ(float_bits(out[i]), uint32_t(h[i]) << 16);
  const std::vector<float> f = {1.5f, -2.25f, 3e-39f};
  std::vector<float> g(3);
  dequantize_row(DType::F32, f.data(), g.data(), 3);
  EXPECT_EQ(f, g);
}

TEST(Quantize, GgmlRoundingOnKnownBlocks) {
  // Q8_0: amax 127 gives d = 1; ggml rounds halves away from zero.
  std::vector<float> x(QK, 0.0f);
  x[0] = 127.0f;
  x[1] = 2.5f;
  x[2] = -2.5f;
  x[3] = 0.5f;
  x[4] = -1.49f;
  BlockQ8_0 q8;
  quantize_row(DType::Q8_0, x.data(), &q8, QK);
  EXPECT_EQ(q8.d, 0x3c00);
  EXPECT_EQ(q8.qs[0], 127);
  EXPECT_EQ(q8.qs[1], 3);
  EXPECT_EQ(q8.qs[2], -3);
  EXPECT_EQ(q8.qs[3], 1);
  EXPECT_EQ(q8.qs[4], -1);
  EXPECT_EQ(q8.qs[5], 0);

  // Q4_0: the signed extreme -4 sets d = -4 / -8 = 0.5; values map to v / 0.5 + 8.
  for (int j = 0; j < QK; ++j) x[j] = 0.5f * static_cast<float>(j % 16 - 8);
  BlockQ4_0 q40;
  quantize_row(DType::Q4_0, x.data(), &q40, QK);
  EXPECT_EQ(q40.d, f32_to_f16(0.5f));
  for (int j = 0; j < QK / 2; ++j) {
    EXPECT_EQ(q40.qs[j] & 0x0f, j % 16) << j;
    EXPECT_EQ(q40.qs[j] >> 4, j % 16) << j;
  }
  // A positive extreme gives a negative scale, and the extreme itself clamps to 15 (value 7 d).
  for (int j = 0; j < QK; ++j) x[j] = j == 5 ? 8.0f : 0.0f;
  quantize_row(DType::Q4_0, x.data(), &q40, QK);
  EXPECT_EQ(q40.d, f32_to_f16(-1.0f));
  EXPECT_EQ(q40.qs[5] & 0x0f, 0);  // 8 * (1 / -1) + 8.5 = 0.5 truncates to 0: value 8
  EXPECT_EQ(q40.qs[0] & 0x0f, 8);

  // Q4_1: min 1, max 4.75 gives d = 0.25 and quants (v - 1) / 0.25.
  for (int j = 0; j < QK; ++j) x[j] = 1.0f + 0.25f * static_cast<float>((j * 7) % 16);
  BlockQ4_1 q41;
  quantize_row(DType::Q4_1, x.data(), &q41, QK);
  EXPECT_EQ(q41.d, f32_to_f16(0.25f));
  EXPECT_EQ(q41.m, f32_to_f16(1.0f));
  for (int j = 0; j < QK / 2; ++j) {
    EXPECT_EQ(q41.qs[j] & 0x0f, (j * 7) % 16) << j;
    EXPECT_EQ(q41.qs[j] >> 4, ((j + 16) * 7) % 16) << j;
  }
  // A constant block has d = 0 and quants 0.
  std::fill(x.begin(), x.end(), -3.0f);
  quantize_row(DType::Q4_1, x.data(), &q41, QK);
  EXPECT_EQ(q41.d, 0);
  EXPECT_EQ(q41.m, f32_to_f16(-3.0f));
  for (int j = 0; j < QK / 2; ++j) EXPECT_EQ(q41.qs[j], 0);
}

// Quantize then dequantize: every element within the format's rounding step, with the half
// rounding of the stored scale (relative 2^-11) allowed on top.
TEST(Quantize, RoundTripErrorIsWithinTheFormatStep) {
  std::mt19937 rng(9);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  const int64_t n = 4096;
  std::vector<float> x(n), y(n);
  for (float& v : x) v = dist(rng) * (rng() % 2 ? 1.0f : 1e-3f);
  for (DType t : kComputable) {
    if (!has_quantizer(t)) continue;
    std::vector<uint8_t> data(row_size(t, n));
    quantize_row(t, x.data(), data.data(), n);
    dequantize_row(t, data.data(), y.data(), n);
    const double h = std::ldexp(1.0, -11);
    for (int64_t b = 0; b < n / QK; ++b) {
      float amax = 0, lo = x[b * QK], hi = x[b * QK];
      for (int j = 0; j < QK; ++j) {
        amax = std::max(amax, std::fabs(x[b * QK + j]));
        lo = std::min(lo, x[b * QK + j]);
        hi = std::max(hi, x[b * QK + j]);
      }
      for (int j = 0; j < QK; ++j) {
        const int64_t i = b * QK + j;
        double bound = 0;
        switch (t) {
          case DType::F32:
            bound = 0;
            break;
          // Relative 2^-11, or half the subnormal spacing 2^-24 below the normal range.
          case DType::F16:
            bound = std::max(std::fabs(x[i]) * h, std::ldexp(1.0, -25));
            break;
          case DType::BF16:
            bound = std::fabs(x[i]) * std::ldexp(1.0, -8);
            break;
          // Half a step, plus up to 127 steps of the scale's rounding.
          case DType::Q8_0:
            bound = amax / 127.0 * (0.5 + 127 * h);
            break;
          // The extreme clamps from 8 to 7 steps: a whole step, plus 8 steps of scale rounding.
          case DType::Q4_0:
            bound = amax / 8.0 * (1.0 + 8 * h);
            break;
          // Half a step, 15 steps of scale rounding and the minimum's rounding.
          case DType::Q4_1:
            bound = (hi - lo) / 15.0 * (0.5 + 15 * h) + std::fabs(lo) * h;
            break;
          default:
            break;
        }
        ASSERT_LE(std::fabs(double(y[i]) - x[i]), bound * (1 + 1e-6) + 1e-30)
            << type_name(t) << " element " << i << " value " << x[i];
      }
    }
  }
}

TEST(Quantize, RejectsPartialBlocksAndOtherTypes) {
  std::vector<float> x(48);
  std::vector<uint8_t> buf(1024);
  EXPECT_THROW(quantize_row(DType::Q4_0, x.data(), buf.data(), 48), ArgumentError);
  EXPECT_THROW(dequantize_row(DType::Q8_0, buf.data(), x.data(), 40), ArgumentError);
  EXPECT_THROW(dequantize_row(DType::IQ2_XXS, buf.data(), x.data(), 256), ArgumentError);
  EXPECT_THROW(quantize_row(DType::Q6_K, x.data(), buf.data(), 0), ArgumentError);
}

// ---------------------------------------------------------------------------------------------
// mul_mat_tile

struct Problem {
  DType type;
  int64_t k;
  int n_rows, n_cols;
  std::vector<float> w_deq;  // dequantized weights, row-major n_rows x k
  std::vector<float> x;      // activations, n_cols columns of k
  std::vector<uint8_t> w;    // weights in the format
  size_t w_stride = 0;
  std::vector<uint8_t> act;  // prepared activations
  size_t act_stride = 0;
};

// A row of a format without a quantizer in ggraph: random quants and scales, with f16 scales of
// the size a quantizer would give rows of 0.1 * N(0, 1) (the largest the format can hold is about
// 0.3 on one side).
void random_row(DType t, int64_t k, std::mt19937& rng, uint8_t* dst) {
  const FormatLayout layout = layout_of(t);
  const size_t bsize = type_traits(t).type_size;
  const int64_t nb = k / type_traits(t).block_size;
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(0.2f, 1.0f);
  // Unit of the quants times the sub-block scale, so that values are about 0.3 at most.
  const float unit = t == DType::Q5_0 || t == DType::Q5_1 ? 0.3f / 31
                     : t == DType::IQ4_NL                 ? 0.3f / 127
                     : t == DType::IQ4_XS                 ? 0.3f / (127 * 31)
                     : t == DType::Q2_K                   ? 0.3f / (3 * 15)
                     : t == DType::Q3_K                   ? 0.3f / (4 * 31)
                     : t == DType::Q6_K                   ? 0.3f / (32 * 127)
                                                          : 0.3f / (31 * 63);
  for (int64_t i = 0; i < nb; ++i) {
    uint8_t* blk = dst + i * bsize;
    for (size_t j = 0; j < bsize; ++j) blk[j] = static_cast<uint8_t>(byte(rng));
    for (size_t h = 0; h < layout.halves.size(); ++h) {
      // Q5_1's second half is a minimum in value units; the K-quants' a scale of the minimums.
      float v = unit * scale(rng);
      if (t == DType::Q5_1 && h == 1) v = -0.15f * scale(rng);
      const uint16_t bits = f32_to_f16(rng() % 2 ? v : -v);
      std::memcpy(blk + layout.halves[h], &bits, 2);
    }
  }
}

Problem make_problem(DType t, int64_t k, int n_rows, int n_cols, std::mt19937& rng) {
  Problem p{t, k, n_rows, n_cols, {}, {}, {}, 0, {}, 0};
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::uniform_real_distribution<float> offset(-0.5f, 0.5f);
  // Weights with a per-row offset so that Q4_1's minimum and Q4_0's asymmetry matter.
  std::vector<float> row(k);
  // Rows padded by 2 bytes so that the kernels get rows that are not block-aligned.
  p.w_stride = row_size(t, k) + 2;
  p.w.assign(p.w_stride * n_rows, 0xcd);
  p.w_deq.resize(size_t(k) * n_rows);
  for (int r = 0; r < n_rows; ++r) {
    uint8_t* w = p.w.data() + r * p.w_stride;
    if (has_quantizer(t)) {
      const float off = offset(rng);
      for (float& v : row) v = 0.1f * dist(rng) + off;
      quantize_row(t, row.data(), w, k);
    } else {
      random_row(t, k, rng, w);
    }
    dequantize_row(t, w, p.w_deq.data() + size_t(r) * k, k);
  }
  p.x.resize(size_t(k) * n_cols);
  for (float& v : p.x) v = dist(rng);
  p.act_stride = act_row_size(t, k);
  p.act.assign(p.act_stride * n_cols, 0);
  for (int c = 0; c < n_cols; ++c) {
    prepare_act(t, p.x.data() + size_t(c) * k, p.act.data() + c * p.act_stride, k);
  }
  return p;
}

std::vector<float> run_tile(const Problem& p) {
  std::vector<float> out(size_t(p.n_rows) * p.n_cols, std::nanf(""));
  mul_mat_tile(p.type, p.k, p.w.data(), p.w_stride, p.n_rows, p.act.data(), p.act_stride, p.n_cols,
               out.data(), size_t(p.n_rows));
  return out;
}

// The activation quantization as documented in quant.h, done here independently: per block of
// 32 (256 for the super-block formats) d = amax / 127 and q = x * (127 / amax) rounded to
// nearest even.
std::vector<double> quantized_activation(DType t, const float* x, int64_t k) {
  const int64_t qb = act_block(t);
  std::vector<double> out(k);
  for (int64_t b = 0; b < k / qb; ++b) {
    float amax = 0;
    for (int j = 0; j < qb; ++j) amax = std::max(amax, std::fabs(x[b * qb + j]));
    const float id = amax != 0 ? 127.0f / amax : 0.0f;
    const float d = amax / 127.0f;
    for (int j = 0; j < qb; ++j) {
      const float prod = x[b * qb + j] * id;
      out[b * qb + j] = std::nearbyint(prod) * static_cast<double>(d);
    }
  }
  return out;
}

// Each element's minimum: its value with all quant bits zero (-8 d for Q4_0, -dmin m for Q4_K,
// -32 d sc for Q6_K...), which the kernels sum apart from the scaled quants. The signed formats
// (Q8_0, IQ4_NL, IQ4_XS) have none.
std::vector<float> element_minimums(const Problem& p, int r) {
  std::vector<float> mins(p.k, 0.0f);
  if (!is_quantized(p.type) || p.type == DType::Q8_0 || p.type == DType::IQ4_NL ||
      p.type == DType::IQ4_XS) {
    return mins;
  }
  const FormatLayout layout = layout_of(p.type);
  std::vector<uint8_t> row(p.w.begin() + r * p.w_stride, p.w.begin() + (r + 1) * p.w_stride);
  const size_t bsize = type_traits(p.type).type_size;
  for (int64_t b = 0; b < p.k / type_traits(p.type).block_size; ++b) {
    for (const auto& q : layout.quants) {
      std::fill(row.begin() + b * bsize + q.first, row.begin() + b * bsize + q.second, 0);
    }
  }
  dequantize_row(p.type, row.data(), mins.data(), p.k);
  return mins;
}

// Largest magnitude the kernels may hold in float while summing row r with column c: the
// quantized formats sum unsigned quants times the scale and add the minimum's term apart, so
// each element can contribute up to (|w| + 2|m|) |x| with m its minimum.
double float_magnitude(const Problem& p, int r, const std::vector<double>& xq) {
  const float* w = p.w_deq.data() + size_t(r) * p.k;
  const std::vector<float> mins = element_minimums(p, r);
  double sum = 0;
  for (int64_t i = 0; i < p.k; ++i)
    sum += (std::fabs(w[i]) + 2 * std::fabs(mins[i])) * std::fabs(xq[i]);
  return sum;
}

// Rounding bound of float summation: a product and one addition per block or element in each
// of 8 lanes, then the lane sum, all at unit roundoff 2^-24; doubled for second-order terms. The
// super-block formats round fewer times (a conversion and two fused steps per 256 elements).
double summation_bound(const Problem& p, double magnitude) {
  const double terms = is_quantized(p.type) ? double(p.k / QK) : double(p.k);
  return (terms + 16) * std::ldexp(1.0, -23) * magnitude;
}

void check_against_references(const Problem& p, const std::vector<float>& out,
                              const std::string& label) {
  for (int c = 0; c < p.n_cols; ++c) {
    const float* x = p.x.data() + size_t(c) * p.k;
    std::vector<double> xq(x, x + p.k);
    if (is_quantized(p.type)) xq = quantized_activation(p.type, x, p.k);
    for (int r = 0; r < p.n_rows; ++r) {
      const float* w = p.w_deq.data() + size_t(r) * p.k;
      double exact = 0, with_xq = 0, abs_dot = 0, act_bound = 0;
      for (int64_t i = 0; i < p.k; ++i) {
        exact += double(w[i]) * x[i];
        with_xq += double(w[i]) * xq[i];
        abs_dot += std::fabs(double(w[i]) * x[i]);
      }
      if (is_quantized(p.type)) {
        // 8-bit rounding moves each activation by at most half a step, amax / 254, plus the
        // float rounding of x * (127 / amax) (a few units of 2^-24 relative).
        const int64_t qb = act_block(p.type);
        for (int64_t b = 0; b < p.k / qb; ++b) {
          double amax = 0, wabs = 0;
          for (int j = 0; j < qb; ++j) {
            amax = std::max(amax, std::fabs(double(x[b * qb + j])));
            wabs += std::fabs(double(w[b * qb + j]));
          }
          act_bound += amax / 127.0 * (0.5 + 127 * std::ldexp(1.0, -21)) * wabs;
        }
      }
      const double got = out[size_t(c) * p.n_rows + r];
      const double float_bound = summation_bound(p, float_magnitude(p, r, xq));
      // Against the original activations: the 8-bit rounding dominates.
      ASSERT_LE(std::fabs(got - exact), act_bound + float_bound + 1e-30)
          << label << " r=" << r << " c=" << c << " exact=" << exact << " |w|.|x|=" << abs_dot;
      // Against the same quantized activations: only float summation differs.
      ASSERT_LE(std::fabs(got - with_xq), float_bound + 1e-30)
          << label << " r=" << r << " c=" << c << " reference=" << with_xq;
    }
  }
}

std::string label_of(const Problem& p) {
  return std::string(type_name(p.type)) + " k=" + std::to_string(p.k) + " " +
         std::to_string(p.n_rows) + "x" + std::to_string(p.n_cols) + " " + cpu_features();
}

enum class KernelSet { kScalar, kAvx2, kAvx512 };

const quant_impl::Kernels* kernels_of(KernelSet set) {
  switch (set) {
    case KernelSet::kScalar:
      return &quant_impl::scalar_kernels();
    case KernelSet::kAvx2:
      return quant_impl::avx2_kernels();
    case KernelSet::kAvx512:
      return quant_impl::avx512_kernels();
  }
  return nullptr;
}

// Runs each test with one kernel table; tables the CPU or build lacks are skipped.
class MulMatTile : public ::testing::TestWithParam<KernelSet> {
 protected:
  void SetUp() override {
    const quant_impl::Kernels* k = kernels_of(GetParam());
    if (!quant_impl::cpu_supports(k)) GTEST_SKIP() << "kernels not available on this CPU/build";
    quant_impl::use_kernels(k);
  }
  void TearDown() override { quant_impl::use_kernels(nullptr); }
};

TEST_P(MulMatTile, MatchesFloat64ReferenceForEveryTypeAndShape) {
  std::mt19937 rng(21);
  for (DType t : kComputable) {
    std::vector<int64_t> ks = {32, 64, 576, 1536, 4096};
    if (!is_quantized(t)) ks.insert(ks.end(), {1, 7, 33});
    if (act_block(t) == 256) ks = {256, 768, 2304, 8192};
    for (int64_t k : ks) {
      for (int n_rows : {1, 3, 7, 17}) {
        for (int n_cols : {1, 3, 7, 9}) {
          if (k >= 4096 && n_rows * n_cols > 50) continue;  // keeps the float64 reference quick
          const Problem p = make_problem(t, k, n_rows, n_cols, rng);
          check_against_references(p, run_tile(p), label_of(p));
        }
      }
    }
  }
}

// Bits must not depend on how rows and columns are grouped into calls.
TEST_P(MulMatTile, SameBitsWhateverTheTileShape) {
  std::mt19937 rng(33);
  for (DType t : kComputable) {
    for (int64_t k : {64, 576, 1536}) {
      if (act_block(t) == 256) k = k / 64 * 256;
      const Problem p = make_problem(t, k, 37, 13, rng);
      const std::vector<float> whole = run_tile(p);
      // One element per call.
      std::vector<float> single(whole.size());
      for (int r = 0; r < p.n_rows; ++r) {
        for (int c = 0; c < p.n_cols; ++c) {
          mul_mat_tile(t, k, p.w.data() + r * p.w_stride, p.w_stride, 1,
                       p.act.data() + c * p.act_stride, p.act_stride, 1,
                       single.data() + size_t(c) * p.n_rows + r, size_t(p.n_rows));
        }
      }
      ASSERT_EQ(0, std::memcmp(whole.data(), single.data(), whole.size() * sizeof(float)))
          << label_of(p) << ": 1x1 calls differ from one call";
      // Random tiles.
      std::uniform_int_distribution<int> size(1, 9);
      std::vector<float> tiled(whole.size());
      for (int r = 0; r < p.n_rows;) {
        const int nr = std::min(size(rng), p.n_rows - r);
        for (int c = 0; c < p.n_cols;) {
          const int nc = std::min(size(rng), p.n_cols - c);
          mul_mat_tile(t, k, p.w.data() + r * p.w_stride, p.w_stride, nr,
                       p.act.data() + c * p.act_stride, p.act_stride, nc,
                       tiled.data() + size_t(c) * p.n_rows + r, size_t(p.n_rows));
          c += nc;
        }
        r += nr;
      }
      ASSERT_EQ(0, std::memcmp(whole.data(), tiled.data(), whole.size() * sizeof(float)))
          << label_of(p) << ": random tiles differ from one call";
      // A column computed alone equals the same column inside a tile.
      std::vector<float> col(p.n_rows);
      mul_mat_tile(t, k, p.w.data(), p.w_stride, p.n_rows, p.act.data() + 5 * p.act_stride,
                   p.act_stride, 1, col.data(), size_t(p.n_rows));
      ASSERT_EQ(0, std::memcmp(whole.data() + 5 * p.n_rows, col.data(), col.size() * 4))
          << label_of(p) << ": single column differs";
    }
  }
}

TEST_P(MulMatTile, NonFiniteActivationsGiveNaN) {
  std::mt19937 rng(41);
  for (DType t : kComputable) {
    if (!is_quantized(t)) continue;
    const int64_t k = 2 * act_block(t);
    Problem p = make_problem(t, k, 3, 2, rng);
    p.x[k / 2 + 8] = std::numeric_limits<float>::infinity();
    p.x[k + 3] = std::nanf("");
    for (int c = 0; c < 2; ++c) {
      prepare_act(t, p.x.data() + c * k, p.act.data() + c * p.act_stride, k);
    }
    const std::vector<float> out = run_tile(p);
    for (float v : out) EXPECT_TRUE(std::isnan(v)) << label_of(p);
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, MulMatTile,
                         ::testing::Values(KernelSet::kScalar, KernelSet::kAvx2,
                                           KernelSet::kAvx512),
                         [](const ::testing::TestParamInfo<KernelSet>& info) {
                           return std::string(info.param == KernelSet::kScalar ? "Scalar"
                                              : info.param == KernelSet::kAvx2 ? "Avx2"
                                                                               : "Avx512");
                         });

// ---------------------------------------------------------------------------------------------
// Attention rows (the CPU attention's inner kernel), in every kernel set

class AttentionRows : public MulMatTile {};

struct AttnCase {
  int R, hd, n;
  int64_t ks, vs;
  std::vector<float> q, k, v;
  std::vector<int> b, e;
};

AttnCase random_attn_case(int R, int hd, int n, std::mt19937& rng) {
  AttnCase c{R, hd, n, hd + 8, hd + 24, {}, {}, {}, {}, {}};
  std::normal_distribution<float> g(0.0f, 1.0f);
  c.q.resize(size_t(R) * hd);
  c.k.resize(size_t(std::max(n, 1)) * c.ks);
  c.v.resize(size_t(std::max(n, 1)) * c.vs);
  for (float& x : c.q) x = g(rng);
  for (float& x : c.k) x = g(rng);
  for (float& x : c.v) x = g(rng);
  std::uniform_int_distribution<int> pos(0, n);
  for (int r = 0; r < R; ++r) {
    int lo = pos(rng), hi = pos(rng);
    if (lo > hi) std::swap(lo, hi);
    if (r == 0) lo = 0, hi = n;  // one row over every key
    if (r == 1) hi = lo;         // and one without any
    c.b.push_back(lo);
    c.e.push_back(hi);
  }
  return c;
}

struct AttnOut {
  std::vector<float> scores, mx, sum, acc;
};

AttnOut run_attention_rows(const AttnCase& c, float scale) {
  AttnOut o{std::vector<float>(size_t(c.R) * std::max(c.n, 1)), std::vector<float>(c.R),
            std::vector<float>(c.R), std::vector<float>(size_t(c.R) * c.hd)};
  attention_rows(c.q.data(), c.R, c.hd, c.k.data(), c.ks, c.v.data(), c.vs, c.n, c.b.data(),
                 c.e.data(), scale, o.scores.data(), o.mx.data(), o.sum.data(), o.acc.data());
  return o;
}

// Softmax-weighted values of every row against a float64 evaluation, for head sizes with and
// without a vector kernel (a multiple of 8 or not), chunks of whole and partial key blocks, and
// an empty chunk (every row without keys).
TEST_P(AttentionRows, MatchesFloat64Reference) {
  std::mt19937 rng(41);
  for (int hd : {64, 96, 128, 256, 36}) {
    for (int n : {0, 1, 7, 8, 9, 61, 256}) {
      const AttnCase c = random_attn_case(7, hd, n, rng);
      const float scale = 1.0f / std::sqrt(float(hd));
      const AttnOut o = run_attention_rows(c, scale);
      for (int r = 0; r < c.R; ++r) {
        const std::string where =
            "hd " + std::to_string(hd) + " n " + std::to_string(n) + " row " + std::to_string(r);
        if (c.e[r] <= c.b[r]) {
          EXPECT_EQ(o.sum[r], 0.0f) << where;
          EXPECT_TRUE(std::isinf(o.mx[r]) && o.mx[r] < 0) << where;
          for (int d = 0; d < hd; ++d) ASSERT_EQ(o.acc[size_t(r) * hd + d], 0.0f) << where;
          continue;
        }
        std::vector<double> s;
        double m = -INFINITY;
        for (int p = c.b[r]; p < c.e[r]; ++p) {
          double dot = 0;
          for (int d = 0; d < hd; ++d)
            dot += double(c.q[size_t(r) * hd + d]) * c.k[size_t(p) * c.ks + d];
          s.push_back(dot * scale);
          m = std::max(m, s.back());
        }
        double total = 0;
        for (double& x : s) total += (x = std::exp(x - m));
        EXPECT_NEAR(o.mx[r], m, 1e-5 * std::max(1.0, std::fabs(m))) << where;
        EXPECT_NEAR(o.sum[r] * std::exp(double(o.mx[r]) - m), total, 1e-5 * total) << where;
        for (int d = 0; d < hd; ++d) {
          double want = 0;
          for (int p = c.b[r]; p < c.e[r]; ++p) want += s[p - c.b[r]] * c.v[size_t(p) * c.vs + d];
          const double got = double(o.acc[size_t(r) * hd + d]) / o.sum[r];
          ASSERT_NEAR(got, want / total, 2e-5) << where << " dimension " << d;
        }
      }
    }
  }
}

// A row's result is the same bits whichever rows share the call and wherever its keys start in
// the chunk: what lets a prompt and its tokens one at a time (whose chunks start elsewhere under
// a sliding window) give the same bits.
TEST_P(AttentionRows, SameBitsWhateverTheOtherRowsAndTheChunkStart) {
  std::mt19937 rng(42);
  for (int hd : {64, 128, 36}) {
    const AttnCase all = random_attn_case(9, hd, 203, rng);
    const float scale = 0.125f;
    const AttnOut together = run_attention_rows(all, scale);
    for (int r = 0; r < all.R; ++r) {
      // Row r alone, over the keys from its first one on (the chunk starting there).
      const int o = all.b[r];
      AttnCase alone{1, hd, all.n - o, all.ks, all.vs, {}, {}, {}, {0}, {all.e[r] - o}};
      alone.q.assign(all.q.begin() + size_t(r) * hd, all.q.begin() + size_t(r + 1) * hd);
      alone.k.assign(all.k.begin() + size_t(o) * all.ks, all.k.end());
      alone.v.assign(all.v.begin() + size_t(o) * all.vs, all.v.end());
      if (alone.e[0] < 0) alone.e[0] = 0;
      const AttnOut single = run_attention_rows(alone, scale);
      const std::string where = "hd " + std::to_string(hd) + " row " + std::to_string(r);
      EXPECT_EQ(float_bits(single.mx[0]), float_bits(together.mx[r])) << where;
      EXPECT_EQ(float_bits(single.sum[0]), float_bits(together.sum[r])) << where;
      for (int d = 0; d < hd; ++d)
        ASSERT_EQ(float_bits(single.acc[d]), float_bits(together.acc[size_t(r) * hd + d]))
            << where << " dimension " << d;
    }
  }
}

// Every kernel set's softmax takes the portable one's steps: with scores that every order of
// summation gets exactly (small integers, a power-of-two scale) and values of 0 and 1 (each
// weighted value exact), the maxima, sums and weighted values equal the scalar set's bit for
// bit, over rows of every length around the vector width and scores far below the max.
TEST_P(AttentionRows, SoftmaxGivesThePortableBits) {
  std::mt19937 rng(43);
  std::uniform_int_distribution<int> small(-6, 6), bit(0, 1);
  for (int n : {1, 5, 8, 13, 16, 203}) {
    AttnCase c{6, 64, n, 72, 80, {}, {}, {}, {}, {}};
    c.q.resize(size_t(c.R) * c.hd);
    c.k.resize(size_t(n) * c.ks);
    c.v.resize(size_t(n) * c.vs);
    for (float& x : c.q) x = float(small(rng));
    for (float& x : c.k) x = float(small(rng));
    for (float& x : c.v) x = float(bit(rng));
    // Row 5's last key scores far above the others: most of its exponentials underflow to 0.
    for (int d = 0; d < c.hd; ++d) c.q[size_t(5) * c.hd + d] = 6.0f;
    for (int d = 0; d < c.hd; ++d) c.k[size_t(n - 1) * c.ks + d] = 6.0f;
    for (int r = 0; r < c.R; ++r) {
      c.b.push_back(r == 3 ? n / 3 : 0);
      c.e.push_back(r == 4 ? n - n / 4 : n);
    }
    const AttnOut got = run_attention_rows(c, 0.125f);
    quant_impl::use_kernels(kernels_of(KernelSet::kScalar));
    const AttnOut want = run_attention_rows(c, 0.125f);
    quant_impl::use_kernels(kernels_of(GetParam()));
    for (int r = 0; r < c.R; ++r) {
      const std::string where = "n " + std::to_string(n) + " row " + std::to_string(r);
      EXPECT_EQ(float_bits(got.mx[r]), float_bits(want.mx[r])) << where;
      EXPECT_EQ(float_bits(got.sum[r]), float_bits(want.sum[r])) << where;
      for (int d = 0; d < c.hd; ++d)
        ASSERT_EQ(float_bits(got.acc[size_t(r) * c.hd + d]),
                  float_bits(want.acc[size_t(r) * c.hd + d]))
            << where << " dimension " << d;
    }
  }
}

// An F16 cache read in place (attention_rows_f16, in the kernel sets that have it) gives the bits
// of attention_rows over the same rows decoded to floats: each element converts exactly.
TEST_P(AttentionRows, F16CacheInPlaceGivesTheBitsOfItsDecodedRows) {
  std::mt19937 rng(43);
  int checked = 0;
  for (int hd : {64, 128, 256}) {
    if (!has_attention_rows_f16(hd)) continue;
    for (int n : {1, 7, 8, 9, 203}) {
      AttnCase c = random_attn_case(7, hd, n, rng);
      std::vector<uint16_t> kh(c.k.size()), vh(c.v.size());
      for (size_t i = 0; i < c.k.size(); ++i) c.k[i] = f16_to_f32(kh[i] = f32_to_f16(c.k[i]));
      for (size_t i = 0; i < c.v.size(); ++i) c.v[i] = f16_to_f32(vh[i] = f32_to_f16(c.v[i]));
      const float scale = 1.0f / std::sqrt(float(hd));
      const AttnOut want = run_attention_rows(c, scale);
      AttnOut got = want;
      attention_rows_f16(c.q.data(), c.R, 1, hd, kh.data(), c.ks, vh.data(), c.vs, n, c.b.data(),
                         c.e.data(), scale, got.scores.data(), got.mx.data(), got.sum.data(),
                         got.acc.data());
      for (int r = 0; r < c.R; ++r) {
        const std::string where =
            "hd " + std::to_string(hd) + " n " + std::to_string(n) + " row " + std::to_string(r);
        EXPECT_EQ(float_bits(got.mx[r]), float_bits(want.mx[r])) << where;
        EXPECT_EQ(float_bits(got.sum[r]), float_bits(want.sum[r])) << where;
        for (int d = 0; d < hd; ++d)
          ASSERT_EQ(float_bits(got.acc[size_t(r) * hd + d]),
                    float_bits(want.acc[size_t(r) * hd + d]))
              << where << " dimension " << d;
      }
      ++checked;
    }
  }
  if (checked == 0) GTEST_SKIP() << "these kernels have no F16 form (the rows are decoded first)";
}

// H heads of R rows against n keys in one call, `all(q, k, v, ks, b, e, outputs)`, give the bits
// of one call a head, `one(h, ...)` (head h's rows and its slice of the cache rows); Elem: the
// cache's element, made from a float by to_elem.
template <class Elem, class ToElem, class All, class One>
void expect_heads_in_one_call(int hd, int H, int R, int n, std::mt19937& rng, ToElem to_elem,
                              All all, One one) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t ks = int64_t(H) * hd + 8;  // rows a little wider than the heads
  std::vector<Elem> k(size_t(n) * ks), v(size_t(n) * ks);
  for (auto& x : k) x = to_elem(normal(rng));
  for (auto& x : v) x = to_elem(normal(rng));
  const int rows = H * R;
  std::vector<float> q(size_t(rows) * hd);
  for (auto& x : q) x = normal(rng);
  std::vector<int> b(rows), e(rows);
  for (int r = 0; r < rows; ++r) {
    b[r] = int(rng() % unsigned(n));
    e[r] = b[r] + 1 + int(rng() % unsigned(n - b[r]));
  }
  std::vector<float> sc(size_t(rows) * n), mx(rows), sum(rows), acc(size_t(rows) * hd);
  all(q.data(), k.data(), v.data(), ks, b.data(), e.data(), sc.data(), mx.data(), sum.data(),
      acc.data());
  for (int h = 0; h < H; ++h) {
    std::vector<float> sc1(size_t(R) * n), mx1(R), sum1(R), acc1(size_t(R) * hd);
    one(q.data() + size_t(h) * R * hd, k.data() + h * hd, v.data() + h * hd, ks, b.data() + h * R,
        e.data() + h * R, sc1.data(), mx1.data(), sum1.data(), acc1.data());
    const std::string where = "hd " + std::to_string(hd) + " H " + std::to_string(H) + " R " +
                              std::to_string(R) + " n " + std::to_string(n) + " head " +
                              std::to_string(h);
    ASSERT_EQ(0, std::memcmp(mx1.data(), mx.data() + h * R, R * sizeof(float))) << where;
    ASSERT_EQ(0, std::memcmp(sum1.data(), sum.data() + h * R, R * sizeof(float))) << where;
    ASSERT_EQ(
        0, std::memcmp(acc1.data(), acc.data() + size_t(h) * R * hd, acc1.size() * sizeof(float)))
        << where;
  }
}

// Several heads in one call over an F16 cache read in place (each row attending to its head's
// slice of the cache rows) give the bits of one call a head.
TEST_P(AttentionRows, F16HeadsInOneCallGiveTheBitsOfOneCallAHead) {
  std::mt19937 rng(47);
  int checked = 0;
  for (int hd : {64, 128}) {
    if (!has_attention_rows_f16(hd)) continue;
    const float scale = 1.0f / std::sqrt(float(hd));
    for (int H : {2, 3, 8})
      for (int R : {1, 3, 4})
        for (int n : {1, 9, 203}) {
          auto call = [&](int heads) {
            return [=](const float* q, const uint16_t* k, const uint16_t* v, int64_t ks,
                       const int* b, const int* e, float* sc, float* mx, float* sum, float* acc) {
              attention_rows_f16(q, R, heads, hd, k, ks, v, ks, n, b, e, scale, sc, mx, sum, acc);
            };
          };
          expect_heads_in_one_call<uint16_t>(hd, H, R, n, rng, f32_to_f16, call(H), call(1));
          ++checked;
        }
  }
  if (checked == 0) GTEST_SKIP() << "these kernels have no F16 form (the rows are decoded first)";
}

// attention_rows_heads: H heads of float rows in one call give the bits of attention_rows a
// head (every kernel set, head sizes with and without a vector kernel).
TEST_P(AttentionRows, FloatHeadsInOneCallGiveTheBitsOfOneCallAHead) {
  std::mt19937 rng(48);
  for (int hd : {64, 36}) {
    const float scale = 1.0f / std::sqrt(float(hd));
    for (int H : {2, 3})
      for (int R : {1, 3})
        for (int n : {1, 9, 203}) {
          auto all = [&](const float* q, const float* k, const float* v, int64_t ks, const int* b,
                         const int* e, float* sc, float* mx, float* sum, float* acc) {
            attention_rows_heads(q, R, H, hd, k, ks, v, ks, n, b, e, scale, sc, mx, sum, acc);
          };
          auto one = [&](const float* q, const float* k, const float* v, int64_t ks, const int* b,
                         const int* e, float* sc, float* mx, float* sum, float* acc) {
            attention_rows(q, R, hd, k, ks, v, ks, n, b, e, scale, sc, mx, sum, acc);
          };
          expect_heads_in_one_call<float>(
              hd, H, R, n, rng, [](float x) { return x; }, all, one);
        }
  }
}

// The gated units' act(g) * u (SiLU; GELU's tanh form) against float64 evaluations of their
// definitions, in every kernel set: across the range where exp is finite in float and past the
// clamp on both sides, in runs that are not multiples of the vector width.
TEST_P(AttentionRows, GluMulMatchesFloat64Reference) {
  std::mt19937 rng(44);
  std::uniform_real_distribution<float> wide(-120.0f, 120.0f), narrow(-8.0f, 8.0f);
  for (bool gelu : {false, true}) {
    for (int n : {1, 7, 8, 13, 1000}) {
      std::vector<float> g(n), u(n), y(n);
      for (int i = 0; i < n; ++i) {
        g[i] = i % 3 == 0 ? wide(rng) : narrow(rng);
        u[i] = narrow(rng);
      }
      if (n > 8) g[0] = 0.0f, g[1] = -87.5f, g[2] = 88.5f, g[3] = -1e-30f, g[4] = 1e-4f;
      glu_mul(g.data(), u.data(), y.data(), n, gelu);
      for (int i = 0; i < n; ++i) {
        const double x = g[i];
        // GELU's tanh form 0.5 x (1 + tanh(a / 2)) as x / (1 + exp(-a)), the same function
        // without the cancellation 1 + tanh suffers in float64 where a < -37. Its argument a is
        // rounded in float (a few roundings, relative), which moves the result by that error
        // times |a| (1 - sigmoid(a)).
        const double a = gelu ? 1.5957691216057308 * (x + 0.044715 * x * x * x) : x;
        const double want = x / (1.0 + std::exp(-a)) * u[i];
        const double a_error = gelu ? 4e-7 * std::fabs(a) / (1.0 + std::exp(a)) : 0.0;
        ASSERT_NEAR(y[i], want, (1e-6 + a_error) * std::fabs(want) + 1e-38 * std::fabs(x * u[i]))
            << (gelu ? "gelu" : "silu") << ", n " << n << ", g " << g[i] << ", u " << u[i];
      }
    }
    const float nan = std::numeric_limits<float>::quiet_NaN(), one = 1.0f;
    float out = 0.0f;
    glu_mul(&nan, &one, &out, 1, gelu);
    EXPECT_TRUE(std::isnan(out)) << (gelu ? "gelu" : "silu");
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, AttentionRows,
                         ::testing::Values(KernelSet::kScalar, KernelSet::kAvx2,
                                           KernelSet::kAvx512),
                         [](const ::testing::TestParamInfo<KernelSet>& info) {
                           return std::string(info.param == KernelSet::kScalar ? "Scalar"
                                              : info.param == KernelSet::kAvx2 ? "Avx2"
                                                                               : "Avx512");
                         });

// ---------------------------------------------------------------------------------------------
// Scalar and vector kernels

// The type table is the one list of computable formats: each has a decoder, an activation layout
// and a scalar kernel, and the error for any other type names them all.
TEST(KernelDispatch, TypeTableListsExactlyTheFormatsWithKernels) {
  std::string names;
  for (DType t : kComputable) {
    const TypeTraits& traits = type_traits(t);
    EXPECT_TRUE(traits.computable) << traits.name;
    EXPECT_NE(traits.to_float, nullptr) << traits.name;
    EXPECT_EQ(traits.act, !is_quantized(t)           ? ActLayout::kFloat
                          : traits.block_size == 256 ? ActLayout::kQ8K
                                                     : ActLayout::kQ8)
        << traits.name;
    EXPECT_NE(quant_impl::scalar_kernels().tile[quant_impl::slot(t)], nullptr) << traits.name;
    names += std::string(names.empty() ? "" : " ") + traits.name;
  }
  std::string listed = computable_type_names();
  std::replace(listed.begin(), listed.end(), ',', ' ');
  auto words = [](const std::string& s) {
    std::vector<std::string> w;
    size_t i = 0;
    while (i < s.size()) {
      const size_t j = s.find(' ', i);
      const std::string word = s.substr(i, j == std::string::npos ? std::string::npos : j - i);
      if (!word.empty()) w.push_back(word);
      if (j == std::string::npos) break;
      i = j + 1;
    }
    std::sort(w.begin(), w.end());
    return w;
  };
  EXPECT_EQ(words(listed), words(names));
  for (uint32_t id = 0; id < 64; ++id) {
    const TypeTraits* traits = type_traits_or_null(id);
    if (traits == nullptr || traits->computable) continue;
    try {
      act_row_size(static_cast<DType>(id), 256);
      ADD_FAILURE() << traits->name << " was accepted";
    } catch (const ArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find("expected weights of type " + computable_type_names() +
                                           ", got " + traits->name),
                std::string::npos)
          << e.what();
    }
  }
}

TEST(KernelDispatch, ReportsFeaturesAndForcesScalar) {
  KernelModeGuard guard;
  force_scalar_kernels(false);
  const std::string best = cpu_features();
  EXPECT_FALSE(best.empty());
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    EXPECT_NE(best.find("avx2"), std::string::npos) << best;
  }
#endif
  force_scalar_kernels(true);
  EXPECT_EQ(std::string(cpu_features()), "scalar");
}

TEST(KernelDispatch, PreparedActivationsAreIdenticalBytes) {
  KernelModeGuard guard;
  std::mt19937 rng(51);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  for (DType t : kComputable) {
    for (int64_t k : {32, 96, 576, 4096}) {
      if (act_block(t) == 256) k = (k + 255) / 256 * 256;
      std::vector<float> x(k);
      for (float& v : x) v = dist(rng);
      const int64_t qb = act_block(t);
      if (k >= 3 * qb) {
        x[qb + 1] = std::numeric_limits<float>::infinity();       // second block non-finite
        std::fill(x.begin() + 2 * qb, x.begin() + 3 * qb, 0.0f);  // third block all zero
      }
      const size_t size = act_row_size(t, k);
      std::vector<uint8_t> a(size, 0xaa), b(size, 0x55);
      force_scalar_kernels(true);
      prepare_act(t, x.data(), a.data(), k);
      force_scalar_kernels(false);
      prepare_act(t, x.data(), b.data(), k);
      EXPECT_EQ(a, b) << type_name(t) << " k=" << k;
    }
  }
}

// Float weights: the vector kernels sum in a different order from the scalar ones (the quantized
// formats' give the same bits, tested below); both must land within the float summation bound of
// the same float64 value, so within twice that bound of each other.
TEST(KernelDispatch, ScalarAndVectorKernelsAgree) {
  KernelModeGuard guard;
  std::mt19937 rng(61);
  for (DType t : kComputable) {
    for (int64_t k : {32, 576, 1536}) {
      if (act_block(t) == 256) k = (k + 255) / 256 * 256;
      const Problem p = make_problem(t, k, 19, 6, rng);
      force_scalar_kernels(true);
      const std::vector<float> scalar = run_tile(p);
      force_scalar_kernels(false);
      const std::vector<float> vec = run_tile(p);
      for (int c = 0; c < p.n_cols; ++c) {
        std::vector<double> xq(p.x.begin() + c * k, p.x.begin() + (c + 1) * k);
        if (is_quantized(t)) xq = quantized_activation(t, p.x.data() + c * k, k);
        for (int r = 0; r < p.n_rows; ++r) {
          const size_t i = size_t(c) * p.n_rows + r;
          ASSERT_LE(std::fabs(double(scalar[i]) - vec[i]),
                    2 * summation_bound(p, float_magnitude(p, r, xq)) + 1e-30)
              << label_of(p) << " r=" << r << " c=" << c;
        }
      }
    }
  }
}

// The quantized formats' scalar kernels follow the vector kernels' integer lanes and float
// steps, so all give the same bits: checked for every instruction set the CPU has.
TEST(KernelDispatch, QuantizedFormatsGiveScalarBitsOnEveryInstructionSet) {
  KernelModeGuard guard;
  std::mt19937 rng(67);
  for (const quant_impl::Kernels* set :
       {quant_impl::avx2_kernels(), quant_impl::avx512_kernels(), quant_impl::amx_kernels()}) {
    if (!quant_impl::cpu_supports(set)) continue;
    for (DType t : kComputable) {
      if (!is_quantized(t)) continue;
      for (int64_t k : {32, 96, 256, 1024, 4352}) {
        if (k % act_block(t) != 0) continue;
        for (int n_cols : {1, 2, 5, 7, 9, 17}) {
          const Problem p = make_problem(t, k, 21, n_cols, rng);
          quant_impl::use_kernels(&quant_impl::scalar_kernels());
          const std::vector<float> want = run_tile(p);
          quant_impl::use_kernels(set);
          const std::vector<float> got = run_tile(p);
          for (size_t i = 0; i < want.size(); ++i) {
            ASSERT_EQ(float_bits(want[i]), float_bits(got[i]))
                << label_of(p) << " element " << i << ": scalar " << want[i] << ", vector "
                << got[i];
          }
        }
      }
    }
  }
}

// F16 rows (the KV cache's stores) are f32_to_f16's bits on every instruction set: random
// numbers of every exponent, the edges of the half range, and NaNs with their payloads, over a
// length that leaves a tail past the vectors.
TEST(KernelDispatch, F16RowsGiveScalarBitsOnEveryInstructionSet) {
  KernelModeGuard guard;
  std::mt19937 rng(73);
  std::uniform_int_distribution<uint32_t> bits(0, 0xffffffffu);
  std::vector<float> x(4099);
  for (float& v : x) v = bits_float(bits(rng));
  const float edges[] = {0.0f,
                         -0.0f,
                         65504.0f,
                         65519.99f,
                         65520.0f,
                         -65520.0f,
                         5.9604645e-8f,
                         2.9802322e-8f,
                         2.9802326e-8f,
                         6.1035156e-5f,
                         1e-45f,
                         std::numeric_limits<float>::infinity(),
                         bits_float(0x7f800001),
                         bits_float(0xffc12345),
                         std::numeric_limits<float>::quiet_NaN()};
  for (size_t i = 0; i < std::size(edges); ++i) x[3 * i + 1] = edges[i];
  for (const quant_impl::Kernels* set : {&quant_impl::scalar_kernels(), quant_impl::avx2_kernels(),
                                         quant_impl::avx512_kernels(), quant_impl::amx_kernels()}) {
    if (!quant_impl::cpu_supports(set)) continue;
    quant_impl::use_kernels(set);
    std::vector<uint16_t> h(x.size());
    quantize_row(DType::F16, x.data(), h.data(), static_cast<int64_t>(x.size()));
    for (size_t i = 0; i < x.size(); ++i) {
      ASSERT_EQ(h[i], f32_to_f16(x[i]))
          << set->features << ": element " << i << " (" << std::hexfloat << x[i] << ")";
    }
  }
}

// An empty product (k = 0) is zeros on every instruction set, at every column count (the AMX
// tiles have no block to multiply).
TEST(KernelDispatch, EmptyProductsAreZerosOnEveryInstructionSet) {
  KernelModeGuard guard;
  for (const quant_impl::Kernels* set : {&quant_impl::scalar_kernels(), quant_impl::avx2_kernels(),
                                         quant_impl::avx512_kernels(), quant_impl::amx_kernels()}) {
    if (!quant_impl::cpu_supports(set)) continue;
    quant_impl::use_kernels(set);
    for (DType t : {DType::Q8_0, DType::Q4_0, DType::Q4_1}) {
      for (int n_cols : {1, 6, 8, 17}) {
        const int n_rows = 20;
        std::vector<uint8_t> w(16, 0), act(64, 0);
        std::vector<float> out(size_t(n_rows) * n_cols, std::nanf(""));
        mul_mat_tile(t, 0, w.data(), 0, n_rows, act.data(), 0, n_cols, out.data(), size_t(n_rows));
        for (float v : out) ASSERT_EQ(v, 0.0f) << type_name(t) << ", " << n_cols << " columns";
      }
    }
  }
}

// The AVX2 and AVX512-VNNI kernels do the same arithmetic (the 8-bit dots are exact integers
// either way), so they must agree bit for bit; a CPU without both skips.
TEST(KernelDispatch, InstructionSetsGiveSameBits) {
  KernelModeGuard guard;
  const quant_impl::Kernels* avx2 = quant_impl::avx2_kernels();
  const quant_impl::Kernels* avx512 = quant_impl::avx512_kernels();
  if (!quant_impl::cpu_supports(avx2) || !quant_impl::cpu_supports(avx512)) {
    GTEST_SKIP() << "needs a CPU and build with both AVX2 and AVX512-VNNI kernels";
  }
  std::mt19937 rng(71);
  for (DType t : kComputable) {
    for (int64_t k : {32, 96, 576, 1536}) {
      if (act_block(t) == 256) k = (k + 255) / 256 * 256;
      for (int n_cols : {1, 5}) {
        Problem p = make_problem(t, k, 23, n_cols, rng);
        quant_impl::use_kernels(avx2);
        const std::vector<float> a = run_tile(p);
        std::vector<uint8_t> act_a = p.act;
        quant_impl::use_kernels(avx512);
        for (int c = 0; c < n_cols; ++c) {
          prepare_act(t, p.x.data() + size_t(c) * k, p.act.data() + c * p.act_stride, k);
        }
        EXPECT_EQ(act_a, p.act) << type_name(t) << " k=" << k;
        const std::vector<float> b = run_tile(p);
        EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)))
            << type_name(t) << " k=" << k << " n_cols=" << n_cols;
      }
    }
  }
}

// The vector decoders of the KV cache's formats give the table's bits: every F16 value (NaN
// payloads included) at offsets that leave a scalar tail, and random Q8_0 blocks whose scales
// span normal, subnormal and zero.
TEST(KernelDispatch, VectorDecodersGiveTheTableBits) {
  KernelModeGuard guard;
  std::vector<uint16_t> halves(65536 + 5);
  for (size_t i = 0; i < halves.size(); ++i) halves[i] = static_cast<uint16_t>(i * 40503u);
  std::mt19937 rng(73);
  std::vector<BlockQ8_0> q8(64);
  for (size_t i = 0; i < q8.size(); ++i) {
    const uint16_t scales[] = {0x3c00, 0x0001, 0x0000, 0x1234, 0x7bff, 0x8400};
    q8[i].d = i < 6 ? scales[i] : static_cast<uint16_t>(rng() & 0x7fff);
    for (int j = 0; j < QK; ++j) q8[i].qs[j] = static_cast<int8_t>(rng());
  }
  for (const quant_impl::Kernels* set :
       {quant_impl::avx2_kernels(), quant_impl::avx512_kernels()}) {
    if (!quant_impl::cpu_supports(set)) continue;
    for (int64_t n : {int64_t(65536), int64_t(5), int64_t(13), int64_t(64)}) {
      std::vector<float> want(n), got(n);
      quant_impl::use_kernels(&quant_impl::scalar_kernels());
      dequantize_row(DType::F16, halves.data() + 3, want.data(), n);
      quant_impl::use_kernels(set);
      dequantize_row(DType::F16, halves.data() + 3, got.data(), n);
      for (int64_t i = 0; i < n; ++i)
        ASSERT_EQ(float_bits(want[i]), float_bits(got[i])) << "F16 " << n << " element " << i;
    }
    const int64_t n = int64_t(q8.size()) * QK;
    std::vector<float> want(n), got(n);
    quant_impl::use_kernels(&quant_impl::scalar_kernels());
    dequantize_row(DType::Q8_0, q8.data(), want.data(), n);
    quant_impl::use_kernels(set);
    dequantize_row(DType::Q8_0, q8.data(), got.data(), n);
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(float_bits(want[i]), float_bits(got[i])) << "Q8_0 element " << i;
  }
}

TEST(KernelDispatch, RejectsTypesWithoutKernelsAndPartialBlocks) {
  std::vector<uint8_t> buf(4096);
  float out[4];
  EXPECT_THROW(act_row_size(DType::IQ2_XXS, 256), ArgumentError);
  EXPECT_THROW(act_row_size(DType::Q8_0, 48), ArgumentError);
  EXPECT_THROW(prepare_act(DType::TQ1_0, nullptr, buf.data(), 256), ArgumentError);
  EXPECT_THROW(mul_mat_tile(DType::IQ1_S, 256, buf.data(), 256, 1, buf.data(), 256, 1, out, 1),
               ArgumentError);
  EXPECT_THROW(mul_mat_tile(DType::Q4_1, 48, buf.data(), 48, 1, buf.data(), 48, 1, out, 1),
               ArgumentError);
}

}  // namespace
}  // namespace ggraph
