/* ggraph C API: load a GGUF model, evaluate tokens, sample, tokenize.
 *
 * Every function that can fail returns a negative GGRAPH_ERR_* code (or NULL) and leaves a
 * message for ggraph_last_error() in the calling thread; a failed call leaves the model as it
 * was. A model may be shared between threads: calls on it are serialized (a caller waits for
 * the call in progress). */
#ifndef GGRAPH_H
#define GGRAPH_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define GGRAPH_API __declspec(dllexport)
#else
#define GGRAPH_API __attribute__((visibility("default")))
#endif

typedef struct ggraph_model ggraph_model;

enum {
  GGRAPH_OK = 0,
  GGRAPH_ERR_FILE = -1,     /* missing or malformed model file */
  GGRAPH_ERR_ARGUMENT = -2, /* bad token id, full context, bad option */
  GGRAPH_ERR_DEVICE = -3,   /* CUDA error, out of memory */
  GGRAPH_ERR_INTERNAL = -4,
  GGRAPH_ERR_CANCELLED = -5, /* stopped by ggraph_cancel; the model is as it was (but see
                                ggraph_generate) */
};

/* Set .size to sizeof(ggraph_params) (ggraph_default_params does): a later version may add
 * fields at the end and reads only what the caller's size covers. */
typedef struct {
  size_t size;
  const char* device; /* "auto" (default), "cpu", "cuda", "cuda:N" */
  /* context length in tokens; 0 = the model's training length; -1 (default) = 2048, or the
   * training length where that is shorter */
  int n_ctx;
  int n_threads;           /* CPU threads; 0 = all cores; at most 1024 */
  const char* cuda_graphs; /* "patch" (default), "update", "recapture", "off" */
  /* the KV cache's elements: "auto" (default: f16), "f32" (CPU), "f16",
   * "q8_0" */
  const char* kv_type;
  /* 1: accept an n_ctx past the model's training context (quality usually drops there);
   * 0 (default): refuse it */
  int allow_longer_context;
  /* sequences the model holds at once: itself and up to n_seq_max - 1 sessions
   * (ggraph_session_open), each with its own KV cache of n_ctx tokens, allocated at load;
   * 0 or 1 (default): the model alone; at most 256 */
  int64_t n_seq_max;
  /* 1: sliding-window layers keep every position's KV rows; 0 (default): only their window and
   * one batch's (a ring; a rewind past what it kept makes the next eval re-evaluate the tokens
   * kept) */
  int swa_full;
} ggraph_params;

typedef struct {
  float temperature; /* 0 = greedy */
  int32_t top_k;     /* 0 = off */
  float top_p;       /* 1 = off */
  float min_p;       /* 0 = off */
  float repeat_penalty;
  uint64_t seed;
} ggraph_sampling;

GGRAPH_API ggraph_params ggraph_default_params(void);
GGRAPH_API ggraph_sampling ggraph_default_sampling(void);

/* Loads a model; returns NULL on failure with the reason in err (when err_size > 0). */
GGRAPH_API ggraph_model* ggraph_load(const char* path, const ggraph_params* params, char* err,
                                     size_t err_size);
/* Frees a model or closes a session. The weights and context stay until the model and every
 * session of it are freed, in any order. */
GGRAPH_API void ggraph_free(ggraph_model* model);
/* A session: an independent conversation (its own KV cache, tokens and position) over the
 * model's loaded weights, taken from the n_seq_max the model was loaded with. It is a
 * ggraph_model handle: every call works on the handle it is given, and calls on a model and its
 * sessions are serialized. NULL, with the reason in ggraph_last_error, when all are in use;
 * ggraph_free closes it. */
GGRAPH_API ggraph_model* ggraph_session_open(ggraph_model* model);
/* The calling thread's last error message ("" after a call that succeeded); model is not
 * used. */
GGRAPH_API const char* ggraph_last_error(const ggraph_model* model);

GGRAPH_API int32_t ggraph_n_vocab(const ggraph_model* model);
GGRAPH_API int32_t ggraph_n_ctx(const ggraph_model* model);
GGRAPH_API int32_t ggraph_n_past(const ggraph_model* model);
GGRAPH_API int32_t ggraph_eos(const ggraph_model* model);
GGRAPH_API int ggraph_is_end_of_generation(const ggraph_model* model, int32_t token);

