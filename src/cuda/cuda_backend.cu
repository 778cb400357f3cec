// The CUDA backend: device memory for weights, KV cache, scratch and inputs; validation; the
// per-op dispatch of a graph's kernels (launch_graph); and the copies around a compute.
// KV-position values reach the kernels through the step's KV record (kernels.cuh), so that a
// step of an unchanged topology changes one launch; a step on the graph the last step ran,
// shifted, checks and launches only what that record needs, without walking the graph again.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "backend.h"
#include "cuda/blas.h"
#include "cuda/cuda_backend.h"
#include "cuda/graph_executor.h"
#include "cuda/kernels.cuh"
#include "planner.h"
#include "sampling_math.h"

namespace ggraph {
namespace cuda {

[[noreturn]] void throw_cuda_error(cudaError_t err, const char* what, const char* file, int line) {
  // Clears the error where it is not sticky, so the process can go on after the exception.
  cudaGetLastError();
  const char* base = std::strrchr(file, '/');
  throw DeviceError(std::string("CUDA error ") + cudaGetErrorName(err) + " (" +
                    cudaGetErrorString(err) + ") in " + what + " at " + (base ? base + 1 : file) +
                    ":" + std::to_string(line));
}

namespace {

std::string mib(size_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return buf;
}

std::string shape_str(const Tensor* t) {
  return "[" + std::to_string(t->ne[0]) + ", " + std::to_string(t->ne[1]) + "]";
}

[[noreturn]] void bad_node(const Tensor* t, const std::string& what) {
  throw ArgumentError(std::string("cuda: node ") + op_name(t->op) + " '" + t->name + "': " + what);
}

// The cache a KvStore writes (and that an Attention reading the KvStore node reads): the node's
// own Kv storage, or the Kv tensor among its sources.
const Tensor* kv_target(const Tensor* t) {
  if (t->storage == Storage::Kv && t->data) return t;
  for (const Tensor* s : t->src) {
    if (s && s->storage == Storage::Kv && s->data) return s;
  }
  for (const Tensor* s : t->src) {
    if (s && s->op == Op::KvStore) return kv_target(s);
  }
  return nullptr;
}

// KV cache operand of an Attention node.
const Tensor* cache_of(const Tensor* t) { return t->op == Op::KvStore ? kv_target(t) : t; }

size_t elem_size(DType t) { return block_bytes(t); }

// Rope node t's configuration, the key of its angle table (RopeTable; rows and data unset), with
// its frequency factors at `factors` (none: null).
RopeTable rope_config(const Tensor* t, const float* factors) {
  RopeTable c;
  c.freq_base = t->param_f(kRopeBase);
  c.freq_scale = t->param_f(kRopeScale);
  c.freq_factors = factors;
  c.n_dims = t->params[kRopeNDims];
  return c;
}
bool same_rope_config(const RopeTable& a, const RopeTable& b) {
  return a.freq_base == b.freq_base && a.freq_scale == b.freq_scale &&
         a.freq_factors == b.freq_factors && a.n_dims == b.n_dims;
}

// How far ahead a mat-vec looks for others of the same activation to launch with it.
constexpr int kGroupWindow = 6;

// Whether two tensors' scratch byte ranges intersect.
bool scratch_overlap(const Tensor* a, const Tensor* b) {
  if (a->storage != Storage::Scratch || b->storage != Storage::Scratch) return false;
  const size_t a_end = a->offset + static_cast<size_t>(a->n_elements()) * elem_size(a->type);
  const size_t b_end = b->offset + static_cast<size_t>(b->n_elements()) * elem_size(b->type);
  return a->offset < b_end && b->offset < a_end;
}

// Whether the write of out may move before the nodes after node i and before node j: none of
// them reads or writes memory that out overlaps. Nodes marked in `done` (already part of a
// launch, when given) are passed over.
bool write_moves_before(const std::vector<Tensor*>& nodes, int i, int j, const Tensor* out,
                        const std::vector<char>* done = nullptr) {
  for (int m = i + 1; m < j; ++m) {
    const Tensor* between = nodes[m];
    if (between->op == Op::Leaf || (done && (*done)[m])) continue;
    if (scratch_overlap(out, between)) return false;
    for (const Tensor* s : between->src)
      if (s && scratch_overlap(out, s)) return false;
  }
  return true;
}

// Whether product node j may go out in the launch of node i before it: no node between them
// reads or writes memory that j's output overlaps (j's write moves before them).
bool joins_launch_of(const std::vector<Tensor*>& nodes, int i, int j) {
  return write_moves_before(nodes, i, j, nodes[j]);
}

// GGRAPH_CUDA_MMQ_GROUP=0 launches each tensor-core product alone, to measure.
bool mat_mul_q_grouping() {
  static const bool on = env_switch_on("GGRAPH_CUDA_MMQ_GROUP");
  return on;
}

// The products that go out in one tensor-core launch (launch_mat_mul_q's parts) with product
// node i: those within the window after it of the same activation, weight format and k that are
// not launched yet and may join its launch. Returns how many, i first.
int mat_mul_q_group(const std::vector<Tensor*>& nodes, int i, const std::vector<char>& done,
                    int (&group)[kMatMulQMaxParts]) {
  const Tensor* w = nodes[i]->src[0];
  const Tensor* x = nodes[i]->src[1];
  int count = 0;
  group[count++] = i;
  const int n = static_cast<int>(nodes.size());
  for (int j = i + 1;
       mat_mul_q_grouping() && j < n && j <= i + kGroupWindow && count < kMatMulQMaxParts; ++j) {
    const Tensor* c = nodes[j];
    if (c->op == Op::MulMat && !done[j] && c->src[1] == x && c->src[0]->type == w->type &&
        c->src[0]->ne[0] == w->ne[0] && joins_launch_of(nodes, i, j))
      group[count++] = j;
  }
  return count;
}

}  // namespace

void* tensor_ptr(const Tensor* t, const DeviceBuffers& buf) {
  if (t->op == Op::KvStore) return kv_target(t)->data;
  switch (t->storage) {
    case Storage::Weight:
    case Storage::Kv:
      return t->data;
    case Storage::Input:
      return buf.input + t->offset;
    case Storage::Scratch:
      return buf.scratch + t->offset;
  }
  return nullptr;
}

// The forms the products read at the workspace's start (8-bit blocks, half), and the
// warp-pipelined product's column tiles after them: the tiles of one activation and the other
// form of the same activation, which a product of another format beside it reads (a K-quant
// mix's v), are both kept. Last, the 8-bit blocks a gate/up launch's gated unit writes
// (MatVecGlu) while its blocks still read their own activation in the first region.
namespace {
struct ActWorkspace {
  size_t forms = 0, tiles = 0, glu = 0;
};
ActWorkspace act_workspace(const Graph& graph) {
  ActWorkspace need;
  for (const Tensor* t : graph.nodes()) {
    if (t->op != Op::MulMat) continue;
    const int64_t k = t->src[0]->ne[0], cols = t->src[1]->ne[1];
    const MatMulQ q = mat_mul_q_kind(t->src[0]->type, k, cols);
    if (q == MatMulQ::Int8) {
      need.forms = std::max(need.forms, act_q8_bytes(k, cols));
    } else if (q == MatMulQ::Int8Warp) {
      need.tiles = std::max(need.tiles, act_q8_tiles_bytes(k, cols));
    } else if (q == MatMulQ::Half || cols > kMatVecMaxCols) {
      need.forms = std::max(need.forms, act_half_bytes(k, cols));
    } else if (is_quantized(t->src[0]->type)) {
      need.forms = std::max(need.forms, act_q8_bytes(k, cols));
    }
  }
  for (const Tensor* t : graph.nodes()) {
    if (t->op == Op::Glu && t->ne[1] == 1 && t->ne[0] % 32 == 0)
      need.glu = std::max(need.glu, act_q8_bytes(t->ne[0], 1));
  }
  need.forms = (need.forms + 255) / 256 * 256;
  need.tiles = (need.tiles + 255) / 256 * 256;
  return need;
}
}  // namespace

size_t act_workspace_bytes(const Graph& graph) {
  const ActWorkspace need = act_workspace(graph);
  return need.forms + need.tiles + need.glu;
}

namespace {
bool& tile_output() {
  static bool on = env_switch_on("GGRAPH_CUDA_TILE_OUTPUT");
  return on;
}
}  // namespace

bool set_tile_output(bool on) { return std::exchange(tile_output(), on); }

size_t sample_workspace_bytes(const Graph& graph) {
  size_t need = 0;
  for (const Tensor* t : graph.nodes())
    if (t->op == Op::Sample)
      need = std::max(need, sample_work_bytes(static_cast<int>(t->src[0]->ne[0])));
  return need;
}

size_t attn_workspace_bytes(const Graph& graph, bool counters) {
  size_t need = 0;
  const std::vector<Tensor*>& nodes = graph.nodes();
  std::vector<char> done(nodes.size(), 0);
  for (int i = 0; i < static_cast<int>(nodes.size()); ++i) {
    const Tensor* t = nodes[i];
    if (t->op == Op::Attention || t->op == Op::AttentionSeqs) {
      const int n_head = t->params[kAttnNHead], n_tokens = static_cast<int>(t->src[0]->ne[1]);
      const bool seqs = t->op == Op::AttentionSeqs;
      need = std::max(
          need, counters ? attn_counters_bytes(n_head, n_tokens, seqs)
                         : attn_partials_bytes(n_head, t->params[kAttnHeadDim], n_tokens, seqs));
    } else if (t->op == Op::KvStore && counters && kv_target(t) &&
               kv_target(t)->type == DType::Q8_0) {
      // The rope epilogue's tickets for one token's K and V rows into Q8_0 caches (a group of 32
      // values each), never at the same time as an attention or a product.
      need = std::max(need, 2 * static_cast<size_t>(t->src[0]->ne[0] / 32) * sizeof(unsigned));
    } else if (t->op == Op::MulMat) {
      // Split-k tensor-core products use the same memory (never at the same time as an
      // attention), a launch's products together (as the executor groups them).
      const Tensor* w = t->src[0];
      const int64_t k = w->ne[0], cols = t->src[1]->ne[1];
      if (done[i] || mat_mul_q_kind(w->type, k, cols) == MatMulQ::None) continue;
      int group[kMatMulQMaxParts];
      const int parts = mat_mul_q_group(nodes, i, done, group);
      int64_t n[kMatMulQMaxParts];
      for (int p = 0; p < parts; ++p) {
        n[p] = nodes[group[p]]->src[0]->ne[1];
        done[group[p]] = 1;
      }
      need = std::max(need, counters ? mat_mul_q_counters_bytes(w->type, n, parts, k, cols)
                                     : mat_mul_q_partials_bytes(w->type, n, parts, k, cols));
    }
  }
  return need;
}

void validate_graph(const Graph& graph) {
  const Tensor* out = graph.output();
  if (!out) throw ArgumentError("cuda: the graph has no output tensor");
  // (A sampled chain's output is its token buffer: 4-byte words too.)
  if (out->type != DType::F32 && out->op != Op::Sample && out->op != Op::ChainLoop)
    throw ArgumentError(std::string("cuda: the graph output must be F32, found ") +
                        dtype_name(out->type));
  for (const Tensor* t : graph.nodes()) validate_node(t);
}

void validate_node(const Tensor* t) {
  auto need_src = [&](int i, DType type) {
    const Tensor* s = t->src[i];
    if (!s) bad_node(t, "source " + std::to_string(i) + " is missing");
    if (s->type != type)
      bad_node(t, "source " + std::to_string(i) + " must be " + dtype_name(type) + ", found " +
                      dtype_name(s->type));
    return s;
  };
  auto need_same = [&](const Tensor* a, const Tensor* b) {
    if (a->ne[0] != b->ne[0] || a->ne[1] != b->ne[1])
      bad_node(t, "shapes " + shape_str(a) + " and " + shape_str(b) + " differ");
  };
  auto need_broadcast = [&](const Tensor* a, const Tensor* b) {
    if (b->ne[0] <= 0 || a->ne[0] % b->ne[0] != 0 || (b->ne[1] != 1 && b->ne[1] != a->ne[1]))
      bad_node(t, "cannot broadcast " + shape_str(b) + " over " + shape_str(a));
  };
  switch (t->op) {
    case Op::Leaf:
      if ((t->storage == Storage::Weight || t->storage == Storage::Kv) && !t->data)
        bad_node(t, "leaf has no device memory");
      break;
    case Op::GetRows: {
      const Tensor* table = t->src[0];
      if (!table || !is_computable(table->type))
        bad_node(t, std::string("table type ") + (table ? dtype_name(table->type) : "missing") +
                        " is not computable");
      const Tensor* ids = need_src(1, DType::I32);
      if (ids->storage == Storage::Input && ids->data) {
        const auto* v = static_cast<const int32_t*>(ids->data);
        for (int64_t i = 0; i < ids->ne[0]; ++i) {
          if (v[i] < 0 || v[i] >= table->ne[1])
            bad_node(t, "row id " + std::to_string(v[i]) + " at " + std::to_string(i) +
                            " is outside [0, " + std::to_string(table->ne[1]) + ")");
        }
      }
      break;
    }
    case Op::RmsNorm: {
      const int64_t group = t->params[kNormGroup];
      if (group <= 0 || need_src(0, DType::F32)->ne[0] % group != 0)
        bad_node(t, "norm group " + std::to_string(group) + " does not divide the width");
      break;
    }
    case Op::Mul:
    case Op::Add:
      need_broadcast(need_src(0, DType::F32), need_src(1, DType::F32));
      break;
    case Op::Glu:
      need_same(need_src(0, DType::F32), need_src(1, DType::F32));
      if (t->params[0] != kGluSilu && t->params[0] != kGluGelu)
        bad_node(t, "unknown gate activation " + std::to_string(t->params[0]));
      break;
    case Op::Concat:
      bad_node(t, "concat (batches of several sequences) runs on the CPU only, so far");
      break;
    case Op::Sample: {
      const Tensor* logits = need_src(0, DType::F32);
      if (logits->ne[1] != 1 || logits->ne[0] > kMaxSampleVocab)
        bad_node(t, "logits must be one column of at most 2^23, found " + shape_str(logits));
      if (need_src(1, DType::I32)->ne[0] < sample_word::kHeader)
        bad_node(t, "the config is shorter than its header");
      if (!t->data || t->params[0] < 0 || t->params[0] >= t->params[1])
        bad_node(t, "expected a token buffer with room for this step");
      break;
    }
    case Op::ChainLoop: {
      const Tensor* last = t->src[0];
      const int k = t->params[kLoopChain];
      if (!last || last->op != Op::Sample || last->params[0] + 1 != k || k > kMaxLoopSteps)
        bad_node(t, "expected the last step of a sampled chain of at most " +
                        std::to_string(kMaxLoopSteps) + " steps");
      if (need_src(1, DType::I32) != last->src[1]) bad_node(t, "expected the chain's config");
      if (need_src(2, DType::I32)->storage != Storage::Input ||
          need_src(3, DType::I32)->storage != Storage::Input || t->src[3]->ne[0] != 2)
        bad_node(t, "expected the first token and the control words as inputs");
      if (!t->data || t->params[kLoopCapacity] < k || t->params[kLoopCapacity] % k != 0)
        bad_node(t, "expected a buffer for a whole number of rounds");
      break;
    }
    case Op::Softcap:
      need_src(0, DType::F32);
      if (!(t->param_f(0) > 0.0f && t->param_f(0) < INFINITY))
        bad_node(t, "cap must be positive and finite");
      break;
    case Op::MulMat: {
      const Tensor* w = t->src[0];
      const Tensor* x = need_src(1, DType::F32);
      if (!w || !is_computable(w->type))
        bad_node(t, std::string("weight type ") + (w ? dtype_name(w->type) : "missing") +
                        " is not computable");
      if (w->ne[0] != x->ne[0])
        bad_node(t,
                 "weight " + shape_str(w) + " and activation " + shape_str(x) + " disagree on k");
      if (is_quantized(w->type) && w->ne[0] % 32 != 0)
        bad_node(t, "k = " + std::to_string(w->ne[0]) + " is not a multiple of 32");
      // Quantized weights are uploaded in the backend's own layout (weight_layout.h), which the
      // products read, and may be read before the wait for the kernel before (DESIGN.md).
      if (is_quantized(w->type) && w->storage != Storage::Weight)
        bad_node(t, std::string("a ") + dtype_name(w->type) +
                        " matrix must be a model weight, found one the graph computes or caches");
      if (w->ne[1] > (1 << 30) || x->ne[1] > (1 << 30)) bad_node(t, "too large");
      break;
    }
    case Op::Rope: {
      const Tensor* x = need_src(0, DType::F32);
      const Tensor* pos = need_src(1, DType::I32);
      const int n_head = t->params[kRopeNHead], head_dim = t->params[kRopeHeadDim];
      const int n_dims = t->params[kRopeNDims], mode = t->params[kRopeMode];
      if (n_head <= 0 || head_dim <= 0 || head_dim % 2 != 0 ||
          x->ne[0] != static_cast<int64_t>(n_head) * head_dim)
        bad_node(t, "expected [n_head*head_dim, T] with even head_dim, found " + shape_str(x));
      if (n_dims <= 0 || n_dims % 2 != 0 || n_dims > head_dim)
        bad_node(t, "n_dims " + std::to_string(n_dims) + " must be even and <= head_dim");
      if (mode != kRopeNormal && mode != kRopeNeox)
        bad_node(t, "unknown rope mode " + std::to_string(mode));
      if (pos->ne[0] != x->ne[1]) bad_node(t, "positions and tokens differ in count");
      if (t->src[2] && (t->src[2]->type != DType::F32 || t->src[2]->ne[0] < n_dims / 2))
        bad_node(t, "frequency factors must be F32 with n_dims/2 values");
      if (!(t->param_f(kRopeScale) > 0.0f)) bad_node(t, "frequency scale must be positive");
      break;
    }
    case Op::KvStoreSeqs:
    case Op::KvStore: {
      const Tensor* x = need_src(0, DType::F32);
      const Tensor* cache = kv_target(t);
      if (!cache) bad_node(t, "no KV cache tensor to write");
      if (cache->type != DType::F16 && cache->type != DType::Q8_0)
        bad_node(t, std::string("cache must be F16 or Q8_0, found ") + dtype_name(cache->type));
      if (cache->type == DType::Q8_0 && x->ne[0] % 64 != 0)
        bad_node(
            t, "a Q8_0 cache needs rows a multiple of 64 wide, found " + std::to_string(x->ne[0]));
      if (x->ne[0] != cache->ne[0])
        bad_node(t, "rows of " + std::to_string(x->ne[0]) + " into a cache of rows of " +
                        std::to_string(cache->ne[0]));
      if (t->op == Op::KvStoreSeqs) {
        const Tensor* slots = need_src(2, DType::I32);
        if (slots->ne[0] != 2 * x->ne[1] || t->params[kKvSeqRows] <= 0)
          bad_node(t, "slots must hold each token's sequence and position in a pool");
        break;
      }
      if (t->kv[0] < 0 || (cache->params[kKvRing] ? x->ne[1] : t->kv[0] + x->ne[1]) > cache->ne[1])
        bad_node(t, "rows " + std::to_string(t->kv[0]) + ".." +
                        std::to_string(t->kv[0] + x->ne[1]) + " outside a cache of " +
                        std::to_string(cache->ne[1]));
      break;
    }
    case Op::AttentionSeqs:
    case Op::Attention: {
      const Tensor* q = need_src(0, DType::F32);
      const int n_head = t->params[kAttnNHead], n_head_kv = t->params[kAttnNHeadKv];
      const int head_dim = t->params[kAttnHeadDim];
      if (n_head <= 0 || n_head_kv <= 0 || n_head % n_head_kv != 0)
        bad_node(t, "n_head " + std::to_string(n_head) + " is not a multiple of n_head_kv " +
                        std::to_string(n_head_kv));
      if (head_dim <= 0 || head_dim % 8 != 0 || head_dim > 256)
        bad_node(
            t, "head_dim " + std::to_string(head_dim) + " must be a multiple of 8 and at most 256");
      if (q->ne[0] != static_cast<int64_t>(n_head) * head_dim)
        bad_node(t, "q " + shape_str(q) + " is not [n_head*head_dim, T]");
      for (int i = 1; i <= 2; ++i) {
        const Tensor* c = t->src[i] ? cache_of(t->src[i]) : nullptr;
        if (!c || (c->type != DType::F16 && c->type != DType::Q8_0))
          bad_node(t, "K/V cache must be an F16 or Q8_0 tensor");
        if (c->type != cache_of(t->src[1])->type) bad_node(t, "K and V caches differ in type");
        if (c->type == DType::Q8_0 && head_dim % 64 != 0)
          bad_node(
              t, "a Q8_0 cache needs head_dim a multiple of 64, found " + std::to_string(head_dim));
        if (c->ne[0] != static_cast<int64_t>(n_head_kv) * head_dim)
          bad_node(t, "cache rows of " + std::to_string(c->ne[0]) + ", expected n_head_kv*" +
                          "head_dim = " + std::to_string(n_head_kv * head_dim));
        if (t->op == Op::AttentionSeqs) continue;  // lengths from the slots, on the device
        if (t->kv[kAttnNKv] < 0 || (!c->params[kKvRing] && t->kv[kAttnNKv] > c->ne[1]))
          bad_node(t, "n_kv " + std::to_string(t->kv[kAttnNKv]) + " outside a cache of " +
                          std::to_string(c->ne[1]));
        if (c->params[kKvRing] &&
            (t->params[kAttnWindow] <= 0 || t->params[kAttnWindow] + q->ne[1] - 1 > c->ne[1]))
          bad_node(t, "a ring cache of " + std::to_string(c->ne[1]) +
                          " rows holds fewer than the window and the queries");
      }
      if (t->kv[kAttnFirstPos] < 0) bad_node(t, "negative first position");
      if (t->params[kAttnWindow] < 0) bad_node(t, "negative window");
      if (t->op == Op::AttentionSeqs && (need_src(3, DType::I32)->ne[0] != 2 * q->ne[1] ||
                                         cache_of(t->src[1])->params[kKvSeqRows] <= 0))
        bad_node(t, "slots must hold each token's sequence and position in a pool");
      break;
    }
    default:
      bad_node(t, "op not supported by the CUDA backend");
  }
}

int KvLayout::slot_of(int32_t value) const {
  for (int i = 0; i < n_slots; ++i)
    if (values.v[i] == value) return i;
  return -1;
}

void kv_layout(const Graph& graph, KvLayout* layout) {
  layout->sources.clear();
  layout->values = {};
  layout->n_slots = 0;
  const std::vector<Tensor*>& nodes = graph.nodes();
  for (size_t i = 0; i < nodes.size(); ++i) {
    const Tensor* t = nodes[i];
    // The KV parameters Graph::shift_kv moves.
    for (int k = 0; k < t->n_kv(); ++k) {
      const int32_t value = t->kv[k];
      int slot = layout->slot_of(value);
      if (slot < 0) {
        if (layout->n_slots == kMaxKvSlots)
          bad_node(t, "the graph has more distinct KV-position values than the " +
                          std::to_string(kMaxKvSlots) + " the KV record holds");
        slot = layout->n_slots++;
        layout->values.v[slot] = value;
      }
      layout->sources.push_back({static_cast<int>(i), k, slot});
    }
  }
}

bool refresh_kv_values(const Graph& graph, KvLayout* layout) {
  const std::vector<Tensor*>& nodes = graph.nodes();
  KvSlots values = {};
  int seen = 0;
  for (const KvLayout::Source& s : layout->sources) {
    if (size_t(s.node) >= nodes.size()) return false;
    const int32_t value = nodes[size_t(s.node)]->kv[s.kv];
    if (s.slot == seen) {
      values.v[seen++] = value;  // slots are numbered in order of first use
    } else if (values.v[s.slot] != value) {
      return false;
    }
  }
  for (int i = 0; i < seen; ++i) {
    for (int j = 0; j < i; ++j)
      if (values.v[j] == values.v[i]) return false;
  }
  layout->values = values;
  return true;
}

namespace {

// The values validate_node accepts for a KV node's value k, all else about the node fixed.
void kv_range(const Tensor* t, int k, int32_t* lo, int32_t* hi) {
  constexpr int32_t kMax = std::numeric_limits<int32_t>::max();
  *lo = 0;
  *hi = kMax;
  if (t->op == Op::KvStore) {
    const Tensor* cache = kv_target(t);
    if (!cache->params[kKvRing]) *hi = int32_t(cache->ne[1] - t->src[0]->ne[1]);
  } else if (k == kAttnNKv) {
    for (int i = 1; i <= 2; ++i) {
      const Tensor* c = cache_of(t->src[i]);
      if (!c->params[kKvRing]) *hi = std::min(*hi, int32_t(c->ne[1]));
    }
  }
}

}  // namespace

void plan_reuse(const Graph& graph, ReusePlan* plan) {
  plan->recheck.clear();
  plan->kv_checks.clear();
  plan->inputs.clear();
  const std::vector<Tensor*>& nodes = graph.nodes();
  for (size_t i = 0; i < nodes.size(); ++i) {
    const Tensor* t = nodes[i];
    const bool input_ids = t->op == Op::GetRows && t->src[1] &&
                           t->src[1]->storage == Storage::Input && t->src[1]->data;
    if (input_ids) plan->recheck.push_back(static_cast<int>(i));
    for (int k = 0; k < t->n_kv(); ++k) {
      ReusePlan::KvCheck c{static_cast<int>(i), k, 0, 0};
      kv_range(t, k, &c.lo, &c.hi);
      plan->kv_checks.push_back(c);
    }
    if (t->storage == Storage::Input) plan->inputs.push_back(static_cast<int>(i));
  }
  kv_layout(graph, &plan->kv);
}

void check_kv_values(const Graph& graph, const ReusePlan& plan, int32_t span) {
  const std::vector<Tensor*>& nodes = graph.nodes();
  for (const ReusePlan::KvCheck& c : plan.kv_checks) {
    const Tensor* t = nodes[size_t(c.node)];
    const int32_t v = t->kv[c.kv];
    if (v >= c.lo && v <= c.hi && int64_t(v) + span <= c.hi) continue;
    validate_node(t);  // names the fault
    bad_node(t, "KV value " + std::to_string(v) +
                    (span ? " (" + std::to_string(int64_t(v) + span) + " in the loop's last round)"
                          : std::string()) +
                    " outside " + std::to_string(c.lo) + ".." + std::to_string(c.hi));
  }
}

bool check_reused(const Graph& graph, ReusePlan* plan, int32_t span) {
  const std::vector<Tensor*>& nodes = graph.nodes();
  for (int i : plan->recheck) validate_node(nodes[size_t(i)]);
  check_kv_values(graph, *plan, span);
  if (refresh_kv_values(graph, &plan->kv)) return true;
  kv_layout(graph, &plan->kv);
  return false;
}

void launch_graph(const Graph& graph, const KvLayout& kv, const DeviceBuffers& buf, Launcher& l) {
  const std::vector<Tensor*>& nodes = graph.nodes();
  const int n = static_cast<int>(nodes.size());
  // Consumers per node, to know when an intermediate can be fused away; and which nodes a
  // quantized mat-vec reads, a warp-pipelined product, or a product that takes half
  // activations, so that their producer can hand over the 8-bit, column-tile or half form too.
  std::vector<int> uses(n, 0);
  std::vector<char> q8_read(n, 0), tile_read(n, 0), half_read(n, 0);
  bool indexed = true;
  for (int i = 0; i < n && indexed; ++i) indexed = nodes[i]->index == i;
  std::unordered_map<const Tensor*, int> position;
  if (!indexed) {
    for (int i = 0; i < n; ++i) position[nodes[i]] = i;
  }
  auto pos = [&](const Tensor* s) {
    if (indexed) return s->index >= 0 && s->index < n && nodes[s->index] == s ? s->index : -1;
    auto it = position.find(s);
    return it == position.end() ? -1 : it->second;
  };
  for (const Tensor* t : nodes) {
    for (const Tensor* s : t->src) {
      const int p = s ? pos(s) : -1;
      if (p >= 0) ++uses[p];
    }
    if (t->op == Op::MulMat) {
      const Tensor* w = t->src[0];
      const int64_t cols = t->src[1]->ne[1];
      const MatMulQ kind =
          is_quantized(w->type) ? mat_mul_q_kind(w->type, w->ne[0], cols) : MatMulQ::None;
      const int p = pos(t->src[1]);
      if (p >= 0 && is_quantized(w->type) && cols <= kMatVecMaxCols &&
          (kind == MatMulQ::None || kind == MatMulQ::Int8))
        q8_read[p] = 1;
      if (p >= 0 && kind == MatMulQ::Int8Warp) tile_read[p] = 1;
      // The half kernel's, and cuBLAS's and the tile kernel's but for BF16 weights (which
      // cuBLAS may take in BF16): the forms the MulMat case prepares.
      if (p >= 0 && (kind == MatMulQ::Half ||
                     (kind == MatMulQ::None && cols > kMatVecMaxCols && w->type != DType::BF16)))
        half_read[p] = 1;
    }
  }
  auto ptr = [&](const Tensor* t) { return tensor_ptr(t, buf); };
  auto fptr = [&](const Tensor* t) { return static_cast<float*>(tensor_ptr(t, buf)); };

  // The KV record first: the kernels below read their KV-position values from it.
  if (l.execute && !buf.kv_record) throw std::logic_error("launch_graph: no KV record buffer");
  l.node = -1;
  launch_kv_params(l, kv.values, buf.kv_record);
  // A chain loop's body: everything after the KV record, which its rounds move on.
  if (graph.output()->op == Op::ChainLoop) l.open_loop();
  // Where a KV parameter's value sits in the record (recording without buffers: nullptr).
  auto kv_at = [&](int32_t value) -> const int32_t* {
    const int slot = kv.slot_of(value);
    if (slot < 0) throw std::logic_error("launch_graph: a KV value the layout does not hold");
    return buf.kv_record ? buf.kv_record + slot : nullptr;
  };

  // Which activation the workspace holds (prepared once, reused by later mat-muls of it).
  // Its form: 8-bit blocks (mat-vecs of quantized weights), half or bfloat16 (prompt products).
  enum class Form { Q8, Half, BF16 };
  const Tensor* prepared = nullptr;
  Form prepared_form = Form::Q8;
  // The activation whose column tiles (the warp-pipelined product's form) lie after the other
  // forms (ActWorkspace), where nothing else writes.
  const Tensor* prepared_tiles = nullptr;
  const ActWorkspace ws_need = act_workspace(graph);
  uint8_t* tiles = buf.act ? buf.act + ws_need.forms : nullptr;
  // Where the prepared activation's 8-bit form lies: the workspace's start, or the gated unit's
  // region when a gate/up launch wrote it (glu_epilogue).
  uint8_t* q8_at = buf.act;
  uint8_t* glu_q8 = buf.act && ws_need.glu > 0 ? buf.act + ws_need.forms + ws_need.tiles : nullptr;

  // Nodes already launched as part of an earlier node's kernel.
  std::vector<char> done(n, 0);

  // The node after node i that does work (leaves, such as the weights a model's builder makes as
  // it goes, lie anywhere in between); n when none.
  auto next_op = [&](int i) {
    int j = i + 1;
    while (j < n && nodes[j]->op == Op::Leaf) ++j;
    return j;
  };

  // Where the producer of x writes x's 8-bit form too, when quantized mat-vecs read x and the
  // producer can (`can`: its own condition): the workspace, and x is marked prepared. Else
  // nullptr.
  auto q8_output = [&](const Tensor* x, bool can = true) -> uint8_t* {
    const int p = pos(x);
    if (!can || p < 0 || !q8_read[p] || x->ne[0] % 32 != 0 || x->ne[1] > kMatVecMaxCols)
      return nullptr;
    prepared = x;
    prepared_form = Form::Q8;
    q8_at = buf.act;
    return buf.act;
  };
  // The same for the column tiles, where warp-pipelined products read x and no quantized
  // mat-vec does (a producer writes one 8-bit form; with a mat-vec reading the plain one, the
  // first product quantizes the tiles itself): the tile region, and x's tiles are marked
  // prepared. The padding columns of the last tile are left unwritten, unlike
  // launch_quantize_act_tiles's zeros: mat_mul_qw_kernel's columns never mix (each output column
  // sums its own column's quants and pairs) and it stores no column past cols, so whatever they
  // hold reaches no result.
  auto tiles_output = [&](const Tensor* x, bool can = true) -> uint8_t* {
    const int p = pos(x);
    if (!can || !tile_output() || !tiles || p < 0 || !tile_read[p] || q8_read[p] ||
        x->ne[0] % 32 != 0)
      return nullptr;
    prepared_tiles = x;
    return tiles;
  };
  // The same for the half form (launch_act_to_half's, without its padding: rows a multiple of
  // kActPad), where only products that take half activations read x (never beside q8_output's,
  // which needs a mat-vec reading x).
  auto half_output = [&](const Tensor* x, bool can = true) -> uint8_t* {
    const int p = pos(x);
    if (!can || p < 0 || !half_read[p] || q8_read[p] || x->ne[0] % kActPad != 0) return nullptr;
    prepared = x;
    prepared_form = Form::Half;
    return buf.act;
  };

  // Launches rms_norm node ri as one kernel with: the Add node `add` before it (or none), the
  // weight multiply after it when nothing else reads the norm, and the 8-bit form of the result
  // when quantized mat-vecs read it. Refuses (false) when the result's memory overlaps the sum
  // it also writes, or inputs that other threads of the kernel may still read (only where the
  // kernel does not read everything first: several columns or wide rows).
  // pre (with add): the norm node whose weighted result is add's second input; add then takes
  // its input unnormalized and the kernel normalizes it (one column in registers only).
  auto launch_norm_now = [&](int ri, const Tensor* add, const Tensor* pre = nullptr,
                             const Tensor* pre_w = nullptr) {
    const Tensor* r = nodes[ri];
    // A grouped norm (per-head q/k norms) runs as a norm of as many short columns.
    const int64_t group = r->params[kNormGroup];
    const int64_t cols = r->ne[1] * (r->ne[0] / group);
    const bool reads_first = cols == 1 && group <= kNormRegElems;
    const Tensor* in = add ? add : r->src[0];
    const int mi = next_op(ri);
    const Tensor* next = mi < n ? nodes[mi] : nullptr;
    const Tensor* w = nullptr;
    if (next && next->op == Op::Mul && !done[mi] && uses[ri] == 1 && r != graph.output() &&
        next->src[0] == r && next->src[1] != r && next->src[1]->ne[0] == group &&
        (next->src[1]->ne[1] == 1 || group == r->ne[0]) &&
        (!scratch_overlap(next, in) || (reads_first && !add)))
      w = next->src[1];
    const Tensor* out = w ? next : r;
    // Several columns: a block a column reads its column into registers before it writes, so
    // the result may take the place of an input exactly (as the planner gives it the product's
    // that the add consumed), though not overlap one otherwise.
    const bool column_first = group == r->ne[0] && group <= kNormRegElems;
    auto clash = [&](const Tensor* x) {
      return scratch_overlap(out, x) &&
             !(column_first && out->offset == x->offset && out->type == x->type &&
               out->ne[0] == x->ne[0] && out->n_elements() == x->n_elements());
    };
    if (add &&
        (scratch_overlap(out, add) || (!reads_first && (clash(add->src[0]) || clash(add->src[1])))))
      return false;
    NormArgs a;
    a.src = fptr(add ? add->src[0] : r->src[0]);
    if (add) {
      a.add = fptr(pre ? pre->src[0] : add->src[1]);
      a.sum_out = fptr(add);
    }
    if (pre) {
      if (!reads_first) return false;
      a.add_w = fptr(pre_w);
      a.add_eps = pre->param_f(kNormEps);
    }
    if (w) {
      a.w = fptr(w);
      a.w_cols = w->ne[1];
      a.w_fixed = w->storage == Storage::Weight;
    }
    a.dst = fptr(out);
    a.quant_ws = tiles_output(out, group == r->ne[0]);
    a.quant_tiles = a.quant_ws != nullptr;
    if (!a.quant_tiles) a.quant_ws = q8_output(out, group == r->ne[0]);
    a.half_ws = half_output(out, group == r->ne[0]);
    launch_rms_norm(l, a, group, cols, r->param_f(kNormEps));
    done[ri] = 1;
    if (w) done[mi] = 1;
    return true;
  };

  // A one-column norm put off for the products right after it to work out (NormFold): the
  // weighted result they read, the norm's node, the residual add it takes (or none), the
  // products' node and the fold's arguments. x is null when none is.
  struct PendingFold {
    const Tensor* x = nullptr;
    int ri = -1, pi = -1;
    const Tensor* add = nullptr;
    NormFold f;
  } fold;
  // Puts norm ri (with the add before it, or none) off where the next node to launch after its
  // weight multiply is a one-column product of quantized weights reading the result, and no node
  // up to norm_fold_reach writes where the fold reads (the planner keeps those inputs
  // allocated). Whether that product's launch takes it is decided there (fold_for).
  auto defer_norm = [&](int ri, const Tensor* add) {
    const Tensor* r = nodes[ri];
    const int64_t ne0 = r->ne[0];
    if (r->ne[1] != 1 || r->params[kNormGroup] != ne0 || ne0 % 32 != 0 || ne0 > 1024 ||
        uses[ri] != 1 || r == graph.output())
      return false;
    const int mi = next_op(ri);
    const Tensor* mul = mi < n ? nodes[mi] : nullptr;
    if (!mul || done[mi] || mul->op != Op::Mul || mul->src[0] != r || mul->src[1] == r ||
        mul == graph.output())
      return false;
    const Tensor* w = mul->src[1];
    if (w->storage != Storage::Weight || w->type != DType::F32 || w->ne[0] != ne0 ||
        w->ne[1] != 1 || (add && scratch_overlap(mul, add)))
      return false;
    const int pi = next_op(mi);
    const Tensor* p = pi < n ? nodes[pi] : nullptr;
    // (With the fold off, or a format no launch folds, the norm goes out at once: no deferral
    // that fold_for would only undo.)
    if (!p || p->op != Op::MulMat || p->src[1] != mul || p->src[0]->ne[0] != ne0 ||
        !is_quantized(p->src[0]->type) ||
        mat_mul_q_kind(p->src[0]->type, ne0, 1) != MatMulQ::None ||
        !mat_vec_folds_norm(p->src[0]->type, p->src[0]->type, ne0))
      return false;
    const Tensor* reads[2] = {add ? add->src[0] : r->src[0], add ? add->src[1] : nullptr};
    const int reach = norm_fold_reach(nodes, ri);
    for (int j = ri + 1; j <= reach; ++j) {
      for (const Tensor* s : reads) {
        if (s && scratch_overlap(nodes[j], s)) return false;
      }
    }
    for (const Tensor* s : reads) {
      if (s && add && scratch_overlap(add, s)) return false;
    }
    fold.x = mul;
    fold.ri = ri;
    fold.pi = pi;
    fold.add = add;
    fold.f = NormFold{fptr(reads[0]),
                      reads[1] ? fptr(reads[1]) : nullptr,
                      add ? fptr(add) : nullptr,
                      fptr(w),
                      r->param_f(kNormEps),
                      static_cast<int>(ne0)};
    done[ri] = done[mi] = 1;
    return true;
  };
  // Launches the norm put off, if one is (its products then read the 8-bit form it leaves).
  auto flush_norm = [&]() {
    if (!fold.x) return;
    const PendingFold f = fold;
    fold = PendingFold{};
    done[f.ri] = done[next_op(f.ri)] = 0;
    // Recorded at the node it would have gone out at: the add's, or the norm's.
    const int node = l.node;
    l.node = f.add ? pos(f.add) : f.ri;
    if (!launch_norm_now(f.ri, f.add))
      throw std::logic_error("launch_graph: a norm put off for its products would not launch");
    l.node = node;
  };
  // The fold for a launch of product x whose launch reads x `readers` times, of formats type and
  // type_b: where every reader of x is in it and its kernel takes the fold. Otherwise the norm
  // goes out first (and nullptr).
  auto fold_for = [&](const Tensor* x, int readers, DType type, DType type_b) -> const NormFold* {
    if (!fold.x || fold.x != x) return nullptr;
    const int p = pos(x);
    if (p >= 0 && readers == uses[p] && mat_vec_folds_norm(type, type_b, x->ne[0])) return &fold.f;
    flush_norm();
    return nullptr;
  };
  // After a launch that took the fold.
  auto fold_taken = [&](const NormFold* f) {
    if (f) fold = PendingFold{};
  };
  // The norm's kernel, or the fold above (nothing to launch yet).
  auto launch_norm = [&](int ri, const Tensor* add, const Tensor* pre = nullptr,
                         const Tensor* pre_w = nullptr) {
    if (!pre && defer_norm(ri, add)) return true;
    return launch_norm_now(ri, add, pre, pre_w);
  };

  // How a two-tensor rope launch reads (rope_token_fits, rope_reads_first): kRopeAll, every read
  // before any write (one token); kRopeToken, a token a block, its rows read first; else neither.
  constexpr int kRopeToken = 1, kRopeAll = 2;
  // Whether such a launch may write x where it reads y: where they do not overlap; with
  // kRopeAll, anywhere; with kRopeToken, where x takes y's place exactly, with y's row width (a
  // token's rows are then the same bytes, in one block).
  auto rope_apart = [&](const Tensor* x, const Tensor* y, int reads) {
    if (!scratch_overlap(x, y) || reads == kRopeAll) return true;
    return reads == kRopeToken && x->offset == y->offset && x->type == y->type &&
           x->ne[0] == y->ne[0] && x->ne[1] == y->ne[1];
  };
  // Whether rope c may go out in the launch of rope t (q's and k's: the same positions and
  // parameters, neither writing what the other reads unless the launch reads it first); with
  // c_written false, where c's rotated rows go to the cache only (c's output is not written).
  auto ropes_pair = [&](const Tensor* t, const Tensor* c, int reads, bool c_written = true) {
    return c->op == Op::Rope && c->src[1] == t->src[1] && c->ne[1] == t->ne[1] &&
           c->params[kRopeHeadDim] == t->params[kRopeHeadDim] &&
           c->params[kRopeNDims] == t->params[kRopeNDims] &&
           c->params[kRopeMode] == t->params[kRopeMode] &&
           c->params[kRopeBase] == t->params[kRopeBase] &&
           c->params[kRopeScale] == t->params[kRopeScale] && c->src[2] == t->src[2] &&
           (reads == kRopeAll ||
            ((!c_written || (!scratch_overlap(c, t) && rope_apart(c, t->src[0], reads))) &&
             rope_apart(t, c->src[0], reads)));
  };

  // Per-head q/k norms (rms_norm per head, times the head weight) right before the ropes of q
  // and k go into the ropes' launch (one token): the rope of q's node then reads the raw
  // products. Only when nothing but the four norm nodes lies between the products and the
  // ropes, so that no launch in between can overwrite the products.
  struct HeadNorm {
    const Tensor* q_in = nullptr;
    const Tensor* k_in = nullptr;
    RopeHeadNorm norm;
  };
  std::unordered_map<int, HeadNorm> head_norms;  // by the q rope's node
  auto head_norm_mul = [&](int ri) -> int {      // the weight multiply of head norm ri, or -1
    const Tensor* r = nodes[ri];
    const int mi = next_op(ri);
    // (With one KV head, k's norm spans its whole column: the rope it feeds says it is a head's.)
    if (r->op != Op::RmsNorm || r->ne[1] != 1 || uses[ri] != 1 || mi >= n || r == graph.output())
      return -1;
    const Tensor* m = nodes[mi];
    const Tensor* w = m->src[1];
    const bool ok = m->op == Op::Mul && m->src[0] == r && w && w != r &&
                    w->storage == Storage::Weight && w->ne[0] == r->params[kNormGroup] &&
                    w->ne[1] == 1 && uses[mi] == 1 && m != graph.output();
    return ok ? mi : -1;
  };
  for (int i = 0; i < n; ++i) {
    const int qm = head_norm_mul(i);
    if (qm < 0) continue;
    const int kr = next_op(qm);
    const int km = kr < n ? head_norm_mul(kr) : -1;
    const int rq = km >= 0 ? next_op(km) : n;
    const int rk = rq < n ? next_op(rq) : n;
    if (rk >= n) continue;
    const Tensor *q = nodes[rq], *k = nodes[rk];
    const int hd = q->params[kRopeHeadDim];
    if (q->op != Op::Rope || k->op != Op::Rope || q->src[0] != nodes[qm] ||
        k->src[0] != nodes[km] || q->ne[1] != 1 || nodes[i]->params[kNormGroup] != hd ||
        nodes[kr]->params[kNormGroup] != hd ||
        nodes[i]->params[kNormEps] != nodes[kr]->params[kNormEps] || !ropes_pair(q, k, kRopeAll) ||
        !rope_norm_fits(1, q->params[kRopeNHead], k->params[kRopeNHead], hd))
      continue;
    HeadNorm h;
    h.q_in = nodes[i]->src[0];
    h.k_in = nodes[kr]->src[0];
    h.norm.w0 = fptr(nodes[qm]->src[1]);
    h.norm.w1 = fptr(nodes[km]->src[1]);
    h.norm.eps = nodes[i]->param_f(kNormEps);
    head_norms[rq] = h;
    done[i] = done[qm] = done[kr] = done[km] = 1;
  }

  // The next node not yet launched after node `from` (-1: none within the window).
  auto next_open = [&](int from) {
    for (int j = from + 1; j < n && j <= from + kGroupWindow; ++j) {
      if (nodes[j]->op != Op::Leaf && !done[j]) return j;
    }
    return -1;
  };
  // The four nodes to launch after node `from` (where the rope epilogues below take the ropes of
  // q and k and the K and V stores), or false where fewer are left in reach.
  auto next_four = [&](int from, int(&j)[4]) {
    for (int& x : j) x = from = from >= 0 ? next_open(from) : -1;
    return from >= 0;
  };

  // The angle table of rope node r's configuration (prepare_rope_tables), or none.
  auto rope_table_of = [&](const Tensor* r) -> const RopeTable* {
    if (!rope_table_enabled()) return nullptr;
    const RopeTable want = rope_config(r, r->src[2] ? fptr(r->src[2]) : nullptr);
    for (int t = 0; t < buf.n_rope_tables; ++t) {
      if (same_rope_config(buf.rope_tables[t], want)) return &buf.rope_tables[t];
    }
    return nullptr;
  };

  // The rope epilogue of one token's q, k and v products (MatVecRope), whose nodes are
  // same[0..2] (already marked launched; v's weight in v_type): where the next four nodes to
  // launch are the ropes of q and k (normal mode, the same positions and parameters: ropes_pair;
  // a head-normed rope reads the norm, not the product) and the K and V stores of the rotated k
  // and of v into caches of one position, both F16 or both Q8_0 (whose groups of 32 values the
  // launch quantizes by tickets in the counters' memory, attn_workspace_bytes). q's and k's
  // products then exist nowhere but in registers: only their ropes may read them. The kernel
  // reads no scratch but the positions, which none of its outputs may overlap, and with float
  // weights (F32, F16, BF16: model weights only) the float activation, which the ropes' outputs
  // may not overlap either (the planner keeps it allocated until the ropes for that). Returns
  // whether it launched them all.
  auto rope_epilogue = [&](const int(&same)[3], const MatVecPart(&parts)[3], DType type,
                           DType v_type, int64_t k) {
    const Tensor* act_in = nodes[same[0]]->src[1];
    int j[4];
    if (!next_four(same[0], j)) return false;
    const Tensor *rq = nodes[j[0]], *rk = nodes[j[1]], *ks = nodes[j[2]], *vs = nodes[j[3]];
    const Tensor *q = nodes[same[0]], *kp = nodes[same[1]], *v = nodes[same[2]];
    const int hd = rq->params[kRopeHeadDim];
    const bool ok =
        rq->op == Op::Rope && rq->src[0] == q && rq->params[kRopeMode] == kRopeNormal &&
        rq->ne[1] == 1 && hd > 0 && hd % 2 == 0 && !scratch_overlap(rq->src[1], rq) &&
        !scratch_overlap(rq->src[1], rk) && !scratch_overlap(rq->src[1], v) && q->ne[0] % hd == 0 &&
        kp->ne[0] % hd == 0 && v->ne[0] % 2 == 0 && ropes_pair(rq, rk, kRopeAll) &&
        rk->src[0] == kp && uses[same[0]] == 1 && uses[same[1]] == 1 && q != graph.output() &&
        kp != graph.output() && ks->op == Op::KvStore && ks->src[0] == rk &&
        vs->op == Op::KvStore && vs->src[0] == v && vs->kv[0] == ks->kv[0] &&
        (kv_target(ks)->type == DType::F16 || kv_target(ks)->type == DType::Q8_0) &&
        kv_target(vs)->type == kv_target(ks)->type && kv_target(ks)->ne[0] == kp->ne[0] &&
        kv_target(vs)->ne[0] == v->ne[0] && kv_target(vs)->ne[1] == kv_target(ks)->ne[1] &&
        kv_target(vs)->data != kv_target(ks)->data &&
        (is_quantized(type) || (!scratch_overlap(act_in, rq) && !scratch_overlap(act_in, rk)));
    if (!ok) return false;
    const NormFold* f = fold_for(act_in, 3, type, v_type);
    MatVecRope r;
    r.pos = static_cast<const int32_t*>(ptr(rq->src[1]));
    r.freq_factors = rq->src[2] ? fptr(rq->src[2]) : nullptr;
    r.first_row = kv_at(ks->kv[0]);
    r.k_cache = kv_target(ks)->data;
    r.v_cache = kv_target(vs)->data;
    r.q_out = fptr(rq);
    r.k_out = fptr(rk);
    if (kv_target(ks)->type == DType::Q8_0) {
      if (!buf.attn_counters) return false;  // no tickets: the stores go apart
      r.q8_tickets = buf.attn_counters;
      r.v_tickets = static_cast<int>(kp->ne[0] / 32);
    }
    r.head_dim = hd;
    r.n_dims = rq->params[kRopeNDims];
    r.rows = static_cast<int>(kv_target(ks)->ne[1]);
    r.freq_base = rq->param_f(kRopeBase);
    r.freq_scale = rq->param_f(kRopeScale);
    if (const RopeTable* rt = rope_table_of(rq)) {
      r.table = rt->data;
      r.table_rows = rt->rows;
    }
    if (!launch_mat_vec_rope(l, type, v_type, parts, k, q8_at, r, f, fptr(act_in))) return false;
    fold_taken(f);
    for (int x : j) done[x] = 1;
    return true;
  };

  // The gated unit in the epilogue of one token's gate and up products (MatVecGlu), whose nodes
  // are same[0] and same[1] (already marked launched): where the next node to launch is the glu
  // of exactly those two, which nothing else reads, and the glu's output lies clear of the nodes
  // between gate and it that go out after this launch. The products then exist nowhere but in
  // registers. The glu's 8-bit form, where quantized mat-vecs read it, goes to the workspace's
  // own region for it (the launch still reads its activation at q8_at; not where that is the
  // region itself, a glu's result whose products feed another glu). Returns whether it
  // launched them.
  auto glu_epilogue = [&](const int(&same)[3], const MatVecPart(&parts)[3], DType type, int64_t k) {
    const int gi = next_open(same[1]);
    if (gi < 0) return false;
    const Tensor* g = nodes[gi];
    const Tensor *gate = nodes[same[0]], *up = nodes[same[1]];
    const int p = pos(g);
    if (g->op != Op::Glu || g->src[0] != gate || g->src[1] != up || g->ne[1] != 1 ||
        g->ne[0] % 32 != 0 || uses[same[0]] != 1 || uses[same[1]] != 1 || gate == graph.output() ||
        up == graph.output() || p < 0 || half_read[p] || tile_read[p] ||
        (q8_read[p] && !glu_q8 && buf.act) || (glu_q8 && q8_at == glu_q8))
      return false;
    // The glu's write moves before the nodes between gate and it that go out later.
    if (!write_moves_before(nodes, same[0], gi, g, &done)) return false;
    MatVecGlu a;
    a.dst = fptr(g);
    a.act = g->params[0];
    if (q8_read[p] && glu_q8) {
      const ActQ8 q = act_q8(glu_q8, g->ne[0], 1);
      a.qs = q.qs;
      a.ds = q.ds;
    }
    if (!launch_mat_vec_glu(l, type, parts, k, q8_at, a)) return false;
    done[gi] = 1;
    if (q8_read[p]) {
      prepared = g;
      prepared_form = Form::Q8;
      q8_at = glu_q8;
    }
    return true;
  };

  // The rope epilogue of a few tokens' q, k and v products on the warp-pipelined kernel
  // (MatMulQRope), whose nodes are group[0..2] (already marked launched): where the next four
  // nodes to launch are the ropes of q and k (normal mode, the same positions and parameters),
  // the K store of the rotated k, which nothing else reads, and the V store of v, into F16 caches
  // by the same rows (one sequence) or slots (a decode batch). q's and k's products then exist
  // nowhere but in registers. The kernel reads no scratch but the positions and slots, which
  // none of its outputs may overlap. Fills r and marks the four launched where they fit.
  auto warp_rope_epilogue = [&](const int* group, int n_parts, int cols, MatMulQRope* r) {
    if (n_parts != 3 || !warp_rope_epilogue_enabled()) return false;
    int j[4];
    if (!next_four(group[0], j)) return false;
    const int jk = j[1];
    const Tensor *rq = nodes[j[0]], *rk = nodes[jk], *ks = nodes[j[2]], *vs = nodes[j[3]];
    const Tensor *q = nodes[group[0]], *kp = nodes[group[1]], *v = nodes[group[2]];
    const int hd = rq->params[kRopeHeadDim];
    const bool seqs = ks->op == Op::KvStoreSeqs;
    const Tensor* slots = seqs ? ks->src[2] : nullptr;
    auto apart = [&](const Tensor* in) {
      return !in || (!scratch_overlap(in, rq) && !scratch_overlap(in, v));
    };
    const bool ok =
        rq->op == Op::Rope && rq->src[0] == q && rq->params[kRopeMode] == kRopeNormal &&
        rq->ne[1] == cols && hd > 0 && hd % 2 == 0 && rq->params[kRopeNDims] <= kQwRopeMaxDims &&
        q->ne[0] % hd == 0 && kp->ne[0] % hd == 0 && ropes_pair(rq, rk, kRopeAll) &&
        rk->src[0] == kp && uses[group[0]] == 1 && uses[group[1]] == 1 && uses[jk] == 1 &&
        q != graph.output() && kp != graph.output() && rk != graph.output() && apart(rq->src[1]) &&
        apart(rq->src[2]) && apart(slots) && (ks->op == Op::KvStore || seqs) && vs->op == ks->op &&
        ks->src[0] == rk && vs->src[0] == v && kv_target(ks)->type == DType::F16 &&
        kv_target(vs)->type == DType::F16 && kv_target(vs)->data != kv_target(ks)->data &&
        (seqs ? vs->src[2] == slots && vs->params[kKvSeqRows] == ks->params[kKvSeqRows]
              : vs->kv[0] == ks->kv[0] && kv_target(vs)->ne[1] == kv_target(ks)->ne[1]);
    if (!ok) return false;
    r->pos = static_cast<const int32_t*>(ptr(rq->src[1]));
    r->freq_factors = rq->src[2] ? fptr(rq->src[2]) : nullptr;
    if (seqs) {
      r->slots = static_cast<const int32_t*>(ptr(slots));
      r->rows = ks->params[kKvSeqRows];
    } else {
      r->first_row = kv_at(ks->kv[0]);
      r->rows = static_cast<int>(kv_target(ks)->ne[1]);
    }
    r->k_cache = kv_target(ks)->data;
    r->v_cache = kv_target(vs)->data;
    r->q_out = fptr(rq);
    r->head_dim = hd;
    r->n_dims = rq->params[kRopeNDims];
    r->n_tokens = cols;
    r->freq_base = rq->param_f(kRopeBase);
    r->freq_scale = rq->param_f(kRopeScale);
    if (const RopeTable* rt = rope_table_of(rq)) {
      r->table = rt->data;
      r->table_rows = rt->rows;
    }
    for (int x : j) done[x] = 1;
    return true;
  };

  for (int i = 0; i < n; ++i) {
    const Tensor* t = nodes[i];
    if (done[i]) continue;
    if (fold.x && i != fold.pi && t->op != Op::Leaf) flush_norm();
    l.node = i;
    switch (t->op) {
      case Op::Leaf:
        break;
      case Op::GetRows:
        launch_get_rows(l, t->src[0]->type, ptr(t->src[0]), t->src[0]->ne[0], t->src[0]->ne[1],
                        static_cast<const int32_t*>(ptr(t->src[1])),
                        static_cast<int>(t->src[1]->ne[0]), fptr(t), t->param_f(0));
        break;
      case Op::RmsNorm: {
        // A post-norm (Gemma's): rms_norm(a) * w added to the residual, whose sum the next
        // pre-norm reads at once. All four go into that norm's kernel, which normalizes a itself
        // (decode batches: one column).
        const int mi = next_op(i);
        const int ai = mi < n ? next_op(mi) : n;
        const int ri = ai < n ? next_op(ai) : n;
        if (ri < n && t->ne[1] == 1 && t->params[kNormGroup] == t->ne[0] && uses[i] == 1 &&
            t != graph.output() && nodes[mi] != graph.output()) {
          const Tensor* mul = nodes[mi];
          const Tensor* add = nodes[ai];
          const Tensor* r = nodes[ri];
          if (mul->op == Op::Mul && mul->src[0] == t && mul->src[1] != t &&
              mul->src[1]->ne[0] == t->ne[0] && mul->src[1]->ne[1] == 1 && uses[mi] == 1 &&
              add->op == Op::Add && add->src[1] == mul && add->src[0] != mul &&
              add->src[0]->ne[0] == t->ne[0] && add->src[0]->ne[1] == 1 && r->op == Op::RmsNorm &&
              r->src[0] == add && r->params[kNormGroup] == r->ne[0] &&
              launch_norm(ri, add, t, mul->src[1])) {
            done[i] = done[mi] = done[ai] = 1;
            break;
          }
        }
        launch_norm(i, nullptr);
        break;
      }
      case Op::Add: {
        // The residual add and the norm that reads it (as each layer has them): one kernel.
        const int ri = next_op(i);
        const Tensor* r = ri < n ? nodes[ri] : nullptr;
        if (r && r->op == Op::RmsNorm && r->src[0] == t && t->src[1]->ne[1] == t->ne[1] &&
            t->src[1]->ne[0] == t->ne[0] && r->params[kNormGroup] == r->ne[0] && launch_norm(ri, t))
          break;
        launch_binary(l, 0, fptr(t->src[0]), fptr(t->src[1]), t->src[1]->ne[1], fptr(t),
                      t->src[0]->ne[0], t->src[0]->ne[1], t->src[1]->ne[0]);
        break;
      }
      case Op::Mul:
        launch_binary(l, 1, fptr(t->src[0]), fptr(t->src[1]), t->src[1]->ne[1], fptr(t),
                      t->src[0]->ne[0], t->src[0]->ne[1], t->src[1]->ne[0]);
        break;
      case Op::Glu: {
        uint8_t* tw = tiles_output(t);
        launch_glu(l, t->params[0], fptr(t->src[0]), fptr(t->src[1]), fptr(t), t->ne[0], t->ne[1],
                   tw ? tw : q8_output(t), half_output(t), tw != nullptr);
        break;
      }
      case Op::Softcap:
        launch_softcap(l, fptr(t->src[0]), fptr(t), t->n_elements(), t->param_f(0));
        break;
      case Op::Sample: {
        // A chain's steps after this one are conditional nodes of its graph, where the
        // executor makes them so (Launcher::gate): each runs only if the step before it sampled
        // no stop id.
        const int next = t->params[0] + 1;
        const bool gated = next < graph.chain;
        launch_sample(l, fptr(t->src[0]), static_cast<int>(t->src[0]->ne[0]),
                      static_cast<const int32_t*>(ptr(t->src[1])), static_cast<int32_t*>(t->data),
                      t->params[0], t->params[1], buf.sample_work, gated ? l.step_handle(next) : 0);
        if (gated) l.open_step(next);
        break;
      }
      case Op::ChainLoop: {
        const Tensor* last = t->src[0];
        ChainLoopArgs a;
        a.tokens = static_cast<const int32_t*>(last->data);
        a.k = t->params[kLoopChain];
        a.k_total = last->params[1];
        a.config = static_cast<int32_t*>(ptr(t->src[1]));
        a.history_cap = static_cast<int>(t->src[1]->ne[0]) - sample_word::kHeader;
        a.first = static_cast<int32_t*>(ptr(t->src[2]));
        const std::vector<Tensor*>& positions = graph.loop_positions();
        if (positions.size() != size_t(a.k))
          throw std::logic_error("launch_graph: a chain loop without its steps' positions");
        for (int j = 0; j < a.k; ++j) a.positions[j] = static_cast<int32_t*>(ptr(positions[j]));
        a.record = buf.kv_record;
        a.control = static_cast<int32_t*>(ptr(t->src[3]));
        a.out = static_cast<int32_t*>(t->data);
        a.capacity = t->params[kLoopCapacity];
        a.host = buf.loop_host;
        a.halt = buf.loop_halt;
        // The round's kernel runs after every step, skipped or not; then the loop ends.
        l.end_steps();
        a.loop = l.loop_handle();
        for (int j = 1; j < a.k; ++j) a.steps[j] = l.step_handle(j);
        // Not programmatic: its launch follows a conditional node, not a kernel.
        const bool pdl = std::exchange(l.pdl, false);
        launch_chain_loop_round(l, a);
        l.pdl = pdl;
        l.close_loop();
        break;
      }
      case Op::MulMat: {
        const Tensor* w = t->src[0];
        const Tensor* x = t->src[1];
        const int64_t k = w->ne[0];
        const int cols = static_cast<int>(x->ne[1]);
        // The products read their matrices through the read-only path, which ptxas may move
        // above the wait for the kernel before: the product of a matrix the graph computes (a
        // float one; a quantized one must be a weight) launches without programmatic
        // dependence, so that it starts once every kernel before it has finished.
        struct LaunchInOrder {
          Launcher& l;
          const bool was;
          LaunchInOrder(Launcher& launcher, bool on) : l(launcher), was(launcher.pdl) {
            if (on) l.pdl = false;
          }
          ~LaunchInOrder() { l.pdl = was; }
        } in_order(l, w->storage != Storage::Weight);
        // The 8-bit form of x in the workspace, unless it is there already.
        auto prepare_q8 = [&]() {
          if (fold.x == x) flush_norm();
          if (prepared == x && prepared_form == Form::Q8) return;
          launch_quantize_act(l, fptr(x), k, cols, buf.act);
          prepared = x;
          prepared_form = Form::Q8;
          q8_at = buf.act;
        };
        // The activation's half form in the workspace, unless it is there already.
        auto prepare_half = [&](Form form) {
          if (prepared == x && prepared_form == form) return;
          launch_act_to_half(l, fptr(x), k, cols, buf.act, form == Form::BF16);
          prepared = x;
          prepared_form = form;
        };
        if (const MatMulQ q = mat_mul_q_kind(w->type, k, cols); q != MatMulQ::None) {
          if (q == MatMulQ::Int8Warp) {
            if (prepared_tiles != x) {
              launch_quantize_act_tiles(l, fptr(x), k, cols, tiles);
              prepared_tiles = x;
            }
          } else if (q == MatMulQ::Int8) {
            prepare_q8();
          } else {
            prepare_half(Form::Half);
          }
          // Products of the same activation close after it (q, k, v; gate, up) in one launch.
          int group[kMatMulQMaxParts];
          const int n_parts = mat_mul_q_group(nodes, i, done, group);
          MatMulQPart parts[kMatMulQMaxParts];
          for (int p = 0; p < n_parts; ++p) {
            const Tensor* c = nodes[group[p]];
            parts[p] = {ptr(c->src[0]), c->src[0]->ne[1], fptr(c)};
            done[group[p]] = 1;
          }
          MatMulQRope rope;
          const bool with_rope =
              q == MatMulQ::Int8Warp && warp_rope_epilogue(group, n_parts, cols, &rope);
          launch_mat_mul_q(l, w->type, parts, n_parts, k,
                           q == MatMulQ::Int8Warp ? tiles
                           : q == MatMulQ::Int8   ? q8_at
                                                  : buf.act,
                           cols, buf.attn, buf.attn_counters, with_rope ? &rope : nullptr);
          break;
        }
        if (cols > kMatVecMaxCols) {
          // cuBLAS takes products of F16 and BF16 weights, and of quantized ones decoded to
          // half a chunk of rows at a time, where it is loaded (blas.h).
          const int64_t n_out = w->ne[1];
          const bool quant = is_quantized(w->type);
          const int64_t chunk = quant ? std::min(n_out, dequant_chunk_rows(k)) : n_out;
          const bool blas =
              buf.blas && gemm_wants_blas(w->type, cols) &&
              (!quant || static_cast<size_t>(chunk * act_half_pitch(k) * 2) <= buf.wdeq_bytes);
          prepare_half(blas && w->type == DType::BF16 ? Form::BF16 : Form::Half);
          const int64_t kp = act_half_pitch(k);
          if (blas && quant) {
            for (int64_t r0 = 0; r0 < n_out; r0 += chunk) {
              const int64_t rows = std::min(chunk, n_out - r0);
              launch_dequant_half(l, w->type, ptr(w), n_out, k, r0, rows, buf.wdeq);
              buf.blas->gemm(l, DType::F16, buf.wdeq, kp, rows, k, buf.act, kp, cols, fptr(t) + r0,
                             n_out);
            }
          } else if (blas) {
            buf.blas->gemm(l, w->type, ptr(w), k, n_out, k, buf.act, kp, cols, fptr(t), n_out);
          } else {
            launch_mat_mul_tc(l, w->type, ptr(w), w->ne[1], k, buf.act, cols, fptr(t));
          }
          break;
        }
        // With a norm put off for these products, the 8-bit activation is the launch's own work
        // (fold_for), or the norm's once it goes out.
        if (is_quantized(w->type) && fold.x != x) prepare_q8();
        // Mat-vecs of the same activation and weight format close together (q, k, v; gate, up)
        // go out as one launch at the first of them, where that moves no write over memory
        // that the nodes in between still use.
        // A product of another quantized format among them (v in Q6_K beside q and k in Q4_K,
        // as K-quant mixes store them) joins a one-column launch where a kernel takes the pair.
        MatVecPart parts[3];
        int same[3] = {i, -1, -1}, n_parts = 0, other = -1;
        auto part_of = [&](const Tensor* c) {
          return MatVecPart{ptr(c->src[0]), c->src[0]->ne[1], fptr(c),
                            c->src[0]->storage == Storage::Weight};
        };
        parts[n_parts++] = part_of(t);
        for (int j = i + 1; j < n && j <= i + kGroupWindow && n_parts < 3; ++j) {
          const Tensor* c = nodes[j];
          if (c->op != Op::MulMat || done[j] || c->src[1] != x || c->src[0]->ne[0] != k) continue;
          const bool mixed = c->src[0]->type != w->type;
          if (mixed &&
              (other >= 0 || cols != 1 || !is_quantized(w->type) || !is_quantized(c->src[0]->type)))
            continue;
          if (!joins_launch_of(nodes, i, j)) continue;
          if (mixed) {
            other = j;
          } else {
            same[n_parts] = j;
            parts[n_parts++] = part_of(c);
          }
        }
        for (int p = 0; p < n_parts; ++p) done[same[p]] = 1;
        if (n_parts == 3 && other < 0 && cols == 1 &&
            rope_epilogue(same, parts, w->type, w->type, k))
          break;
        if (n_parts == 2 && other < 0 && cols == 1 && is_quantized(w->type) && fold.x != x &&
            glu_epilogue(same, parts, w->type, k))
          break;
        if (other >= 0 && n_parts < 3) {
          parts[n_parts] = part_of(nodes[other]);
          if (n_parts == 2) {
            // q and k in one format, v in another (a K-quant mix): the rope epilogue too.
            const int trio[3] = {same[0], same[1], other};
            done[other] = 1;
            if (rope_epilogue(trio, parts, w->type, nodes[other]->src[0]->type, k)) break;
            done[other] = 0;
          }
          const DType other_type = nodes[other]->src[0]->type;
          const NormFold* f = fold_for(x, n_parts + 1, w->type, other_type);
          if (launch_mat_vec_mixed(l, w->type, other_type, parts, n_parts, k, q8_at, f)) {
            fold_taken(f);
            done[other] = 1;
            break;
          }
        }
        const NormFold* f = fold_for(x, n_parts, w->type, w->type);
        launch_mat_vec(l, w->type, parts, n_parts, k, fptr(x), q8_at, cols, f);
        fold_taken(f);
        break;
      }
      case Op::Rope: {
        // The rope of k right after that of q (only already launched nodes between, the same
        // positions and parameters, neither writing what the other reads): one launch.
        const Tensor* pair = nullptr;
        bool k_cache_only = false;
        int reads = 0;
        const int jk = next_open(i);
        if (jk >= 0 && nodes[jk]->op == Op::Rope) {
          const Tensor* c = nodes[jk];
          // A token a block reads its rows before writing: then k's rope may write where q's
          // product was (as the planner arranges), for one token anywhere.
          const int64_t rs = rope_slots(t->params[kRopeNHead], t->params[kRopeHeadDim],
                                        c->params[kRopeNHead], true);
          const int hd = t->params[kRopeHeadDim];
          reads = rope_reads_first(static_cast<int>(t->ne[1]), rs, hd) ? kRopeAll
                  : rope_token_fits(rs, hd)                            ? kRopeToken
                                                                       : 0;
          if (ropes_pair(t, c, reads)) {
            pair = c;
            done[jk] = 1;
          } else if (ropes_pair(t, c, reads, /*c_written=*/false) && uses[jk] == 1 &&
                     c != graph.output()) {
            // Rotated k that only its K store reads need not exist anywhere but in the cache:
            // the pair holds if that store rides along (below), whatever k's own output overlaps
            // (a GQA batch's k, narrower than q, where q's product was).
            pair = c;
            k_cache_only = true;
            done[jk] = 1;
          }
        }
        // Then the K store of the rotated k and the V store of rows already computed, next to
        // each other (or a decode batch's stores into its pools, by the same slots): they ride
        // along too.
        RopeKvStore kv;
        bool with_kv = false;
        if (pair) {
          const int js = next_open(jk);
          const int jv = js >= 0 ? next_open(js) : -1;
          if (jv >= 0) {
            const Tensor* ks = nodes[js];
            const Tensor* vs = nodes[jv];
            const bool seqs = ks->op == Op::KvStoreSeqs;
            const int pv =
                vs->op == Op::KvStore || vs->op == Op::KvStoreSeqs ? pos(vs->src[0]) : -1;
            with_kv =
                (ks->op == Op::KvStore || seqs) && vs->op == ks->op && ks->src[0] == pair &&
                kv_target(ks)->type == DType::F16 && kv_target(vs)->type == DType::F16 &&
                (seqs ? vs->src[2] == ks->src[2] && vs->params[kKvSeqRows] == ks->params[kKvSeqRows]
                      : vs->kv[0] == ks->kv[0] && kv_target(vs)->ne[1] == kv_target(ks)->ne[1]) &&
                vs->src[0]->ne[0] == pair->ne[0] && vs->src[0]->ne[1] == pair->ne[1] &&
                kv_target(vs)->data != kv_target(ks)->data && (pv < 0 || pv < i || done[pv]) &&
                rope_apart(t, vs->src[0], reads) &&
                (k_cache_only || rope_apart(pair, vs->src[0], reads));
            if (with_kv) {
              kv.k_cache = kv_target(ks)->data;
              kv.v = fptr(vs->src[0]);
              kv.v_cache = kv_target(vs)->data;
              if (seqs) {
                kv.slots = static_cast<const int32_t*>(ptr(ks->src[2]));
                kv.rows = ks->params[kKvSeqRows];
              } else {
                kv.first_row = kv_at(ks->kv[0]);
                kv.rows = static_cast<int>(kv_target(ks)->ne[1]);
              }
              done[js] = done[jv] = 1;
            }
          }
          if (k_cache_only && !with_kv) {
            done[jk] = 0;
            pair = nullptr;
          }
        }
        // With the head norms, the raw products (the pairing was checked when they were taken).
        const auto hn = head_norms.find(i);
        const bool norms = hn != head_norms.end();
        if (norms && pair != nodes[next_op(i)])
          throw std::logic_error("launch_graph: head norms taken for ropes that did not pair");
        const RopeTable* table = rope_table_of(t);
        launch_rope(l, fptr(norms ? hn->second.q_in : t->src[0]),
                    static_cast<const int32_t*>(ptr(t->src[1])), fptr(t), t->params[kRopeNHead],
                    t->params[kRopeHeadDim], t->params[kRopeNDims], t->params[kRopeMode],
                    t->param_f(kRopeBase), static_cast<int>(t->ne[1]),
                    pair ? fptr(norms ? hn->second.k_in : pair->src[0]) : nullptr,
                    pair && !k_cache_only ? fptr(pair) : nullptr,
                    pair ? pair->params[kRopeNHead] : 0, with_kv ? &kv : nullptr,
                    t->src[2] ? fptr(t->src[2]) : nullptr, t->param_f(kRopeScale),
                    norms ? &hn->second.norm : nullptr, table ? table->data : nullptr,
                    table ? table->rows : 0);
        break;
      }
      case Op::KvStore: {
        // K and V stores of the same rows, one after the other: one launch.
        const int xi = next_op(i);
        const Tensor* nx = xi < n ? nodes[xi] : nullptr;
        const bool pair = nx && nx->op == Op::KvStore && !done[xi] && nx->kv[0] == t->kv[0] &&
                          nx->src[0]->ne[0] == t->src[0]->ne[0] &&
                          nx->src[0]->ne[1] == t->src[0]->ne[1] && kv_target(nx) != kv_target(t) &&
                          kv_target(nx)->type == kv_target(t)->type &&
                          kv_target(nx)->ne[1] == kv_target(t)->ne[1];
        launch_kv_store(l, kv_target(t)->type, fptr(t->src[0]), kv_target(t)->data,
                        pair ? fptr(nx->src[0]) : nullptr, pair ? kv_target(nx)->data : nullptr,
                        t->src[0]->ne[0], static_cast<int>(t->src[0]->ne[1]), kv_at(t->kv[0]),
                        static_cast<int>(kv_target(t)->ne[1]));
        if (pair) done[xi] = 1;
        break;
      }
      case Op::KvStoreSeqs: {
        // K and V stores of the same slots, one after the other: one launch.
        const int xi = next_op(i);
        const Tensor* nx = xi < n ? nodes[xi] : nullptr;
        const bool pair = nx && nx->op == Op::KvStoreSeqs && !done[xi] && nx->src[2] == t->src[2] &&
                          nx->src[0]->ne[0] == t->src[0]->ne[0] &&
                          nx->src[0]->ne[1] == t->src[0]->ne[1] && nx->data != t->data &&
                          nx->type == t->type && nx->params[kKvSeqRows] == t->params[kKvSeqRows];
        launch_kv_store(l, t->type, fptr(t->src[0]), t->data, pair ? fptr(nx->src[0]) : nullptr,
                        pair ? nx->data : nullptr, t->src[0]->ne[0],
                        static_cast<int>(t->src[0]->ne[1]), nullptr, t->params[kKvSeqRows],
                        static_cast<const int32_t*>(ptr(t->src[2])));
        if (pair) done[xi] = 1;
        break;
      }
      case Op::AttentionSeqs:
      case Op::Attention: {
        float scale;
        std::memcpy(&scale, &t->params[kAttnScale], sizeof scale);
        const int n_tokens = static_cast<int>(t->src[0]->ne[1]);
        // The 8-bit form for the products that read the output (the output projection): plain
        // for a mat-vec, column tiles for warp-pipelined products (the decode kernels write
        // either: a decode batch of several sequences takes them at any count).
        const bool decode = n_tokens <= kDecodeAttnMaxTokens || t->op == Op::AttentionSeqs;
        uint8_t* tq = tiles_output(t, t->params[kAttnHeadDim] % 32 == 0 && decode);
        uint8_t* q = tq ? tq
                        : q8_output(t, t->params[kAttnHeadDim] % 32 == 0 &&
                                           n_tokens <= kDecodeAttnMaxTokens);
        // Or the half form, for the products of a decode batch of several sequences.
        uint8_t* h = half_output(t, decode);
        AttentionArgs a;
        a.q = fptr(t->src[0]);
        a.k_cache = cache_of(t->src[1])->data;
        a.v_cache = cache_of(t->src[2])->data;
        a.kv_type = cache_of(t->src[1])->type;
        a.out = fptr(t);
        a.n_head = t->params[kAttnNHead];
        a.n_head_kv = t->params[kAttnNHeadKv];
        a.head_dim = t->params[kAttnHeadDim];
        a.scale = scale;
        a.n_tokens = n_tokens;
        a.ring = cache_of(t->src[1])->params[kKvRing] != 0;
        if (t->op == Op::AttentionSeqs) {
          a.cache_rows = cache_of(t->src[1])->params[kKvSeqRows];
          a.slots = static_cast<const int32_t*>(ptr(t->src[3]));
        } else {
          a.n_kv = t->kv[kAttnNKv];
          a.first_pos = t->kv[kAttnFirstPos];
          a.cache_rows = static_cast<int>(cache_of(t->src[1])->ne[1]);
          a.n_kv_at = kv_at(t->kv[kAttnNKv]);
          a.first_pos_at = kv_at(t->kv[kAttnFirstPos]);
        }
        a.partials = buf.attn;
        a.counters = buf.attn_counters;
        a.quant_ws = q;
        a.quant_tiles = tq != nullptr;
        a.half_ws = h;
        a.window = t->params[kAttnWindow];
        launch_attention(l, a);
        break;
      }
      default:
        break;  // rejected by validate_graph
    }
  }
  flush_norm();
}

namespace {

// The executor's key for a graph's topology: a decode batch of several sequences (bit 63), a
// chain loop (bit 62) and a sampled chain (its steps, bits 48-61) are classes of their own; then
// the step's tokens (bits 32-47) and its output's columns.
uint64_t topology_key(const Graph& graph) {
  const bool loop = graph.output()->op == Op::ChainLoop;
  return (uint64_t(graph.seqs) << 63) | (uint64_t(loop) << 62) | (uint64_t(graph.chain) << 48) |
         (uint64_t(graph.n_tokens) << 32) | uint64_t(graph.output()->ne[1]);
}

// The name graph_stats gives a key's class: "batch8" for decode batches of 8 (their size
// class), "loop8" for chain loops of rounds of 8 steps, "chain8" for sampled chains of 8 steps,
// "tokens1" for steps of one token.
std::string topology_name(uint64_t key) {
  const uint64_t chain = (key >> 48) & 0x3FFF, n_tokens = (key >> 32) & 0xFFFF;
  if (key >> 63) return "batch" + std::to_string(n_tokens);
  if ((key >> 62) & 1) return "loop" + std::to_string(chain);
  if (chain) return "chain" + std::to_string(chain);
  return "tokens" + std::to_string(n_tokens);
}

// Page-locked blocks for step outputs: the logits of a decode batch are megabytes (64 rows of a
// 49,152-token vocabulary are 12 MiB), and a copy into pageable memory costs the host a second
// pass over them, more than the device's copy itself. Making a block costs milliseconds, so
// blocks come back here and serve again; a few stay kept, the rest are freed.
class PinnedPool : public HostPool {
 public:
  explicit PinnedPool(int device) : device_(device) {}
  ~PinnedPool() override {
    for (const Block& b : free_) cudaFreeHost(b.ptr);
  }

