// The generation loop, shared by Python's Model.generate and the C API's ggraph_generate: the
// prompt's prefill (reusing the prefix the KV cache already holds), then a token at a time:
// sample, check for the end of generation, decode the text as it becomes whole UTF-8, hold back
// what could begin a stop string, evaluate.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "context.h"
#include "sampling.h"
#include "tokenizer.h"

namespace ggraph {

// The most alternatives a step reports with their log-probabilities.
constexpr int kMaxTopLogprobs = 20;
constexpr int kAutoChain = -1;
constexpr int kDefaultChain = 8;

struct GenerateOptions {
  int max_tokens = 128;           // >= 0
  std::vector<std::string> stop;  // non-empty strings; the text ends before the first found
  SamplingParams sampling;
  int top_logprobs = 0;  // 0 to kMaxTopLogprobs alternatives a step
  // The sampled token's log-probability (a softmax over the vocabulary each step); without it
  // GeneratedToken::logprob is NaN and top_logprobs must be 0.
  bool logprobs = true;
  // An end-of-generation token is generated as any other (its text, if any, is given) instead
  // of ending the generation: for benchmarks that need exactly max_tokens tokens.
  bool ignore_eos = false;
  // Decode steps a backend launch runs, each sampling the next step's token on the backend
  // (Context::decode_sampled), so that only token ids come back: kAutoChain takes
  // Context::kMaxLaunch where the backend runs loops, else kDefaultChain on CUDA and 1 on the
  // CPU; 1 evaluates and samples a token at a time on the host. Up to Context::kMaxLaunch where
  // the backend runs loops (CUDA graphs in patch and recapture modes; their tokens are read as
  // the rounds write them: Context::poll_sampled), past Context::kMaxChain elsewhere a chain's
  // most. A chain needs top_logprobs 0 and is not used in deferred (batched) generation; what a
  // stop leaves unused is rewound.
  int chain = kAutoChain;
};

enum class StopReason { kNone, kEos, kStop, kLength, kContextFull, kCancelled };
// "eos", "stop", "length", "context_full", "cancelled"; "" for none.
const char* stop_reason_name(StopReason r);

// A sampled token with its log-probability under the raw logits (before penalties and
// temperature) and, when asked for, the most likely alternatives, descending.
struct GeneratedToken {
  int32_t id = -1;
  float logprob = 0.0f;
  std::vector<std::pair<int32_t, float>> top;
};

class Generation {
 public:
  // Checks everything before the context changes: ids in range, a prompt that is non-empty and
  // leaves room in the context, the options. The prefill runs at the first next(). Clears a
  // stale cancel request: Context::cancel() from then on stops the generation at its next step
  // (stop reason kCancelled), or a long prefill between chunks (Cancelled is thrown, or a
  // deferred generation ends as cancelled; the context keeps the prefix it shares with the
  // prompt).
  Generation(Context& ctx, std::vector<int32_t> prompt, GenerateOptions options);
  // A launch still in flight is halted and landed (its tokens past those given stay in the
  // context, as they do after settle()).
  ~Generation();
  Generation(const Generation&) = delete;
  Generation& operator=(const Generation&) = delete;

  // One step: at most one token. Returns false once the generation is over and its text all
  // given; otherwise true, with the text that became final (often empty: held back or not yet
  // whole UTF-8) and, when the step sampled one, the token in *token (token->id -1 otherwise).
  // `interrupted` (when given) may stop a long prefill between chunks (Context::eval).
  bool next(std::string* text, GeneratedToken* token = nullptr,
            const std::function<bool()>& interrupted = nullptr);

  // Deferred evaluation, for a caller that steps several generations together: after a step
  // that sampled a token to continue with, next() leaves it unevaluated (pending_tokens()); the
  // caller evaluates it (Context::decode_batch, beside other sequences' tokens) and hands its
  // logits to feed() before the next next(). A prompt's chunks of at most kDeferredPrefill
  // tokens are left the same way, in order (decode_batch with repeats), the last one's logits
  // fed; a longer chunk goes in at once through the context's prompt path.
  void set_defer(bool defer) { defer_ = defer; }
  static constexpr size_t kDeferredPrefill = 64;
  // Chunked prefill: each next() evaluates at most `tokens` of the prompt (0, the default: all
  // of it at the first), giving no text until the prompt is in; a caller stepping several
  // generations keeps the others going while a long prompt goes in.
  void set_prefill_chunk(int tokens) { prefill_chunk_ = tokens > 0 ? tokens : 0; }
  // The tokens waiting for their evaluation, in order (a prompt's chunk, or one sampled token);
  // pending_token() is the last, or -1 for none.
  const std::vector<int32_t>& pending_tokens() const { return pending_; }
  int32_t pending_token() const { return pending_.empty() ? -1 : pending_.back(); }
  // The logits of the last pending token.
  void feed(const float* logits, size_t n);
  // Samples the next token from the fed logits now, for next() to take: what next() would
  // sample, the same token and draw. Touches only this generation's sampler and its sequence's
  // history (the selected sequence need not be its own), so that a caller may presample several
  // generations of one context on several threads at once, with nothing else using the context.
  void presample();

