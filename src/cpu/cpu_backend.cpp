// CPU backend: runs the graph's nodes in order, with threads inside each op.
// It is the reference the CUDA backend is checked against.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <thread>
#include <vector>

#include "backend.h"
#include "common.h"
#include "cpu/thread_pool.h"
#include "quant.h"
#include "sampling.h"

namespace ggraph {
namespace {

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<uint8_t, FreeDeleter>;

Buffer alloc_buffer(size_t bytes, const char* what) {
  size_t size = (std::max<size_t>(bytes, 1) + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, size);
  if (!p) {
    throw DeviceError("out of host memory: needed " + std::to_string(bytes >> 20) + " MiB for " +
                      what);
  }
  std::memset(p, 0, size);
  return Buffer(static_cast<uint8_t*>(p));
}

// y += w * x
__attribute__((target_clones("avx2", "default"))) void axpy(float* y, float w, const float* x,
                                                            int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += w * x[i];
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int n_threads) : pool_(n_threads) {}

  std::string name() const override { return "cpu (" + std::to_string(pool_.size()) + " threads)"; }

  void* upload_weight(const void* host, size_t, DType, int64_t, int64_t,
                      const std::string&) override {
    return const_cast<void*>(host);  // kernels read the file mapping in place
  }

  void* alloc_kv(size_t bytes) override {
    kv_.push_back(alloc_buffer(bytes, "the KV cache"));
    return kv_.back().get();
  }

  void reserve(size_t scratch_bytes, size_t input_bytes) override {
    if (scratch_bytes > scratch_size_) {
      scratch_ = alloc_buffer(scratch_bytes, "scratch");
      scratch_size_ = scratch_bytes;
    }
    if (input_bytes > input_size_) {
      input_ = alloc_buffer(input_bytes, "inputs");
      input_size_ = input_bytes;
    }
  }

  void compute(const Graph& graph, float* out) override {
    if (graph.scratch_size > scratch_size_ || graph.input_size > input_size_)
      throw std::logic_error("cpu backend: graph does not fit the reserved buffers");
    act_x_ = nullptr;  // a graph run again holds other values at the same tensors
    for (const Tensor* t : graph.nodes())
      if (t->storage == Storage::Input) std::memcpy(ptr(t), t->data, t->nbytes());
    for (const Tensor* t : graph.nodes()) run(t);
    const Tensor* o = graph.output();
    std::memcpy(out, ptr(o), o->nbytes());
  }

 private:
  uint8_t* ptr(const Tensor* t) const {
    switch (t->storage) {
      case Storage::Weight:
      case Storage::Kv:
        return static_cast<uint8_t*>(t->data);
      case Storage::Input:
        return input_.get() + t->offset;
      case Storage::Scratch:
        return scratch_.get() + t->offset;
    }
    return nullptr;
  }
  float* f32(const Tensor* t) const { return reinterpret_cast<float*>(ptr(t)); }
  const int32_t* i32(const Tensor* t) const { return reinterpret_cast<const int32_t*>(ptr(t)); }

  // Values a task of a light per-value loop (norms, activation preparations) takes at the
  // least: a decode batch's few columns run inline, where a loop's hand-off costs more than it
  // saves (SmolLM2's B=8 step: 7.8 ms against 8.1 with tasks of 4,096).
  static constexpr int64_t kLightTaskValues = 16384;

  // Splits n items into tasks of at least `grain` items; runs inline when there is one task.
  template <typename F>
  void parallel(int64_t n, int64_t grain, F&& fn) {
    int64_t tasks = std::min<int64_t>((n + grain - 1) / grain, 4 * pool_.size());
    if (tasks <= 1) {
      fn(0, n);
      return;
    }
    int64_t per = (n + tasks - 1) / tasks;
    std::function<void(int)> body = [&](int task) {
      int64_t begin = task * per, end = std::min(n, begin + per);
      if (begin < end) fn(begin, end);
    };
    pool_.parallel_for(static_cast<int>(tasks), body);
  }

