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

// Which kernel takes the prompt products (more than kMatVecMaxCols columns). Auto: cuBLAS, for
// F16 and BF16 weights as they are and for quantized weights decoded to half a chunk of rows
// at a time (launch_dequant_half), where it loads; the tiled kernel otherwise. BENCHMARKS.md
// has the sweep that chose this: decoding and cuBLAS beat the tiled kernel from 16 columns on.
// GGRAPH_CUDA_GEMM=mma|cublas|auto sets it for a process; tests and benchmarks set it with
// set_gemm_path.
enum class GemmPath { Auto, Mma, Cublas };
void set_gemm_path(GemmPath p);
GemmPath gemm_path();

// Whether a prompt product of cols columns of weights of this type goes to cuBLAS under the
// current path, given that the library is available.
bool gemm_wants_blas(DType weight_type, int64_t cols);

class Blas {
 public:
  // A handle on stream with its own workspace; nullptr, with the reason in *why, where the
  // library cannot be loaded or its handle not made.
  static std::unique_ptr<Blas> create(cudaStream_t stream, std::string* why);
  ~Blas();
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;

  // dst[cols][n] (F32, columns ldc apart) = x[cols][k] * w[n][k]^T, w's rows lda apart, x's
  // ldx apart (as launch_act_to_half lays them out), both in type (F16 or BF16). Launches only
  // where l executes; the graph executor sees its kernels as nodes that are not its own.
  void gemm(Launcher& l, DType type, const void* w, int64_t lda, int64_t n, int64_t k,
            const void* x, int64_t ldx, int cols, float* dst, int64_t ldc) const;

  size_t workspace_bytes() const { return workspace_bytes_; }

 private:
  Blas() = default;
  void* handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
};

}  // namespace ggraph::cuda
