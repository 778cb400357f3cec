// The arithmetic of sampling that the CPU sampler (sampling.cpp) and the CUDA sample kernel
// (cuda/sample.cu) share, written once so that both pick the same token from the same logits:
// the random stream (Philox4x32-10), the fixed exponential, the order of tokens and the integer
// probability masses. Every float operation here is a single IEEE operation that neither side
// fuses (the host file is built with -ffp-contract=off; the device uses the _rn intrinsics).
#pragma once

#include <cstdint>
#include <cstring>

#include "quant.h"  // GGRAPH_HD

namespace ggraph {

// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011):
// counter-based, so the n-th number of a stream needs no state but (seed, n).
struct Philox4 {
  uint32_t v[4];
};

GGRAPH_HD Philox4 philox4x32_10(Philox4 ctr, uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const uint64_t p0 = uint64_t(0xD2511F53u) * ctr.v[0];
    const uint64_t p1 = uint64_t(0xCD9E8D57u) * ctr.v[2];
    ctr = {{uint32_t(p1 >> 32) ^ ctr.v[1] ^ k0, uint32_t(p1), uint32_t(p0 >> 32) ^ ctr.v[3] ^ k1,
            uint32_t(p0)}};
  }
  return ctr;
}

// The draw-th uniform number in [0, 1) of seed's stream: Philox of the counter (draw, 0) under
// the key seed, its first two words as the low and high halves of 64 bits, whose top 53 bits
// times 2^-53 give the number.
GGRAPH_HD double philox_uniform(uint64_t seed, uint64_t draw) {
  const Philox4 r = philox4x32_10({{uint32_t(draw), uint32_t(draw >> 32), 0u, 0u}}, uint32_t(seed),
                                  uint32_t(seed >> 32));
  const uint64_t bits = (uint64_t(r.v[1]) << 32) | r.v[0];
  return double(bits >> 11) * (1.0 / 9007199254740992.0);
}

GGRAPH_HD uint32_t sample_bits_of(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
#endif
}

GGRAPH_HD float sample_float_of(uint32_t b) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(b);
#else
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
#endif
}

// Unfused single operations: the device's round-to-nearest intrinsics, plain operators on the
// host.
GGRAPH_HD float sample_mul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
GGRAPH_HD float sample_add(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
GGRAPH_HD float sample_div(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// e^x for x <= 0 (0 below -87, where it would leave the normal floats; NaN gives 0). A fixed
// polynomial rather than a library's exp, so that every platform computes the same bits.
// Relative error about 1e-7.
GGRAPH_HD float exp_nonpositive(float x) {
  constexpr uint32_t kFloorBits = 0xC2AE0000u;  // -87.0f; larger bits are more negative
  const uint32_t x_bits = sample_bits_of(x);
  const uint32_t in_range = x_bits < kFloorBits ? 0xFFFFFFFFu : 0u;
  const float xc = sample_float_of((x_bits & in_range) | (kFloorBits & ~in_range));
  // k = round(xc / ln 2); truncation of a negative value minus one half rounds to nearest.
  const int32_t k = static_cast<int32_t>(sample_add(sample_mul(xc, 1.44269504f), -0.5f));
  const float kf = static_cast<float>(k);
  // r = xc - k ln 2, with ln 2 split so that k * hi is exact.
  const float r =
      sample_add(sample_add(xc, -sample_mul(kf, 0.693359375f)), sample_mul(kf, 2.12194440e-4f));
  // Taylor series to degree 7: |r| <= 0.35, so the remainder is below 1e-8.
  float p = 1.98412698e-4f;
  p = sample_add(sample_mul(p, r), 1.38888889e-3f);
  p = sample_add(sample_mul(p, r), 8.33333333e-3f);
  p = sample_add(sample_mul(p, r), 4.16666667e-2f);
  p = sample_add(sample_mul(p, r), 1.66666667e-1f);
  p = sample_add(sample_mul(p, r), 0.5f);
  p = sample_add(sample_mul(p, r), 1.0f);
  p = sample_add(sample_mul(p, r), 1.0f);
  const float y = sample_mul(p, sample_float_of(static_cast<uint32_t>(k + 127) << 23));  // 2^k
  return sample_float_of(sample_bits_of(y) & in_range);
}

// Whether a sample is greedy (the argmax, no draw): temperature 0 or top_k 1.
GGRAPH_HD bool sample_is_greedy(float temperature, int32_t top_k) {
  return temperature == 0.0f || top_k == 1;
}

// A token's probability mass: its weight (an exp_nonpositive value, at most 1) in units of
// 2^-40, rounded down. Masses add exactly in any order, so a sum over the vocabulary is the same
// however it is split over threads. A vocabulary of up to 2^23 tokens sums below 2^63.
constexpr int kMassBits = 40;
constexpr int kMaxSampleVocab = 1 << 23;
GGRAPH_HD uint64_t sample_mass(float weight) {
  // Exact, then truncated; through int64, which x86-64 converts in one instruction (the same
  // value: the product lies in [0, 2^40]).
  return static_cast<uint64_t>(static_cast<int64_t>(sample_mul(weight, 1099511627776.0f)));
}

// The sampling order, as an unsigned key: a larger logit has a larger key (ties go to the lower
// token id). -0 and +0 share a key, as they compare equal. NaN has been replaced by -inf before.
GGRAPH_HD uint32_t sample_key(float logit) {
  const uint32_t b = logit == 0.0f ? 0u : sample_bits_of(logit);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The words of a Sample op's configuration (an I32 input the host fills before each step; see
// Graph::sample). Floats are stored as their bits.
namespace sample_word {
constexpr int kTemperature = 0;
constexpr int kTopK = 1;
constexpr int kTopP = 2;
constexpr int kMinP = 3;
constexpr int kLogMinP = 4;  // (float)log((double)min_p), computed once by the host
constexpr int kRepeatPenalty = 5;
constexpr int kFrequencyPenalty = 6;
constexpr int kPresencePenalty = 7;
constexpr int kPenaltyLastN = 8;
constexpr int kSeedLo = 9, kSeedHi = 10;
constexpr int kDrawLo = 11, kDrawHi = 12;  // the draw index the graph's first Sample uses
constexpr int kNHistory = 13;              // history ids after the header, the most recent last
// Stop ids (the end-of-generation tokens a generation ends at): after a step of a chain samples
// one, the chain's later steps may be skipped, their token entries then kSkipped.
constexpr int kNStop = 14;
// The steps a launch may still run, from its (or its loop round's) first step: where conditional
// graph nodes skip steps, the step before the limit ends the chain as a stop id does (the
// entries past it read kSkipped). 0: none (the host sized the chain to its tokens).
constexpr int kLimit = 15;
constexpr int kStop = 16;  // kMaxStop words
constexpr int kMaxStop = 8;
constexpr int kHeader = 24;  // the history's first word
static_assert(kNStop < kLimit && kLimit < kStop && kStop + kMaxStop <= kHeader,
              "the header's words overlap");
// A chain's token entry for a step that did not run, an earlier step having sampled a stop id
// or reached the limit (-1 is a step that found nothing to sample).
constexpr int32_t kSkipped = -2;
}  // namespace sample_word

}  // namespace ggraph