  void run(const Tensor* t) {
    switch (t->op) {
      case Op::Leaf:
        return;
      case Op::GetRows:
        return get_rows(t);
      case Op::RmsNorm:
        return rms_norm(t);
      case Op::Mul:
      case Op::Add:
        return elementwise(t);
      case Op::MulMat:
        return mul_mat(t);
      case Op::Rope:
        return rope(t);
      case Op::KvStore:
        return kv_store(t);
      case Op::Attention:
        return attention(t);
      case Op::AttentionSeqs:
        return attention_seqs(t);
      case Op::KvStoreSeqs:
        return kv_store_seqs(t);
      case Op::Glu:
        return glu(t);
      case Op::Softcap:
        return softcap(t);
      case Op::Concat: {
        const size_t a = static_cast<size_t>(t->src[0]->n_elements()) * sizeof(float);
        std::memcpy(f32(t), f32(t->src[0]), a);
        std::memcpy(reinterpret_cast<uint8_t*>(f32(t)) + a, f32(t->src[1]),
                    static_cast<size_t>(t->src[1]->n_elements()) * sizeof(float));
        return;
      }
      case Op::Sample:
        if (!sampler_) sampler_ = std::make_unique<Sampler>(SamplingParams{});
        run_sample_op(f32(t->src[0]), static_cast<int32_t>(t->src[0]->ne[0]), i32(t->src[1]),
                      reinterpret_cast<int32_t*>(ptr(t)), t->params[0], t->params[1], *sampler_);
        return;
      case Op::ChainLoop:
        throw ArgumentError("cpu backend: chain loops run on backends that run graph loops (CUDA)");
      case Op::Count:
        break;
    }
    throw std::logic_error("cpu backend: unknown op");
  }

