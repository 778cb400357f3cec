#include "kv_cache.h"

namespace ggraph {

size_t KvCache::bytes() const {
  size_t total = 0;
  for (int l = 0; l < n_layer; ++l) total += 2 * layer_bytes(l);
  return total;
}

void KvCache::allocate(Backend& backend, DType cache_type, int layers, int64_t row_width,
                       int context, const std::vector<int>& layer_rows) {
  type = cache_type;
  n_layer = layers;
  width = row_width;
  n_ctx = context;
  rows = layer_rows.empty() ? std::vector<int>(size_t(layers), context) : layer_rows;
  uint8_t* base = static_cast<uint8_t*>(backend.alloc_kv(bytes()));
  k.resize(n_layer);
  v.resize(n_layer);
  for (int l = 0; l < n_layer; ++l) {
    k[l] = base;
    v[l] = base + layer_bytes(l);
    base += 2 * layer_bytes(l);
  }
}

}  // namespace ggraph
