// A loaded model with its KV cache and backend: what Model in Python and ggraph_model in C wrap.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "backend.h"
#include "gguf.h"
#include "kv_cache.h"
#include "model.h"
#include "sampling.h"
#include "tokenizer.h"

namespace ggraph {

// The most CPU threads a context takes (more are refused, not clamped).
constexpr int kMaxThreads = 1024;

// ContextOptions::n_ctx's default: 2048 tokens, or the model's training context if shorter.
constexpr int kDefaultContext = -1;
constexpr int kDefaultContextTokens = 2048;

struct ContextOptions {
  std::string device = "auto";  // cpu | cuda | cuda:N | auto
  // Tokens; 0 = the model's training context; kDefaultContext = 2048, or the training context
  // where that is shorter (what a caller who did not choose gets).
  int n_ctx = kDefaultContext;
  // Past the model's training context (its <arch>.context_length) only when allowed: the
  // model has never seen such positions, so quality usually drops.
  bool allow_longer_context = false;
  // The KV cache's element type: f32 | f16 | q8_0 | auto (f32 on the CPU, f16 on CUDA).
  std::string kv_type = "auto";
  int n_threads = 0;  // CPU threads; 0 = all cores
  int n_batch = 512;  // most tokens per graph; longer inputs are split
  std::string cuda_graphs = "patch";
  bool cuda_graph_debug = false;
  bool use_mmap = true;  // false: read the file into memory (see GGUFFile::open)
  // Sequences the context holds at once, each with its own KV cache of n_ctx rows, all
  // allocated at load: sequence 0 is always open; open_sequence hands out the others.
  int n_seq_max = 1;
  // Sliding-window layers keep only their window and one batch (window + n_batch - 1 rows, a
  // ring) unless swa_full: then every position's rows, as the global layers do. A ring costs a
  // re-evaluation of the kept tokens where a rewind, a cancelled eval or a loaded state needs
  // rows it has overwritten.
  bool swa_full = false;
};

// The most sequences a context holds.
constexpr int kMaxSequences = 256;

// Why ggraph cannot run the model file at `path` (an unsupported architecture, tensor format or
// key, a malformed file, a vocabulary it cannot read), or "" when it can. Reads the metadata and
// checks every tensor as loading would, without loading weights.
std::string check_model_file(const std::string& path);

class Context {
 public:
  Context(const std::string& path, const ContextOptions& options);
  ~Context();

