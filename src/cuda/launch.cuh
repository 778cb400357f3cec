// Every kernel launch of a step goes through Launcher, so that the graph executor can
// see each launch's function, grid and argument values: to patch captured kernel nodes in place.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#ifdef GGRAPH_CUDA_STEP_TRACE
#include <cstdio>
#endif
#include <cstring>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common.h"

namespace ggraph::cuda {

[[noreturn]] void throw_cuda_error(cudaError_t err, const char* what, const char* file, int line);

#define GGRAPH_CUDA_CHECK(expr)                                                 \
  do {                                                                          \
    cudaError_t ggraph_err_ = (expr);                                           \
    if (ggraph_err_ != cudaSuccess)                                             \
      ::ggraph::cuda::throw_cuda_error(ggraph_err_, #expr, __FILE__, __LINE__); \
  } while (0)

// Lets a kernel take up to `bytes` of dynamic shared memory a block (past the default 48 KB). A
// failure (no device, a kernel not built for it) stays in the error state for the caller.
template <typename Kernel>
void allow_block_smem(Kernel kernel, size_t bytes) {
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                       static_cast<int>(bytes));
}

// The share of the SM's unified L1/shared memory that a kernel prefers as shared memory
// (cudaFuncAttributePreferredSharedMemoryCarveout), set once a function before its first launch:
// all of it on sm_90, the driver's choice elsewhere; GGRAPH_CUDA_CARVEOUT=P (0-100) sets P% for
// every kernel, -1 the driver's choice (measurement settings).
void prefer_carveout(const void* func);

// One kernel launch with its arguments copied out, in launch order. Fixed-size storage: a
// decode step records hundreds of these and must not allocate.
struct KernelLaunch {
  static constexpr int kMaxArgs = 32;
  static constexpr int kMaxArgBytes = 320;
  const void* func = nullptr;
  dim3 grid, block;
  size_t smem = 0;
  int node = -1;   // index of the graph node that launched it
  int index = -1;  // position among all of the step's launches
  int n_args = 0;
  int arg_bytes = 0;  // only the first n_args / arg_bytes entries below are meaningful
  uint16_t arg_offset[kMaxArgs];
  uint16_t arg_size[kMaxArgs];
  alignas(16) uint8_t args[kMaxArgBytes];  // each argument at an 8-byte aligned offset

  // User-provided so that recording a launch does not zero the whole record first.
  KernelLaunch() {}

  // Pointers for cudaKernelNodeParams::kernelParams; valid while this object is unchanged.
  void fill_param_ptrs(void** out) {
    for (int i = 0; i < n_args; ++i) out[i] = args + arg_offset[i];
  }
  bool same_args(const KernelLaunch& o) const {
    return arg_bytes == o.arg_bytes && std::memcmp(args, o.args, arg_bytes) == 0;
  }
  bool same_shape(const KernelLaunch& o) const {
    return func == o.func && grid.x == o.grid.x && grid.y == o.grid.y && grid.z == o.grid.z &&
           block.x == o.block.x && block.y == o.block.y && block.z == o.block.z && smem == o.smem &&
           n_args == o.n_args && std::memcmp(arg_size, o.arg_size, sizeof(uint16_t) * n_args) == 0;
  }
};

class Launcher;

// The steps of a sampled chain as CUDA graphs' conditional (IF) nodes: the kernels of step j >= 1
// run only if step j - 1's sample kernel set step j's handle, which it does unless it sampled a
// stop id. A chain loop (Op::ChainLoop) is a WHILE node around the chain, whose round kernel
// ends it or sets the steps' handles back to 0 for the next round. The graph executor supplies a
// gate where it captures or replays a graph; without one (plain stream launches) every step
// runs, once.
class StepGate {
 public:
  virtual ~StepGate() = default;
  // Adds a conditional node of `type` on handle h to graph after deps[n_deps] (*node takes it,
  // where given) and returns its body graph.
  static cudaGraph_t add_conditional_node(cudaGraph_t graph, const cudaGraphNode_t* deps,
                                          size_t n_deps, cudaGraphConditionalHandle h,
                                          cudaGraphConditionalNodeType type,
                                          cudaGraphNode_t* node = nullptr);
  // The handle of step j's IF node (0: the step runs unconditionally).
  virtual cudaGraphConditionalHandle handle(int step) = 0;
  // The launches after this call make step j's body.
  virtual void open(Launcher& l, int step) = 0;
  // The handle of the loop's WHILE node (0: none).
  virtual cudaGraphConditionalHandle loop_handle() = 0;
  // The launches after open_loop make the loop's body; end_steps closes the last step's body
  // (the launches after it run every round), close_loop the loop's.
  virtual void open_loop(Launcher& l) = 0;
  virtual void end_steps(Launcher& l) = 0;
  virtual void close_loop(Launcher& l) = 0;
};

class Launcher {
 public:
  cudaStream_t stream = nullptr;
  bool execute = true;                          // launch on the stream
  std::vector<KernelLaunch>* record = nullptr;  // when set, every launch is appended here
  int node = -1;                                // graph node being launched
  // While the stream is being captured: the kernel node each launch became, in launch order.
  std::vector<cudaGraphNode_t>* captured_nodes = nullptr;
  int launches = 0;  // launches issued or recorded so far this step
  StepGate* gate = nullptr;
  cudaGraphConditionalHandle step_handle(int step) { return gate ? gate->handle(step) : 0; }
  void open_step(int step) {
    if (gate) gate->open(*this, step);
  }
  cudaGraphConditionalHandle loop_handle() { return gate ? gate->loop_handle() : 0; }
  void open_loop() {
    if (gate) gate->open_loop(*this);
  }
  void end_steps() {
    if (gate) gate->end_steps(*this);
  }
  void close_loop() {
    if (gate) gate->close_loop(*this);
  }
  // Launch with programmatic stream serialization (sm_90+): the next kernel's launch overlaps
  // this one's run; every kernel begins with pdl_wait() (cuda/device_util.cuh), which keeps
  // plain stream order for memory.
  bool pdl = false;

