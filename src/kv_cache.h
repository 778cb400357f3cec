// The KV cache: one K and one V matrix per layer, allocated once per context.
#pragma once

#include <cstdint>
#include <vector>

#include "backend.h"
#include "quant.h"

namespace ggraph {

struct KvCache {
  DType type = DType::F16;
  int n_layer = 0;
  int64_t width = 0;  // n_head_kv * head_dim
  int n_ctx = 0;
  std::vector<void*> k, v;  // per layer, [width, n_ctx], row per position

  size_t layer_bytes() const { return row_size(type, width) * size_t(n_ctx); }
  // Allocates every layer's K and V through the backend (one block).
  void allocate(Backend& backend, DType type, int n_layer, int64_t width, int n_ctx);
};

}  // namespace ggraph