/* Appends n tokens to the context; writes the last position's n_vocab logits to `logits`
 * (may be NULL). Returns GGRAPH_OK or an error code. */
GGRAPH_API int ggraph_eval(ggraph_model* model, const int32_t* tokens, size_t n, float* logits);
/* The next token of n sequences at once (a model and its sessions, each at most once: seqs[i]
 * takes tokens[i]), in one step that reads the weights once for all of them. Writes row i of
 * `logits` (n * n_vocab floats; may be NULL) for seqs[i], and each sequence's row becomes its
 * last logits for ggraph_sample. Every id, sequence and remaining context is checked before
 * anything changes. Returns GGRAPH_OK or an error code. */
GGRAPH_API int ggraph_decode_batch(ggraph_model* const* seqs, const int32_t* tokens, size_t n,
                                   float* logits);
GGRAPH_API void ggraph_reset(ggraph_model* model);
/* Stops the ggraph_eval in progress on model (from any thread, without waiting): a long input
 * stops before its next chunk of tokens and that eval returns GGRAPH_ERR_CANCELLED with the
 * model as it was. An eval that has been called and still waits for another call on the model
 * counts as in progress. No effect when no eval is running. */
GGRAPH_API void ggraph_cancel(ggraph_model* model);

/* Samples from the last eval's logits, with the context's tokens as penalty history.
 * Returns the token id, or a negative error code. */
GGRAPH_API int32_t ggraph_sample(ggraph_model* model, const ggraph_sampling* sampling);

/* Tokenizes text (len bytes). add_bos: 1 yes, 0 no, -1 as the model says. Returns the number
 * of tokens; when that exceeds max_tokens, nothing is written and the count is still returned. */
GGRAPH_API int32_t ggraph_tokenize(ggraph_model* model, const char* text, size_t len, int add_bos,
                                   int special, int32_t* tokens, int32_t max_tokens);
/* Writes a token's bytes (not NUL-terminated); returns their count, or the size needed when
 * larger than size (>= 0), or a negative error code. */
GGRAPH_API int32_t ggraph_token_to_piece(ggraph_model* model, int32_t token, char* buf,
                                         int32_t size);

/* ---- Generation ---------------------------------------------------------------------------
 * The whole loop in the library: the prompt's prefill (reusing the prefix the context already
 * holds), then per token: sampling, end of generation, stop strings, UTF-8 text as it becomes
 * whole. Set .size to sizeof(ggraph_generate_params) (ggraph_default_generate_params does): a
 * later version may add fields at the end and reads only what the caller's size covers. */
typedef struct {
  size_t size;
  int32_t max_tokens;      /* >= 0 */
  float temperature;       /* 0 = greedy */
  int32_t top_k;           /* 0 = off */
  float top_p;             /* 1 = off */
  float min_p;             /* 0 = off */
  float repeat_penalty;    /* 1 = off */
  float frequency_penalty; /* 0 = off */
  float presence_penalty;  /* 0 = off */
  int32_t penalty_last_n;  /* -1 = the whole context, 0 = off */
  uint64_t seed;           /* UINT64_MAX = a fresh random seed */
  const char* const* stop; /* n_stop non-empty NUL-terminated strings, or NULL */
  size_t n_stop;
  int32_t top_logprobs; /* 0 to 20 alternatives passed to the callback each step */
  uint64_t flags;       /* GGRAPH_GENERATE_* bits (a field past the padding of older versions) */
  /* Decode steps a launch, sampled on the backend: 0 = the backend's default (a loop of 256 on
   * CUDA with graphs in patch or recapture mode, else 8 on CUDA, 1 on the CPU); 1 evaluates and
   * samples a token at a time on the host; up to 256 on CUDA with graphs in patch or recapture
   * mode (a loop on the GPU), 16 elsewhere. The same tokens. */
  int32_t tokens_per_launch;
} ggraph_generate_params;

/* An end-of-generation token is generated as any other (for benchmarks). */
#define GGRAPH_GENERATE_IGNORE_EOS ((uint64_t)1)

typedef struct {
  int32_t token;
  float logprob;
} ggraph_token_logprob;

