#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "sampling.h"

namespace ggraph {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

SamplingParams unfiltered(float temperature, uint64_t seed) {
  SamplingParams p;
  p.temperature = temperature;
  p.top_k = 0;
  p.top_p = 1.0f;
  p.min_p = 0.0f;
  p.seed = seed;
  return p;
}

std::vector<float> normal_logits(int32_t n, float scale, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> logits(n);
  for (float& l : logits) l = normal(gen);
  return logits;
}

// ---------------------------------------------------------------------------------------------
// Parameter validation

void expect_invalid(const SamplingParams& p, const std::string& name, const std::string& value) {
  try {
    validate(p);
    FAIL() << "validate accepted " << name << " = " << value;
  } catch (const ArgumentError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(name), std::string::npos) << msg;
    EXPECT_NE(msg.find("got " + value), std::string::npos) << msg;
  }
  EXPECT_THROW(Sampler{p}, ArgumentError);
}

TEST(SamplingValidate, DefaultsAndBoundsAreAccepted) {
  EXPECT_NO_THROW(validate(SamplingParams{}));
  SamplingParams p;
  p.temperature = 0.0f;
  p.top_k = 0;
  p.top_p = 1.0f;
  p.min_p = 1.0f;
  p.repeat_penalty = 1e-3f;
  p.frequency_penalty = -2.0f;
  p.presence_penalty = -2.0f;
  p.penalty_last_n = -1;
  EXPECT_NO_THROW(validate(p));
  p.min_p = 0.0f;
  p.top_p = 1e-6f;
  EXPECT_NO_THROW(validate(p));
}

TEST(SamplingValidate, EachBadValueNamesItsParameter) {
  SamplingParams p;
  p.temperature = -0.5f;
  expect_invalid(p, "temperature", "-0.5");
  p.temperature = kNaN;
  expect_invalid(p, "temperature", "nan");
  p.temperature = kInf;
  expect_invalid(p, "temperature", "inf");

  p = SamplingParams{};
  p.top_k = -1;
  expect_invalid(p, "top_k", "-1");

  p = SamplingParams{};
  p.top_p = 0.0f;
  expect_invalid(p, "top_p", "0");
  p.top_p = 1.5f;
  expect_invalid(p, "top_p", "1.5");
  p.top_p = kNaN;
  expect_invalid(p, "top_p", "nan");

  p = SamplingParams{};
  p.min_p = -0.1f;
  expect_invalid(p, "min_p", "-0.1");
  p.min_p = 1.25f;
  expect_invalid(p, "min_p", "1.25");

  p = SamplingParams{};
  p.repeat_penalty = 0.0f;
  expect_invalid(p, "repeat_penalty", "0");
  p.repeat_penalty = -1.0f;
  expect_invalid(p, "repeat_penalty", "-1");

  p = SamplingParams{};
  p.frequency_penalty = kInf;
  expect_invalid(p, "frequency_penalty", "inf");
  p = SamplingParams{};
  p.presence_penalty = kNaN;
  expect_invalid(p, "presence_penalty", "nan");

  p = SamplingParams{};
  p.penalty_last_n = -2;
  expect_invalid(p, "penalty_last_n", "-2");
}

