#include "sampling.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <type_traits>

namespace ggraph {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Messages are formatted with snprintf, not iostreams: a Python process may have loaded an
// older libstdc++ than the one the extension was built with, and its stream formatting of
// floating-point values is where such a mismatch shows.
std::string format_value(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}
std::string format_value(long long v) { return std::to_string(v); }
std::string format_value(unsigned long long v) { return std::to_string(v); }

template <typename T>
[[noreturn]] void invalid(const char* name, const char* range, T value) {
  using Wide = std::conditional_t<
      std::is_floating_point<T>::value, double,
      std::conditional_t<std::is_signed<T>::value, long long, unsigned long long>>;
  throw ArgumentError(std::string("sampling: ") + name + " must be " + range + ", got " +
                      format_value(static_cast<Wide>(value)));
}

// The entropy source is read once a process (opening it costs more than a whole greedy
// draw); each seed then mixes it with the clock and a counter (splitmix64's finalizer), so that
// seeds asked for at once still differ.
uint64_t fresh_seed() {
  static const uint64_t entropy = [] {
    uint64_t e = 0;
    try {
      std::random_device device;
      e = (static_cast<uint64_t>(device()) << 32) ^ device();
    } catch (const std::exception&) {
      // No entropy source on this platform: the clock alone still differs between runs.
    }
    return e;
  }();
  static std::atomic<uint64_t> counter{0};
  uint64_t z =
      entropy ^ static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  z += 0x9E3779B97F4A7C15ull * (counter.fetch_add(1, std::memory_order_relaxed) + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  // The sentinel would mean "random" again if the caller passed seed() back to reseed().
  return z == kRandomSeed ? 0 : z;
}

constexpr int kBuckets = 1024;
constexpr size_t kSortDirectly = 256;

// Eight running maxima: independent chains, where one would wait on each comparison.
float max_of(const float* values, size_t n) {
  float m[8];
  std::fill(m, m + 8, -kInf);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) m[j] = std::max(m[j], values[i + j]);
  }
  for (; i < n; ++i) m[0] = std::max(m[0], values[i]);
  return *std::max_element(m, m + 8);
}

// The highest of n logits (NaN passed over, as -inf would be); an error when none is above -inf.
float highest_logit(const float* logits, size_t n) {
  const float m = max_of(logits, n);
  if (!(m > -kInf)) {
    throw ArgumentError("sampling: expected a logit above -inf, got " + std::to_string(n) +
                        " logits all NaN or -inf");
  }
  return m;
}

// Larger logit first, lower id first among equal logits: a strict total order, so every
// selection algorithm (and every standard library) keeps the same set in the same order.
struct ByLogitDescending {
  const float* logits;
  bool operator()(int32_t a, int32_t b) const {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  }
};

}  // namespace

void validate(const SamplingParams& p) {
  // Written as !(in range) so that NaN fails every check.
  if (!(p.temperature >= 0.0f && std::isfinite(p.temperature))) {
    invalid("temperature", "a finite number >= 0 (0 = greedy)", p.temperature);
  }
  if (p.top_k < 0) invalid("top_k", ">= 0 (0 = off)", p.top_k);
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) invalid("top_p", "in (0, 1] (1 = off)", p.top_p);
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) invalid("min_p", "in [0, 1] (0 = off)", p.min_p);
  if (!(p.repeat_penalty > 0.0f && std::isfinite(p.repeat_penalty))) {
    invalid("repeat_penalty", "a finite number > 0 (1 = off)", p.repeat_penalty);
  }
  if (!std::isfinite(p.frequency_penalty)) {
    invalid("frequency_penalty", "a finite number (0 = off)", p.frequency_penalty);
  }
  if (!std::isfinite(p.presence_penalty)) {
    invalid("presence_penalty", "a finite number (0 = off)", p.presence_penalty);
  }
  if (p.penalty_last_n < -1) {
    invalid("penalty_last_n", ">= -1 (-1 = whole history, 0 = off)", p.penalty_last_n);
  }
}

