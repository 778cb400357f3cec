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
  GGRAPH_ERR_CANCELLED = -5, /* stopped by ggraph_cancel; the model is as it was */
};

typedef struct {
  const char* device;      /* "auto" (default), "cpu", "cuda", "cuda:N" */
  int n_ctx;               /* context length in tokens; 0 = the model's own */
  int n_threads;           /* CPU threads; 0 = all cores; at most 1024 */
  const char* cuda_graphs; /* "patch" (default), "update", "recapture", "off" */
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
GGRAPH_API void ggraph_free(ggraph_model* model);
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
GGRAPH_API void ggraph_reset(ggraph_model* model);
/* Stops the ggraph_eval in progress on model (from any thread, without waiting): a long input
 * stops before its next chunk of tokens and that eval returns GGRAPH_ERR_CANCELLED with the
 * model as it was. No effect when no eval is running. */
GGRAPH_API void ggraph_cancel(ggraph_model* model);

/* Samples from the last eval's logits, with the context's tokens as penalty history.
 * Returns the token id, or a negative error code. */
GGRAPH_API int32_t ggraph_sample(ggraph_model* model, const ggraph_sampling* sampling);

/* Tokenizes text (len bytes). add_bos: 1 yes, 0 no, -1 as the model says. Returns the number
 * of tokens; when that exceeds max_tokens, nothing is written and the count is still returned. */
GGRAPH_API int32_t ggraph_tokenize(ggraph_model* model, const char* text, size_t len, int add_bos,
                                   int special, int32_t* tokens, int32_t max_tokens);
/* Writes a token's bytes (not NUL-terminated); returns their count, or the size needed when
 * larger than size, or a negative error code. */
GGRAPH_API int32_t ggraph_token_to_piece(ggraph_model* model, int32_t token, char* buf,
                                         int32_t size);

#ifdef __cplusplus
}
#endif

#endif /* GGRAPH_H */