  // Appends tokens to the context and returns logits: the last position's (n_vocab) or, with
  // all_logits, every position's (n_tokens x n_vocab). Throws ArgumentError, leaving the
  // context unchanged, for an empty list, an id outside [0, n_vocab) or a context overflow.
  // A long input runs in chunks of n_batch tokens; before each chunk after the first the eval
  // stops, throwing Cancelled and leaving the context unchanged, if cancel() was called (and not
  // cleared) or `interrupted` (when given) returns true.
  std::vector<float> eval(const int32_t* tokens, size_t n_tokens, bool all_logits,
                          const std::function<bool()>& interrupted = nullptr);
  // The most decode steps one sampled chain runs (decode_sampled).
  static constexpr int kMaxChain = 16;
  // Beyond kMaxChain, a launch runs rounds of a chain of kLoopChain steps (Op::ChainLoop), up to
  // kMaxLaunch tokens, on a backend that runs loops (Backend::runs_loops).
  static constexpr int kLoopChain = 8;
  static constexpr int kMaxLaunch = 256;
  // The positions a loop of k tokens runs through: its whole rounds, a last one that ends
  // part-way included (its skipped steps' positions must fit the context too).
  static constexpr int loop_positions(int k) {
    return (k + kLoopChain - 1) / kLoopChain * kLoopChain;
  }
  // Decodes `first` (the token after the context's last) and k - 1 tokens more in one graph
  // (one CUDA graph launch), each step sampling the next step's token on the backend by
  // `params` with `seed` (not kRandomSeed) from draw index `draw` on (the Sample op); only the
  // sampled tokens and their log-probabilities (under the raw logits) come back, into
  // tokens[k] and logprobs[k]. The context then holds `first` and the first k - 1 samples; the
  // last sample is not evaluated yet. Throws ArgumentError, leaving the context unchanged, for
  // a bad id, k outside [1, kMaxChain] (kMaxLaunch where the backend runs loops), or k tokens
  // that do not fit; and when a step finds no logit above -inf (then the context holds the
  // tokens that step and those before evaluated). k above kMaxChain (where the backend runs
  // loops) runs rounds of a chain of kLoopChain steps in one launch, the last one ended at the
  // k-th token on the device, as that many calls one after the other would, each from the last
  // one's last sample and draws; its whole rounds' positions must fit the context. as_loop
  // (where the backend runs loops) runs any k as a loop where they fit, so that launches of
  // every length share one graph.
  // After a step samples one of the n_stops ids `stops`, the backend may skip the steps after it
  // (CUDA graphs do): returns the samples made, k or fewer, the last of them then a stop id; the
  // context holds `first` and the samples before the last.
  int decode_sampled(int32_t first, int k, const SamplingParams& params, uint64_t seed,
                     uint64_t draw, int32_t* tokens, float* logprobs,
                     const int32_t* stops = nullptr, size_t n_stops = 0);
  // decode_sampled in parts, for a caller that takes a loop's tokens as its rounds make them:
  // launch_sampled checks and launches as decode_sampled does (on CUDA it returns while the
  // launch runs); poll_sampled waits for the launch's tokens past the first `have` and copies
  // them into tokens[have, n) and logprobs[have, n), returning n, or returns -1 once no more
  // will come before the end (a launch that does not stream them, or whose last round or a
  // failed step came); land_sampled waits for the end and returns what decode_sampled returns
  // (tokens and logprobs take all of them). halt_sampled asks a loop to end after its round in
  // progress: land_sampled then returns fewer tokens, whole rounds of them. While a launch is in
  // flight a cancel request (cancel()) halts it too, and stays pending. Every other call that
  // changes the context lands the launch first, keeping its result for land_sampled: another
  // sequence's launch too (its sequence keeps the result until its own next launch), so that
  // generations on several sequences may take turns. launch_sampled returns the launch's id,
  // which the other three take.
  uint64_t launch_sampled(int32_t first, int k, const SamplingParams& params, uint64_t seed,
                          uint64_t draw, const int32_t* stops = nullptr, size_t n_stops = 0,
                          bool as_loop = false);
  int poll_sampled(uint64_t launch, int have, int32_t* tokens, float* logprobs);
  void halt_sampled(uint64_t launch);
  int land_sampled(uint64_t launch, int32_t* tokens, float* logprobs);
  // The final normalized hidden state of every one of n tokens, [n][n_embd], as llama.cpp's
  // embedding mode computes it: the tokens are evaluated as a sequence of their own, from
  // position 0. The context's own tokens and cache are kept (saved and restored around it).
  std::vector<float> embed(const int32_t* tokens, size_t n);
  int64_t n_embd() const { return model_->n_embd; }
  // Asks the operation in progress (an eval: at its next chunk; a Generation: at its next
  // step) to stop; any thread may call it at any time (lock-free). Requests are counted per
  // sequence: an operation stops for those made after the count it was armed with. A caller
  // reads the count (cancel_epoch, lock-free) when its call begins, before it waits for the
  // context, and arms the operation with it (arm_cancel), so that a cancel made while the call
  // waits stops it; clear_cancel arms with the count as it is now (older requests are stale).
  // take_cancel consumes a pending request. cancel(seq) stops that sequence's operation only
  // (ignored for a sequence the context does not have); the others act on the selected one.
  void cancel(int seq = 0) {
    if (seq >= 0 && seq < n_seq_max())
      cancels_[size_t(seq)].fetch_add(1, std::memory_order_relaxed);
  }
  uint64_t cancel_epoch(int seq) const {
    return seq >= 0 && seq < n_seq_max() ? cancels_[size_t(seq)].load(std::memory_order_relaxed)
                                         : 0;
  }
  void arm_cancel(uint64_t epoch) { armed_[size_t(cur_)] = epoch; }
  void clear_cancel() { arm_cancel(cancel_epoch(cur_)); }
  bool take_cancel() {
    const uint64_t now = cancel_epoch(cur_);
    if (now == armed_[size_t(cur_)]) return false;
    armed_[size_t(cur_)] = now;
    return true;
  }
  void reset() {
    land();
    live().n_past = 0;
    live().kv_lost = 0;
    live().tokens.clear();
  }
  // Forgets every position from n on (keeps the first n tokens of the cache). Where sliding-
  // window rings have overwritten rows the next step needs, that step first re-evaluates the n
  // tokens kept.
  void rewind(int n) {
    land();
    if (n < 0 || n > live().n_past)
      throw ArgumentError("rewind: expected a position in [0, " + std::to_string(live().n_past) +
                          "], got " + std::to_string(n));
    live().n_past = n;
    live().tokens.resize(size_t(n));
  }
  // The context's state: its tokens and their KV cache rows, in a versioned binary format that
  // names the model it belongs to (a fingerprint of its file: size, tensor table, weight samples)
  // and the cache's element type. load_state checks all of it before it changes anything, and
  // throws ArgumentError naming what does not match.
  std::vector<uint8_t> save_state() const;
  // The most bytes a state of this context takes (every position of the context held).
  size_t max_state_bytes() const;
  void load_state(const uint8_t* data, size_t size);
  // load_state of the file open at descriptor fd (named path in errors): refused, unread, where
  // it is not a regular file (a device or a pipe could feed bytes without end) or holds more
  // than max_state_bytes.
  void load_state_file(int fd, const std::string& path);
  // Replaces the selected sequence's tokens and KV cache with the first n of open sequence
  // `from` (another one), copying the rows on the device: a prompt's prefix that another
  // sequence holds, without evaluating it again or passing through the host. Throws
  // ArgumentError, changing nothing, for a sequence that is not open or is this one, n past
  // its tokens, or a model with sliding-window layers (their rings keep other positions).
  void copy_prefix(int from, int n);
  // The tokens the KV cache holds, in order (n_past of them).
  const std::vector<int32_t>& tokens() const { return live().tokens; }
  // Those of sequence seq, selected or not (an open one).
  const std::vector<int32_t>& tokens_of(int seq) const { return seqs_[size_t(seq)].tokens; }