int32_t argmax(const float* values, int32_t n) {
  if (values == nullptr || n <= 0) {
    throw ArgumentError("argmax: expected at least one value, got n = " + std::to_string(n));
  }
  int32_t best = -1;
  float best_value = -kInf;
  for (int32_t i = 0; i < n; ++i) {
    const float v = values[i];
    if (v > best_value || (best < 0 && v == -kInf)) {
      best = i;
      best_value = v;
    }
  }
  if (best < 0) {
    throw ArgumentError("argmax: expected a value that is not NaN, got " + std::to_string(n) +
                        " NaN values");
  }
  return best;
}

Sampler::Sampler(const SamplingParams& params) : params_(params) {
  validate(params_);
  reseed(params_.seed);
}

void Sampler::set_params(const SamplingParams& params) {
  validate(params);
  params_ = params;
}

void Sampler::reseed(uint64_t seed) {
  seed_ = seed == kRandomSeed ? fresh_seed() : seed;
  draws_ = 0;
}

int32_t sample_once(const SamplingParams& params, const float* logits, int32_t n_vocab,
                    const int32_t* history, size_t n_history) {
  thread_local Sampler sampler{SamplingParams{}};
  sampler.set_params(params);
  sampler.reseed(params.seed);
  return sampler.sample(logits, n_vocab, history, n_history);
}

void Sampler::reserve(int32_t n_vocab) {
  const size_t n = static_cast<size_t>(n_vocab);
  if (logits_.size() >= n) return;
  logits_.resize(n);
  mass_.resize(n);
  weights_.resize(n);
  candidates_.resize(n);
  scratch_.resize(n);
  counts_.resize(n, 0);
}

bool Sampler::penalizes(size_t n_history) const {
  return n_history != 0 && sample_history_window(params_, 1) > 0;
}

void Sampler::apply_penalties(float* logits, int32_t n_vocab, const int32_t* history,
                              size_t n_history) {
  const SamplingParams& p = params_;
  if (!penalizes(n_history)) return;
  if (logits == nullptr || n_vocab <= 0) invalid("n_vocab", "> 0 with non-null logits", n_vocab);
  if (history == nullptr) invalid("history", "non-null when n_history > 0", n_history);
  const size_t window =
      p.penalty_last_n < 0 ? n_history : std::min(n_history, static_cast<size_t>(p.penalty_last_n));
  const int32_t* recent = history + (n_history - window);
  // Check every id before counting, so that an error leaves counts_ all zero.
  for (size_t i = 0; i < window; ++i) {
    if (recent[i] < 0 || recent[i] >= n_vocab) {
      throw ArgumentError("sampling: history token at position " +
                          std::to_string(n_history - window + i) + " must be in [0, " +
                          std::to_string(n_vocab) + "), got " + std::to_string(recent[i]));
    }
  }
  reserve(n_vocab);
  int32_t* counts = counts_.data();
  for (size_t i = 0; i < window; ++i) ++counts[recent[i]];
  for (size_t i = 0; i < window; ++i) {
    const int32_t id = recent[i];
    const int32_t count = counts[id];
    if (count == 0) continue;  // already penalized
    counts[id] = 0;
    float& l = logits[id];
    l = l > 0.0f ? l / p.repeat_penalty : l * p.repeat_penalty;
    l -= static_cast<float>(count) * p.frequency_penalty + p.presence_penalty;
    if (std::isnan(l)) l = -kInf;  // inf - inf, when a huge penalty meets an infinite logit
  }
}

