#include "generation.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

namespace ggraph {

const char* stop_reason_name(StopReason r) {
  switch (r) {
    case StopReason::kEos:
      return "eos";
    case StopReason::kStop:
      return "stop";
    case StopReason::kLength:
      return "length";
    case StopReason::kContextFull:
      return "context_full";
    case StopReason::kCancelled:
      return "cancelled";
    case StopReason::kNone:
      break;
  }
  return "";
}

namespace {

// The length of s's longest prefix that ends on a UTF-8 character boundary at or before n.
size_t utf8_boundary(const std::string& s, size_t n) {
  while (n > 0 && n < s.size() && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;
  return n;
}

// log-softmax of the logits at `id`, and the `top` largest with theirs.
void logprobs(const std::vector<float>& logits, int32_t id, int top, GeneratedToken* out) {
  float max = -INFINITY;
  for (float v : logits)
    if (v > max) max = v;
  double sum = 0.0;
  for (float v : logits) sum += std::exp(double(v) - max);
  const double log_z = double(max) + std::log(sum);
  out->logprob = float(double(logits[size_t(id)]) - log_z);
  out->top.clear();
  if (top <= 0) return;
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  const size_t k = std::min(order.size(), size_t(top));
  std::partial_sort(order.begin(), order.begin() + long(k), order.end(), [&](int32_t a, int32_t b) {
    return logits[size_t(a)] > logits[size_t(b)] ||
           (logits[size_t(a)] == logits[size_t(b)] && a < b);
  });
  for (size_t i = 0; i < k; ++i)
    out->top.emplace_back(order[i], float(double(logits[size_t(order[i])]) - log_z));
}

}  // namespace

Generation::Generation(Context& ctx, std::vector<int32_t> prompt, GenerateOptions options)
    : ctx_(ctx),
      prompt_(std::move(prompt)),
      opt_(std::move(options)),
      sampler_(opt_.sampling),
      decoder_(ctx.tokenizer()) {
  seq_ = ctx.sequence();
  if (prompt_.empty()) throw ArgumentError("generate: the prompt is empty");
  check_token_ids(prompt_.data(), prompt_.size(), ctx.n_vocab(), "generate");
  if (prompt_.size() >= size_t(ctx.n_ctx()))
    throw ArgumentError("generate: the prompt has " + std::to_string(prompt_.size()) +
                        " tokens; the context holds " + std::to_string(ctx.n_ctx()));
  if (opt_.max_tokens < 0)
    throw ArgumentError("generate: max_tokens must be >= 0, got " +
                        std::to_string(opt_.max_tokens));
  if (opt_.top_logprobs < 0 || opt_.top_logprobs > kMaxTopLogprobs)
    throw ArgumentError("generate: top_logprobs must be 0 to " + std::to_string(kMaxTopLogprobs) +
                        ", got " + std::to_string(opt_.top_logprobs));
  if (!opt_.logprobs && opt_.top_logprobs > 0)
    throw ArgumentError("generate: top_logprobs needs logprobs");
  for (const std::string& s : opt_.stop) {
    if (s.empty()) throw ArgumentError("generate: stop strings must be non-empty");
    if (s.size() > UINT32_MAX) throw ArgumentError("generate: a stop string of 4 GiB or more");
    std::vector<uint32_t> fail(s.size(), 0);
    for (size_t i = 1, k = 0; i < s.size(); ++i) {
      while (k > 0 && s[i] != s[k]) k = fail[k - 1];
      if (s[i] == s[k]) ++k;
      fail[i] = uint32_t(k);
    }
    stop_fail_.push_back(std::move(fail));
  }
  stop_state_.assign(opt_.stop.size(), 0);
  if (opt_.chain != kAutoChain && (opt_.chain < 1 || opt_.chain > Context::kMaxLaunch))
    throw ArgumentError("generate: chain must be 1 to " + std::to_string(Context::kMaxLaunch) +
                        " decode steps a launch (or the backend's default), got " +
                        std::to_string(opt_.chain));
  // By default a loop where the backend runs them (its tokens stream back a round at a time),
  // else a chain of kDefaultChain on CUDA, and a token at a time (sampled on the host) on the CPU.
  if (opt_.chain != kAutoChain)
    chain_ = opt_.chain;
  else if (ctx_.backend().runs_loops())
    chain_ = Context::kMaxLaunch;
  else
    chain_ = ctx_.backend().is_cuda() ? kDefaultChain : 1;
  // More than a chain's steps a launch where the backend runs loops; elsewhere a chain's most.
  if (!ctx_.backend().runs_loops()) chain_ = std::min(chain_, Context::kMaxChain);
  if (opt_.top_logprobs > 0) chain_ = 1;
  ctx_.clear_cancel();
}

Generation::~Generation() {
  if (!in_flight_) return;
  try {
    land_chain(true);
  } catch (...) {  // (a device error: the context reports it at its next call)
  }
}

void Generation::launch_chain() {
  if (relaunch_) ctx_.rewind(ctx_.n_past() - 1);
  relaunch_ = false;
  const int base = ctx_.n_past();
  int k = std::min({chain_, ctx_.n_ctx() - base, opt_.max_tokens - n_generated_});
  // A loop's whole rounds must fit the context (Context::decode_sampled): near its end, the
  // rounds that fit, then a chain of the rest.
  if (chain_ > Context::kMaxChain && k > Context::kLoopChain &&
      base + Context::loop_positions(k) > ctx_.n_ctx())
    k -= k % Context::kLoopChain;
  flight_tokens_.assign(static_cast<size_t>(k), 0);
  flight_logprobs_.assign(static_cast<size_t>(k), 0.0f);
  // (A step that fails leaves the context with what it evaluated, and the chain as it was.)
  // The steps after an end-of-generation token may be skipped, unless those are ignored.
  const std::vector<int32_t>& eog = ctx_.tokenizer().end_of_generation();
  // A generation of loops runs its shorter launches as loops too: one graph serves them all.
  launch_ = ctx_.launch_sampled(chain_first_, k, sampler_.params(), sampler_.seed(),
                                sampler_.draws(), opt_.ignore_eos ? nullptr : eog.data(),
                                opt_.ignore_eos ? 0 : eog.size(), chain_ > Context::kMaxChain);
  in_flight_ = true;
  chain_base_ = base;
  chain_tokens_.clear();
  chain_logprobs_.clear();
  chain_next_ = 0;
}

void Generation::land_chain(bool halt) {
  if (halt) ctx_.halt_sampled(launch_);
  in_flight_ = false;  // landed or failed, it is no longer in flight
  const int made = ctx_.land_sampled(launch_, flight_tokens_.data(), flight_logprobs_.data());
  const SamplingParams& p = sampler_.params();
  if (!sample_is_greedy(p.temperature, p.top_k)) sampler_.set_draws(sampler_.draws() + made);
  chain_tokens_.assign(flight_tokens_.begin(), flight_tokens_.begin() + made);
  chain_logprobs_.assign(flight_logprobs_.begin(), flight_logprobs_.begin() + made);
  chain_first_ = chain_tokens_.back();
}

int32_t Generation::next_chained(float* logprob) {
  while (chain_next_ == chain_tokens_.size()) {
    // Every token made so far given: the launch's next ones as its rounds make them, or all of
    // them at its end (a launch whose tokens were all given already ends with none new, and the
    // next one starts from its last).
    if (!in_flight_) launch_chain();
    const int have = static_cast<int>(chain_tokens_.size());
    const int n = ctx_.poll_sampled(launch_, have, flight_tokens_.data(), flight_logprobs_.data());
    if (n < 0) {
      land_chain(false);
    } else {
      chain_tokens_.assign(flight_tokens_.begin(), flight_tokens_.begin() + n);
      chain_logprobs_.assign(flight_logprobs_.begin(), flight_logprobs_.begin() + n);
    }
  }
  *logprob = chain_logprobs_[chain_next_];
  return chain_tokens_[chain_next_++];
}

void Generation::settle_chain(bool stopped, bool evaluate_last) {
  if (in_flight_) land_chain(true);
  if (chain_tokens_.empty()) return;
  // The last launch evaluated tokens past what a step at a time would have: keep those the
  // caller was given, less one that stopped the generation.
  const int given = static_cast<int>(chain_next_);
  const int k = static_cast<int>(chain_tokens_.size());
  const int keep = chain_base_ + std::min(given + (stopped ? 0 : 1), k);
  if (ctx_.n_past() > keep) ctx_.rewind(keep);
  // A step at a time evaluates each token it gives before it looks for a length limit or a
  // cancel: so does the last launch's last sample.
  if (evaluate_last && given == k && ctx_.n_past() < ctx_.n_ctx())
    ctx_.eval(&chain_first_, 1, false);
  chain_tokens_.clear();
  chain_next_ = 0;
}

void Generation::settle() {
  if (in_flight_) land_chain(true);
  if (over_ || chain_next_ == 0) return;
  const int given = static_cast<int>(chain_next_);
  const int k = static_cast<int>(chain_tokens_.size());
  if (given < k) {
    // The last token given stays evaluated and the sample after it stays next; the launch
    // after that starts from it, with the draws the samples dropped here took.
    const int dropped = k - given - 1;
    if (ctx_.n_past() > chain_base_ + given + 1) ctx_.rewind(chain_base_ + given + 1);
    const SamplingParams& p = sampler_.params();
    if (!sample_is_greedy(p.temperature, p.top_k))
      sampler_.set_draws(sampler_.draws() - static_cast<uint64_t>(dropped));
    chain_tokens_.resize(static_cast<size_t>(given + 1));
    chain_logprobs_.resize(static_cast<size_t>(given + 1));
    chain_first_ = chain_tokens_.back();
  } else {
    // Every sample given: the last one evaluated, as a step at a time has it.
    if (ctx_.n_past() > chain_base_ + k) ctx_.rewind(chain_base_ + k);
    if (ctx_.n_past() >= ctx_.n_ctx()) return;
    ctx_.eval(&chain_first_, 1, false);
    relaunch_ = true;
    chain_tokens_.clear();
    chain_logprobs_.clear();
    chain_next_ = 0;
  }
}

void Generation::close() {
  if (over_) return;
  if (!started_) {  // the prompt's tokens given so far are in; a chunk left pending is not
    pending_.clear();
    over_ = true;
    return;
  }
  // As a step at a time leaves it: every token given evaluated.
  settle_chain(false, true);
  over_ = true;
}

void Generation::finish(StopReason reason, std::string* text) {
  settle_chain(reason == StopReason::kEos || reason == StopReason::kStop,
               reason == StopReason::kLength || reason == StopReason::kCancelled);
  reason_ = reason;
  over_ = true;
  *text += held_;
  if (reason != StopReason::kStop) *text += decoder_.flush();
  held_.clear();
}

size_t Generation::match_stops(const std::string& piece, size_t* stop_at) {
  // Every earlier byte of held_ went through the matchers, so a stop string in held_ ends in
  // the piece: its first match there is its first occurrence.
  const size_t before = held_.size() - piece.size();
  size_t keep = 0;
  *stop_at = std::string::npos;
  for (size_t i = 0; i < opt_.stop.size(); ++i) {
    const std::string& s = opt_.stop[i];
    const std::vector<uint32_t>& fail = stop_fail_[i];
    size_t k = stop_state_[i];
    for (size_t p = 0; p < piece.size() && k < s.size(); ++p) {
      while (k > 0 && s[k] != piece[p]) k = fail[k - 1];
      if (s[k] == piece[p]) ++k;
      if (k == s.size()) *stop_at = std::min(*stop_at, before + p + 1 - s.size());
    }
    stop_state_[i] = k;
    if (k < s.size()) keep = std::max(keep, k);
  }
  return keep;
}

bool Generation::next(std::string* text, GeneratedToken* token,
                      const std::function<bool()>& interrupted) {
  text->clear();
  if (token) token->id = -1;
  if (!pending_.empty())
    throw std::logic_error("generate: the pending token's logits were not fed");
  if (over_) return false;
  // A prompt partly in (a chunk a step) finds the context where its last chunk left it.
  if (!started_ && prefilled_ > 0 && ctx_.n_past() != int(prefilled_))
    throw ArgumentError("generate: the context moved while the prompt went in");
  if (!started_ && prefilled_ < prompt_.size()) {
    if (prefilled_ == 0) {
      // Prefill: keep the cached prefix the prompt shares, at least one position to recompute.
      const std::vector<int32_t>& cached = ctx_.tokens();
      size_t common = 0;
      while (common < cached.size() && common < prompt_.size() && cached[common] == prompt_[common])
        ++common;
      if (common == prompt_.size()) --common;
      if (common < size_t(ctx_.n_past())) {
        replaced_ = size_t(ctx_.n_past()) - common;
        ctx_.rewind(int(common));
      }
      prefilled_ = cached_ = common;
    }
    if (defer_ || prefill_chunk_ > 0) chain_ = 1;
    const size_t rest = prompt_.size() - prefilled_;
    const size_t n = prefill_chunk_ > 0 ? std::min(rest, size_t(prefill_chunk_)) : rest;
    if (defer_ && n <= kDeferredPrefill) {
      if (prefilled_ > 0 && ctx_.take_cancel()) {  // between chunks, as eval stops
        finish(StopReason::kCancelled, text);
        return true;
      }
      // For the caller's batch; the step after it is fed goes on from here.
      pending_.assign(prompt_.begin() + std::ptrdiff_t(prefilled_),
                      prompt_.begin() + std::ptrdiff_t(prefilled_ + n));
      prefilled_ += n;
      return true;
    }
    try {
      logits_ = ctx_.eval(prompt_.data() + prefilled_, n, false, interrupted);
    } catch (const Cancelled&) {
      // The eval changed nothing, but its first chunk took the cache rows of the history past
      // the prefix the prompt shares: those tokens are gone, and the message must say so.
      if (replaced_ == 0) throw;
      throw Cancelled(
          "generate: cancelled while the prompt went in, after it had replaced the last " +
          std::to_string(replaced_) + " tokens of the context's history: the context " +
          "now holds the prompt's first " + std::to_string(ctx_.n_past()) + " tokens");
    }
    prefilled_ += n;
    if (prefilled_ < prompt_.size()) return true;  // more of the prompt at the next step
  }
  started_ = true;
  if (ctx_.take_cancel()) {
    finish(StopReason::kCancelled, text);
    return true;
  }
  if (n_generated_ == opt_.max_tokens) {
    finish(StopReason::kLength, text);
    return true;
  }
  int32_t tok;
  float chained_logprob = NAN;
  if (chain_ > 1 && chain_first_ >= 0) {
    tok = next_chained(&chained_logprob);
  } else {
    // (With chains, the first token too: from the prompt's logits, on the host, so that the
    // prompt goes in as a step at a time puts it in. The chains start with it.)
    const std::vector<int32_t>& history = ctx_.tokens();
    if (presampled_ >= 0) {
      tok = presampled_;  // presample() drew it from these logits and this history
      presampled_ = -1;
    } else {
      tok =
          sampler_.sample(logits_.data(), int32_t(logits_.size()), history.data(), history.size());
    }
    if (chain_ > 1) {
      if (opt_.logprobs) {
        // As a token at a time computes it.
        GeneratedToken first;
        logprobs(logits_, tok, 0, &first);
        chained_logprob = first.logprob;
      }
      // As if a chain of one had evaluated the prompt's last token and sampled tok.
      chain_base_ = ctx_.n_past() - 1;
      chain_tokens_.assign(1, tok);
      chain_logprobs_.assign(1, chained_logprob);
      chain_next_ = 1;
      chain_first_ = tok;
    }
  }
  ++n_generated_;
  if (token) {
    token->id = tok;
    if (opt_.logprobs && chain_ > 1) {
      token->logprob = chained_logprob;
      token->top.clear();
    } else if (opt_.logprobs) {
      logprobs(logits_, tok, opt_.top_logprobs, token);
    } else {
      token->logprob = NAN;
      token->top.clear();
    }
  }
  if (!opt_.ignore_eos && ctx_.tokenizer().is_end_of_generation(tok)) {
    finish(StopReason::kEos, text);
    return true;
  }
  const std::string piece = decoder_.push(tok);
  held_ += piece;
  size_t stop_at;
  const size_t keep = match_stops(piece, &stop_at);
  if (stop_at != std::string::npos) {
    held_.resize(stop_at);  // the text before the first stop string found
    finish(StopReason::kStop, text);
    return true;
  }
  if (held_.size() > keep) {
    const size_t cut = utf8_boundary(held_, held_.size() - keep);
    *text = held_.substr(0, cut);
    held_.erase(0, cut);
  }
  // (A chain has evaluated ahead: the position a step at a time would be at.)
  const int n_past = chain_ > 1 ? chain_base_ + static_cast<int>(chain_next_) : ctx_.n_past();
  if (n_past >= ctx_.n_ctx()) {
    std::string tail;
    finish(StopReason::kContextFull, &tail);
    *text += tail;
    return true;
  }
  if (defer_) {
    pending_.assign(1, tok);
  } else if (chain_ == 1) {
    logits_ = ctx_.eval(&tok, 1, false);
  }
  return true;
}

void Generation::feed(const float* logits, size_t n) {
  if (pending_.empty()) throw std::logic_error("generate: no token waits for its logits");
  if (n != size_t(ctx_.n_vocab()))
    throw ArgumentError("generate: fed " + std::to_string(n) + " logits, expected " +
                        std::to_string(ctx_.n_vocab()));
  logits_.assign(logits, logits + n);
  pending_.clear();
  presampled_ = -1;
}

void Generation::presample() {
  // (Once the prompt is in: the step that takes its logits begins the generation.)
  if (!pending_.empty() || over_ || prefilled_ < prompt_.size() || chain_ > 1 || presampled_ >= 0)
    return;
  const std::vector<int32_t>& history = ctx_.tokens_of(seq_);
  try {
    presampled_ =
        sampler_.sample(logits_.data(), int32_t(logits_.size()), history.data(), history.size());
  } catch (const ArgumentError&) {
    presampled_ = -1;  // (no draw was taken) next() samples again and reports it for this one
  }
}

}  // namespace ggraph
