// Builds without the CUDA backend: it reports itself absent.
#include "backend.h"
#include "common.h"

namespace ggraph {

bool cuda_compiled() { return false; }
std::vector<DeviceInfo> cuda_devices() { return {}; }
std::unique_ptr<Backend> make_cuda_backend(const CudaOptions&) {
  throw DeviceError("this build of ggraph has no CUDA backend");
}

}  // namespace ggraph