// The k best tokens (ByLogitDescending) into candidates_, sorted, without the -inf ones.
size_t Sampler::select_top_k(int32_t n_vocab, size_t k) {
  const float* work = logits_.data();
  const ByLogitDescending order{work};
  int32_t* candidates = candidates_.data();
  const size_t n = static_cast<size_t>(n_vocab);
  if (k * 16 <= n) {
    // A heap of the best k so far, the weakest on top: one comparison for most tokens. Ids
    // arrive in increasing order, so a tie with the weakest never displaces it.
    for (size_t i = 0; i < k; ++i) candidates[i] = static_cast<int32_t>(i);
    std::make_heap(candidates, candidates + k, order);
    float weakest = work[candidates[0]];
    for (size_t i = k; i < n; ++i) {
      if (work[i] > weakest) {
        std::pop_heap(candidates, candidates + k, order);
        candidates[k - 1] = static_cast<int32_t>(i);
        std::push_heap(candidates, candidates + k, order);
        weakest = work[candidates[0]];
      }
    }
    std::sort_heap(candidates, candidates + k, order);
  } else {
    for (size_t i = 0; i < n; ++i) candidates[i] = static_cast<int32_t>(i);
    std::nth_element(candidates, candidates + k, candidates + n, order);
    std::sort(candidates, candidates + k, order);
  }
  while (k > 0 && work[candidates[k - 1]] == -kInf) --k;
  return k;
}

namespace {

// min-p's floor: p_i >= min_p * p_max <=> logit_i >= max + ln(min_p). The lowest float also
// drops -inf.
float log_min_p(float min_p) { return static_cast<float>(std::log(static_cast<double>(min_p))); }

float min_p_floor(const SamplingParams& p, float max_logit) {
  float floor = -std::numeric_limits<float>::max();
  if (p.min_p > 0.0f) floor = std::max(floor, max_logit + log_min_p(p.min_p));
  return floor;
}

uint64_t top_p_target(float top_p, uint64_t total) {
  return static_cast<uint64_t>(std::ceil(static_cast<double>(top_p) * static_cast<double>(total)));
}

int32_t float_word(float f) { return static_cast<int32_t>(sample_bits_of(f)); }

}  // namespace

void fill_sample_config(const SamplingParams& p, uint64_t seed, uint64_t draw,
                        const int32_t* history, size_t n_history, int window, int32_t* words,
                        const int32_t* stops, size_t n_stops) {
  namespace w = sample_word;
  std::fill(words, words + w::kHeader, 0);
  words[w::kTemperature] = float_word(p.temperature);
  words[w::kTopK] = p.top_k;
  words[w::kTopP] = float_word(p.top_p);
  words[w::kMinP] = float_word(p.min_p);
  words[w::kLogMinP] = float_word(p.min_p > 0.0f ? log_min_p(p.min_p) : 0.0f);
  words[w::kRepeatPenalty] = float_word(p.repeat_penalty);
  words[w::kFrequencyPenalty] = float_word(p.frequency_penalty);
  words[w::kPresencePenalty] = float_word(p.presence_penalty);
  words[w::kPenaltyLastN] = p.penalty_last_n;
  words[w::kSeedLo] = static_cast<int32_t>(static_cast<uint32_t>(seed));
  words[w::kSeedHi] = static_cast<int32_t>(static_cast<uint32_t>(seed >> 32));
  words[w::kDrawLo] = static_cast<int32_t>(static_cast<uint32_t>(draw));
  words[w::kDrawHi] = static_cast<int32_t>(static_cast<uint32_t>(draw >> 32));
  const size_t n = std::min(n_history, static_cast<size_t>(std::max(window, 0)));
  const size_t n_stop = std::min(n_stops, static_cast<size_t>(w::kMaxStop));
  words[w::kNStop] = static_cast<int32_t>(n_stop);
  if (n_stop > 0) std::copy(stops, stops + n_stop, words + w::kStop);
  words[w::kNHistory] = static_cast<int32_t>(n);
  if (n > 0) std::copy(history + (n_history - n), history + n_history, words + w::kHeader);
}

float token_logprob(const float* logits, int32_t n, int32_t id) {
  float max = -kInf;
  for (int32_t i = 0; i < n; ++i) max = std::max(max, std::isnan(logits[i]) ? -kInf : logits[i]);
  if (!(max > -kInf) || max == kInf) return logits[id] == max ? 0.0f : -kInf;
  double sum = 0.0;
  for (int32_t i = 0; i < n; ++i)
    if (!std::isnan(logits[i])) sum += std::exp(double(logits[i]) - max);
  return static_cast<float>(double(logits[id]) - (double(max) + std::log(sum)));
}

