// The pieces every architecture is built from, the way llama.cpp's model files share one
// graph-building context: weights loaded with their shapes and types checked, the shared
// hyper-parameters read and validated, and blocks (norm, attention, feed-forward, logits) that
// take each family's choices as options. An architecture file reads its own keys, loads its
// tensors and says which blocks come in which order.
#pragma once

#include <cmath>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "model.h"

namespace ggraph {

// A tensor as the backend holds it; an absent optional weight has no data.
struct Weight {
  DType type = DType::F32;
  int64_t ne0 = 0, ne1 = 0;
  void* data = nullptr;
  std::string name;
  explicit operator bool() const { return data != nullptr; }
};

// Reads one architecture's keys (`<arch>.<key>`) and uploads its tensors through the backend.
// Every failure is a GGUFError naming the key or tensor, what was expected and what was found.
class ModelLoader {
 public:
  ModelLoader(const GGUFFile& file, Backend& backend, const std::string& arch);

  std::string key(const std::string& k) const { return arch + "." + k; }
  bool has(const std::string& k) const { return file.has(key(k)); }
  // A positive size (at most 2^24): required, or `fallback` when the key is absent.
  int64_t size(const std::string& k) const;
  int64_t size(const std::string& k, int64_t fallback) const;
  // A finite positive number, or `fallback` when the key is absent.
  float positive(const std::string& k, float fallback) const;

  bool has_tensor(const std::string& name) const { return file.tensor(name) != nullptr; }
  // A matrix [ne0, ne1] in any computable type.
  Weight matrix(const std::string& name, int64_t ne0, int64_t ne1);
  // An F32 vector of n (norm weights, biases); `optional` ones may be absent from the file.
  Weight vector(const std::string& name, int64_t n, bool optional = false);
  // A fused matrix [ne0, sum(parts)] as one weight per consecutive run of rows: GGUF rows are
  // contiguous, so each part is a sub-range of the same tensor data.
  std::vector<Weight> split_rows(const std::string& name, int64_t ne0,
                                 const std::vector<int64_t>& parts);

  // Refuses a file with tensors the architecture has not loaded (layers past block_count, a
  // fused tensor where separate ones were read): the model would run without them.
  void check_all_used() const;

  const GGUFFile& file;
  const std::string arch;
  size_t weight_bytes = 0;  // bytes of every tensor loaded so far

 private:
  mutable std::set<std::string> used_;  // the tensors find() returned
  const GGUFTensorInfo& find(const std::string& name) const;
  void check_type(const GGUFTensorInfo& t) const;
  Weight upload(const GGUFTensorInfo& t, size_t offset, size_t bytes, int64_t ne0, int64_t ne1,
                const std::string& name);
  Backend& backend_;
};

// Hyper-parameters the decoders here share, read from the file with validation.
struct Hparams {
  int n_layer = 0, n_embd = 0, n_ff = 0;
  int n_head = 0, n_head_kv = 0;
  int head_dim = 0;  // attention.key_length, or n_embd / n_head when the file has none
  int n_rot = 0;     // rope.dimension_count, or head_dim
  int n_vocab = 0;   // rows of token_embd.weight
  int n_ctx_train = 0;
  int window = 0;  // attention.sliding_window when declared (0: none)
  float rope_base = 10000.0f, norm_eps = 1e-5f;
  float rope_scale = 1.0f;  // linear rope scaling: 1 / rope.scaling.factor