  void* take(size_t bytes) override {
    {
      std::lock_guard<std::mutex> hold(mu_);
      // The smallest free block that fits without wasting more than its request.
      auto best = free_.end();
      for (auto it = free_.begin(); it != free_.end(); ++it)
        if (it->bytes >= bytes && it->bytes <= 2 * bytes &&
            (best == free_.end() || it->bytes < best->bytes))
          best = it;
      if (best != free_.end()) {
        Block b = *best;
        free_.erase(best);
        taken_.push_back(b);
        return b.ptr;
      }
    }
    void* p = nullptr;
    // On the model's device (the calling thread's current one is put back), portable, so that
    // the memory is page-locked for every context.
    int current = device_;
    cudaGetDevice(&current);
    if (current != device_) cudaSetDevice(device_);
    const cudaError_t err = cudaHostAlloc(&p, std::max<size_t>(bytes, 1), cudaHostAllocPortable);
    if (current != device_) cudaSetDevice(current);
    if (err != cudaSuccess) {
      cudaGetLastError();  // no page-locked memory to spare: the caller's own memory serves
      return nullptr;
    }
    std::lock_guard<std::mutex> hold(mu_);
    taken_.push_back({p, bytes});
    return p;
  }

  // Whether p lies in a block taken from this pool (one the device copies into directly).
  bool holds(const void* p) {
    const auto* b = static_cast<const uint8_t*>(p);
    std::lock_guard<std::mutex> hold(mu_);
    for (const Block& t : taken_) {
      const auto* start = static_cast<const uint8_t*>(t.ptr);
      if (b >= start && b < start + t.bytes) return true;
    }
    return false;
  }

