// GGUF reader. Every count, length and offset comes from an untrusted file, so each one is
// checked against the bytes that remain before it is used to allocate, loop or point.
#include "gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <utility>

#include "unicode.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the GGUF reader assumes a little-endian host"
#endif

namespace ggraph {
namespace {

// Real vocabularies hold a few hundred thousand entries per array; a file claiming far more
// values than this would only make the reader allocate gigabytes of GGUFValue nodes.
constexpr uint64_t kMaxMetadataValues = uint64_t{1} << 23;
// Arrays of arrays nest one level in practice; the limit keeps recursion off the stack's edge.
constexpr int kMaxArrayDepth = 16;
// Smallest possible encodings, used to bound counts by the bytes left in the file.
constexpr uint64_t kMinKVBytes = 8 + 4 + 1;  // key length, value type, 1-byte value
// Name length, n_dims, one dimension, type, offset.
constexpr uint64_t kMinTensorInfoBytes = 8 + 4 + 8 + 4 + 8;
constexpr int kMaxDims = 4;

bool valid_value_type(uint32_t t) { return t <= static_cast<uint32_t>(GGUFType::FLOAT64); }

// Bytes one value of type t takes at least (exactly, for scalars).
uint64_t min_value_bytes(GGUFType t) {
  switch (t) {
    case GGUFType::UINT8:
    case GGUFType::INT8:
    case GGUFType::BOOL:
      return 1;
    case GGUFType::UINT16:
    case GGUFType::INT16:
      return 2;
    case GGUFType::UINT32:
    case GGUFType::INT32:
    case GGUFType::FLOAT32:
      return 4;
    case GGUFType::UINT64:
    case GGUFType::INT64:
    case GGUFType::FLOAT64:
    case GGUFType::STRING:  // the length alone
      return 8;
    case GGUFType::ARRAY:  // element type and count
      return 12;
  }
  return 1;
}

// s in quotes for a message: bytes that are not well-formed UTF-8, and control characters, as
// \xNN escapes, so that a message always decodes (a name from the file may hold any bytes).
std::string quoted(const std::string& s) {
  std::string out = "'";
  size_t i = 0;
  while (i < s.size()) {
    const unicode::Utf8Step step = unicode::decode_utf8_step(s.data() + i, s.size() - i);
    const bool control = step.valid && (step.cp < 0x20 || step.cp == 0x7f);
    if (step.valid && !control && step.cp != '\\') {
      out.append(s, i, size_t(step.len));
    } else {
      char buf[8];
      for (int k = 0; k < step.len; ++k) {
        std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned char>(s[i + k]));
        out += buf;
      }
    }
    i += size_t(step.len);
  }
  return out + "'";
}

// Names (keys, tensors) must be text: a name that is not well-formed UTF-8 is refused.
bool valid_utf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const unicode::Utf8Step step = unicode::decode_utf8_step(s.data() + i, s.size() - i);
    if (!step.valid) return false;
    i += size_t(step.len);
  }
  return true;
}

std::string hex_bytes(const uint8_t* p, size_t n) {
  std::string out;
  char buf[4];
  for (size_t i = 0; i < n; ++i) {
    std::snprintf(buf, sizeof(buf), "%s%02x", i ? " " : "", p[i]);
    out += buf;
  }
  return out;
}

