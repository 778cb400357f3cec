// The ggml type table: names, block sizes and block byte sizes as stored in GGUF files.
#include <string>

#include "common.h"
#include "quant.h"

namespace ggraph {
namespace {

struct TypeEntry {
  DType id;
  TypeTraits traits;
};

// Sizes follow ggml's block structs (ggml-common.h); K-quants and most IQ types use 256-element
// super-blocks. Q8_1 stores two f16 values (d and the scaled sum) ahead of 32 int8 quants.
constexpr TypeEntry kTypes[] = {
    {DType::F32, {"F32", 1, 4, true}},
    {DType::F16, {"F16", 1, 2, true}},
    {DType::Q4_0, {"Q4_0", 32, 18, true}},
    {DType::Q4_1, {"Q4_1", 32, 20, true}},
    {DType::Q5_0, {"Q5_0", 32, 22, false}},
    {DType::Q5_1, {"Q5_1", 32, 24, false}},
    {DType::Q8_0, {"Q8_0", 32, 34, true}},
    {DType::Q8_1, {"Q8_1", 32, 36, false}},
    {DType::Q2_K, {"Q2_K", 256, 84, false}},
    {DType::Q3_K, {"Q3_K", 256, 110, false}},
    {DType::Q4_K, {"Q4_K", 256, 144, false}},
    {DType::Q5_K, {"Q5_K", 256, 176, false}},
    {DType::Q6_K, {"Q6_K", 256, 210, false}},
    {DType::Q8_K, {"Q8_K", 256, 292, false}},
    {DType::IQ2_XXS, {"IQ2_XXS", 256, 66, false}},
    {DType::IQ2_XS, {"IQ2_XS", 256, 74, false}},
    {DType::IQ3_XXS, {"IQ3_XXS", 256, 98, false}},
    {DType::IQ1_S, {"IQ1_S", 256, 50, false}},
    {DType::IQ4_NL, {"IQ4_NL", 32, 18, false}},
    {DType::IQ3_S, {"IQ3_S", 256, 110, false}},
    {DType::IQ2_S, {"IQ2_S", 256, 82, false}},
    {DType::IQ4_XS, {"IQ4_XS", 256, 136, false}},
    {DType::I8, {"I8", 1, 1, false}},
    {DType::I16, {"I16", 1, 2, false}},
    {DType::I32, {"I32", 1, 4, false}},
    {DType::I64, {"I64", 1, 8, false}},
    {DType::F64, {"F64", 1, 8, false}},
    {DType::IQ1_M, {"IQ1_M", 256, 56, false}},
    {DType::BF16, {"BF16", 1, 2, true}},
    {DType::TQ1_0, {"TQ1_0", 256, 54, false}},
    {DType::TQ2_0, {"TQ2_0", 256, 66, false}},
    {DType::MXFP4, {"MXFP4", 32, 17, false}},
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