  void give(void* block) override {
    void* drop = nullptr;
    {
      std::lock_guard<std::mutex> hold(mu_);
      auto it = std::find_if(taken_.begin(), taken_.end(),
                             [&](const Block& b) { return b.ptr == block; });
      if (it == taken_.end()) return;
      free_.push_back(*it);
      taken_.erase(it);
      if (free_.size() > kKept) {
        drop = free_.front().ptr;
        free_.erase(free_.begin());
      }
    }
    if (drop) cudaFreeHost(drop);
  }

 private:
  struct Block {
    void* ptr;
    size_t bytes;
  };
  static constexpr size_t kKept = 4;
  int device_;
  std::mutex mu_;
  std::vector<Block> free_, taken_;
};

class CudaBackend : public Backend {
 public:
  explicit CudaBackend(const CudaOptions& options)
      : device_(options.device), debug_(options.debug) {
    const GraphMode mode = parse_graph_mode(options.graphs);
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
      cudaGetLastError();
      throw DeviceError(std::string("no usable CUDA device: ") + cudaGetErrorString(err));
    }
    if (device_ < 0 || device_ >= count)
      throw DeviceError("CUDA device " + std::to_string(device_) + " requested, " +
                        std::to_string(count) + " present");
    GGRAPH_CUDA_CHECK(cudaSetDevice(device_));
    cudaDeviceProp prop;
    GGRAPH_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
    if (prop.major < 8)
      throw DeviceError(std::string("CUDA device ") + prop.name + " has compute capability " +
                        std::to_string(prop.major) + "." + std::to_string(prop.minor) +
                        "; ggraph needs 8.0 or newer");
    name_ = "cuda:" + std::to_string(device_) + " (" + prop.name + ")";
    prepare_kernels();
    kv_record_ = static_cast<int32_t*>(device_alloc(sizeof(KvSlots), "the KV record"));
    try {
      GGRAPH_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
      executor_ = std::make_unique<GraphExecutor>(stream_, mode, options.debug,
                                                  use_programmatic_launch(prop));
    } catch (...) {
      // No destructor runs for a constructor that throws.
      if (stream_) cudaStreamDestroy(stream_);
      cudaFree(kv_record_);
      throw;
    }
  }