class Parser {
 public:
  Parser(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  size_t pos() const { return pos_; }
  size_t remaining() const { return size_ - pos_; }
  void set_context(std::string context) { context_ = std::move(context); }
  const std::string& context() const { return context_; }

  [[noreturn]] void fail(const std::string& msg) const {
    throw GGUFError(context_.empty() ? msg : context_ + ": " + msg);
  }

  void need(uint64_t n, const char* what) const {
    if (n > remaining()) {
      fail(std::string("unexpected end of file at byte offset ") + std::to_string(pos_) + ": " +
           what + " needs " + std::to_string(n) + " bytes, " + std::to_string(remaining()) +
           " left");
    }
  }

  template <typename T>
  T read(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }

  std::string read_string(const char* what) {
    const size_t at = pos_;
    const uint64_t len = read<uint64_t>(what);
    if (len > remaining()) {
      fail(std::string(what) + ": string length " + std::to_string(len) + " at byte offset " +
           std::to_string(at) + " exceeds the " + std::to_string(remaining()) +
           " bytes left in the file");
    }
    std::string s(reinterpret_cast<const char*>(data_ + pos_), static_cast<size_t>(len));
    pos_ += static_cast<size_t>(len);
    return s;
  }

  // Fails unless count items of at least item_bytes each fit in what is left of the file.
  void check_count(uint64_t count, uint64_t item_bytes, size_t at, const char* what) const {
    uint64_t total = 0;
    if (mul_overflows(count, item_bytes, &total) || total > remaining()) {
      fail(std::string(what) + " " + std::to_string(count) + " at byte offset " +
           std::to_string(at) + " is impossible: each entry takes at least " +
           std::to_string(item_bytes) + " bytes and only " + std::to_string(remaining()) +
           " bytes are left in the file");
    }
  }

  GGUFType read_value_type(const char* what) {
    const size_t at = pos_;
    const uint32_t t = read<uint32_t>(what);
    if (!valid_value_type(t)) {
      fail(std::string("unknown ") + what + " " + std::to_string(t) + " at byte offset " +
           std::to_string(at) + " (expected 0 to 12)");
    }
    return static_cast<GGUFType>(t);
  }

  void read_value(GGUFType type, int depth, GGUFValue* out) {
    out->type = type;
    switch (type) {
      case GGUFType::UINT8:
        set_unsigned(out, read<uint8_t>("uint8 value"));
        break;
      case GGUFType::INT8:
        set_signed(out, read<int8_t>("int8 value"));
        break;
      case GGUFType::UINT16:
        set_unsigned(out, read<uint16_t>("uint16 value"));
        break;
      case GGUFType::INT16:
        set_signed(out, read<int16_t>("int16 value"));
        break;
      case GGUFType::UINT32:
        set_unsigned(out, read<uint32_t>("uint32 value"));
        break;
      case GGUFType::INT32:
        set_signed(out, read<int32_t>("int32 value"));
        break;
      case GGUFType::UINT64:
        set_unsigned(out, read<uint64_t>("uint64 value"));
        break;
      case GGUFType::INT64:
        set_signed(out, read<int64_t>("int64 value"));
        break;
      case GGUFType::FLOAT32:
        out->f = read<float>("float32 value");
        break;
      case GGUFType::FLOAT64:
        out->f = read<double>("float64 value");
        break;
      case GGUFType::BOOL: {
        const size_t at = pos_;
        const uint8_t b = read<uint8_t>("bool value");
        if (b > 1) {
          fail("bool value " + std::to_string(b) + " at byte offset " + std::to_string(at) +
               " (expected 0 or 1)");
        }
        out->b = b != 0;
        break;
      }
      case GGUFType::STRING:
        out->str = read_string("string value");
        break;
      case GGUFType::ARRAY:
        read_array(depth, out);
        break;
    }
  }

  uint64_t n_values() const { return n_values_; }

 private:
  static void set_unsigned(GGUFValue* v, uint64_t x) {
    v->u = x;
    v->i = x <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ? static_cast<int64_t>(x)
                                                                           : 0;
  }
  static void set_signed(GGUFValue* v, int64_t x) {
    v->i = x;
    v->u = x >= 0 ? static_cast<uint64_t>(x) : 0;
  }

  void read_array(int depth, GGUFValue* out) {
    const GGUFType elem = read_value_type("array element type");
    if (elem == GGUFType::ARRAY && depth + 1 >= kMaxArrayDepth) {
      fail("arrays nested deeper than " + std::to_string(kMaxArrayDepth) +
           " levels at byte offset " + std::to_string(pos_));
    }
    const size_t at = pos_;
    const uint64_t count = read<uint64_t>("array length");
    check_count(count, min_value_bytes(elem), at, "array length");
    n_values_ += count;
    if (n_values_ > kMaxMetadataValues) {
      fail("array length " + std::to_string(count) + " at byte offset " + std::to_string(at) +
           " brings the metadata to " + std::to_string(n_values_) + " values (limit " +
           std::to_string(kMaxMetadataValues) + ")");
    }
    out->arr_type = elem;
    // Grow with what is actually parsed, so a corrupt count fails before it allocates much.
    out->arr.reserve(static_cast<size_t>(std::min<uint64_t>(count, 4096)));
    for (uint64_t k = 0; k < count; ++k) {
      out->arr.emplace_back();
      read_value(elem, depth + 1, &out->arr.back());
    }
  }

  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
  std::string context_;
  uint64_t n_values_ = 0;
};

std::string type_mismatch(const std::string& key, const char* expected, const GGUFValue& v) {
  std::string found = gguf_type_name(v.type);
  if (v.type == GGUFType::ARRAY) found += std::string(" of ") + gguf_type_name(v.arr_type);
  return "metadata key " + quoted(key) + ": expected " + expected + ", found " + found;
}

bool is_int_type(GGUFType t) {
  switch (t) {
    case GGUFType::UINT8:
    case GGUFType::INT8:
    case GGUFType::UINT16:
    case GGUFType::INT16:
    case GGUFType::UINT32:
    case GGUFType::INT32:
    case GGUFType::UINT64:
    case GGUFType::INT64:
      return true;
    default:
      return false;
  }
}

bool is_signed_type(GGUFType t) {
  return t == GGUFType::INT8 || t == GGUFType::INT16 || t == GGUFType::INT32 ||
         t == GGUFType::INT64;
}

bool is_float_type(GGUFType t) { return t == GGUFType::FLOAT32 || t == GGUFType::FLOAT64; }

// Integer value as int64; false when an unsigned value exceeds INT64_MAX.
bool int_value(const GGUFValue& v, int64_t* out) {
  if (is_signed_type(v.type)) {
    *out = v.i;
    return true;
  }
  if (v.u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
  *out = static_cast<int64_t>(v.u);
  return true;
}

double numeric_value(const GGUFValue& v) {
  if (is_float_type(v.type)) return v.f;
  if (is_signed_type(v.type)) return static_cast<double>(v.i);
  return static_cast<double>(v.u);
}

}  // namespace

const char* gguf_type_name(GGUFType t) {
  switch (t) {
    case GGUFType::UINT8:
      return "uint8";
    case GGUFType::INT8:
      return "int8";
    case GGUFType::UINT16:
      return "uint16";
    case GGUFType::INT16:
      return "int16";
    case GGUFType::UINT32:
      return "uint32";
    case GGUFType::INT32:
      return "int32";
    case GGUFType::FLOAT32:
      return "float32";
    case GGUFType::BOOL:
      return "bool";
    case GGUFType::STRING:
      return "string";
    case GGUFType::ARRAY:
      return "array";
    case GGUFType::UINT64:
      return "uint64";
    case GGUFType::INT64:
      return "int64";
    case GGUFType::FLOAT64:
      return "float64";
  }
  return "unknown";
}

bool GGUFValue::is_int() const { return is_int_type(type); }

std::string GGUFTensorInfo::shape_str() const {
  std::string s;
  for (int d = 0; d < n_dims; ++d) {
    if (d) s += 'x';
    s += std::to_string(ne[d]);
  }
  return s;
}

std::unique_ptr<GGUFFile> GGUFFile::open(const std::string& path, bool use_mmap) {
  std::unique_ptr<GGUFFile> file(new GGUFFile());
  file->path_ = path;
  // Non-blocking, so that a FIFO or a device fails the regular-file check below instead of
  // blocking the open.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    throw GGUFError("cannot open " + quoted(path) + ": " + std::strerror(errno));
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw GGUFError("cannot stat " + quoted(path) + ": " + std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw GGUFError(quoted(path) + " is not a regular file");
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size == 0) {
    ::close(fd);
    throw GGUFError(quoted(path) + ": file is empty (expected a GGUF header)");
  }
  if (use_mmap) {
    void* p = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    const int map_err = errno;
    ::close(fd);
    if (p == MAP_FAILED) {
      throw GGUFError("cannot map " + quoted(path) + " (" + std::to_string(size) +
                      " bytes): " + std::strerror(map_err));
    }
    file->base_ = static_cast<const uint8_t*>(p);
    file->mapped_ = true;
  } else {
    // Read into memory aligned as a mapping would be: later changes to the file do not reach
    // the model. The descriptor is non-blocking, which a regular file ignores.
    constexpr size_t kAlign = 64;
    try {
      file->owned_.resize(size + kAlign);
    } catch (const std::bad_alloc&) {
      ::close(fd);
      throw GGUFError("cannot read " + quoted(path) + " into memory (" + std::to_string(size) +
                      " bytes): out of memory");
    }
    const uintptr_t raw = reinterpret_cast<uintptr_t>(file->owned_.data());
    uint8_t* base = file->owned_.data() + ((kAlign - raw % kAlign) % kAlign);
    size_t done = 0;
    while (done < size) {
      const ssize_t got = ::pread(fd, base + done, size - done, off_t(done));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) {
        const int err = got < 0 ? errno : 0;
        ::close(fd);
        throw GGUFError("cannot read " + quoted(path) + ": " +
                        (err ? std::strerror(err) : "the file shrank while it was read"));
      }
      done += size_t(got);
    }
    ::close(fd);
    file->base_ = base;
  }
  file->size_ = size;
  try {
    file->parse();
  } catch (const GGUFError& e) {
    throw GGUFError(path + ": " + e.what());
  }
  return file;
}

