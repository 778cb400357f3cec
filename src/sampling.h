// Token samplers: repetition penalties, top-k, top-p, min-p and temperature over one row of logits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common.h"
#include "sampling_math.h"

namespace ggraph {

// The seed value that asks for a fresh random seed.
constexpr uint64_t kRandomSeed = 0xFFFFFFFFFFFFFFFFull;

// Settings of the sampling chain. The chain runs in llama.cpp's default order:
//   1. penalties, over the last penalty_last_n tokens of the history: each token seen there
//      `count` times gets logit > 0 ? logit / repeat_penalty : logit * repeat_penalty, then
//      logit -= count * frequency_penalty + presence_penalty (NaN results become -inf)
//   2. top-k: keep the first k tokens in descending order
//   3. top-p: keep the shortest prefix of that order whose probability mass (softmax over what
//      top-k kept, at temperature 1) reaches top_p of the mass top-k kept
//   4. min-p: keep the tokens whose probability is at least min_p times the largest one
//   5. temperature: divide the kept logits by it and draw from their softmax
// Descending order: larger logit first, lower token id first among equal logits. top-p and
// min-p measure probabilities before temperature, as llama.cpp does. Temperature 0 or top_k 1
// is greedy: the argmax of the penalized logits, which no filter removes.
//
// Exactly, so that the CPU and the CUDA sample kernel (cuda/sample.cu) pick the same token from
// the same logits (the arithmetic is sampling_math.h's):
//   - work = the logits with NaN as -inf, penalized. max = the largest; none above -inf is an
//     error. Greedy: the lowest id whose work equals max.
//   - If max is +inf: work = 0 for the +inf tokens and -inf for the others, max = 0.
//   - The order: sample_key(work) descending, then id ascending.
//   - top-k (0 < top_k < n_vocab): the first top_k tokens of the order, less those at -inf.
//     Otherwise every token.
//   - top-p (top_p < 1): mass_i = sample_mass(exp_nonpositive(work_i - max)); T = the sum over
//     the top-k set; target = ceil(double(top_p) * double(T)). The top-p set is the order's
//     prefix of the top-k set through the first token at which the running mass reaches target.
//   - min-p (min_p > 0): the tokens with work >= max(-FLT_MAX, max + (float)log(double(min_p))).
//     (The lowest float also drops -inf tokens.)
//   - The draw, over the tokens in all three sets, in ascending id order: d_i =
//     sample_mass(exp_nonpositive((work_i - max) / temperature)), D = sum d_i, u = the sampler's
//     next philox_uniform(seed, draw), r = min(D - 1, uint64(u * double(D))); the token is the
//     first whose running sum of d exceeds r. Each draw advances the draw counter by one; greedy
//     samples draw nothing.
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

// The configuration words of a Sample op (sampling_math.h's sample_word): the parameters, seed
// and first draw index, the first sample_word::kMaxStop of the n_stops stop ids (the backend may
// skip a chain's steps after one), then the last `window` ids of the history (fewer when it is
// shorter), into words[0, sample_word::kHeader + window).
void fill_sample_config(const SamplingParams& params, uint64_t seed, uint64_t draw,
                        const int32_t* history, size_t n_history, int window, int32_t* words,
                        const int32_t* stops = nullptr, size_t n_stops = 0);
// The history a Sample op needs of a chain: the penalty window (all of it for -1), or 0 when
// the parameters apply no penalty.
int sample_history_window(const SamplingParams& params, int n_ctx);

// log-softmax of n logits at id, NaN counting as -inf (in double).
float token_logprob(const float* logits, int32_t n, int32_t id);

// Index of the largest value, the lowest index among ties; NaN counts as -inf.
// Throws ArgumentError if n <= 0 or every value is NaN.
int32_t argmax(const float* values, int32_t n);

// Runs the chain of SamplingParams over one row of logits (above). Reproducible: for the same
// logits, history, parameters, seed and draw counter it returns the same token on every
// platform and on both backends. Buffers grow to the largest n_vocab seen and are reused:
// sample() does not allocate after the first call. Not thread-safe.
class Sampler;

// A Sample op (graph.h) on the host, with `sampler`'s buffers: config holds its parameters,
// seed, first draw and history (sampling_math.h's sample_word); entry `step` of tokens (2k
// words) gets the token (-1 when no logit is above -inf) and entry k + step the bits of its
// log-probability. The penalty history is config's ids, then tokens[0, step).
void run_sample_op(const float* logits, int32_t n_vocab, const int32_t* config, int32_t* tokens,
                   int step, int k, Sampler& sampler);

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);  // validates params
  // New parameters (validated), keeping the buffers; the seed and draw counter stay.
  void set_params(const SamplingParams& params);

  // Picks one token from n_vocab logits; history holds the previous tokens (for penalties) and
  // may be null when n_history is 0. History ids inside the penalty window must be in range.
  int32_t sample(const float* logits, int32_t n_vocab, const int32_t* history, size_t n_history);

  // Restarts the random stream (the draw counter at 0); kRandomSeed draws a fresh seed.
  void reseed(uint64_t seed);
  // The stream's position: the draws made since the seed was set.
  uint64_t draws() const { return draws_; }
  void set_draws(uint64_t n) { draws_ = n; }
  // The seed of the current stream (the drawn one when a random seed was asked for).
  uint64_t seed() const { return seed_; }
  const SamplingParams& params() const { return params_; }

  // Step 1 of the chain alone, in place (for tests and for callers that sample elsewhere).
  void apply_penalties(float* logits, int32_t n_vocab, const int32_t* history, size_t n_history);

 private:
  // Whether a history of n_history tokens changes any logit under these parameters.
  bool penalizes(size_t n_history) const;
  void reserve(int32_t n_vocab);
  size_t select_top_k(int32_t n_vocab, size_t k);
  size_t cut_top_p(size_t n, uint64_t target);
  uint64_t fill_masses(const int32_t* ids, size_t n, float max_logit, float temperature,
                       uint64_t* out);
  int32_t draw(const int32_t* ids, size_t n, float max_logit);

  SamplingParams params_;
  uint64_t seed_ = 0;
  uint64_t draws_ = 0;
  std::vector<float> logits_;        // the penalized working copy
  std::vector<uint64_t> mass_;       // top-p's masses by token id
  std::vector<float> weights_;       // fill_masses' exp_nonpositive values
  std::vector<int32_t> candidates_;  // token ids still in the running
  std::vector<int32_t> scratch_;     // top-p's narrowing subsets
  std::vector<int32_t> counts_;      // by token id; all zero between calls
};

// One draw as a new Sampler(params) would make it (a stream of params.seed from its start), on
// a sampler kept for the calling thread, so that a loop that samples a token at a time this way
// allocates its work buffers once, not every call.
int32_t sample_once(const SamplingParams& params, const float* logits, int32_t n_vocab,
                    const int32_t* history, size_t n_history);

}  // namespace ggraph