TEST(SamplingValidate, ValidRangeIsInTheMessage) {
  SamplingParams p;
  p.top_p = 2.0f;
  try {
    validate(p);
    FAIL();
  } catch (const ArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("(0, 1]"), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------------------------------------
// argmax

TEST(SamplingArgmax, LowestIndexAmongTies) {
  const std::vector<float> v = {1.0f, 3.0f, 2.0f, 3.0f, 3.0f};
  EXPECT_EQ(argmax(v.data(), 5), 1);
  const std::vector<float> all_equal(7, -2.5f);
  EXPECT_EQ(argmax(all_equal.data(), 7), 0);
  const std::vector<float> infs = {0.0f, kInf, 5.0f, kInf};
  EXPECT_EQ(argmax(infs.data(), 4), 1);
}

TEST(SamplingArgmax, NaNCountsAsMinusInfinity) {
  const std::vector<float> v = {kNaN, -5.0f, kNaN, -1.0f, kNaN};
  EXPECT_EQ(argmax(v.data(), 5), 3);
  const std::vector<float> minus_inf = {kNaN, -kInf, -kInf};
  EXPECT_EQ(argmax(minus_inf.data(), 3), 1);
  const std::vector<float> nans(3, kNaN);
  EXPECT_THROW(argmax(nans.data(), 3), ArgumentError);
  EXPECT_THROW(argmax(v.data(), 0), ArgumentError);
}

// ---------------------------------------------------------------------------------------------
// Random numbers

TEST(SamplingRng, PhiloxKnownAnswers) {
  // The known-answer vectors published with Random123 for philox4x32_10.
  auto check = [](Philox4 ctr, uint32_t k0, uint32_t k1, Philox4 expected) {
    const Philox4 got = philox4x32_10(ctr, k0, k1);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(got.v[i], expected.v[i]) << "word " << i;
  };
  check({{0, 0, 0, 0}}, 0, 0, {{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}});
  check({{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}}, 0xffffffffu, 0xffffffffu,
        {{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}});
  check({{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}}, 0xa4093822u, 0x299f31d0u,
        {{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}});
}

TEST(SamplingRng, UniformIsTheTop53BitsOfTheDrawsCounter) {
  // Draw n of seed s: Philox of the counter (n, 0) under the key s, words 0 and 1 as 64 bits.
  const uint64_t seed = 0x0123456789abcdefull;
  for (uint64_t draw : {uint64_t(0), uint64_t(1), uint64_t(0x100000000ull) + 7}) {
    const Philox4 r =
        philox4x32_10({{uint32_t(draw), uint32_t(draw >> 32), 0, 0}}, 0x89abcdefu, 0x01234567u);
    const uint64_t bits = (uint64_t(r.v[1]) << 32) | r.v[0];
    EXPECT_EQ(philox_uniform(seed, draw), std::ldexp(double(bits >> 11), -53));
  }
  for (uint64_t i = 0; i < 10000; ++i) {
    const double u = philox_uniform(42, i);
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
  }
}

TEST(SamplingRng, EachDrawAdvancesTheCounterAndGreedyDrawsNothing) {
  SamplingParams p;
  p.seed = 7;
  p.top_k = 0;
  p.top_p = 1.0f;
  p.min_p = 0.0f;
  p.temperature = 1.0f;
  const std::vector<float> logits(1000, 0.0f);  // uniform: token = floor(u * 1000)
  Sampler s(p);
  for (uint64_t i = 0; i < 20; ++i) {
    EXPECT_EQ(s.draws(), i);
    EXPECT_EQ(s.sample(logits.data(), 1000, nullptr, 0), int32_t(philox_uniform(7, i) * 1000));
  }
  s.set_draws(3);
  EXPECT_EQ(s.sample(logits.data(), 1000, nullptr, 0), int32_t(philox_uniform(7, 3) * 1000));
  SamplingParams g = p;
  g.temperature = 0.0f;
  Sampler greedy(g);
  greedy.sample(logits.data(), 1000, nullptr, 0);
  EXPECT_EQ(greedy.draws(), 0u);
}

// ---------------------------------------------------------------------------------------------
// Penalties

// The penalty rule written out per token, in double.
std::vector<double> reference_penalties(const std::vector<float>& logits,
                                        const std::vector<int32_t>& history,
                                        const SamplingParams& p) {
  std::vector<double> out(logits.begin(), logits.end());
  size_t window = history.size();
  if (p.penalty_last_n >= 0) window = std::min(window, static_cast<size_t>(p.penalty_last_n));
  std::map<int32_t, int> counts;
  for (size_t i = history.size() - window; i < history.size(); ++i) counts[history[i]]++;
  for (const auto& [id, count] : counts) {
    double l = out[id];
    l = l > 0 ? l / p.repeat_penalty : l * p.repeat_penalty;
    out[id] = l - count * static_cast<double>(p.frequency_penalty) - p.presence_penalty;
  }
  return out;
}

TEST(SamplingPenalties, MatchTheRuleOnRandomCases) {
  std::mt19937 gen(7);
  const float repeat[] = {1.0f, 1.1f, 1.3f, 0.8f};
  const float frequency[] = {0.0f, 0.5f, -0.25f};
  const float presence[] = {0.0f, 0.7f, -0.3f};
  const int32_t last_n[] = {-1, 0, 1, 5, 64};
  int checked = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const int32_t n_vocab = 1 + static_cast<int32_t>(gen() % 60);
    SamplingParams p;
    p.repeat_penalty = repeat[gen() % 4];
    p.frequency_penalty = frequency[gen() % 3];
    p.presence_penalty = presence[gen() % 3];
    p.penalty_last_n = last_n[gen() % 5];
    std::vector<float> logits = normal_logits(n_vocab, 3.0f, trial);
    std::vector<int32_t> history(gen() % 40);
    // Few distinct ids, so that tokens repeat.
    const int32_t distinct = std::min(n_vocab, 6);
    for (int32_t& id : history) id = static_cast<int32_t>(gen() % distinct);
    const std::vector<double> expected = reference_penalties(logits, history, p);
    Sampler sampler(p);
    sampler.apply_penalties(logits.data(), n_vocab, history.data(), history.size());
    for (int32_t i = 0; i < n_vocab; ++i) {
      ASSERT_NEAR(logits[i], expected[i], 1e-5 * (1.0 + std::fabs(expected[i])))
          << "trial " << trial << " token " << i;
      ++checked;
    }
  }
  EXPECT_GT(checked, 3000);
}

TEST(SamplingPenalties, WindowCoversOnlyTheLastTokens) {
  SamplingParams p;
  p.presence_penalty = 1.0f;
  p.penalty_last_n = 3;
  Sampler sampler(p);
  std::vector<float> logits(6, 0.0f);
  const std::vector<int32_t> history = {0, 0, 1, 4, 3, 2};
  sampler.apply_penalties(logits.data(), 6, history.data(), history.size());
  EXPECT_EQ(logits, (std::vector<float>{0.0f, 0.0f, -1.0f, -1.0f, -1.0f, 0.0f}));
}

TEST(SamplingPenalties, RepeatPenaltyDividesPositiveAndMultipliesNegative) {
  SamplingParams p;
  p.repeat_penalty = 2.0f;
  Sampler sampler(p);
  std::vector<float> logits = {4.0f, -4.0f, 0.0f, 3.0f};
  const std::vector<int32_t> history = {0, 1, 2, 0};
  sampler.apply_penalties(logits.data(), 4, history.data(), history.size());
  EXPECT_EQ(logits, (std::vector<float>{2.0f, -8.0f, 0.0f, 3.0f}));
}

TEST(SamplingPenalties, FrequencyCountsEveryOccurrence) {
  SamplingParams p;
  p.frequency_penalty = 0.5f;
  p.presence_penalty = 0.25f;
  p.penalty_last_n = -1;
  Sampler sampler(p);
  std::vector<float> logits = {1.0f, 1.0f, 1.0f};
  const std::vector<int32_t> history = {2, 0, 2, 2};
  sampler.apply_penalties(logits.data(), 3, history.data(), history.size());
  EXPECT_EQ(logits, (std::vector<float>{0.25f, 1.0f, -0.75f}));
  // Counts are reset between calls: the same call gives the same result.
  std::vector<float> again = {1.0f, 1.0f, 1.0f};
  sampler.apply_penalties(again.data(), 3, history.data(), history.size());
  EXPECT_EQ(again, logits);
}

TEST(SamplingPenalties, OutOfRangeHistoryInsideTheWindowIsAnError) {
  SamplingParams p;
  p.repeat_penalty = 1.2f;
  p.penalty_last_n = 2;
  Sampler sampler(p);
  std::vector<float> logits(4, 1.0f);
  const std::vector<int32_t> bad_inside = {0, 1, 4};
  EXPECT_THROW(sampler.apply_penalties(logits.data(), 4, bad_inside.data(), 3), ArgumentError);
  const std::vector<int32_t> negative = {0, -1, 2};
  EXPECT_THROW(sampler.sample(logits.data(), 4, negative.data(), 3), ArgumentError);
  // An id outside the window is never read.
  const std::vector<int32_t> bad_outside = {99, 1, 2};
  EXPECT_NO_THROW(sampler.apply_penalties(logits.data(), 4, bad_outside.data(), 3));
  // A failed call leaves no counts behind.
  std::vector<float> fresh(4, 1.0f);
  const std::vector<int32_t> one = {3};
  sampler.apply_penalties(fresh.data(), 4, one.data(), 1);
  EXPECT_EQ(fresh, (std::vector<float>{1.0f, 1.0f, 1.0f, 1.0f / 1.2f}));
}

// ---------------------------------------------------------------------------------------------
// The whole chain against a reference that sorts everything and works in double

struct ReferencePick {
  int32_t token = -1;
  bool ambiguous = false;  // float rounding in the sampler may legitimately pick another token
};

// The sampler's weights carry about 1e-6 relative error (float logits, float exp); a pick that
// changes when a threshold moves by a few times that is a coin toss, not a disagreement.
constexpr double kMassTolerance = 3e-6;   // top-p and the draw, relative to the sums
constexpr double kLogitTolerance = 1e-5;  // top-k and min-p, on the logits

// Everything after the sort, with the top-p, min-p and draw thresholds scaled by 1 + nudge.
// w1 and wt are exp(l - top) and exp((l - top) / temperature) by token id.
int32_t reference_pick(std::vector<int32_t> ids, const std::vector<double>& w1,
                       const std::vector<double>& wt, const SamplingParams& p, double u,
                       const double nudge[3]) {
  size_t keep = ids.size();
  if (p.top_p < 1.0f) {
    double z = 0.0;
    for (int32_t i : ids) z += w1[i];
    const double target = p.top_p * z * (1.0 + nudge[0]);
    double cumulative = 0.0;
    for (size_t j = 0; j < ids.size(); ++j) {
      cumulative += w1[ids[j]];
      if (cumulative >= target) {
        keep = j + 1;
        break;
      }
    }
  }
  if (p.min_p > 0.0f) {
    size_t kept = 0;
    for (int32_t i : ids) kept += w1[i] >= p.min_p * (1.0 + nudge[1]);
    keep = std::min(keep, kept);
  }
  ids.resize(keep);
  std::sort(ids.begin(), ids.end());
  double total = 0.0;
  for (int32_t i : ids) total += wt[i];
  const double target = u * total * (1.0 + nudge[2]);
  double cumulative = 0.0;
  for (int32_t i : ids) {
    cumulative += wt[i];
    if (cumulative > target) return i;
  }
  return ids.back();
}

// The chain as documented, sorting everything, in double with std::exp.
ReferencePick reference_sample(const std::vector<float>& logits,
                               const std::vector<int32_t>& history, const SamplingParams& p,
                               double u) {
  const int32_t n_vocab = static_cast<int32_t>(logits.size());
  std::vector<double> l = reference_penalties(logits, history, p);
  for (double& v : l) v = std::isnan(v) ? -HUGE_VAL : v;
  const double max = *std::max_element(l.begin(), l.end());
  std::vector<int32_t> ids;
  for (int32_t i = 0; i < n_vocab; ++i) {
    if (max == HUGE_VAL ? l[i] == HUGE_VAL : l[i] > -HUGE_VAL) ids.push_back(i);
  }
  const double top = max == HUGE_VAL ? 0.0 : max;
  if (max == HUGE_VAL) {
    for (int32_t i : ids) l[i] = 0.0;
  }
  std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return l[a] > l[b]; });
  ReferencePick pick;
  if (p.temperature == 0.0f || p.top_k == 1) {
    pick.token = ids[0];
    return pick;
  }
  if (p.top_k > 0 && static_cast<size_t>(p.top_k) < ids.size()) {
    const double gap = l[ids[p.top_k - 1]] - l[ids[p.top_k]];
    // Exact ties are no ambiguity: both sides break them by id.
    pick.ambiguous = gap > 0.0 && gap < kLogitTolerance * (1.0 + std::fabs(l[ids[p.top_k]]));
    ids.resize(p.top_k);
  }
  std::vector<double> w1(n_vocab, 0.0);
  std::vector<double> wt(n_vocab, 0.0);
  for (int32_t i : ids) {
    w1[i] = std::exp(l[i] - top);
    wt[i] = std::exp((l[i] - top) / p.temperature);
  }
  const double no_nudge[3] = {0.0, 0.0, 0.0};
  pick.token = reference_pick(ids, w1, wt, p, u, no_nudge);
  for (int combo = 0; combo < 27; ++combo) {
    const double nudge[3] = {kMassTolerance * (combo % 3 - 1),
                             kLogitTolerance * (combo / 3 % 3 - 1),
                             kMassTolerance * (combo / 9 - 1)};
    if (reference_pick(ids, w1, wt, p, u, nudge) != pick.token) pick.ambiguous = true;
  }
  return pick;
}