  ~CudaBackend() override {
    cudaSetDevice(device_);
    if (stream_) cudaStreamSynchronize(stream_);
    for (void* p : allocations_) cudaFree(p);
    cudaFree(scratch_);
    cudaFree(input_);
    cudaFree(act_);
    cudaFree(wdeq_);
    cudaFree(attn_);
    cudaFree(attn_counters_);
    cudaFree(sample_work_);
    cudaFree(kv_record_);
    cudaFreeHost(input_staging_);
    cudaFreeHost(output_staging_);
    if (loop_words_) cudaFreeHost(const_cast<int32_t*>(loop_words_));
    executor_.reset();
    blas_.reset();
    if (stream_) cudaStreamDestroy(stream_);
  }

  std::string name() const override { return name_; }
  bool is_cuda() const override { return true; }
  bool folds_norms() const override { return norm_fold_enabled(); }
  std::shared_ptr<HostPool> host_pool() override { return host_pool_; }

  void* upload_weight(const void* host, size_t bytes, DType type, int64_t ne0, int64_t ne1,
                      const std::string& name) override {
    GGRAPH_CUDA_CHECK(cudaSetDevice(device_));
    if (is_quantized(type) &&
        (ne0 % block_elems(type) != 0 || bytes != row_bytes(type, ne0) * size_t(ne1)))
      throw ArgumentError("weight " + name + ": " + std::to_string(bytes) + " bytes for a " +
                          dtype_name(type) + " [" + std::to_string(ne0) + ", " +
                          std::to_string(ne1) + "], expected " +
                          std::to_string(row_bytes(type, ne0) * size_t(ne1)) +
                          " with ne0 a multiple of " + std::to_string(block_elems(type)));
    // The split layout of Q2_K and Q3_K takes more than their GGUF bytes (weight_layout.h).
    const size_t stored =
        is_quantized(type) ? split_bytes(split_format(type), bytes / block_bytes(type)) : bytes;
    void* p = device_alloc(stored + kWeightPadding, "weight " + name);
    allocations_.push_back(p);
    // Everything on the backend's stream, which does not wait for the legacy default stream.
    GGRAPH_CUDA_CHECK(
        cudaMemsetAsync(static_cast<uint8_t*>(p) + stored, 0, kWeightPadding, stream_));
    if (!is_quantized(type)) {
      GGRAPH_CUDA_CHECK(cudaMemcpyAsync(p, host, bytes, cudaMemcpyHostToDevice, stream_));
      GGRAPH_CUDA_CHECK(cudaStreamSynchronize(stream_));
      return p;
    }
    // Quantized blocks go through a device staging buffer, a chunk at a time (so a large
    // weight needs little more than its own size), and are split there. Stream order keeps a
    // chunk's copy behind the previous chunk's split.
    const size_t bb = block_bytes(type);
    const int64_t n_blocks = static_cast<int64_t>(bytes / bb);
    const int64_t chunk = static_cast<int64_t>(std::max<size_t>(1, kWeightStagingBytes / bb));
    void* staging =
        device_alloc(static_cast<size_t>(std::min(chunk, n_blocks)) * bb, "staging weight " + name);
    cudaError_t err = cudaSuccess;
    try {
      for (int64_t first = 0; first < n_blocks && err == cudaSuccess; first += chunk) {
        const int64_t n = std::min(chunk, n_blocks - first);
        err = cudaMemcpyAsync(staging, static_cast<const uint8_t*>(host) + first * bb,
                              static_cast<size_t>(n) * bb, cudaMemcpyHostToDevice, stream_);
        if (err == cudaSuccess)
          launch_split_weight(type, static_cast<const uint8_t*>(staging), static_cast<uint8_t*>(p),
                              first, n, n_blocks, stream_);
      }
    } catch (...) {
      cudaStreamSynchronize(stream_);
      cudaFree(staging);
      throw;
    }
    const cudaError_t synced = cudaStreamSynchronize(stream_);
    if (err == cudaSuccess) err = synced;
    cudaFree(staging);
    GGRAPH_CUDA_CHECK(err);
    return p;
  }

