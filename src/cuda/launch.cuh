// Every kernel launch of the CUDA backend goes through Launcher, so that the graph executor can
// see each launch's function, grid and argument values: to patch captured kernel nodes in place.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common.h"

namespace ggraph::cuda {

[[noreturn]] void throw_cuda_error(cudaError_t err, const char* what, const char* file, int line);

#define GGRAPH_CUDA_CHECK(expr)                                                   \
  do {                                                                            \
    cudaError_t ggraph_err_ = (expr);                                             \
    if (ggraph_err_ != cudaSuccess)                                               \
      ::ggraph::cuda::throw_cuda_error(ggraph_err_, #expr, __FILE__, __LINE__);   \
  } while (0)

// One kernel launch with its arguments copied out, in launch order.
struct KernelLaunch {
  const void* func = nullptr;
  dim3 grid, block;
  size_t smem = 0;
  int node = -1;                    // index of the graph node that launched it
  std::vector<uint64_t> arg_store;  // argument bytes, each argument 8-byte aligned
  std::vector<uint32_t> arg_offset; // byte offset of each argument in arg_store
  std::vector<uint32_t> arg_size;

  // Pointers for cudaKernelNodeParams::kernelParams (valid while this object is unchanged).
  std::vector<void*> param_ptrs() {
    std::vector<void*> p(arg_offset.size());
    for (size_t i = 0; i < p.size(); ++i)
      p[i] = reinterpret_cast<uint8_t*>(arg_store.data()) + arg_offset[i];
    return p;
  }
  bool same_args(const KernelLaunch& o) const {
    return arg_size == o.arg_size && arg_store == o.arg_store;
  }
  bool same_shape(const KernelLaunch& o) const {
    return func == o.func && grid.x == o.grid.x && grid.y == o.grid.y && grid.z == o.grid.z &&
           block.x == o.block.x && block.y == o.block.y && block.z == o.block.z &&
           smem == o.smem && arg_size == o.arg_size;
  }
};

class Launcher {
 public:
  cudaStream_t stream = nullptr;
  bool execute = true;                         // launch on the stream
  std::vector<KernelLaunch>* record = nullptr; // when set, every launch is appended here
  int node = -1;                               // graph node being launched

  template <typename... KArgs, typename... Args>
  void operator()(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                  Args&&... args) {
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
    if (record) {
      KernelLaunch k;
      k.func = func;
      k.grid = grid;
      k.block = block;
      k.smem = smem;
      k.node = node;
      size_t sizes[sizeof...(I) + 1] = {sizeof(std::get<I>(values))...};
      size_t total = 0;
      for (size_t i = 0; i < sizeof...(I); ++i) {
        k.arg_offset.push_back(static_cast<uint32_t>(total));
        k.arg_size.push_back(static_cast<uint32_t>(sizes[i]));
        total += (sizes[i] + 7) / 8 * 8;
      }
      k.arg_store.assign(total / 8 + 1, 0);
      for (size_t i = 0; i < sizeof...(I); ++i)
        std::memcpy(reinterpret_cast<uint8_t*>(k.arg_store.data()) + k.arg_offset[i], ptrs[i],
                    sizes[i]);
      record->push_back(std::move(k));
    }
    if (execute) {
      GGRAPH_CUDA_CHECK(cudaLaunchKernel(func, grid, block, ptrs, smem, stream));
    }
  }
};

}  // namespace ggraph::cuda
