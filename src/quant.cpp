// Portable half-float conversions, ggml's reference block (de)quantizers, the scalar dot-product
// kernels and the run-time choice between them and the AVX2 kernels.
#include "quant.h"

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "common.h"
#include "quant_impl.h"

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
  throw ArgumentError(std::string(what) + ": expected weights of type F32, F16, BF16, Q8_0, Q4_0" +
                      " or Q4_1, got " +
                      (traits != nullptr ? std::string(traits->name)
                                         : "type id " + std::to_string(static_cast<uint32_t>(t))));
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

void dequantize_row(DType t, const void* src, float* dst, int64_t n) {
  switch (t) {
    case DType::F32:
      check_blocks(t, n, 1, "dequantize_row");
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      return;
    case DType::F16:
    case DType::BF16: {
      check_blocks(t, n, 1, "dequantize_row");
      const uint16_t* h = static_cast<const uint16_t*>(src);
      if (t == DType::F16) {
        for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(h[i]);
      } else {
        for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(h[i]);
      }
      return;
    }
    case DType::Q4_0: {
      check_blocks(t, n, QK, "dequantize_row");
      const BlockQ4_0* b = static_cast<const BlockQ4_0*>(src);
      for (int64_t i = 0; i < n / QK; ++i, dst += QK) {
        const float d = f16_to_f32(b[i].d);
        for (int j = 0; j < QK / 2; ++j) {
          dst[j] = static_cast<float>((b[i].qs[j] & 0x0f) - 8) * d;
          dst[j + QK / 2] = static_cast<float>((b[i].qs[j] >> 4) - 8) * d;
        }
      }
      return;
    }
    case DType::Q4_1: {
      check_blocks(t, n, QK, "dequantize_row");
      const BlockQ4_1* b = static_cast<const BlockQ4_1*>(src);
      for (int64_t i = 0; i < n / QK; ++i, dst += QK) {
        const float d = f16_to_f32(b[i].d), m = f16_to_f32(b[i].m);
        for (int j = 0; j < QK / 2; ++j) {
          dst[j] = static_cast<float>(b[i].qs[j] & 0x0f) * d + m;
          dst[j + QK / 2] = static_cast<float>(b[i].qs[j] >> 4) * d + m;
        }
      }
      return;
    }
    case DType::Q8_0: {
      check_blocks(t, n, QK, "dequantize_row");
      const BlockQ8_0* b = static_cast<const BlockQ8_0*>(src);
      for (int64_t i = 0; i < n / QK; ++i, dst += QK) {
        const float d = f16_to_f32(b[i].d);
        for (int j = 0; j < QK; ++j) dst[j] = static_cast<float>(b[i].qs[j]) * d;
      }
      return;
    }
    default:
      not_computable(t, "dequantize_row");
  }
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
        for (int64_t i = 0; i < n; ++i) h[i] = f32_to_f16(src[i]);
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
    default:
      not_computable(t, "quantize_row");
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

// Q4_0 is Q4_1 with minimum -8 d: one kernel, the minimum's term summed apart from the blocks.
template <bool kQ4_1>
void tile_q4_scalar(int64_t k, const uint8_t* w, size_t w_stride, int n_rows, const uint8_t* act,
                    size_t act_stride, int n_cols, float* out, size_t out_stride) {
  const int64_t nb = k / QK;
  const size_t bsize = kQ4_1 ? sizeof(BlockQ4_1) : sizeof(BlockQ4_0);
  const size_t qoff = kQ4_1 ? 4 : 2;
  for (int r = 0; r < n_rows; ++r) {
    const uint8_t* row = w + r * w_stride;
    for (int c = 0; c < n_cols; ++c) {
      const uint8_t* col = act + c * act_stride;
      const int8_t* q = reinterpret_cast<const int8_t*>(col);
      const float* ds = act_ds(col, k);
      float acc = 0.0f, acc_min = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = row + b * bsize;
        const uint8_t* qs = blk + qoff;
        int32_t isum = 0;
        for (int j = 0; j < QK / 2; ++j) {
          isum += (qs[j] & 0x0f) * q[act_q_offset(b, j)] +
                  (qs[j] >> 4) * q[act_q_offset(b, j + QK / 2)];
        }
        uint16_t dh, mh;
        std::memcpy(&dh, blk, 2);
        const float dw = f16_to_f32(dh);
        float m;
        if (kQ4_1) {
          std::memcpy(&mh, blk + 2, 2);
          m = f16_to_f32(mh);
        } else {
          m = -8.0f * dw;
        }
        acc += dw * ds[2 * b] * static_cast<float>(isum);
        acc_min += m * ds[2 * b + 1];
      }
      out[c * out_stride + r] = acc + acc_min;
    }
  }
}