void run_sample_op(const float* logits, int32_t n_vocab, const int32_t* config, int32_t* tokens,
                   int step, int k, Sampler& sampler) {
  namespace w = sample_word;
  auto f = [&](int word) { return sample_float_of(static_cast<uint32_t>(config[word])); };
  auto u64 = [&](int lo, int hi) {
    return uint64_t(uint32_t(config[lo])) | (uint64_t(uint32_t(config[hi])) << 32);
  };
  SamplingParams p;
  p.temperature = f(w::kTemperature);
  p.top_k = config[w::kTopK];
  p.top_p = f(w::kTopP);
  p.min_p = f(w::kMinP);
  p.repeat_penalty = f(w::kRepeatPenalty);
  p.frequency_penalty = f(w::kFrequencyPenalty);
  p.presence_penalty = f(w::kPresencePenalty);
  p.penalty_last_n = config[w::kPenaltyLastN];
  p.seed = u64(w::kSeedLo, w::kSeedHi);
  sampler.set_params(p);
  if (sampler.seed() != p.seed) sampler.reseed(p.seed);
  sampler.set_draws(u64(w::kDrawLo, w::kDrawHi) + uint64_t(step));
  const int n_history = config[w::kNHistory];
  std::vector<int32_t> history(config + w::kHeader, config + w::kHeader + n_history);
  history.insert(history.end(), tokens, tokens + step);
  int32_t token = -1;
  try {
    token = sampler.sample(logits, n_vocab, history.data(), history.size());
  } catch (const ArgumentError&) {
    token = -1;  // no logit above -inf: the caller reports it
  }
  tokens[step] = token;
  const float lp = token >= 0 ? token_logprob(logits, n_vocab, token) : NAN;
  tokens[k + step] = static_cast<int32_t>(sample_bits_of(lp));
}

int sample_history_window(const SamplingParams& p, int n_ctx) {
  if (p.penalty_last_n == 0 ||
      (p.repeat_penalty == 1.0f && p.frequency_penalty == 0.0f && p.presence_penalty == 0.0f))
    return 0;
  return p.penalty_last_n < 0 ? n_ctx : std::min(p.penalty_last_n, n_ctx);
}

// Top-p over candidates_[0, n), in id order, whose masses are in mass_ by id: keeps those that
// precede, in the sampling order, the first token at which the running mass from the top of the
// order reaches target (that token included), still in id order. The candidates must include
// every token of the order up to that one, and target must be reached among them (else all are
// kept). Rather than sorting, it narrows down to the token where the sum crosses: a histogram of
// mass by logit finds the bucket it crosses in, then that bucket alone is examined, the same
// way, until few tokens are left to sort. Masses are integers, so the sums are exact in any
// order.
size_t Sampler::cut_top_p(size_t n, uint64_t target) {
  const float* work = logits_.data();
  const uint64_t* mass = mass_.data();
  const ByLogitDescending order{work};
  int32_t* candidates = candidates_.data();
  int32_t* subset = scratch_.data();
  uint64_t bucket_mass[kBuckets];
  std::copy(candidates, candidates + n, subset);
  size_t m = n;
  uint64_t cumulative = 0;  // mass of the tokens ahead of the subset
  int32_t last = -1;        // the last token kept
  while (last < 0) {
    float lo = kInf;
    float hi = -kInf;
    for (size_t j = 0; j < m; ++j) {
      lo = std::min(lo, work[subset[j]]);
      hi = std::max(hi, work[subset[j]]);
    }
    if (m <= kSortDirectly || lo == hi) {
      // Equal logits are already in order: the subset keeps id order.
      if (lo != hi) std::sort(subset, subset + m, order);
      last = subset[m - 1];  // the target lies past the subset: keep all of it
      for (size_t j = 0; j < m; ++j) {
        cumulative += mass[subset[j]];
        if (cumulative >= target) {
          last = subset[j];
          break;
        }
      }
      break;
    }
    // Bucket 0 holds the largest logits. Double, as hi - lo may overflow a float; the mapping
    // is monotonic, and lo and hi land in different buckets, so every round narrows the subset.
    const double scale = kBuckets / (static_cast<double>(hi) - static_cast<double>(lo));
    auto bucket_of = [&](int32_t id) {
      const double b = (static_cast<double>(hi) - static_cast<double>(work[id])) * scale;
      return std::min(static_cast<int>(b), kBuckets - 1);
    };
    std::fill(bucket_mass, bucket_mass + kBuckets, uint64_t(0));
    for (size_t j = 0; j < m; ++j) bucket_mass[bucket_of(subset[j])] += mass[subset[j]];
    int crossing = 0;
    while (crossing < kBuckets && cumulative + bucket_mass[crossing] < target) {
      cumulative += bucket_mass[crossing++];
    }
    if (crossing == kBuckets) return n;  // the target lies past every candidate: keep all
    // Branch-free compaction: which tokens stay is as good as random in id order.
    size_t kept = 0;
    for (size_t j = 0; j < m; ++j) {
      subset[kept] = subset[j];
      kept += bucket_of(subset[j]) == crossing;
    }
    m = kept;
  }
  // Keep what comes no later than `last` in the order.
  const float cut = work[last];
  size_t kept = 0;
  for (size_t j = 0; j < n; ++j) {
    const int32_t id = candidates[j];
    candidates[kept] = id;
    kept += (work[id] > cut) | ((work[id] == cut) & (id <= last));
  }
  return kept;
}

