// Qwen 2 / 2.5: the Llama layout with biases on the q, k and v products and NeoX rope.
#include "blocks.h"

namespace ggraph {

std::unique_ptr<Model> load_qwen2(const GGUFFile& file, Backend& backend) {
  return load_pre_norm_decoder(
      file, backend, "qwen2", kRopeNeox,
      [](ModelLoader& ld, const Hparams& hp, const std::string& p, DecoderLayer& L) {
        load_standard_layer(ld, hp, p, L);
        L.attn.bq = ld.vector(p + "attn_q.bias", hp.q_width());
        L.attn.bk = ld.vector(p + "attn_k.bias", hp.kv_width());
        L.attn.bv = ld.vector(p + "attn_v.bias", hp.kv_width());
      });
}

}  // namespace ggraph