enum class Shape {
  kNormal,   // normal logits with standard deviation `scale`
  kTies,     // the same rounded to multiples of 0.5: many exact ties
  kCluster,  // a narrow cluster far below one token: top-p's histogram needs several rounds
};

struct ChainCase {
  int32_t n_vocab;
  float scale;
  SamplingParams params;
  Shape shape = Shape::kNormal;
};

std::vector<float> case_logits(const ChainCase& c, uint32_t seed) {
  std::vector<float> logits = normal_logits(c.n_vocab, c.scale, seed);
  if (c.shape == Shape::kTies) {
    for (float& l : logits) l = std::round(l * 2.0f) / 2.0f;
  } else if (c.shape == Shape::kCluster) {
    for (float& l : logits) l *= 0.05f;
    logits[seed % c.n_vocab] = 8.0f;
  }
  return logits;
}

void check_against_reference(const ChainCase& c, int n_seeds, int* compared, int* skipped) {
  std::mt19937 gen(c.n_vocab + static_cast<uint32_t>(c.params.top_k));
  for (int s = 0; s < n_seeds; ++s) {
    std::vector<float> logits = case_logits(c, 1000 + s);
    std::vector<int32_t> history(gen() % 100);
    for (int32_t& id : history) id = static_cast<int32_t>(gen() % std::min(c.n_vocab, 50));
    SamplingParams p = c.params;
    p.seed = 12345 + s;
    Sampler sampler(p);
    const int32_t token = sampler.sample(logits.data(), c.n_vocab, history.data(), history.size());
    const ReferencePick expected = reference_sample(logits, history, p, philox_uniform(p.seed, 0));
    if (expected.ambiguous) {
      ++*skipped;
      continue;
    }
    ++*compared;
    ASSERT_EQ(token, expected.token)
        << "n_vocab " << c.n_vocab << " top_k " << p.top_k << " top_p " << p.top_p << " min_p "
        << p.min_p << " temperature " << p.temperature << " seed " << p.seed;
  }
}

