// Eager execution: a step's kernels are launched on the stream one by one. Capture, replay,
// patch and update of CUDA graphs replace this in the graph executor's own change; until then
// every mode launches eagerly and counts its steps as eager evaluations.
#include <chrono>

#include "cuda/graph_executor.h"

namespace ggraph::cuda {

GraphMode parse_graph_mode(const std::string& name) {
  if (name == "off") return GraphMode::Off;
  if (name == "recapture") return GraphMode::Recapture;
  if (name == "update") return GraphMode::Update;
  if (name == "patch") return GraphMode::Patch;
  throw ArgumentError("cuda_graphs must be one of off, recapture, update, patch; got '" + name +
                      "'");
}

GraphExecutor::GraphExecutor(cudaStream_t stream, GraphMode mode, bool debug)
    : stream_(stream), mode_(mode), debug_(debug) {}

GraphExecutor::~GraphExecutor() = default;

void GraphExecutor::run(uint64_t key, const LaunchAll& launch_all,
                        const std::function<std::string(int)>& node_names) {
  const auto start = std::chrono::steady_clock::now();
  Launcher launcher;
  launcher.stream = stream_;
  launch_all(launcher);
  stats_.eager_evals += 1;
  stats_.steps += 1;
  stats_.host_us_total +=
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace ggraph::cuda
