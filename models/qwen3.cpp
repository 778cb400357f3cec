// Qwen 3 (dense): the Llama layout with per-head RMS norms of q and k before NeoX rope, and a
// head size of its own (attention.key_length) that need not be n_embd / n_head.
#include "blocks.h"

namespace ggraph {

std::unique_ptr<Model> load_qwen3(const GGUFFile& file, Backend& backend) {
  return load_pre_norm_decoder(
      file, backend, "qwen3", kRopeNeox,
      [](ModelLoader& ld, const Hparams& hp, const std::string& p, DecoderLayer& L) {
        load_standard_layer(ld, hp, p, L);
        L.attn.q_norm = ld.vector(p + "attn_q_norm.weight", hp.head_dim);
        L.attn.k_norm = ld.vector(p + "attn_k_norm.weight", hp.head_dim);
      });
}

}  // namespace ggraph
