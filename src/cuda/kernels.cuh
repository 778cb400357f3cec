// Internal declarations of the CUDA backend: device buffers, the step's KV record, per-op launch
// functions and the flash-decoding split count.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "common.h"
#include "cuda/launch.cuh"
#include "cuda/weight_layout.h"
#include "graph.h"

namespace ggraph::cuda {

// ---- Weight formats as the kernels see them -------------------------------------------------

// Sizes and names come from the core's type table (dtype.cpp); quantized weights are those with
// a split layout (cuda/weight_layout.h), which every kernel reads.
inline int64_t block_elems(DType t) { return type_traits(t).block_size; }
inline size_t block_bytes(DType t) { return type_traits(t).type_size; }
inline bool is_quantized(DType t) { return split_format(t).block_bytes != 0; }
// The weight formats every kernel handles.
inline bool is_computable(DType t) {
  return t == DType::F32 || t == DType::F16 || t == DType::BF16 || is_quantized(t);
}
inline const char* dtype_name(DType t) { return type_name(t); }
inline size_t row_bytes(DType t, int64_t n) {
  return static_cast<size_t>(n / block_elems(t)) * block_bytes(t);
}

// Calls fn(std::integral_constant<int, TYPE>{}) for a weight format the kernels handle (what
// names the caller in the error for any other).
template <typename Fn>
decltype(auto) with_weight_type(DType t, const char* what, Fn&& fn) {
  switch (t) {
#define GGRAPH_WEIGHT_TYPE(T) \
  case DType::T:              \
    return fn(std::integral_constant<int, static_cast<int>(DType::T)>{});
    GGRAPH_WEIGHT_TYPE(F32)
    GGRAPH_WEIGHT_TYPE(F16)
    GGRAPH_WEIGHT_TYPE(BF16)
    GGRAPH_WEIGHT_TYPE(Q4_0)
    GGRAPH_WEIGHT_TYPE(Q4_1)
    GGRAPH_WEIGHT_TYPE(Q5_0)
    GGRAPH_WEIGHT_TYPE(Q5_1)
    GGRAPH_WEIGHT_TYPE(Q8_0)
    GGRAPH_WEIGHT_TYPE(Q2_K)
    GGRAPH_WEIGHT_TYPE(Q3_K)
    GGRAPH_WEIGHT_TYPE(Q4_K)
    GGRAPH_WEIGHT_TYPE(Q5_K)
    GGRAPH_WEIGHT_TYPE(Q6_K)
    GGRAPH_WEIGHT_TYPE(IQ4_NL)
    GGRAPH_WEIGHT_TYPE(IQ4_XS)
#undef GGRAPH_WEIGHT_TYPE
    default:
      throw ArgumentError(std::string(what) + ": unsupported weight type " + dtype_name(t));
  }
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Weight allocations get this many spare bytes so that the mat-vec kernels' 16-byte copies of a
// row's last bytes stay inside the allocation whatever the row alignment.
constexpr size_t kWeightPadding = 64;
// Quantized weights are staged on the device in chunks of at most this many bytes for the split.
constexpr size_t kWeightStagingBytes = size_t(16) << 20;

// Mat-muls with at most this many columns (tokens) take the mat-vec kernels; more take the
// tensor-core tiled kernels. The choice depends on the batch only, never on KV values.
constexpr int kMatVecMaxCols = 8;
// Attention over at most this many queries takes the flash-decoding kernels.
constexpr int kDecodeAttnMaxTokens = 8;

// ---- Flash-decoding split count ---------------------------------------------------------------

// Flash-decoding launches kAttnTargetBlocks blocks or more (over its queries) where the cache is
// long enough to give each split split_keys keys (kAttnMinSplitKeys, or the keys a block's warps
// stage in one pass where that is fewer); a step uses as many of its splits as its keys fill
// (attn_decode_kernel). The grid depends on the cache size and the batch's size, never on the KV
// position, so one executable serves a whole conversation.
constexpr int kAttnTargetBlocks = 256;
constexpr int kAttnMinSplitKeys = 128;
constexpr int kAttnMaxSplitKeys = 2048;  // where kMaxAttnSplits allow
constexpr int kMaxAttnSplits = 64;
// Splits of the cluster decode kernel (sm_90+, few KV heads): one cluster of this many blocks a
// head group, merged through distributed shared memory.
constexpr int kAttnClusterSplits = 8;
// Splits for a decode attention that reads at most max_keys keys with kv_blocks blocks per split.
int attention_splits(int max_keys, int kv_blocks, int split_keys = kAttnMinSplitKeys);

// ---- The step's KV record ---------------------------------------------------------------------
//
// A step's KV-position values (cache rows written, attention lengths, first query positions)
// reach the kernels through a small device buffer that the step's first kernel writes from its
// by-value argument; the kernels that use them hold pointers into it. So a step that only moves
// the KV position changes the arguments of that one kernel node.

constexpr int kMaxKvSlots = 32;
// The record's contents as that kernel's argument (no padding: equal values, equal bytes).
struct KvSlots {
  int32_t v[kMaxKvSlots];
};
void launch_kv_params(Launcher& l, const KvSlots& values, int32_t* record);

// Where a graph's KV parameters (Tensor::kv of its KvStore and Attention nodes) go in the record:
// equal values share a slot, slots numbered in order of first use.
struct KvLayout {
  struct Source {
    int node;  // index in Graph::nodes
    int kv;    // which of its kv values
    int slot;
  };
  std::vector<Source> sources;  // in node order
  KvSlots values = {};          // unused slots zero
  int n_slots = 0;
  int slot_of(int32_t value) const;  // -1 when no slot holds it
};
// Throws ArgumentError when the graph has more than kMaxKvSlots distinct KV values.
void kv_layout(const Graph& graph, KvLayout* layout);
// Reads the KV values of the graph that layout was made from, shifted since (Graph::shift_kv),
// into layout->values. False when the layout no longer fits it (values that were equal differ
// or the other way round): then
// its launches are not those of the last step and must be walked again.
bool refresh_kv_values(const Graph& graph, KvLayout* layout);

class Blas;

// ---- Buffers a graph's kernels address --------------------------------------------------------

// The rope angles of one configuration at positions [0, rows) (launch_rope_table), kept by the
// backend for as long as it lives.
struct RopeTable {
  float freq_base = 0.0f, freq_scale = 1.0f;
  const float* freq_factors = nullptr;
  int n_dims = 0, rows = 0;
  float2* data = nullptr;
};

struct DeviceBuffers {
  uint8_t* scratch = nullptr;
  uint8_t* input = nullptr;
  uint8_t* act = nullptr;  // activations prepared for mat-muls (8-bit blocks or half)
  size_t act_bytes = 0;
  float* attn = nullptr;  // flash-decoding partial results
  size_t attn_bytes = 0;
  unsigned* attn_counters = nullptr;  // flash-decoding tickets (attn_counters_bytes)
  int32_t* kv_record = nullptr;       // kMaxKvSlots values
  void* sample_work = nullptr;        // the sample kernel's workspace (sample_work_bytes)
  const Blas* blas = nullptr;         // cuBLAS for the prompt products it takes (blas.h), or none
  uint8_t* wdeq = nullptr;            // a chunk of a quantized weight decoded for it
  size_t wdeq_bytes = 0;
  const RopeTable* rope_tables = nullptr;  // n_rope_tables of them (the rope configurations')
  int n_rope_tables = 0;
  // A chain loop's words streamed to the host, and the host's halt word (mapped host memory,
  // device addresses; ChainLoopArgs), or none.
  int32_t* loop_host = nullptr;
  const int32_t* loop_halt = nullptr;
};

// Device address of a tensor's data.
void* tensor_ptr(const Tensor* t, const DeviceBuffers& buf);

// Workspace sizes a graph needs (computed on the host from shapes; never depends on kv values).
size_t act_workspace_bytes(const Graph& graph);
// Whether the producer of an activation that only warp-pipelined products read among the
// quantized ones (a norm, a glu, a decode attention) writes its column tiles itself, so that no
// launch_quantize_act_tiles goes out before the products (on by default; GGRAPH_CUDA_TILE_OUTPUT=0
// turns it off). Test hook: sets it, returns the setting before.
bool set_tile_output(bool on);
// Attention partials, or with counters the flash-decoding tickets.
size_t attn_workspace_bytes(const Graph& graph, bool counters);

// Checks every node's shapes, types and KV arguments against what the kernels support, before
// anything is launched. Throws ArgumentError naming the node.
void validate_graph(const Graph& graph);
// The same checks for one node.
void validate_node(const Tensor* t);

// What a step on a graph that ran before (shifted since by Graph::shift_kv) needs to know of
// it, found once from the whole graph.
struct ReusePlan {
  std::vector<int> recheck;  // nodes whose checks read input values: get_rows of token ids
  // The range each KV value may take (validate_node's rule for it), so that a step checks
  // values, not nodes.
  struct KvCheck {
    int node, kv;
    int32_t lo, hi;
  };
  std::vector<KvCheck> kv_checks;
  std::vector<int> inputs;  // input tensors, copied in every step
  KvLayout kv;
};
void plan_reuse(const Graph& graph, ReusePlan* plan);
// Checks the nodes of plan->recheck again and the KV values against their ranges, and those
// values plus span (throws ArgumentError as validate_graph does), and reads the KV values into
// plan->kv; false (plan->kv made anew) when the launches must be walked again (see
// refresh_kv_values).
bool check_reused(const Graph& graph, ReusePlan* plan, int32_t span = 0);
// The KV values' checks alone; span: how far a chain loop's last round lies past the values.
void check_kv_values(const Graph& graph, const ReusePlan& plan, int32_t span);

// Launches the KV record's kernel with kv's values, then every node's kernels, on launcher (which
// sets launcher.node for each node; -1 for the record's). kv is the graph's layout with its
// current values (kv_layout, or plan_reuse / check_reused's). No allocation, no
// synchronisation, no host read of device data: it may run under stream capture.
void launch_graph(const Graph& graph, const KvLayout& kv, const DeviceBuffers& buf,
                  Launcher& launcher);

// ---- Per-op launches (pointers already resolved) ----------------------------------------------

// scale multiplies every value gathered.
void launch_get_rows(Launcher& l, DType type, const void* table, int64_t ne0, int64_t n_rows,
                     const int32_t* ids, int n_ids, float* dst, float scale = 1.0f);
// rms_norm per column, with optional fusions: x = src + add (written to sum_out) before the
// norm; the weight multiply after it (w broadcast when w_cols == 1; w_fixed: a model weight);
// and the 8-bit quantization of the result into quant_ws (the layout of launch_quantize_act;
// ne0 % 32 == 0). With one column and ne0 <= kNormRegElems, every read comes before every
// write: the outputs may then overlap the inputs.
constexpr int64_t kNormRegElems = 8 * 1024;
struct NormArgs {
  const float* src = nullptr;
  const float* add = nullptr;
  float* sum_out = nullptr;
  // When set, add is first normalized (add_eps) and multiplied by add_w: src + rms_norm(add) *
  // add_w is the sum. One column of at most kNormRegElems only.
  const float* add_w = nullptr;
  float add_eps = 0.0f;
  const float* w = nullptr;
  int64_t w_cols = 1;
  bool w_fixed = false;
  float* dst = nullptr;
  uint8_t* quant_ws = nullptr;  // also the result's 8-bit form (launch_quantize_act's)
  bool quant_tiles = false;     // that form in column tiles (launch_quantize_act_tiles's)
  uint8_t* half_ws = nullptr;   // also its half form (launch_act_to_half's; ne0 % kActPad == 0)
};
void launch_rms_norm(Launcher& l, const NormArgs& args, int64_t ne0, int64_t cols, float eps);
// One column of 2,048 to 8,192 values is normalized over a cluster of blocks where the GPU runs
// it (sm_90+) and the column is at least this wide (4,096 by default; GGRAPH_CUDA_NORM_CLUSTER=0
// none, =1 2,048). Test hook: sets the width, returns the one before.
int64_t set_norm_cluster_min_width(int64_t width);
// Asks once whether the cluster norms run here (part of prepare_kernels, before any capture).
void prepare_norm_kernels();
// Measurement builds (GGRAPH_CUDA_STEP_TRACE): once a process, page-locked records for every
// grid's stamps (cuda/device_util.cuh, pdl_wait), printed as "STP" lines at its exit. A no-op
// in other builds.
void step_trace_attach();
// op: 0 = add, 1 = mul; src1 broadcast over columns when src1_cols == 1, and its columns of
// b_ne0 elements repeated along a column of ne0 (ne0 a multiple of b_ne0).
void launch_binary(Launcher& l, int op, const float* a, const float* b, int64_t b_cols, float* dst,
                   int64_t ne0, int64_t cols, int64_t b_ne0);
// act: kGluSilu or kGluGelu (graph.h). quant_ws (optional, ne0 % 32 == 0): also the 8-bit
// quantization of the result (quant_tiles: in column tiles, launch_quantize_act_tiles's);
// half_ws (optional, ne0 % kActPad == 0): also its half form.
void launch_glu(Launcher& l, int act, const float* gate, const float* up, float* dst, int64_t ne0,
                int64_t cols, uint8_t* quant_ws, uint8_t* half_ws = nullptr,
                bool quant_tiles = false);
// dst = cap * tanh(x / cap) over n elements.
void launch_softcap(Launcher& l, const float* x, float* dst, int64_t n, float cap);
// Global workspace launch_sample needs for a vocabulary of n_vocab (bytes; 16-byte aligned).
size_t sample_work_bytes(int n_vocab);
// The sampling chain (sampling.h) on logits [n_vocab] (device F32, read only), configured by
// config (device I32 words: sampling_math.h's sample_word layout; words kHeader.. hold
// config[kNHistory] history ids, oldest first). Writes tokens[step] = the token, the CPU
// Sampler's for the same inputs (-1 where it fails: no logit above -inf after penalties, or an
// id of the penalty window out of range), and tokens[k_total + step] = the bits of its
// log-probability under the raw logits (NaN as -inf): (raw[tok] - max) - log(sum exp(raw - max));
// where raw logits are +inf, 0 for those and -inf for the others; NaN without a token. The
// penalty history of this step is the config's ids followed by tokens[0, step) (tokens that
// earlier launches of a chain wrote); the draw index is config's draw (kDrawLo/Hi) + step. Two
// kernels, one block per 1024 ids. tokens[step + 1] (below k_total) becomes sample_word::kSkipped
// until the next step writes it; and with `next` (a conditional node's handle, 0 for none) the
// kernel sets that node's condition: 1 unless the token is -1 or one of config's stop ids.
void launch_sample(Launcher& l, const float* logits, int n_vocab, const int32_t* config,
                   int32_t* tokens, int step, int k_total, void* work,
                   cudaGraphConditionalHandle next = 0);
// The end of a round of a chain loop (Op::ChainLoop), one block: appends the round's k token
// words (tokens[0, k) and tokens[k_total, k_total + k)) to out (out[0]: the count so far), and
// unless one of them is negative or a stop id of config, or control's rounds are done, readies
// the next round: *first becomes the round's last token, each step's position and every KV
// record slot move on by k, config's draw by k, and the round's tokens join config's history
// (the newest history_cap kept). Sets `loop`'s condition to whether a next round runs, and the
// steps' (steps[1, k), their IF nodes' handles) to 0: each round's steps run only as its own
// samples allow. control (device I32 [2]): rounds left, then the tokens so far. With `host`
// (mapped host memory laid out as out), the round's words go there too, then the count, plus
// kLoopEnded when no next round runs; a nonzero *halt (mapped host memory, written by the host)
// ends the loop after the round.
constexpr int kMaxLoopSteps = 8;
struct ChainLoopArgs {
  const int32_t* tokens = nullptr;
  int32_t* config = nullptr;
  int32_t* first = nullptr;
  int32_t* positions[kMaxLoopSteps] = {};
  int32_t* record = nullptr;
  int32_t* control = nullptr;
  int32_t* out = nullptr;
  int32_t* host = nullptr;
  const int32_t* halt = nullptr;
  int k = 0, k_total = 0, history_cap = 0, capacity = 0;
  cudaGraphConditionalHandle loop = 0;
  cudaGraphConditionalHandle steps[kMaxLoopSteps] = {};
};
// Launches are compared byte by byte: no padding.
static_assert(sizeof(ChainLoopArgs) == (8 + kMaxLoopSteps) * sizeof(void*) + 4 * sizeof(int) +
                                           (1 + kMaxLoopSteps) * sizeof(cudaGraphConditionalHandle),
              "ChainLoopArgs has padding");
void launch_chain_loop_round(Launcher& l, const ChainLoopArgs& args);
// How a kernel hands a word to the host through mapped memory while it runs: kHostWordStore
// stores it at system scope after a system-scope fence (the writes before it first);
// kHostWordFenced fences again after it, kHostWordVolatile stores it as a volatile store between
// the two fences. chain_loop_round hands its count over the kLoopHostWord way.
enum HostWordWay : int { kHostWordStore = 0, kHostWordFenced = 1, kHostWordVolatile = 2 };
constexpr int kHostWordWays = 3;
constexpr HostWordWay kLoopHostWord = kHostWordFenced;
// How loop_words_late_rounds runs its rounds: kernels launched one after the other; a CUDA
// graph's WHILE node around the round's kernel alone; or a chain loop's shape as the graph
// executor captures it in patch mode (a WHILE node whose body holds conditional steps of
// programmatic launches, then the round's kernel).
enum class RoundsAs { kKernels, kWhileNode, kExecutorLoop };
// Test hook: `rounds` rounds run `as` given, each handing its number to the host the `way` way
// and then waiting (at most 100 ms) for a host thread to acknowledge it; returns the rounds whose
// acknowledgement did not come in time (0: the host saw every round while it ran), or -1 where
// the rounds did not all run.
int loop_words_late_rounds(int rounds, RoundsAs as, HostWordWay way);
// Test hook: for i < n, philox4x32_10 (sampling_math.h) of the counter first + i under seed into
// ours[4 i, 4 i + 4), and the (i + 1)-th curand4() of curand's Philox4_32_10 state initialized
// with (seed, 0, 4 first) into theirs (host arrays), both computed on the device. False, with
// nothing written, where the build had no curand headers.
bool philox_against_curand(uint64_t seed, uint64_t first, int n, uint32_t* ours, uint32_t* theirs);
// The K/V stores that may ride along with a q and k rope: rotated k rows and v's rows (as wide
// as k's) go to F16 caches at positions *first_row... (first_row points into the KV record), in
// caches of `rows` rows (a sliding-window ring wraps: ring_row).
struct RopeKvStore {
  void* k_cache = nullptr;
  const float* v = nullptr;
  void* v_cache = nullptr;
  const int32_t* first_row = nullptr;
  int rows = 0;
  // Each token into its sequence's rows of pools of sequences of `rows` rows (I32 [2 * n_tokens]:
  // sequences, then positions; first_row unused), as launch_kv_store's slots.
  const int32_t* slots = nullptr;
};
// Per-head RMS norms applied before the rotation (Qwen 3's and Gemma 3's q/k norms): each head
// of src (src1) is normalized over head_dim and multiplied by w0 (w1), head_dim values.
struct RopeHeadNorm {
  const float* w0 = nullptr;
  const float* w1 = nullptr;
  float eps = 0.0f;
};
// With src1 given, also rotates src1 (n_head1 heads, the same positions) into dst1: q and k in
// one launch; with kv given too, the K and V stores as well (dst1 may then be null: k rotated
// into the cache only); with norm, the head norms too (one token only: rope_norm_fits). table:
// the angles at positions [0, table_rows) (launch_rope_table), or none (worked out).
void launch_rope(Launcher& l, const float* src, const int32_t* pos, float* dst, int n_head,
                 int head_dim, int n_dims, int mode, float freq_base, int n_tokens,
                 const float* src1 = nullptr, float* dst1 = nullptr, int n_head1 = 0,
                 const RopeKvStore* kv = nullptr, const float* freq_factors = nullptr,
                 float freq_scale = 1.0f, const RopeHeadNorm* norm = nullptr,
                 const float2* table = nullptr, int table_rows = 0);
// The rope angles of every pair at positions [0, rows): table[p * (n_dims / 2) + i] is pair i's
// (sin, cos) at position p, rope_angle's bits. Filled once on `stream`, outside any capture, for
// the kernels that read angles instead of working them out (MatVecRope::table).
void launch_rope_table(float2* table, int rows, int n_dims, float freq_base, float freq_scale,
                       const float* freq_factors, cudaStream_t stream);
// Whether a rope launch of q (n_head heads) and k (n_head1) can take their head norms: one
// token, every pair in one block (w0 or w1 may be null: that tensor is not normalized).
constexpr int kRopeNormMaxPairs = 8192;
constexpr int kRopeNormMaxHeads = 256;
bool rope_norm_fits(int n_tokens, int n_head, int n_head1, int head_dim);
// Pair slots of such a launch: q's and k's rotation pairs, and v's pairs when the stores ride
// along.
int64_t rope_slots(int n_head, int head_dim, int n_head1, bool with_kv);
// Whether a two-tensor rope launch of this size runs a token a block, every read of the token's
// rows before any write (rope_token_fits): then an output may take the place of an input of
// the same row width (token t's rows are then the same bytes, in the same block); and whether
// it does every read before any write (rope_reads_first, one token): then its outputs may
// overlap its inputs in any way. Each of its threads keeps one pair of up to kRopeTokenSlots
// heads; rope_token_threads is its block size for n_heads heads (q's, k's and V's rows cut into
// heads).
constexpr int kRopeTokenSlots = 8;
constexpr int kRopeMaxHalfDim = 256;
bool rope_token_fits(int64_t slots, int head_dim);
bool rope_reads_first(int n_tokens, int64_t slots, int head_dim);
int rope_token_threads(int n_heads, int head_dim);
// Writes src0 into cache0 (and src1 into cache1 when src1 is given) at positions *first_row...
// (first_row points into the KV record) of caches of `rows` rows (ring_row); or, with slots
// (I32 [2 * n_tokens] on the device: each token's sequence, then its position), token t into
// its sequence's row of a pool of sequences of `rows` rows (first_row then unused).
// Rows of n_embd_kv values into an F16 or Q8_0 cache (Q8_0: ggml's blocks, quantized as the
// CPU quantizes them, bit for bit).
void launch_kv_store(Launcher& l, DType cache_type, const float* src0, void* cache0,
                     const float* src1, void* cache1, int64_t n_embd_kv, int n_tokens,
                     const int32_t* first_row, int rows, const int32_t* slots = nullptr);

// Activation preparation for quantized mat-vec: 8-bit blocks of 32 (qs, then per block d and
// d*sum(q) as float2), one column after another. Needs k % 32 == 0.
size_t act_q8_bytes(int64_t k, int64_t cols);
// Where the quants and the (d, d * sum(q)) pairs of such a workspace lie (nullptr: none).
struct ActQ8 {
  int8_t* qs = nullptr;
  float2* ds = nullptr;
  int64_t tiles_k = 0;  // the column tiles' row length (q8_index), 0 in the plain layout
};
ActQ8 act_q8(uint8_t* ws, int64_t k, int64_t cols);
void launch_quantize_act(Launcher& l, const float* x, int64_t k, int64_t cols, uint8_t* ws);
// The same 8-bit blocks in column tiles, the B fragments of an m16n8k32 mma (the warp-pipelined
// int8 product's form): tiles of 8 columns (columns past cols are zeros), in each tile per
// 32-block the 8 columns' 32 bytes, words in the order 0 4 1 5 2 6 3 7 (lane (g, t)'s fragment
// is 8 bytes at column g's 8 t), and the pairs [tile][block][column] as (d, d * sum).
size_t act_q8_tiles_bytes(int64_t k, int64_t cols);
ActQ8 act_q8_tiles(uint8_t* ws, int64_t k, int64_t cols);
// The form a producer (a norm, a glu, the decode attention) writes: tiles or plain.
ActQ8 act_q8_form(uint8_t* ws, int64_t k, int64_t cols, bool tiles);
void launch_quantize_act_tiles(Launcher& l, const float* x, int64_t k, int64_t cols, uint8_t* ws);
// Activation preparation for the tensor-core path: half (or bfloat16, for cuBLAS's products of
// BF16 weights), columns padded to kp = round_up(k, kActPad) with zeros.
constexpr int kActPad = 64;
constexpr GGRAPH_HD int64_t act_half_pitch(int64_t k) {
  return (k + kActPad - 1) / kActPad * kActPad;
}
size_t act_half_bytes(int64_t k, int64_t cols);
void launch_act_to_half(Launcher& l, const float* x, int64_t k, int64_t cols, uint8_t* ws,
                        bool bf16 = false);

// One weight matrix of a (possibly grouped) mat-vec: weights [k, n] and its output [n, cols].
struct MatVecPart {
  const void* w = nullptr;
  int64_t n = 0;
  float* dst = nullptr;
  // w is a model weight, never written after upload: the kernel may then load it before waiting
  // for the kernel before it (programmatic dependent launch), which may be what writes others.
  bool fixed = false;
};
// The norm before one column's quantized products, worked out by the products' kernel instead of
// a launch of its own: the activation is rms_norm(src + add) * w (add optional; eps; ne0
// values), each warp making its 8-bit blocks itself, bit for bit what launch_rms_norm and its
// quantization would leave in ws; one warp stores src + add to sum_out (optional). Only where
// mat_vec_folds_norm says the launch takes it; none of the launch's writes may overlap src or
// add. No padding: a launch's arguments compare bytewise from step to step.
struct NormFold {
  const float* src = nullptr;
  const float* add = nullptr;
  float* sum_out = nullptr;
  const float* w = nullptr;  // a model weight, one column of ne0
  float eps = 0.0f;
  int ne0 = 0;
};
static_assert(sizeof(NormFold) == 4 * sizeof(void*) + 8, "NormFold has no padding");
// Whether one column's products of k = ne0 values in format type (and type_b, for the other
// part of a launch_mat_vec_mixed or launch_mat_vec_rope pair; type itself otherwise) take a
// NormFold: k a multiple of 32 up to 1,024 (a lane a 32 of the activation, the norm's one-block
// kernel a thread a value), formats of 16 bytes of quants a 32, the register-resident kernel
// (its capacity measured, no shape forced), and the fold on (off unless GGRAPH_CUDA_NORM_FOLD=1
// or set_norm_fold turns it on).
bool mat_vec_folds_norm(DType type, DType type_b, int64_t k);
// Test hook: turns the fold on or off; returns the setting it replaced.
bool set_norm_fold(bool on);
bool norm_fold_enabled();
// Up to 3 weights of the same type and k that share one activation (q, k, v) in one launch.
// Quantized types read the 8-bit activation from ws (prepared by launch_quantize_act); float
// types read x directly. fold (one column): the activation from the norm before, as NormFold
// says, instead of ws.
void launch_mat_vec(Launcher& l, DType type, const MatVecPart* parts, int n_parts, int64_t k,
                    const float* x, const uint8_t* ws, int cols, const NormFold* fold = nullptr);
// One column of parts[0, n_a) (one or two) in format type_a and parts[n_a] in type_b, sharing
// the 8-bit activation in ws (q and k in one format, v in another, as K-quant mixes make them),
// in one launch. False, with nothing launched, where that pair of formats or that row length
// has no such kernel: the caller then launches them apart.
bool launch_mat_vec_mixed(Launcher& l, DType type_a, DType type_b, const MatVecPart* parts, int n_a,
                          int64_t k, const uint8_t* ws, const NormFold* fold = nullptr);
// The ropes and the K/V stores of one token in the epilogue of its q, k and v products (parts
// 0, 1 and 2 of one launch): pairs of adjacent rows of q and k rotate (the rope's normal mode;
// pairs past n_dims are copied) into q_out and k_out, as launch_rope rotates them, bit for bit;
// k's rotated rows and v's product go to the caches k_cache and v_cache at the row of position
// *first_row (ring_row over caches of `rows` rows). v's product is written to its part's dst as
// well; q's and k's products are not written at all. Q8_0 caches (q8_tickets set): k_out and v's
// dst hold the rows in F32, and the writer of the last pair of each 32 values (a ticket a group,
// left at zero) quantizes the group into its cache block with its warp, as kv_store does. No
// padding: a launch's arguments compare bytewise from step to step.
struct MatVecRope {
  const int32_t* pos = nullptr;  // the token's position (device)
  const float* freq_factors = nullptr;
  const int32_t* first_row = nullptr;
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  float* q_out = nullptr;
  float* k_out = nullptr;
  // Q8_0 caches: a ticket for each group of 32 values of k (first), then of v; null for F16.
  unsigned* q8_tickets = nullptr;
  int head_dim = 0, n_dims = 0, rows = 0;
  float freq_base = 0.0f, freq_scale = 1.0f;
  // 1: the register-resident rows kernels take a row pair's angle (from the table, or worked
  // out) while its loads are on their way, instead of after its sums (set by the launch: on
  // unless GGRAPH_CUDA_ROPE_ANGLE_EARLY=0). The block-shaped products keep theirs at the end:
  // early there measured 4% slower on the 7B shape (BENCHMARKS.md).
  int early_angle = 0;
  // Each pair's (sin, cos) at positions [0, table_rows), n_dims / 2 pairs a position, as
  // rope_angle gives them (launch_rope_table): a load instead of a few hundred double-precision
  // instructions. Positions past it, or no table, work the angle out.
  const float2* table = nullptr;
  int table_rows = 0;
  int v_tickets = 0;  // Q8_0: where v's tickets start (k's groups of 32)
};
static_assert(sizeof(MatVecRope) == 9 * sizeof(void*) + 8 * 4, "MatVecRope has no padding");
// One column of parts[0..2] (q, k, v; q and k in one quantized format, v in it too or in the
// other of a pair launch_mat_vec_mixed takes; or all three in one float format, F32, F16 or BF16,
// model weights whose float activation is x; q's and k's rows whole heads, v's even in number) with
// the rope epilogue. False, with nothing launched, where the formats or a forced kernel shape have
// no such kernel, or GGRAPH_CUDA_ROPE_EPILOGUE=0 (set_rope_epilogue) turned it off: the caller then
// launches the products and the ropes apart.
bool launch_mat_vec_rope(Launcher& l, DType type, DType v_type, const MatVecPart* parts, int64_t k,
                         const uint8_t* ws, const MatVecRope& rope, const NormFold* fold = nullptr,
                         const float* x = nullptr);
// Test hook: turns the rope epilogue on or off (the default: on, unless
// GGRAPH_CUDA_ROPE_EPILOGUE=0); returns the setting it replaced.
bool set_rope_epilogue(bool on);
// Test hook: caps the warps of a launch of the register-resident mat-vec kernels (0: as many as
// the device holds at once), so that they walk their rows in several passes; returns the cap it
// replaced.
int set_rows_kernel_warp_cap(int cap);
// Test hook: the rope epilogue's angles early (MatVecRope::early_angle) or not; returns the
// setting it replaced.
bool set_rope_angle_early(bool on);
// Whether rope launches and the rope epilogue take their angles from the backend's tables
// (RopeTable; on unless GGRAPH_CUDA_ROPE_TABLE=0) or work them out. Test hook: sets it,
// returns the setting it replaced.
bool set_rope_table(bool on);
bool rope_table_enabled();
bool rope_epilogue_enabled();
// The same epilogue for several tokens on the warp-pipelined products (MatMulQRope): on unless
// GGRAPH_CUDA_WARP_ROPE_EPILOGUE=0 (or this test hook, which returns the setting it replaced),
// and then only with the one above on.
bool set_warp_rope_epilogue(bool on);
bool warp_rope_epilogue_enabled();
// The gated unit in the epilogue of one column's gate and up products (parts 0 and 1 of one
// launch, one quantized format, n rows each, n a multiple of 32): dst[i] = act(gate[i]) * up[i]
// (act kGluSilu or kGluGelu, glu_value), and with qs set its 8-bit blocks at qs/ds (plain
// layout), bit for bit what the products, launch_glu and its quantization leave. The products
// themselves are not written. qs must not be the activation ws the products read: blocks that
// finish early write it while others still read theirs. No padding: a launch's arguments
// compare bytewise from step to step.
struct MatVecGlu {
  float* dst = nullptr;
  int8_t* qs = nullptr;
  float2* ds = nullptr;
  int act = 0;
  int unused = 0;
};
static_assert(sizeof(MatVecGlu) == 3 * sizeof(void*) + 8, "MatVecGlu has no padding");
// Launches it for rows of up to 64 pieces (the register-resident mat-vec's); false, with nothing
// launched, for longer rows, a forced kernel shape, or where GGRAPH_CUDA_GLU_EPILOGUE=0
// (set_glu_epilogue) turned it off: the caller then launches the products and the glu apart.
bool launch_mat_vec_glu(Launcher& l, DType type, const MatVecPart* parts, int64_t k,
                        const uint8_t* ws, const MatVecGlu& glu);
// Test hook: turns the glu epilogue on or off (the default: on, unless
// GGRAPH_CUDA_GLU_EPILOGUE=0); returns the setting it replaced.
bool set_glu_epilogue(bool on);
// The quantized mat-vec's shape: rows a warp owns (with the ksplit warps sharing them), 16-byte
// pieces of each row in flight per lane, warps splitting k. rows 0 picks them from the weight
// format and row length; benchmarks and tests set others.
struct MatVecConfig {
  int rows = 0;
  int unroll = 0;
  int ksplit = 1;  // warps of a block sharing rows, each over part of k
  // How a launch overlaps the one before it (programmatic dependent launch), -1 for the default:
  // bit 0, the first weights are loaded before waiting for it; bit 1, the next grid may launch
  // as soon as this one starts (otherwise once every block has streamed its rows).
  int overlap = -1;
};
void set_mat_vec_config(MatVecConfig c);
// Quantized weights live in the split layout of cuda/weight_layout.h: converts n GGUF blocks at
// src (device memory), blocks first.. of a matrix of n_blocks, into it at dst.
void launch_split_weight(DType type, const uint8_t* src, uint8_t* dst, int64_t first, int64_t n,
                         int64_t n_blocks, cudaStream_t stream);
// Once per process before any launch: raises the shared memory limit of the kernels that
// need more than 48 KiB (never during a stream capture).
void prepare_kernels();
// Whether the environment leaves the switch `name` on: unset, or set to anything but "0" (the
// GGRAPH_CUDA_* settings that turn a path off to measure or test without it).
bool env_switch_on(const char* name);
// The integer the environment variable `name` holds where it lies in [lo, hi]; fallback where it
// is unset, not a number or out of range (the settings that measurements vary).
int env_int(const char* name, int lo, int hi, int fallback);
// Whether to launch with programmatic dependent launch on this GPU: sm_90 or newer, kernels
// built to begin with griddepcontrol.wait (sm_90 code), and not GGRAPH_CUDA_PDL=0 (to compare).
bool use_programmatic_launch(const cudaDeviceProp& prop);
// Rows [row0, row0 + rows) of a quantized weight [k, n] decoded to half at out, rows
// act_half_pitch(k) apart (zeros past k): cuBLAS's operand for prompt products (blas.h).
// dequant_chunk_rows(k) rows at a time fit kDequantChunkBytes.
constexpr size_t kDequantChunkBytes = size_t(64) << 20;
inline int64_t dequant_chunk_rows(int64_t k) {
  const int64_t r = static_cast<int64_t>(kDequantChunkBytes / (act_half_pitch(k) * 2));
  return r > 0 ? r : 1;
}
void launch_dequant_half(Launcher& l, DType type, const void* w, int64_t n, int64_t k, int64_t row0,
                         int64_t rows, uint8_t* out);
// Tensor-core tiled product for cols > kMatVecMaxCols; activations from launch_act_to_half.
void launch_mat_mul_tc(Launcher& l, DType type, const void* w, int64_t n, int64_t k,
                       const uint8_t* ws, int cols, float* dst);

// Quantized products of a few columns (decode batches) on the tensor cores (cuda/matmul_q.cu),
// for Q4_0, Q4_1, Q8_0 and Q4_K weights, k a multiple of 64, 2 to kMatMulQMaxCols columns, by
// one of three kernels: Int8 (mma on the quants against the 8-bit activation of
// launch_quantize_act in ws), Int8Warp (the same mma, each warp streaming its own weights, up to
// 16 columns, against the activation of launch_quantize_act_tiles in ws) or Half (the weights
// decoded to half in registers, against the activation of launch_act_to_half in ws).
// mat_mul_q_kind says which takes a product, by default
// where it measured faster than the mat-vec and cuBLAS paths (matmul_q.cu says where), None for
// neither. Products of few row blocks split k: they need partials and counters (zeroed once; the
// kernel leaves them at zero) of the sizes below, 0 where they do not split.
// GGRAPH_CUDA_MMQ=0 turns them off; =int8 (or =all), =warp and =half send every product they can
// take to one of them.
// One launch may take up to kMatMulQMaxParts products of one activation whose weights share a
// format and k (q, k and v; gate and up): a grid over all their row blocks, k split as for one
// product of all their rows, each part's partials after the one before it.
constexpr int kMatMulQMaxCols = 64;
constexpr int kMatMulQMaxParts = 3;
enum class MatMulQ { None, Int8, Half, Int8Warp };
MatMulQ mat_mul_q_kind(DType type, int64_t k, int64_t cols);
struct MatMulQPart {
  const void* w;  // n rows of k, split layout
  int64_t n;
  float* dst;  // n x cols
};
size_t mat_mul_q_partials_bytes(DType type, const int64_t* n, int n_parts, int64_t k, int64_t cols);
size_t mat_mul_q_counters_bytes(DType type, const int64_t* n, int n_parts, int64_t k, int64_t cols);
// The most rotated dimensions MatMulQRope takes (the warp kernel's table of the pairs'
// frequencies).
constexpr int kQwRopeMaxDims = 256;
// The rope epilogue of a few tokens' q, k and v products (parts 0, 1 and 2, q's and k's rows
// whole heads) on the warp-pipelined kernel: q rotated (normal mode) into q_out, k rotated into
// the F16 K cache only, v into its product's output and the F16 V cache, each token t (column)
// at position pos[t] and cache row kv_store_row(first_row, slots, t, n_tokens, rows), with the
// rope and K/V store kernels' bits. launch_mat_mul_q takes it for Int8Warp products only.
struct MatMulQRope {
  const int32_t* pos = nullptr;
  const float* freq_factors = nullptr;
  const int32_t* first_row = nullptr;  // one sequence: the first row (KV record), or
  const int32_t* slots = nullptr;      // a decode batch's sequences (kv_store_row)
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  float* q_out = nullptr;
  int head_dim = 0, n_dims = 0, rows = 0, n_tokens = 0;
  float freq_base = 0.0f, freq_scale = 1.0f;
  const float2* table = nullptr;  // the angles at positions [0, table_rows), as MatVecRope's
  int table_rows = 0;
  int unused = 0;  // keeps the struct free of padding
};
static_assert(sizeof(MatMulQRope) == 8 * sizeof(void*) + 8 * 4, "MatMulQRope has no padding");
void launch_mat_mul_q(Launcher& l, DType type, const MatMulQPart* parts, int n_parts, int64_t k,
                      const uint8_t* ws, int cols, float* partials, unsigned* counters,
                      const MatMulQRope* rope = nullptr);
// Test hook: one kernel for every product it can take, or (None) the default choice.
void set_mat_mul_q_everywhere(MatMulQ kind);
// The shared memory a block of the current device may opt into (or the test hook's stand-in).
size_t max_block_smem();
// Test hook: plan products and attention as if a block could take at most `bytes` of shared
// memory (the narrow tiles, short tiles and refusals of sm_86 and sm_89 on a larger GPU); 0
// restores the device's limit.
void set_block_smem_limit(size_t bytes);
// Shared-memory limits of its kernels (prepare_kernels calls it).
void prepare_mat_mul_q_kernels();

// Attention: q [n_head*head_dim, T] F32; caches F16 rows of n_head_kv*head_dim; out like q.
// The grid depends on n_tokens and the cache size only. With n_kv_at and first_pos_at (pointers
// into the KV record: graph steps) the kernels read n_kv and first_pos there, so their arguments
// stay the same from step to step; without (a launch outside a graph step, as the kernel
// benchmark makes), they take them by value. Decode batches (n_tokens <= kDecodeAttnMaxTokens)
// need partials (attn_partials_bytes) and counters (attn_counters_bytes, zeroed once: the
// kernel leaves them at zero). quant_ws (the decode kernels, head_dim a multiple of 32): also the
// output's 8-bit form (the layout of launch_quantize_act, or with quant_tiles the column tiles of
// launch_quantize_act_tiles).
struct AttentionArgs {
  const float* q = nullptr;
  const void* k_cache = nullptr;
  const void* v_cache = nullptr;
  float* out = nullptr;
  int n_head = 0, n_head_kv = 0, head_dim = 0;
  float scale = 1.0f;
  int n_tokens = 0;
  int32_t n_kv = 0, first_pos = 0;
  int cache_rows = 0;  // rows the caches hold (n_ctx, or a sliding-window ring's)
  bool ring = false;   // position p in row p % cache_rows (Graph::kv_cache)
  // Each token over its own sequence (Graph::attention_seqs): I32 [2 * n_tokens] on the device,
  // each token's sequence, then its position; the caches are pools of sequences of cache_rows
  // rows. n_kv and first_pos are then unused.
  const int32_t* slots = nullptr;
  const int32_t* n_kv_at = nullptr;
  const int32_t* first_pos_at = nullptr;
  float* partials = nullptr;
  unsigned* counters = nullptr;
  uint8_t* quant_ws = nullptr;
  bool quant_tiles = false;
  uint8_t* half_ws = nullptr;  // the output's half form too (decode kernels; launch_act_to_half's)
  int window = 0;              // sliding window (0: none)
  DType kv_type = DType::F16;  // F16, or Q8_0 blocks (head_dim a multiple of 64)
};
void launch_attention(Launcher& l, const AttentionArgs& args);
// Raises the decode kernels' shared memory limit (part of prepare_kernels).
void prepare_attention_kernels();
// Query heads per flash-decoding block, and the most keys a launch reads.
int attention_group(int n_head, int n_head_kv, int head_dim);
int attention_max_keys(const AttentionArgs& args);
// Whether decode batches of this head size run on tensor cores (q and the probabilities each as
// two halves, float-exact like the lanes), rather than on lanes' float dot products.
bool decode_attention_mma(int head_dim);
// Test hook: whether decode batches of few KV heads may take the cluster kernel (sm_90+; on by
// default where it fits). Returns the setting before.
bool set_decode_attention_cluster(bool on);
// Whether this GPU runs the cluster decode kernel (an sm_90 build on sm_90 or later).
bool decode_attention_clusters();
// seqs: tokens of sequences of their own (AttentionArgs::slots), which take the decode kernels
// at any count.
size_t attn_partials_bytes(int n_head, int head_dim, int n_tokens, bool seqs = false);
size_t attn_counters_bytes(int n_head, int n_tokens, bool seqs = false);

}  // namespace ggraph::cuda
