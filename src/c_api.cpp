// The C API: a thin shell over Context that turns exceptions into error codes. Calls on one
// model are serialized by its mutex; the last error is per thread.
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "context.h"
#include "generation.h"
#include "ggraph.h"
#include "sampling.h"

// What a model and its sessions share: the context and the mutex every call holds.
struct ggraph_shared {
  std::unique_ptr<ggraph::Context> ctx;
  std::mutex mutex;
};

// A model, or one of its sessions: a sequence of the shared context, which every call selects
// once it holds the mutex.
struct ggraph_model {
  std::shared_ptr<ggraph_shared> shared;
  ggraph::Context* ctx;
  std::mutex& mutex;
  int seq;
  std::vector<float> logits;

  ggraph_model(std::shared_ptr<ggraph_shared> s, int sequence)
      : shared(std::move(s)), ctx(shared->ctx.get()), mutex(shared->mutex), seq(sequence) {}
  ~ggraph_model() {
    if (seq == 0) return;
    std::lock_guard<std::mutex> lock(mutex);
    try {
      ctx->close_sequence(seq);
    } catch (const std::exception&) {
    }
  }
};

namespace {

// The calling thread's last error message.
thread_local std::string t_error;

template <typename F>
int guarded(ggraph_model* m, F&& fn) {
  t_error.clear();
  if (!m) {
    t_error = "model is NULL";
    return GGRAPH_ERR_ARGUMENT;
  }
  try {
    std::lock_guard<std::mutex> lock(m->mutex);
    m->ctx->select_sequence(m->seq);
    return fn();
  } catch (const ggraph::GGUFError& e) {
    t_error = e.what();
    return GGRAPH_ERR_FILE;
  } catch (const ggraph::ArgumentError& e) {
    t_error = e.what();
    return GGRAPH_ERR_ARGUMENT;
  } catch (const ggraph::DeviceError& e) {
    t_error = e.what();
    return GGRAPH_ERR_DEVICE;
  } catch (const ggraph::Cancelled& e) {
    t_error = e.what();
    return GGRAPH_ERR_CANCELLED;
  } catch (const std::bad_alloc&) {
    t_error = "out of host memory";
    return GGRAPH_ERR_DEVICE;
  } catch (const std::exception& e) {
    t_error = e.what();
    return GGRAPH_ERR_INTERNAL;
  }
}

// Reads of a model's fixed sizes and position, under its mutex.
template <typename F>
int32_t locked_read(const ggraph_model* m, int32_t fallback, F&& fn) {
  t_error.clear();
  if (!m) {
    t_error = "model is NULL";
    return fallback;
  }
  std::lock_guard<std::mutex> lock(m->mutex);
  try {
    m->ctx->select_sequence(m->seq);
    return fn();
  } catch (const std::exception& e) {
    t_error = e.what();
    return fallback;
  }
}

// The most bytes of text ggraph_tokenize takes in one call.
constexpr size_t kMaxTextBytes = size_t(1) << 30;

void copy_error(const std::string& msg, char* err, size_t size) {
  if (!err || size == 0) return;
  const size_t n = std::min(msg.size(), size - 1);
  std::memcpy(err, msg.data(), n);
  err[n] = '\0';
}

}  // namespace

