// Weight formats: type table, dequantization and dot products for the CPU backend.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#if defined(__CUDACC__)
#define GGRAPH_HD __host__ __device__ __forceinline__
#else
#define GGRAPH_HD inline
#endif

namespace ggraph {

// Values are ggml's type ids as stored in GGUF tensor tables.
enum class DType : uint32_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q8_1 = 9,
  Q2_K = 10,
  Q3_K = 11,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  Q8_K = 15,
  IQ2_XXS = 16,
  IQ2_XS = 17,
  IQ3_XXS = 18,
  IQ1_S = 19,
  IQ4_NL = 20,
  IQ3_S = 21,
  IQ2_S = 22,
  IQ4_XS = 23,
  I8 = 24,
  I16 = 25,
  I32 = 26,
  I64 = 27,
  F64 = 28,
  IQ1_M = 29,
  BF16 = 30,
  TQ1_0 = 34,
  TQ2_0 = 35,
  MXFP4 = 39,
};

// How a format's dot product wants its activations prepared (layouts in quant_impl.h).
enum class ActLayout : uint8_t {
  kNone,   // the format has no CPU dot product
  kFloat,  // f32 copy, zero-padded (F32, F16, BF16)
  kQ8,     // 8-bit, an f32 scale and sum per 32 elements (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 IQ4_NL)
  kQ8K,    // 8-bit, an f32 scale per 256 elements and int16 sums per 16 (K-quants, IQ4_XS)
};

// Everything ggraph knows about a format lives in one table (dtype.cpp): adding a format means a
// line there plus its kernels (quant.cpp and the x86 kernel files).
struct TypeTraits {
  const char* name;    // "Q4_1"
  int64_t block_size;  // elements per block (1 for plain types)
  size_t type_size;    // bytes per block
  ActLayout act;       // the activation layout of its CPU dot product; kNone if it has none
  bool computable;     // ggraph can run mat-muls with it on the CPU (act != kNone)
  // Decodes n_blocks blocks to floats exactly as ggml does; nullptr if ggraph cannot.
  void (*to_float)(const void* blocks, float* dst, int64_t n_blocks);
};

// Returns nullptr for an id that is not a known ggml type.
const TypeTraits* type_traits_or_null(uint32_t id);
const TypeTraits& type_traits(DType t);
inline const char* type_name(DType t) { return type_traits(t).name; }
// Bytes of one row of n elements; n must be a multiple of the block size.
size_t row_size(DType t, int64_t n);
// The type named `name` ("Q4_K"); throws ArgumentError naming the known types for any other.
DType type_from_name(const std::string& name);
// The computable formats' names in the table's order, for error messages: "F32, F16, ..., Q6_K".
std::string computable_type_names();