TEST(SamplingChain, MatchesTheSortingReference) {
  auto params = [](float t, int32_t k, float top_p, float min_p, float rep, float freq) {
    SamplingParams p;
    p.temperature = t;
    p.top_k = k;
    p.top_p = top_p;
    p.min_p = min_p;
    p.repeat_penalty = rep;
    p.frequency_penalty = freq;
    p.presence_penalty = freq / 2;
    p.penalty_last_n = 32;
    return p;
  };
  const std::vector<ChainCase> cases = {
      {1, 1.0f, params(0.8f, 40, 0.95f, 0.05f, 1.0f, 0.0f)},
      {2, 1.0f, params(1.0f, 0, 1.0f, 0.0f, 1.0f, 0.0f)},
      {10, 2.0f, params(1.0f, 0, 1.0f, 0.0f, 1.3f, 0.2f)},
      {10, 2.0f, params(0.0f, 0, 1.0f, 0.0f, 1.3f, 0.2f)},
      {10, 2.0f, params(0.7f, 1, 1.0f, 0.0f, 1.3f, 0.2f)},
      {100, 2.0f, params(1.5f, 5, 1.0f, 0.0f, 1.0f, 0.0f)},    // heap selection
      {100, 2.0f, params(1.5f, 60, 1.0f, 0.0f, 1.0f, 0.0f)},   // nth_element selection
      {100, 2.0f, params(1.5f, 0, 0.6f, 0.0f, 1.0f, 0.0f)},    // top-p by sorting
      {100, 2.0f, params(1.5f, 0, 1.0f, 0.02f, 1.0f, 0.0f)},   // min-p alone
      {100, 2.0f, params(1.5f, 30, 0.7f, 0.05f, 1.1f, 0.1f)},  // everything
      {5000, 1.0f, params(1.0f, 0, 0.9f, 0.0f, 1.0f, 0.0f)},   // top-p by histogram
      {5000, 1.0f, params(0.9f, 0, 0.99f, 0.0f, 1.0f, 0.0f)},
      {5000, 1.0f, params(1.2f, 0, 0.9f, 0.1f, 1.0f, 0.0f)},
      {5000, 3.0f, params(0.8f, 200, 0.95f, 0.01f, 1.1f, 0.0f)},
      {5000, 1.0f, params(2.0f, 4000, 0.5f, 0.0f, 1.0f, 0.0f)},
      {5000, 1.0f, params(1.0f, 0, 0.8f, 0.0f, 1.0f, 0.0f), Shape::kTies},
      {5000, 1.0f, params(1.0f, 100, 0.9f, 0.0f, 1.0f, 0.0f), Shape::kTies},
      {5000, 1.0f, params(1.0f, 1000, 1.0f, 0.3f, 1.0f, 0.0f), Shape::kTies},
      {20000, 1.0f, params(1.0f, 0, 0.7f, 0.0f, 1.0f, 0.0f), Shape::kCluster},
      {20000, 1.0f, params(1.0f, 0, 0.995f, 0.0f, 1.0f, 0.0f), Shape::kCluster},
  };
  int compared = 0;
  int skipped = 0;
  for (const ChainCase& c : cases) check_against_reference(c, 40, &compared, &skipped);
  EXPECT_LT(skipped, compared / 50) << "too few cases away from a threshold to compare";
}

