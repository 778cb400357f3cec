#include "kv_cache.h"

namespace ggraph {

size_t KvCache::bytes() const {
  size_t total = 0;
  for (int l = 0; l < n_layer; ++l) total += 2 * layer_bytes(l);
  return total;
}

void KvCache::allocate(Backend& backend, DType cache_type, int layers, int64_t row_width,
                       int context, const std::vector<int>& layer_rows) {
  *this = allocate_pool(backend, cache_type, layers, row_width, context, layer_rows, 1)[0];
}

std::vector<KvCache> KvCache::allocate_pool(Backend& backend, DType cache_type, int layers,
                                            int64_t row_width, int context,
                                            const std::vector<int>& layer_rows, int n_seq) {
  KvCache c;
  c.type = cache_type;
  c.n_layer = layers;
  c.width = row_width;
  c.n_ctx = context;
  c.rows = layer_rows.empty() ? std::vector<int>(size_t(layers), context) : layer_rows;
  c.n_seq = n_seq;
  uint8_t* base = static_cast<uint8_t*>(backend.alloc_kv(c.bytes() * size_t(n_seq)));
  c.k_pool.resize(size_t(layers));
  c.v_pool.resize(size_t(layers));
  for (int l = 0; l < layers; ++l) {
    const size_t all = c.layer_bytes(l) * size_t(n_seq);
    c.k_pool[size_t(l)] = base;
    c.v_pool[size_t(l)] = base + all;
    base += 2 * all;
  }
  std::vector<KvCache> seqs(size_t(n_seq), c);
  for (int s = 0; s < n_seq; ++s) {
    KvCache& v = seqs[size_t(s)];
    v.seq = s;
    v.k.resize(size_t(layers));
    v.v.resize(size_t(layers));
    for (int l = 0; l < layers; ++l) {
      v.k[size_t(l)] = static_cast<uint8_t*>(c.k_pool[size_t(l)]) + c.layer_bytes(l) * size_t(s);
      v.v[size_t(l)] = static_cast<uint8_t*>(c.v_pool[size_t(l)]) + c.layer_bytes(l) * size_t(s);
    }
  }
  return seqs;
}

}  // namespace ggraph
