// cuBLAS through dlopen: the few entry points the prompt products use, declared here with the
// library's documented ABI (handles are opaque pointers, enums are ints), so that neither the
// build nor the import needs cuBLAS; without it the tiled kernel takes every product.
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cuda/blas.h"
#include "cuda/kernels.cuh"

#if defined(__linux__)
#include <dlfcn.h>
#endif

namespace ggraph::cuda {
namespace {

// cuBLAS's values (cublas_api.h, library_types.h).
constexpr int kOpN = 0, kOpT = 1;
constexpr int kR32F = 0, kR16F = 2, kR16BF = 14;  // cudaDataType
constexpr int kCompute32F = 68;                   // cublasComputeType_t
constexpr int kGemmDefault = -1;                  // cublasGemmAlgo_t
// The workspace cuBLAS asks for on Hopper; set explicitly so that a capture allocates nothing.
constexpr size_t kWorkspaceBytes = size_t(32) << 20;

using Handle = void*;
struct Api {
  int (*create)(Handle*) = nullptr;
  int (*destroy)(Handle) = nullptr;
  int (*set_stream)(Handle, cudaStream_t) = nullptr;
  int (*set_workspace)(Handle, void*, size_t) = nullptr;
  int (*gemm_ex)(Handle, int, int, int, int, int, const void*, const void*, int, int, const void*,
                 int, int, const void*, void*, int, int, int, int) = nullptr;
  std::string error;  // why the library is not there, when it is not
};

#ifndef GGRAPH_CUBLAS_MAJOR
#define GGRAPH_CUBLAS_MAJOR (CUDART_VERSION / 1000)
#endif

const Api& api() {
  static const Api a = [] {
    Api r;
#if defined(__linux__)
    const std::string so = "libcublas.so." + std::to_string(GGRAPH_CUBLAS_MAJOR);
    std::vector<std::string> names;
    if (const char* p = std::getenv("GGRAPH_CUBLAS")) names.emplace_back(p);
    names.push_back(so);
#ifdef GGRAPH_CUDA_LIBRARY_DIR
    names.push_back(std::string(GGRAPH_CUDA_LIBRARY_DIR) + "/" + so);
#endif
    void* lib = nullptr;
    for (const std::string& n : names)
      if ((lib = dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL)) != nullptr) break;
    if (!lib) {
      r.error = so + " not found (GGRAPH_CUBLAS may name the file)";
      return r;
    }
    auto sym = [&](auto& f, const char* name) {
      f = reinterpret_cast<std::remove_reference_t<decltype(f)>>(dlsym(lib, name));
      if (!f && r.error.empty()) r.error = std::string(so) + " lacks " + name;
    };
    sym(r.create, "cublasCreate_v2");
    sym(r.destroy, "cublasDestroy_v2");
    sym(r.set_stream, "cublasSetStream_v2");
    sym(r.set_workspace, "cublasSetWorkspace_v2");
    sym(r.gemm_ex, "cublasGemmEx");
    if (!r.error.empty()) r.create = nullptr;
#else
    r.error = "cuBLAS is loaded on Linux only";
#endif
    return r;
  }();
  return a;
}

GemmPath env_gemm_path() {
  const char* v = std::getenv("GGRAPH_CUDA_GEMM");
  if (!v || !*v || std::strcmp(v, "auto") == 0) return GemmPath::Auto;
  if (std::strcmp(v, "mma") == 0) return GemmPath::Mma;
  if (std::strcmp(v, "cublas") == 0) return GemmPath::Cublas;
  throw ArgumentError(std::string("GGRAPH_CUDA_GEMM: expected 'auto', 'mma' or 'cublas', got '") +
                      v + "'");
}

GemmPath& path_setting() {
  static GemmPath p = env_gemm_path();
  return p;
}

}  // namespace

void set_gemm_path(GemmPath p) { path_setting() = p; }
GemmPath gemm_path() { return path_setting(); }

bool gemm_wants_blas(DType weight_type, int64_t cols) {
  if (gemm_path() == GemmPath::Mma || cols <= kMatVecMaxCols) return false;
  return weight_type == DType::F16 || weight_type == DType::BF16 || is_quantized(weight_type);
}

std::unique_ptr<Blas> Blas::create(cudaStream_t stream, std::string* why) {
  const Api& a = api();
  if (!a.create) {
    *why = a.error;
    return nullptr;
  }
  std::unique_ptr<Blas> b(new Blas());
  if (a.create(&b->handle_) != 0) {
    b->handle_ = nullptr;
    *why = "cublasCreate failed";
    return nullptr;
  }
  if (cudaMalloc(&b->workspace_, kWorkspaceBytes) != cudaSuccess) {
    cudaGetLastError();
    b->workspace_ = nullptr;
    *why = "no device memory for cuBLAS's workspace";
    return nullptr;
  }
  b->workspace_bytes_ = kWorkspaceBytes;
  if (a.set_stream(b->handle_, stream) != 0 ||
      a.set_workspace(b->handle_, b->workspace_, kWorkspaceBytes) != 0) {
    *why = "cuBLAS refused the stream or the workspace";
    return nullptr;
  }
  return b;
}

Blas::~Blas() {
  if (handle_) api().destroy(handle_);
  if (workspace_) cudaFree(workspace_);
}

void Blas::gemm(Launcher& l, DType type, const void* w, int64_t lda, int64_t n, int64_t k,
                const void* x, int64_t ldx, int cols, float* dst, int64_t ldc) const {
  if (!l.execute) return;
  const int dt = type == DType::BF16 ? kR16BF : kR16F;
  const float one = 1.0f, zero = 0.0f;
  // Column-major view: W is k x n, X is k x cols, C = W^T X is n x cols.
  const int status =
      api().gemm_ex(handle_, kOpT, kOpN, static_cast<int>(n), cols, static_cast<int>(k), &one, w,
                    dt, static_cast<int>(lda), x, dt, static_cast<int>(ldx), &zero, dst, kR32F,
                    static_cast<int>(ldc), kCompute32F, kGemmDefault);
  if (status != 0)
    throw DeviceError("cublasGemmEx failed with status " + std::to_string(status) + " for [" +
                      std::to_string(n) + " x " + std::to_string(k) + "] x " +
                      std::to_string(cols) + " columns");
}

}  // namespace ggraph::cuda
