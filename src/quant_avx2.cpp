// The x86 kernels built for AVX2 + FMA + F16C. This file alone is compiled with those
// instruction sets; quant.cpp calls into it only after checking the running CPU.
#include "quant_impl.h"

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

#include "quant_x86.h"

namespace ggraph {
namespace quant_impl {
namespace {

// 16 vector registers: 2x4 tiles of accumulators leave room for the unpacked weights.
const Kernels kAvx2 = {
    "avx2 fma f16c",
    Tiler<FloatTile<LoadF32>, 4, 3, 4>::run,
    Tiler<FloatTile<LoadF16>, 4, 3, 4>::run,
    Tiler<FloatTile<LoadBF16>, 4, 3, 4>::run,
    Tiler<QuantTile<DotAvx2, Fmt::kQ8_0>, 2, 4, 2>::run,
    Tiler<QuantTile<DotAvx2, Fmt::kQ4_0>, 2, 4, 2>::run,
    Tiler<QuantTile<DotAvx2, Fmt::kQ4_1>, 2, 4, 2>::run,
    prepare_q8_x86,
    prepare_f32_x86,
};

}  // namespace

const Kernels* avx2_kernels() { return &kAvx2; }

}  // namespace quant_impl
}  // namespace ggraph

#else

namespace ggraph {
namespace quant_impl {
const Kernels* avx2_kernels() { return nullptr; }
}  // namespace quant_impl
}  // namespace ggraph

#endif