// The 8 six-bit scales and minimums of Q4_K and Q5_K: for j < 4 the low 6 bits of bytes j and
// j + 4; for j >= 4 the nibbles of byte j + 4 with the top 2 bits of bytes j - 4 and j above them.
GGRAPH_HD void k_scale_min(const uint8_t* s, int j, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// The 16 six-bit scales of Q3_K: low nibbles in bytes 0..7 (scale j < 8 in the low nibble of byte
// j, scale j >= 8 in the high nibble of byte j - 8), high bit pairs in bytes 8..11 (scale j in
// bits 2 (j / 4) of byte 8 + j % 4); stored offset by 32.
GGRAPH_HD int q3_k_scale(const uint8_t* scales, int j) {
  const int lo = j < 8 ? scales[j] & 0x0f : scales[j - 8] >> 4;
  const int hi = (scales[8 + j % 4] >> (2 * (j / 4))) & 3;
  return (lo | (hi << 4)) - 32;
}

// Block layouts (identical to ggml's on-disk formats).
constexpr int QK = 32;  // elements per block of Q4_0, Q4_1, Q8_0
struct BlockQ4_0 {
  uint16_t d;  // f16 scale
  uint8_t qs[QK / 2];
};
struct BlockQ4_1 {
  uint16_t d;  // f16 scale
  uint16_t m;  // f16 minimum
  uint8_t qs[QK / 2];
};
struct BlockQ8_0 {
  uint16_t d;  // f16 scale
  int8_t qs[QK];
};
static_assert(sizeof(BlockQ4_0) == 18, "Q4_0 block layout");
static_assert(sizeof(BlockQ4_1) == 20, "Q4_1 block layout");
static_assert(sizeof(BlockQ8_0) == 34, "Q8_0 block layout");

// 5-bit formats: the low nibbles as in Q4_0/Q4_1, the fifth bits of the 32 values in qh (bit j of
// the little-endian 32-bit word is element j's fifth bit).
struct BlockQ5_0 {
  uint16_t d;     // f16 scale
  uint8_t qh[4];  // fifth bits
  uint8_t qs[QK / 2];
};
struct BlockQ5_1 {
  uint16_t d;  // f16 scale
  uint16_t m;  // f16 minimum
  uint8_t qh[4];
  uint8_t qs[QK / 2];
};
static_assert(sizeof(BlockQ5_0) == 22, "Q5_0 block layout");
static_assert(sizeof(BlockQ5_1) == 24, "Q5_1 block layout");

// K-quants: 256-element super-blocks of 16 sub-blocks of 16 (Q2_K, Q3_K, Q6_K) or 8 of 32 (Q4_K,
// Q5_K), each sub-block with a small integer scale (and minimum) times the f16 super-block scales.
constexpr int QK_K = 256;
constexpr int K_SCALE_SIZE = 12;  // 8 six-bit scales and 8 six-bit minimums of Q4_K/Q5_K
struct BlockQ2_K {
  uint8_t scales[QK_K / 16];  // low nibble scale, high nibble minimum of each sub-block of 16
  uint8_t qs[QK_K / 4];       // 2-bit quants
  uint16_t d;                 // f16 scale of the scales
  uint16_t dmin;              // f16 scale of the minimums
};
struct BlockQ3_K {
  uint8_t hmask[QK_K / 8];  // third bits (set means +0, clear means -4)
  uint8_t qs[QK_K / 4];     // low 2 bits
  uint8_t scales[12];       // 16 six-bit scales, offset by 32
  uint16_t d;               // f16 scale of the scales
};
struct BlockQ4_K {
  uint16_t d;     // f16 scale of the scales
  uint16_t dmin;  // f16 scale of the minimums
  uint8_t scales[K_SCALE_SIZE];
  uint8_t qs[QK_K / 2];
};
struct BlockQ5_K {
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[K_SCALE_SIZE];
  uint8_t qh[QK_K / 8];  // fifth bits
  uint8_t qs[QK_K / 2];
};
struct BlockQ6_K {
  uint8_t ql[QK_K / 2];      // low 4 bits
  uint8_t qh[QK_K / 4];      // high 2 bits
  int8_t scales[QK_K / 16];  // 8-bit scales of the sub-blocks of 16
  uint16_t d;                // f16 scale of the scales
};
// The activation form ggml pairs with K-quants; listed for the type table's sizes.
struct BlockQ8_K {
  float d;
  int8_t qs[QK_K];
  int16_t bsums[QK_K / 16];
};
static_assert(sizeof(BlockQ2_K) == 84, "Q2_K block layout");
static_assert(sizeof(BlockQ3_K) == 110, "Q3_K block layout");
static_assert(sizeof(BlockQ4_K) == 144, "Q4_K block layout");
static_assert(sizeof(BlockQ5_K) == 176, "Q5_K block layout");
static_assert(sizeof(BlockQ6_K) == 210, "Q6_K block layout");
static_assert(sizeof(BlockQ8_K) == 292, "Q8_K block layout");

// Non-linear 4-bit formats: each nibble indexes a fixed table of 16 int8 levels.
struct BlockIQ4_NL {
  uint16_t d;
  uint8_t qs[QK / 2];
};
struct BlockIQ4_XS {
  uint16_t d;
  uint16_t scales_h;            // high 2 bits of the 8 six-bit sub-block scales
  uint8_t scales_l[QK_K / 64];  // low 4 bits of the 8 scales
  uint8_t qs[QK_K / 2];
};
static_assert(sizeof(BlockIQ4_NL) == 18, "IQ4_NL block layout");
static_assert(sizeof(BlockIQ4_XS) == 136, "IQ4_XS block layout");

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);  // round to nearest even
float bf16_to_f32(uint16_t h);
uint16_t f32_to_bf16(float f);  // round to nearest even

// Dequantize n elements (n a multiple of the block size) of a type the table can decode (every
// computable type).
void dequantize_row(DType t, const void* src, float* dst, int64_t n);
// The decoder dequantize_row uses for t (the fastest the CPU has), which decodes n_blocks whole
// blocks without checks: for loops over many short rows (a KV cache's), where a check and a
// lookup per row cost as much as the decoding. Throws ArgumentError for a type it cannot decode.
using RowDecoder = void (*)(const void* blocks, float* dst, int64_t n_blocks);
RowDecoder row_decoder(DType t);
// Reference quantizer (ggml's rounding) for F32, F16, BF16, Q8_0, Q4_0 and Q4_1; used by tests,
// tools and the KV cache. Other types throw ArgumentError.
void quantize_row(DType t, const float* src, void* dst, int64_t n);

