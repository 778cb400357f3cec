#include <chrono>
#include <cstring>
#include <stdexcept>

#include "common.h"
#include "cuda/graph_executor.h"

namespace ggraph::cuda {

GraphMode parse_graph_mode(const std::string& name) {
  if (name == "off") return GraphMode::Off;
  if (name == "recapture") return GraphMode::Recapture;
  if (name == "update") return GraphMode::Update;
  if (name == "patch") return GraphMode::Patch;
  throw ArgumentError("cuda_graphs: expected 'off', 'recapture', 'update' or 'patch', got '" +
                      name + "'");
}

GraphExecutor::GraphExecutor(cudaStream_t stream, GraphMode mode, bool debug, bool pdl)
    : stream_(stream), mode_(mode), debug_(debug), pdl_(pdl) {
  recorded_.reserve(4096);
}

GraphExecutor::~GraphExecutor() {
  for (auto& kv : cache_) release(kv.second);
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
}

void GraphExecutor::capture(const LaunchAll& launch_all, cudaGraph_t* graph,
                            std::vector<KernelLaunch>* launches,
                            std::vector<cudaGraphNode_t>* nodes) {
  const auto t0 = std::chrono::steady_clock::now();
  launches->clear();
  nodes->clear();
  GGRAPH_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  Launcher L;
  L.stream = stream_;
  L.pdl = pdl_;
  L.execute = true;
  L.record = launches;
  L.captured_nodes = nodes;
  try {
    launch_all(L);
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
                                          std::vector<cudaGraphNode_t>& nodes) {
  if (e.exec && e.launches.size() == launches.size()) {
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

void GraphExecutor::record_step(const LaunchAll& launches) {
  recorded_.clear();
  Launcher L;
  L.stream = stream_;
  L.pdl = pdl_;
  L.execute = false;
  L.record = &recorded_;
  launches(L);
}

void GraphExecutor::patch_node(Entry& e, size_t i, const KernelLaunch& want) {
  KernelLaunch applied = want;
  if (corrupt_next_patch_) {
    applied.args[0] ^= 0x40;  // flips a bit of the first argument
    corrupt_next_patch_ = false;
  }
  void* ptrs[KernelLaunch::kMaxArgs];
  cudaKernelNodeParams p;
  set_kernel_params(applied, &p, ptrs);
  GGRAPH_CUDA_CHECK(cudaGraphExecKernelNodeSetParams(e.exec, e.nodes[i], &p));
  e.launches[i] = applied;
  e.stale[i] = 1;  // the captured graph catches up when someone looks at it
  stats_.kernel_nodes_patched += 1;
}

void GraphExecutor::patch(Entry& e) {
  for (size_t i = 0; i < recorded_.size(); ++i) {
    const KernelLaunch& want = recorded_[i];
    if (!want.same_args(e.launches[i])) patch_node(e, i, want);
  }
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
  GGRAPH_CUDA_CHECK(cudaGraphLaunch(e.exec, stream_));
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
    if (!want.same_args(e.launches[size_t(want.index)])) patch_node(e, size_t(want.index), want);
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
    capture(launch_all, &e.graph, &e.launches, &e.nodes);
    e.stale.assign(e.nodes.size(), 0);
    instantiate(e);
    launch(e);
    return;
  }
  if (mode_ == GraphMode::Update) {
    Entry& e = entry_for(key);
    cudaGraph_t g = nullptr;
    capture(launch_all, &g, &captured_, &captured_nodes_);
    update_or_instantiate(e, g, captured_, captured_nodes_);
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
  record_step(launch_all);
  const auto t1 = Clock::now();
  stats_.record_us_total += std::chrono::duration<double, std::micro>(t1 - t0).count();
  Entry& e = entry_for(key);
  if (e.exec && same_topology(recorded_, e.launches)) {
    patch(e);
    stats_.patch_us_total += std::chrono::duration<double, std::micro>(Clock::now() - t1).count();
  } else {
    cudaGraph_t g = nullptr;
    capture(launch_all, &g, &captured_, &captured_nodes_);
    update_or_instantiate(e, g, captured_, captured_nodes_);
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
