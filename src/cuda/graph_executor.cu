#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>

#include "common.h"
#include "cuda/graph_executor.h"
#include "cuda/kernels.cuh"  // env_int

namespace ggraph::cuda {

cudaGraph_t StepGate::add_conditional_node(cudaGraph_t graph, const cudaGraphNode_t* deps,
                                           size_t n_deps, cudaGraphConditionalHandle h,
                                           cudaGraphConditionalNodeType type,
                                           cudaGraphNode_t* node) {
  cudaGraphNodeParams p = {};
  p.type = cudaGraphNodeTypeConditional;
  p.conditional.handle = h;
  p.conditional.type = type;
  p.conditional.size = 1;
  cudaGraphNode_t added = nullptr;
  GGRAPH_CUDA_CHECK(cudaGraphAddNode(&added, graph, deps, nullptr, n_deps, &p));
  if (node) *node = added;
  return p.conditional.phGraph_out[0];
}

GraphMode parse_graph_mode(const std::string& name) {
  if (name == "off") return GraphMode::Off;
  if (name == "recapture") return GraphMode::Recapture;
  if (name == "update") return GraphMode::Update;
  if (name == "patch") return GraphMode::Patch;
  throw ArgumentError("cuda_graphs: expected 'off', 'recapture', 'update' or 'patch', got '" +
                      name + "'");
}

// Capture: each conditional step of a sampled chain becomes an IF node of the graph being
// captured, after everything captured before it, and its kernels go into the node's body graph,
// captured on a stream of its own; the steps' nodes follow one another.
class GraphExecutor::CaptureGate : public StepGate {
 public:
  CaptureGate(cudaStream_t stream, cudaStream_t body_stream, cudaStream_t loop_stream,
              std::vector<cudaGraphConditionalHandle>* handles)
      : stream_(stream), body_stream_(body_stream), loop_stream_(loop_stream), handles_(handles) {
    cudaStreamCaptureStatus status;
    GGRAPH_CUDA_CHECK(cudaStreamGetCaptureInfo(stream_, &status, nullptr, &graph_));
    outer_ = stream_;
    outer_graph_ = graph_;
  }
  ~CaptureGate() override {
    // An exception left bodies open: end them, discarding what they captured.
    cudaGraph_t body = nullptr;
    if (open_) cudaStreamEndCapture(body_stream_, &body);
    if (looping_) cudaStreamEndCapture(loop_stream_, &body);
    cudaGetLastError();
  }
  cudaGraphConditionalHandle handle(int step) override {
    if (step <= 0) return 0;
    if (size_t(step) >= handles_->size()) handles_->resize(size_t(step) + 1, 0);
    cudaGraphConditionalHandle& h = (*handles_)[size_t(step)];
    // 0 at each launch of the graph until the step before sets it (a handle serves one node).
    if (!h)
      GGRAPH_CUDA_CHECK(
          cudaGraphConditionalHandleCreate(&h, graph_, 0, cudaGraphCondAssignDefault));
    return h;
  }
  void open(Launcher& l, int step) override {
    const cudaGraphConditionalHandle h = handle(step);
    close();
    const cudaGraph_t body = add_conditional(outer_, outer_graph_, h, cudaGraphCondTypeIf);
    GGRAPH_CUDA_CHECK(cudaStreamBeginCaptureToGraph(body_stream_, body, nullptr, nullptr, 0,
                                                    cudaStreamCaptureModeThreadLocal));
    open_ = true;
    l.stream = body_stream_;
  }
  cudaGraphConditionalHandle loop_handle() override {
    if (handles_->empty()) handles_->resize(1, 0);
    cudaGraphConditionalHandle& h = (*handles_)[0];
    // 1 at each launch of the graph: the loop's first round runs.
    if (!h)
      GGRAPH_CUDA_CHECK(
          cudaGraphConditionalHandleCreate(&h, graph_, 1, cudaGraphCondAssignDefault));
    return h;
  }
  void open_loop(Launcher& l) override {
    if (looping_) throw std::logic_error("CaptureGate: a loop inside a loop");
    close();
    const cudaGraph_t body =
        add_conditional(stream_, graph_, loop_handle(), cudaGraphCondTypeWhile);
    GGRAPH_CUDA_CHECK(cudaStreamBeginCaptureToGraph(loop_stream_, body, nullptr, nullptr, 0,
                                                    cudaStreamCaptureModeThreadLocal));
    looping_ = true;
    outer_ = loop_stream_;
    outer_graph_ = body;
    l.stream = loop_stream_;
  }
  void end_steps(Launcher& l) override {
    close();
    l.stream = outer_;
  }
  void close_loop(Launcher& l) override {
    close();
    if (looping_) {
      looping_ = false;
      cudaGraph_t body = nullptr;
      GGRAPH_CUDA_CHECK(cudaStreamEndCapture(loop_stream_, &body));
    }
    outer_ = stream_;
    outer_graph_ = graph_;
    l.stream = stream_;
  }
  // Ends the capture of the step body in progress.
  void close() {
    if (!open_) return;
    open_ = false;
    cudaGraph_t body = nullptr;
    GGRAPH_CUDA_CHECK(cudaStreamEndCapture(body_stream_, &body));
  }
  // Ends every body in progress.
  void finish(Launcher& l) { close_loop(l); }

