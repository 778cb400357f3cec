// Phi 3 / 3.5 (dense): the Llama layout with NeoX rope, q, k and v in one fused matrix and the
// gate and up projections in another; each is loaded as separate weights over row ranges of
// the same data, so the graph is the Llama graph.
#include "blocks.h"

namespace ggraph {

// A declared window is honoured (Phi-3-mini's 2047); llama.cpp ignores Phi 3's, so their logits
// part past that many tokens.
std::unique_ptr<Model> load_phi3(const GGUFFile& file, Backend& backend) {
  return load_pre_norm_decoder(
      file, backend, "phi3", kRopeNeox,
      [](ModelLoader& ld, const Hparams& hp, const std::string& p, DecoderLayer& L) {
        const int64_t E = hp.n_embd;
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
        // Rows: the gate's n_ff, then up's.
        auto gate_up = ld.split_rows(p + "ffn_up.weight", E, {hp.n_ff, hp.n_ff});
        L.ffn.gate = gate_up[0];
        L.ffn.up = gate_up[1];
        L.ffn.down = ld.matrix(p + "ffn_down.weight", hp.n_ff, E);
      });
}

}  // namespace ggraph
