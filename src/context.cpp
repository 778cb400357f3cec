#include "context.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <numeric>
#include <thread>

#include "planner.h"

namespace ggraph {

static std::unique_ptr<Backend> make_backend(const ContextOptions& o, std::string* device) {
  std::string d = o.device;
  if (d == "auto") d = cuda_devices().empty() ? "cpu" : "cuda";
  if (d == "cpu") {
    *device = "cpu";
    return make_cpu_backend(o.n_threads);
  }
  if (d == "cuda" || d.rfind("cuda:", 0) == 0) {
    CudaOptions c;
    if (d.size() > 5) {
      try {
        c.device = std::stoi(d.substr(5));
      } catch (const std::exception&) {
        throw ArgumentError("device '" + d + "': expected cuda:N with N a GPU index");
      }
    }
    c.graphs = o.cuda_graphs;
    c.debug = o.cuda_graph_debug;
    if (!cuda_compiled())
      throw ArgumentError("device '" + d + "': this build of ggraph has no CUDA backend");
    *device = "cuda:" + std::to_string(c.device);
    return make_cuda_backend(c);
  }
  throw ArgumentError("device '" + o.device + "': expected 'cpu', 'cuda', 'cuda:N' or 'auto'");
}

namespace {

// The KV cache's element types, by the names ContextOptions::kv_type takes.
constexpr struct {
  const char* name;
  DType type;
} kKvTypes[] = {{"f32", DType::F32}, {"f16", DType::F16}, {"q8_0", DType::Q8_0}};

// "auto": F16 on every device, as llama.cpp keeps its cache: half the memory of F32, and on the
// CPU decode at depth reads half the bytes (its attention converts F16 rows as it loads them,
// exactly; BENCHMARKS.md, "the attention's values over an F16 cache").
DType kv_type_from_name(const std::string& name) {
  if (name == "auto") return DType::F16;
  for (const auto& t : kKvTypes)
    if (name == t.name) return t.type;
  throw ArgumentError("kv_type: expected 'auto', 'f32', 'f16' or 'q8_0', got '" + name + "'");
}

// A backend that keeps nothing: loading a model through it checks names, shapes, types and keys.
class CheckBackend final : public Backend {
 public:
  std::string name() const override { return "check"; }
  void* upload_weight(const void* host, size_t, DType, int64_t, int64_t,
                      const std::string&) override {
    return const_cast<void*>(host);
  }
  void* alloc_kv(size_t) override { return nullptr; }
  void reserve(size_t, size_t) override {}
  void compute(const Graph&, float*) override {
    throw std::logic_error("check backend: nothing to compute");
  }
};

// The tokenizer's ids are the model's rows: a vocabulary of another size gives ids the model
// has no row for (an end-of-generation token it never samples), or rows no token reaches.
void check_vocab(const Tokenizer& tok, const Model& model) {
  if (tok.n_vocab() != model.n_vocab)
    throw GGUFError("tokenizer.ggml.tokens has " + std::to_string(tok.n_vocab()) +
                    " tokens but token_embd.weight has " + std::to_string(model.n_vocab) +
                    " rows: expected one token a row");
}

}  // namespace

std::string check_model_file(const std::string& path) {
  try {
    auto file = GGUFFile::open(path);
    CheckBackend backend;
    const auto model = load_model(*file, backend);
    check_vocab(*Tokenizer::from_gguf(*file), *model);
  } catch (const GGUFError& e) {
    return e.what();
  }
  return "";
}

Context::Context(const std::string& path, const ContextOptions& o) {
  if (o.n_ctx < 0 && o.n_ctx != kDefaultContext)
    throw ArgumentError("n_ctx must be >= 0 (0: the training context), or " +
                        std::to_string(kDefaultContext) + " for the default, got " +
                        std::to_string(o.n_ctx));
  if (o.n_batch < 1) throw ArgumentError("n_batch must be >= 1, got " + std::to_string(o.n_batch));
  if (o.cuda_graphs != "off" && o.cuda_graphs != "recapture" && o.cuda_graphs != "update" &&
      o.cuda_graphs != "patch")
    throw ArgumentError("cuda_graphs: expected 'off', 'recapture', 'update' or 'patch', got '" +
                        o.cuda_graphs + "'");
  if (o.n_threads < 0 || o.n_threads > kMaxThreads)
    throw ArgumentError("n_threads must be 0 (automatic) to " + std::to_string(kMaxThreads) +
                        ", got " + std::to_string(o.n_threads));
  const DType kv_type = kv_type_from_name(o.kv_type);  // a bad name fails before the file is read
  file_ = GGUFFile::open(path, o.use_mmap);
  backend_ = make_backend(o, &device_);
  // The CUDA kernels read F16 and Q8_0 caches.
  if (backend_->is_cuda() && kv_type != DType::F16 && kv_type != DType::Q8_0)
    throw ArgumentError("kv_type '" + o.kv_type +
                        "' is not supported on CUDA; use 'f16' or 'q8_0'");
  model_ = load_model(*file_, *backend_);
  // The vocabulary is read and checked now: a broken one fails the load, not a later call. A
  // file without one (weights only) loads, and tokenizing with it says why it cannot.
  if (file_->has("tokenizer.ggml.model")) {
    tokenizer_ = Tokenizer::from_gguf(*file_);
    check_vocab(*tokenizer_, *model_);
  } else
    tokenizer_error_ = file_->path() + ": the file has no tokenizer (no 'tokenizer.ggml.model')";
  // Attention reads one head's slice of a row: with Q8_0 each head must be whole blocks.
  const int64_t block = type_traits(kv_type).block_size;
  if (model_->head_dim % block != 0)
    throw ArgumentError("kv_type '" + o.kv_type + "' stores blocks of " + std::to_string(block) +
                        " values, and this model's attention heads are " +
                        std::to_string(model_->head_dim) + " wide (not a multiple of " +
                        std::to_string(block) + "); use 'f16' or 'f32'");
  // CUDA stages a head's Q8_0 blocks with 4-byte copies: a head must be an even number of them.
  if (backend_->is_cuda() && kv_type == DType::Q8_0 && model_->head_dim % 64 != 0)
    throw ArgumentError(
        "kv_type 'q8_0' on CUDA needs attention heads a multiple of 64 wide; "
        "this model's are " +
        std::to_string(model_->head_dim) + "; use 'f16'");
  if (o.n_ctx > model_->n_ctx_train && model_->n_ctx_train > 0 && !o.allow_longer_context)
    throw ArgumentError(
        "n_ctx " + std::to_string(o.n_ctx) + " is longer than the model's training context of " +
        std::to_string(model_->n_ctx_train) + " tokens (" + model_->arch +
        ".context_length); ask for " + std::to_string(model_->n_ctx_train) +
        " or fewer (n_ctx 0 means the training length), or set allow_longer_context to run " +
        "past it (quality usually drops beyond the training length)");
  // FNV-1a over the file's size and tensor table (states of format versions 1 and 2), and
  // over those and samples of each tensor's bytes, 16 runs of 16 spread over it (version 3: a
  // fine-tune of the same layout differs there): what a saved state must have been made with.
  table_fingerprint_ = 1469598103934665603ull;
  auto mix = [](uint64_t& h, const void* p, size_t n) {
    for (size_t i = 0; i < n; ++i) {
      h ^= static_cast<const uint8_t*>(p)[i];
      h *= 1099511628211ull;
    }
  };
  const uint64_t file_size = file_->file_size();
  mix(table_fingerprint_, &file_size, sizeof file_size);
  for (const GGUFTensorInfo& t : file_->tensors()) {
    mix(table_fingerprint_, t.name.data(), t.name.size());
    mix(table_fingerprint_, t.ne, sizeof t.ne);
    mix(table_fingerprint_, &t.type, sizeof t.type);
  }
  fingerprint_ = table_fingerprint_;
  for (const GGUFTensorInfo& t : file_->tensors()) {
    constexpr size_t kRuns = 16, kRun = 16;
    if (t.nbytes <= kRuns * kRun) {
      mix(fingerprint_, t.data, t.nbytes);
    } else {
      for (size_t i = 0; i < kRuns; ++i)
        mix(fingerprint_, t.data + i * ((t.nbytes - kRun) / (kRuns - 1)), kRun);
    }
  }
  if (o.n_ctx > 0)
    n_ctx_ = o.n_ctx;
  else if (o.n_ctx == 0 || (model_->n_ctx_train > 0 && model_->n_ctx_train < kDefaultContextTokens))
    n_ctx_ = model_->n_ctx_train;
  else
    n_ctx_ = kDefaultContextTokens;
  n_batch_ = std::min(o.n_batch, n_ctx_);
  if (o.n_seq_max < 1 || o.n_seq_max > kMaxSequences)
    throw ArgumentError("n_seq_max must be 1 to " + std::to_string(kMaxSequences) + ", got " +
                        std::to_string(o.n_seq_max));
  seqs_.resize(size_t(o.n_seq_max));
  cancels_.reset(new std::atomic<uint64_t>[seqs_.size()]());
  armed_.assign(seqs_.size(), 0);
  untaken_.resize(seqs_.size());
  // A windowed layer reads at most its window's rows and writes one batch's: a ring of
  // window + n_batch - 1 rows holds both, where that is shorter than the context. Every
  // windowed layer takes the largest window's ring, so that one position per sequence
  // (kv_lost) tells what every ring still holds.
  for (int w : model_->layer_window) swa_window_ = std::max(swa_window_, w);
  const int64_t ring = int64_t(swa_window_) + n_batch_ - 1;
  if (swa_window_ > 0 && !o.swa_full && ring < n_ctx_) ring_rows_ = int(ring);
  std::vector<int> rows(size_t(model_->n_layer), n_ctx_);
  for (int l = 0; l < model_->n_layer; ++l)
    if (ring_rows_ > 0 && model_->layer_window[size_t(l)] > 0) rows[size_t(l)] = ring_rows_;
  std::vector<KvCache> caches = KvCache::allocate_pool(
      *backend_, kv_type, model_->n_layer, model_->kv_width, n_ctx_, rows, int(seqs_.size()));
  for (size_t s = 0; s < seqs_.size(); ++s) seqs_[s].kv = std::move(caches[s]);
  seqs_[0].open = true;

  // Size the buffers once, from the largest graph: a full batch with every logit.
  Graph worst;
  StepGraph worst_inputs;
  build(worst_inputs, worst, n_batch_, n_batch_, 0);
  plan_graph(worst);
  size_t scratch = worst.scratch_size, inputs = worst.input_size;
  if (seqs_.size() > 1) {
    // And the largest decode batch a step runs as one graph (a server's batch may carry new
    // prompts' tokens beside one of each sequence).
    Graph batch;
    DecodeInputs in;
    const size_t m =
        batch_class(std::max(std::min(seqs_.size(), size_t(n_batch_)), decode_batch_span()));
    build_decode_batch(batch, m, in, m);
    scratch = std::max(scratch, batch.scratch_size);
    inputs = std::max(inputs, batch.input_size);
  }
  backend_->reserve(scratch, inputs);
  reserved_scratch_ = scratch;
  reserved_inputs_ = inputs;
}

Context::~Context() = default;

int Context::decode_sampled(int32_t first, int k, const SamplingParams& params, uint64_t seed,
                            uint64_t draw, int32_t* tokens, float* logprobs, const int32_t* stops,
                            size_t n_stops) {
  return land_sampled(launch_sampled(first, k, params, seed, draw, stops, n_stops), tokens,
                      logprobs);
}

uint64_t Context::launch_sampled(int32_t first, int k, const SamplingParams& params, uint64_t seed,
                                 uint64_t draw, const int32_t* stops, size_t n_stops,
                                 bool as_loop) {
  land();
  check_token_ids(&first, 1, model_->n_vocab, "decode_sampled");
  const bool loops = backend_->runs_loops();
  if (k < 1 || k > (loops ? kMaxLaunch : kMaxChain))
    throw ArgumentError("decode_sampled: k must be 1 to " +
                        std::to_string(loops ? kMaxLaunch : kMaxChain) + ", got " +
                        std::to_string(k));
  if (live().n_past + k > n_ctx_)
    throw ArgumentError("decode_sampled: " + std::to_string(k) +
                        " tokens do not fit the context: " + std::to_string(live().n_past) +
                        " of " + std::to_string(n_ctx_) + " positions are used");
  // A loop's rounds end at its k-th token on the device (the config's limit), the last one
  // part-way: so with as_loop, launches of every length run in the loop's one graph, where a
  // chain of each length would be captured anew. The positions of its whole rounds must fit the
  // context all the same (the backend checks every step's KV values against it).
  const int rounds_end = live().n_past + loop_positions(k);
  if (loops && k > kMaxChain && rounds_end > n_ctx_)
    throw ArgumentError("decode_sampled: a loop of " + std::to_string(k) +
                        " tokens runs whole rounds of " + std::to_string(kLoopChain) +
                        " steps, to position " + std::to_string(rounds_end) +
                        "; the context holds " + std::to_string(n_ctx_));
  const bool loop = loops && (k > kMaxChain || as_loop) && rounds_end <= n_ctx_;
  const int steps = loop ? kLoopChain : k;
  if (seed == kRandomSeed) throw ArgumentError("decode_sampled: the seed must be resolved");
  validate(params);
  // (A refused launch changes nothing.) A launch whose tokens its caller has not taken: its
  // sequence keeps them (they are in its history already) for the caller's land_sampled, until the
  // sequence launches again.
  if (flight_.active) {
    untaken_[size_t(flight_.seq)] = flight_;
    flight_.active = false;
  }
  untaken_[size_t(cur_)].active = false;
  if (needs_repair()) repair();
  const auto t0 = std::chrono::steady_clock::now();
  Sequence& s = live();
  const int n_past = s.n_past;
  const int window = sample_history_window(params, n_ctx_);
  if (!chain_tokens_) chain_tokens_ = backend_->alloc_kv(2 * kMaxChain * sizeof(int32_t));
  if (loop && !loop_tokens_)
    loop_tokens_ = backend_->alloc_kv((1 + 2 * kMaxLaunch) * sizeof(int32_t));
  // A generation's chains are mostly of one length, its last one shorter: a few graphs serve.
  const std::tuple<int, int, bool> key{steps, window, loop};
  if (s.chains.size() >= 8 && !s.chains.count(key)) s.chains.clear();
  ChainStep& c = s.chains[key];
  if (c.graph) {
    c.graph->shift_kv(n_past - c.n_past);
  } else {
    c.first.assign(1, first);
    c.positions.assign(size_t(steps), 0);
    c.out_ids.assign(1, 0);
    c.config.assign(size_t(sample_word::kHeader + window), 0);
    c.control.assign(2, 0);
    auto graph = std::make_unique<Graph>();
    Tensor* buffer = graph->token_buffer(chain_tokens_, kMaxChain);
    Tensor* config = graph->input_i32(int64_t(c.config.size()), c.config.data(), "sample_config");
    Tensor* first_id = graph->input_i32(1, c.first.data(), "tokens");
    std::vector<Tensor*> positions;
    for (int j = 0; j < steps; ++j) {
      Batch b;
      b.token_ids = j > 0 ? graph->token_at(buffer, j - 1) : first_id;
      positions.push_back(graph->input_i32(1, &c.positions[size_t(j)], "positions"));
      b.position_ids = positions.back();
      b.out_ids = c.out_ids.data();
      b.n_tokens = 1;
      b.n_outputs = 1;
      b.n_past = n_past + j;
      model_->build(*graph, b, s.kv);
      graph->set_output(graph->sample(graph->output(), config, buffer, j));
    }
    if (loop) {
      Tensor* control = graph->input_i32(2, c.control.data(), "loop_control");
      graph->set_output(graph->chain_loop(graph->output(), config, first_id, control, positions,
                                          loop_tokens_, kMaxLaunch));
    }
    graph->chain = steps;
    plan_graph(*graph);
    fit_reserved(*graph);
    c.graph = std::move(graph);  // only once built: a failed build leaves none behind
  }
  c.n_past = n_past;
  c.first[0] = first;
  std::iota(c.positions.begin(), c.positions.end(), n_past);
  // In place: the graph's input points at these words.
  c.control[0] = loop ? loop_positions(k) / kLoopChain : 1;
  c.control[1] = 0;
  // The penalty window's ids: the last of the sequence's tokens, then first.
  const size_t from = s.tokens.size() - std::min(s.tokens.size(), size_t(window));
  std::vector<int32_t> history(s.tokens.begin() + long(from), s.tokens.end());
  history.push_back(first);
  fill_sample_config(params, seed, draw, history.data(), history.size(), window, c.config.data(),
                     stops, n_stops);
  if (loop) c.config[sample_word::kLimit] = k;
  backend_->add_host_time(
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  note_written(s.kv_lost, n_past + k, ring_rows_);
  // The launch's token words (Flight::tokens): a loop's are read as a chain of the tokens its
  // rounds made.
  Flight& f = flight_;
  f.out.assign(loop ? 1 + 2 * size_t(kMaxLaunch) : 2 * size_t(kMaxChain), 0.0f);
  backend_->compute_start(*c.graph, f.out.data());
  f.active = true;
  f.landed = false;
  f.loop = loop;
  f.seq = cur_;
  f.k = k;
  f.steps = steps;
  f.n_past = n_past;
  f.first = first;
  f.done = 0;
  f.error.clear();
  f.id = ++launches_;
  return f.id;
}

int Context::poll_sampled(uint64_t launch, int have, int32_t* tokens, float* logprobs) {
  // A launch landed since, or kept by its sequence: land_sampled has its tokens.
  if (!flight_.active || flight_.id != launch) return -1;
  const volatile int32_t* w = flight_.loop && !flight_.landed ? backend_->loop_words() : nullptr;
  if (!w) return -1;
  // Only the words are read while the loop runs, no CUDA call (a query of the stream may wait
  // for the graph). A launch that shows nothing new for kQuiet (a failed one, or rounds slower
  // than that) is landed instead: its tokens then come at its end, and an error with them.
  constexpr auto kQuiet = std::chrono::seconds(2);
  const auto since = std::chrono::steady_clock::now();
  for (unsigned spin = 0;; ++spin) {
    const int32_t count = w[0];
    // The words a count covers were written before it (Backend::loop_words).
    std::atomic_thread_fence(std::memory_order_acquire);
    const int n = std::min(count & ~kLoopEnded, flight_.k);
    int ok = have;  // the words past have that are tokens (a failed or skipped step's are not)
    while (ok < n && w[loop_token_word(ok)] >= 0) ++ok;
    if (ok > have) {
      for (int j = have; j < ok; ++j) {
        tokens[j] = w[loop_token_word(j)];
        const int32_t bits = w[loop_logprob_word(kMaxLaunch, j)];
        std::memcpy(&logprobs[j], &bits, sizeof(float));
      }
      backend_->add_loop_looks(spin + 1, (count & kLoopEnded) ? 0 : ok - have, false);
      return ok;
    }
    if ((count & kLoopEnded) || ok < n) {
      backend_->add_loop_looks(spin + 1, 0, !(count & kLoopEnded));
      return -1;
    }
    if (spin % 64 == 63) {
      if (std::chrono::steady_clock::now() - since > kQuiet) {
        backend_->add_loop_looks(spin + 1, 0, true);
        return -1;
      }
      // A cancel asked for ends the loop at its round's end; the request stays for the caller.
      if (cancel_epoch(flight_.seq) != armed_[size_t(flight_.seq)]) backend_->halt_loop();
    }
    std::this_thread::yield();
  }
}

void Context::halt_sampled(uint64_t launch) {
  if (flight_.active && flight_.id == launch && !flight_.landed && flight_.loop)
    backend_->halt_loop();
}

void Context::land() {
  Flight& f = flight_;
  if (!f.active || f.landed) return;
  f.landed = true;
  try {
    backend_->compute_finish();
  } catch (...) {
    f.active = false;  // nothing to take: the context holds what it held before the launch
    throw;
  }
  Sequence& s = seqs_[size_t(f.seq)];
  const int steps = f.steps;
  const int n_past = f.n_past;
  int k = f.k;
  const int32_t* words = f.tokens();
  if (f.loop) {
    const int32_t made = reinterpret_cast<const int32_t*>(f.out.data())[0];
    if (made < steps || made > loop_positions(k) || made % steps != 0) {
      f.active = false;
      throw DeviceError("decode_sampled: the loop reported " + std::to_string(made) + " of " +
                        std::to_string(k) + " tokens");
    }
    k = std::min(k, int(made));  // (a last round that ended part-way reports its whole round)
  }
  int done = k;  // steps whose sample succeeded
  for (int j = 0; j < k && done == k; ++j)
    if (words[j] < 0) done = j;
  // Skipped steps: the one before them sampled a stop id, and each step that ran evaluated its
  // token. Otherwise the cache holds first and the samples before the last, or through the
  // step whose sample failed: the tokens that step and the ones before it evaluated.
  const bool skipped = done < k && done > 0 && words[done] == sample_word::kSkipped;
  const int evaluated = skipped ? done : done == k ? k : done + 1;
  s.tokens.push_back(f.first);
  s.tokens.insert(s.tokens.end(), words, words + (evaluated - 1));
  s.n_past = n_past + evaluated;
  if (done < k && !skipped)
    f.error = "decode_sampled: step " + std::to_string(done) +
              " found no logit above -inf to sample from";
  f.done = done;
}

int Context::land_sampled(uint64_t launch, int32_t* tokens, float* logprobs) {
  Flight* kept = nullptr;
  for (Flight& u : untaken_)
    if (u.active && u.id == launch) kept = &u;
  if (!kept && !(flight_.active && flight_.id == launch))
    throw ArgumentError("decode_sampled: no launch in flight (another call took its tokens)");
  if (!kept) land();
  Flight& f = kept ? *kept : flight_;
  f.active = false;
  if (!f.error.empty()) throw ArgumentError(f.error);
  std::copy(f.tokens(), f.tokens() + f.done, tokens);
  std::memcpy(logprobs, f.logprobs(), size_t(f.done) * sizeof(float));
  return f.done;
}

void Context::build_decode_batch(Graph& graph, size_t m, DecodeInputs& in, size_t n_out) const {
  in.tokens.assign(m, 0);
  in.positions.assign(m, 0);
  in.out_ids.resize(n_out);
  std::iota(in.out_ids.begin(), in.out_ids.end(), 0);
  in.slots.assign(2 * m, 0);
  Batch b;
  b.tokens = in.tokens.data();
  b.positions = in.positions.data();
  b.out_ids = in.out_ids.data();
  b.n_tokens = static_cast<int>(m);
  b.n_outputs = static_cast<int>(n_out);
  b.pool = &live().kv;
  b.slots = in.slots.data();
  b.n_seqs = static_cast<int>(m);
  model_->build(graph, b, live().kv);
  plan_graph(graph);
}

size_t Context::batch_class(size_t m) const {
  if (!backend_->is_cuda() || m > 64) return m;
  size_t c = 1;
  while (c < m) c <<= 1;
  return std::min(c, size_t(n_batch_));
}

void Context::set_decode_inputs(DecodeInputs& in, const int* seqs, const int32_t* tokens,
                                size_t m) const {
  const size_t c = in.tokens.size();
  std::vector<int> taken(seqs_.size(), 0);  // a sequence's tokens before this one
  for (size_t i = 0; i < c; ++i) {
    const bool pad = i >= m;
    in.tokens[i] = pad ? 0 : tokens[i];
    in.positions[i] = in.slots[c + i] = pad ? 0 : past_of(seqs[i]) + taken[size_t(seqs[i])]++;
    in.slots[i] = pad ? -1 : seqs[i];
  }
}

size_t Context::decode_batch_span() const { return std::min(size_t(64), size_t(n_batch_)); }

void Context::fit_reserved(const Graph& graph) {
  if (graph.scratch_size <= reserved_scratch_ && graph.input_size <= reserved_inputs_) return;
  reserved_scratch_ = std::max(reserved_scratch_, graph.scratch_size);
  reserved_inputs_ = std::max(reserved_inputs_, graph.input_size);
  backend_->reserve(reserved_scratch_, reserved_inputs_);
}

size_t Context::decode_batch_rows(size_t n) const {
  if (n <= 1) return n;
  // Batches of at most n_batch tokens (the buffers were sized for that many), each run in its
  // size class.
  size_t rows = n;
  for (size_t start = 0; start < n; start += size_t(n_batch_))
    rows = std::max(rows, start + batch_class(std::min(n - start, size_t(n_batch_))));
  return rows;
}

void Context::decode_batch(const int* seqs, const int32_t* tokens, size_t n, float* out,
                           bool repeats, bool last_only) {
  land();
  if (n == 0) throw ArgumentError("decode_batch: the batch is empty");
  if (last_only && n > size_t(n_batch_))
    throw ArgumentError("decode_batch: " + std::to_string(n) +
                        " tokens for their sequences' last logits; at most " +
                        std::to_string(n_batch_) + " a call");
  const int n_vocab = model_->n_vocab;
  check_token_ids(tokens, n, n_vocab, "decode_batch");
  std::vector<int> seen(seqs_.size(), 0);
  for (size_t i = 0; i < n; ++i) {
    const int s = seqs[i];
    if (s < 0 || s >= n_seq_max() || !seqs_[size_t(s)].open)
      throw ArgumentError("decode_batch: " + std::to_string(s) + " is not an open sequence");
    if (seen[size_t(s)]++ && !repeats)
      throw ArgumentError("decode_batch: sequence " + std::to_string(s) +
                          " appears twice; a batch takes one token of each");
    if (past_of(s) + seen[size_t(s)] > n_ctx_)
      throw ArgumentError("decode_batch: sequence " + std::to_string(s) + " is full: all " +
                          std::to_string(n_ctx_) + " positions are used");
  }
  if (repeats && swa_window_ > 0) {
    // A sequence's tokens in one batch must fit the ring beside its window.
    for (size_t s = 0; s < seen.size(); ++s)
      if (seen[s] > n_batch_)
        throw ArgumentError("decode_batch: sequence " + std::to_string(s) + " takes " +
                            std::to_string(seen[s]) + " tokens; a batch takes at most " +
                            std::to_string(n_batch_) + " of one sequence");
  }
  // Whatever happens below, the caller's sequence is selected again after.
  struct Reselect {
    Context* c;
    int id;
    ~Reselect() { c->cur_ = id; }
  } reselect{this, cur_};
  if (swa_window_ > 0) {
    // A sequence whose windowed rows were overwritten (a rewind, a cancelled eval) first
    // re-evaluates its tokens, as its own eval would; a stale cancel request does not stop it.
    for (size_t i = 0; i < n; ++i) {
      select_sequence(seqs[i]);
      if (!needs_repair()) continue;
      clear_cancel();
      repair();
    }
  }
  if (n == 1) {
    // A batch of one is its sequence's own decode step (its step graph, its CUDA graph).
    select_sequence(seqs[0]);
    const std::vector<float> logits = eval(tokens, 1, false);
    std::copy(logits.begin(), logits.end(), out);
    return;
  }
  for (size_t start = 0; start < n; start += size_t(n_batch_)) {
    const size_t m = std::min(n - start, size_t(n_batch_));
    const int* sq = seqs + start;
    const auto t0 = std::chrono::steady_clock::now();
    // The last batch's graph serves again for any m sequences at any positions: only its
    // inputs change (on the CPU, while it gives as many rows of logits). Only a batch's first
    // n_batch tokens are kept (more is rare: n_seq_max > n_batch).
    const size_t c = batch_class(m);
    // last_only: each sequence's last token (the CPU's graph computes only their logits; CUDA's
    // keeps one graph a size class, and its rows are gathered after).
    std::vector<int32_t> last;
    if (last_only) {
      std::vector<char> later(seqs_.size(), 0);  // a later token of the sequence was seen
      for (size_t i = m; i-- > 0;) {
        if (later[size_t(sq[i])]) continue;
        later[size_t(sq[i])] = 1;
        last.push_back(static_cast<int32_t>(i));
      }
      std::reverse(last.begin(), last.end());
    }
    const size_t n_out = last_only && !backend_->is_cuda() ? last.size() : c;
    std::unique_ptr<Graph> local;
    DecodeInputs local_in;
    DecodeInputs* in = &local_in;
    const Graph* graph = nullptr;
    if (start == 0) {
      BatchStep& step = batch_steps_[c];
      if (!step.graph || step.n_out != n_out) {
        step.graph.reset();
        auto g = std::make_unique<Graph>();
        build_decode_batch(*g, c, step.in, n_out);
        step.graph = std::move(g);  // only once built: a failed build leaves none behind
        step.n_out = n_out;
      }
      graph = step.graph.get();
      in = &step.in;
    } else {
      local = std::make_unique<Graph>();
      build_decode_batch(*local, c, local_in, n_out);
      graph = local.get();
    }
    fit_reserved(*graph);  // a batch larger than the one sized at load
    set_decode_inputs(*in, sq, tokens + start, m);
    if (n_out < c) std::copy(last.begin(), last.end(), in->out_ids.begin());
    backend_->add_host_time(
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    for (size_t i = 0; i < m; ++i)
      note_written(seqs_[size_t(sq[i])].kv_lost, in->positions[i] + 1, ring_rows_);
    // (The padding tokens' logits land past the batch's: decode_batch_rows counts them.)
    backend_->compute(*graph, out + start * n_vocab);
    if (last_only && n_out == c) {  // every row computed: the last tokens' gathered in front
      float* rows = out + start * n_vocab;
      for (size_t k = 0; k < last.size(); ++k)
        if (size_t(last[k]) != k)
          std::memmove(rows + k * n_vocab, rows + size_t(last[k]) * n_vocab,
                       size_t(n_vocab) * sizeof(float));
    }
    for (size_t i = 0; i < m; ++i) append_token(sq[i], tokens[start + i]);
  }
}

void Context::append_token(int seq, int32_t token) {
  ++seqs_[size_t(seq)].n_past;
  seqs_[size_t(seq)].tokens.push_back(token);
}

int Context::open_sequence() {
  land();
  for (size_t i = 0; i < seqs_.size(); ++i) {
    if (seqs_[i].open) continue;
    seqs_[i].open = true;
    seqs_[i].n_past = 0;
    seqs_[i].kv_lost = 0;
    seqs_[i].tokens.clear();
    return static_cast<int>(i);
  }
  throw ArgumentError(
      "all " + std::to_string(seqs_.size()) + " sequences of this context are in use (n_seq_max=" +
      std::to_string(seqs_.size()) + "); close one, or load the model with a larger n_seq_max");
}

void Context::close_sequence(int id) {
  land();
  if (id <= 0 || id >= n_seq_max() || !seqs_[size_t(id)].open)
    throw ArgumentError("close_sequence: " + std::to_string(id) +
                        " is not an open sequence other than 0");
  if (id == cur_) select_sequence(0);
  seqs_[size_t(id)].open = false;
  seqs_[size_t(id)].n_past = 0;
  seqs_[size_t(id)].kv_lost = 0;
  seqs_[size_t(id)].tokens.clear();
  for (StepGraph& step : seqs_[size_t(id)].steps) step = StepGraph();
  seqs_[size_t(id)].chains.clear();
  untaken_[size_t(id)].active = false;
}

void Context::select_sequence(int id) {
  if (id < 0 || id >= n_seq_max() || !seqs_[size_t(id)].open)
    throw ArgumentError("select_sequence: " + std::to_string(id) + " is not an open sequence");
  // Selecting the sequence selected already changes nothing: a loop in flight stays in flight
  // (the Python wrapper selects its sequence around every step of a generation, between the
  // rounds a loop streams).
  if (id == cur_) return;
  land();
  cur_ = id;
}

int Context::n_seq_open() const {
  int n = 0;
  for (const Sequence& s : seqs_) n += s.open ? 1 : 0;
  return n;
}

std::string Context::kv_type() const {
  for (const auto& t : kKvTypes)
    if (live().kv.type == t.type) return t.name;
  return type_name(live().kv.type);
}

const Tokenizer& Context::tokenizer() const {
  if (!tokenizer_) throw GGUFError(tokenizer_error_);
  return *tokenizer_;
}

void Context::build(StepGraph& step, Graph& graph, int n_tokens, int n_outputs, int n_past,
                    bool embeddings) {
  step.in_tokens.resize(n_tokens);
  step.in_positions.resize(n_tokens);
  std::iota(step.in_positions.begin(), step.in_positions.end(), n_past);
  step.in_out_ids.resize(n_outputs);
  std::iota(step.in_out_ids.begin(), step.in_out_ids.end(), n_tokens - n_outputs);
  Batch b;
  b.tokens = step.in_tokens.data();
  b.positions = step.in_positions.data();
  b.out_ids = step.in_out_ids.data();
  b.n_tokens = n_tokens;
  b.n_outputs = n_outputs;
  b.n_past = n_past;
  b.embeddings = embeddings;
  model_->build(graph, b, live().kv);
}

std::vector<float> Context::eval(const int32_t* tokens, size_t n, bool all_logits,
                                 const std::function<bool()>& interrupted) {
  land();
  if (n == 0) throw ArgumentError("eval: the token list is empty");
  const int n_vocab = model_->n_vocab;
  check_token_ids(tokens, n, n_vocab, "eval");
  if (size_t(live().n_past) + n > size_t(n_ctx_))
    throw ArgumentError("eval: " + std::to_string(n) +
                        " tokens do not fit the context: " + std::to_string(live().n_past) +
                        " of " + std::to_string(n_ctx_) + " positions are used");
  if (needs_repair()) repair(interrupted);

  std::vector<float> logits(size_t(n_vocab) * (all_logits ? n : 1));
  int n_past = live().n_past;
  for (size_t start = 0; start < n; start += n_batch_) {
    // The cache rows the earlier chunks wrote lie past the sequence's n_past, which has not
    // moved: stopping here leaves the context as it was.
    if (start > 0 && (take_cancel() || (interrupted && interrupted())))
      throw Cancelled("eval: cancelled after " + std::to_string(start) + " of " +
                      std::to_string(n) + " tokens; the context is unchanged");
    const int chunk = int(std::min<size_t>(n_batch_, n - start));
    const int n_out = all_logits ? chunk : 1;
    const auto t0 = std::chrono::steady_clock::now();
    // This shape's graph, or the place of the one that ran longest ago.
    Sequence& seq = live();
    StepGraph* step = nullptr;
    for (StepGraph& g : seq.steps)
      if (g.graph && g.tokens == chunk && g.outputs == n_out) step = &g;
    if (step) {
      step->graph->shift_kv(n_past - step->n_past);
      std::iota(step->in_positions.begin(), step->in_positions.end(), n_past);
    } else {
      step = &seq.steps[0];
      for (StepGraph& g : seq.steps)
        if (!g.graph || g.used < step->used) step = &g;
      step->graph.reset();  // a failed build must not leave a half-made graph behind
      auto graph = std::make_unique<Graph>();
      build(*step, *graph, chunk, n_out, n_past);
      plan_graph(*graph);
      step->graph = std::move(graph);
      step->tokens = chunk;
      step->outputs = n_out;
    }
    step->n_past = n_past;
    step->used = ++seq.clock;
    std::copy(tokens + start, tokens + start + chunk, step->in_tokens.begin());
    const Graph& graph = *step->graph;
    backend_->add_host_time(
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    // Earlier chunks only fill the KV cache; their logit row is overwritten by the last. A
    // ring's rows of earlier positions are overwritten even where the eval stops after this.
    note_written(live().kv_lost, n_past + chunk, ring_rows_);
    backend_->compute(graph, all_logits ? logits.data() + start * n_vocab : logits.data());
    n_past += chunk;
  }
  live().n_past = n_past;  // only once every chunk has run: a failure leaves the context as it was
  live().tokens.insert(live().tokens.end(), tokens, tokens + n);
  return logits;
}

void Context::repair(const std::function<bool()>& interrupted) {
  std::vector<int32_t> kept;
  kept.swap(live().tokens);
  const int n = live().n_past;
  live().n_past = 0;
  live().kv_lost = 0;
  try {
    if (n > 0) eval(kept.data(), size_t(n), false, interrupted);
  } catch (...) {
    // Stopped half-way: the same tokens, with every windowed row still to be rebuilt.
    live().tokens.swap(kept);
    live().n_past = n;
    live().kv_lost = n;
    throw;
  }
}

namespace {

constexpr char kStateMagic[4] = {'G', 'G', 'R', 'S'};
// Version 2 adds, after the tokens, the first position each layer's saved rows start at (a
// ring keeps the last rows only); version 1 states (every layer from position 0) still load.
// Version 3 names the model by samples of its weights too (Context's constructor).
constexpr uint32_t kStateVersion = 3;

struct StateHeader {
  char magic[4];
  uint32_t version;
  uint64_t fingerprint;
  uint32_t kv_type;
  uint32_t n_layer;
  uint64_t width;
  uint32_t n_past;
  uint32_t kv_lost;  // version 2 (0 in version 1): windowed rows before it may be missing
};

}  // namespace

size_t Context::kv_rows_bytes(size_t n_rows) const {
  return 2 * size_t(live().kv.n_layer) * n_rows * live().kv.row_bytes();
}

void Context::kv_rows_to_host(uint8_t* host, size_t n_rows) const {
  const size_t layer = 2 * n_rows * live().kv.row_bytes();
  for (int l = 0; l < live().kv.n_layer; ++l, host += layer)
    kv_runs(l, 0, int(n_rows), [&](void* cache, size_t at, size_t bytes) {
      backend_->kv_to_host(host + at, cache, bytes);
    });
}

void Context::kv_rows_from_host(const uint8_t* host, size_t n_rows) {
  const size_t layer = 2 * n_rows * live().kv.row_bytes();
  for (int l = 0; l < live().kv.n_layer; ++l, host += layer)
    kv_runs(l, 0, int(n_rows), [&](void* cache, size_t at, size_t bytes) {
      backend_->kv_from_host(cache, host + at, bytes);
    });
}

void Context::kv_runs(
    int l, int first, int end,
    const std::function<void(void* cache, size_t offset, size_t bytes)>& fn) const {
  const KvCache& kv = live().kv;
  const size_t rb = kv.row_bytes();
  const int rows = kv.rows[size_t(l)];
  size_t offset = 0;
  for (void* cache : {kv.k[size_t(l)], kv.v[size_t(l)]}) {
    // A ring's positions lie in at most two runs of rows.
    for (int p = first; p < end;) {
      const int r = int(kv_row(p, rows)), n = std::min(end - p, rows - r);
      fn(static_cast<uint8_t*>(cache) + size_t(r) * rb, offset, size_t(n) * rb);
      offset += size_t(n) * rb;
      p += n;
    }
  }
}

void Context::plan_graph(Graph& graph) const { plan(graph, backend_->folds_norms()); }

size_t Context::max_state_bytes() const {
  const KvCache& kv = live().kv;
  return sizeof(StateHeader) + size_t(n_ctx_) * sizeof(int32_t) +
         size_t(kv.n_layer) * (sizeof(uint32_t) + 2 * size_t(n_ctx_) * kv.row_bytes());
}

std::vector<uint8_t> Context::save_state() const {
  const KvCache& kv = live().kv;
  // Each layer's rows from its first kept position: 0, or for a ring the oldest it still holds.
  std::vector<uint32_t> firsts(size_t(kv.n_layer), 0);
  size_t kv_bytes = 0;
  for (int l = 0; l < kv.n_layer; ++l) {
    if (kv.ring(l))
      firsts[size_t(l)] = uint32_t(std::min(
          live().n_past, std::max({0, live().kv_lost, live().n_past - kv.rows[size_t(l)]})));
    kv_bytes += 2 * size_t(live().n_past - int(firsts[size_t(l)])) * kv.row_bytes();
  }
  const size_t tokens_bytes = size_t(live().n_past) * sizeof(int32_t);
  const size_t firsts_bytes = firsts.size() * sizeof(uint32_t);
  std::vector<uint8_t> out(sizeof(StateHeader) + tokens_bytes + firsts_bytes + kv_bytes);
  StateHeader h{};
  std::memcpy(h.magic, kStateMagic, 4);
  h.version = kStateVersion;
  h.fingerprint = fingerprint_;
  h.kv_type = static_cast<uint32_t>(kv.type);
  h.n_layer = uint32_t(kv.n_layer);
  h.width = uint64_t(kv.width);
  h.n_past = uint32_t(live().n_past);
  h.kv_lost = uint32_t(std::min(live().kv_lost, live().n_past));
  uint8_t* p = out.data();
  std::memcpy(p, &h, sizeof h);
  p += sizeof h;
  std::memcpy(p, live().tokens.data(), tokens_bytes);
  p += tokens_bytes;
  std::memcpy(p, firsts.data(), firsts_bytes);
  p += firsts_bytes;
  for (int l = 0; l < kv.n_layer; ++l) {
    kv_runs(l, int(firsts[size_t(l)]), live().n_past, [&](void* cache, size_t at, size_t bytes) {
      backend_->kv_to_host(p + at, cache, bytes);
    });
    p += 2 * size_t(live().n_past - int(firsts[size_t(l)])) * kv.row_bytes();
  }
  return out;
}

void Context::copy_prefix(int from, int n) {
  land();
  if (from < 0 || from >= n_seq_max() || !seqs_[size_t(from)].open)
    throw ArgumentError("copy_prefix: expected an open sequence id, got " + std::to_string(from));
  if (from == cur_)
    throw ArgumentError(
        "copy_prefix: sequence " + std::to_string(from) +
        " is the one selected; expected another (rewind keeps a prefix of its own)");
  const Sequence& src = seqs_[size_t(from)];
  if (n < 0 || n > src.n_past)
    throw ArgumentError("copy_prefix: expected a length in [0, " + std::to_string(src.n_past) +
                        "] (sequence " + std::to_string(from) + "'s tokens), got " +
                        std::to_string(n));
  for (int w : model_->layer_window)
    if (w > 0)
      throw ArgumentError(
          "copy_prefix: this model has sliding-window layers, whose rings keep other positions "
          "than a prefix");
  // Without rings, position p lies at row p of every layer: rows [0, n) of K and of V are one
  // run each.
  const KvCache& kv = live().kv;
  const size_t bytes = size_t(n) * kv.row_bytes();
  try {
    for (size_t l = 0; l < size_t(kv.n_layer); ++l) {
      backend_->kv_copy(kv.k[l], src.kv.k[l], bytes);
      backend_->kv_copy(kv.v[l], src.kv.v[l], bytes);
    }
  } catch (...) {
    reset();  // a device failure half-way: the old rows are gone, so the sequence is emptied
    throw;
  }
  live().tokens.assign(src.tokens.begin(), src.tokens.begin() + n);
  live().n_past = n;
  live().kv_lost = 0;
}

void Context::load_state_file(int fd, const std::string& path) {
  land();
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
    throw ArgumentError("load_state: " + path + " is not a regular file");
  const size_t most = max_state_bytes();
  if (uint64_t(st.st_size) > most)
    throw ArgumentError("load_state: " + path + " holds " + std::to_string(st.st_size) +
                        " bytes; a state of this context takes at most " + std::to_string(most));
  std::vector<uint8_t> data(size_t(st.st_size));
  size_t got = 0;
  while (got < data.size()) {
    const ssize_t n = pread(fd, data.data() + got, data.size() - got, off_t(got));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      throw ArgumentError("load_state: reading " + path + " failed" +
                          (n < 0 ? std::string(": ") + std::strerror(errno) : " (file shrank)"));
    got += size_t(n);
  }
  load_state(data.data(), data.size());
}

void Context::load_state(const uint8_t* data, size_t size) {
  land();
  const KvCache& kv = live().kv;
  StateHeader h{};
  if (!data || size < sizeof h)
    throw ArgumentError("load_state: " + std::to_string(size) +
                        " bytes are too few for a saved state");
  std::memcpy(&h, data, sizeof h);
  if (std::memcmp(h.magic, kStateMagic, 4) != 0)
    throw ArgumentError("load_state: not a ggraph state (its first bytes are not 'GGRS')");
  if (h.version < 1 || h.version > kStateVersion)
    throw ArgumentError("load_state: state format version " + std::to_string(h.version) +
                        "; this ggraph reads versions 1 to " + std::to_string(kStateVersion));
  if (h.fingerprint != (h.version >= 3 ? fingerprint_ : table_fingerprint_))
    throw ArgumentError("load_state: the state was saved with another model file");
  if (h.kv_type != static_cast<uint32_t>(kv.type) || h.n_layer != uint32_t(kv.n_layer) ||
      h.width != uint64_t(kv.width)) {
    const TypeTraits* saved = type_traits_or_null(h.kv_type);
    throw ArgumentError(std::string("load_state: the state's KV cache is ") +
                        (saved ? saved->name : "of type id " + std::to_string(h.kv_type)) + " (" +
                        std::to_string(h.n_layer) + " layers of " + std::to_string(h.width) +
                        "), this context's " + type_name(kv.type) + " (" +
                        std::to_string(kv.n_layer) + " layers of " + std::to_string(kv.width) +
                        "): a state loads into a context of the same kv_type");
  }
  if (h.n_past > uint32_t(n_ctx_))
    throw ArgumentError("load_state: the state holds " + std::to_string(h.n_past) +
                        " tokens; this context holds " + std::to_string(n_ctx_));
  const int n_past = int(h.n_past);
  const size_t tokens_bytes = size_t(n_past) * sizeof(int32_t);
  const size_t firsts_bytes = h.version >= 2 ? size_t(kv.n_layer) * sizeof(uint32_t) : 0;
  if (size < sizeof h + tokens_bytes + firsts_bytes)
    throw ArgumentError("load_state: " + std::to_string(size) + " bytes; a state of " +
                        std::to_string(n_past) + " tokens takes at least " +
                        std::to_string(sizeof h + tokens_bytes + firsts_bytes));
  std::vector<uint32_t> firsts(size_t(kv.n_layer), 0);
  if (firsts_bytes) std::memcpy(firsts.data(), data + sizeof h + tokens_bytes, firsts_bytes);
  size_t expected = sizeof h + tokens_bytes + firsts_bytes;
  for (int l = 0; l < kv.n_layer; ++l) {
    const uint32_t f = firsts[size_t(l)];
    const bool windowed = model_->layer_window[size_t(l)] > 0;
    // Only a windowed layer may start past position 0.
    if (f > h.n_past || (f > 0 && !windowed))
      throw ArgumentError("load_state: layer " + std::to_string(l) + "'s rows start at position " +
                          std::to_string(f) + "; expected " +
                          (windowed ? "at most " + std::to_string(n_past) : std::string("0")));
    expected += 2 * size_t(n_past - int(f)) * kv.row_bytes();
  }
  if (size != expected)
    throw ArgumentError("load_state: " + std::to_string(size) + " bytes; a state of " +
                        std::to_string(n_past) + " tokens takes " + std::to_string(expected));
  std::vector<int32_t> tokens(h.n_past);
  std::memcpy(tokens.data(), data + sizeof h, tokens_bytes);
  check_token_ids(tokens.data(), tokens.size(), model_->n_vocab, "load_state");
  int lost = int(std::min(h.kv_lost, h.n_past));
  try {
    const uint8_t* p = data + sizeof h + tokens_bytes + firsts_bytes;
    for (int l = 0; l < kv.n_layer; ++l) {
      // This context's ring may be shorter than the saving one's: its last rows only.
      const int count = n_past - int(firsts[size_t(l)]);
      const int keep = std::min(count, kv.rows[size_t(l)]);
      const size_t skip = size_t(count - keep) * kv.row_bytes();
      const size_t half = size_t(keep) * kv.row_bytes();  // K's rows, then V's
      kv_runs(l, n_past - keep, n_past, [&](void* cache, size_t at, size_t bytes) {
        const size_t from =
            at < half ? skip + at : size_t(count) * kv.row_bytes() + skip + at - half;
        backend_->kv_from_host(cache, p + from, bytes);
      });
      if (model_->layer_window[size_t(l)] > 0) lost = std::max(lost, n_past - keep);
      p += 2 * size_t(count) * kv.row_bytes();
    }
  } catch (...) {
    reset();  // a device failure half-way: the old rows are gone, so the context is emptied
    throw;
  }
  live().tokens = std::move(tokens);
  live().n_past = n_past;
  live().kv_lost = lost;
}

std::vector<float> Context::embed(const int32_t* tokens, size_t n) {
  land();
  if (n == 0) throw ArgumentError("embed: the token list is empty");
  check_token_ids(tokens, n, model_->n_vocab, "embed");
  if (n > size_t(n_batch_))
    throw ArgumentError("embed: " + std::to_string(n) + " tokens; one call takes at most " +
                        std::to_string(n_batch_) + " (n_batch)");
  // The graph writes cache rows [0, n): the conversation's rows there are kept aside and put
  // back, so that its tokens and cache are as they were.
  const size_t kept = std::min(n, size_t(live().n_past));
  std::vector<uint8_t> saved(kv_rows_bytes(kept));
  kv_rows_to_host(saved.data(), kept);
  const int n_tok = int(n);
  std::vector<float> out(size_t(model_->n_embd) * n);
  try {
    StepGraph step;  // a graph and inputs of its own: the sequence's step graphs stay
    Graph graph;
    build(step, graph, n_tok, n_tok, 0, /*embeddings=*/true);
    plan_graph(graph);
    std::copy(tokens, tokens + n, step.in_tokens.begin());
    backend_->compute(graph, out.data());
  } catch (...) {
    kv_rows_from_host(saved.data(), kept);
    throw;
  }
  kv_rows_from_host(saved.data(), kept);
  return out;
}

}  // namespace ggraph
