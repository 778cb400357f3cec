/* Several conversations over one load of a model, stepped together: each prompt gets a session of
 * its own, and every step evaluates the next token of all of them at once
 * (ggraph_decode_batch), reading the weights once for the whole batch. Greedy decoding; each
 * session's reply is printed on a line of its own once all are done.
 *
 *   build-example/ggraph_batch model.gguf MAX_TOKENS "first prompt" "second prompt" ...
 *
 * (Built beside ggraph_chat by examples/CMakeLists.txt.) */
#include <ggraph.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_SEQS 16
#define MAX_REPLY 1024

typedef struct {
  ggraph_model* handle; /* the model itself for the first prompt, a session for the others */
  int32_t reply[MAX_REPLY];
  int n_reply;
  int done;
} sequence;

/* The token a sequence takes next: the argmax of its last logits (ggraph_sample, greedy). */
static int32_t greedy(ggraph_model* m) {
  ggraph_sampling s = ggraph_default_sampling();
  s.temperature = 0.0f;
  s.repeat_penalty = 1.0f;
  return ggraph_sample(m, &s);
}

int main(int argc, char** argv) {
  if (argc < 4 || argc - 3 > MAX_SEQS) {
    fprintf(stderr, "usage: %s MODEL.gguf MAX_TOKENS PROMPT [PROMPT ...] (1 to %d prompts)\n",
            argv[0], MAX_SEQS);
    return 2;
  }
  const int n = argc - 3;
  int max_tokens = atoi(argv[2]);
  if (max_tokens < 1 || max_tokens > MAX_REPLY) max_tokens = MAX_REPLY;

  char err[512];
  ggraph_params params = ggraph_default_params();
  params.n_seq_max = n; /* the model and n - 1 sessions, each with its own KV cache */
  ggraph_model* model = ggraph_load(argv[1], &params, err, sizeof err);
  if (!model) {
    fprintf(stderr, "cannot load %s: %s\n", argv[1], err);
    return 1;
  }
  static sequence seqs[MAX_SEQS];
  int status = 0;
  for (int i = 0; i < n && status == 0; ++i) {
    seqs[i].handle = i == 0 ? model : ggraph_session_open(model);
    int32_t ids[512];
    const int32_t k = seqs[i].handle ? ggraph_tokenize(seqs[i].handle, argv[3 + i],
                                                       strlen(argv[3 + i]), -1, 0, ids, 512)
                                     : -1;
    /* Each prompt on its own: a long one does not hold the others up once they decode. */
    if (k < 1 || k > 512 || ggraph_eval(seqs[i].handle, ids, (size_t)k, NULL) != GGRAPH_OK) {
      fprintf(stderr, "prompt %d: %s\n", i + 1, ggraph_last_error(model));
      status = 1;
    }
  }

  ggraph_model* batch[MAX_SEQS];
  int32_t next[MAX_SEQS];
  for (int step = 0; step < max_tokens && status == 0; ++step) {
    /* The sequences still going, each with the token its last logits choose. */
    int m = 0;
    for (int i = 0; i < n; ++i) {
      if (seqs[i].done) continue;
      const int32_t t = greedy(seqs[i].handle);
      if (t < 0 || ggraph_is_end_of_generation(seqs[i].handle, t) ||
          ggraph_n_past(seqs[i].handle) >= ggraph_n_ctx(seqs[i].handle)) {
        seqs[i].done = 1;
        continue;
      }
      seqs[i].reply[seqs[i].n_reply++] = t;
      batch[m] = seqs[i].handle;
      next[m++] = t;
    }
    if (m == 0) break;
    if (ggraph_decode_batch(batch, next, (size_t)m, NULL) != GGRAPH_OK) {
      fprintf(stderr, "decode_batch: %s\n", ggraph_last_error(model));
      status = 1;
    }
  }

  for (int i = 0; i < n && status == 0; ++i) {
    char text[8 * MAX_REPLY];
    const int32_t len = ggraph_detokenize(seqs[i].handle, seqs[i].reply, (size_t)seqs[i].n_reply, 0,
                                          text, (int32_t)sizeof text - 1);
    if (len < 0 || len >= (int32_t)sizeof text) {
      fprintf(stderr, "detokenize: %s\n", len < 0 ? ggraph_last_error(model) : "reply too long");
      status = 1;
      break;
    }
    text[len] = '\0';
    for (char* c = text; *c; ++c)
      if (*c == '\n' || *c == '\r') *c = ' '; /* one line a sequence */
    printf("[%d] %s\n", i + 1, text);
  }
  /* Sessions first or last: the weights stay until the model and every session are freed. */
  for (int i = n - 1; i >= 0; --i)
    if (seqs[i].handle) ggraph_free(seqs[i].handle);
  return status;
}