  void get_rows(const Tensor* t) {
    const Tensor* table = t->src[0];
    const int32_t* ids = i32(t->src[1]);
    float* dst = f32(t);
    const int64_t n = t->ne[0];
    const float scale = t->param_f(0);
    parallel(t->ne[1], 8, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        float* row = dst + i * n;
        // Inputs were checked; an id a Sample op computed (-1 after a failed sample) reads zeros.
        if (ids[i] < 0 || ids[i] >= table->ne[1]) {
          std::fill(row, row + n, 0.0f);
          continue;
        }
        dequantize_row(table->type, ptr(table) + size_t(ids[i]) * table->nb[1], row, n);
        if (scale != 1.0f)
          for (int64_t j = 0; j < n; ++j) row[j] *= scale;
      }
    });
  }

  void rms_norm(const Tensor* t) {
    const float* x = f32(t->src[0]);
    float* y = f32(t);
    // Groups are consecutive runs of the contiguous tensor: a column, or one head of it.
    const int64_t n = t->params[kNormGroup];
    const float eps = t->param_f(kNormEps);
    const int64_t grain = std::max<int64_t>(1, kLightTaskValues / n);
    parallel(t->n_elements() / n, grain, [&](int64_t b, int64_t e) {
      for (int64_t j = b; j < e; ++j) {
        const float* xr = x + j * n;
        double sum = 0;
        for (int64_t i = 0; i < n; ++i) sum += double(xr[i]) * xr[i];
        const float scale = float(1.0 / std::sqrt(sum / double(n) + eps));
        for (int64_t i = 0; i < n; ++i) y[j * n + i] = xr[i] * scale;
      }
    });
  }

  void elementwise(const Tensor* t) {
    const float* a = f32(t->src[0]);
    const float* b = f32(t->src[1]);
    float* y = f32(t);
    const int64_t n = t->ne[0];
    // src1's column repeats along the column when it is shorter (a per-head weight).
    const int64_t nb = t->src[1]->ne[0];
    const bool broadcast = t->src[1]->ne[1] == 1;
    const bool add = t->op == Op::Add;
    parallel(t->ne[1], 64, [&](int64_t c0, int64_t c1) {
      for (int64_t j = c0; j < c1; ++j) {
        const float* br = b + (broadcast ? 0 : j * nb);
        for (int64_t r = 0; r < n; r += nb) {
          const float* ar = a + j * n + r;
          float* yr = y + j * n + r;
          if (add)
            for (int64_t i = 0; i < nb; ++i) yr[i] = ar[i] + br[i];
          else
            for (int64_t i = 0; i < nb; ++i) yr[i] = ar[i] * br[i];
        }
      }
    });
  }

  void glu(const Tensor* t) {
    const float* g = f32(t->src[0]);
    const float* u = f32(t->src[1]);
    float* y = f32(t);
    const bool gelu = t->params[0] == kGluGelu;
    // Tasks of 4,096 elements or more (an exponential each): a decode batch of 8 of a 1,536-wide
    // feed-forward splits, one token does not.
    parallel(t->n_elements(), 1 << 12,
             [&](int64_t b, int64_t e) { glu_mul(g + b, u + b, y + b, e - b, gelu); });
  }

  void softcap(const Tensor* t) {
    const float* x = f32(t->src[0]);
    float* y = f32(t);
    const float cap = t->param_f(0);
    parallel(t->n_elements(), 1 << 14, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) y[i] = cap * std::tanh(x[i] / cap);
    });
  }

  void mul_mat(const Tensor* t) {
    const Tensor* w = t->src[0];
    const Tensor* x = t->src[1];
    const DType wt = w->type;
    const int64_t k = w->ne[0], n_rows = w->ne[1], n_cols = x->ne[1];
    const size_t act_row = act_row_size(wt, k);
    if (act_.size() < act_row * n_cols) act_.resize(act_row * n_cols);
    uint8_t* act = act_.data();
    const float* xf = f32(x);
    // Products of one activation and weight format in a row (q, k, v; gate, up) prepare it once.
    if (x != act_x_ || wt != act_type_) {
      act_x_ = nullptr;  // (until prepared)
      parallel(n_cols, std::max<int64_t>(1, kLightTaskValues / k), [&](int64_t b, int64_t e) {
        for (int64_t c = b; c < e; ++c) prepare_act(wt, xf + c * k, act + c * act_row, k);
      });
      act_x_ = x;
      act_type_ = wt;
    }
    float* out = f32(t);
    const uint8_t* wd = ptr(w);
    const size_t w_stride = w->nb[1];
    if (n_cols == 1) {
      // Memory-bound mat-vec: each thread streams its whole share of rows in one call.
      const int n_tasks = int(std::min<int64_t>(pool_.size(), (n_rows + 15) / 16));
      const int64_t per = (n_rows + n_tasks - 1) / n_tasks;
      std::function<void(int)> body = [&](int task) {
        const int64_t r0 = task * per, r1 = std::min(n_rows, r0 + per);
        if (r0 < r1)
          mul_mat_tile(wt, k, wd + r0 * w_stride, w_stride, int(r1 - r0), act, act_row, 1, out + r0,
                       size_t(n_rows));
      };
      pool_.parallel_for(n_tasks, body);
      return;
    }
    // Rows in whole groups of 16 (the AVX512 tiles' row groups; a tile's shape does not change
    // its values). A decode batch (up to kBatchCols columns): each thread one run of rows in one
    // call, so that its weights stream in order (the kernels request the lines of the rows after
    // those they work on). Prompts: tasks of up to 64 rows, in a count the threads divide where
    // one exists (products of 192 or 576 rows in tasks of 64 left a thread idle a third or a
    // ninth of the time), with every column, so that a task's rows are read once for all of
    // them; where that leaves fewer than two tasks a thread (many threads, few rows), the
    // columns split too, in runs of kBatchCols, a row task's column runs one after another.
    constexpr int64_t kGroup = 16, kMaxGroups = 4, kBatchCols = 8;
    const int64_t threads = std::max<int64_t>(1, pool_.size());
    const int64_t groups = (n_rows + kGroup - 1) / kGroup;
    int64_t per = (groups + threads - 1) / threads;  // groups a task
    int64_t cols_per_task = n_cols;
    if (n_cols > kBatchCols) {
      per = std::min<int64_t>(kMaxGroups, per);
      for (int64_t g = per; g >= 1; --g)
        if ((groups + g - 1) / g % threads == 0) {
          per = g;
          break;
        }
      const int64_t row_tasks = (groups + per - 1) / per;
      if (row_tasks < 2 * threads) {
        const int64_t splits = (2 * threads + row_tasks - 1) / row_tasks;
        cols_per_task = (n_cols + splits * kBatchCols - 1) / (splits * kBatchCols) * kBatchCols;
      }
    }
    const int64_t rows_per_task = per * kGroup;
    const int64_t col_tasks = (n_cols + cols_per_task - 1) / cols_per_task;
    std::function<void(int)> body = [&](int task) {
      const int64_t r0 = task / col_tasks * rows_per_task, c0 = task % col_tasks * cols_per_task;
      const int nr = int(std::min(rows_per_task, n_rows - r0));
      const int nc = int(std::min(cols_per_task, n_cols - c0));
      mul_mat_tile(wt, k, wd + r0 * w_stride, w_stride, nr, act + c0 * act_row, act_row, nc,
                   out + c0 * n_rows + r0, size_t(n_rows));
    };
    pool_.parallel_for(int((n_rows + rows_per_task - 1) / rows_per_task * col_tasks), body);
  }

  // A rope's cos and sin of each token's angles ([token][n_dims]), kept for the ropes after it
  // with the same positions and parameters: a step's q and k of every layer share one (Gemma's
  // two bases, two).
  struct RopeTable {
    std::vector<int32_t> pos;
    std::vector<float> factors;
    int n_dims = 0;
    double base = 0, scale = 0;
    bool has_factors = false;
    std::vector<float> cs;
  };

  const std::vector<float>& rope_table(const Tensor* t) {
    const int64_t n_tok = t->ne[1];
    const int32_t* pos = i32(t->src[1]);
    const int n_dims = t->params[kRopeNDims];
    const double base = t->param_f(kRopeBase), scale = t->param_f(kRopeScale);
    const float* factors = t->src[2] ? f32(t->src[2]) : nullptr;
    auto same = [&](const RopeTable& r) {
      return r.n_dims == n_dims && r.base == base && r.scale == scale &&
             r.has_factors == (factors != nullptr) &&
             (!factors || std::equal(r.factors.begin(), r.factors.end(), factors)) &&
             r.pos.size() == size_t(n_tok) && std::equal(r.pos.begin(), r.pos.end(), pos);
    };
    for (int i = 0; i < 2; ++i) {
      if (same(rope_tables_[i])) {
        if (i == 1) std::swap(rope_tables_[0], rope_tables_[1]);  // most recent first
        return rope_tables_[0].cs;
      }
    }
    std::swap(rope_tables_[0], rope_tables_[1]);
    RopeTable& r = rope_tables_[0];
    r.n_dims = 0;  // matches nothing until the table is whole (an exception leaves it so)
    r.pos.assign(pos, pos + n_tok);
    r.has_factors = factors != nullptr;
    if (factors)
      r.factors.assign(factors, factors + n_dims / 2);
    else
      r.factors.clear();
    r.base = base;
    r.scale = scale;
    r.cs.resize(size_t(n_tok) * size_t(n_dims));
    parallel(n_tok, 4, [&](int64_t b, int64_t e) {
      for (int64_t j = b; j < e; ++j) {
        float* cs = r.cs.data() + j * n_dims;
        for (int i = 0; i < n_dims / 2; ++i) {
          double theta = pos[j] * scale * std::pow(base, -2.0 * i / n_dims);
          if (factors) theta /= factors[i];
          cs[2 * i] = float(std::cos(theta));
          cs[2 * i + 1] = float(std::sin(theta));
        }
      }
    });
    r.n_dims = n_dims;
    return r.cs;
  }

  void rope(const Tensor* t) {
    const float* x = f32(t->src[0]);
    float* y = f32(t);
    const int n_head = t->params[kRopeNHead], head_dim = t->params[kRopeHeadDim];
    const int n_dims = t->params[kRopeNDims], mode = t->params[kRopeMode];
    const int64_t width = t->ne[0];
    const float* table = rope_table(t).data();
    parallel(t->ne[1], 4, [&](int64_t b, int64_t e) {
      for (int64_t j = b; j < e; ++j) {
        const float* cs = table + j * n_dims;
        for (int h = 0; h < n_head; ++h) {
          const float* xr = x + j * width + h * head_dim;
          float* yr = y + j * width + h * head_dim;
          for (int d = n_dims; d < head_dim; ++d) yr[d] = xr[d];
          const int half = n_dims / 2;
          for (int i = 0; i < half; ++i) {
            const int a = mode == kRopeNeox ? i : 2 * i;
            const int c = mode == kRopeNeox ? i + half : 2 * i + 1;
            const float x0 = xr[a], x1 = xr[c], cos_t = cs[2 * i], sin_t = cs[2 * i + 1];
            yr[a] = x0 * cos_t - x1 * sin_t;
            yr[c] = x0 * sin_t + x1 * cos_t;
          }
        }
      }
    });
  }

  void kv_store(const Tensor* t) {
    const Tensor* src = t->src[0];
    const float* x = f32(src);
    const int64_t n = src->ne[0];
    // F32 rows are copied; F16 rounded to nearest even; Q8_0 quantized as ggml's reference.
    for (int64_t j = 0; j < src->ne[1]; ++j)
      quantize_row(t->type, x + j * n, ptr(t) + size_t(kv_row(t->kv[0] + j, t->ne[1])) * t->nb[1],
                   n);
  }

  // A task is up to kAttnTokens tokens, one KV head (over an F16 cache read in place, every KV
  // head where that leaves enough tasks: attend) and one chunk of kAttnChunk keys: the query
  // heads that share the KV head (GQA) read each key and value row once together, a chunk of an
  // F16 or Q8_0 cache is decoded once for all the task's tokens (a prompt at depth reads it
  // kAttnTokens times less), and a decode step at depth spreads over the threads by chunks.
  // Each (token, chunk) keeps its softmax max, sum and weighted values; the chunks merge
  // afterwards (log-sum-exp). The split depends on the lengths alone, never on the thread
  // count, so the result is the same bits whatever the threads.
  static constexpr int kAttnChunk = 256;
  static constexpr int kAttnTokens = 16;
  static constexpr int kAttnMergeTokens = 4;

  // Keys for a run of query tokens: a cache's K and V rows (`rows` of them, position p in row
  // kv_row(p, rows)), the attention length, the first query's position, and the run's tokens
  // [j0, j0 + n_tok).
  struct AttnSource {
    const uint8_t* k;
    const uint8_t* v;
    int64_t rows;
    int n_kv, first_pos;
    int j0, n_tok;
    int n_chunks() const { return std::max(1, (n_kv + kAttnChunk - 1) / kAttnChunk); }
    int n_blocks() const { return (n_tok + kAttnTokens - 1) / kAttnTokens; }
  };

  void attention(const Tensor* t) {
    const Tensor* kc = t->src[1];
    const AttnSource s{ptr(kc), ptr(t->src[2]), kc->ne[1], t->kv[kAttnNKv], t->kv[kAttnFirstPos],
                       0,       int(t->ne[1])};
    attend(t, &s, 1);
  }

  // Each token over its own sequence's rows in the pools: sources of one token each.
  void attention_seqs(const Tensor* t) {
    const Tensor* kp = t->src[1];
    const Tensor* vp = t->src[2];
    const int32_t* slots = i32(t->src[3]);
    const int n = int(t->ne[1]);
    const int64_t rows = kp->params[kKvSeqRows];
    check_slots(slots, n, rows, kp->ne[1] / rows, kp->params[kKvRing] != 0);
    attn_sources_.resize(size_t(n));
    for (int b = 0; b < n; ++b) {
      // A padding token (sequence -1) attends to the first row of sequence 0, unused.
      const bool pad = slots[b] < 0;
      const size_t at = pad ? 0 : size_t(slots[b]) * size_t(rows);
      const int pos = pad ? 0 : slots[n + b];
      attn_sources_[size_t(b)] = {
          ptr(kp) + at * kp->nb[1], ptr(vp) + at * vp->nb[1], rows, pos + 1, pos, b, 1};
    }
    attend(t, attn_sources_.data(), n);
  }

  // Attention of every source's tokens, as tasks of up to kAttnTokens tokens of one source, one
  // KV head and one chunk of its keys, all in one parallel_for.
  void attend(const Tensor* t, const AttnSource* srcs, int n_src) {
    const Tensor* q = t->src[0];
    const Tensor* kc = t->src[1];
    const int n_head = t->params[kAttnNHead], n_head_kv = t->params[kAttnNHeadKv];
    const int hd = t->params[kAttnHeadDim];
    const float scale = t->param_f(kAttnScale);
    const int window = t->params[kAttnWindow];
    const int n_tok = int(q->ne[1]);
    const int group = n_head / n_head_kv;
    const float* qd = f32(q);
    float* out = f32(t);
    const bool f32_cache = kc->type == DType::F32;
    // An F16 cache is read in place where the kernels take it (attention_rows_f16), else its
    // rows are decoded to floats first.
    const bool f16_in_place = kc->type == DType::F16 && has_attention_rows_f16(hd);
    const size_t row_bytes = kc->nb[1];
    // Per (token, head, chunk) of a source with several chunks: max, sum, then hd weighted
    // values, each source's from part_start[i] on.
    const size_t part = size_t(hd) + 2;
    // Tasks of each source, from task_start[i] on; each token's source.
    attn_task_start_.resize(size_t(n_src) + 1);
    attn_part_start_.resize(size_t(n_src) + 1);
    attn_token_src_.resize(size_t(n_tok));
    attn_task_start_[0] = 0;
    attn_part_start_[0] = 0;
    // A decoding token's task (a source of at most kAttnMergeTokens tokens) takes every KV head
    // where that still leaves four tasks a thread (a decode batch's sequences, one sequence's
    // chunks at depth): the rows of its keys then come from memory once for all the heads, not
    // one head's slice of each at a time (F32 and F16 caches read in place, a Q8_0 task decoding
    // its whole rows once). (A prompt's blocks keep a head a task: their scores for every head
    // would outgrow the caches.)
    int64_t merged = 0;
    for (int i = 0; i < n_src; ++i) merged += int64_t(srcs[i].n_blocks()) * srcs[i].n_chunks();
    const bool merge_heads = merged >= 4 * int64_t(pool_.size());
    attn_heads_.resize(size_t(n_src));
    for (int i = 0; i < n_src; ++i) {
      const AttnSource& s = srcs[i];
      attn_heads_[size_t(i)] = merge_heads && s.n_tok <= kAttnMergeTokens ? n_head_kv : 1;
      attn_task_start_[size_t(i) + 1] =
          attn_task_start_[size_t(i)] +
          s.n_blocks() * (n_head_kv / attn_heads_[size_t(i)]) * s.n_chunks();
      attn_part_start_[size_t(i) + 1] =
          attn_part_start_[size_t(i)] +
          (s.n_chunks() > 1 ? size_t(s.n_tok) * n_head * s.n_chunks() * part : 0);
      for (int j = s.j0; j < s.j0 + s.n_tok; ++j) attn_token_src_[size_t(j)] = i;
    }
    if (attn_part_start_[size_t(n_src)] > attn_parts_.size())
      attn_parts_.resize(attn_part_start_[size_t(n_src)]);
    // Token j's part of head h's chunk c.
    auto part_of = [&](int j, int h, int c) {
      const int i = attn_token_src_[size_t(j)];
      const AttnSource& s = srcs[i];
      return attn_parts_.data() + attn_part_start_[size_t(i)] +
             ((size_t(j - s.j0) * n_head + h) * s.n_chunks() + c) * part;
    };
    auto keys = [&](const AttnSource& s, int j, int* start, int* len) {
      *len = std::min(s.n_kv, s.first_pos + (j - s.j0) + 1);
      // Keys before `start` are outside the window: never read.
      *start = window > 0 ? std::max(0, s.first_pos + (j - s.j0) + 1 - window) : 0;
    };
    // A (token, head, chunk)'s result: the output itself when its source has one chunk, else its
    // part.
    auto emit = [&](const AttnSource& s, int j, int h, int c, float m, float sum, const float* a) {
      if (s.n_chunks() == 1) {
        float* o = out + int64_t(j) * t->ne[0] + int64_t(h) * hd;
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        for (int d = 0; d < hd; ++d) o[d] = a[d] * inv;
      } else {
        float* pp = part_of(j, h, c);
        pp[0] = m;
        pp[1] = sum;
        std::copy(a, a + hd, pp + 2);
      }
    };
    // Tokens [j0, j1) of source s against keys [lo, hi) of chunk c of KV heads [hk, hk + nh)
    // (rows kb and vb, ks and vs floats apart, at the first head's part): one call for all the
    // tokens' query heads. A row's sums run in the same order whichever tokens and heads share
    // its task, so a prompt and the same tokens one at a time give the same bits.
    // kh and vh (not null): the rows are an F16 cache's, read in place (ks and vs elements
    // apart); else kb and vb's floats, head h's hd elements into each row.
    auto token_rows = [&](const AttnSource& s, int j0, int j1, int hk, int nh, int c, int lo,
                          int hi, const float* kb, int64_t ks, const float* vb, int64_t vs,
                          const uint16_t* kh, const uint16_t* vh) {
      thread_local std::vector<float> qs, sc, ac, m, sm;
      thread_local std::vector<int> bs, es;
      const int n = std::max(0, hi - lo);
      const int R = (j1 - j0) * group;  // rows a head
      qs.resize(size_t(R) * nh * hd);
      bs.resize(size_t(R) * nh);
      es.resize(size_t(R) * nh);
      for (int j = j0; j < j1; ++j) {
        int start, len;
        keys(s, j, &start, &len);
        const int b = std::max(start, c * kAttnChunk) - lo;
        const int e = std::max(b, std::min(len, (c + 1) * kAttnChunk) - lo);
        for (int h = 0; h < nh; ++h) {
          const float* qr = qd + int64_t(j) * q->ne[0] + int64_t(hk + h) * group * hd;
          const size_t row = size_t(h) * R + size_t(j - j0) * group;
          std::copy(qr, qr + size_t(group) * hd, qs.begin() + row * hd);
          for (int g = 0; g < group; ++g) bs[row + g] = b, es[row + g] = e;
        }
      }
      // The kernel sets every row's max, sum and values, rows without keys (n = 0) included.
      const int rows = R * nh;
      sc.resize(size_t(rows) * std::max(n, 1));
      ac.resize(size_t(rows) * hd);
      m.resize(rows);
      sm.resize(rows);
      if (kh != nullptr)
        attention_rows_f16(qs.data(), R, nh, hd, kh, ks, vh, vs, n, bs.data(), es.data(), scale,
                           sc.data(), m.data(), sm.data(), ac.data());
      else
        attention_rows_heads(qs.data(), R, nh, hd, kb, ks, vb, vs, n, bs.data(), es.data(), scale,
                             sc.data(), m.data(), sm.data(), ac.data());
      for (int h = 0; h < nh; ++h)
        for (int j = j0; j < j1; ++j)
          for (int g = 0; g < group; ++g) {
            const int r = h * R + (j - j0) * group + g;
            emit(s, j, (hk + h) * group + g, c, m[r], sm[r], ac.data() + size_t(r) * hd);
          }
    };
    std::function<void(int)> body = [&](int task) {
      const int i = int(std::upper_bound(attn_task_start_.begin(), attn_task_start_.end(), task) -
                        attn_task_start_.begin()) -
                    1;
      const AttnSource& s = srcs[i];
      const int local = task - attn_task_start_[size_t(i)], n_chunks = s.n_chunks();
      const int c = local % n_chunks;
      const int heads_a_task = attn_heads_[size_t(i)], head_tasks = n_head_kv / heads_a_task;
      const int hk0 = local / n_chunks % head_tasks * heads_a_task;
      const int j0 = s.j0 + local / n_chunks / head_tasks * kAttnTokens;
      const int j1 = std::min(s.j0 + s.n_tok, j0 + kAttnTokens);
      // The keys any of the tokens reads in this chunk: from the first token's start (starts
      // and ends grow with the position) to the last token's end.
      int start0, len0, start1, len1;
      keys(s, j0, &start0, &len0);
      keys(s, j1 - 1, &start1, &len1);
      const int lo = std::max(start0, c * kAttnChunk), hi = std::min(len1, (c + 1) * kAttnChunk);
      // (K and V are of one type and width: Graph::attention_node.)
      const int64_t rows = s.rows;
      const bool in_place = kv_row(lo, rows) + (hi - lo) <= rows;
      // The task's first row, at its first head.
      const size_t first =
          size_t(kv_row(lo, rows)) * row_bytes + row_size(kc->type, int64_t(hk0) * hd);
      if (in_place && hi > lo) {
        // The task's heads in one call: an F16 cache's rows or an F32 cache's read in place,
        // another's whole rows decoded once for every head (each decoded value is the float a
        // head's own decode gives).
        if (f16_in_place) {
          token_rows(s, j0, j1, hk0, heads_a_task, c, lo, hi, nullptr, int64_t(row_bytes / 2),
                     nullptr, int64_t(row_bytes / 2),
                     reinterpret_cast<const uint16_t*>(s.k + first),
                     reinterpret_cast<const uint16_t*>(s.v + first));
          return;
        }
        if (f32_cache) {
          token_rows(s, j0, j1, hk0, heads_a_task, c, lo, hi,
                     reinterpret_cast<const float*>(s.k + first), int64_t(row_bytes / 4),
                     reinterpret_cast<const float*>(s.v + first), int64_t(row_bytes / 4), nullptr,
                     nullptr);
          return;
        }
        if (heads_a_task > 1) {
          thread_local std::vector<float> kbuf, vbuf;
          const int n = hi - lo, width = heads_a_task * hd;
          kbuf.resize(size_t(n) * width);
          vbuf.resize(size_t(n) * width);
          const RowDecoder decode = row_decoder(kc->type);
          const int64_t blocks = width / type_traits(kc->type).block_size;
          for (int p = 0; p < n; ++p) {
            decode(s.k + first + size_t(p) * row_bytes, kbuf.data() + size_t(p) * width, blocks);
            decode(s.v + first + size_t(p) * row_bytes, vbuf.data() + size_t(p) * width, blocks);
          }
          token_rows(s, j0, j1, hk0, heads_a_task, c, lo, hi, kbuf.data(), width, vbuf.data(),
                     width, nullptr, nullptr);
          return;
        }
      }
      for (int hk = hk0; hk < hk0 + heads_a_task; ++hk) {
        thread_local std::vector<float> kbuf, vbuf;
        const float* kb = nullptr;
        const float* vb = nullptr;
        if (hi > lo) {
          // The chunk's rows of this KV head decoded into rows of hd floats (a Q8_0 head is
          // whole blocks: Context checks); positions that wrap around a ring cache's end are
          // gathered so too.
          const int n = hi - lo;
          const size_t at = row_size(kc->type, int64_t(hk) * hd);
          kbuf.resize(size_t(n) * hd);
          vbuf.resize(size_t(n) * hd);
          const size_t head_bytes = row_size(kc->type, hd);
          const RowDecoder decode = row_decoder(kc->type);
          const int64_t head_blocks = hd / type_traits(kc->type).block_size;
          for (int p = lo; p < hi; ++p) {
            const size_t r = size_t(kv_row(p, rows)), ahead = size_t(kv_row(p + 8, rows));
            // Each head's slice is a cache row apart from the next: fetched ahead by hand.
            if (p + 8 < hi)
              for (size_t b = 0; b < head_bytes; b += 64) {
                __builtin_prefetch(s.k + ahead * row_bytes + at + b);
                __builtin_prefetch(s.v + ahead * row_bytes + at + b);
              }
            decode(s.k + r * row_bytes + at, kbuf.data() + size_t(p - lo) * hd, head_blocks);
            decode(s.v + r * row_bytes + at, vbuf.data() + size_t(p - lo) * hd, head_blocks);
          }
          kb = kbuf.data(), vb = vbuf.data();
        }
        token_rows(s, j0, j1, hk, 1, c, lo, hi, kb, hd, vb, hd, nullptr, nullptr);
      }
    };
    pool_.parallel_for(attn_task_start_[size_t(n_src)], body);
    if (attn_part_start_[size_t(n_src)] == 0) return;  // no source has several chunks
    // Merge each head's chunks: weights exp(max_c - max), empty chunks (sum 0) add nothing.
    std::function<void(int)> merge = [&](int task) {
      const int j = task / n_head, h = task % n_head;
      const int n_chunks = srcs[attn_token_src_[size_t(j)]].n_chunks();
      if (n_chunks == 1) return;  // written directly
      const float* pp = part_of(j, h, 0);
      float m = -INFINITY;
      for (int c = 0; c < n_chunks; ++c)
        if (pp[c * part + 1] > 0.0f) m = std::max(m, pp[c * part]);
      float* o = out + int64_t(j) * t->ne[0] + int64_t(h) * hd;
      std::fill(o, o + hd, 0.0f);
      double total = 0;
      for (int c = 0; c < n_chunks; ++c) {
        const float* pc = pp + c * part;
        if (pc[1] <= 0.0f) continue;
        const float w = std::exp(pc[0] - m);
        total += double(pc[1]) * w;
        axpy(o, w, pc + 2, hd);
      }
      const float inv = total > 0 ? float(1.0 / total) : 0.0f;
      for (int d = 0; d < hd; ++d) o[d] *= inv;
    };
    pool_.parallel_for(n_tok * n_head, merge);
  }

  // Each token's sequence must lie in the pool, and its position in the sequence's rows unless
  // they are a ring (Context checks as much before it builds a batch).
  static void check_slots(const int32_t* slots, int n, int64_t rows, int64_t n_seq, bool ring) {
    for (int b = 0; b < n; ++b)
      if (slots[b] < -1 || slots[b] >= n_seq || slots[n + b] < 0 || (!ring && slots[n + b] >= rows))
        throw std::logic_error("cpu backend: token " + std::to_string(b) + "'s slot (sequence " +
                               std::to_string(slots[b]) + ", position " +
                               std::to_string(slots[n + b]) + ") lies outside the KV pool");
  }

  // Writes column b of src0 into the row of its sequence's position in the pool.
  void kv_store_seqs(const Tensor* t) {
    const Tensor* src = t->src[0];
    const float* x = f32(src);
    const int32_t* slots = i32(t->src[2]);
    const int64_t n = src->ne[0], m = src->ne[1], rows = t->params[kKvSeqRows];
    check_slots(slots, int(m), rows, t->ne[1] / rows, t->params[kKvRing] != 0);
    for (int64_t j = 0; j < m; ++j) {
      if (slots[j] < 0) continue;  // a padding token
      const int64_t row = slots[j] * rows + kv_row(slots[m + j], rows);
      quantize_row(t->type, x + j * n, ptr(t) + size_t(row) * t->nb[1], n);
    }
  }

  ThreadPool pool_;
  std::unique_ptr<Sampler> sampler_;  // Sample ops' buffers
  std::vector<AttnSource> attn_sources_;
  RopeTable rope_tables_[2];
  std::vector<int> attn_task_start_, attn_token_src_, attn_heads_;
  std::vector<size_t> attn_part_start_;
  Buffer scratch_, input_;
  size_t scratch_size_ = 0, input_size_ = 0;
  std::vector<Buffer> kv_;
  std::vector<uint8_t> act_;
  // The activation act_ holds, prepared for weights of act_type_ (this compute's), or none.
  const Tensor* act_x_ = nullptr;
  DType act_type_ = DType::F32;
  std::vector<float> attn_parts_;  // attention's per-chunk partial results
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(int n_threads) {
  if (n_threads <= 0) n_threads = default_thread_count();
  return std::make_unique<CpuBackend>(n_threads);
}

}  // namespace ggraph