extern "C" {

ggraph_params ggraph_default_params(void) {
  ggraph::ContextOptions o;
  ggraph_params p{};
  p.size = sizeof(ggraph_params);
  p.device = "auto";
  p.n_ctx = o.n_ctx;
  p.n_threads = o.n_threads;
  p.cuda_graphs = "patch";
  p.kv_type = "auto";
  p.allow_longer_context = 0;
  p.n_seq_max = 1;
  p.swa_full = 0;
  return p;
}

ggraph_sampling ggraph_default_sampling(void) {
  ggraph::SamplingParams p;
  return ggraph_sampling{p.temperature, p.top_k, p.top_p, p.min_p, p.repeat_penalty, p.seed};
}

ggraph_model* ggraph_load(const char* path, const ggraph_params* params, char* err,
                          size_t err_size) {
  t_error.clear();
  if (!path) {
    t_error = "ggraph_load: path is NULL";
    copy_error(t_error, err, err_size);
    return nullptr;
  }
  try {
    ggraph_params p = ggraph_default_params();
    if (params) {
      // The fields the caller's version of the struct has; the rest keep their defaults.
      if (params->size < offsetof(ggraph_params, cuda_graphs) + sizeof(const char*) ||
          params->size > sizeof(ggraph_params))
        throw ggraph::ArgumentError("ggraph_load: params->size " + std::to_string(params->size) +
                                    " is not the size of a ggraph_params (expected " +
                                    std::to_string(sizeof(ggraph_params)) +
                                    ": start from ggraph_default_params())");
      std::memcpy(&p, params, params->size);
    }
    ggraph::ContextOptions o;
    o.device = p.device ? p.device : "auto";
    o.n_ctx = p.n_ctx;
    o.n_threads = p.n_threads;
    o.cuda_graphs = p.cuda_graphs ? p.cuda_graphs : "patch";
    if (p.kv_type) o.kv_type = p.kv_type;
    o.allow_longer_context = p.allow_longer_context != 0;
    if (p.n_seq_max < 0 || p.n_seq_max > ggraph::kMaxSequences)
      throw ggraph::ArgumentError("ggraph_load: n_seq_max must be 0 to " +
                                  std::to_string(ggraph::kMaxSequences) + ", got " +
                                  std::to_string(p.n_seq_max));
    o.n_seq_max = p.n_seq_max > 0 ? static_cast<int>(p.n_seq_max) : 1;
    o.swa_full = p.swa_full != 0;
    auto shared = std::make_shared<ggraph_shared>();
    shared->ctx = std::make_unique<ggraph::Context>(path, o);
    return new ggraph_model(std::move(shared), 0);
  } catch (const std::exception& e) {
    t_error = e.what();
    copy_error(t_error, err, err_size);
    return nullptr;
  }
}

void ggraph_free(ggraph_model* model) { delete model; }

ggraph_model* ggraph_session_open(ggraph_model* m) {
  ggraph_model* out = nullptr;
  const int rc = guarded(m, [&] {
    out = new ggraph_model(m->shared, m->ctx->open_sequence());
    return GGRAPH_OK;
  });
  return rc == GGRAPH_OK ? out : nullptr;
}

const char* ggraph_last_error(const ggraph_model* model) {
  (void)model;  // the message is the calling thread's, whichever model failed
  return t_error.c_str();
}

int32_t ggraph_n_vocab(const ggraph_model* m) {
  return locked_read(m, 0, [&] { return m->ctx->n_vocab(); });
}
int32_t ggraph_n_ctx(const ggraph_model* m) {
  return locked_read(m, 0, [&] { return m->ctx->n_ctx(); });
}
int32_t ggraph_n_past(const ggraph_model* m) {
  return locked_read(m, 0, [&] { return m->ctx->n_past(); });
}

int32_t ggraph_eos(const ggraph_model* m) {
  return locked_read(m, -1, [&] { return m->ctx->tokenizer().eos_id(); });
}

int ggraph_is_end_of_generation(const ggraph_model* m, int32_t token) {
  return locked_read(m, 0, [&] { return m->ctx->tokenizer().is_end_of_generation(token) ? 1 : 0; });
}

int ggraph_eval(ggraph_model* m, const int32_t* tokens, size_t n, float* logits) {
  // The cancel requests so far, read before the call waits for the model: one made while it
  // waits stops it.
  const uint64_t epoch = m ? m->ctx->cancel_epoch(m->seq) : 0;
  return guarded(m, [&] {
    if (!tokens && n) throw ggraph::ArgumentError("ggraph_eval: tokens is NULL");
    // The capacity first: the caller's buffer is read only once n is known to fit.
    const size_t room = size_t(m->ctx->n_ctx() - m->ctx->n_past());
    if (n > room)
      throw ggraph::ArgumentError(
          "ggraph_eval: " + std::to_string(n) + " tokens do not fit: the context holds " +
          std::to_string(m->ctx->n_ctx()) + " and has " + std::to_string(room) + " left");
    m->ctx->arm_cancel(epoch);
    m->logits = m->ctx->eval(tokens, n, false);
    if (logits) std::memcpy(logits, m->logits.data(), m->logits.size() * sizeof(float));
    return GGRAPH_OK;
  });
}

int ggraph_decode_batch(ggraph_model* const* seqs, const int32_t* tokens, size_t n, float* logits) {
  if (!seqs || n == 0) {
    t_error =
        !seqs ? "ggraph_decode_batch: seqs is NULL" : "ggraph_decode_batch: the batch is empty";
    return GGRAPH_ERR_ARGUMENT;
  }
  return guarded(seqs[0], [&] {
    if (!tokens) throw ggraph::ArgumentError("ggraph_decode_batch: tokens is NULL");
    std::vector<int> ids(n);
    for (size_t i = 0; i < n; ++i) {
      if (!seqs[i] || seqs[i]->shared != seqs[0]->shared)
        throw ggraph::ArgumentError("ggraph_decode_batch: sequence " + std::to_string(i) +
                                    (seqs[i] ? " is not of the first one's model" : " is NULL") +
                                    "; a batch takes one model and its sessions");
      ids[i] = seqs[i]->seq;
    }
    ggraph::Context& ctx = *seqs[0]->ctx;
    const size_t n_vocab = size_t(ctx.n_vocab()), rows = ctx.decode_batch_rows(n);
    // The caller's buffer takes the logits directly where it has room for the padding rows too.
    std::vector<float> scratch;
    float* out = logits;
    if (!out || rows > n) {
      scratch.resize(rows * n_vocab);
      out = scratch.data();
    }
    std::vector<int> before(n);
    for (size_t i = 0; i < n; ++i) before[i] = ctx.n_past_of(ids[i]);
    try {
      ctx.decode_batch(ids.data(), tokens, n, out);
    } catch (...) {
      // A step that failed part of the way (a device error in a later batch of more than
      // n_batch) advanced some sequences: their old logits are no longer theirs, and
      // ggraph_sample then asks for an eval. A refused batch changed nothing and keeps them.
      for (size_t i = 0; i < n; ++i)
        if (ctx.n_past_of(ids[i]) != before[i]) seqs[i]->logits.clear();
      throw;
    }
    for (size_t i = 0; i < n; ++i) {
      const float* row = out + i * n_vocab;
      seqs[i]->logits.assign(row, row + n_vocab);
    }
    if (logits && out != logits) std::memcpy(logits, out, n * n_vocab * sizeof(float));
    return GGRAPH_OK;
  });
}

void ggraph_cancel(ggraph_model* m) {
  t_error.clear();
  if (m) m->ctx->cancel(m->seq);  // lock-free: the eval in progress holds the mutex
}

void ggraph_reset(ggraph_model* m) {
  t_error.clear();
  if (!m) return;
  std::lock_guard<std::mutex> lock(m->mutex);
  m->ctx->select_sequence(m->seq);
  m->ctx->reset();
  m->logits.clear();
}

int32_t ggraph_sample(ggraph_model* m, const ggraph_sampling* s) {
  return guarded(m, [&] {
    if (m->logits.empty()) throw ggraph::ArgumentError("ggraph_sample: no logits yet; eval first");
    const ggraph_sampling in = s ? *s : ggraph_default_sampling();
    ggraph::SamplingParams p;
    p.temperature = in.temperature;
    p.top_k = in.top_k;
    p.top_p = in.top_p;
    p.min_p = in.min_p;
    p.repeat_penalty = in.repeat_penalty;
    p.seed = in.seed;
    const std::vector<int32_t>& history = m->ctx->tokens();
    return int(ggraph::sample_once(p, m->logits.data(), int32_t(m->logits.size()), history.data(),
                                   history.size()));
  });
}

int32_t ggraph_tokenize(ggraph_model* m, const char* text, size_t len, int add_bos, int special,
                        int32_t* tokens, int32_t max_tokens) {
  return guarded(m, [&] {
    if (!text && len) throw ggraph::ArgumentError("ggraph_tokenize: text is NULL");
    if (len > kMaxTextBytes)
      throw ggraph::ArgumentError("ggraph_tokenize: " + std::to_string(len) +
                                  " bytes of text; at most " + std::to_string(kMaxTextBytes) +
                                  " a call");
    if (max_tokens < 0)
      throw ggraph::ArgumentError("ggraph_tokenize: max_tokens must be >= 0, got " +
                                  std::to_string(max_tokens));
    const auto& tok = m->ctx->tokenizer();
    const bool bos = add_bos < 0 ? tok.add_bos_default() : add_bos != 0;
    std::vector<int32_t> ids = tok.tokenize(std::string(text ? text : "", len), bos, special != 0);
    if (tokens && int64_t(ids.size()) <= max_tokens)
      std::memcpy(tokens, ids.data(), ids.size() * sizeof(int32_t));
    return int(ids.size());
  });
}

int32_t ggraph_token_to_piece(ggraph_model* m, int32_t token, char* buf, int32_t size) {
  return guarded(m, [&] {
    if (size < 0)
      throw ggraph::ArgumentError("ggraph_token_to_piece: size must be >= 0, got " +
                                  std::to_string(size));
    const auto& tok = m->ctx->tokenizer();
    ggraph::check_token_ids(&token, 1, tok.n_vocab(), "ggraph_token_to_piece");
    const std::string piece = tok.token_to_piece(token);
    if (buf && int64_t(piece.size()) <= size) std::memcpy(buf, piece.data(), piece.size());
    return int(piece.size());
  });
}

ggraph_generate_params ggraph_default_generate_params(void) {
  const ggraph::SamplingParams p;
  ggraph_generate_params g{};
  g.size = sizeof(ggraph_generate_params);
  g.max_tokens = 128;
  g.temperature = p.temperature;
  g.top_k = p.top_k;
  g.top_p = p.top_p;
  g.min_p = p.min_p;
  g.repeat_penalty = p.repeat_penalty;
  g.frequency_penalty = p.frequency_penalty;
  g.presence_penalty = p.presence_penalty;
  g.penalty_last_n = p.penalty_last_n;
  g.seed = p.seed;
  return g;
}

int ggraph_generate(ggraph_model* m, const int32_t* prompt, size_t n,
                    const ggraph_generate_params* params, ggraph_step_fn on_step, void* user) {
  const uint64_t epoch = m ? m->ctx->cancel_epoch(m->seq) : 0;  // as ggraph_eval's
  return guarded(m, [&] {
    if (!prompt && n) throw ggraph::ArgumentError("ggraph_generate: prompt is NULL");
    if (n > size_t(m->ctx->n_ctx()))
      throw ggraph::ArgumentError("ggraph_generate: a prompt of " + std::to_string(n) +
                                  " tokens; the context holds " + std::to_string(m->ctx->n_ctx()));
    // The caller's struct may be older (smaller) than this one: read what it has.
    ggraph_generate_params in = ggraph_default_generate_params();
    if (params) {
      if (params->size < offsetof(ggraph_generate_params, max_tokens) + sizeof(int32_t) ||
          params->size > sizeof(ggraph_generate_params))
        throw ggraph::ArgumentError("ggraph_generate: params->size " +
                                    std::to_string(params->size) +
                                    " is not a size this "
                                    "library knows (at most " +
                                    std::to_string(sizeof(ggraph_generate_params)) + ")");
      std::memcpy(&in, params, params->size);
    }
    ggraph::GenerateOptions o;
    o.max_tokens = in.max_tokens;
    o.sampling.temperature = in.temperature;
    o.sampling.top_k = in.top_k;
    o.sampling.top_p = in.top_p;
    o.sampling.min_p = in.min_p;
    o.sampling.repeat_penalty = in.repeat_penalty;
    o.sampling.frequency_penalty = in.frequency_penalty;
    o.sampling.presence_penalty = in.presence_penalty;
    o.sampling.penalty_last_n = in.penalty_last_n;
    o.sampling.seed = in.seed;
    o.top_logprobs = in.top_logprobs;
    if (in.flags & ~GGRAPH_GENERATE_IGNORE_EOS)
      throw ggraph::ArgumentError("ggraph_generate: unknown flags " + std::to_string(in.flags));
    o.ignore_eos = (in.flags & GGRAPH_GENERATE_IGNORE_EOS) != 0;
    if (in.tokens_per_launch < 0)
      throw ggraph::ArgumentError("ggraph_generate: tokens_per_launch must be 0 (the default) to " +
                                  std::to_string(ggraph::Context::kMaxLaunch) + ", got " +
                                  std::to_string(in.tokens_per_launch));
    o.chain = in.tokens_per_launch == 0 ? ggraph::kAutoChain : in.tokens_per_launch;
    if (in.n_stop && !in.stop) throw ggraph::ArgumentError("ggraph_generate: stop is NULL");
    for (size_t i = 0; i < in.n_stop; ++i) {
      if (!in.stop[i]) throw ggraph::ArgumentError("ggraph_generate: stop string is NULL");
      o.stop.emplace_back(in.stop[i]);
    }
    ggraph::Generation gen(*m->ctx, std::vector<int32_t>(prompt, prompt + n), std::move(o));
    m->ctx->arm_cancel(epoch);
    // However it ends (a callback's stop, an error part of the way), the last eval's logits are
    // no longer the context's: ggraph_sample then asks for an eval.
    m->logits.clear();
    std::string text;
    ggraph::GeneratedToken tok;
    std::vector<ggraph_token_logprob> top;
    while (gen.next(&text, &tok)) {
      top.clear();
      for (const auto& t : tok.top) top.push_back({t.first, t.second});
      if (on_step && on_step(text.data(), text.size(), tok.id, tok.logprob, top.data(),
                             int32_t(top.size()), user) != 0) {
        gen.close();  // the context as a step at a time leaves it
        return int(GGRAPH_STOP_CALLBACK);
      }
    }
    switch (gen.stop_reason()) {
      case ggraph::StopReason::kEos:
        return int(GGRAPH_STOP_EOS);
      case ggraph::StopReason::kStop:
        return int(GGRAPH_STOP_STRING);
      case ggraph::StopReason::kLength:
        return int(GGRAPH_STOP_LENGTH);
      case ggraph::StopReason::kContextFull:
        return int(GGRAPH_STOP_CONTEXT_FULL);
      case ggraph::StopReason::kCancelled:
        return int(GGRAPH_STOP_CANCELLED);
      case ggraph::StopReason::kNone:
        break;
    }
    throw std::logic_error("ggraph_generate: ended without a reason");
  });
}

int32_t ggraph_detokenize(ggraph_model* m, const int32_t* tokens, size_t n, int render_special,
                          char* buf, int32_t size) {
  return guarded(m, [&] {
    if (!tokens && n) throw ggraph::ArgumentError("ggraph_detokenize: tokens is NULL");
    if (size < 0)
      throw ggraph::ArgumentError("ggraph_detokenize: size must be >= 0, got " +
                                  std::to_string(size));
    const auto& tok = m->ctx->tokenizer();
    ggraph::check_token_ids(tokens, n, tok.n_vocab(), "ggraph_detokenize");
    const std::string text =
        tok.detokenize(std::vector<int32_t>(tokens, tokens + n), render_special != 0);
    if (text.size() > size_t(INT32_MAX))
      throw ggraph::ArgumentError("ggraph_detokenize: the text exceeds 2 GiB");
    if (buf && int64_t(text.size()) <= size) std::memcpy(buf, text.data(), text.size());
    return int(text.size());
  });
}

int ggraph_rewind(ggraph_model* m, int32_t n_keep) {
  return guarded(m, [&] {
    m->ctx->rewind(n_keep);
    m->logits.clear();
    return GGRAPH_OK;
  });
}

int ggraph_copy_prefix(ggraph_model* m, const ggraph_model* from, int32_t n) {
  return guarded(m, [&] {
    if (!from || from->shared != m->shared)
      throw ggraph::ArgumentError("copy_prefix: expected a session of the same model");
    m->ctx->copy_prefix(from->seq, n);
    m->logits.clear();
    return GGRAPH_OK;
  });
}

int64_t ggraph_save_state(ggraph_model* m, void* buf, size_t size) {
  int64_t n = 0;
  const int rc = guarded(m, [&] {
    const std::vector<uint8_t> state = m->ctx->save_state();
    if (buf && state.size() <= size) std::memcpy(buf, state.data(), state.size());
    n = int64_t(state.size());
    return GGRAPH_OK;
  });
  return rc < 0 ? rc : n;
}

int ggraph_load_state(ggraph_model* m, const void* buf, size_t size) {
  return guarded(m, [&] {
    if (!buf && size) throw ggraph::ArgumentError("ggraph_load_state: buf is NULL");
    m->ctx->load_state(static_cast<const uint8_t*>(buf), size);
    m->logits.clear();
    return GGRAPH_OK;
  });
}

int ggraph_save_state_file(ggraph_model* m, const char* path) {
  return guarded(m, [&] {
    if (!path) throw ggraph::ArgumentError("ggraph_save_state_file: path is NULL");
    const std::vector<uint8_t> state = m->ctx->save_state();
    FILE* f = std::fopen(path, "wb");
    if (!f)
      throw ggraph::ArgumentError(std::string("ggraph_save_state_file: cannot write ") + path +
                                  ": " + std::strerror(errno));
    const bool ok = std::fwrite(state.data(), 1, state.size(), f) == state.size();
    if (std::fclose(f) != 0 || !ok)
      throw ggraph::ArgumentError(std::string("ggraph_save_state_file: writing ") + path +
                                  " failed");
    return GGRAPH_OK;
  });
}

int ggraph_load_state_file(ggraph_model* m, const char* path) {
  return guarded(m, [&] {
    if (!path) throw ggraph::ArgumentError("ggraph_load_state_file: path is NULL");
    const std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path, "rb"), &std::fclose);
    if (!f)
      throw ggraph::ArgumentError(std::string("ggraph_load_state_file: cannot read ") + path +
                                  ": " + std::strerror(errno));
    m->ctx->load_state_file(fileno(f.get()), path);
    m->logits.clear();
    return GGRAPH_OK;
  });
}

}  // extern "C"