TEST(SamplingChain, LargeVocabularyDefaults) {
  int compared = 0;
  int skipped = 0;
  SamplingParams p;
  check_against_reference({152064, 2.0f, p}, 10, &compared, &skipped);
  p.top_k = 0;
  check_against_reference({152064, 2.0f, p}, 10, &compared, &skipped);
  p.min_p = 0.0f;  // top-p alone over a flat tail: tens of thousands of tokens kept
  check_against_reference({49152, 1.0f, p}, 10, &compared, &skipped);
  EXPECT_GE(compared, 20);
}

// ---------------------------------------------------------------------------------------------
// Distribution

// Pearson's statistic is asymptotically chi-square with df degrees of freedom; Laurent and
// Massart (2000): P(X >= df + 2 sqrt(df x) + 2x) <= e^-x. x = ln(1e6): a one-in-a-million false
// alarm rate.
double chi_square_bound(int df) {
  const double x = std::log(1e6);
  return df + 2.0 * std::sqrt(df * x) + 2.0 * x;
}

double pearson(const std::vector<int>& counts, const std::vector<double>& probs, int n) {
  double stat = 0.0;
  for (size_t i = 0; i < counts.size(); ++i) {
    const double expected = n * probs[i];
    stat += (counts[i] - expected) * (counts[i] - expected) / expected;
  }
  return stat;
}