  // Ends a generation whose caller stops stepping it before it is over (a loop left early):
  // the context keeps what a step at a time would have left, every token given evaluated (a
  // chain may have evaluated tokens past them). next() then returns false.
  void close();

  // Leaves the context as a step at a time would have it after the tokens given so far, where a
  // chain evaluated past them, without ending the generation: next() goes on with the tokens it
  // would have given (the same draws). For a caller that reads or changes the context between
  // steps (Python's Model, while a loop broken out of keeps its generator); needs the
  // generation's sequence selected.
  void settle();

  StopReason stop_reason() const { return reason_; }
  int n_generated() const { return n_generated_; }
  // Prompt tokens the cache already held (the prefix it shares with the prompt, kept rather
  // than evaluated again); 0 until the prompt starts going in.
  size_t cached_tokens() const { return cached_; }
  // The context's sequence this generation runs on (selected when it began).
  int sequence() const { return seq_; }

 private:
  void finish(StopReason reason, std::string* text);
  // The next sampled token of a chain, launching one when none is left; a launch's tokens are
  // taken as its rounds make them (Context::poll_sampled).
  int32_t next_chained(float* logprob);
  void launch_chain();
  // Ends the launch in flight (halted first when `halt`) and takes all its tokens.
  void land_chain(bool halt);
  // Rewinds what the last launch evaluated past the tokens given (and past the stopping one,
  // when `stopped`); with evaluate_last, evaluates the last token given where the launch did
  // not.
  void settle_chain(bool stopped, bool evaluate_last);

  Context& ctx_;
  std::vector<int32_t> prompt_;
  GenerateOptions opt_;
  Sampler sampler_;
  StreamDecoder decoder_;
  std::vector<float> logits_;
  std::string held_;  // decoded text held back while it could begin a stop string
  // Per stop string: its prefix function (Knuth-Morris-Pratt) and the longest of its prefixes
  // that the decoded text ends with, so that only text that may begin a stop string is held.
  std::vector<std::vector<uint32_t>> stop_fail_;
  std::vector<size_t> stop_state_;
  // Feeds the piece just added to held_ to the stop strings' matchers: *stop_at is where the
  // first stop string found in held_ begins (npos: none), and the result the bytes at its end
  // that may begin one (the longest matched prefix of a string not yet found).
  size_t match_stops(const std::string& piece, size_t* stop_at);
  bool started_ = false, over_ = false;
  bool defer_ = false;
  int prefill_chunk_ = 0;
  size_t prefilled_ = 0;          // prompt tokens in the cache so far (once the prefix is settled)
  size_t cached_ = 0;             // of them, those the cache held before (cached_tokens)
  size_t replaced_ = 0;           // history tokens past the shared prefix that the prompt rewound
  std::vector<int32_t> pending_;  // tokens left for the caller to evaluate (deferred)
  int seq_ = 0;                   // the context's sequence this generation runs on
  int32_t presampled_ = -1;       // presample()'s token, for the next next(); -1: none
  // Chains: the steps a launch runs (1: none); the last launch's samples not handed out yet
  // (chain_tokens_[chain_next_..]); the token that starts the next launch once they are. While
  // a launch is in flight (in_flight_), chain_tokens_ holds those it has made so far and
  // flight_tokens_ has room for all it may make.
  int chain_ = 1;
  std::vector<int32_t> chain_tokens_;
  std::vector<float> chain_logprobs_;
  bool in_flight_ = false;
  uint64_t launch_ = 0;  // the launch's id (Context::launch_sampled)
  std::vector<int32_t> flight_tokens_;
  std::vector<float> flight_logprobs_;
  size_t chain_next_ = 0;
  int32_t chain_first_ = -1;  // -1 until the first token is sampled (on the host)
  // The context's n_past before the last launch (for the first token, one less than after the
  // prompt: as if a chain of one had evaluated the prompt's last token).
  int chain_base_ = 0;
  // settle() evaluated the last launch's last sample, which the next launch evaluates again
  // from its own position.
  bool relaunch_ = false;
  StopReason reason_ = StopReason::kNone;
  int n_generated_ = 0;
};

}  // namespace ggraph