  // Sequences: independent token histories and KV caches over the same weights. Every call
  // above works on the selected one. open_sequence takes a free one (empty) and returns its id,
  // throwing ArgumentError when all n_seq_max are open; close_sequence frees one (not 0);
  // select_sequence makes an open one current.
  int open_sequence();
  // The next token of each of n open, distinct sequences (seqs[i] takes tokens[i]), in one
  // step: the weights are read once for all of them. Returns each one's logits, [n][n_vocab],
  // and leaves the sequence selected before. Checks every id, sequence and remaining context
  // before anything changes. One graph serves every batch of n tokens (on CUDA, one executable).
  // out takes decode_batch_rows(n) rows of n_vocab: the logits, then the padding tokens' rows
  // of the last batch's size class (scratch), so that they are copied once, into the caller's
  // memory. With `repeats`, a sequence may take several tokens, in order at its next
  // positions (each token's queries see the tokens before it in the batch): a server's batch
  // carries new prompts' tokens beside the running sequences' next ones. With `last_only`
  // (n at most n_batch), out's first rows are the logits of each sequence's last token only,
  // in the order of those tokens (a caller that gives each sequence's tokens together knows
  // row r as its r-th sequence's): the CPU computes no others (a prompt's tokens need none).
  void decode_batch(const int* seqs, const int32_t* tokens, size_t n, float* out,
                    bool repeats = false, bool last_only = false);
  size_t decode_batch_rows(size_t n) const;
  // The most tokens a server's step puts in one decode_batch call: the largest size class on
  // CUDA (a longer batch builds a graph of its own size), at most n_batch. The buffers are sized
  // at load for a batch of that many.
  size_t decode_batch_span() const;
  void close_sequence(int id);
  void select_sequence(int id);
  int sequence() const { return cur_; }
  int n_seq_max() const { return static_cast<int>(seqs_.size()); }
  int n_seq_open() const;