/* Called for every step: `text` (len bytes, not NUL-terminated, often empty while text is held
 * back) became final; `token` was sampled (-1 for a last call that only flushes text), with its
 * log-probability under the model's logits and the n_top most likely tokens. Return 0 to go on,
 * anything else to stop (ggraph_generate then returns GGRAPH_STOP_CALLBACK). */
typedef int (*ggraph_step_fn)(const char* text, size_t len, int32_t token, float logprob,
                              const ggraph_token_logprob* top, int32_t n_top, void* user);

enum {
  GGRAPH_STOP_EOS = 1,          /* an end-of-generation token */
  GGRAPH_STOP_STRING = 2,       /* a stop string (not passed to the callback) */
  GGRAPH_STOP_LENGTH = 3,       /* max_tokens */
  GGRAPH_STOP_CONTEXT_FULL = 4, /* the context is full */
  GGRAPH_STOP_CANCELLED = 5,    /* ggraph_cancel */
  GGRAPH_STOP_CALLBACK = 6,     /* the callback returned non-zero */
};

GGRAPH_API ggraph_generate_params ggraph_default_generate_params(void);
/* Generates a continuation of the n prompt tokens. Returns a GGRAPH_STOP_* reason (> 0) or a
 * negative error code; a refused call (bad ids or parameters, a prompt that does not fit) leaves
 * the model as it was. ggraph_cancel from another thread stops it at the next token
 * (GGRAPH_STOP_CANCELLED), or while the prompt goes in, before its next chunk of tokens
 * (GGRAPH_ERR_CANCELLED): the model then holds what it held, except that a prompt that differs
 * from the model's tokens has already replaced those past the prefix the two share. on_step
 * runs while the model is held: it must not call ggraph_* functions on this model or any of its
 * sessions (ggraph_cancel excepted). On CUDA the tokens are decoded as a loop of up to 256 a
 * launch (8 in the graph modes off and update) and sampled on the GPU, the same tokens, each round
 * of 8 reaching on_step as the GPU makes it (.tokens_per_launch sets the count). However the
 * generation ends, the model then holds the prompt and the generated tokens, less a final one
 * that ended it (an end-of-generation token, one completing a stop string, or one the full
 * context had no room for).
 */
GGRAPH_API int ggraph_generate(ggraph_model* model, const int32_t* prompt, size_t n,
                               const ggraph_generate_params* params, ggraph_step_fn on_step,
                               void* user);

/* Writes the text of n tokens (special tokens rendered when render_special) to buf when it
 * fits in size bytes; returns the text's length in bytes (call again with a larger buffer if it
 * exceeds size), or a negative error code. Not NUL-terminated. */
GGRAPH_API int32_t ggraph_detokenize(ggraph_model* model, const int32_t* tokens, size_t n,
                                     int render_special, char* buf, int32_t size);
/* Keeps the first n_keep tokens of the context and forgets the rest. */
GGRAPH_API int ggraph_rewind(ggraph_model* model, int32_t n_keep);
/* Replaces model's tokens and KV cache with the first n of `from`'s, another session of the
 * same model (or the model itself): a prompt's prefix that `from` holds, its cache rows copied
 * on the device instead of evaluated again. GGRAPH_ERR_ARGUMENT, changing nothing, for a
 * session of another model, model itself, n past from's tokens, or a model with sliding-window
 * layers. */
GGRAPH_API int ggraph_copy_prefix(ggraph_model* model, const ggraph_model* from, int32_t n);

/* ---- State ------------------------------------------------------------------------------
 * A context's tokens and KV cache rows, to resume a conversation later or elsewhere: in a
 * buffer (ggraph_save_state returns the bytes it takes, writing them when size suffices; call it
 * with NULL to learn the size) or a file. Loading checks the state belongs to this model file
 * and a cache of this kv_type, and fits the context, before it changes anything. */
GGRAPH_API int64_t ggraph_save_state(ggraph_model* model, void* buf, size_t size);
GGRAPH_API int ggraph_load_state(ggraph_model* model, const void* buf, size_t size);
GGRAPH_API int ggraph_save_state_file(ggraph_model* model, const char* path);
GGRAPH_API int ggraph_load_state_file(ggraph_model* model, const char* path);

#ifdef __cplusplus
}
#endif

#endif /* GGRAPH_H */