std::unique_ptr<GGUFFile> GGUFFile::from_bytes(const void* data, size_t size) {
  std::unique_ptr<GGUFFile> file(new GGUFFile());
  // Over-allocate so the image starts 64-byte aligned, as a mapping would be.
  constexpr size_t kAlign = 64;
  file->owned_.resize(size + kAlign);
  const uintptr_t raw = reinterpret_cast<uintptr_t>(file->owned_.data());
  uint8_t* base = file->owned_.data() + ((kAlign - raw % kAlign) % kAlign);
  if (size > 0) std::memcpy(base, data, size);
  file->base_ = base;
  file->size_ = size;
  file->parse();
  return file;
}

GGUFFile::~GGUFFile() {
  if (mapped_) munmap(const_cast<uint8_t*>(base_), size_);
}

void GGUFFile::parse() {
  Parser p(base_, size_);

  p.set_context("header");
  p.need(4, "magic");
  if (std::memcmp(base_, "GGUF", 4) != 0) {
    p.fail("bad magic at byte offset 0: expected 'GGUF' (47 47 55 46), found " +
           hex_bytes(base_, 4));
  }
  p.read<uint32_t>("magic");
  version_ = p.read<uint32_t>("version");
  if (version_ == 1) {
    p.fail("GGUF version 1 is not supported (expected version 2 or 3)");
  }
  if (version_ != 2 && version_ != 3) {
    if (__builtin_bswap32(version_) == 2 || __builtin_bswap32(version_) == 3) {
      p.fail("version field reads " + std::to_string(version_) +
             ": a big-endian GGUF file, only little-endian files are supported");
    }
    p.fail("unsupported GGUF version " + std::to_string(version_) + " (expected 2 or 3)");
  }
  const size_t n_tensors_at = p.pos();
  const uint64_t n_tensors = p.read<uint64_t>("tensor count");
  const size_t n_kv_at = p.pos();
  const uint64_t n_kv = p.read<uint64_t>("metadata count");
  p.check_count(n_kv, kMinKVBytes, n_kv_at, "metadata count");
  p.check_count(n_tensors, kMinTensorInfoBytes, n_tensors_at, "tensor count");

  for (uint64_t i = 0; i < n_kv; ++i) {
    const size_t entry_at = p.pos();
    p.set_context("metadata entry #" + std::to_string(i) + " at byte offset " +
                  std::to_string(entry_at));
    std::string key = p.read_string("key");
    p.set_context("metadata key " + quoted(key) + " (entry #" + std::to_string(i) +
                  " at byte offset " + std::to_string(entry_at) + ")");
    if (!valid_utf8(key)) p.fail("the key is not valid UTF-8");
    if (kv_.count(key)) p.fail("duplicate key");
    GGUFValue value;
    value.type = p.read_value_type("value type");
    p.read_value(value.type, 0, &value);
    kv_.emplace(std::move(key), std::move(value));
  }

  p.set_context("");
  if (const GGUFValue* a = find("general.alignment")) {
    int64_t align = 0;
    if (!a->is_int() || !int_value(*a, &align) || align <= 0 || (align & (align - 1)) != 0 ||
        align > std::numeric_limits<uint32_t>::max()) {
      const std::string found =
          a->is_int() ? (is_signed_type(a->type) ? std::to_string(a->i) : std::to_string(a->u))
                      : std::string("a ") + gguf_type_name(a->type);
      p.fail("metadata key 'general.alignment': expected a non-zero power of two, found " + found);
    }
    alignment_ = static_cast<size_t>(align);
  }

  for (uint64_t i = 0; i < n_tensors; ++i) {
    const size_t entry_at = p.pos();
    p.set_context("tensor #" + std::to_string(i) + " at byte offset " + std::to_string(entry_at));
    GGUFTensorInfo t;
    t.name = p.read_string("name");
    p.set_context("tensor " + quoted(t.name) + " (entry #" + std::to_string(i) +
                  " at byte offset " + std::to_string(entry_at) + ")");
    if (!valid_utf8(t.name)) p.fail("the name is not valid UTF-8");
    if (tensor_index_.count(t.name)) p.fail("duplicate tensor name");
    const uint32_t n_dims = p.read<uint32_t>("n_dims");
    if (n_dims < 1 || n_dims > kMaxDims) {
      p.fail("n_dims " + std::to_string(n_dims) + ": expected 1 to " + std::to_string(kMaxDims));
    }
    t.n_dims = static_cast<int>(n_dims);
    for (int d = 0; d < t.n_dims; ++d) {
      const uint64_t ne = p.read<uint64_t>("dimension");
      if (ne == 0 || ne > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        p.fail("dimension " + std::to_string(d) + " is " + std::to_string(ne) +
               " (expected 1 to 2^63-1)");
      }
      t.ne[d] = static_cast<int64_t>(ne);
    }
    const size_t type_at = p.pos();
    const uint32_t type_id = p.read<uint32_t>("type");
    const TypeTraits* traits = type_traits_or_null(type_id);
    if (traits == nullptr) {
      p.fail("unknown ggml type id " + std::to_string(type_id) + " at byte offset " +
             std::to_string(type_at));
    }
    t.type = static_cast<DType>(type_id);
    t.offset = p.read<uint64_t>("data offset");

    uint64_t n_elements = 1;
    for (int d = 0; d < t.n_dims; ++d) {
      if (mul_overflows(n_elements, static_cast<uint64_t>(t.ne[d]), &n_elements) ||
          n_elements > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        p.fail("shape " + t.shape_str() + " has more than 2^63-1 elements");
      }
    }
    if (t.ne[0] % traits->block_size != 0) {
      p.fail("ne[0] = " + std::to_string(t.ne[0]) + " is not a multiple of the " + traits->name +
             " block size " + std::to_string(traits->block_size));
    }
    uint64_t nbytes = 0;
    if (mul_overflows(n_elements / traits->block_size, traits->type_size, &nbytes) ||
        nbytes > std::numeric_limits<size_t>::max()) {
      p.fail("shape " + t.shape_str() + " of " + traits->name + " overflows the byte size");
    }
    t.nbytes = static_cast<size_t>(nbytes);
    tensor_index_.emplace(t.name, tensors_.size());
    tensors_.push_back(std::move(t));
  }

  p.set_context("");
  // The data section starts at the header's end rounded up to the alignment.
  const uint64_t header_end = p.pos();
  const uint64_t data_start = (header_end + alignment_ - 1) / alignment_ * alignment_;
  // ggml's layout: the tensors' data in the order of their entries, each at the running size of
  // the ones before it padded to the alignment (so no two overlap).
  uint64_t expected = 0;
  for (GGUFTensorInfo& t : tensors_) {
    if (t.offset != expected) {
      throw GGUFError("tensor " + quoted(t.name) + ": data offset " + std::to_string(t.offset) +
                      ", expected " + std::to_string(expected) +
                      " (ggml lays tensors out in the order of their entries, each padded to "
                      "the alignment " +
                      std::to_string(alignment_) + ")");
    }
    const uint64_t padded = (uint64_t(t.nbytes) + alignment_ - 1) / alignment_ * alignment_;
    if (__builtin_add_overflow(expected, padded, &expected))
      throw GGUFError("tensor " + quoted(t.name) + ": the data sizes overflow");
    uint64_t begin = 0;
    uint64_t end = 0;
    const bool overflow = __builtin_add_overflow(data_start, t.offset, &begin) ||
                          __builtin_add_overflow(begin, t.nbytes, &end);
    if (overflow || end > size_) {
      throw GGUFError("tensor " + quoted(t.name) + ": data [offset " +
                      (overflow ? std::to_string(data_start) + "+" + std::to_string(t.offset)
                                : std::to_string(begin)) +
                      ", " + std::to_string(t.nbytes) + " bytes] runs past the end of the file (" +
                      std::to_string(size_) + " bytes)");
    }
    t.data = base_ + begin;
  }
}