std::vector<double> softmax(const std::vector<float>& logits, double temperature) {
  std::vector<double> p(logits.size());
  const double max = *std::max_element(logits.begin(), logits.end());
  double z = 0.0;
  for (size_t i = 0; i < p.size(); ++i) z += p[i] = std::exp((logits[i] - max) / temperature);
  for (double& v : p) v /= z;
  return p;
}

TEST(SamplingDistribution, FrequenciesMatchTheSoftmax) {
  const std::vector<float> logits = {0.5f, -0.3f, 1.2f, 0.0f, -1.0f, 0.9f, 0.2f, -0.6f};
  const int n = 40000;
  for (float temperature : {1.0f, 0.7f}) {
    Sampler sampler(unfiltered(temperature, 2024));
    std::vector<int> counts(logits.size(), 0);
    for (int i = 0; i < n; ++i) ++counts[sampler.sample(logits.data(), 8, nullptr, 0)];
    const std::vector<double> probs = softmax(logits, temperature);
    for (double q : probs) ASSERT_GT(q * n, 50.0);  // large expected counts: the asymptotics hold
    const double bound = chi_square_bound(7);
    EXPECT_LT(pearson(counts, probs, n), bound) << "temperature " << temperature;
    // The test can tell a wrong temperature apart.
    EXPECT_GT(pearson(counts, softmax(logits, temperature * 1.2), n), bound);
  }
}

// ---------------------------------------------------------------------------------------------
// Special values, greedy, seeds

TEST(SamplingSpecialValues, NaNAndMinusInfinityAreNeverDrawn) {
  const std::vector<float> logits = {kNaN, 0.0f, -kInf, 0.5f, kNaN, -0.5f, -kInf};
  Sampler sampler(unfiltered(5.0f, 1));
  std::vector<int> counts(7, 0);
  for (int i = 0; i < 3000; ++i) ++counts[sampler.sample(logits.data(), 7, nullptr, 0)];
  EXPECT_EQ(counts[0] + counts[2] + counts[4] + counts[6], 0);
  EXPECT_GT(counts[1], 0);
  EXPECT_GT(counts[3], 0);
  EXPECT_GT(counts[5], 0);
  Sampler greedy(unfiltered(0.0f, 1));
  EXPECT_EQ(greedy.sample(logits.data(), 7, nullptr, 0), 3);
}

TEST(SamplingSpecialValues, NoFiniteLogitIsAnError) {
  const std::vector<float> logits = {kNaN, -kInf, kNaN};
  Sampler sampler(SamplingParams{});
  EXPECT_THROW(sampler.sample(logits.data(), 3, nullptr, 0), ArgumentError);
  Sampler greedy(unfiltered(0.0f, 1));
  EXPECT_THROW(greedy.sample(logits.data(), 3, nullptr, 0), ArgumentError);
  EXPECT_THROW(greedy.sample(logits.data(), 0, nullptr, 0), ArgumentError);
}

TEST(SamplingSpecialValues, PlusInfinityTakesAllTheProbability) {
  const std::vector<float> logits = {0.0f, kInf, 100.0f, kInf};
  Sampler sampler(unfiltered(1.0f, 3));
  std::vector<int> counts(4, 0);
  const int n = 4000;
  for (int i = 0; i < n; ++i) ++counts[sampler.sample(logits.data(), 4, nullptr, 0)];
  EXPECT_EQ(counts[0] + counts[2], 0);
  // Shared equally: binomial(4000, 1/2) within 6 standard deviations (about 190).
  EXPECT_NEAR(counts[1], n / 2, 190);
  Sampler greedy(unfiltered(0.0f, 1));
  EXPECT_EQ(greedy.sample(logits.data(), 4, nullptr, 0), 1);
}

TEST(SamplingTopK, TiesAtTheCutKeepTheLowerIds) {
  std::vector<float> logits(80, -1.0f);
  for (int32_t id : {10, 50}) logits[id] = 2.0f;
  for (int32_t id : {5, 20, 30, 60, 70}) logits[id] = 1.0f;
  // k = 3 goes through heap selection (k * 16 <= n), k = 6 through nth_element.
  const std::map<int32_t, std::vector<int32_t>> kept_by_k = {{3, {5, 10, 50}},
                                                             {6, {5, 10, 20, 30, 50, 60}}};
  for (const auto& [k, kept] : kept_by_k) {
    SamplingParams p = unfiltered(3.0f, 11);
    p.top_k = k;
    Sampler sampler(p);
    std::vector<int> counts(80, 0);
    for (int i = 0; i < 2000; ++i) ++counts[sampler.sample(logits.data(), 80, nullptr, 0)];
    for (int32_t id = 0; id < 80; ++id) {
      const bool expected = std::find(kept.begin(), kept.end(), id) != kept.end();
      EXPECT_EQ(counts[id] > 0, expected) << "k " << k << " token " << id;
    }
  }
}