  void* alloc_kv(size_t bytes) override {
    GGRAPH_CUDA_CHECK(cudaSetDevice(device_));
    void* p = device_alloc(bytes, "the KV cache");
    allocations_.push_back(p);
    // On the backend's stream, which does not wait for the legacy default stream.
    GGRAPH_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream_));
    GGRAPH_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return p;
  }

  void kv_to_host(void* host, const void* kv, size_t bytes) override {
    GGRAPH_CUDA_CHECK(cudaSetDevice(device_));
    GGRAPH_CUDA_CHECK(cudaMemcpyAsync(host, kv, bytes, cudaMemcpyDeviceToHost, stream_));
    GGRAPH_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void kv_from_host(void* kv, const void* host, size_t bytes) override {
    GGRAPH_CUDA_CHECK(cudaSetDevice(device_));
    GGRAPH_CUDA_CHECK(cudaMemcpyAsync(kv, host, bytes, cudaMemcpyHostToDevice, stream_));
    GGRAPH_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void kv_copy(void* dst, const void* src, size_t bytes) override {
    GGRAPH_CUDA_CHECK(cudaSetDevice(device_));
    GGRAPH_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
    GGRAPH_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  void reserve(size_t scratch_bytes, size_t input_bytes) override {
    GGRAPH_CUDA_CHECK(cudaSetDevice(device_));
    GGRAPH_CUDA_CHECK(cudaStreamSynchronize(stream_));
    ++buffers_version_;  // launches recorded before now point at the old buffers
    release(scratch_);
    release(input_);
    if (input_staging_) GGRAPH_CUDA_CHECK(cudaFreeHost(input_staging_));
    input_staging_ = nullptr;
    scratch_bytes_ = input_bytes_ = 0;
    scratch_ = static_cast<uint8_t*>(device_alloc(std::max<size_t>(scratch_bytes, 256), "scratch"));
    scratch_bytes_ = scratch_bytes;
    input_ = static_cast<uint8_t*>(device_alloc(std::max<size_t>(input_bytes, 256), "inputs"));
    input_bytes_ = input_bytes;
    GGRAPH_CUDA_CHECK(cudaMallocHost(&input_staging_, std::max<size_t>(input_bytes, 256)));
    // Mat-mul activations are scratch tensors; their prepared forms are at most half their size
    // (compute grows the workspace where a graph needs more).
    ensure(act_, act_bytes_, scratch_bytes / 2 + (1 << 20), "mat-mul activations");
    forget_blas_graphs();  // the scratch that cuBLAS's products write has moved
  }

  void compute(const Graph& graph, float* out) override {
    compute_start(graph, out);
    compute_finish();
  }

  void compute_start(const Graph& graph, float* out) override {
    if (pending_.graph) throw std::logic_error("cuda: a compute is already in flight");
    const auto t_enter = std::chrono::steady_clock::now();
    GGRAPH_CUDA_CHECK(cudaSetDevice(device_));
    const std::vector<Tensor*>& nodes = graph.nodes();
    if (!graph.output()) throw ArgumentError("cuda: the graph has no output");
    // A chain loop's rounds move its KV values on by the chain each: the last round's must fit.
    const int32_t span = loop_span(graph);
    // One executable per batch shape (topology_key); a changed topology within it is applied
    // to that executable with cudaGraphExecUpdate.
    const uint64_t batch_key = topology_key(graph);
    // The graph object the last step of this shape ran, shifted since, on the same buffers: only
    // its KV parameters and its inputs' values can have changed.
    Reuse& reuse = reuse_for(batch_key);
    const bool same_graph = graph.serial == reuse.serial && buffers_version_ == reuse.version;
    reuse.serial = 0;  // unknown until this step has run
    // Whether the step's launches are the last step's of this shape but for the KV record's.
    bool kv_only = false;
    if (same_graph && !debug_) {
      kv_only = check_reused(graph, &reuse.plan, span);
    } else {
      validate_graph(graph);
      if (graph.scratch_size > scratch_bytes_ || graph.input_size > input_bytes_ || !scratch_)
        throw ArgumentError("cuda: the graph needs " + std::to_string(graph.scratch_size) +
                            " bytes of scratch and " + std::to_string(graph.input_size) +
                            " of inputs; reserved " + std::to_string(scratch_bytes_) + " and " +
                            std::to_string(input_bytes_));
      // Workspaces only grow, and before any launch: never inside the launches themselves.
      if (ensure(act_, act_bytes_, act_workspace_bytes(graph), "mat-mul activations"))
        forget_blas_graphs();
      ensure(attn_, attn_bytes_, attn_workspace_bytes(graph, false), "attention partials");
      if (ensure(attn_counters_, attn_counters_bytes_, attn_workspace_bytes(graph, true),
                 "attention counters"))
        GGRAPH_CUDA_CHECK(cudaMemsetAsync(attn_counters_, 0, attn_counters_bytes_, stream_));
      ensure(sample_work_, sample_work_bytes_, sample_workspace_bytes(graph), "sampling");
      ensure_loop_words(graph);
      plan_reuse(graph, &reuse.plan);
      check_kv_values(graph, reuse.plan, span);
      prepare_blas(graph);
      prepare_rope_tables(graph);
    }

    // The output's staging buffer grows before the launch: page-locked frees and allocations
    // wait for the device, and a chain loop hands its tokens over while it runs.
    const Tensor* o = graph.output();
    const size_t out_bytes = static_cast<size_t>(o->n_elements()) * sizeof(float);
    const bool staged = !host_pool_->holds(out);  // page-locked memory needs no staging copy
    if (staged && out_bytes > output_staging_bytes_) {
      GGRAPH_CUDA_CHECK(cudaStreamSynchronize(stream_));
      if (output_staging_) GGRAPH_CUDA_CHECK(cudaFreeHost(output_staging_));
      output_staging_ = nullptr;
      output_staging_bytes_ = 0;
      GGRAPH_CUDA_CHECK(cudaMallocHost(&output_staging_, out_bytes));
      output_staging_bytes_ = out_bytes;
    }

    const auto t_input = std::chrono::steady_clock::now();
    for (int i : reuse.plan.inputs) {
      const Tensor* t = nodes[size_t(i)];
      const size_t bytes = static_cast<size_t>(t->n_elements()) * elem_size(t->type);
      if (t->offset + bytes > input_bytes_)
        throw ArgumentError("cuda: input '" + t->name + "' lies outside the input buffer");
      std::memcpy(static_cast<uint8_t*>(input_staging_) + t->offset, t->data, bytes);
    }
    if (graph.input_size > 0)
      GGRAPH_CUDA_CHECK(cudaMemcpyAsync(input_, input_staging_, graph.input_size,
                                        cudaMemcpyHostToDevice, stream_));
    executor_->mutable_stats().input_us_total +=
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t_input)
            .count();

    DeviceBuffers buf;
    buf.scratch = scratch_;
    buf.input = input_;
    buf.act = static_cast<uint8_t*>(act_);
    buf.act_bytes = act_bytes_;
    buf.attn = static_cast<float*>(attn_);
    buf.attn_bytes = attn_bytes_;
    buf.attn_counters = static_cast<unsigned*>(attn_counters_);
    buf.sample_work = sample_work_;
    buf.kv_record = kv_record_;
    buf.blas = blas_.get();
    buf.wdeq = static_cast<uint8_t*>(wdeq_);
    buf.wdeq_bytes = wdeq_bytes_;
    buf.rope_tables = rope_tables_.data();
    buf.n_rope_tables = static_cast<int>(rope_tables_.size());
    buf.loop_host = loop_words_device_;
    buf.loop_halt = loop_words_device_ ? loop_words_device_ + loop_halt_word() : nullptr;
    if (loop_words_) {
      // The stream is idle: the last loop's words are read, and this one starts from none.
      loop_words_[0] = 0;
      loop_words_[loop_halt_word()] = 0;
    }
    executor_->mutable_stats().host_us_total +=
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t_enter)
            .count();
    // On a reused graph patch mode needs only the KV record's launch: no walk of the graph.
    GraphExecutor::LaunchAll launch_kv;
    if (kv_only && executor_->mode() == GraphMode::Patch)
      launch_kv = [&](Launcher& l) { launch_kv_params(l, reuse.plan.kv.values, kv_record_); };
    executor_->run(
        batch_key, [&](Launcher& l) { launch_graph(graph, reuse.plan.kv, buf, l); },
        [&](int i) {
          if (i == -1) return std::string("the step's KV record");
          if (i < 0 || i >= static_cast<int>(nodes.size())) return std::string("?");
          return std::string(op_name(nodes[i]->op)) + " '" + nodes[i]->name + "' (node " +
                 std::to_string(i) + ")";
        },
        launch_kv);
    reuse.serial = graph.serial;
    reuse.version = buffers_version_;
    executor_->mutable_stats().tokens += graph.chain > 0 ? graph.chain : graph.n_tokens;

    GGRAPH_CUDA_CHECK(cudaMemcpyAsync(staged ? output_staging_ : out, tensor_ptr(o, buf), out_bytes,
                                      cudaMemcpyDeviceToHost, stream_));
    pending_ = Pending{&graph, out, staged ? out_bytes : 0, batch_key};
  }

  void compute_finish() override {
    const Pending p = std::exchange(pending_, Pending{});
    if (!p.graph) return;
    GGRAPH_CUDA_CHECK(cudaSetDevice(device_));
    GGRAPH_CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (p.staged_bytes > 0) std::memcpy(p.out, output_staging_, p.staged_bytes);
    count_skipped(*p.graph, p.out, p.key);
  }

  const volatile int32_t* loop_words() override { return loop_words_; }
  void halt_loop() override {
    if (loop_words_) loop_words_[loop_halt_word()] = 1;
  }

  // A sampled chain's steps that its conditional nodes skipped (their token words read
  // kSkipped): they computed no token. A chain loop's rounds: their tokens, the last round's
  // skipped steps not among them.
  void count_skipped(const Graph& graph, const float* out, uint64_t key) {
    const Op op = graph.output()->op;
    if (graph.chain <= 1 || (op != Op::Sample && op != Op::ChainLoop)) return;
    const int32_t* words = reinterpret_cast<const int32_t*>(out);
    GraphStats& s = executor_->mutable_stats();
    if (op == Op::ChainLoop) {
      const int made = std::clamp(words[0], graph.chain, graph.output()->params[kLoopCapacity]);
      s.tokens += made - graph.chain;  // compute counted one round
      executor_->count_rounds(key, made / graph.chain);
      words += loop_token_word(made - graph.chain);  // the last round's
    }
    for (int j = 1; j < graph.chain; ++j) {
      if (words[j] != sample_word::kSkipped) continue;
      s.chain_steps_skipped += graph.chain - j;
      s.tokens -= graph.chain - j;
      return;
    }
  }

  bool runs_loops() const override { return executor_->runs_loops(); }

  // The words a chain loop streams to the host (loop_words): the count, kMaxLaunch-sized token
  // and log-probability rows as the op's output, then the host's halt word. Allocated at the
  // first loop, mapped into the device's address space; a larger loop later moves them.
  size_t loop_halt_word() const {
    return size_t(loop_logprob_word(loop_capacity_, loop_capacity_));
  }
  void ensure_loop_words(const Graph& graph) {
    const Tensor* o = graph.output();
    if (o->op != Op::ChainLoop || o->params[kLoopCapacity] <= loop_capacity_) return;
    GGRAPH_CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (loop_words_) GGRAPH_CUDA_CHECK(cudaFreeHost(const_cast<int32_t*>(loop_words_)));
    loop_words_ = nullptr;
    loop_words_device_ = nullptr;
    loop_capacity_ = 0;
    const int capacity = o->params[kLoopCapacity];
    void* host = nullptr;
    GGRAPH_CUDA_CHECK(
        cudaHostAlloc(&host, (2 + 2 * size_t(capacity)) * sizeof(int32_t), cudaHostAllocMapped));
    void* device = nullptr;
    if (cudaHostGetDevicePointer(&device, host, 0) != cudaSuccess) {
      cudaFreeHost(host);
      throw DeviceError("cuda: no device address for the chain loop's host words");
    }
    loop_words_ = static_cast<volatile int32_t*>(host);
    loop_words_device_ = static_cast<int32_t*>(device);
    loop_capacity_ = capacity;
    ++buffers_version_;  // graphs recorded before point at no words, or the old ones
  }

  // How far a chain loop's last round lies past its first (0 for other graphs); throws where the
  // loop cannot run here or asks for more rounds than its buffer holds.
  int32_t loop_span(const Graph& graph) const {
    const Tensor* o = graph.output();
    if (o->op != Op::ChainLoop) return 0;
    if (!executor_->runs_loops())
      throw ArgumentError(
          "cuda: chain loops run in the patch and recapture graph modes, with conditional nodes");
    const Tensor* control = o->src[3];
    const int k = o->params[kLoopChain];
    const int rounds = control && control->data ? static_cast<const int32_t*>(control->data)[0] : 0;
    if (rounds < 1 || int64_t(rounds) * k > o->params[kLoopCapacity])
      throw ArgumentError("cuda: a chain loop of " + std::to_string(rounds) + " rounds of " +
                          std::to_string(k) + " tokens; its buffer holds " +
                          std::to_string(o->params[kLoopCapacity]));
    return int32_t(rounds - 1) * k;
  }

  std::map<std::string, double> stats() const override {
    const GraphStats& s = executor_->stats();
    std::map<std::string, double> out = {
        {"captures", s.captures},
        {"instantiations", s.instantiations},
        {"exec_updates", s.exec_updates},
        {"update_failures", s.update_failures},
        {"kernel_nodes_patched", s.kernel_nodes_patched},
        {"replays", s.replays},
        {"eager_evals", s.eager_evals},
        {"capture_ms_total", s.capture_ms_total},
        {"steps", s.steps},
        {"host_us_total", s.host_us_total},
        {"build_us_total", s.build_us_total},
        {"input_us_total", s.input_us_total},
        {"record_us_total", s.record_us_total},
        {"patch_us_total", s.patch_us_total},
        {"launch_us_total", s.launch_us_total},
        {"tokens", s.tokens},
        {"chain_steps_skipped", s.chain_steps_skipped},
        {"kernels", s.kernels},
        {"kernels_per_token", s.tokens > 0 ? s.kernels / s.tokens : 0.0},
        {"tokens_per_launch",
         s.replays + s.eager_evals > 0 ? s.tokens / (s.replays + s.eager_evals) : 0.0},
        {"cached_graphs", double(executor_->cached_graphs())},
        {"graph_pool_bytes", double(graph_pool_bytes())}};
    if (executor_->runs_loops()) {  // the host's looks at a chain loop's words
      out["loop_looks"] = s.loop_looks;
      out["loop_tokens_streamed"] = s.loop_tokens_streamed;
      out["loop_looks_given_up"] = s.loop_looks_given_up;
    }
    // Per topology class: "batch8.replays", "chain8.captures", "tokens1.replays".
    for (const auto& [key, k] : executor_->key_stats()) {
      const std::string name = topology_name(key);
      out[name + ".captures"] += k.captures;
      out[name + ".replays"] += k.replays;
    }
    return out;
  }
  uint64_t graph_handle() override {
    cudaGraph_t g = executor_->current_graph();
    if (!g) throw ArgumentError("no CUDA graph has been captured yet (cuda_graphs='off'?)");
    return reinterpret_cast<uint64_t>(g);
  }
  void dump_graph(const std::string& path) override { executor_->dump_dot(path); }
  void debug_corrupt_next_patch() override { executor_->corrupt_next_patch(); }
  void reset_stats() override { executor_->reset_stats(); }
  void add_host_time(double microseconds) override {
    executor_->mutable_stats().host_us_total += microseconds;
    executor_->mutable_stats().build_us_total += microseconds;
  }
  void add_loop_looks(double looks, double tokens_streamed, bool gave_up) override {
    GraphStats& s = executor_->mutable_stats();
    s.loop_looks += looks;
    s.loop_tokens_streamed += tokens_streamed;
    s.loop_looks_given_up += gave_up ? 1 : 0;
  }

  size_t graph_pool_bytes() const {
    uint64_t used = 0;
    if (cudaDeviceGetGraphMemAttribute(device_, cudaGraphMemAttrUsedMemCurrent, &used) !=
        cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return size_t(used);
  }

  void poison(uint8_t byte) {
    GGRAPH_CUDA_CHECK(cudaSetDevice(device_));
    GGRAPH_CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (scratch_)
      GGRAPH_CUDA_CHECK(cudaMemset(scratch_, byte, std::max<size_t>(scratch_bytes_, 256)));
    if (act_) GGRAPH_CUDA_CHECK(cudaMemset(act_, byte, act_bytes_));
    if (attn_) GGRAPH_CUDA_CHECK(cudaMemset(attn_, byte, attn_bytes_));
    if (wdeq_) GGRAPH_CUDA_CHECK(cudaMemset(wdeq_, byte, wdeq_bytes_));
    GGRAPH_CUDA_CHECK(cudaDeviceSynchronize());
  }

 private:
  // Loads cuBLAS the first time a graph has a product it would take (blas.h); without it the
  // tiled kernel takes them, unless GGRAPH_CUDA_GEMM=cublas asked for cuBLAS by name.
  void prepare_blas(const Graph& graph) {
    if (!blas_) {
      bool wanted = false;
      for (const Tensor* t : graph.nodes())
        wanted =
            wanted || (t->op == Op::MulMat && gemm_wants_blas(t->src[0]->type, t->src[1]->ne[1]));
      if (!wanted) return;
    }
    if (!blas_tried_) {
      blas_tried_ = true;
      blas_ = Blas::create(stream_, &blas_missing_);
    }
    if (!blas_ && gemm_path() == GemmPath::Cublas)
      throw DeviceError("GGRAPH_CUDA_GEMM=cublas, but cuBLAS is not usable: " + blas_missing_);
    // Quantized weights it takes are decoded into a chunk buffer first.
    size_t need = 0;
    for (const Tensor* t : graph.nodes()) {
      if (!blas_ || t->op != Op::MulMat || !is_quantized(t->src[0]->type) ||
          !gemm_wants_blas(t->src[0]->type, t->src[1]->ne[1]) ||
          mat_mul_q_kind(t->src[0]->type, t->src[0]->ne[0], t->src[1]->ne[1]) != MatMulQ::None)
        continue;
      const int64_t k = t->src[0]->ne[0];
      const int64_t rows = std::min(t->src[0]->ne[1], dequant_chunk_rows(k));
      need = std::max(need, static_cast<size_t>(rows * act_half_pitch(k) * 2));
    }
    if (ensure(wdeq_, wdeq_bytes_, need, "weights decoded for cuBLAS")) forget_blas_graphs();
  }

  // The rope angle tables of the graph's rope configurations (RopeTable), for positions up to
  // its largest KV cache's rows and at most kRopeTableBytes each: made once, before any capture.
  // Where the memory is short, or the tables are off, the kernels work their angles out.
  static constexpr size_t kRopeTableBytes = size_t(16) << 20;
  void prepare_rope_tables(const Graph& graph) {
    if (!rope_table_enabled()) return;
    int64_t rows = 0;
    for (const Tensor* t : graph.nodes()) {
      if (t->op == Op::KvStore && kv_target(t)) rows = std::max(rows, kv_target(t)->ne[1]);
      if (t->op == Op::KvStoreSeqs) rows = std::max<int64_t>(rows, t->params[kKvSeqRows]);
    }
    for (const Tensor* t : graph.nodes()) {
      if (t->op != Op::Rope || t->params[kRopeNDims] < 2 || rows == 0) continue;
      RopeTable want =
          rope_config(t, t->src[2] ? static_cast<const float*>(t->src[2]->data) : nullptr);
      const int64_t per_row = int64_t(want.n_dims / 2) * sizeof(float2);
      want.rows = static_cast<int>(std::min<int64_t>(rows, kRopeTableBytes / per_row));
      bool have = false;
      for (const RopeTable& h : rope_tables_)
        have = have || (same_rope_config(h, want) && h.rows >= want.rows);
      if (have || (want.freq_factors && t->src[2]->storage != Storage::Weight)) continue;
      void* p = nullptr;
      if (cudaMalloc(&p, size_t(want.rows) * per_row) != cudaSuccess) {
        cudaGetLastError();  // no table: the kernels work the angles out
        continue;
      }
      allocations_.push_back(p);
      want.data = static_cast<float2*>(p);
      launch_rope_table(want.data, want.rows, want.n_dims, want.freq_base, want.freq_scale,
                        want.freq_factors, stream_);
      // A smaller table of the same configuration gives way (its memory stays until the end).
      rope_tables_.erase(
          std::remove_if(rope_tables_.begin(), rope_tables_.end(),
                         [&](const RopeTable& h) { return same_rope_config(h, want); }),
          rope_tables_.end());
      rope_tables_.push_back(want);
      ++buffers_version_;  // steps of other shapes read their tables anew
    }
  }

  // cuBLAS's nodes in a captured graph keep the addresses they were captured with, and the
  // executor neither records nor patches them: when a buffer they read or write moves, every
  // executable is dropped (this happens on the first steps of a context, not in its run).
  void forget_blas_graphs() {
    if (blas_) executor_->forget_all();
  }

  // cudaMalloc that turns out-of-memory into a DeviceError naming the sizes and leaves no error.
  void* device_alloc(size_t bytes, const std::string& what) {
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, bytes);
    if (err == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      cudaGetLastError();
      throw DeviceError("out of device memory: needed " + mib(bytes) + " MiB for " + what + ", " +
                        mib(free_b) + " MiB free of " + mib(total_b) + " MiB");
    }
    if (err != cudaSuccess) throw_cuda_error(err, "cudaMalloc", __FILE__, __LINE__);
    return p;
  }

  void release(uint8_t*& p) {
    if (p) GGRAPH_CUDA_CHECK(cudaFree(p));
    p = nullptr;
  }

  // Grows a workspace to need bytes (contents lost); whether it did.
  bool ensure(void*& p, size_t& have, size_t need, const char* what) {
    if (need <= have) return false;
    ++buffers_version_;  // launches recorded before now point at the old buffer
    GGRAPH_CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (p) GGRAPH_CUDA_CHECK(cudaFree(p));
    p = nullptr;
    have = 0;
    p = device_alloc(need, what);
    have = need;
    return true;
  }

  int device_;
  std::string name_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<GraphExecutor> executor_;
  std::unique_ptr<Blas> blas_;  // loaded on first need (prepare_blas)
  bool blas_tried_ = false;
  std::string blas_missing_;  // why it did not load
  // The last step of a batch shape (topology_key): the graph it ran, the buffers' generation
  // then, and its plan (see compute). A few shapes are kept, the least recently used dropped.
  struct Reuse {
    uint64_t serial = 0, version = 0, last_used = 0;
    ReusePlan plan;
  };
  static constexpr size_t kMaxReused = 16;
  Reuse& reuse_for(uint64_t key) {
    auto it = reuse_.find(key);
    if (it == reuse_.end()) {
      if (reuse_.size() >= kMaxReused)
        reuse_.erase(std::min_element(
            reuse_.begin(), reuse_.end(),
            [](const auto& a, const auto& b) { return a.second.last_used < b.second.last_used; }));
      it = reuse_.emplace(key, Reuse()).first;
    }
    it->second.last_used = ++reuse_clock_;
    return it->second;
  }
  std::map<uint64_t, Reuse> reuse_;
  uint64_t reuse_clock_ = 0;
  uint64_t buffers_version_ = 0;  // a step recorded in an older generation points at old buffers
  bool debug_ = false;
  int32_t* kv_record_ = nullptr;    // the step's KV record (kernels.cuh)
  std::vector<void*> allocations_;  // weights and KV caches, freed with the backend
  uint8_t* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  uint8_t* input_ = nullptr;
  size_t input_bytes_ = 0;
  void* input_staging_ = nullptr;  // pinned, so the input copy is a true async copy
  void* output_staging_ = nullptr;
  size_t output_staging_bytes_ = 0;
  std::shared_ptr<PinnedPool> host_pool_ = std::make_shared<PinnedPool>(device_);
  void* act_ = nullptr;
  size_t act_bytes_ = 0;
  void* wdeq_ = nullptr;  // quantized weights decoded to half for cuBLAS, a chunk of rows
  size_t wdeq_bytes_ = 0;
  void* attn_ = nullptr;
  size_t attn_bytes_ = 0;
  void* attn_counters_ = nullptr;  // flash-decoding tickets: zero between launches
  size_t attn_counters_bytes_ = 0;
  void* sample_work_ = nullptr;  // the sample kernel's workspace
  size_t sample_work_bytes_ = 0;
  std::vector<RopeTable> rope_tables_;  // prepare_rope_tables
  // A chain loop's streamed words (ensure_loop_words): host and device addresses.
  volatile int32_t* loop_words_ = nullptr;
  int32_t* loop_words_device_ = nullptr;
  int loop_capacity_ = 0;
  // The launch compute_start made, until compute_finish: its output's place and size to copy
  // from the staging buffer (0: copied straight into out), and its batch shape.
  struct Pending {
    const Graph* graph = nullptr;
    float* out = nullptr;
    size_t staged_bytes = 0;
    uint64_t key = 0;
  };
  Pending pending_;
};

}  // namespace
}  // namespace cuda

