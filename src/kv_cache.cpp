#include "kv_cache.h"

namespace ggraph {

void KvCache::allocate(Backend& backend, DType cache_type, int layers, int64_t row_width,
                       int context) {
  type = cache_type;
  n_layer = layers;
  width = row_width;
  n_ctx = context;
  const size_t per = layer_bytes();
  uint8_t* base = static_cast<uint8_t*>(backend.alloc_kv(per * 2 * size_t(n_layer)));
  k.resize(n_layer);
  v.resize(n_layer);
  for (int l = 0; l < n_layer; ++l) {
    k[l] = base + per * (2 * size_t(l));
    v[l] = base + per * (2 * size_t(l) + 1);
  }
}

}  // namespace ggraph