namespace {

// w[j] = exp_nonpositive((x[j] - max_logit) / temperature): one vectorized loop, sixteen or
// eight lanes where the CPU has AVX-512 or AVX2 (the clone chosen at load; the same IEEE
// operations lane by lane, so the same bits as the baseline's four). At 49,152 logits on an
// AVX-512 VM the whole draw took 130 us with four lanes, 90 with eight, 70 with sixteen.
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void exp_weights(const float* x, float* w, size_t n, float max_logit, float temperature) {
  for (size_t j = 0; j < n; ++j) w[j] = exp_nonpositive((x[j] - max_logit) / temperature);
}

}  // namespace

// out[j] = sample_mass(exp_nonpositive((work[id_j] - max_logit) / temperature)) for j < n (ids
// null: id_j = j), and their sum. The weights go first, in a loop of their own that the compiler
// vectorizes (the same operations, lane by lane: the same bits); the integer masses and their
// sum after. A whole vocabulary's draw took 566 us at 49,152 tokens one element at a time.
uint64_t Sampler::fill_masses(const int32_t* ids, size_t n, float max_logit, float temperature,
                              uint64_t* out) {
  const float* work = logits_.data();
  float* w = weights_.data();
  const float* x = work;
  if (ids) {
    for (size_t j = 0; j < n; ++j) w[j] = work[ids[j]];
    x = w;
  }
  exp_weights(x, w, n, max_logit, temperature);
  uint64_t total = 0;
  for (size_t j = 0; j < n; ++j) {
    out[j] = sample_mass(w[j]);
    total += out[j];
  }
  return total;
}

// The draw over ids[0, n) (ascending; null: every token 0..n-1), as sampling.h describes it.
int32_t Sampler::draw(const int32_t* ids, size_t n, float max_logit) {
  uint64_t* d = mass_.data();  // by position among the kept tokens
  const uint64_t total = fill_masses(ids, n, max_logit, params_.temperature, d);
  const double u = philox_uniform(seed_, draws_++);
  const uint64_t r = std::min(total - 1, static_cast<uint64_t>(u * static_cast<double>(total)));
  uint64_t cumulative = 0;
  size_t j = 0;
  for (; j + 1 < n; ++j) {
    cumulative += d[j];
    if (cumulative > r) break;
  }
  return ids ? ids[j] : static_cast<int32_t>(j);
}

