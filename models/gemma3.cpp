// Gemma 3: embeddings scaled by sqrt(n_embd); attention with per-head q/k norms and NeoX rope,
// sliding-window on five of every six layers (with their own rope base); norms after the
// attention and after the GeGLU feed-forward as well as before; tied output; optional final
// logit soft-capping.
#include "blocks.h"

namespace ggraph {
namespace {

struct Layer {
  Weight attn_norm, post_attn_norm, ffn_norm, post_ffn_norm;
  AttnWeights attn;
  FfnWeights ffn;
  AttnOptions opts;  // differs between windowed and global layers
};

class Gemma3 final : public Model {
 public:
  Hparams hp;
  float softcap = 0.0f;  // 0: none
  Weight tok_embd, output_norm, output;
  std::vector<Layer> layers;

  void build(Graph& g, const Batch& b, const KvCache& kv) const override {
    GraphContext ctx(g, b, kv, hp);
    Tensor* x = ctx.embeddings(tok_embd, std::sqrt(float(hp.n_embd)));
    for (int il = 0; il < n_layer; ++il) {
      const Layer& L = layers[il];
      Tensor* h = ctx.norm(x, L.attn_norm);
      Tensor* attn_out = ctx.attention(il, h, x, L.attn, L.opts);
      x = g.add(x, ctx.norm(attn_out, L.post_attn_norm));
      Tensor* f = ctx.norm(x, L.ffn_norm);
      Tensor* ffn_out = ctx.feed_forward(f, L.ffn, Activation::Gelu);
      x = g.add(x, ctx.norm(ffn_out, L.post_ffn_norm));
    }
    ctx.logits(x, output_norm, output, softcap);
  }
};

}  // namespace

std::unique_ptr<Model> load_gemma3(const GGUFFile& file, Backend& backend) {
  auto m = std::make_unique<Gemma3>();
  ModelLoader ld(file, backend, "gemma3");
  m->hp = read_hparams(ld);
  const Hparams& hp = m->hp;
  // Files declare the window but not which layers use it: Gemma 3 was trained with five
  // windowed layers, then one global, repeating (llama.cpp assumes the same period of 6).
  const int period = int(ld.size("attention.sliding_window_pattern", 6));
  if (ld.has("final_logit_softcapping")) m->softcap = ld.positive("final_logit_softcapping", 0.0f);
  // Gemma 3 27B scales queries by n_embd / n_head (its query_pre_attn_scalar), the others by
  // the head size; the file does not say which, so the layer count does, as in llama.cpp.
  const float scale_dim = hp.n_layer == 62 ? float(hp.n_embd / hp.n_head) : float(hp.head_dim);

  const int64_t E = hp.n_embd, D = hp.head_dim;
  m->tok_embd = ld.matrix("token_embd.weight", E, hp.n_vocab);
  for (int il = 0; il < hp.n_layer; ++il) {
    const std::string p = "blk." + std::to_string(il) + ".";
    Layer L;
    L.attn_norm = ld.vector(p + "attn_norm.weight", E);
    L.attn = load_attention(ld, p, hp);
    L.attn.q_norm = ld.vector(p + "attn_q_norm.weight", D);
    L.attn.k_norm = ld.vector(p + "attn_k_norm.weight", D);
    L.post_attn_norm = ld.vector(p + "post_attention_norm.weight", E);
    L.ffn_norm = ld.vector(p + "ffn_norm.weight", E);
    L.ffn = load_feed_forward(ld, p, hp);
    L.post_ffn_norm = ld.vector(p + "post_ffw_norm.weight", E);
    const bool windowed = hp.window > 0 && (il + 1) % period != 0;
    L.opts.rope_mode = kRopeNeox;
    // Windowed layers keep the original rope base; global layers take the file's (1e6).
    L.opts.rope_base = windowed ? 10000.0f : hp.rope_base;
    L.opts.window = windowed ? hp.window : 0;
    // Linear rope scaling (Gemma 3 4B and larger) applies to the global layers only.
    L.opts.rope_scale = windowed ? 1.0f : hp.rope_scale;
    L.opts.scale = 1.0f / std::sqrt(scale_dim);
    m->layers.push_back(L);
  }
  m->output_norm = ld.vector("output_norm.weight", E);
  m->output = load_output(ld, hp, m->tok_embd);
  ld.check_all_used();
  describe(*m, hp, ld);
  for (int il = 0; il < hp.n_layer; ++il) m->layer_window[size_t(il)] = m->layers[il].opts.window;
  return m;
}

}  // namespace ggraph
