// Test hooks of the CUDA backend that the Backend interface does not carry.
#pragma once

#include <cstdint>

#include "backend.h"

namespace ggraph {

// Fills the CUDA backend's scratch and workspace buffers with `byte`, so that a test sees any
// kernel that reads memory nothing wrote. Throws ArgumentError for a non-CUDA backend.
void cuda_poison_buffers(Backend& backend, uint8_t byte);

}  // namespace ggraph
