// cuBLAS for the prompt products of F16 and BF16 weights, loaded at run time: a build with
// CUDA runs where the library is missing, and then the tiled tensor-core kernel serves.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>

#include "common.h"
#include "cuda/launch.cuh"
#include "quant.h"

namespace ggraph::cuda {

// Which kernel takes the prompt products (more than kMatVecMaxCols columns) of F16 and BF16
// weights. Auto: cuBLAS where it loads (BENCHMARKS.md has the sweep that chose it), else the
// tiled kernel. GGRAPH_CUDA_GEMM=mma|cublas|auto sets it for a process; tests and benchmarks
// set it with set_gemm_path.
enum class GemmPath { Auto, Mma, Cublas };
void set_gemm_path(GemmPath p);
GemmPath gemm_path();

// Whether the products of weights of this type go to cuBLAS under the current path, given that
// the library is available.
bool gemm_wants_blas(DType weight_type);

class Blas {
 public:
  // A handle on stream with its own workspace; nullptr, with the reason in *why, where the
  // library cannot be loaded or its handle not made.
  static std::unique_ptr<Blas> create(cudaStream_t stream, std::string* why);
  ~Blas();
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;

  // dst[cols][n] (F32) = x[cols][kp] * w[n][k]^T, x in the weight's type (F16 or BF16) with
  // rows kp apart, as launch_act_to_half lays them out. Launches only where l executes; the
  // graph executor sees its kernels as nodes that are not its own (launch.cuh).
  void gemm(Launcher& l, DType type, const void* w, int64_t n, int64_t k, const void* x, int64_t kp,
            int cols, float* dst) const;

  size_t workspace_bytes() const { return workspace_bytes_; }

 private:
  Blas() = default;
  void* handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
};

}  // namespace ggraph::cuda