  template <typename... KArgs, typename... Args>
  void operator()(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, Args&&... args) {
    static_assert(sizeof...(KArgs) == sizeof...(Args), "kernel argument count");
    std::tuple<KArgs...> values(std::forward<Args>(args)...);
    launch_tuple(reinterpret_cast<const void*>(kernel), grid, block, smem, values,
                 std::index_sequence_for<KArgs...>{});
  }

 private:
  template <typename Tuple, size_t... I>
  void launch_tuple(const void* func, dim3 grid, dim3 block, size_t smem, Tuple& values,
                    std::index_sequence<I...>) {
    void* ptrs[sizeof...(I) + 1] = {static_cast<void*>(&std::get<I>(values))...};
    const int index = launches++;
    if (record) {
      static_assert(sizeof...(I) <= KernelLaunch::kMaxArgs, "too many kernel arguments");
      record->emplace_back();
      KernelLaunch& k = record->back();
      k.func = func;
      k.grid = grid;
      k.block = block;
      k.smem = smem;
      k.node = node;
      k.index = index;
      k.n_args = int(sizeof...(I));
      constexpr size_t sizes[sizeof...(I) + 1] = {sizeof(std::tuple_element_t<I, Tuple>)...};
      int total = 0;
      for (size_t i = 0; i < sizeof...(I); ++i) {
        k.arg_offset[i] = uint16_t(total);
        k.arg_size[i] = uint16_t(sizes[i]);
        total += int((sizes[i] + 7) / 8 * 8);
      }
      if (total > KernelLaunch::kMaxArgBytes)
        throw std::logic_error("kernel arguments exceed KernelLaunch::kMaxArgBytes");
      // Zero the argument bytes first: padding between arguments is compared too.
      std::memset(k.args, 0, size_t(total));
      for (size_t i = 0; i < sizeof...(I); ++i)
        std::memcpy(k.args + k.arg_offset[i], ptrs[i], sizes[i]);
      k.arg_bytes = total;
    }
    if (execute) {
      prefer_carveout(func);
      if (pdl) {
        cudaLaunchAttribute attr = {};
        attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr.val.programmaticStreamSerializationAllowed = 1;
        cudaLaunchConfig_t config = {};
        config.gridDim = grid;
        config.blockDim = block;
        config.dynamicSmemBytes = smem;
        config.stream = stream;
        config.attrs = &attr;
        config.numAttrs = 1;
        GGRAPH_CUDA_CHECK(cudaLaunchKernelExC(&config, func, ptrs));
      } else {
        GGRAPH_CUDA_CHECK(cudaLaunchKernel(func, grid, block, ptrs, smem, stream));
      }
      if (captured_nodes) {
        // On a captured stream the last node added is the sole dependency of what comes next.
        cudaStreamCaptureStatus status;
        const cudaGraphNode_t* deps = nullptr;
        const cudaGraphEdgeData* edges = nullptr;  // programmatic edges are not default ones
        size_t n_deps = 0;
        GGRAPH_CUDA_CHECK(
            cudaStreamGetCaptureInfo(stream, &status, nullptr, nullptr, &deps, &edges, &n_deps));
        if (status != cudaStreamCaptureStatusActive || n_deps != 1)
          throw std::logic_error("launch under capture: expected one dependency node");
        captured_nodes->push_back(deps[0]);
#ifdef GGRAPH_CUDA_STEP_TRACE
        // The captured step's launches, for the grids' stamps (cuda/device_util.cuh, pdl_wait).
        const char* name = nullptr;
        if (cudaFuncGetName(&name, func) != cudaSuccess || !name) name = "?";
        std::printf("LNC %d %s %u %u\n", index, name, grid.x * grid.y * grid.z,
                    block.x * block.y * block.z);
#endif
      }
    }
  }
};

}  // namespace ggraph::cuda
