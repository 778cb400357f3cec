// GGUF reader: valid v2/v3 images parse completely; malformed images raise GGUFError naming the
// problem. Images are built in memory by a small writer that follows the GGUF specification.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gguf.h"
#include "quant.h"

namespace ggraph {
namespace {

// Appends little-endian GGUF fields to a byte buffer.
class Writer {
 public:
  template <typename T>
  size_t put(T v) {
    const size_t at = buf.size();
    buf.resize(at + sizeof(T));
    std::memcpy(buf.data() + at, &v, sizeof(T));
    return at;
  }
  size_t str(const std::string& s) {
    const size_t at = put<uint64_t>(s.size());
    buf.insert(buf.end(), s.begin(), s.end());
    return at;
  }
  // A key followed by its value type; returns the position of the type field.
  size_t key(const std::string& k, GGUFType t) {
    str(k);
    return put<uint32_t>(static_cast<uint32_t>(t));
  }
  size_t header(uint32_t version, uint64_t n_tensors, uint64_t n_kv) {
    buf.insert(buf.end(), {'G', 'G', 'U', 'F'});
    put<uint32_t>(version);
    put<uint64_t>(n_tensors);
    return put<uint64_t>(n_kv);
  }
  // Writes a tensor entry; returns the position of its n_dims field.
  size_t tensor(const std::string& name, std::vector<uint64_t> ne, uint32_t type, uint64_t offset) {
    str(name);
    const size_t at = put<uint32_t>(static_cast<uint32_t>(ne.size()));
    for (uint64_t n : ne) put<uint64_t>(n);
    put<uint32_t>(type);
    put<uint64_t>(offset);
    return at;
  }
  void pad_to(size_t alignment) {
    while (buf.size() % alignment) buf.push_back(0);
  }
  template <typename T>
  void patch(size_t at, T v) {
    std::memcpy(buf.data() + at, &v, sizeof(T));
  }

