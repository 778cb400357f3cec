// The x86 kernels built for AVX512 F/BW/VL + VNNI on top of AVX2 + FMA + F16C: the same
// arithmetic as quant_avx2.cpp with vpdpbusd for the 8-bit dots and 32 vector registers for
// larger register tiles. quant.cpp calls into it only after checking the running CPU.
#include "quant_impl.h"

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512VNNI__) && defined(__FMA__) && defined(__F16C__)

#include "quant_x86.h"

namespace ggraph {
namespace quant_impl {
namespace {

const Kernels kAvx512 = {
    "avx2 fma f16c avx512vl avx512vnni",
    Tiler<FloatTile<LoadF32>, 4, 4, 4>::run,
    Tiler<FloatTile<LoadF16>, 4, 4, 4>::run,
    Tiler<FloatTile<LoadBF16>, 4, 4, 4>::run,
    Tiler<QuantTile<DotVnni, Fmt::kQ8_0>, 4, 4, 2>::run,
    Tiler<QuantTile<DotVnni, Fmt::kQ4_0>, 4, 4, 2>::run,
    Tiler<QuantTile<DotVnni, Fmt::kQ4_1>, 4, 4, 2>::run,
    prepare_q8_x86,
    prepare_f32_x86,
};

}  // namespace

const Kernels* avx512_kernels() { return &kAvx512; }

}  // namespace quant_impl
}  // namespace ggraph

#else

namespace ggraph {
namespace quant_impl {
const Kernels* avx512_kernels() { return nullptr; }
}  // namespace quant_impl
}  // namespace ggraph

#endif
