// Graph IR: tensors are descriptors, ops are constructors that do no work (ggml-style).
// A backend computes a finished graph; the planner gives every intermediate a fixed offset.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <string>
#include <vector>

#include "quant.h"

namespace ggraph {

enum class Op : uint8_t {
  Leaf,       // weight, input or KV cache: no work
  GetRows,    // dst[:, i] = scale * src0[:, src1[i]]    src0 any computable type, src1 I32
  RmsNorm,    // each run of `group` elements of src0 divided by its rms   params: eps, group
  Mul,        // dst = src0 * src1; src1 broadcast over columns when it has one column, and
              // repeated along a column when its rows are shorter (a per-head weight)
  Add,        // dst = src0 + src1, same broadcast
  MulMat,     // dst[n, t] = sum_k src0[k, n] * src1[k, t]   src0 weights, src1 F32
  Rope,       // rotate pairs of src0 [n_head*head_dim, T] by positions src1 (I32 [T])
  KvStore,    // write src0 [n_embd_kv, T] (F32) into cache dst, positions kv[0]..kv[0]+T-1
  Attention,  // causal attention of q=src0 over K=src1, V=src2 caches; GQA; optional window
  Glu,        // dst = act(src0) * src1, act = silu (SwiGLU) or tanh-approximated gelu (GeGLU)
  Softcap,    // dst = cap * tanh(src0 / cap)
  Concat,     // dst = [src0 | src1]: the columns of src0, then those of src1 (same rows)
  // One token of each of B sequences whose caches lie in one pool (src1 [width, n_seq * rows],
  // sequence s's rows from s * rows on); src2 (I32 [2B]) holds each token's sequence, then its
  // position. KvStoreSeqs writes src0 [width, B]'s column b into its sequence's row;
  // AttentionSeqs is each token's Attention over its own sequence (K = src1, V = src2, slots =
  // src3). Sequence -1 marks a padding token (a batch padded to its size class): nothing is
  // stored for it and its attention output is unspecified.
  KvStoreSeqs,
  AttentionSeqs,
  // The next token from src0's logits (F32 [n_vocab, 1]) by the sampling chain (sampling.h),
  // configured by src1 (I32 [sample_word::kHeader + window], sampling_math.h). The node writes
  // the token buffer src2 (I32 [2K], Storage::Kv) in place: entry j = params[0] gets the token,
  // entry K + j the bits of its log-probability under the raw logits. Step j's penalty history
  // is src1's ids followed by entries 0..j-1, its draw index the config's first plus j.
  Sample,
  // A device loop around a sampled chain (src0 the chain's last Sample, whose token buffer it
  // reads): the backend runs the chain's steps again and again in one launch, this op ending
  // each round. It appends the round's token words to its own buffer (I32 [1 + 2C], C =
  // params[kLoopCapacity]: the count of tokens so far, then C tokens, then C log-probability
  // bits, as a Sample's) and, unless a token is negative or one of the config's stop ids or
  // the rounds asked (src3, I32 [2]: rounds, then 0) are done, readies the next round: the
  // chain's first token (src2) becomes the round's last, its positions (Graph::loop_positions)
  // and KV values move on by params[kLoopChain], the config (src1) draws on, counts the round
  // off its limit (sample_word::kLimit: the steps past it skipped, the last round then ending
  // part-way) and takes the round's tokens into its history.
  ChainLoop,
  Count,
};
const char* op_name(Op op);

enum class Storage : uint8_t {
  Weight,   // uploaded once at load
  Input,    // host data copied into a fixed place before each compute
  Kv,       // the KV cache, allocated once per context
  Scratch,  // intermediates: an offset in the scratch buffer, assigned by the planner
};

// Rope modes, as llama.cpp numbers them.
constexpr int32_t kRopeNormal = 0;  // rotate adjacent pairs (x[2i], x[2i+1])
constexpr int32_t kRopeNeox = 2;    // rotate halves (x[i], x[i + n_dims/2])

struct Tensor {
  Op op = Op::Leaf;
  DType type = DType::F32;
  Storage storage = Storage::Scratch;
  int64_t ne[4] = {1, 1, 1, 1};  // ne[0] innermost
  size_t nb[4] = {0, 0, 0, 0};   // strides in bytes (contiguous rows)
  Tensor* src[4] = {nullptr, nullptr, nullptr, nullptr};
  // Op parameters that define the topology (shapes, modes, constants).
  int32_t params[8] = {};
  // Op parameters that follow the KV-cache position (cache row written, attention length,
  // position of the first query). They change every decode step without changing topology:
  // the CUDA graph executor patches them in place.
  int32_t kv[2] = {0, 0};
  // How many of kv are in use (what Graph::shift_kv moves): a KvStore's row, an Attention's
  // length and first position.
  int n_kv() const { return op == Op::KvStore ? 1 : op == Op::Attention ? 2 : 0; }
  size_t offset = 0;     // Scratch: from the planner. Input: in the input buffer.
  void* data = nullptr;  // Weight/Kv: backend memory. Input: host source data.
  int index = -1;        // position in Graph::nodes
  std::string name;