void tile_q8_0_scalar(int64_t k, const uint8_t* w, size_t w_stride, int n_rows, const uint8_t* act,
                      size_t act_stride, int n_cols, float* out, size_t out_stride) {
  const int64_t nb = k / QK;
  for (int r = 0; r < n_rows; ++r) {
    const BlockQ8_0* row = reinterpret_cast<const BlockQ8_0*>(w + r * w_stride);
    for (int c = 0; c < n_cols; ++c) {
      const uint8_t* col = act + c * act_stride;
      const int8_t* q = reinterpret_cast<const int8_t*>(col);
      const float* ds = act_ds(col, k);
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t isum = 0;
        for (int j = 0; j < QK; ++j) isum += row[b].qs[j] * q[act_q_offset(b, j)];
        acc += f16_to_f32(row[b].d) * ds[2 * b] * static_cast<float>(isum);
      }
      out[c * out_stride + r] = acc;
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

const quant_impl::Kernels kScalar = {
    "scalar",
    tile_float_scalar<float>,
    tile_float_scalar<uint16_t>,
    tile_float_scalar<Bf16>,
    tile_q8_0_scalar,
    tile_q4_scalar<false>,
    tile_q4_scalar<true>,
    prepare_q8_scalar,
    prepare_f32_scalar,
};

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

const quant_impl::Kernels* best_kernels() {
  for (const quant_impl::Kernels* k : {quant_impl::avx512_kernels(), quant_impl::avx2_kernels()}) {
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

bool is_quantized(DType t) { return t == DType::Q8_0 || t == DType::Q4_0 || t == DType::Q4_1; }
bool is_float(DType t) { return t == DType::F32 || t == DType::F16 || t == DType::BF16; }

}  // namespace

namespace quant_impl {

const Kernels& scalar_kernels() { return kScalar; }

bool cpu_supports(const Kernels* k) {
  if (k == nullptr) return false;
  if (k == &kScalar) return true;
  if (k == avx2_kernels()) return cpu_has_avx2();
  if (k == avx512_kernels()) return cpu_has_avx512_vnni();
  return false;
}

void use_kernels(const Kernels* k) {
  g_kernels.store(k != nullptr ? k : best_kernels(), std::memory_order_release);
}

}  // namespace quant_impl

void force_scalar_kernels(bool scalar) { quant_impl::use_kernels(scalar ? &kScalar : nullptr); }

const char* cpu_features() { return kernels().features; }

size_t act_row_size(DType weight_type, int64_t n) {
  if (is_quantized(weight_type)) {
    check_blocks(weight_type, n, QK, "act_row_size");
    return quant_impl::q8_act_size(n);
  }
  if (is_float(weight_type)) {
    check_blocks(weight_type, n, 1, "act_row_size");
    return quant_impl::f32_act_size(n);
  }
  not_computable(weight_type, "act_row_size");
}

void prepare_act(DType weight_type, const float* x, void* dst, int64_t n) {
  if (is_quantized(weight_type)) {
    check_blocks(weight_type, n, QK, "prepare_act");
    kernels().prepare_q8(x, dst, n);
    return;
  }
  if (is_float(weight_type)) {
    check_blocks(weight_type, n, 1, "prepare_act");
    kernels().prepare_f32(x, dst, n);
    return;
  }
  not_computable(weight_type, "prepare_act");
}

void mul_mat_tile(DType weight_type, int64_t k, const void* w, size_t w_stride, int n_rows,
                  const void* act, size_t act_stride, int n_cols, float* out, size_t out_stride) {
  const quant_impl::Kernels& kern = kernels();
  quant_impl::TileFn fn = nullptr;
  switch (weight_type) {
    case DType::F32:
      fn = kern.f32;
      break;
    case DType::F16:
      fn = kern.f16;
      break;
    case DType::BF16:
      fn = kern.bf16;
      break;
    case DType::Q8_0:
      fn = kern.q8_0;
      break;
    case DType::Q4_0:
      fn = kern.q4_0;
      break;
    case DType::Q4_1:
      fn = kern.q4_1;
      break;
    default:
      not_computable(weight_type, "mul_mat_tile");
  }
  check_blocks(weight_type, k, is_quantized(weight_type) ? QK : 1, "mul_mat_tile");
  if (n_rows <= 0 || n_cols <= 0) return;
  fn(k, static_cast<const uint8_t*>(w), w_stride, n_rows, static_cast<const uint8_t*>(act),
     act_stride, n_cols, out, out_stride);
}

}  // namespace ggraph
