// The narrow backend interface: memory for weights and the KV cache, and computing a graph.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common.h"
#include "graph.h"

namespace ggraph {

// Blocks of host memory that are costly to make (page-locked), kept for reuse: give() returns
// a block take() handed out. Thread-safe; holders of a block keep the pool alive.
class HostPool {
 public:
  virtual ~HostPool() = default;
  // A block of at least `bytes`, or nullptr where none can be had (the caller uses its own).
  virtual void* take(size_t bytes) = 0;
  virtual void give(void* block) = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;  // "cpu", "cuda:0 (NVIDIA H200)"
  virtual bool is_cuda() const { return false; }
  // Whether compute runs a chain loop (Op::ChainLoop): its rounds in one launch.
  virtual bool runs_loops() const { return false; }
  // Whether compute may fold a one-column norm into the products after it, reading its inputs
  // after its own node (planner.h: plan's fold_room).
  virtual bool folds_norms() const { return false; }

  // Makes the bytes of a weight [ne0, ne1] of `type` available to kernels; returns the address
  // kernels read. The CPU backend reads the file mapping in place; the CUDA backend copies to
  // device memory (quantized types in its own layout, see cuda/weight_layout.h).
  virtual void* upload_weight(const void* host, size_t bytes, DType type, int64_t ne0, int64_t ne1,
                              const std::string& name) = 0;
  // Zeroed memory for the KV cache. Throws DeviceError naming bytes needed and free on failure.
  virtual void* alloc_kv(size_t bytes) = 0;
  // Copies between the host and memory from alloc_kv (saving and loading a context's state),
  // finished when they return.
  virtual void kv_to_host(void* host, const void* kv, size_t bytes) {
    std::memcpy(host, kv, bytes);
  }
  virtual void kv_from_host(void* kv, const void* host, size_t bytes) {
    std::memcpy(kv, host, bytes);
  }
  // A copy between two places of alloc_kv's memory (one sequence's rows into another's).
  virtual void kv_copy(void* dst, const void* src, size_t bytes) { std::memmove(dst, src, bytes); }
  // Sizes the scratch and input buffers once per context, from the largest graph it will run.
  virtual void reserve(size_t scratch_bytes, size_t input_bytes) = 0;
  // Copies the graph's inputs in, runs every node, copies the output tensor (F32) to `out`.
  // The graph must have been planned and fit the reserved buffers.
  virtual void compute(const Graph& graph, float* out) = 0;
  // compute in two halves, for a caller that takes a chain loop's tokens while it runs
  // (loop_words): compute_start copies the inputs in and launches (CUDA returns at once; other
  // backends run it all), compute_finish waits for the end and copies the output to the `out`
  // given at the start; an error of the launch is thrown there. Between the two the graph, its
  // inputs and `out` stay as they are, and only loop_words and halt_loop may be called.
  virtual void compute_start(const Graph& graph, float* out) { compute(graph, out); }
  virtual void compute_finish() {}
  // A chain loop's words as its rounds end (Op::ChainLoop), in host memory that the device
  // writes while the launch runs; nullptr where a loop's tokens come back only at its end. Word
  // 0 is the count of tokens so far, with kLoopEnded added once the loop has ended; then the
  // loop's capacity of token words, then as many log-probability words, as the op's output.
  // The words a count covers are written before it.
  virtual const volatile int32_t* loop_words() { return nullptr; }
  // Asks the loop in flight to end after its round in progress (or the next one); its words and
  // output then stop there, as if its rounds had been done.
  virtual void halt_loop() {}
  // Host memory that compute() writes its output into fastest (on CUDA page-locked, which the
  // device copies into directly); nullptr where ordinary memory is as good.
  virtual std::shared_ptr<HostPool> host_pool() { return nullptr; }

  // Execution statistics (CUDA graph counters and the like), for Model.graph_stats.
  virtual std::map<std::string, double> stats() const { return {}; }
  virtual void reset_stats() {}
  // Host time the caller spent on this step before compute (graph build, planning), so that the
  // backend can report host time per step from eval call to launch.
  virtual void add_host_time(double microseconds) {}
  // What the caller saw of a chain loop's words (loop_words) while it ran: how many times it
  // looked, the tokens it took from them before the loop had ended, and whether it stopped
  // looking before the loop had ended (nothing new for long, or words it could not take) to
  // wait for its end instead.
  virtual void add_loop_looks(double looks, double tokens_streamed, bool gave_up) {}

  // CUDA graph inspection; other backends refuse.
  virtual uint64_t graph_handle() { throw ArgumentError(name() + " has no CUDA graph"); }
  virtual void dump_graph(const std::string& path) {
    throw ArgumentError(name() + " has no CUDA graph");
  }
  virtual void debug_corrupt_next_patch() { throw ArgumentError(name() + " has no CUDA graph"); }
};

std::unique_ptr<Backend> make_cpu_backend(int n_threads);

struct CudaOptions {
  int device = 0;
  std::string graphs = "patch";  // off | recapture | update | patch
  bool debug = false;            // check replay inputs and patched parameters
};
bool cuda_compiled();
// Throws DeviceError when no usable GPU is present.
std::unique_ptr<Backend> make_cuda_backend(const CudaOptions& options);

struct DeviceInfo {
  int index;
  std::string name;
  size_t total_memory;
  size_t free_memory;
  int cc_major, cc_minor;
  int multiprocessors;
};
std::vector<DeviceInfo> cuda_devices();  // empty when CUDA is not compiled or no GPU is present

}  // namespace ggraph