TEST(SamplingTopP, EqualLogitsKeepTheLowerIds) {
  // 1000 equal logits: top-p = 0.25 (exact in binary) keeps the 250 lowest ids.
  const std::vector<float> logits(1000, 0.25f);
  SamplingParams p = unfiltered(1.0f, 13);
  p.top_p = 0.25f;
  Sampler sampler(p);
  std::vector<int> counts(1000, 0);
  for (int i = 0; i < 20000; ++i) ++counts[sampler.sample(logits.data(), 1000, nullptr, 0)];
  // Each kept token is drawn about 80 times: missing one has probability below 1e-30.
  for (int32_t id = 0; id < 1000; ++id) {
    ASSERT_EQ(counts[id] > 0, id < 250) << "token " << id << " drawn " << counts[id] << " times";
  }
}

TEST(SamplingGreedy, TemperatureZeroAndTopKOneTakeThePenalizedArgmax) {
  for (int trial = 0; trial < 50; ++trial) {
    const std::vector<float> logits = normal_logits(300, 2.0f, trial);
    const std::vector<int32_t> history = {argmax(logits.data(), 300), 5, 7};
    SamplingParams p = unfiltered(0.0f, 9);
    p.repeat_penalty = 1.5f;
    p.presence_penalty = 0.5f;
    std::vector<float> penalized = logits;
    Sampler sampler(p);
    sampler.apply_penalties(penalized.data(), 300, history.data(), history.size());
    const int32_t expected = argmax(penalized.data(), 300);
    EXPECT_EQ(sampler.sample(logits.data(), 300, history.data(), history.size()), expected);
    p.temperature = 1.0f;
    p.top_k = 1;
    Sampler top1(p);
    EXPECT_EQ(top1.sample(logits.data(), 300, history.data(), history.size()), expected);
  }
}

TEST(SamplingSeed, SameSeedSameTokens) {
  const std::vector<float> logits = normal_logits(1000, 1.0f, 5);
  auto run = [&](Sampler& s) {
    std::vector<int32_t> out;
    for (int i = 0; i < 50; ++i) out.push_back(s.sample(logits.data(), 1000, out.data(), i));
    return out;
  };
  SamplingParams p;
  p.seed = 77;
  p.repeat_penalty = 1.1f;
  Sampler a(p);
  Sampler b(p);
  const std::vector<int32_t> first = run(a);
  EXPECT_EQ(first, run(b));
  a.reseed(77);
  EXPECT_EQ(first, run(a));
  p.seed = 78;
  Sampler c(p);
  EXPECT_NE(first, run(c));
}

TEST(SamplingSeed, RandomSeedIsDrawnAndReported) {
  Sampler a(SamplingParams{});
  Sampler b(SamplingParams{});
  EXPECT_NE(a.seed(), kRandomSeed);
  EXPECT_NE(a.seed(), b.seed());
  // Reporting the drawn seed lets a run be replayed.
  const std::vector<float> logits = normal_logits(500, 1.0f, 6);
  SamplingParams replay;
  replay.seed = a.seed();
  Sampler c(replay);
  for (int i = 0; i < 20; ++i) {
    EXPECT_EQ(a.sample(logits.data(), 500, nullptr, 0), c.sample(logits.data(), 500, nullptr, 0));
  }
}

TEST(SamplingBuffers, VocabularySizeMayChangeBetweenCalls) {
  Sampler sampler(unfiltered(0.0f, 1));
  const std::vector<float> big = normal_logits(5000, 1.0f, 8);
  const std::vector<float> small = {0.0f, 2.0f, 1.0f};
  EXPECT_EQ(sampler.sample(small.data(), 3, nullptr, 0), 1);
  EXPECT_EQ(sampler.sample(big.data(), 5000, nullptr, 0), argmax(big.data(), 5000));
  EXPECT_EQ(sampler.sample(small.data(), 3, nullptr, 0), 1);
}

// Greedy sampling without penalties reads the logits in place: the same token as argmax over
// the rows it takes (ties, NaN, infinities, lengths around the 8-wide steps), the same error
// when nothing is above -inf.
TEST(SamplingGreedy, InPlaceEqualsArgmax) {
  Sampler greedy(unfiltered(0.0f, 1));
  std::mt19937 gen(21);
  for (int32_t n : {1, 7, 8, 9, 31, 4097}) {
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<float> v = normal_logits(n, 2.0f, uint32_t(n * 100 + trial));
      for (float& x : v) {
        const uint32_t r = gen() % 16;
        if (r == 0) x = kNaN;
        if (r == 1) x = -kInf;
        if (r == 2) x = 1.5f;  // ties
        if (r == 3 && trial % 5 == 0) x = kInf;
      }
      if (trial == 19) std::fill(v.begin(), v.end(), kNaN);
      if (std::none_of(v.begin(), v.end(), [](float x) { return x > -kInf; })) {
        EXPECT_THROW(greedy.sample(v.data(), n, nullptr, 0), ArgumentError) << n;
        continue;
      }
      EXPECT_EQ(greedy.sample(v.data(), n, nullptr, 0), argmax(v.data(), n)) << n << " " << trial;
    }
  }
}

