#include "sampling.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
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

uint64_t splitmix64(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t fresh_seed() {
  uint64_t seed =
      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  try {
    std::random_device device;
    seed ^= (static_cast<uint64_t>(device()) << 32) ^ device();
  } catch (const std::exception&) {
    // No entropy source on this platform: the clock alone still differs between runs.
  }
  // The sentinel would mean "random" again if the caller passed seed() back to reseed().
  return seed == kRandomSeed ? 0 : seed;
}

uint32_t bits_of(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}

float float_of(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// e^x for x <= 0 (0 below -87, where it would leave the normal floats). A fixed polynomial
// rather than std::exp, so the weights, and so the drawn tokens, do not depend on the platform's
// C library. Relative error about 1e-7. The range test compares bits, not floats: a float
// comparison may trap on NaN, which keeps the compiler from vectorizing the loops that call it.
inline float exp_nonpositive(float x) {
  constexpr uint32_t kFloorBits = 0xC2AE0000u;  // -87.0f; larger bits are more negative
  const uint32_t x_bits = bits_of(x);
  const uint32_t in_range = x_bits < kFloorBits ? 0xFFFFFFFFu : 0u;
  const float xc = float_of((x_bits & in_range) | (kFloorBits & ~in_range));
  // k = round(xc / ln 2); truncation of a negative value minus one half rounds to nearest.
  const int32_t k = static_cast<int32_t>(xc * 1.44269504f - 0.5f);
  const float kf = static_cast<float>(k);
  // r = xc - k ln 2, with ln 2 split so that k * hi is exact.
  const float r = (xc - kf * 0.693359375f) + kf * 2.12194440e-4f;
  // Taylor series to degree 7: |r| <= 0.35, so the remainder is below 1e-8.
  float p = 1.98412698e-4f;
  p = p * r + 1.38888889e-3f;
  p = p * r + 8.33333333e-3f;
  p = p * r + 4.16666667e-2f;
  p = p * r + 1.66666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const float y = p * float_of(static_cast<uint32_t>(k + 127) << 23);  // 2^k, k in [-126, 0]
  return float_of(bits_of(y) & in_range);
}

constexpr int kBuckets = 1024;
constexpr size_t kSortDirectly = 256;
constexpr size_t kBlock = 256;

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

// Four running sums in a fixed order: faster than one chain, and the same result everywhere.
double sum_of(const float* values, size_t n) {
  double s[4] = {0.0, 0.0, 0.0, 0.0};
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int j = 0; j < 4; ++j) s[j] += values[i + j];
  }
  for (; i < n; ++i) s[0] += values[i];
  return (s[0] + s[1]) + (s[2] + s[3]);
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

Rng::Rng(uint64_t seed) {
  uint64_t state = seed;
  for (uint64_t& word : s_) word = splitmix64(&state);
}

Rng Rng::from_state(const uint64_t state[4]) {
  Rng rng;
  std::copy(state, state + 4, rng.s_);
  return rng;
}

uint64_t Rng::next() {
  const uint64_t result = rotl(s_[1] * 5, 7) * 9;
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = rotl(s_[3], 45);
  return result;
}

double Rng::uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(0) {
  validate(params_);
  reseed(params_.seed);
}

void Sampler::reseed(uint64_t seed) {
  seed_ = seed == kRandomSeed ? fresh_seed() : seed;
  rng_ = Rng(seed_);
}

void Sampler::reserve(int32_t n_vocab) {
  const size_t n = static_cast<size_t>(n_vocab);
  if (logits_.size() >= n) return;
  logits_.resize(n);
  weights_.resize(n);
  draw_weights_.resize(n);
  candidates_.resize(n);
  scratch_.resize(n);
  bucket_mass_.resize(kBuckets);
  block_sums_.resize((n + kBlock - 1) / kBlock);
  counts_.resize(n, 0);
}

void Sampler::apply_penalties(float* logits, int32_t n_vocab, const int32_t* history,
                              size_t n_history) {
  const SamplingParams& p = params_;
  if (p.penalty_last_n == 0 || n_history == 0) return;
  if (p.repeat_penalty == 1.0f && p.frequency_penalty == 0.0f && p.presence_penalty == 0.0f) {
    return;
  }
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

// Top-p over candidates_[0, n), in id order: keeps those that precede, in ByLogitDescending
// order, the first token at which the running sum of weights_ reaches target (that token
// included), still in id order. Rather than sorting, it narrows down to the token where the sum
// crosses: a histogram of weight by logit finds the bucket it crosses in, then that bucket alone
// is examined, the same way, until few tokens are left to sort.
size_t Sampler::cut_top_p(size_t n, double target) {
  const float* work = logits_.data();
  const float* weights = weights_.data();
  const ByLogitDescending order{work};
  int32_t* candidates = candidates_.data();
  int32_t* subset = scratch_.data();
  double* mass = bucket_mass_.data();
  std::copy(candidates, candidates + n, subset);
  size_t m = n;
  double cumulative = 0.0;  // weight of the tokens ahead of the subset
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
      last = subset[m - 1];  // short of the target by rounding only: keep the whole subset
      for (size_t j = 0; j < m; ++j) {
        cumulative += weights[subset[j]];
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
    std::fill(mass, mass + kBuckets, 0.0);
    for (size_t j = 0; j < m; ++j) mass[bucket_of(subset[j])] += weights[subset[j]];
    int crossing = 0;
    while (crossing < kBuckets && cumulative + mass[crossing] < target) {
      cumulative += mass[crossing++];
    }
    if (crossing == kBuckets) return n;  // short of the target by rounding only: keep all
    // Branch-free compaction: which tokens stay is as good as random in id order.
    size_t kept = 0;
    for (size_t j = 0; j < m; ++j) {
      subset[kept] = subset[j];
      kept += bucket_of(subset[j]) == crossing;
    }
    m = kept;
  }
  // Keep what comes no later than `last` in ByLogitDescending order.
  const float cut = work[last];
  size_t kept = 0;
  for (size_t j = 0; j < n; ++j) {
    const int32_t id = candidates[j];
    candidates[kept] = id;
    kept += (work[id] > cut) | ((work[id] == cut) & (id <= last));
  }
  return kept;
}

float Sampler::min_p_floor(float max_logit) const {
  // p_i >= min_p * p_max  <=>  logit_i >= max + ln(min_p). The lowest float also drops -inf.
  float floor = -std::numeric_limits<float>::max();
  if (params_.min_p > 0.0f) {
    const double log_min_p = std::log(static_cast<double>(params_.min_p));
    floor = std::max(floor, max_logit + static_cast<float>(log_min_p));
  }
  return floor;
}

size_t Sampler::keep_top_k(int32_t n_vocab, float max_logit) {
  const SamplingParams& p = params_;
  const float* work = logits_.data();
  float* weights = weights_.data();
  int32_t* candidates = candidates_.data();
  size_t n = select_top_k(n_vocab, static_cast<size_t>(p.top_k));
  // Sorted by logit, so min-p and top-p each keep a prefix; top-p's mass counts every token
  // top-k kept.
  double total = 0.0;
  if (p.top_p < 1.0f) {
    for (size_t j = 0; j < n; ++j) {
      weights[candidates[j]] = exp_nonpositive(work[candidates[j]] - max_logit);
      total += weights[candidates[j]];
    }
  }
  const float floor = min_p_floor(max_logit);
  size_t keep = 0;
  while (keep < n && work[candidates[keep]] >= floor) ++keep;
  if (p.top_p < 1.0f) {
    const double target = static_cast<double>(p.top_p) * total;
    double cumulative = 0.0;
    for (size_t j = 0; j < keep; ++j) {
      cumulative += weights[candidates[j]];
      if (cumulative >= target) {
        keep = j + 1;
        break;
      }
    }
  }
  std::sort(candidates, candidates + keep);
  return keep;
}

size_t Sampler::keep_top_p_min_p(int32_t n_vocab, float max_logit) {
  const SamplingParams& p = params_;
  const size_t n_all = static_cast<size_t>(n_vocab);
  const float* work = logits_.data();
  float* weights = weights_.data();
  int32_t* candidates = candidates_.data();
  const float floor = min_p_floor(max_logit);
  size_t n = 0;
  if (p.top_p == 1.0f) {
    for (size_t i = 0; i < n_all; ++i) {
      candidates[n] = static_cast<int32_t>(i);
      n += work[i] >= floor;
    }
    return n;
  }
  for (size_t i = 0; i < n_all; ++i) weights[i] = exp_nonpositive(work[i] - max_logit);
  const double total = sum_of(weights, n_all);
  // Tokens lighter than (1 - top_p) * total / n_vocab weigh less than (1 - top_p) * total all
  // together, so the heavier ones reach the target first: top-p drops every light one.
  const float light = static_cast<float>((1.0 - p.top_p) * total / static_cast<double>(n_all));
  for (size_t i = 0; i < n_all; ++i) {
    candidates[n] = static_cast<int32_t>(i);
    n += (work[i] >= floor) & (weights[i] >= light);
  }
  // min-p keeps a prefix of the sorted order too, so top-p within it, with the mass of all
  // tokens as the target, keeps the intersection that the chain's order asks for.
  return cut_top_p(n, static_cast<double>(p.top_p) * total);
}

int32_t Sampler::draw(const int32_t* ids, size_t n, float max_logit) {
  const float* work = logits_.data();
  float* weights = draw_weights_.data();
  if (ids == nullptr) {
    std::copy(work, work + n, weights);
  } else {
    for (size_t j = 0; j < n; ++j) weights[j] = work[ids[j]];
  }
  // A pass of its own over contiguous logits, so that it vectorizes.
  const float temperature = params_.temperature;
  for (size_t j = 0; j < n; ++j)
    weights[j] = exp_nonpositive((weights[j] - max_logit) / temperature);
  // Block sums let the walk below skip to the block where the running sum crosses the target.
  double* blocks = block_sums_.data();
  const size_t n_blocks = (n + kBlock - 1) / kBlock;
  double total = 0.0;
  for (size_t b = 0; b < n_blocks; ++b) {
    blocks[b] = sum_of(weights + b * kBlock, std::min(kBlock, n - b * kBlock));
    total += blocks[b];
  }
  const double target = rng_.uniform() * total;
  double cumulative = 0.0;
  size_t b = 0;
  while (b + 1 < n_blocks && cumulative + blocks[b] <= target) cumulative += blocks[b++];
  for (size_t j = b * kBlock; j < n; ++j) {
    cumulative += weights[j];
    if (cumulative > target) return ids == nullptr ? static_cast<int32_t>(j) : ids[j];
  }
  // Rounding left the target at the very end of the sum: the last token with weight takes it.
  size_t j = n - 1;
  while (j > 0 && weights[j] == 0.0f) --j;
  return ids == nullptr ? static_cast<int32_t>(j) : ids[j];
}

int32_t Sampler::sample(const float* logits, int32_t n_vocab, const int32_t* history,
                        size_t n_history) {
  if (logits == nullptr || n_vocab <= 0) invalid("n_vocab", "> 0 with non-null logits", n_vocab);
  reserve(n_vocab);
  const size_t n_all = static_cast<size_t>(n_vocab);
  float* work = logits_.data();
  for (size_t i = 0; i < n_all; ++i) work[i] = std::isnan(logits[i]) ? -kInf : logits[i];
  apply_penalties(work, n_vocab, history, n_history);
  float max_logit = max_of(work, n_all);
  if (!(max_logit > -kInf)) {
    throw ArgumentError("sampling: expected a logit above -inf, got " + std::to_string(n_vocab) +
                        " logits all NaN or -inf");
  }
  const SamplingParams& p = params_;
  if (p.temperature == 0.0f || p.top_k == 1) {
    return static_cast<int32_t>(std::find(work, work + n_all, max_logit) - work);
  }
  if (max_logit == kInf) {
    // The limit of the softmax: the +inf tokens share all the probability equally.
    for (size_t i = 0; i < n_all; ++i) work[i] = work[i] == kInf ? 0.0f : -kInf;
    max_logit = 0.0f;
  }
  if (p.top_k > 0 && static_cast<size_t>(p.top_k) < n_all) {
    const size_t n = keep_top_k(n_vocab, max_logit);
    return draw(candidates_.data(), n, max_logit);
  }
  if (p.top_p < 1.0f || p.min_p > 0.0f) {
    const size_t n = keep_top_p_min_p(n_vocab, max_logit);
    return draw(candidates_.data(), n, max_logit);
  }
  // Nothing to filter: every token is a candidate, the -inf ones with weight 0.
  return draw(nullptr, n_all, max_logit);
}

}  // namespace ggraph
