// Llama-family decoder (Llama 2/3, Mistral, TinyLlama, SmolLM2): pre-norm attention with RoPE
// and GQA, then a SwiGLU feed-forward; tied or separate output matrix.
#include "blocks.h"

namespace ggraph {

std::unique_ptr<Model> load_llama(const GGUFFile& file, Backend& backend) {
  auto m = std::make_unique<PreNormDecoder>();
  m->rope_mode = kRopeNormal;
  ModelLoader ld(file, backend, "llama");
  m->hp = read_hparams(ld);
  const Hparams& hp = m->hp;
  const int64_t E = hp.n_embd;
  m->tok_embd = ld.matrix("token_embd.weight", E, hp.n_vocab);
  for (int il = 0; il < hp.n_layer; ++il) {
    const std::string p = "blk." + std::to_string(il) + ".";
    DecoderLayer L;
    L.attn_norm = ld.vector(p + "attn_norm.weight", E);
    L.attn = load_attention(ld, p, hp);
    L.ffn_norm = ld.vector(p + "ffn_norm.weight", E);
    L.ffn = load_feed_forward(ld, p, hp);
    m->layers.push_back(L);
  }
  m->rope_freqs = load_rope_freqs(ld, hp);
  m->output_norm = ld.vector("output_norm.weight", E);
  m->output = load_output(ld, hp, m->tok_embd);
  describe(*m, hp, ld);
  return m;
}

}  // namespace ggraph
