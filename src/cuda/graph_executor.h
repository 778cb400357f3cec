// GraphExecutor: runs one step's kernels eagerly or through a CUDA graph. In patch mode (the
// default) a step whose launches match the cached executable's in everything but argument
// values patches exactly those kernel nodes in place and replays; a changed topology is captured
// again and applied with cudaGraphExecUpdate. The backend's kernels read the KV position from a
// device record that the step's first kernel writes, so a decode step patches that one node.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "cuda/launch.cuh"

namespace ggraph::cuda {

enum class GraphMode { Off, Recapture, Update, Patch };
GraphMode parse_graph_mode(const std::string& name);  // throws ArgumentError

struct GraphStats {
  double captures = 0, instantiations = 0, exec_updates = 0, update_failures = 0;
  double kernel_nodes_patched = 0, replays = 0, eager_evals = 0;
  double capture_ms_total = 0;
  double steps = 0, host_us_total = 0;
  // Where patch mode's host time goes: graph build and planning (reported by the caller),
  // the input copy (the caller's), the record pass over the step's launches, the node patches
  // and cudaGraphLaunch.
  double build_us_total = 0, input_us_total = 0, record_us_total = 0, patch_us_total = 0;
  double launch_us_total = 0;
  // Tokens the steps computed (a sampled chain's steps, a batch's tokens) and kernels they ran.
  double tokens = 0, kernels = 0;
  // Steps of sampled chains skipped after a stop id (conditional nodes); not in tokens.
  double chain_steps_skipped = 0;
  // The host's looks at chain loops' words while they ran, the tokens it took from them before
  // their loops had ended, and the times it stopped looking to wait for a loop's end
  // (Backend::add_loop_looks).
  double loop_looks = 0, loop_tokens_streamed = 0, loop_looks_given_up = 0;
};

class GraphExecutor {
 public:
  using LaunchAll = std::function<void(Launcher&)>;

  // pdl: launch kernels with programmatic stream serialization (see Launcher::pdl).
  GraphExecutor(cudaStream_t stream, GraphMode mode, bool debug, bool pdl);
  ~GraphExecutor();
  GraphExecutor(const GraphExecutor&) = delete;
  GraphExecutor& operator=(const GraphExecutor&) = delete;

  // Issues the step's kernels on the stream. `key` names the topology class (batch shape);
  // launch_all must issue the same kernels in the same order whenever it is called for a step.
  // node_names maps a launch's graph-node index (-1: none) to a name for debug messages.
  // launch_kv, when given, promises that launch_all would issue what the last step with this key
  // issued but for the arguments of its first launches, which launch_kv issues alone. Then
  // (patch mode, outside debug mode) only those are recorded and patched: no walk of the graph.
  void run(uint64_t key, const LaunchAll& launch_all,
           const std::function<std::string(int)>& node_names, const LaunchAll& launch_kv = {});

  GraphMode mode() const { return mode_; }
  // Whether run() makes chain loops WHILE nodes: where it has conditional steps (gate_).
  bool runs_loops() const { return gate_; }
  const GraphStats& stats() const { return stats_; }
  // Captures and replays by topology class (run's key).
  struct KeyStats {
    double captures = 0, replays = 0;
  };
  const std::map<uint64_t, KeyStats>& key_stats() const { return key_stats_; }
  void reset_stats() {
    stats_ = GraphStats();
    key_stats_.clear();
  }
  GraphStats& mutable_stats() { return stats_; }
  // A loop's rounds: the launches of the last run of `key` but the first (outside the loop, the
  // KV record's) ran `rounds` times, not once.
  void count_rounds(uint64_t key, int rounds) {
    auto it = cache_.find(key);
    if (it != cache_.end() && rounds > 1 && !it->second.launches.empty())
      stats_.kernels += double(rounds - 1) * double(it->second.launches.size() - 1);
  }
  size_t cached_graphs() const { return cache_.size(); }
  // Drops every executable: the next step of each shape captures again. For buffers that nodes
  // the executor does not record (cuBLAS's) read: patching would leave those at old addresses.
  void forget_all();
  // The graph behind the executable that ran last (nullptr before any capture), brought in
  // step with every patch applied to the executable.
  cudaGraph_t current_graph();
  void dump_dot(const std::string& path);
  // Testing hook: the next patch writes a wrong value, which debug mode must catch.
  void corrupt_next_patch() { corrupt_next_patch_ = true; }