  int n_past() const { return live().n_past; }
  // Sequence seq's position (an id decode_batch takes).
  int n_past_of(int seq) const { return seqs_.at(size_t(seq)).n_past; }
  int n_ctx() const { return n_ctx_; }
  // Bytes of one sequence's KV cache (every layer's K and V; rings are smaller).
  size_t kv_bytes() const { return live().kv.bytes(); }
  int n_ctx_train() const { return model_->n_ctx_train; }
  // The KV cache's element type as ContextOptions::kv_type names it ("f16").
  std::string kv_type() const;
  int n_vocab() const { return model_->n_vocab; }
  const GGUFFile& file() const { return *file_; }
  const Model& model() const { return *model_; }
  Backend& backend() { return *backend_; }
  const Tokenizer& tokenizer() const;  // throws GGUFError when the file has no usable vocabulary
  const std::string& device() const { return device_; }

 private:
  // A planned step graph of one batch shape over the selected sequence's cache, and the host
  // inputs its input tensors point at.
  struct StepGraph {
    std::unique_ptr<Graph> graph;
    int tokens = 0, outputs = 0, n_past = 0;
    std::vector<int32_t> in_tokens, in_positions, in_out_ids;
    uint64_t used = 0;  // when it last ran (Sequence::clock)
  };
  // Builds step's graph (into step.graph's place, not yet planned) for n_tokens tokens at n_past.
  void build(StepGraph& step, Graph& graph, int n_tokens, int n_outputs, int n_past,
             bool embeddings = false);
  // The graph of one token of each of m sequences, planned, and its host inputs: it depends on
  // m alone, so that a step of any m sequences at any positions runs it after set_decode_inputs.
  struct DecodeInputs {
    std::vector<int32_t> tokens, positions, out_ids, slots;
  };
  // A batch of m tokens, n_out of which give logits (out_ids, first n_out tokens until set).
  void build_decode_batch(Graph& graph, size_t m, DecodeInputs& in, size_t n_out) const;
  // Token i of `tokens` goes to sequence seqs[i] at its position (the first m of the inputs;
  // the rest pad).
  void set_decode_inputs(DecodeInputs& in, const int* seqs, const int32_t* tokens, size_t m) const;
  // Grows the backend's reserved buffers to fit `graph` (planned), where it needs more.
  void fit_reserved(const Graph& graph);
  // Copies the KV rows of positions [0, n_rows) of every layer, K then V, to or from `host`
  // (2 * n_layer * n_rows rows).
  size_t kv_rows_bytes(size_t n_rows) const;
  void kv_rows_to_host(uint8_t* host, size_t n_rows) const;
  void kv_rows_from_host(const uint8_t* host, size_t n_rows);
  // Layer l's rows of positions [first, end), K's then V's, as runs of consecutive rows (a
  // ring's wrap around): fn(run's first row, its offset in the positions' bytes, its bytes).
  void kv_runs(int l, int first, int end,
               const std::function<void(void* cache, size_t offset, size_t bytes)>& fn) const;