  int64_t n_elements() const { return ne[0] * ne[1] * ne[2] * ne[3]; }
  size_t nbytes() const { return nb[3] * ne[3]; }
  int64_t rows() const { return ne[1] * ne[2] * ne[3]; }
  float param_f(int i) const {
    float f;
    std::memcpy(&f, &params[i], sizeof f);
    return f;
  }
  void set_param_f(int i, float f) { std::memcpy(&params[i], &f, sizeof f); }
};

// A graph owns its tensors. Leaves may be reused across graphs only through Graph::leaf().
class Graph {
 public:
  Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  // Leaves
  Tensor* weight(DType type, int64_t ne0, int64_t ne1, void* data, const std::string& name);
  // ring: the cache's ne1 rows hold position p in row p % ne1 (a sliding-window layer's ring);
  // otherwise position p is row p.
  Tensor* kv_cache(DType type, int64_t ne0, int64_t ne1, void* data, const std::string& name,
                   bool ring = false);
  Tensor* input_i32(int64_t n, const int32_t* host, const std::string& name);
  // The token buffer of a chain of k Sample ops (backend memory of 2k I32, see Op::Sample), and
  // the view of its entry j: the token a step feeds the next one.
  Tensor* token_buffer(void* data, int k);
  Tensor* token_at(Tensor* buffer, int j);

  // Ops (no work is done here)
  // scale multiplies every gathered value (Gemma scales its embeddings by sqrt(n_embd)).
  Tensor* get_rows(Tensor* table, Tensor* ids, float scale = 1.0f);
  // Normalizes each run of `group` elements (0: a whole column); a group of head_dim gives
  // the per-head norms of q and k.
  Tensor* rms_norm(Tensor* x, float eps, int64_t group = 0);
  Tensor* mul(Tensor* a, Tensor* b);
  Tensor* add(Tensor* a, Tensor* b);
  Tensor* mul_mat(Tensor* w, Tensor* x);
  // Pair i turns by pos * freq_scale * freq_base^(-2i/n_dims) / freq_factors[i]; freq_factors
  // (F32 [n_dims/2], optional) are Llama 3.1's long-context rope factors, freq_scale < 1 is
  // linear rope scaling.
  Tensor* rope(Tensor* x, Tensor* pos, int n_head, int head_dim, int n_dims, int mode,
               float freq_base, Tensor* freq_factors = nullptr, float freq_scale = 1.0f);
  // Writes x's columns as the rows of positions first_row.. (of a ring: rows modulo its size).
  Tensor* kv_store(Tensor* cache, Tensor* x, int32_t first_row);
  // window > 0: a query at position p sees only keys at positions p - window + 1 .. p. Over a
  // ring cache the window must be set, and the window plus the queries must fit its rows.
  Tensor* attention(Tensor* q, Tensor* k_cache, Tensor* v_cache, int n_head, int n_head_kv,
                    int head_dim, float scale, int32_t n_kv, int32_t first_pos, int window = 0);
  // A pool of n_seq caches of `rows` rows each (ring: each sequence's rows a ring); the ops on
  // one token of each of several sequences take it with their slots (I32 [2B]: each token's
  // sequence, then its position).
  Tensor* kv_pool(DType type, int64_t ne0, int rows, int n_seq, void* data, const std::string& name,
                  bool ring = false);
  Tensor* kv_store_seqs(Tensor* pool, Tensor* x, Tensor* slots);
  Tensor* attention_seqs(Tensor* q, Tensor* k_pool, Tensor* v_pool, Tensor* slots, int n_head,
                         int n_head_kv, int head_dim, float scale, int window = 0);
  Tensor* swiglu(Tensor* gate, Tensor* up);
  Tensor* geglu(Tensor* gate, Tensor* up);
  Tensor* softcap(Tensor* x, float cap);
  Tensor* concat(Tensor* a, Tensor* b);
  // Step `step` of a chain sampling into `tokens` (Op::Sample).
  Tensor* sample(Tensor* logits, Tensor* config, Tensor* tokens, int step);
  // The loop around the chain whose last step is `last` (Op::ChainLoop): positions are the
  // chain's position inputs, one a step, out backend memory of 1 + 2 * capacity I32.
  Tensor* chain_loop(Tensor* last, Tensor* config, Tensor* first, Tensor* control,
                     const std::vector<Tensor*>& positions, void* out, int capacity);
  const std::vector<Tensor*>& loop_positions() const { return loop_positions_; }

