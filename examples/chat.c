/* A small chat program on ggraph's C API, the starting point of an embedding application: load a
 * model, read a line, stream the reply token by token, stop on Ctrl-C without losing the model.
 *
 *   cmake -S examples -B build-example -DCMAKE_PREFIX_PATH="$(python -c 'import ggraph;
 * print(ggraph.cmake_prefix_path())')" cmake --build build-example && build-example/ggraph_chat
 * model.gguf
 *
 * Each line of input is a user turn in ChatML (<|im_start|>user ... <|im_end|>), the format of
 * the default SmolLM2 model; each turn passes the whole conversation, and the library evaluates
 * only what its context does not hold yet. */
#include <ggraph.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static ggraph_model* g_model = NULL;

static void on_sigint(int sig) {
  (void)sig;
  ggraph_cancel(g_model); /* async-signal-safe: it sets a flag */
}

/* The conversation's token ids: what the next turn's prompt starts with. */
typedef struct {
  int32_t ids[8192];
  size_t n;
} conversation;

static int append(conversation* c, const int32_t* ids, size_t n) {
  if (c->n + n > sizeof c->ids / sizeof c->ids[0]) return 0;
  memcpy(c->ids + c->n, ids, n * sizeof ids[0]);
  c->n += n;
  return 1;
}

static int append_text(conversation* c, const char* text, int special) {
  int32_t buf[4096];
  const int32_t n = ggraph_tokenize(g_model, text, strlen(text), 0, special, buf, 4096);
  return n >= 0 && n <= 4096 && append(c, buf, (size_t)n);
}

static int on_step(const char* text, size_t len, int32_t token, float logprob,
                   const ggraph_token_logprob* top, int32_t n_top, void* user) {
  (void)logprob, (void)top, (void)n_top;
  fwrite(text, 1, len, stdout);
  fflush(stdout);
  /* The reply joins the conversation (the end-of-turn token too, when sampled). */
  return token >= 0 && !append((conversation*)user, &token, 1);
}

int main(int argc, char** argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s MODEL.gguf [max_tokens]\n", argv[0]);
    return 2;
  }
  char err[512];
  ggraph_params params = ggraph_default_params();
  g_model = ggraph_load(argv[1], &params, err, sizeof err);
  if (!g_model) {
    fprintf(stderr, "cannot load %s: %s\n", argv[1], err);
    return 1;
  }
  signal(SIGINT, on_sigint);

  ggraph_generate_params gen = ggraph_default_generate_params();
  gen.max_tokens = argc > 2 ? atoi(argv[2]) : 256;
  gen.temperature = 0.0f;

  static conversation conv;
  char line[4096];
  int status = 0;
  while (fgets(line, sizeof line, stdin)) {
    line[strcspn(line, "\n")] = '\0';
    /* The turn's markers are control tokens; the user's text is plain text, never markers. */
    if (!append_text(&conv, "<|im_start|>user\n", 1) || !append_text(&conv, line, 0) ||
        !append_text(&conv, "<|im_end|>\n<|im_start|>assistant\n", 1)) {
      fprintf(stderr, "the conversation is too long\n");
      status = 1;
      break;
    }
    /* The whole conversation each turn: the library reuses the prefix its context holds. */
    const int rc = ggraph_generate(g_model, conv.ids, conv.n, &gen, on_step, &conv);
    if (rc < 0) {
      fprintf(stderr, "\ngenerate: %s\n", ggraph_last_error(g_model));
      status = 1;
      break;
    }
    printf("\n[%s]\n", rc == GGRAPH_STOP_EOS         ? "end of turn"
                       : rc == GGRAPH_STOP_CANCELLED ? "cancelled"
                       : rc == GGRAPH_STOP_LENGTH    ? "max tokens"
                                                     : "stopped");
    fflush(stdout);
    /* Close the assistant's turn as the template does. */
    if (!append_text(&conv, rc == GGRAPH_STOP_EOS ? "\n" : "<|im_end|>\n", 1)) {
      fprintf(stderr, "the conversation is too long\n");
      status = 1;
      break;
    }
  }
  ggraph_free(g_model);
  return status;
}