 private:
  // A conditional node after what `stream` (capturing into `graph`) has captured so far, which
  // the stream's next launches then follow; its body graph.
  static cudaGraph_t add_conditional(cudaStream_t stream, cudaGraph_t graph,
                                     cudaGraphConditionalHandle h,
                                     cudaGraphConditionalNodeType type) {
    cudaStreamCaptureStatus status;
    const cudaGraphNode_t* deps = nullptr;
    size_t n_deps = 0;
    GGRAPH_CUDA_CHECK(
        cudaStreamGetCaptureInfo(stream, &status, nullptr, nullptr, &deps, nullptr, &n_deps));
    cudaGraphNode_t node = nullptr;
    const cudaGraph_t body = add_conditional_node(graph, deps, n_deps, h, type, &node);
    GGRAPH_CUDA_CHECK(cudaStreamUpdateCaptureDependencies(stream, &node, nullptr, 1,
                                                          cudaStreamSetCaptureDependencies));
    return body;
  }

  cudaStream_t stream_, body_stream_, loop_stream_;
  std::vector<cudaGraphConditionalHandle>* handles_;
  cudaGraph_t graph_ = nullptr;
  // Where the steps' IF nodes go: the graph's stream, or within a loop the loop body's.
  cudaStream_t outer_ = nullptr;
  cudaGraph_t outer_graph_ = nullptr;
  bool open_ = false, looping_ = false;
};

// Recording a step to compare it with an executable: the handles that executable's steps read.
class GraphExecutor::ReplayGate : public StepGate {
 public:
  explicit ReplayGate(const std::vector<cudaGraphConditionalHandle>& handles) : handles_(handles) {}
  cudaGraphConditionalHandle handle(int step) override {
    return step > 0 && size_t(step) < handles_.size() ? handles_[size_t(step)] : 0;
  }
  void open(Launcher&, int) override {}
  cudaGraphConditionalHandle loop_handle() override { return handles_.empty() ? 0 : handles_[0]; }
  void open_loop(Launcher&) override {}
  void end_steps(Launcher&) override {}
  void close_loop(Launcher&) override {}