const GGUFValue* GGUFFile::find(const std::string& key) const {
  auto it = kv_.find(key);
  return it == kv_.end() ? nullptr : &it->second;
}

namespace {
const GGUFValue& require(const GGUFFile& f, const std::string& key) {
  const GGUFValue* v = f.find(key);
  if (v == nullptr) throw GGUFError("metadata key " + quoted(key) + " is missing");
  return *v;
}
}  // namespace

std::string GGUFFile::get_string(const std::string& key) const {
  const GGUFValue& v = require(*this, key);
  if (v.type != GGUFType::STRING) throw GGUFError(type_mismatch(key, "string", v));
  return v.str;
}

std::string GGUFFile::get_string(const std::string& key, const std::string& def) const {
  return has(key) ? get_string(key) : def;
}

int64_t GGUFFile::get_int(const std::string& key) const {
  const GGUFValue& v = require(*this, key);
  if (!v.is_int()) throw GGUFError(type_mismatch(key, "an integer", v));
  int64_t out = 0;
  if (!int_value(v, &out)) {
    throw GGUFError("metadata key " + quoted(key) + ": value " + std::to_string(v.u) +
                    " does not fit in int64");
  }
  return out;
}

int64_t GGUFFile::get_int(const std::string& key, int64_t def) const {
  return has(key) ? get_int(key) : def;
}