bool cuda_compiled() { return true; }

std::unique_ptr<Backend> make_cuda_backend(const CudaOptions& options) {
  return std::make_unique<cuda::CudaBackend>(options);
}

std::vector<DeviceInfo> cuda_devices() {
  std::vector<DeviceInfo> out;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return out;
  }
  int current = 0;
  cudaGetDevice(&current);
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) {
      cudaGetLastError();
      continue;
    }
    DeviceInfo d;
    d.index = i;
    d.name = prop.name;
    d.total_memory = prop.totalGlobalMem;
    d.free_memory = 0;
    size_t free_b = 0, total_b = 0;
    if (cudaSetDevice(i) == cudaSuccess && cudaMemGetInfo(&free_b, &total_b) == cudaSuccess)
      d.free_memory = free_b;
    cudaGetLastError();
    d.cc_major = prop.major;
    d.cc_minor = prop.minor;
    d.multiprocessors = prop.multiProcessorCount;
    out.push_back(d);
  }
  cudaSetDevice(current);
  cudaGetLastError();
  return out;
}

void cuda_poison_buffers(Backend& backend, uint8_t byte) {
  auto* cb = dynamic_cast<cuda::CudaBackend*>(&backend);
  if (!cb) throw ArgumentError("cuda_poison_buffers: not a CUDA backend");
  cb->poison(byte);
}

}  // namespace ggraph
