// Phi 3 / 3.5 (dense): the Llama layout with NeoX rope, q, k and v in one fused matrix and the
// gate and up projections in another; each is loaded as separate weights over row ranges of
// the same data, so the graph is the Llama graph.
#include "blocks.h"

namespace ggraph {

std::unique_ptr<Model> load_phi3(const GGUFFile& file, Backend& backend) {
  auto m = std::make_unique<PreNormDecoder>();
  m->rope_mode = kRopeNeox;
  // A declared window is honoured (Phi-3-mini's 2047); llama.cpp ignores Phi 3's, so their
  // logits part past that many tokens.
  ModelLoader ld(file, backend, "phi3");
  m->hp = read_hparams(ld);
  const Hparams& hp = m->hp;
  const int64_t E = hp.n_embd;
  m->tok_embd = ld.matrix("token_embd.weight", E, hp.n_vocab);
  for (int il = 0; il < hp.n_layer; ++il) {
    const std::string p = "blk." + std::to_string(il) + ".";
    DecoderLayer L;
    L.attn_norm = ld.vector(p + "attn_norm.weight", E);
    if (ld.has_tensor(p + "attn_qkv.weight")) {
      // Rows: q, then k, then v.
      auto qkv =
          ld.split_rows(p + "attn_qkv.weight", E, {hp.q_width(), hp.kv_width(), hp.kv_width()});
      L.attn.wq = qkv[0];
      L.attn.wk = qkv[1];
      L.attn.wv = qkv[2];
      L.attn.wo = ld.matrix(p + "attn_output.weight", hp.q_width(), E);
    } else {
      L.attn = load_attention(ld, p, hp);  // files converted with separate q, k and v
    }
    L.ffn_norm = ld.vector(p + "ffn_norm.weight", E);
    // Rows: the gate's n_ff, then up's.
    auto gate_up = ld.split_rows(p + "ffn_up.weight", E, {hp.n_ff, hp.n_ff});
    L.ffn.gate = gate_up[0];
    L.ffn.up = gate_up[1];
    L.ffn.down = ld.matrix(p + "ffn_down.weight", hp.n_ff, E);
    m->layers.push_back(L);
  }
  m->rope_freqs = load_rope_freqs(ld, hp);
  m->output_norm = ld.vector("output_norm.weight", E);
  m->output = load_output(ld, hp, m->tok_embd);
  describe(*m, hp, ld);
  return m;
}

}  // namespace ggraph
