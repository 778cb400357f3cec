// The x86 kernels built for AVX512 F/BW/VL + VNNI on top of AVX2 + FMA + F16C: the same
// arithmetic as quant_avx2.cpp with vpdpbusd for the 8-bit dots of the 32-element block formats
// (the K-quants scale each 4-product sum by its sub-block scale, which maddubs + madd do in as
// many instructions) and 32 vector registers for larger register tiles. quant.cpp calls into it
// only after checking the running CPU.
#include "quant_impl.h"

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512VNNI__) && defined(__FMA__) && defined(__F16C__)

#include "quant_x86.h"

namespace ggraph {
namespace quant_impl {
namespace {

Kernels make_kernels() {
  Kernels k{};
  k.features = "avx2 fma f16c avx512vl avx512vnni";
  k.tile[slot(DType::F32)] = Tiler<FloatTile<LoadF32>, 4, 4, 4>::run;
  k.tile[slot(DType::F16)] = Tiler<FloatTile<LoadF16>, 4, 4, 4>::run;
  k.tile[slot(DType::BF16)] = Tiler<FloatTile<LoadBF16>, 4, 4, 4>::run;
  set_block_tiles<DotVnni, 4>(k);
  k.tile[slot(DType::Q2_K)] = Tiler<KQuantTile<DType::Q2_K>, 4, 4, 2>::run;
  k.tile[slot(DType::Q3_K)] = Tiler<KQuantTile<DType::Q3_K>, 4, 4, 2>::run;
  k.tile[slot(DType::Q4_K)] = Tiler<KQuantTile<DType::Q4_K>, 4, 4, 2>::run;
  k.tile[slot(DType::Q5_K)] = Tiler<KQuantTile<DType::Q5_K>, 4, 4, 2>::run;
  k.tile[slot(DType::Q6_K)] = Tiler<KQuantTile<DType::Q6_K>, 4, 4, 2>::run;
  k.tile[slot(DType::IQ4_XS)] = Tiler<KQuantTile<DType::IQ4_XS>, 4, 4, 2>::run;
  k.prepare[slot(ActLayout::kFloat)] = prepare_f32_x86;
  k.prepare[slot(ActLayout::kQ8K)] = prepare_q8k_x86;
  k.prepare[slot(ActLayout::kQ8)] = prepare_q8_x86;
  k.to_float[slot(DType::F16)] = to_float_f16_x86;
  k.f16_from_float = f16_from_float_x86;
  k.to_float[slot(DType::Q8_0)] = to_float_q8_0_x86;
  k.attn_rows = attn_rows_x86;
  k.attn_rows_f16 = attn_rows_f16_x86;
  k.glu_mul = glu_mul_x86;
  return k;
}

}  // namespace

const Kernels* avx512_table() {
  static const Kernels kernels = make_kernels();
  return &kernels;
}

}  // namespace quant_impl
}  // namespace ggraph

#else

namespace ggraph {
namespace quant_impl {
const Kernels* avx512_table() { return nullptr; }
}  // namespace quant_impl
}  // namespace ggraph

#endif
