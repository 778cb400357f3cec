// Llama-family decoder (Llama 2/3, Mistral, TinyLlama, SmolLM2): pre-norm attention with RoPE
// and GQA, then a SwiGLU feed-forward; tied or separate output matrix.
#include <cmath>
#include <string>
#include <vector>

#include "model.h"

namespace ggraph {
namespace {

struct Weight {
  DType type;
  int64_t ne0, ne1;
  void* data;
  std::string name;
};

struct Layer {
  Weight attn_norm, wq, wk, wv, wo, ffn_norm, w_gate, w_up, w_down;
};

class Llama final : public Model {
 public:
  int n_embd = 0, n_head = 0, n_head_kv = 0, head_dim = 0, n_ff = 0, n_rot = 0;
  float rope_base = 10000.0f, norm_eps = 1e-5f;
  Weight tok_embd, output_norm, output;
  std::vector<Layer> layers;

  void build(Graph& g, const Batch& b, const KvCache& kv) const override {
    auto w = [&](const Weight& x) { return g.weight(x.type, x.ne0, x.ne1, x.data, x.name); };
    Tensor* tokens = g.input_i32(b.n_tokens, b.tokens, "tokens");
    Tensor* positions = g.input_i32(b.n_tokens, b.positions, "positions");
    Tensor* out_ids = g.input_i32(b.n_outputs, b.out_ids, "out_ids");
    g.n_tokens = b.n_tokens;
    const int n_kv = b.n_past + b.n_tokens;
    const float kq_scale = 1.0f / std::sqrt(float(head_dim));

    Tensor* x = g.get_rows(w(tok_embd), tokens);
    for (int il = 0; il < n_layer; ++il) {
      const Layer& L = layers[il];
      Tensor* k_cache = g.kv_cache(kv.type, kv.width, kv.n_ctx, kv.k[il], "k_cache");
      Tensor* v_cache = g.kv_cache(kv.type, kv.width, kv.n_ctx, kv.v[il], "v_cache");

      Tensor* h = g.mul(g.rms_norm(x, norm_eps), w(L.attn_norm));
      // The three products of h first, then their ropes: a backend may run products of one
      // input together, and the two ropes together.
      Tensor* qm = g.mul_mat(w(L.wq), h);
      Tensor* km = g.mul_mat(w(L.wk), h);
      Tensor* v = g.mul_mat(w(L.wv), h);
      Tensor* q = g.rope(qm, positions, n_head, head_dim, n_rot, kRopeNormal, rope_base);
      Tensor* k = g.rope(km, positions, n_head_kv, head_dim, n_rot, kRopeNormal, rope_base);
      g.kv_store(k_cache, k, b.n_past);
      g.kv_store(v_cache, v, b.n_past);
      Tensor* attn =
          g.attention(q, k_cache, v_cache, n_head, n_head_kv, head_dim, kq_scale, n_kv, b.n_past);
      if (il == n_layer - 1 && b.n_outputs < b.n_tokens) {
        // Only the positions that produce logits go through the last layer's remainder.
        attn = g.get_rows(attn, out_ids);
        x = g.get_rows(x, out_ids);
      }
      x = g.add(x, g.mul_mat(w(L.wo), attn));

      Tensor* f = g.mul(g.rms_norm(x, norm_eps), w(L.ffn_norm));
      Tensor* ffn = g.swiglu(g.mul_mat(w(L.w_gate), f), g.mul_mat(w(L.w_up), f));
      x = g.add(x, g.mul_mat(w(L.w_down), ffn));
    }
    x = g.mul(g.rms_norm(x, norm_eps), w(output_norm));
    g.set_output(g.mul_mat(w(output), x));
  }
};

class Loader {
 public:
  Loader(const GGUFFile& f, Backend& b) : file_(f), backend_(b) {}

  Weight get(const std::string& name, int64_t ne0, int64_t ne1, size_t* total) {
    const GGUFTensorInfo* t = file_.tensor(name);
    if (!t) throw GGUFError("tensor '" + name + "' is missing from the file");
    const bool ok_shape =
        t->ne[0] == ne0 && t->ne[1] == ne1 && t->ne[2] == 1 && t->ne[3] == 1 && t->n_dims <= 2;
    if (!ok_shape) {
      throw GGUFError("tensor '" + name + "': expected " + std::to_string(ne0) +
                      (ne1 > 1 ? "x" + std::to_string(ne1) : std::string()) + ", file has " +
                      t->shape_str());
    }
    if (!type_traits(t->type).computable) {
      throw GGUFError("tensor '" + name + "' has type " + type_name(t->type) +
                      ", which ggraph does not support (supported: F32, F16, BF16, Q8_0, Q4_0, "
                      "Q4_1)");
    }
    if (ne1 == 1 && t->type != DType::F32) {
      throw GGUFError("tensor '" + name + "': norm weights must be F32, file has " +
                      type_name(t->type));
    }
    *total += t->nbytes;
    return Weight{t->type, ne0, ne1,
                  backend_.upload_weight(t->data, t->nbytes, t->type, ne0, ne1, name), name};
  }

