// Llama-family decoder (Llama 2/3, Mistral, TinyLlama, SmolLM2): pre-norm attention with RoPE
// and GQA, then a SwiGLU feed-forward; tied or separate output matrix.
#include "blocks.h"

namespace ggraph {

std::unique_ptr<Model> load_llama(const GGUFFile& file, Backend& backend) {
  return load_pre_norm_decoder(file, backend, "llama", kRopeNormal, load_standard_layer);
}

}  // namespace ggraph