 private:
  const std::vector<cudaGraphConditionalHandle>& handles_;
};

// Whether the driver makes conditional nodes (CUDA 12.4 and newer drivers).
static bool conditional_nodes_work() {
  cudaGraph_t g = nullptr;
  if (cudaGraphCreate(&g, 0) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  cudaGraphConditionalHandle h = 0;
  const bool ok = cudaGraphConditionalHandleCreate(&h, g, 0, 0) == cudaSuccess;
  cudaGetLastError();
  cudaGraphDestroy(g);
  return ok;
}

GraphExecutor::GraphExecutor(cudaStream_t stream, GraphMode mode, bool debug, bool pdl)
    : stream_(stream), mode_(mode), debug_(debug), pdl_(pdl) {
  recorded_.reserve(4096);
  // Update mode captures every step anew, and an executable's conditional nodes cannot take
  // another capture's handles: it would instantiate every chain.
  gate_ = (mode == GraphMode::Patch || mode == GraphMode::Recapture) &&
          env_int("GGRAPH_CUDA_CHAIN_GATE", 0, 1, 1) == 1 && conditional_nodes_work();
  if (gate_) {
    GGRAPH_CUDA_CHECK(cudaStreamCreateWithFlags(&body_stream_, cudaStreamNonBlocking));
    GGRAPH_CUDA_CHECK(cudaStreamCreateWithFlags(&loop_stream_, cudaStreamNonBlocking));
  }
}

GraphExecutor::~GraphExecutor() {
  for (auto& kv : cache_) release(kv.second);
  if (body_stream_) cudaStreamDestroy(body_stream_);
  if (loop_stream_) cudaStreamDestroy(loop_stream_);
}

void GraphExecutor::forget_all() {
  for (auto& kv : cache_) release(kv.second);
  cache_.clear();
  current_ = nullptr;
}

void GraphExecutor::release(Entry& e) {
  if (e.exec) cudaGraphExecDestroy(e.exec);
  if (e.graph) cudaGraphDestroy(e.graph);
  e.exec = nullptr;
  e.graph = nullptr;
  e.handles.clear();
}

void GraphExecutor::capture(const LaunchAll& launch_all, cudaGraph_t* graph,
                            std::vector<KernelLaunch>* launches,
                            std::vector<cudaGraphNode_t>* nodes,
                            std::vector<cudaGraphConditionalHandle>* handles) {
  const auto t0 = std::chrono::steady_clock::now();
  launches->clear();
  nodes->clear();
  if (handles) handles->clear();
  GGRAPH_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  Launcher L;
  L.stream = stream_;
  L.pdl = pdl_;
  L.execute = true;
  L.record = launches;
  L.captured_nodes = nodes;
  try {
    std::unique_ptr<CaptureGate> steps;
    if (handles) {
      steps = std::make_unique<CaptureGate>(stream_, body_stream_, loop_stream_, handles);
      L.gate = steps.get();
    }
    launch_all(L);
    if (steps) steps->finish(L);
  } catch (...) {
    cudaGraph_t broken = nullptr;
    cudaStreamEndCapture(stream_, &broken);
    if (broken) cudaGraphDestroy(broken);
    cudaGetLastError();
    throw;
  }
  GGRAPH_CUDA_CHECK(cudaStreamEndCapture(stream_, graph));
  stats_.captures += 1;
  key_stats_[key_].captures += 1;
  stats_.capture_ms_total +=
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

void GraphExecutor::instantiate(Entry& e) {
  GGRAPH_CUDA_CHECK(cudaGraphInstantiate(&e.exec, e.graph, 0));
  stats_.instantiations += 1;
}

static void set_kernel_params(KernelLaunch& k, cudaKernelNodeParams* p, void** ptrs) {
  k.fill_param_ptrs(ptrs);
  *p = {};
  p->func = const_cast<void*>(k.func);
  p->gridDim = k.grid;
  p->blockDim = k.block;
  p->sharedMemBytes = static_cast<unsigned>(k.smem);
  p->kernelParams = ptrs;
}

void GraphExecutor::update_or_instantiate(Entry& e, cudaGraph_t graph,
                                          std::vector<KernelLaunch>& launches,
                                          std::vector<cudaGraphNode_t>& nodes,
                                          std::vector<cudaGraphConditionalHandle>& handles) {
  // An executable's conditional nodes keep their handles through an update, while the new
  // capture's kernels name its own: such a graph is instantiated anew.
  if (e.exec && e.launches.size() == launches.size() && handles.empty() && e.handles.empty()) {
    cudaGraphExecUpdateResultInfo info;
    if (cudaGraphExecUpdate(e.exec, graph, &info) == cudaSuccess) {
      stats_.exec_updates += 1;
      // The executable keeps the nodes it was instantiated from: later patches must name those,
      // so the new capture is dropped and the instantiation graph marked for catching up.
      for (size_t i = 0; i < launches.size(); ++i)
        if (!launches[i].same_shape(e.launches[i]) || !launches[i].same_args(e.launches[i]))
          e.stale[i] = 1;
      cudaGraphDestroy(graph);
      e.launches.swap(launches);
      return;
    }
    cudaGetLastError();  // a refused update is an ordinary outcome, not a sticky error
    stats_.update_failures += 1;
  } else if (e.exec) {
    stats_.update_failures += 1;  // a different number of kernels cannot be updated
  }
  release(e);
  e.graph = graph;
  e.launches.swap(launches);
  e.nodes.swap(nodes);
  e.handles.swap(handles);
  e.stale.assign(e.nodes.size(), 0);
  instantiate(e);
}

void GraphExecutor::sync_graph(Entry& e) {
  // Keeps the captured graph in step with the executable, so that what it shows is what runs.
  void* ptrs[KernelLaunch::kMaxArgs];
  cudaKernelNodeParams p;
  for (size_t i = 0; i < e.stale.size(); ++i) {
    if (!e.stale[i]) continue;
    set_kernel_params(e.launches[i], &p, ptrs);
    GGRAPH_CUDA_CHECK(cudaGraphKernelNodeSetParams(e.nodes[i], &p));
    e.stale[i] = 0;
  }
}

cudaGraph_t GraphExecutor::current_graph() {
  if (!current_ || !current_->graph) return nullptr;
  sync_graph(*current_);
  return current_->graph;
}

GraphExecutor::Entry& GraphExecutor::entry_for(uint64_t key) {
  auto it = cache_.find(key);
  if (it != cache_.end()) return it->second;
  if (cache_.size() >= kMaxCached) {  // evict the least recently used topology
    auto victim = cache_.begin();
    for (auto i = cache_.begin(); i != cache_.end(); ++i)
      if (i->second.last_used < victim->second.last_used) victim = i;
    if (current_ == &victim->second) current_ = nullptr;
    release(victim->second);
    cache_.erase(victim);
  }
  return cache_[key];
}

static bool same_topology(const std::vector<KernelLaunch>& a, const std::vector<KernelLaunch>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!a[i].same_shape(b[i])) return false;
  return true;
}

void GraphExecutor::record_step(const LaunchAll& launches, const Entry* with) {
  recorded_.clear();
  Launcher L;
  L.stream = stream_;
  L.pdl = pdl_;
  L.execute = false;
  L.record = &recorded_;
  std::optional<ReplayGate> steps;
  if (with && !with->handles.empty()) {
    steps.emplace(with->handles);
    L.gate = &*steps;
  }
  launches(L);
}

cudaError_t GraphExecutor::patch_node(Entry& e, size_t i, const KernelLaunch& want) {
  KernelLaunch applied = want;
  if (corrupt_next_patch_) {
    applied.args[0] ^= 0x40;  // flips a bit of the first argument
    corrupt_next_patch_ = false;
  }
  void* ptrs[KernelLaunch::kMaxArgs];
  cudaKernelNodeParams p;
  set_kernel_params(applied, &p, ptrs);
  const cudaError_t err = cudaGraphExecKernelNodeSetParams(e.exec, e.nodes[i], &p);
  if (err != cudaSuccess) return err;
  e.launches[i] = applied;
  e.stale[i] = 1;  // the captured graph catches up when someone looks at it
  stats_.kernel_nodes_patched += 1;
  return cudaSuccess;
}

bool GraphExecutor::patch(Entry& e) {
  for (size_t i = 0; i < recorded_.size(); ++i) {
    const KernelLaunch& want = recorded_[i];
    if (want.same_args(e.launches[i])) continue;
    const cudaError_t err = patch_node(e, i, want);
    if (err == cudaSuccess) continue;
    // A node inside a conditional step's body the driver would not patch: capture again.
    if (e.handles.empty()) GGRAPH_CUDA_CHECK(err);
    cudaGetLastError();
    return false;
  }
  return true;
}

void GraphExecutor::check_nodes(const Entry& e,
                                const std::function<std::string(int)>& node_names) const {
  // The graph's kernel nodes must hold exactly the arguments this step's graph asks for:
  // pointers at the captured addresses, KV parameters as patched.
  for (size_t i = 0; i < recorded_.size(); ++i) {
    const KernelLaunch& want = recorded_[i];
    cudaKernelNodeParams p = {};
    GGRAPH_CUDA_CHECK(cudaGraphKernelNodeGetParams(e.nodes[i], &p));
    bool ok = p.func == want.func && p.gridDim.x == want.grid.x && p.gridDim.y == want.grid.y &&
              p.gridDim.z == want.grid.z;
    for (int a = 0; ok && a < want.n_args; ++a)
      ok = std::memcmp(p.kernelParams[a], want.args + want.arg_offset[a], want.arg_size[a]) == 0;
    if (!ok)
      throw DeviceError("CUDA graph debug: kernel node " + std::to_string(i) + " (" +
                        node_names(want.node) +
                        ") does not hold the parameters this step asks for");
  }
}

void GraphExecutor::launch(Entry& e) {
  e.last_used = ++clock_;
  current_ = &e;
  const auto t0 = std::chrono::steady_clock::now();
  GGRAPH_CUDA_CHECK(cudaGraphLaunch(e.exec, stream_));
  stats_.launch_us_total +=
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  stats_.replays += 1;
  key_stats_[key_].replays += 1;
  stats_.kernels += double(e.launches.size());
}

void GraphExecutor::run(uint64_t key, const LaunchAll& launch_all,
                        const std::function<std::string(int)>& node_names,
                        const LaunchAll& launch_kv) {
  const auto start = std::chrono::steady_clock::now();
  key_ = key;
  run_mode(key, launch_all, node_names, launch_kv);
  stats_.steps += 1;
  stats_.host_us_total +=
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
}

bool GraphExecutor::patch_kv_launches(Entry& e, const LaunchAll& launch_kv) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  record_step(launch_kv);
  const auto t1 = Clock::now();
  stats_.record_us_total += std::chrono::duration<double, std::micro>(t1 - t0).count();
  for (const KernelLaunch& k : recorded_)
    if (size_t(k.index) >= e.launches.size() || !k.same_shape(e.launches[size_t(k.index)]))
      return false;
  for (const KernelLaunch& want : recorded_)
    if (!want.same_args(e.launches[size_t(want.index)]))
      GGRAPH_CUDA_CHECK(patch_node(e, size_t(want.index), want));
  stats_.patch_us_total += std::chrono::duration<double, std::micro>(Clock::now() - t1).count();
  return true;
}

void GraphExecutor::run_mode(uint64_t key, const LaunchAll& launch_all,
                             const std::function<std::string(int)>& node_names,
                             const LaunchAll& launch_kv) {
  if (mode_ == GraphMode::Off) {
    Launcher L;
    L.stream = stream_;
    L.pdl = pdl_;
    launch_all(L);
    stats_.eager_evals += 1;
    stats_.kernels += L.launches;
    return;
  }
  if (mode_ == GraphMode::Recapture) {
    Entry& e = entry_for(key);
    release(e);
    capture(launch_all, &e.graph, &e.launches, &e.nodes, gate_ ? &e.handles : nullptr);
    e.stale.assign(e.nodes.size(), 0);
    instantiate(e);
    launch(e);
    return;
  }
  if (mode_ == GraphMode::Update) {
    Entry& e = entry_for(key);
    cudaGraph_t g = nullptr;
    capture(launch_all, &g, &captured_, &captured_nodes_);
    captured_handles_.clear();
    update_or_instantiate(e, g, captured_, captured_nodes_, captured_handles_);
    launch(e);
    return;
  }
  // Patch: find out what this step launches without launching it.
  if (launch_kv && !debug_) {
    auto it = cache_.find(key);
    if (it != cache_.end() && it->second.exec && patch_kv_launches(it->second, launch_kv)) {
      launch(it->second);
      return;
    }
  }
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  Entry& e = entry_for(key);
  record_step(launch_all, &e);
  const auto t1 = Clock::now();
  stats_.record_us_total += std::chrono::duration<double, std::micro>(t1 - t0).count();
  bool patched = false;
  if (e.exec && same_topology(recorded_, e.launches)) {
    patched = patch(e);
    stats_.patch_us_total += std::chrono::duration<double, std::micro>(Clock::now() - t1).count();
  }
  if (!patched) {
    cudaGraph_t g = nullptr;
    capture(launch_all, &g, &captured_, &captured_nodes_, gate_ ? &captured_handles_ : nullptr);
    update_or_instantiate(e, g, captured_, captured_nodes_, captured_handles_);
  }
  if (debug_) {
    sync_graph(e);
    check_nodes(e, node_names);
  }
  launch(e);
}

void GraphExecutor::dump_dot(const std::string& path) {
  cudaGraph_t g = current_graph();
  if (!g) throw ArgumentError("dump_cuda_graph: no CUDA graph has been captured yet");
  GGRAPH_CUDA_CHECK(cudaGraphDebugDotPrint(g, path.c_str(), cudaGraphDebugDotFlagsVerbose));
}

}  // namespace ggraph::cuda
