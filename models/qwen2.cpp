// Qwen 2 / 2.5: the Llama layout with biases on the q, k and v products and NeoX rope.
#include "blocks.h"

namespace ggraph {

std::unique_ptr<Model> load_qwen2(const GGUFFile& file, Backend& backend) {
  auto m = std::make_unique<PreNormDecoder>();
  m->rope_mode = kRopeNeox;
  ModelLoader ld(file, backend, "qwen2");
  m->hp = read_hparams(ld);
  const Hparams& hp = m->hp;
  m->tok_embd = ld.matrix("token_embd.weight", hp.n_embd, hp.n_vocab);
  for (int il = 0; il < hp.n_layer; ++il) {
    const std::string p = "blk." + std::to_string(il) + ".";
    DecoderLayer L;
    L.attn_norm = ld.vector(p + "attn_norm.weight", hp.n_embd);
    L.attn = load_attention(ld, p, hp);
    L.attn.bq = ld.vector(p + "attn_q.bias", hp.q_width());
    L.attn.bk = ld.vector(p + "attn_k.bias", hp.kv_width());
    L.attn.bv = ld.vector(p + "attn_v.bias", hp.kv_width());
    L.ffn_norm = ld.vector(p + "ffn_norm.weight", hp.n_embd);
    L.ffn = load_feed_forward(ld, p, hp);
    m->layers.push_back(L);
  }
  m->rope_freqs = load_rope_freqs(ld, hp);
  m->output_norm = ld.vector("output_norm.weight", hp.n_embd);
  m->output = load_output(ld, hp, m->tok_embd);
  describe(*m, hp, ld);
  return m;
}

}  // namespace ggraph