double GGUFFile::get_float(const std::string& key) const {
  const GGUFValue& v = require(*this, key);
  if (!is_float_type(v.type) && !v.is_int()) throw GGUFError(type_mismatch(key, "a number", v));
  return numeric_value(v);
}

double GGUFFile::get_float(const std::string& key, double def) const {
  return has(key) ? get_float(key) : def;
}

bool GGUFFile::get_bool(const std::string& key, bool def) const {
  const GGUFValue* v = find(key);
  if (v == nullptr) return def;
  if (v->type != GGUFType::BOOL) throw GGUFError(type_mismatch(key, "bool", *v));
  return v->b;
}

std::vector<std::string> GGUFFile::get_string_array(const std::string& key) const {
  const GGUFValue& v = require(*this, key);
  if (v.type != GGUFType::ARRAY || v.arr_type != GGUFType::STRING) {
    throw GGUFError(type_mismatch(key, "array of string", v));
  }
  std::vector<std::string> out;
  out.reserve(v.arr.size());
  for (const GGUFValue& e : v.arr) out.push_back(e.str);
  return out;
}

std::vector<float> GGUFFile::get_float_array(const std::string& key) const {
  const GGUFValue& v = require(*this, key);
  if (v.type != GGUFType::ARRAY || !(is_float_type(v.arr_type) || is_int_type(v.arr_type))) {
    throw GGUFError(type_mismatch(key, "array of numbers", v));
  }
  std::vector<float> out;
  out.reserve(v.arr.size());
  for (const GGUFValue& e : v.arr) out.push_back(static_cast<float>(numeric_value(e)));
  return out;
}

std::vector<int32_t> GGUFFile::get_int_array(const std::string& key) const {
  const GGUFValue& v = require(*this, key);
  if (v.type != GGUFType::ARRAY || !is_int_type(v.arr_type)) {
    throw GGUFError(type_mismatch(key, "array of integers", v));
  }
  std::vector<int32_t> out;
  out.reserve(v.arr.size());
  for (size_t i = 0; i < v.arr.size(); ++i) {
    const GGUFValue& e = v.arr[i];
    int64_t x = 0;
    if (!int_value(e, &x) || x < std::numeric_limits<int32_t>::min() ||
        x > std::numeric_limits<int32_t>::max()) {
      throw GGUFError("metadata key " + quoted(key) + ": element " + std::to_string(i) + " (" +
                      (is_signed_type(e.type) ? std::to_string(e.i) : std::to_string(e.u)) +
                      ") does not fit in int32");
    }
    out.push_back(static_cast<int32_t>(x));
  }
  return out;
}

const GGUFTensorInfo* GGUFFile::tensor(const std::string& name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

}  // namespace ggraph
