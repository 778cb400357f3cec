// The ggml type table: every format's name, block size and byte size as stored in GGUF files,
// and what ggraph can do with it (decode it, dot it on the CPU against which activation layout).
#include <string>

#include "common.h"
#include "quant.h"
#include "quant_impl.h"

namespace ggraph {
namespace {

using quant_impl::ToFloatFn;

struct TypeEntry {
  DType id;
  TypeTraits traits;
};

// A format ggraph only reads the size of.
constexpr TypeEntry stored(DType id, const char* name, int64_t block, size_t bytes) {
  return {id, {name, block, bytes, ActLayout::kNone, false, nullptr}};
}
// A format ggraph decodes but has no dot product for.
constexpr TypeEntry decoded(DType id, const char* name, int64_t block, size_t bytes,
                            ToFloatFn to_float) {
  return {id, {name, block, bytes, ActLayout::kNone, false, to_float}};
}
// A format ggraph computes with on the CPU: decoded, and dotted against activations in `act`.
constexpr TypeEntry computed(DType id, const char* name, int64_t block, size_t bytes, ActLayout act,
                             ToFloatFn to_float) {
  return {id, {name, block, bytes, act, true, to_float}};
}

// Sizes follow ggml's block structs (ggml-common.h); K-quants and most IQ types use 256-element
// super-blocks. Q8_1 stores two f16 values (d and the scaled sum) ahead of 32 int8 quants.
constexpr ActLayout kFloat = ActLayout::kFloat, kQ8 = ActLayout::kQ8, kQ8K = ActLayout::kQ8K;
constexpr TypeEntry kTypes[] = {
    computed(DType::F32, "F32", 1, 4, kFloat, quant_impl::to_float_f32),
    computed(DType::F16, "F16", 1, 2, kFloat, quant_impl::to_float_f16),
    computed(DType::Q4_0, "Q4_0", 32, sizeof(BlockQ4_0), kQ8, quant_impl::to_float_q4_0),
    computed(DType::Q4_1, "Q4_1", 32, sizeof(BlockQ4_1), kQ8, quant_impl::to_float_q4_1),
    computed(DType::Q5_0, "Q5_0", 32, sizeof(BlockQ5_0), kQ8, quant_impl::to_float_q5_0),
    computed(DType::Q5_1, "Q5_1", 32, sizeof(BlockQ5_1), kQ8, quant_impl::to_float_q5_1),
    computed(DType::Q8_0, "Q8_0", 32, sizeof(BlockQ8_0), kQ8, quant_impl::to_float_q8_0),
    stored(DType::Q8_1, "Q8_1", 32, 36),
    computed(DType::Q2_K, "Q2_K", 256, sizeof(BlockQ2_K), kQ8K, quant_impl::to_float_q2_k),
    computed(DType::Q3_K, "Q3_K", 256, sizeof(BlockQ3_K), kQ8K, quant_impl::to_float_q3_k),
    computed(DType::Q4_K, "Q4_K", 256, sizeof(BlockQ4_K), kQ8K, quant_impl::to_float_q4_k),
    computed(DType::Q5_K, "Q5_K", 256, sizeof(BlockQ5_K), kQ8K, quant_impl::to_float_q5_k),
    computed(DType::Q6_K, "Q6_K", 256, sizeof(BlockQ6_K), kQ8K, quant_impl::to_float_q6_k),
    stored(DType::Q8_K, "Q8_K", 256, sizeof(BlockQ8_K)),
    stored(DType::IQ2_XXS, "IQ2_XXS", 256, 66),
    stored(DType::IQ2_XS, "IQ2_XS", 256, 74),
    stored(DType::IQ3_XXS, "IQ3_XXS", 256, 98),
    stored(DType::IQ1_S, "IQ1_S", 256, 50),
    computed(DType::IQ4_NL, "IQ4_NL", 32, sizeof(BlockIQ4_NL), kQ8, quant_impl::to_float_iq4_nl),
    stored(DType::IQ3_S, "IQ3_S", 256, 110),
    stored(DType::IQ2_S, "IQ2_S", 256, 82),
    computed(DType::IQ4_XS, "IQ4_XS", 256, sizeof(BlockIQ4_XS), kQ8K, quant_impl::to_float_iq4_xs),
    stored(DType::I8, "I8", 1, 1),
    stored(DType::I16, "I16", 1, 2),
    stored(DType::I32, "I32", 1, 4),
    stored(DType::I64, "I64", 1, 8),
    stored(DType::F64, "F64", 1, 8),
    stored(DType::IQ1_M, "IQ1_M", 256, 56),
    computed(DType::BF16, "BF16", 1, 2, kFloat, quant_impl::to_float_bf16),
    stored(DType::TQ1_0, "TQ1_0", 256, 54),
    stored(DType::TQ2_0, "TQ2_0", 256, 66),
    stored(DType::MXFP4, "MXFP4", 32, 17),
};

}  // namespace

const TypeTraits* type_traits_or_null(uint32_t id) {
  for (const TypeEntry& e : kTypes) {
    if (static_cast<uint32_t>(e.id) == id) return &e.traits;
  }
  return nullptr;
}

const TypeTraits& type_traits(DType t) {
  const TypeTraits* traits = type_traits_or_null(static_cast<uint32_t>(t));
  if (traits == nullptr) {
    throw ArgumentError("unknown ggml type id " + std::to_string(static_cast<uint32_t>(t)));
  }
  return *traits;
}

DType type_from_name(const std::string& name) {
  std::string known;
  for (const TypeEntry& e : kTypes) {
    if (name == e.traits.name) return e.id;
    known += known.empty() ? "" : ", ";
    known += e.traits.name;
  }
  throw ArgumentError("unknown ggml type name '" + name + "': expected one of " + known);
}

std::string computable_type_names() {
  std::string names;
  for (const TypeEntry& e : kTypes) {
    if (!e.traits.computable) continue;
    if (!names.empty()) names += ", ";
    names += e.traits.name;
  }
  return names;
}

size_t row_size(DType t, int64_t n) {
  const TypeTraits& traits = type_traits(t);
  if (n < 0 || n % traits.block_size != 0) {
    throw ArgumentError(std::string("row of ") + traits.name +
                        ": expected a non-negative multiple of " +
                        std::to_string(traits.block_size) + " elements, got " + std::to_string(n));
  }
  uint64_t bytes = 0;
  if (mul_overflows(static_cast<uint64_t>(n / traits.block_size), traits.type_size, &bytes)) {
    throw ArgumentError(std::string("row of ") + std::to_string(n) + " " + traits.name +
                        " elements: byte size overflows");
  }
  return static_cast<size_t>(bytes);
}

}  // namespace ggraph
