#include "graph.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <stdexcept>

#include "common.h"
#include "sampling_math.h"

namespace ggraph {

const char* op_name(Op op) {
  switch (op) {
    case Op::Leaf:
      return "leaf";
    case Op::GetRows:
      return "get_rows";
    case Op::RmsNorm:
      return "rms_norm";
    case Op::Mul:
      return "mul";
    case Op::Add:
      return "add";
    case Op::MulMat:
      return "mul_mat";
    case Op::Rope:
      return "rope";
    case Op::KvStore:
      return "kv_store";
    case Op::Attention:
      return "attention";
    case Op::Glu:
      return "glu";
    case Op::Softcap:
      return "softcap";
    case Op::KvStoreSeqs:
      return "kv_store_seqs";
    case Op::AttentionSeqs:
      return "attention_seqs";
    case Op::Concat:
      return "concat";
    case Op::Sample:
      return "sample";
    case Op::ChainLoop:
      return "chain_loop";
    case Op::Count:
      break;
  }
  return "?";
}

static std::atomic<uint64_t> next_graph_serial{1};

Graph::Graph() : serial(next_graph_serial.fetch_add(1)) {}

static void set_contiguous_strides(Tensor* t) {
  t->nb[0] = type_traits(t->type).type_size;
  t->nb[1] = row_size(t->type, t->ne[0]);
  t->nb[2] = t->nb[1] * t->ne[1];
  t->nb[3] = t->nb[2] * t->ne[2];
}

Tensor* Graph::new_tensor(Op op, DType type, int64_t ne0, int64_t ne1, const std::string& name) {
  storage_.emplace_back();
  Tensor* t = &storage_.back();
  t->op = op;
  t->type = type;
  t->ne[0] = ne0;
  t->ne[1] = ne1;
  set_contiguous_strides(t);
  t->index = static_cast<int>(nodes_.size());
  t->name = name;
  nodes_.push_back(t);
  return t;
}

static void require(bool ok, const char* op, const std::string& what) {
  if (!ok) throw std::logic_error(std::string("graph: ") + op + ": " + what);
}

static std::string shape(const Tensor* t) {
  return std::to_string(t->ne[0]) + "x" + std::to_string(t->ne[1]);
}

Tensor* Graph::weight(DType type, int64_t ne0, int64_t ne1, void* data, const std::string& name) {
  Tensor* t = new_tensor(Op::Leaf, type, ne0, ne1, name);
  t->storage = Storage::Weight;
  t->data = data;
  return t;
}

Tensor* Graph::kv_cache(DType type, int64_t ne0, int64_t ne1, void* data, const std::string& name,
                        bool ring) {
  Tensor* t = new_tensor(Op::Leaf, type, ne0, ne1, name);
  t->storage = Storage::Kv;
  t->data = data;
  t->params[kKvRing] = ring ? 1 : 0;
  return t;
}

Tensor* Graph::input_i32(int64_t n, const int32_t* host, const std::string& name) {
  Tensor* t = new_tensor(Op::Leaf, DType::I32, n, 1, name);
  t->storage = Storage::Input;
  t->data = const_cast<int32_t*>(host);
  return t;
}

Tensor* Graph::token_buffer(void* data, int k) {
  require(k > 0 && data, "token_buffer", "needs memory for at least one step");
  Tensor* t = new_tensor(Op::Leaf, DType::I32, 2 * int64_t(k), 1, "sampled_tokens");
  t->storage = Storage::Kv;
  t->data = data;
  return t;
}

Tensor* Graph::token_at(Tensor* buffer, int j) {
  require(buffer->op == Op::Leaf && buffer->storage == Storage::Kv && buffer->type == DType::I32 &&
              j >= 0 && 2 * int64_t(j) < buffer->ne[0],
          "token_at", "expected an entry of a token buffer");
  Tensor* t = new_tensor(Op::Leaf, DType::I32, 1, 1, "sampled_token");
  t->storage = Storage::Kv;
  t->data = static_cast<int32_t*>(buffer->data) + j;
  return t;
}

Tensor* Graph::get_rows(Tensor* table, Tensor* ids, float scale) {
  require(ids->type == DType::I32 && ids->ne[1] == 1, "get_rows", "ids must be an I32 vector");
  Tensor* t = new_tensor(Op::GetRows, DType::F32, table->ne[0], ids->ne[0], "get_rows");
  t->src[0] = table;
  t->src[1] = ids;
  t->set_param_f(0, scale);
  return t;
}

Tensor* Graph::rms_norm(Tensor* x, float eps, int64_t group) {
  require(x->type == DType::F32, "rms_norm", "input must be F32");
  if (group == 0) group = x->ne[0];
  require(group > 0 && x->ne[0] % group == 0, "rms_norm",
          "group " + std::to_string(group) + " does not divide the width " + shape(x));
  Tensor* t = new_tensor(Op::RmsNorm, DType::F32, x->ne[0], x->ne[1], "rms_norm");
  t->src[0] = x;
  t->set_param_f(kNormEps, eps);
  t->params[kNormGroup] = int32_t(group);
  return t;
}

Tensor* Graph::elementwise(Op op, Tensor* a, Tensor* b) {
  const char* name = op_name(op);
  require(a->type == DType::F32 && b->type == DType::F32, name, "inputs must be F32");
  require(b->ne[0] > 0 && a->ne[0] % b->ne[0] == 0 && (b->ne[1] == a->ne[1] || b->ne[1] == 1), name,
          "shapes " + shape(a) + " and " + shape(b) + " do not broadcast");
  Tensor* t = new_tensor(op, DType::F32, a->ne[0], a->ne[1], name);
  t->src[0] = a;
  t->src[1] = b;
  return t;
}

Tensor* Graph::mul(Tensor* a, Tensor* b) { return elementwise(Op::Mul, a, b); }
Tensor* Graph::add(Tensor* a, Tensor* b) { return elementwise(Op::Add, a, b); }

Tensor* Graph::mul_mat(Tensor* w, Tensor* x) {
  require(x->type == DType::F32, "mul_mat", "activations must be F32");
  require(w->ne[0] == x->ne[0], "mul_mat",
          "inner dimensions differ: weight " + shape(w) + ", input " + shape(x));
  Tensor* t = new_tensor(Op::MulMat, DType::F32, w->ne[1], x->ne[1], "mul_mat");
  t->src[0] = w;
  t->src[1] = x;
  return t;
}

Tensor* Graph::rope(Tensor* x, Tensor* pos, int n_head, int head_dim, int n_dims, int mode,
                    float freq_base, Tensor* freq_factors, float freq_scale) {
  require(x->ne[0] == int64_t(n_head) * head_dim, "rope", "width must be n_head*head_dim");
  require(pos->type == DType::I32 && pos->ne[0] == x->ne[1], "rope", "one position per token");
  require(n_dims <= head_dim && n_dims % 2 == 0, "rope", "n_dims must be even and <= head_dim");
  require(!freq_factors || (freq_factors->type == DType::F32 && freq_factors->ne[0] >= n_dims / 2),
          "rope", "freq_factors must be F32 with n_dims/2 values");
  require(freq_scale > 0.0f, "rope", "freq_scale must be positive");
  Tensor* t = new_tensor(Op::Rope, DType::F32, x->ne[0], x->ne[1], "rope");
  t->src[0] = x;
  t->src[1] = pos;
  t->params[kRopeNHead] = n_head;
  t->params[kRopeHeadDim] = head_dim;
  t->params[kRopeNDims] = n_dims;
  t->params[kRopeMode] = mode;
  t->set_param_f(kRopeBase, freq_base);
  t->set_param_f(kRopeScale, freq_scale);
  t->src[2] = freq_factors;
  return t;
}

Tensor* Graph::kv_store(Tensor* cache, Tensor* x, int32_t first_row) {
  require(cache->storage == Storage::Kv, "kv_store", "destination must be a KV cache");
  require(x->ne[0] == cache->ne[0], "kv_store", "row width differs from the cache's");
  const bool ring = cache->params[kKvRing] != 0;
  require(first_row >= 0 && (ring ? x->ne[1] : first_row + x->ne[1]) <= cache->ne[1], "kv_store",
          "rows past the end of the cache");
  Tensor* t = kv_store_node(Op::KvStore, cache, x);
  t->kv[0] = first_row;
  return t;
}

Tensor* Graph::kv_store_node(Op op, Tensor* cache, Tensor* x) {
  Tensor* t = new_tensor(op, cache->type, cache->ne[0], cache->ne[1], op_name(op));
  t->params[kKvRing] = cache->params[kKvRing];
  t->storage = Storage::Kv;
  t->data = cache->data;
  t->src[0] = x;
  t->src[1] = cache;
  return t;
}

// What attention over caches k and v needs of its shapes, whichever op: heads, widths, one type
// and one layout of rows for K and V.
static void require_attention(Op op, const Tensor* q, const Tensor* k, const Tensor* v, int n_head,
                              int n_head_kv, int head_dim, int window) {
  const char* what = op_name(op);
  require(q->ne[0] == int64_t(n_head) * head_dim, what, "q width must be n_head*head_dim");
  require(n_head % n_head_kv == 0, what, "n_head must be a multiple of n_head_kv");
  require(k->ne[0] == int64_t(n_head_kv) * head_dim && v->ne[0] == k->ne[0], what,
          "cache width must be n_head_kv*head_dim");
  require(window >= 0, what, "window must be >= 0");
  require(k->type == v->type, what, "K and V must be of one type");
  require(k->ne[1] == v->ne[1] && k->params[kKvRing] == v->params[kKvRing] &&
              k->params[kKvSeqRows] == v->params[kKvSeqRows],
          what, "K and V caches must hold the same rows");
}

Tensor* Graph::attention_node(Op op, Tensor* q, Tensor* k, Tensor* v, int n_head, int n_head_kv,
                              int head_dim, float scale, int window) {
  Tensor* t = new_tensor(op, DType::F32, q->ne[0], q->ne[1], op_name(op));
  t->src[0] = q;
  t->src[1] = k;
  t->src[2] = v;
  t->params[kAttnNHead] = n_head;
  t->params[kAttnNHeadKv] = n_head_kv;
  t->params[kAttnHeadDim] = head_dim;
  t->set_param_f(kAttnScale, scale);
  t->params[kAttnWindow] = window;
  return t;
}

Tensor* Graph::attention(Tensor* q, Tensor* k_cache, Tensor* v_cache, int n_head, int n_head_kv,
                         int head_dim, float scale, int32_t n_kv, int32_t first_pos, int window) {
  require_attention(Op::Attention, q, k_cache, v_cache, n_head, n_head_kv, head_dim, window);
  if (k_cache->params[kKvRing])
    require(n_kv >= first_pos + q->ne[1] && window > 0 && window + q->ne[1] - 1 <= k_cache->ne[1],
            "attention", "a ring cache holds fewer rows than the window and the queries");
  else
    require(n_kv >= first_pos + q->ne[1] && n_kv <= k_cache->ne[1], "attention",
            "attention length outside the cache");
  Tensor* t = attention_node(Op::Attention, q, k_cache, v_cache, n_head, n_head_kv, head_dim, scale,
                             window);
  t->kv[kAttnNKv] = n_kv;
  t->kv[kAttnFirstPos] = first_pos;
  return t;
}

Tensor* Graph::kv_pool(DType type, int64_t ne0, int rows, int n_seq, void* data,
                       const std::string& name, bool ring) {
  require(rows > 0 && n_seq > 0, "kv_pool", "rows and sequences must be positive");
  Tensor* t = kv_cache(type, ne0, int64_t(rows) * n_seq, data, name, ring);
  t->params[kKvSeqRows] = rows;
  return t;
}

// The slots of B tokens: I32 [2B], sequences then positions.
static void require_slots(const Tensor* slots, int64_t b, const char* what) {
  require(slots->type == DType::I32 && slots->ne[0] == 2 * b && slots->ne[1] == 1, what,
          "slots must be I32 [2 * tokens]: each token's sequence, then its position");
}

Tensor* Graph::kv_store_seqs(Tensor* pool, Tensor* x, Tensor* slots) {
  require(pool->storage == Storage::Kv && pool->params[kKvSeqRows] > 0, "kv_store_seqs",
          "destination must be a KV pool");
  require(x->ne[0] == pool->ne[0], "kv_store_seqs", "row width differs from the pool's");
  require_slots(slots, x->ne[1], "kv_store_seqs");
  Tensor* t = kv_store_node(Op::KvStoreSeqs, pool, x);
  t->params[kKvSeqRows] = pool->params[kKvSeqRows];
  t->src[2] = slots;
  return t;
}

Tensor* Graph::attention_seqs(Tensor* q, Tensor* k_pool, Tensor* v_pool, Tensor* slots, int n_head,
                              int n_head_kv, int head_dim, float scale, int window) {
  require_attention(Op::AttentionSeqs, q, k_pool, v_pool, n_head, n_head_kv, head_dim, window);
  require(k_pool->params[kKvSeqRows] > 0, "attention_seqs", "K and V must be pools");
  require(!k_pool->params[kKvRing] || (window > 0 && window <= k_pool->params[kKvSeqRows]),
          "attention_seqs", "a ring holds fewer rows than the window");
  require_slots(slots, q->ne[1], "attention_seqs");
  Tensor* t = attention_node(Op::AttentionSeqs, q, k_pool, v_pool, n_head, n_head_kv, head_dim,
                             scale, window);
  t->src[3] = slots;
  return t;
}

void Graph::shift_kv(int32_t delta) {
  // A step's graph is shifted once a step, and its KV nodes are a few of its nodes.
  for (; kv_scanned_ < nodes_.size(); ++kv_scanned_) {
    Tensor* t = nodes_[kv_scanned_];
    if (t->n_kv() > 0) kv_nodes_.push_back(t);
  }
  for (Tensor* t : kv_nodes_)
    for (int i = 0; i < t->n_kv(); ++i) t->kv[i] += delta;
}

Tensor* Graph::glu(Tensor* gate, Tensor* up, int32_t act) {
  require(gate->ne[0] == up->ne[0] && gate->ne[1] == up->ne[1], "glu", "shapes differ");
  Tensor* t = new_tensor(Op::Glu, DType::F32, gate->ne[0], gate->ne[1], "glu");
  t->src[0] = gate;
  t->src[1] = up;
  t->params[0] = act;
  return t;
}

Tensor* Graph::swiglu(Tensor* gate, Tensor* up) { return glu(gate, up, kGluSilu); }
Tensor* Graph::geglu(Tensor* gate, Tensor* up) { return glu(gate, up, kGluGelu); }

Tensor* Graph::sample(Tensor* logits, Tensor* config, Tensor* tokens, int step) {
  require(logits->type == DType::F32 && logits->ne[1] == 1, "sample",
          "logits must be one F32 column, got " + shape(logits));
  require(config->type == DType::I32 && config->ne[1] == 1 && config->ne[0] >= sample_word::kHeader,
          "sample", "config must be an I32 vector of at least the header's words");
  require(tokens->op == Op::Leaf && tokens->storage == Storage::Kv && tokens->type == DType::I32 &&
              step >= 0 && 2 * int64_t(step) < tokens->ne[0],
          "sample", "expected a token buffer with room for this step");
  Tensor* t = new_tensor(Op::Sample, DType::I32, tokens->ne[0], 1, "sample");
  t->storage = Storage::Kv;
  t->data = tokens->data;
  t->src[0] = logits;
  t->src[1] = config;
  t->src[2] = tokens;
  t->params[0] = step;
  t->params[1] = static_cast<int32_t>(tokens->ne[0] / 2);
  return t;
}

Tensor* Graph::chain_loop(Tensor* last, Tensor* config, Tensor* first, Tensor* control,
                          const std::vector<Tensor*>& positions, void* out, int capacity) {
  require(last->op == Op::Sample, "chain_loop", "expected the last step of a sampled chain");
  const int k = last->params[0] + 1;
  auto one_input = [](const Tensor* t, int64_t n) {
    return t->storage == Storage::Input && t->type == DType::I32 && t->ne[0] == n && t->ne[1] == 1;
  };
  require(config == last->src[1], "chain_loop", "expected the chain's sample config");
  require(one_input(first, 1) && one_input(control, 2), "chain_loop",
          "expected the first token and the control words as I32 inputs");
  require(int(positions.size()) == k, "chain_loop",
          "expected a position input for each of the chain's " + std::to_string(k) + " steps");
  for (const Tensor* p : positions)
    require(one_input(p, 1), "chain_loop", "expected each step's position as an I32 input");
  require(out && capacity >= k && capacity % k == 0, "chain_loop",
          "needs memory for a whole number of rounds, found room for " + std::to_string(capacity) +
              " tokens in rounds of " + std::to_string(k));
  require(loop_positions_.empty(), "chain_loop", "a graph holds one loop");
  Tensor* t = new_tensor(Op::ChainLoop, DType::I32, 1 + 2 * int64_t(capacity), 1, "chain_loop");
  t->storage = Storage::Kv;
  t->data = out;
  t->src[0] = last;
  t->src[1] = config;
  t->src[2] = first;
  t->src[3] = control;
  t->params[kLoopChain] = k;
  t->params[kLoopCapacity] = capacity;
  loop_positions_ = positions;
  return t;
}

Tensor* Graph::concat(Tensor* a, Tensor* b) {
  require(a->type == DType::F32 && b->type == DType::F32, "concat", "inputs must be F32");
  require(a->ne[0] == b->ne[0], "concat", "inputs must have rows of one length");
  Tensor* t = new_tensor(Op::Concat, DType::F32, a->ne[0], a->ne[1] + b->ne[1], "concat");
  t->src[0] = a;
  t->src[1] = b;
  return t;
}

Tensor* Graph::softcap(Tensor* x, float cap) {
  require(x->type == DType::F32, "softcap", "input must be F32");
  require(cap > 0.0f && cap < INFINITY, "softcap", "cap must be positive and finite");
  Tensor* t = new_tensor(Op::Softcap, DType::F32, x->ne[0], x->ne[1], "softcap");
  t->src[0] = x;
  t->set_param_f(0, cap);
  return t;
}

}  // namespace ggraph