  // Moves every KV-position parameter by delta: the graph of one step, shifted, is the graph of
  // the step `delta` positions later with the same batch shape (what Tensor::kv means).
  void shift_kv(int32_t delta);

  void set_output(Tensor* t) { output_ = t; }
  Tensor* output() const { return output_; }
  const std::vector<Tensor*>& nodes() const { return nodes_; }  // every tensor, in build order
  int n_tokens = 0;   // batch size the graph was built for
  bool seqs = false;  // a decode batch: one token of each of n_tokens sequences
  int chain = 0;      // a chain of that many decode steps, each sampling the next one's token
  // Unique per graph object in the process: a backend can tell a graph it ran last step (shifted
  // in place since) from a new one that happens to share its address.
  const uint64_t serial;

  // Bytes the planner assigned (scratch, inputs).
  size_t scratch_size = 0;
  size_t input_size = 0;

 private:
  Tensor* new_tensor(Op op, DType type, int64_t ne0, int64_t ne1, const std::string& name);
  Tensor* elementwise(Op op, Tensor* a, Tensor* b);
  Tensor* glu(Tensor* gate, Tensor* up, int32_t act);
  // The node of kv_store and kv_store_seqs: x's rows into cache (a KV cache or pool).
  Tensor* kv_store_node(Op op, Tensor* cache, Tensor* x);
  Tensor* attention_node(Op op, Tensor* q, Tensor* k, Tensor* v, int n_head, int n_head_kv,
                         int head_dim, float scale, int window);
  std::deque<Tensor> storage_;  // stable addresses
  std::vector<Tensor*> nodes_;
  // The nodes shift_kv moves, found at its first call after the graph last grew (of nodes_'s
  // first kv_scanned_ entries).
  std::vector<Tensor*> kv_nodes_;
  size_t kv_scanned_ = 0;
  Tensor* output_ = nullptr;
  std::vector<Tensor*> loop_positions_;  // of the ChainLoop node
};

// ChainLoop op parameter slots.
enum LoopParam { kLoopChain = 0, kLoopCapacity = 1 };
// Added to a streamed loop's count of tokens (Backend::loop_words) once its last round has ended.
constexpr int32_t kLoopEnded = 1 << 30;
// Where a chain loop of `capacity` tokens keeps its j-th token id and log-probability, in its
// output and in the words it hands the host (Backend::loop_words): after the count (word 0).
constexpr int loop_token_word(int j) { return 1 + j; }
constexpr int loop_logprob_word(int capacity, int j) { return 1 + capacity + j; }

// Attention op parameter slots.
enum AttnParam {
  kAttnNHead = 0,
  kAttnNHeadKv = 1,
  kAttnHeadDim = 2,
  kAttnScale = 3,
  kAttnWindow = 4
};
// RmsNorm op parameter slots.
enum NormParam { kNormEps = 0, kNormGroup = 1 };
// Glu op: params[0] is the activation of the gate.
constexpr int32_t kGluSilu = 0;
constexpr int32_t kGluGelu = 1;
enum AttnKv { kAttnNKv = 0, kAttnFirstPos = 1 };
// KV cache leaves and KvStore nodes: params[kKvRing] is 1 for a ring cache (Graph::kv_cache);
// pools (Graph::kv_pool) and the ops on them keep each sequence's rows in params[kKvSeqRows].
constexpr int kKvRing = 0;
constexpr int kKvSeqRows = 1;
// The cache row that holds position pos, in a cache of `rows` rows (ring or not).
inline int64_t kv_row(int64_t pos, int64_t rows) { return pos < rows ? pos : pos % rows; }
// Rope op parameter slots.
enum RopeParam {
  kRopeNHead = 0,
  kRopeHeadDim = 1,
  kRopeNDims = 2,
  kRopeMode = 3,
  kRopeBase = 4,
  kRopeScale = 5
};

}  // namespace ggraph
