// Token samplers: repetition penalties, top-k, top-p, min-p and temperature over one row of logits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common.h"

namespace ggraph {

// The seed value that asks for a fresh random seed.
constexpr uint64_t kRandomSeed = 0xFFFFFFFFFFFFFFFFull;

// Settings of the sampling chain. The chain runs in llama.cpp's default order:
//   1. penalties, over the last penalty_last_n tokens of the history: each token seen there
//      `count` times gets logit > 0 ? logit / repeat_penalty : logit * repeat_penalty, then
//      logit -= count * frequency_penalty + presence_penalty
//   2. top-k: keep the first k tokens in descending order
//   3. top-p: keep the shortest prefix of that order whose probabilities (softmax over what
//      top-k kept, at temperature 1) sum to at least top_p
//   4. min-p: keep the tokens whose probability is at least min_p times the largest one
//   5. temperature: divide the kept logits by it and draw from their softmax
// Descending order: larger logit first, lower token id first among equal logits. top-p and
// min-p measure probabilities before temperature, as llama.cpp does. Temperature 0 or top_k 1
// is greedy: the argmax of the penalized logits, which no filter removes.
struct SamplingParams {
  float temperature = 0.8f;        // >= 0; 0 = greedy
  int32_t top_k = 40;              // >= 0; 0 = off
  float top_p = 0.95f;             // in (0, 1]; 1 = off
  float min_p = 0.05f;             // in [0, 1]; 0 = off
  float repeat_penalty = 1.0f;     // > 0; 1 = off
  float frequency_penalty = 0.0f;  // any finite value; 0 = off
  float presence_penalty = 0.0f;   // any finite value; 0 = off
  int32_t penalty_last_n = 64;     // >= -1; 0 = off, -1 = the whole history
  uint64_t seed = kRandomSeed;     // kRandomSeed = random; anything else reproducible
};

// Throws ArgumentError naming the first invalid parameter, its valid range and the value given.
void validate(const SamplingParams& params);

// Index of the largest value, the lowest index among ties; NaN counts as -inf.
// Throws ArgumentError if n <= 0 or every value is NaN.
int32_t argmax(const float* values, int32_t n);

// xoshiro256** with its state filled by four successive outputs of splitmix64(seed): integer
// arithmetic only, so a seed gives the same stream on every platform and compiler.
class Rng {
 public:
  explicit Rng(uint64_t seed);
  static Rng from_state(const uint64_t state[4]);  // the raw generator, for known-answer tests

  uint64_t next();
  double uniform();  // in [0, 1): the top 53 bits of next() times 2^-53

 private:
  Rng() = default;
  uint64_t s_[4] = {0, 0, 0, 0};
};

// Runs the chain of SamplingParams over one row of logits. Reproducible: for the same logits,
// history, parameters and seed it returns the same tokens on every platform, because
//   - greedy calls consume no random number; every other call consumes exactly one, u = uniform();
//   - the weights are exp((logit - max) / temperature) from a fixed polynomial (not the C
//     library's exp), and the token is the first kept token, in ascending id order, whose
//     running sum of weights exceeds u times their total.
// (A compiler that fuses the polynomial's multiply-adds, as -march=native may, can move a weight
// by one float ulp: then only a u within about 1e-7 of a boundary could pick the neighbour.)
// NaN logits count as -inf; +inf logits take all the probability, shared equally. A row with
// no logit above -inf is an ArgumentError. Buffers grow to the largest n_vocab seen and are
// reused: sample() does not allocate after the first call. Not thread-safe.
class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);  // validates params

  // Picks one token from n_vocab logits; history holds the previous tokens (for penalties) and
  // may be null when n_history is 0. History ids inside the penalty window must be in range.
  int32_t sample(const float* logits, int32_t n_vocab, const int32_t* history, size_t n_history);

  // Restarts the random stream; kRandomSeed draws a fresh seed.
  void reseed(uint64_t seed);
  // The seed of the current stream (the drawn one when a random seed was asked for).
  uint64_t seed() const { return seed_; }
  const SamplingParams& params() const { return params_; }

  // Step 1 of the chain alone, in place (for tests and for callers that sample elsewhere).
  void apply_penalties(float* logits, int32_t n_vocab, const int32_t* history, size_t n_history);

 private:
  void reserve(int32_t n_vocab);
  float min_p_floor(float max_logit) const;
  size_t select_top_k(int32_t n_vocab, size_t k);
  size_t keep_top_k(int32_t n_vocab, float max_logit);
  size_t cut_top_p(size_t n, double target);
  size_t keep_top_p_min_p(int32_t n_vocab, float max_logit);
  int32_t draw(const int32_t* ids, size_t n, float max_logit);

  SamplingParams params_;
  uint64_t seed_ = 0;
  Rng rng_;
  std::vector<float> logits_;        // the penalized working copy
  std::vector<float> weights_;       // exp(logit - max) by token id, for top-p
  std::vector<float> draw_weights_;  // by position among the kept candidates
  std::vector<int32_t> candidates_;  // token ids still in the running
  std::vector<int32_t> scratch_;     // top-p's narrowing subsets
  std::vector<double> bucket_mass_;  // top-p's histogram of probability by logit
  std::vector<double> block_sums_;   // the draw's sums of consecutive weights
  std::vector<int32_t> counts_;      // by token id; all zero between calls
};

}  // namespace ggraph
