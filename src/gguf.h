// GGUF reader: mmap, metadata, tensor table, validation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common.h"
#include "quant.h"

namespace ggraph {

enum class GGUFType : uint32_t {
  UINT8 = 0,
  INT8 = 1,
  UINT16 = 2,
  INT16 = 3,
  UINT32 = 4,
  INT32 = 5,
  FLOAT32 = 6,
  BOOL = 7,
  STRING = 8,
  ARRAY = 9,
  UINT64 = 10,
  INT64 = 11,
  FLOAT64 = 12,
};
const char* gguf_type_name(GGUFType t);

// One metadata value. Scalars fill one of i/u/f/b/str; arrays fill arr (elements of arr_type).
struct GGUFValue {
  GGUFType type = GGUFType::UINT8;
  int64_t i = 0;   // signed integer types
  uint64_t u = 0;  // unsigned integer types (also set for non-negative signed ones)
  double f = 0;    // float types
  bool b = false;
  std::string str;
  GGUFType arr_type = GGUFType::UINT8;
  std::vector<GGUFValue> arr;

  bool is_int() const;  // any integer type
};

struct GGUFTensorInfo {
  std::string name;
  DType type = DType::F32;
  int n_dims = 0;
  int64_t ne[4] = {1, 1, 1, 1};  // ne[0] is the innermost (contiguous) dimension
  uint64_t offset = 0;           // from the start of the data section
  size_t nbytes = 0;
  const uint8_t* data = nullptr;  // points into the mapping
  int64_t n_elements() const { return ne[0] * ne[1] * ne[2] * ne[3]; }
  std::string shape_str() const;  // "576x49152"
};

class GGUFFile {
 public:
  // Maps (or, without use_mmap, reads into memory) and validates the file; throws GGUFError
  // naming what is wrong and where. With a mapping, a file truncated on disk while it is in use
  // can end the process with SIGBUS, as with llama.cpp: read it when it may change.
  static std::unique_ptr<GGUFFile> open(const std::string& path, bool use_mmap = true);
  // Parses a copy of an in-memory image (tests, fuzzing).
  static std::unique_ptr<GGUFFile> from_bytes(const void* data, size_t size);
  ~GGUFFile();
  GGUFFile(const GGUFFile&) = delete;
  GGUFFile& operator=(const GGUFFile&) = delete;

  uint32_t version() const { return version_; }
  const std::string& path() const { return path_; }
  size_t file_size() const { return size_; }
  size_t alignment() const { return alignment_; }

  const std::map<std::string, GGUFValue>& metadata() const { return kv_; }
  const GGUFValue* find(const std::string& key) const;
  bool has(const std::string& key) const { return find(key) != nullptr; }
  // Typed getters: throw GGUFError when the key is missing (no default given) or has another type.
  std::string get_string(const std::string& key) const;
  std::string get_string(const std::string& key, const std::string& def) const;
  int64_t get_int(const std::string& key) const;  // any integer type
  int64_t get_int(const std::string& key, int64_t def) const;
  double get_float(const std::string& key) const;  // float or integer types
  double get_float(const std::string& key, double def) const;
  bool get_bool(const std::string& key, bool def) const;
  std::vector<std::string> get_string_array(const std::string& key) const;
  std::vector<float> get_float_array(const std::string& key) const;
  std::vector<int32_t> get_int_array(const std::string& key) const;

  const std::vector<GGUFTensorInfo>& tensors() const { return tensors_; }
  const GGUFTensorInfo* tensor(const std::string& name) const;  // nullptr when absent

 private:
  GGUFFile() = default;
  void parse();

  std::string path_;
  const uint8_t* base_ = nullptr;
  size_t size_ = 0;
  bool mapped_ = false;
  std::vector<uint8_t> owned_;
  uint32_t version_ = 0;
  size_t alignment_ = 32;
  std::map<std::string, GGUFValue> kv_;
  std::vector<GGUFTensorInfo> tensors_;
  std::map<std::string, size_t> tensor_index_;
};

}  // namespace ggraph