  std::vector<uint8_t> buf;
};

constexpr uint32_t kF32 = static_cast<uint32_t>(DType::F32);
constexpr uint32_t kF16 = static_cast<uint32_t>(DType::F16);
constexpr uint32_t kQ8_0 = static_cast<uint32_t>(DType::Q8_0);

// Positions of fields in the valid image, for corrupting one field at a time.
struct Image {
  std::vector<uint8_t> bytes;
  size_t version_at = 0;
  size_t n_tensors_at = 0;
  size_t n_kv_at = 0;
  size_t first_key_at = 0;   // length field of the first key
  size_t str_value_at = 0;   // length field of a string value
  size_t u32_type_at = 0;    // value-type field of a uint32 entry
  size_t array_len_at = 0;   // length field of an int32 array
  size_t array_elem_at = 0;  // element-type field of that array
  size_t alignment_at = 0;   // value of general.alignment
  size_t bool_at = 0;        // value of a bool entry
  size_t tensor_a_at = 0;    // n_dims field of tensor 'a' (then dims, type, offset)
  size_t tensor_b_at = 0;    // n_dims field of tensor 'b'
  size_t data_start = 0;
};

// A complete image: metadata of every type, three tensors, data filled with known bytes.
Image valid_image(uint32_t version = 3, uint32_t alignment = 64) {
  Image im;
  Writer w;
  w.header(version, 3, 19);
  im.version_at = 4;
  im.n_tensors_at = 8;
  im.n_kv_at = 16;
  im.first_key_at = w.buf.size();
  w.key("general.architecture", GGUFType::STRING);
  im.str_value_at = w.str("llama");
  w.key("general.alignment", GGUFType::UINT32);
  im.alignment_at = w.put<uint32_t>(alignment);
  w.key("t.u8", GGUFType::UINT8), w.put<uint8_t>(200);
  w.key("t.i8", GGUFType::INT8), w.put<int8_t>(-100);
  w.key("t.u16", GGUFType::UINT16), w.put<uint16_t>(60000);
  w.key("t.i16", GGUFType::INT16), w.put<int16_t>(-30000);
  im.u32_type_at = w.key("t.u32", GGUFType::UINT32);
  w.put<uint32_t>(4000000000u);
  w.key("t.i32", GGUFType::INT32), w.put<int32_t>(-2000000000);
  w.key("t.u64", GGUFType::UINT64), w.put<uint64_t>(uint64_t{1} << 40);
  w.key("t.u64max", GGUFType::UINT64), w.put<uint64_t>(std::numeric_limits<uint64_t>::max());
  w.key("t.i64", GGUFType::INT64), w.put<int64_t>(-(int64_t{1} << 40));
  w.key("t.f32", GGUFType::FLOAT32), w.put<float>(1.5f);
  w.key("t.f64", GGUFType::FLOAT64), w.put<double>(-2.25);
  w.key("t.bool", GGUFType::BOOL);
  im.bool_at = w.put<uint8_t>(1);
  w.key("t.strs", GGUFType::ARRAY), w.put<uint32_t>(8), w.put<uint64_t>(3);
  w.str("a"), w.str("bc"), w.str("");
  w.key("t.ints", GGUFType::ARRAY);
  im.array_elem_at = w.put<uint32_t>(static_cast<uint32_t>(GGUFType::INT32));
  im.array_len_at = w.put<uint64_t>(3);
  w.put<int32_t>(1), w.put<int32_t>(-2), w.put<int32_t>(3);
  w.key("t.floats", GGUFType::ARRAY), w.put<uint32_t>(6), w.put<uint64_t>(2);
  w.put<float>(0.5f), w.put<float>(-1.0f);
  // [[1, 2], [3]] as an array of arrays of uint16.
  w.key("t.nested", GGUFType::ARRAY), w.put<uint32_t>(9), w.put<uint64_t>(2);
  w.put<uint32_t>(2), w.put<uint64_t>(2), w.put<uint16_t>(1), w.put<uint16_t>(2);
  w.put<uint32_t>(2), w.put<uint64_t>(1), w.put<uint16_t>(3);
  w.key("t.empty", GGUFType::ARRAY), w.put<uint32_t>(8), w.put<uint64_t>(0);

  // Tensors: a = F32 4x2 (32 bytes), b = Q8_0 64 (68 bytes), c = F16 3 (6 bytes), each aligned.
  const uint64_t off_b = (32 + alignment - 1) / alignment * alignment;
  const uint64_t off_c = (off_b + 68 + alignment - 1) / alignment * alignment;
  im.tensor_a_at = w.tensor("a", {4, 2}, kF32, 0);
  im.tensor_b_at = w.tensor("b", {64}, kQ8_0, off_b);
  w.tensor("c", {3}, kF16, off_c);
  w.pad_to(alignment);
  im.data_start = w.buf.size();
  for (int i = 0; i < 8; ++i) w.put<float>(static_cast<float>(i));
  w.pad_to(alignment);
  for (int i = 0; i < 68; ++i) w.put<uint8_t>(static_cast<uint8_t>(i));
  w.pad_to(alignment);
  w.put<uint16_t>(0x3c00), w.put<uint16_t>(0x4000), w.put<uint16_t>(0xc000);
  im.bytes = std::move(w.buf);
  return im;
}

std::unique_ptr<GGUFFile> parse(const std::vector<uint8_t>& bytes) {
  return GGUFFile::from_bytes(bytes.data(), bytes.size());
}

// The message of the GGUFError that parsing raises; fails the test when nothing is raised.
std::string parse_error(const std::vector<uint8_t>& bytes) {
  try {
    parse(bytes);
  } catch (const GGUFError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a GGUFError, the image parsed";
  return "";
}

#define EXPECT_ERROR_HAS(msg, part) \
  EXPECT_NE((msg).find(part), std::string::npos) << "message: " << (msg) << "\nmissing: " << (part)

void check_valid(const GGUFFile& f, uint32_t version, size_t alignment, size_t data_start) {
  EXPECT_EQ(f.version(), version);
  EXPECT_EQ(f.alignment(), alignment);
  EXPECT_EQ(f.metadata().size(), 19u);
  EXPECT_EQ(f.get_string("general.architecture"), "llama");
  EXPECT_EQ(f.get_int("t.u8"), 200);
  EXPECT_EQ(f.get_int("t.i8"), -100);
  EXPECT_EQ(f.get_int("t.u16"), 60000);
  EXPECT_EQ(f.get_int("t.i16"), -30000);
  EXPECT_EQ(f.get_int("t.u32"), 4000000000LL);
  EXPECT_EQ(f.get_int("t.i32"), -2000000000LL);
  EXPECT_EQ(f.get_int("t.u64"), int64_t{1} << 40);
  EXPECT_EQ(f.get_int("t.i64"), -(int64_t{1} << 40));
  EXPECT_EQ(f.find("t.u64max")->u, std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(f.get_float("t.f32"), 1.5);
  EXPECT_EQ(f.get_float("t.f64"), -2.25);
  EXPECT_EQ(f.get_float("t.i16"), -30000.0);
  EXPECT_TRUE(f.get_bool("t.bool", false));
  EXPECT_EQ(f.get_string_array("t.strs"), (std::vector<std::string>{"a", "bc", ""}));
  EXPECT_EQ(f.get_int_array("t.ints"), (std::vector<int32_t>{1, -2, 3}));
  EXPECT_EQ(f.get_float_array("t.floats"), (std::vector<float>{0.5f, -1.0f}));
  EXPECT_EQ(f.get_float_array("t.ints"), (std::vector<float>{1.0f, -2.0f, 3.0f}));
  EXPECT_TRUE(f.get_string_array("t.empty").empty());

  const GGUFValue* nested = f.find("t.nested");
  ASSERT_NE(nested, nullptr);
  EXPECT_EQ(nested->type, GGUFType::ARRAY);
  EXPECT_EQ(nested->arr_type, GGUFType::ARRAY);
  ASSERT_EQ(nested->arr.size(), 2u);
  EXPECT_EQ(nested->arr[0].arr_type, GGUFType::UINT16);
  ASSERT_EQ(nested->arr[0].arr.size(), 2u);
  EXPECT_EQ(nested->arr[0].arr[1].u, 2u);
  ASSERT_EQ(nested->arr[1].arr.size(), 1u);
  EXPECT_EQ(nested->arr[1].arr[0].u, 3u);
  EXPECT_TRUE(nested->arr[1].arr[0].is_int());

  ASSERT_EQ(f.tensors().size(), 3u);
  const GGUFTensorInfo* a = f.tensor("a");
  const GGUFTensorInfo* b = f.tensor("b");
  const GGUFTensorInfo* c = f.tensor("c");
  ASSERT_TRUE(a && b && c);
  EXPECT_EQ(f.tensor("d"), nullptr);
  EXPECT_EQ(a->type, DType::F32);
  EXPECT_EQ(a->n_dims, 2);
  EXPECT_EQ(a->ne[0], 4);
  EXPECT_EQ(a->ne[1], 2);
  EXPECT_EQ(a->ne[2], 1);
  EXPECT_EQ(a->n_elements(), 8);
  EXPECT_EQ(a->shape_str(), "4x2");
  EXPECT_EQ(a->nbytes, 32u);
  EXPECT_EQ(b->type, DType::Q8_0);
  EXPECT_EQ(b->nbytes, 68u);
  EXPECT_EQ(c->type, DType::F16);
  EXPECT_EQ(c->nbytes, 6u);
  EXPECT_EQ(c->shape_str(), "3");

  const uint8_t* base = a->data - data_start;
  EXPECT_EQ(a->offset, 0u);
  EXPECT_EQ(static_cast<size_t>(b->data - a->data), b->offset);
  EXPECT_EQ(b->offset % alignment, 0u);
  EXPECT_EQ(c->offset % alignment, 0u);
  float a_vals[8];
  std::memcpy(a_vals, a->data, sizeof(a_vals));
  for (int i = 0; i < 8; ++i) EXPECT_EQ(a_vals[i], static_cast<float>(i));
  for (int i = 0; i < 68; ++i) EXPECT_EQ(b->data[i], i);
  uint16_t c_vals[3];
  std::memcpy(c_vals, c->data, sizeof(c_vals));
  EXPECT_EQ(c_vals[2], 0xc000);
  EXPECT_EQ(c->data + c->nbytes, base + f.file_size());
}

TEST(GGUF, ParsesV3WithEveryValueType) {
  const Image im = valid_image(3, 64);
  auto f = parse(im.bytes);
  check_valid(*f, 3, 64, im.data_start);
}

TEST(GGUF, ParsesV2WithDefaultAlignment) {
  Image im = valid_image(2, 32);
  // Renaming general.alignment leaves the default of 32 in force.
  std::memcpy(im.bytes.data() + im.alignment_at - 4 - std::strlen("general.alignment"),
              "general.alignmenX", 17);
  auto f = parse(im.bytes);
  EXPECT_FALSE(f->has("general.alignment"));
  EXPECT_TRUE(f->has("general.alignmenX"));
  EXPECT_EQ(f->metadata().size(), 19u);
  check_valid(*f, 2, 32, im.data_start);
}

TEST(GGUF, TypedGettersCheckTypes) {
  auto f = parse(valid_image().bytes);
  std::string msg;
  try {
    f->get_int("general.architecture");
  } catch (const GGUFError& e) {
    msg = e.what();
  }
  EXPECT_ERROR_HAS(msg, "'general.architecture'");
  EXPECT_ERROR_HAS(msg, "found string");
  EXPECT_THROW(f->get_int("t.u64max"), GGUFError);
  EXPECT_THROW(f->get_int("t.bool"), GGUFError);
  EXPECT_THROW(f->get_float("t.strs"), GGUFError);
  EXPECT_THROW(f->get_string("t.u8"), GGUFError);
  EXPECT_THROW(f->get_bool("t.u8", true), GGUFError);
  EXPECT_THROW(f->get_string_array("t.ints"), GGUFError);
  EXPECT_THROW(f->get_int_array("t.floats"), GGUFError);
  EXPECT_THROW(f->get_int_array("t.nested"), GGUFError);
  EXPECT_THROW(f->get_float_array("t.strs"), GGUFError);
  EXPECT_THROW(f->get_string_array("general.architecture"), GGUFError);
  try {
    f->get_int("no.such.key");
    ADD_FAILURE() << "missing key returned a value";
  } catch (const GGUFError& e) {
    msg = e.what();
  }
  EXPECT_ERROR_HAS(msg, "'no.such.key' is missing");
  EXPECT_EQ(f->get_int("no.such.key", 7), 7);
  EXPECT_EQ(f->get_float("no.such.key", 0.25), 0.25);
  EXPECT_EQ(f->get_string("no.such.key", "x"), "x");
  EXPECT_FALSE(f->get_bool("no.such.key", false));
  EXPECT_FALSE(f->has("no.such.key"));
  EXPECT_TRUE(f->find("t.u8")->is_int());
  EXPECT_FALSE(f->find("t.f32")->is_int());
  EXPECT_FALSE(f->find("t.bool")->is_int());
}

TEST(GGUF, IntArrayRejectsValuesOutsideInt32) {
  Writer w;
  w.header(3, 0, 1);
  w.key("big", GGUFType::ARRAY), w.put<uint32_t>(4), w.put<uint64_t>(2);
  w.put<uint32_t>(5), w.put<uint32_t>(3000000000u);
  auto f = parse(w.buf);
  try {
    f->get_int_array("big");
    ADD_FAILURE() << "3000000000 was accepted as int32";
  } catch (const GGUFError& e) {
    EXPECT_ERROR_HAS(std::string(e.what()), "element 1 (3000000000)");
  }
}

TEST(GGUF, TypeNames) {
  EXPECT_STREQ(gguf_type_name(GGUFType::UINT32), "uint32");
  EXPECT_STREQ(gguf_type_name(GGUFType::ARRAY), "array");
  EXPECT_STREQ(gguf_type_name(GGUFType::FLOAT64), "float64");
  EXPECT_STREQ(gguf_type_name(static_cast<GGUFType>(99)), "unknown");
}

TEST(GGUF, EveryTruncationThrows) {
  const Image im = valid_image();
  for (size_t n = 0; n < im.bytes.size(); ++n) {
    std::vector<uint8_t> prefix(im.bytes.begin(), im.bytes.begin() + n);
    const std::string msg = parse_error(prefix);
    const bool names_end = msg.find("unexpected end of file") != std::string::npos ||
                           msg.find("runs past the end of the file") != std::string::npos ||
                           msg.find("left in the file") != std::string::npos;
    EXPECT_TRUE(names_end) << "prefix of " << n << " bytes: " << msg;
  }
}

TEST(GGUF, RandomCorruptionNeverCrashes) {
  const Image im = valid_image();
  std::mt19937 rng(1234);
  int parsed = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    std::vector<uint8_t> bytes = im.bytes;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < flips; ++k) {
      // Corrupt the header region, where every byte is a length, count, type or offset.
      bytes[rng() % im.data_start] = static_cast<uint8_t>(rng());
    }
    try {
      parse(bytes);
      ++parsed;
    } catch (const GGUFError&) {
    }
  }
  EXPECT_LT(parsed, 3000);
}

TEST(GGUF, BadMagic) {
  Image im = valid_image();
  im.bytes[0] = 'g';
  const std::string msg = parse_error(im.bytes);
  EXPECT_ERROR_HAS(msg, "bad magic");
  EXPECT_ERROR_HAS(msg, "67 47 55 46");
}

TEST(GGUF, UnsupportedVersions) {
  Image im = valid_image();
  Writer w;
  w.buf = im.bytes;
  w.patch<uint32_t>(im.version_at, 1);
  EXPECT_ERROR_HAS(parse_error(w.buf), "GGUF version 1 is not supported");
  w.patch<uint32_t>(im.version_at, 4);
  EXPECT_ERROR_HAS(parse_error(w.buf), "unsupported GGUF version 4");
  w.patch<uint32_t>(im.version_at, 0x03000000);
  EXPECT_ERROR_HAS(parse_error(w.buf), "big-endian");
}

TEST(GGUF, HugeCounts) {
  Image im = valid_image();
  Writer w;
  w.buf = im.bytes;
  w.patch<uint64_t>(im.n_tensors_at, uint64_t{1} << 62);
  std::string msg = parse_error(w.buf);
  EXPECT_ERROR_HAS(msg, "tensor count 4611686018427387904");
  EXPECT_ERROR_HAS(msg, "impossible");

  w.buf = im.bytes;
  w.patch<uint64_t>(im.n_kv_at, std::numeric_limits<uint64_t>::max());
  msg = parse_error(w.buf);
  EXPECT_ERROR_HAS(msg, "metadata count 18446744073709551615");

  // A count that fits the file's size but not its content runs into the tensor table.
  w.buf = im.bytes;
  w.patch<uint64_t>(im.n_kv_at, 25);
  EXPECT_THROW(parse(w.buf), GGUFError);
}

TEST(GGUF, HugeStringLengths) {
  Image im = valid_image();
  Writer w;
  w.buf = im.bytes;
  w.patch<uint64_t>(im.first_key_at, uint64_t{1} << 60);
  std::string msg = parse_error(w.buf);
  EXPECT_ERROR_HAS(msg, "key: string length 1152921504606846976");
  EXPECT_ERROR_HAS(msg, "metadata entry #0");

  w.buf = im.bytes;
  w.patch<uint64_t>(im.str_value_at, std::numeric_limits<uint64_t>::max());
  msg = parse_error(w.buf);
  EXPECT_ERROR_HAS(msg, "'general.architecture'");
  EXPECT_ERROR_HAS(msg, "string length 18446744073709551615");
}

TEST(GGUF, HugeArrayLength) {
  Image im = valid_image();
  Writer w;
  w.buf = im.bytes;
  w.patch<uint64_t>(im.array_len_at, uint64_t{1} << 61);
  std::string msg = parse_error(w.buf);
  EXPECT_ERROR_HAS(msg, "'t.ints'");
  EXPECT_ERROR_HAS(msg, "array length 2305843009213693952");
  EXPECT_ERROR_HAS(msg, "impossible");
}

TEST(GGUF, TooManyMetadataValues) {
  // Ten million one-byte elements fit the file but exceed the reader's value budget.
  Writer w;
  w.header(3, 0, 1);
  w.key("big", GGUFType::ARRAY), w.put<uint32_t>(0), w.put<uint64_t>(10000000);
  w.buf.resize(w.buf.size() + 10000000);
  EXPECT_ERROR_HAS(parse_error(w.buf), "limit");
}

TEST(GGUF, BadValueTypes) {
  Image im = valid_image();
  Writer w;
  w.buf = im.bytes;
  w.patch<uint32_t>(im.u32_type_at, 13);
  std::string msg = parse_error(w.buf);
  EXPECT_ERROR_HAS(msg, "'t.u32'");
  EXPECT_ERROR_HAS(msg, "unknown value type 13");

  w.buf = im.bytes;
  w.patch<uint32_t>(im.array_elem_at, 0xffffffffu);
  msg = parse_error(w.buf);
  EXPECT_ERROR_HAS(msg, "'t.ints'");
  EXPECT_ERROR_HAS(msg, "unknown array element type 4294967295");

  w.buf = im.bytes;
  w.patch<uint8_t>(im.bool_at, 2);
  EXPECT_ERROR_HAS(parse_error(w.buf), "bool value 2");
}

TEST(GGUF, DeeplyNestedArrays) {
  Writer w;
  w.header(3, 0, 1);
  w.key("deep", GGUFType::ARRAY);
  for (int i = 0; i < 100; ++i) w.put<uint32_t>(9), w.put<uint64_t>(1);
  w.put<uint32_t>(0), w.put<uint64_t>(0);
  EXPECT_ERROR_HAS(parse_error(w.buf), "nested deeper");
}

TEST(GGUF, BadTensorTypeIds) {
  Image im = valid_image();
  Writer w;
  // Tensor 'a' has two dimensions: n_dims (4), ne (16), then the type id.
  const size_t type_at = im.tensor_a_at + 4 + 16;
  for (uint32_t id : {4u, 31u, 1000u}) {
    w.buf = im.bytes;
    w.patch<uint32_t>(type_at, id);
    const std::string msg = parse_error(w.buf);
    EXPECT_ERROR_HAS(msg, "tensor 'a'");
    EXPECT_ERROR_HAS(msg, "unknown ggml type id " + std::to_string(id));
  }
}

TEST(GGUF, BadDimensionCounts) {
  Image im = valid_image();
  Writer w;
  for (uint32_t n : {0u, 5u}) {
    w.buf = im.bytes;
    w.patch<uint32_t>(im.tensor_b_at, n);
    const std::string msg = parse_error(w.buf);
    EXPECT_ERROR_HAS(msg, "tensor 'b'");
    EXPECT_ERROR_HAS(msg, "n_dims " + std::to_string(n) + ": expected 1 to 4");
  }
}

TEST(GGUF, DimensionOverflow) {
  auto one_tensor = [](std::vector<uint64_t> ne, uint32_t type) {
    Writer w;
    w.header(3, 1, 0);
    w.tensor("w", ne, type, 0);
    w.pad_to(32);
    w.buf.resize(w.buf.size() + 64);
    return w.buf;
  };
  std::string msg = parse_error(one_tensor({uint64_t{1} << 32, uint64_t{1} << 32}, kF32));
  EXPECT_ERROR_HAS(msg, "tensor 'w'");
  EXPECT_ERROR_HAS(msg, "shape 4294967296x4294967296 has more than 2^63-1 elements");
  // 2^62 elements fit int64 but their 2^64 bytes do not.
  msg = parse_error(one_tensor({uint64_t{1} << 31, uint64_t{1} << 31}, kF32));
  EXPECT_ERROR_HAS(msg, "overflows the byte size");
  msg = parse_error(one_tensor({uint64_t{1} << 63}, kF32));
  EXPECT_ERROR_HAS(msg, "dimension 0 is 9223372036854775808");
  msg = parse_error(one_tensor({8, 0}, kF32));
  EXPECT_ERROR_HAS(msg, "dimension 1 is 0");
  msg = parse_error(one_tensor({48}, kQ8_0));
  EXPECT_ERROR_HAS(msg, "ne[0] = 48 is not a multiple of the Q8_0 block size 32");
}

TEST(GGUF, DataPastTheEnd) {
  Image im = valid_image();
  Writer w;
  w.buf = im.bytes;
  w.buf.resize(im.data_start + 64 + 60);  // b's 68 bytes start at 64
  std::string msg = parse_error(w.buf);
  EXPECT_ERROR_HAS(msg, "tensor 'b': data [offset " + std::to_string(im.data_start + 64) +
                            ", 68 bytes] runs past the end of the file (" +
                            std::to_string(w.buf.size()) + " bytes)");
}

// ggml's layout rule: each tensor's data at the running padded size of those before it. Offsets
// far past the end, misaligned, overlapping the previous tensor or leaving a gap are refused.
TEST(GGUF, OffsetsFollowGgmlsLayout) {
  Image im = valid_image();
  Writer w;
  const size_t offset_at = im.tensor_b_at + 4 + 8 + 4;
  for (uint64_t bad : {uint64_t(6400), uint64_t(80), uint64_t(0), uint64_t(128),
                       std::numeric_limits<uint64_t>::max() - 63}) {
    w.buf = im.bytes;
    w.patch<uint64_t>(offset_at, bad);
    EXPECT_ERROR_HAS(parse_error(w.buf),
                     "tensor 'b': data offset " + std::to_string(bad) + ", expected 64");
  }
}

// Names must be text; a message shows a name's undecodable bytes escaped, so that it is text too.
TEST(GGUF, NamesThatAreNotUtf8AreRefusedAndEscaped) {
  Writer k;
  k.header(3, 0, 1);
  k.key("bad\xff\xfename", GGUFType::UINT32);
  k.put<uint32_t>(1);
  std::string msg = parse_error(k.buf);
  EXPECT_ERROR_HAS(msg, "metadata key 'bad\\xff\\xfename'");
  EXPECT_ERROR_HAS(msg, "the key is not valid UTF-8");

  Writer t;
  t.header(3, 1, 0);
  t.tensor("w\xc3", {32}, 0, 0);
  msg = parse_error(t.buf);
  EXPECT_ERROR_HAS(msg, "tensor 'w\\xc3'");
  EXPECT_ERROR_HAS(msg, "the name is not valid UTF-8");
}

TEST(GGUF, BadAlignment) {
  Image im = valid_image();
  Writer w;
  for (uint32_t a : {0u, 48u, 3u}) {
    w.buf = im.bytes;
    w.patch<uint32_t>(im.alignment_at, a);
    EXPECT_ERROR_HAS(
        parse_error(w.buf),
        "'general.alignment': expected a non-zero power of two, found " + std::to_string(a));
  }
  Writer s;
  s.header(3, 0, 1);
  s.key("general.alignment", GGUFType::STRING);
  s.str("32");
  EXPECT_ERROR_HAS(parse_error(s.buf), "found a string");
}

TEST(GGUF, DuplicateNames) {
  Writer w;
  w.header(3, 2, 0);
  w.tensor("x", {32}, kF32, 0);
  w.tensor("x", {32}, kF32, 128);
  w.pad_to(32);
  w.buf.resize(w.buf.size() + 256);
  std::string msg = parse_error(w.buf);
  EXPECT_ERROR_HAS(msg, "tensor 'x' (entry #1");
  EXPECT_ERROR_HAS(msg, "duplicate tensor name");

  Writer k;
  k.header(3, 0, 2);
  k.key("a.b", GGUFType::UINT8), k.put<uint8_t>(1);
  k.key("a.b", GGUFType::UINT8), k.put<uint8_t>(2);
  msg = parse_error(k.buf);
  EXPECT_ERROR_HAS(msg, "metadata key 'a.b' (entry #1");
  EXPECT_ERROR_HAS(msg, "duplicate key");
}

TEST(GGUF, EmptyTensorTableNeedsNoDataSection) {
  Writer w;
  w.header(3, 0, 1);
  w.key("general.name", GGUFType::STRING);
  w.str("x");
  auto f = parse(w.buf);
  EXPECT_TRUE(f->tensors().empty());
  EXPECT_EQ(f->get_string("general.name"), "x");
}

class TempFile {
 public:
  explicit TempFile(const std::vector<uint8_t>& bytes) {
    char name[] = "/tmp/ggraph_test_gguf_XXXXXX";
    const int fd = mkstemp(name);
    EXPECT_GE(fd, 0);
    path_ = name;
    EXPECT_EQ(write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
    close(fd);
  }
  ~TempFile() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

TEST(GGUF, OpenMapsAFile) {
  const Image im = valid_image();
  TempFile tmp(im.bytes);
  auto f = GGUFFile::open(tmp.path());
  EXPECT_EQ(f->path(), tmp.path());
  EXPECT_EQ(f->file_size(), im.bytes.size());
  check_valid(*f, 3, 64, im.data_start);
}

TEST(GGUF, OpenReportsPathAndProblem) {
  std::string msg;
  try {
    GGUFFile::open("/nonexistent/dir/model.gguf");
  } catch (const GGUFError& e) {
    msg = e.what();
  }
  EXPECT_ERROR_HAS(msg, "/nonexistent/dir/model.gguf");
  EXPECT_ERROR_HAS(msg, std::strerror(ENOENT));

  msg.clear();
  try {
    GGUFFile::open("/tmp");
  } catch (const GGUFError& e) {
    msg = e.what();
  }
  EXPECT_ERROR_HAS(msg, "not a regular file");

  Image im = valid_image();
  im.bytes[0] = 'X';
  TempFile bad(im.bytes);
  msg.clear();
  try {
    GGUFFile::open(bad.path());
  } catch (const GGUFError& e) {
    msg = e.what();
  }
  EXPECT_ERROR_HAS(msg, bad.path() + ": header: bad magic");

  TempFile empty({});
  msg.clear();
  try {
    GGUFFile::open(empty.path());
  } catch (const GGUFError& e) {
    msg = e.what();
  }
  EXPECT_ERROR_HAS(msg, "file is empty");
}

// A real model file, when one is named by GGRAPH_TEST_GGUF (e.g. SmolLM2-135M-Instruct Q4_1).
TEST(GGUF, RealFileWhenAvailable) {
  const char* path = std::getenv("GGRAPH_TEST_GGUF");
  if (path == nullptr) GTEST_SKIP() << "GGRAPH_TEST_GGUF not set";
  auto f = GGUFFile::open(path);
  EXPECT_FALSE(f->get_string("general.architecture").empty());
  EXPECT_GT(f->tensors().size(), 0u);
  for (const GGUFTensorInfo& t : f->tensors()) {
    EXPECT_LE(static_cast<size_t>(t.data - f->tensors()[0].data) + t.nbytes, f->file_size());
    EXPECT_EQ(t.nbytes, row_size(t.type, t.ne[0]) * static_cast<size_t>(t.n_elements() / t.ne[0]));
  }
}

TEST(TypeTable, SizesMatchBlockLayouts) {
  EXPECT_EQ(type_traits(DType::Q4_0).type_size, sizeof(BlockQ4_0));
  EXPECT_EQ(type_traits(DType::Q4_1).type_size, sizeof(BlockQ4_1));
  EXPECT_EQ(type_traits(DType::Q8_0).type_size, sizeof(BlockQ8_0));
  EXPECT_EQ(type_traits(DType::Q4_0).block_size, QK);
  EXPECT_EQ(type_traits(DType::Q6_K).block_size, 256);
  EXPECT_STREQ(type_name(DType::Q4_1), "Q4_1");
  EXPECT_EQ(row_size(DType::Q4_0, 64), 36u);
  EXPECT_EQ(row_size(DType::F16, 5), 10u);
  EXPECT_THROW(row_size(DType::Q8_0, 33), ArgumentError);
  EXPECT_EQ(type_traits_or_null(4), nullptr);
  EXPECT_EQ(type_traits_or_null(40), nullptr);
  int computable = 0;
  for (uint32_t id = 0; id < 64; ++id) {
    const TypeTraits* t = type_traits_or_null(id);
    if (t != nullptr && t->computable) ++computable;
  }
  EXPECT_EQ(computable, 15);  // F32 F16 BF16, Q4_0 Q4_1 Q5_0 Q5_1 Q8_0, Q2_K-Q6_K, IQ4_NL IQ4_XS
  EXPECT_TRUE(type_traits(DType::BF16).computable);
  EXPECT_FALSE(type_traits(DType::IQ2_XXS).computable);
}

}  // namespace
}  // namespace ggraph
