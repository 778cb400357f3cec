// What every architecture provides: hyper-parameters, weights, and the per-token graph.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend.h"
#include "gguf.h"
#include "graph.h"
#include "kv_cache.h"

namespace ggraph {

// One call's tokens. Inputs are host arrays the graph's input tensors point at.
struct Batch {
  const int32_t* tokens = nullptr;     // [n_tokens]
  const int32_t* positions = nullptr;  // [n_tokens], n_past + i
  const int32_t* out_ids = nullptr;    // [n_outputs], which positions produce logits
  int n_tokens = 0;
  int n_outputs = 0;
  int n_past = 0;  // tokens already in the KV cache
  // Output the final normalized hidden state, F32 [n_embd, n_outputs], instead of the logits.
  bool embeddings = false;
  // A decode batch of several sequences (n_seqs > 0): token i is the next one of sequence
  // slots[i], at position slots[n_seqs + i] (positions[i] is that too); every sequence's cache
  // lies in the pool of `pool` (any one sequence's cache). kv and n_past of the build call are
  // then unused.
  const KvCache* pool = nullptr;
  const int32_t* slots = nullptr;  // [2 * n_seqs]
  int n_seqs = 0;
  // When set, the token ids are this tensor of the graph being built (a token a Sample op wrote,
  // Graph::token_at) instead of the input `tokens`.
  Tensor* token_ids = nullptr;
  // When set, the positions are this I32 input of the graph being built instead of an input
  // made of `positions` (a chain's loop advances them, Graph::chain_loop).
  Tensor* position_ids = nullptr;
};

class Model {
 public:
  virtual ~Model() = default;
  // Builds the graph of one batch: logits F32 [n_vocab, n_outputs] as graph.output().
  virtual void build(Graph& graph, const Batch& batch, const KvCache& kv) const = 0;

  std::string arch;
  int n_vocab = 0;
  int64_t n_embd = 0;
  int n_layer = 0;
  int64_t kv_width = 0;  // n_head_kv * head_dim
  int head_dim = 0;      // one attention head's width (of keys and of values)
  int n_ctx_train = 0;
  size_t weight_bytes = 0;
  // Each layer's attention window (0: every earlier position). A windowed layer's KV cache may
  // be a ring of fewer rows than the context (KvCache).
  std::vector<int> layer_window;
};

// Reads the architecture from general.architecture and loads its weights through the backend.
// Throws GGUFError naming a missing tensor, a wrong shape or an unsupported type.
std::unique_ptr<Model> load_model(const GGUFFile& file, Backend& backend);

// Architecture loaders (one per file in models/).
std::unique_ptr<Model> load_llama(const GGUFFile& file, Backend& backend);
std::unique_ptr<Model> load_gemma3(const GGUFFile& file, Backend& backend);
std::unique_ptr<Model> load_qwen2(const GGUFFile& file, Backend& backend);
std::unique_ptr<Model> load_qwen3(const GGUFFile& file, Backend& backend);
std::unique_ptr<Model> load_phi3(const GGUFFile& file, Backend& backend);

}  // namespace ggraph
