// Shared basics: error types and checks used across the engine.
#pragma once

#include <cstddef>
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

// Throws ArgumentError naming `what`, the first of ids[0..n) outside [0, n_vocab) and its index.
inline void check_token_ids(const int32_t* ids, size_t n, int64_t n_vocab, const char* what) {
  for (size_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= n_vocab)
      throw ArgumentError(std::string(what) + ": token id " + std::to_string(ids[i]) +
                          " at index " + std::to_string(i) + " is outside the vocabulary [0, " +
                          std::to_string(n_vocab) + ")");
  }
}

// Overflow-checked multiply for sizes read from untrusted files.
inline bool mul_overflows(uint64_t a, uint64_t b, uint64_t* out) {
  return __builtin_mul_overflow(a, b, out);
}

}  // namespace ggraph
