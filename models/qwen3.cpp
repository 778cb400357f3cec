// Qwen 3 (dense): the Llama layout with per-head RMS norms of q and k before NeoX rope, and a
// head size of its own (attention.key_length) that need not be n_embd / n_head.
#include "blocks.h"

namespace ggraph {

std::unique_ptr<Model> load_qwen3(const GGUFFile& file, Backend& backend) {
  auto m = std::make_unique<PreNormDecoder>();
  m->rope_mode = kRopeNeox;
  ModelLoader ld(file, backend, "qwen3");
  m->hp = read_hparams(ld);
  const Hparams& hp = m->hp;
  m->tok_embd = ld.matrix("token_embd.weight", hp.n_embd, hp.n_vocab);
  for (int il = 0; il < hp.n_layer; ++il) {
    const std::string p = "blk." + std::to_string(il) + ".";
    DecoderLayer L;
    L.attn_norm = ld.vector(p + "attn_norm.weight", hp.n_embd);
    L.attn = load_attention(ld, p, hp);
    L.attn.q_norm = ld.vector(p + "attn_q_norm.weight", hp.head_dim);
    L.attn.k_norm = ld.vector(p + "attn_k_norm.weight", hp.head_dim);
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