// Activations are prepared once per column into the form the weight type's dot product wants
// (its traits' ActLayout: 8-bit blocks for quantized weights, float for float weights), then
// dotted with many rows. kQ8: per 32 elements an f32 scale amax/127, int8 values rounded to
// nearest even and the f32 sum scale * sum(values). kQ8K: the same per 256 elements, with the
// int16 sums of each 16 values. A block holding Inf or NaN gets a NaN scale, so every dot it
// enters is NaN. act_row_size is a multiple of 64 bytes; pass it as act_stride so columns stay
// cache-line aligned. The kernels read the padding prepare_act writes: always prepare a column.
size_t act_row_size(DType weight_type, int64_t n);
void prepare_act(DType weight_type, const float* x, void* dst, int64_t n);

// out[c * out_stride + r] = dot(row r of W, column c of act), for r < n_rows, c < n_cols.
// W rows are w_stride bytes apart, prepared activation columns act_stride bytes apart.
// Each output element comes from one fixed sequence of operations, so results are identical bits
// whatever the tile shape or thread split. Throws ArgumentError for a type that is not computable
// or a k that is not a multiple of its block size.
// Shapes that run fastest:
// - one column (decode, memory-bound): give each thread its whole share of rows in one call. The
//   kernel reads a large share as a few sequential streams from distant parts of it, which
//   reaches memory bandwidth; neighbouring rows read side by side, or many small calls, do not.
// - several columns (prompt, compute-bound): 16 to 64 rows by 4 or 8 columns, with consecutive
//   calls on the same rows so that the rows stay in L1/L2 across column tiles.
void mul_mat_tile(DType weight_type, int64_t k, const void* w, size_t w_stride, int n_rows,
                  const void* act, size_t act_stride, int n_cols, float* out, size_t out_stride);

// Attention of R query rows (q, hd floats each) against one chunk of n keys and values (rows of
// hd floats, ks and vs floats apart), the inner kernel of the CPU backend's attention. Row r
// attends to keys [b[r], e[r]) of the chunk. Per row it leaves the max score in mx (-inf when
// the row has no keys), the sum of exp(score - max) in sum (0 then) and the exp-weighted values,
// unnormalized, in acc (R x hd); scores (R x n) is its workspace. Each row's result is one fixed
// sequence of operations whatever the other rows of the call, so a prompt and its tokens one at
// a time give the same bits.
void attention_rows(const float* q, int R, int hd, const float* k, int64_t ks, const float* v,
                    int64_t vs, int n, const int* b, const int* e, float scale, float* scores,
                    float* mx, float* sum, float* acc);

// attention_rows for H heads at once over float rows: rows [h R, h R + R) (q, b, e, scores, mx,
// sum, acc in that order; scores n apart) attend to head h's keys and values, hd
// elements into each row (h hd), as H calls of attention_rows would, bit for bit; in the x86
// kernel sets one call reads each key's row once for all the heads.
void attention_rows_heads(const float* q, int R, int H, int hd, const float* k, int64_t ks,
                          const float* v, int64_t vs, int n, const int* b, const int* e,
                          float scale, float* scores, float* mx, float* sum, float* acc);

// attention_rows_heads over an F16 cache read in place (k and v rows ks and vs elements apart),
// with the bits it gives over the rows decoded to floats. Only where has_attention_rows_f16(hd):
// the running kernels have that form (else the caller decodes the rows first).
bool has_attention_rows_f16(int hd);
void attention_rows_f16(const float* q, int R, int H, int hd, const uint16_t* k, int64_t ks,
                        const uint16_t* v, int64_t vs, int n, const int* b, const int* e,
                        float scale, float* scores, float* mx, float* sum, float* acc);

// y = act(g) * u over n elements (a gated unit): act(g) = g sigmoid(a), a = g for SiLU (SwiGLU) and
// a = 2 sqrt(2 / pi) (g + 0.044715 g^3) for GELU's tanh form (GeGLU: 0.5 g (1 + tanh(a / 2))).
// exp(-a) is 2^m e^r, m the nearest integer to -a log2(e) and e^r (|r| <= ln(2) / 2) its Taylor
// polynomial of degree 6, -a held to [-87, 88] (where a > 88 the result is within e^-88 |g u|,
// about 1e-38 |g u|, of the exact one); within 1e-6 of the exact value relative. In lanes of 8
// where the CPU has AVX2.
void glu_mul(const float* g, const float* u, float* y, int64_t n, bool gelu);

// The instruction sets the hot loops use on the running CPU ("avx2 fma f16c"), or "scalar".
const char* cpu_features();
// Selects the portable kernels (true) or the best the CPU offers (false); for tests that compare
// the two. Setting the environment variable GGRAPH_FORCE_SCALAR=1 starts in scalar mode.
void force_scalar_kernels(bool scalar);

}  // namespace ggraph