// sample_once (the library's one-shot draws: ggraph.sample, Model.sample, ggraph_sample) gives
// what a new Sampler of the same parameters gives, call after call, whatever the calls before
// it asked: other parameters, another vocabulary, a call refused for its history.
TEST(SamplingOnce, EachCallEqualsANewSampler) {
  const std::vector<float> big = normal_logits(3000, 1.5f, 31);
  const std::vector<float> small = normal_logits(40, 1.0f, 32);
  std::vector<int32_t> history(100);
  for (size_t i = 0; i < history.size(); ++i) history[i] = int32_t(i * 7 % 40);
  std::vector<SamplingParams> params;
  params.push_back(unfiltered(0.0f, 1));
  params.push_back(unfiltered(0.9f, 5));
  SamplingParams p;  // the defaults: top-k, top-p and min-p
  p.seed = 9;
  params.push_back(p);
  p.repeat_penalty = 1.3f;
  p.frequency_penalty = 0.2f;
  params.push_back(p);
  p.temperature = 0.0f;  // greedy over penalized logits
  params.push_back(p);
  for (int round = 0; round < 3; ++round) {
    for (const SamplingParams& q : params) {
      for (const std::vector<float>* v : {&big, &small}) {
        const int32_t n = int32_t(v->size());
        Sampler fresh(q);
        EXPECT_EQ(sample_once(q, v->data(), n, history.data(), history.size()),
                  fresh.sample(v->data(), n, history.data(), history.size()));
      }
    }
    // A history id outside the small vocabulary, inside the window: refused, and the next
    // draws are unchanged by it.
    EXPECT_THROW(sample_once(params[3], small.data(), 5, history.data(), history.size()),
                 ArgumentError);
  }
}

TEST(SamplingConfig, StopIdsLieBetweenTheParametersAndTheHistory) {
  namespace w = sample_word;
  SamplingParams p;
  p.temperature = 0.0f;
  p.penalty_last_n = 3;
  p.repeat_penalty = 1.5f;
  const int32_t history[4] = {6, 7, 8, 9};
  const std::vector<int32_t> stops = {2, 11, 12, 13, 14, 15, 16, 17, 18, 19};
  std::vector<int32_t> with(w::kHeader + 3, -7), without(w::kHeader + 3, -7);
  fill_sample_config(p, 5, 0, history, 4, 3, with.data(), stops.data(), stops.size());
  fill_sample_config(p, 5, 0, history, 4, 3, without.data());
  // The first kMaxStop ids are kept; a generation with more stops the others on the host.
  ASSERT_EQ(with[w::kNStop], w::kMaxStop);
  for (int i = 0; i < w::kMaxStop; ++i) EXPECT_EQ(with[w::kStop + i], stops[size_t(i)]);
  EXPECT_EQ(without[w::kNStop], 0);
  // The history's last `window` ids follow the header either way.
  for (const std::vector<int32_t>* c : {&with, &without}) {
    EXPECT_EQ((*c)[w::kNHistory], 3);
    for (int i = 0; i < 3; ++i) EXPECT_EQ((*c)[w::kHeader + i], history[i + 1]);
  }
  // And the stop ids change no sample: the Sample op picks the same token under both.
  std::vector<float> logits(32);
  for (int i = 0; i < 32; ++i) logits[size_t(i)] = float((i * 7) % 11);
  Sampler a(p), b(p);
  std::vector<int32_t> ta(4, 0), tb(4, 0);
  run_sample_op(logits.data(), 32, with.data(), ta.data(), 0, 2, a);
  run_sample_op(logits.data(), 32, without.data(), tb.data(), 0, 2, b);
  EXPECT_EQ(ta, tb);
  EXPECT_GE(ta[0], 0);
}

TEST(SamplingSeed, RandomSeedsDifferFromCallToCall) {
  std::vector<uint64_t> seeds;
  for (int i = 0; i < 1000; ++i) seeds.push_back(Sampler(SamplingParams{}).seed());
  std::sort(seeds.begin(), seeds.end());
  EXPECT_EQ(std::adjacent_find(seeds.begin(), seeds.end()), seeds.end());
  EXPECT_EQ(std::count(seeds.begin(), seeds.end(), kRandomSeed), 0);
}

}  // namespace
}  // namespace ggraph
