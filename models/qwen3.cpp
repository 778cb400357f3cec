// Qwen 3 (dense): the Llama layout with per-head RMS norms of q and k before NeoX rope, and a
// head size of its own (attention.key_length) that need not be n_embd / n_head.
#include "blocks.h"

namespace ggraph {
namespace {

struct Layer {
  Weight attn_norm, ffn_norm;
  AttnWeights attn;
  FfnWeights ffn;
};

class Qwen3 final : public Model {
 public:
  Hparams hp;
  Weight tok_embd, output_norm, output;
  std::vector<Layer> layers;

  void build(Graph& g, const Batch& b, const KvCache& kv) const override {
    GraphContext ctx(g, b, kv, hp);
    AttnOptions attn;
    attn.rope_mode = kRopeNeox;
    attn.rope_base = hp.rope_base;
    attn.scale = 1.0f / std::sqrt(float(hp.head_dim));
    attn.window = hp.window;

    Tensor* x = ctx.embeddings(tok_embd);
    for (int il = 0; il < n_layer; ++il) {
      const Layer& L = layers[il];
      Tensor* h = ctx.norm(x, L.attn_norm);
      Tensor* attn_out = ctx.attention(il, h, x, L.attn, attn);
      x = g.add(x, attn_out);
      Tensor* f = ctx.norm(x, L.ffn_norm);
      x = g.add(x, ctx.feed_forward(f, L.ffn, Activation::Silu));
    }
    ctx.logits(x, output_norm, output);
  }
};

}  // namespace

std::unique_ptr<Model> load_qwen3(const GGUFFile& file, Backend& backend) {
  auto m = std::make_unique<Qwen3>();
  ModelLoader ld(file, backend, "qwen3");
  m->hp = read_hparams(ld);
  const Hparams& hp = m->hp;
  m->tok_embd = ld.matrix("token_embd.weight", hp.n_embd, hp.n_vocab);
  for (int il = 0; il < hp.n_layer; ++il) {
    const std::string p = "blk." + std::to_string(il) + ".";
    Layer L;
    L.attn_norm = ld.vector(p + "attn_norm.weight", hp.n_embd);
    L.attn = load_attention(ld, p, hp);
    L.attn.q_norm = ld.vector(p + "attn_q_norm.weight", hp.head_dim);
    L.attn.k_norm = ld.vector(p + "attn_k_norm.weight", hp.head_dim);
    L.ffn_norm = ld.vector(p + "ffn_norm.weight", hp.n_embd);
    L.ffn = load_feed_forward(ld, p, hp);
    m->layers.push_back(L);
  }
  m->output_norm = ld.vector("output_norm.weight", hp.n_embd);
  m->output = load_output(ld, hp, m->tok_embd);
  describe(*m, hp, ld);
  return m;
}

}  // namespace ggraph