  int64_t q_width() const { return int64_t(n_head) * head_dim; }
  int64_t kv_width() const { return int64_t(n_head_kv) * head_dim; }
};
// Reads the shared keys of `ld.arch`; refuses rope scaling other than linear.
Hparams read_hparams(const ModelLoader& ld);
// The Model fields every architecture fills the same way.
void describe(Model& m, const Hparams& hp, const ModelLoader& ld);

// The weights of one layer's self-attention; the optional ones are empty when unused.
struct AttnWeights {
  Weight wq, wk, wv, wo;
  Weight bq, bk, bv;      // biases added after the q/k/v products (Qwen 2)
  Weight q_norm, k_norm;  // per-head RMS norm weights of head_dim (Qwen 3, Gemma 3)
};
// Loads wq/wk/wv/wo of standard names ("blk.N.attn_q.weight"...) with shapes from hp.
AttnWeights load_attention(ModelLoader& ld, const std::string& prefix, const Hparams& hp);

// output.weight, or token_embd (tied embeddings) when the file has none.
Weight load_output(ModelLoader& ld, const Hparams& hp, const Weight& tok_embd);

// One layer's attention choices.
struct AttnOptions {
  int rope_mode = kRopeNormal;
  float rope_base = 10000.0f;
  float scale = 1.0f;  // multiplies q.k
  int window = 0;      // > 0: a query at position p sees keys p - window + 1 .. p
  float rope_scale = 1.0f;
  Weight rope_freqs;  // per-pair frequency divisors (Llama 3.1's rope_freqs), optional
};
// rope_freqs.weight (n_rot / 2 F32 values) when the file has it, else an empty weight.
Weight load_rope_freqs(ModelLoader& ld, const Hparams& hp);

struct FfnWeights {
  Weight gate, up, down;
};
// Loads ffn_gate/ffn_up/ffn_down of standard names with shapes from hp.
FfnWeights load_feed_forward(ModelLoader& ld, const std::string& prefix, const Hparams& hp);
enum class Activation { Silu, Gelu };  // the gate's activation: SwiGLU or GeGLU

// One batch's graph under construction: the inputs, the KV cache and the blocks.
class GraphContext {
 public:
  GraphContext(Graph& graph, const Batch& batch, const KvCache& kv, const Hparams& hp);

  Tensor* weight(const Weight& w);
  // Token embeddings, times `scale` (Gemma scales by sqrt(n_embd)).
  Tensor* embeddings(const Weight& tok_embd, float scale = 1.0f);
  // rms_norm(x) * w over whole columns.
  Tensor* norm(Tensor* x, const Weight& w);
  // rms_norm of each head of x (head_dim elements) * w, a weight of head_dim.
  Tensor* head_norm(Tensor* x, const Weight& w);
  // Self-attention of layer il on the normed input h, through the output projection: q/k/v
  // products (plus biases), per-head q/k norms, rope, the KV stores, attention. In the last
  // layer only the positions that produce logits go on past attention, and `residual` is cut
  // to the same rows.
  Tensor* attention(int il, Tensor* h, Tensor*& residual, const AttnWeights& w,
                    const AttnOptions& o);
  // The attention's output projection, the last layer's positions cut to those that produce
  // logits first (and `residual` with them).
  Tensor* attention_output(int il, Tensor* attn, Tensor*& residual, const AttnWeights& w);
  // down(act(gate h) * (up h)).
  Tensor* feed_forward(Tensor* h, const FfnWeights& w, Activation act);
  // Final norm, output matrix and optional soft-capping (cap > 0): the graph's output.
  void logits(Tensor* x, const Weight& output_norm, const Weight& output, float softcap = 0.0f);

  Graph& g;
  const Batch& batch;
  const KvCache& kv;
  const Hparams& hp;
  Tensor* tokens;
  Tensor* positions;
  Tensor* out_ids;
  Tensor* slots = nullptr;  // a decode batch of several sequences: Batch::slots
};

// The pre-norm decoder that Llama, Qwen 2/3 and Phi 3 share: per layer norm, attention,
// residual, norm, SwiGLU feed-forward, residual. Their files load it and set its options.
struct DecoderLayer {
  Weight attn_norm, ffn_norm;
  AttnWeights attn;
  FfnWeights ffn;
};
class PreNormDecoder final : public Model {
 public:
  void build(Graph& g, const Batch& b, const KvCache& kv) const override;

  Hparams hp;
  int rope_mode = kRopeNormal;
  Weight rope_freqs;
  Weight tok_embd, output_norm, output;
  std::vector<DecoderLayer> layers;
};
// Loads a PreNormDecoder of `arch`: its keys, the embeddings, per layer the two norms with the
// attention and feed-forward weights that load_layer reads (prefix "blk.N."), rope factors and
// the output. What the families differ in is load_layer and the rope mode.
using LoadLayer = std::function<void(ModelLoader& ld, const Hparams& hp, const std::string& prefix,
                                     DecoderLayer& layer)>;
std::unique_ptr<Model> load_pre_norm_decoder(const GGUFFile& file, Backend& backend,
                                             const std::string& arch, int rope_mode,
                                             const LoadLayer& load_layer);
// load_attention and load_feed_forward: the layer of Llama and of others with standard names.
void load_standard_layer(ModelLoader& ld, const Hparams& hp, const std::string& prefix,
                         DecoderLayer& layer);

}  // namespace ggraph