  int64_t hparam(const std::string& key) const {
    const int64_t v = file_.get_int(key);
    if (v <= 0 || v > (int64_t(1) << 24))
      throw GGUFError("metadata " + key + ": expected a positive size, found " + std::to_string(v));
    return v;
  }

 private:
  const GGUFFile& file_;
  Backend& backend_;
};

}  // namespace

std::unique_ptr<Model> load_llama(const GGUFFile& file, Backend& backend) {
  auto m = std::make_unique<Llama>();
  Loader ld(file, backend);
  const std::string a = "llama.";
  m->arch = "llama";
  m->n_layer = int(ld.hparam(a + "block_count"));
  m->n_embd = int(ld.hparam(a + "embedding_length"));
  m->n_ff = int(ld.hparam(a + "feed_forward_length"));
  m->n_head = int(ld.hparam(a + "attention.head_count"));
  m->n_head_kv = file.has(a + "attention.head_count_kv")
                     ? int(ld.hparam(a + "attention.head_count_kv"))
                     : m->n_head;
  m->n_ctx_train = file.has(a + "context_length") ? int(ld.hparam(a + "context_length")) : 2048;
  if (m->n_embd % m->n_head != 0)
    throw GGUFError("embedding_length " + std::to_string(m->n_embd) +
                    " is not a multiple of head_count " + std::to_string(m->n_head));
  if (m->n_head % m->n_head_kv != 0)
    throw GGUFError("head_count " + std::to_string(m->n_head) +
                    " is not a multiple of head_count_kv " + std::to_string(m->n_head_kv));
  m->head_dim = m->n_embd / m->n_head;
  m->n_rot = file.has(a + "rope.dimension_count") ? int(ld.hparam(a + "rope.dimension_count"))
                                                  : m->head_dim;
  if (m->n_rot > m->head_dim || m->n_rot % 2)
    throw GGUFError("rope.dimension_count " + std::to_string(m->n_rot) +
                    " must be even and at most the head size " + std::to_string(m->head_dim));
  m->rope_base = float(file.get_float(a + "rope.freq_base", 10000.0));
  m->norm_eps = float(file.get_float(a + "attention.layer_norm_rms_epsilon", 1e-5));
  if (file.has(a + "rope.scaling.type") &&
      file.get_string(a + "rope.scaling.type", "none") != "none")
    throw GGUFError("rope scaling '" + file.get_string(a + "rope.scaling.type") +
                    "' is not supported yet");
  m->kv_width = int64_t(m->n_head_kv) * m->head_dim;

  const GGUFTensorInfo* embd = file.tensor("token_embd.weight");
  if (!embd) throw GGUFError("tensor 'token_embd.weight' is missing from the file");
  m->n_vocab = int(embd->ne[1]);
  if (file.has(a + "vocab_size") && file.get_int(a + "vocab_size") != m->n_vocab)
    throw GGUFError("llama.vocab_size is " + std::to_string(file.get_int(a + "vocab_size")) +
                    " but token_embd.weight has " + std::to_string(m->n_vocab) + " rows");

  size_t total = 0;
  const int64_t E = m->n_embd, KV = m->kv_width, F = m->n_ff;
  m->tok_embd = ld.get("token_embd.weight", E, m->n_vocab, &total);
  for (int il = 0; il < m->n_layer; ++il) {
    const std::string p = "blk." + std::to_string(il) + ".";
    Layer L;
    L.attn_norm = ld.get(p + "attn_norm.weight", E, 1, &total);
    L.wq = ld.get(p + "attn_q.weight", E, E, &total);
    L.wk = ld.get(p + "attn_k.weight", E, KV, &total);
    L.wv = ld.get(p + "attn_v.weight", E, KV, &total);
    L.wo = ld.get(p + "attn_output.weight", E, E, &total);
    L.ffn_norm = ld.get(p + "ffn_norm.weight", E, 1, &total);
    L.w_gate = ld.get(p + "ffn_gate.weight", E, F, &total);
    L.w_up = ld.get(p + "ffn_up.weight", E, F, &total);
    L.w_down = ld.get(p + "ffn_down.weight", F, E, &total);
    m->layers.push_back(L);
  }
  m->output_norm = ld.get("output_norm.weight", E, 1, &total);
  m->output = file.tensor("output.weight") ? ld.get("output.weight", E, m->n_vocab, &total)
                                           : m->tok_embd;  // tied embeddings
  m->weight_bytes = total;
  return m;
}

}  // namespace ggraph
