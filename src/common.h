// Shared basics: error types and checks used across the engine.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace ggraph {

// A malformed or unsupported model file.
class GGUFError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A bad argument from the caller (token id, context overflow, option value).
class ArgumentError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A device failure (CUDA error, out of device memory).
class DeviceError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Work stopped on request (a cancel flag, an interrupt): the call changed nothing.
class Cancelled : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Overflow-checked multiply for sizes read from untrusted files.
inline bool mul_overflows(uint64_t a, uint64_t b, uint64_t* out) {
  return __builtin_mul_overflow(a, b, out);
}

}  // namespace ggraph