 private:
  struct Entry {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    std::vector<KernelLaunch> launches;
    std::vector<cudaGraphNode_t> nodes;
    std::vector<uint8_t> stale;  // node's parameters in `graph` lag behind the executable's
    // The handles of a sampled chain's conditional steps, by step (0 for step 0), where the
    // capture made them (StepGate).
    std::vector<cudaGraphConditionalHandle> handles;
    uint64_t last_used = 0;
  };
  class CaptureGate;
  class ReplayGate;

  void run_mode(uint64_t key, const LaunchAll& launch_all,
                const std::function<std::string(int)>& node_names, const LaunchAll& launch_kv);
  // The patch step of a graph known unchanged but for the launches launch_kv issues; false if
  // those do not fit the executable (another function, grid or argument layout).
  bool patch_kv_launches(Entry& e, const LaunchAll& launch_kv);
  // With handles: a sampled chain's steps become conditional nodes, their handles into it.
  void capture(const LaunchAll& launch_all, cudaGraph_t* graph, std::vector<KernelLaunch>* launches,
               std::vector<cudaGraphNode_t>* nodes,
               std::vector<cudaGraphConditionalHandle>* handles = nullptr);
  void instantiate(Entry& e);
  void release(Entry& e);
  // Applies a freshly captured graph to an entry's executable; instantiates anew if refused.
  // Takes the capture's launches and nodes (swapped out of the arguments).
  void update_or_instantiate(Entry& e, cudaGraph_t graph, std::vector<KernelLaunch>& launches,
                             std::vector<cudaGraphNode_t>& nodes,
                             std::vector<cudaGraphConditionalHandle>& handles);
  // Records the launches that `launches` issues into recorded_, without issuing them; with the
  // conditional steps' handles of the executable it is compared with, where it has them.
  void record_step(const LaunchAll& launches, const Entry* with = nullptr);
  // Patches the kernel nodes whose arguments differ from recorded_ (all launches recorded);
  // false if the driver refused a patch (the executable must then be captured again).
  bool patch(Entry& e);
  cudaError_t patch_node(Entry& e, size_t i, const KernelLaunch& want);
  void sync_graph(Entry& e);
  void check_nodes(const Entry& e, const std::function<std::string(int)>& node_names) const;
  void launch(Entry& e);
  Entry& entry_for(uint64_t key);

  cudaStream_t stream_;
  GraphMode mode_;
  bool debug_;
  bool pdl_;
  bool corrupt_next_patch_ = false;
  GraphStats stats_;
  std::map<uint64_t, KeyStats> key_stats_;
  uint64_t key_ = 0;  // the class of the step being run
  std::unordered_map<uint64_t, Entry> cache_;
  Entry* current_ = nullptr;
  uint64_t clock_ = 0;
  std::vector<KernelLaunch> recorded_;  // this step's launches, reused between steps
  std::vector<KernelLaunch> captured_;  // a fresh capture's launches and nodes
  std::vector<cudaGraphNode_t> captured_nodes_;
  std::vector<cudaGraphConditionalHandle> captured_handles_;
  // Conditional steps and chain loops (patch and recapture modes, where the driver has
  // conditional nodes and GGRAPH_CUDA_CHAIN_GATE is not 0), and the streams a step's body and a
  // loop's body are captured on.
  bool gate_ = false;
  cudaStream_t body_stream_ = nullptr, loop_stream_ = nullptr;
  static constexpr size_t kMaxCached = 8;
};

}  // namespace ggraph::cuda
