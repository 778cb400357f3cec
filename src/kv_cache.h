// The KV cache: one K and one V matrix per layer, allocated once per context.
#pragma once

#include <cstdint>
#include <vector>

#include "backend.h"
#include "quant.h"

namespace ggraph {

// A layer holds rows[l] rows: n_ctx, or fewer for a sliding-window layer whose rows form a ring
// (position p in row p % rows[l]), which keeps the window and one batch's new rows, as llama.cpp's
// iSWA cache does.
struct KvCache {
  DType type = DType::F16;
  int n_layer = 0;
  int64_t width = 0;  // n_head_kv * head_dim
  int n_ctx = 0;
  std::vector<int> rows;    // per layer
  std::vector<void*> k, v;  // per layer, [width, rows[l]], row per position
  // The pool these rows lie in: per layer, every sequence's K rows one after another (sequence
  // s's from s * rows[l] on), and the same for V. A cache allocated alone is a pool of one.
  int seq = 0, n_seq = 1;
  std::vector<void*> k_pool, v_pool;  // per layer, [width, n_seq * rows[l]]

  bool ring(int l) const { return rows[size_t(l)] < n_ctx; }
  size_t row_bytes() const { return row_size(type, width); }
  size_t layer_bytes(int l) const { return row_bytes() * size_t(rows[size_t(l)]); }
  size_t bytes() const;  // K and V of every layer
  // Allocates every layer's K and V through the backend (one block); layer_rows empty: n_ctx
  // rows each.
  void allocate(Backend& backend, DType type, int n_layer, int64_t width, int n_ctx,
                const std::vector<int>& layer_rows = {});
  // The caches of n_seq sequences in one block (a pool): each sequence's.
  static std::vector<KvCache> allocate_pool(Backend& backend, DType type, int n_layer,
                                            int64_t width, int n_ctx,
                                            const std::vector<int>& layer_rows, int n_seq);
};

}  // namespace ggraph