int32_t Sampler::sample(const float* logits, int32_t n_vocab, const int32_t* history,
                        size_t n_history) {
  if (logits == nullptr || n_vocab <= 0) invalid("n_vocab", "> 0 with non-null logits", n_vocab);
  if (n_vocab > kMaxSampleVocab)
    invalid("n_vocab", "at most 2^23", static_cast<long long>(n_vocab));
  const size_t n_all = static_cast<size_t>(n_vocab);
  if (sample_is_greedy(params_.temperature, params_.top_k) && !penalizes(n_history)) {
    // The first highest logit, read in place.
    const float max_logit = highest_logit(logits, n_all);
    return static_cast<int32_t>(std::find(logits, logits + n_all, max_logit) - logits);
  }
  reserve(n_vocab);
  float* work = logits_.data();
  for (size_t i = 0; i < n_all; ++i) work[i] = std::isnan(logits[i]) ? -kInf : logits[i];
  apply_penalties(work, n_vocab, history, n_history);
  float max_logit = highest_logit(work, n_all);
  const SamplingParams& p = params_;
  if (sample_is_greedy(p.temperature, p.top_k)) {
    return static_cast<int32_t>(std::find(work, work + n_all, max_logit) - work);
  }
  if (max_logit == kInf) {
    // The limit of the softmax: the +inf tokens share all the probability equally.
    for (size_t i = 0; i < n_all; ++i) work[i] = work[i] == kInf ? 0.0f : -kInf;
    max_logit = 0.0f;
  }
  const float floor = min_p_floor(p, max_logit);
  int32_t* candidates = candidates_.data();
  uint64_t* mass = mass_.data();
  auto mass_of = [&](int32_t id) { return sample_mass(exp_nonpositive(work[id] - max_logit)); };
  if (p.top_k > 0 && static_cast<size_t>(p.top_k) < n_all) {
    // Sorted by the order, so min-p and top-p each keep a prefix; top-p's mass counts every
    // token top-k kept.
    const size_t n = select_top_k(n_vocab, static_cast<size_t>(p.top_k));
    size_t keep = 0;
    while (keep < n && work[candidates[keep]] >= floor) ++keep;
    if (p.top_p < 1.0f) {
      uint64_t total = 0;
      for (size_t j = 0; j < n; ++j) total += mass_of(candidates[j]);
      const uint64_t target = top_p_target(p.top_p, total);
      uint64_t cumulative = 0;
      for (size_t j = 0; j < keep; ++j) {
        cumulative += mass_of(candidates[j]);
        if (cumulative >= target) {
          keep = j + 1;
          break;
        }
      }
    }
    std::sort(candidates, candidates + keep);
    return draw(candidates, keep, max_logit);
  }
  if (p.top_p < 1.0f) {
    // (x / 1 is x: the masses of mass_of.)
    const uint64_t total = fill_masses(nullptr, n_all, max_logit, 1.0f, mass);
    const uint64_t target = top_p_target(p.top_p, total);
    // Masses grow with the logit, so every token of at least `light` precedes every lighter
    // one; the lighter ones weigh less than total - target all together, so the heavier ones
    // reach the target first: top-p drops every light one.
    const uint64_t light = (total - target) / n_all;
    size_t n = 0;
    for (size_t i = 0; i < n_all; ++i) {
      candidates[n] = static_cast<int32_t>(i);
      n += (work[i] >= floor) & (mass[i] >= light);
    }
    // min-p keeps a prefix of the order too, so top-p within it, with the mass of all tokens
    // as the target, keeps the intersection that the chain asks for.
    n = cut_top_p(n, target);
    return draw(candidates, n, max_logit);
  }
  if (p.min_p > 0.0f) {
    size_t n = 0;
    for (size_t i = 0; i < n_all; ++i) {
      candidates[n] = static_cast<int32_t>(i);
      n += work[i] >= floor;
    }
    return draw(candidates, n, max_logit);
  }
  // Nothing to filter: every token is a candidate, the -inf ones with mass 0.
  return draw(nullptr, n_all, max_logit);
}

}  // namespace ggraph