  std::unique_ptr<GGUFFile> file_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<Tokenizer> tokenizer_;  // read at load; null when the file has none
  std::string tokenizer_error_;           // why tokenizer() cannot give one
  int n_ctx_ = 0;
  int n_batch_ = 0;
  std::string device_;
  // Sliding-window rings: the largest window of a windowed layer (0: none) and the rows of
  // every windowed layer's ring (0: no rings). A step at position p needs every windowed
  // layer's rows from p - window + 1 on (Sequence::kv_lost).
  int swa_window_ = 0, ring_rows_ = 0;
  // Positions [.., end) are about to be written: ring rows of positions before end - ring_rows_
  // are overwritten.
  static void note_written(int& lost, int end, int ring_rows) {
    if (ring_rows > 0) lost = std::max(lost, end - ring_rows);
  }
  bool needs_repair() const {
    return live().kv_lost > std::max(0, live().n_past - swa_window_ + 1);
  }
  // Re-evaluates the selected sequence's tokens from position 0 (needs_repair); stopped or
  // failed, it leaves them to be re-evaluated again.
  void repair(const std::function<bool()>& interrupted = nullptr);
  // Plans a graph's memory, with room for the backend to fold norms where it does.
  void plan_graph(Graph& graph) const;
  std::unique_ptr<std::atomic<uint64_t>[]> cancels_;  // requests made, per sequence (cancel)
  std::vector<uint64_t> armed_;  // the count each sequence's operation stops past
  // A sampled chain's graph (decode_sampled) and the host inputs its input tensors point at:
  // the first token, each step's position, the sampling config; n_past, the position it was
  // built or last shifted for.
  struct ChainStep {
    std::unique_ptr<Graph> graph;
    int n_past = 0;
    std::vector<int32_t> first, positions, out_ids, config;
    std::vector<int32_t> control;  // a loop's (Op::ChainLoop): its rounds, then 0
  };
  // Every sequence's cache and history; every call works on the selected one, live().
  struct Sequence {
    KvCache kv;
    int n_past = 0;
    // The position below which a windowed layer may lack rows (written over by later
    // positions, or absent from a loaded state).
    int kv_lost = 0;
    std::vector<int32_t> tokens;
    bool open = false;
    // Its last steps' planned graphs (over its own cache), of two batch shapes at most: a step
    // of one of those shapes reuses its graph, shifted to the new position, instead of building
    // and planning again, so that a prompt's chunks and the one-token steps of the generation
    // after it each keep theirs.
    StepGraph steps[2];
    uint64_t clock = 0;
    // Its sampled chains' graphs (decode_sampled) by steps, penalty window and whether they
    // loop, each reused as the step graph is, with the host inputs it points at.
    std::map<std::tuple<int, int, bool>, ChainStep> chains;
  };
  std::vector<Sequence> seqs_;
  int cur_ = 0;
  Sequence& live() { return seqs_[size_t(cur_)]; }
  const Sequence& live() const { return seqs_[size_t(cur_)]; }
  // A sequence's position, and a token appended to it.
  int past_of(int seq) const { return seqs_[size_t(seq)].n_past; }
  void append_token(int seq, int32_t token);
  // The size class a decode batch of m tokens runs in: on CUDA the next of 1, 2, 4, ..., 64
  // (at most n_batch), so that one executable serves every batch of its class, the tokens past
  // m padding (sequence -1); elsewhere m itself.
  size_t batch_class(size_t m) const;
  // decode_batch's graph of each size class and the host inputs its input tensors point at: the
  // next batch of the class runs it again with new inputs.
  struct BatchStep {
    std::unique_ptr<Graph> graph;
    DecodeInputs in;
    size_t n_out = 0;  // the tokens that give logits (the CPU's last_only batches: fewer)
  };
  std::map<size_t, BatchStep> batch_steps_;
  uint64_t fingerprint_ = 0;        // of the model file and weight samples, for saved states
  uint64_t table_fingerprint_ = 0;  // of the file's size and tensor table (states before v3)
  size_t reserved_scratch_ = 0, reserved_inputs_ = 0;  // what the backend's buffers hold
  void* chain_tokens_ = nullptr;  // backend memory of the chains' sampled tokens (2 kMaxChain)
  void* loop_tokens_ = nullptr;   // and of a chain loop's (1 + 2 kMaxLaunch)
  // The sampled launch in flight (launch_sampled to land_sampled), and once landed its result.
  struct Flight {
    bool active = false, landed = false, loop = false;
    uint64_t id = 0;  // launch_sampled's
    int seq = 0, k = 0, steps = 0, n_past = 0;
    int32_t first = 0;
    std::vector<float> out;  // the launch's token words, as the backend's output
    int done = 0;            // once landed: the samples made
    std::string error;       // once landed: why a step's sample failed (ArgumentError)
    // A chain's words in out (k tokens, then their log-probabilities at kMaxChain), or a
    // loop's (how many, then kMaxLaunch tokens, then their log-probabilities).
    const int32_t* tokens() const {
      return reinterpret_cast<const int32_t*>(out.data()) + (loop ? loop_token_word(0) : 0);
    }
    const float* logprobs() const {
      return out.data() + (loop ? loop_logprob_word(kMaxLaunch, 0) : kMaxChain);
    }
  };
  Flight flight_;
  uint64_t launches_ = 0;  // launch_sampled's so far: the ids
  // A sequence's landed launch whose tokens its caller had not taken when another launch took
  // the context's flight (launch_sampled).
  std::vector<Flight> untaken_;
  // Waits for the launch in flight and takes its tokens into the sequence's history and
  // position, as decode_sampled does; the result stays in flight_ for land_sampled.
  void land();
};

}  // namespace ggraph
