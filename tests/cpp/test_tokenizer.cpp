// Tokenizers on small vocabularies built in memory, and the Unicode layer under them. The real
// vocabularies (SmolLM2, a trained SentencePiece model) are checked against llama.cpp and
// SentencePiece in tests/python/test_tokenizer.py.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "gguf.h"
#include "tokenizer.h"
#include "unicode.h"

namespace ggraph {
namespace {

// A GGUF image holding metadata only, written by hand from the specification.
class MetadataWriter {
 public:
  MetadataWriter& str(const std::string& key, const std::string& value) {
    entry(key, GGUFType::STRING);
    put_str(value);
    return *this;
  }
  MetadataWriter& u32(const std::string& key, uint32_t value) {
    entry(key, GGUFType::UINT32);
    put(value);
    return *this;
  }
  MetadataWriter& boolean(const std::string& key, bool value) {
    entry(key, GGUFType::BOOL);
    put<uint8_t>(value ? 1 : 0);
    return *this;
  }
  MetadataWriter& strs(const std::string& key, const std::vector<std::string>& values) {
    array_head(key, GGUFType::STRING, values.size());
    for (const auto& v : values) put_str(v);
    return *this;
  }
  MetadataWriter& floats(const std::string& key, const std::vector<float>& values) {
    array_head(key, GGUFType::FLOAT32, values.size());
    for (float v : values) put(v);
    return *this;
  }
  MetadataWriter& ints(const std::string& key, const std::vector<int32_t>& values) {
    array_head(key, GGUFType::INT32, values.size());
    for (int32_t v : values) put(v);
    return *this;
  }

  std::unique_ptr<GGUFFile> open() const {
    std::vector<uint8_t> image = {'G', 'G', 'U', 'F'};
    append(&image, uint32_t{3});
    append(&image, uint64_t{0});  // tensors
    append(&image, n_kv_);
    image.insert(image.end(), body_.begin(), body_.end());
    return GGUFFile::from_bytes(image.data(), image.size());
  }

 private:
  template <typename T>
  static void append(std::vector<uint8_t>* buf, T v) {
    const size_t at = buf->size();
    buf->resize(at + sizeof(T));
    std::memcpy(buf->data() + at, &v, sizeof(T));
  }
  template <typename T>
  void put(T v) {
    append(&body_, v);
  }
  void put_str(const std::string& s) {
    put<uint64_t>(s.size());
    body_.insert(body_.end(), s.begin(), s.end());
  }
  void entry(const std::string& key, GGUFType type) {
    put_str(key);
    put(static_cast<uint32_t>(type));
    ++n_kv_;
  }
  void array_head(const std::string& key, GGUFType elem, size_t n) {
    entry(key, GGUFType::ARRAY);
    put(static_cast<uint32_t>(elem));
    put<uint64_t>(n);
  }

  std::vector<uint8_t> body_;
  uint64_t n_kv_ = 0;
};

// GPT-2's byte characters: printable Latin-1 stands for itself, other bytes map to U+0100 on.
std::string byte_char(int b) {
  static std::vector<uint32_t> map = [] {
    std::vector<uint32_t> m(256);
    uint32_t next = 256;
    for (int i = 0; i < 256; ++i) {
      const bool printable = (i >= 33 && i <= 126) || (i >= 161 && i <= 172) || i >= 174;
      m[i] = printable ? i : next++;
    }
    return m;
  }();
  return unicode::to_utf8(map[b]);
}

// A byte-level BPE vocabulary: the 256 byte characters (ids 0-255), then extra tokens.
struct BpeVocab {
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  std::vector<std::string> merges;
  std::string pre = "gpt2";

  BpeVocab() {
    for (int b = 0; b < 256; ++b) {
      tokens.push_back(byte_char(b));
      types.push_back(1);
    }
  }
  int32_t add(const std::string& text, int32_t type = 1) {
    tokens.push_back(text);
    types.push_back(type);
    return static_cast<int32_t>(tokens.size() - 1);
  }
  MetadataWriter writer() const {
    MetadataWriter w;
    w.str("tokenizer.ggml.model", "gpt2")
        .str("tokenizer.ggml.pre", pre)
        .strs("tokenizer.ggml.tokens", tokens)
        .ints("tokenizer.ggml.token_type", types)
        .strs("tokenizer.ggml.merges", merges);
    return w;
  }
  std::unique_ptr<Tokenizer> build() const {
    auto file = writer().open();
    return Tokenizer::from_gguf(*file);
  }
};

// ---------------------------------------------------------------------------------------------
// Unicode

TEST(Unicode, CategoriesOfKnownCodepoints) {
  using namespace unicode;
  const std::pair<uint32_t, uint8_t> cases[] = {
      {'A', kLetter},
      {'z', kLetter},
      {'5', kNumber},
      {'_', kPunctuation},
      {'!', kPunctuation},
      {'$', kSymbol},
      {'+', kSymbol},
      {' ', kSeparator | kWhitespace},
      {'\t', kOther | kWhitespace},
      {'\n', kOther | kWhitespace},
      {0x00, kOther},
      {0x1F, kOther},  // a control the White_Space property leaves out
      {0xA0, kSeparator | kWhitespace},
      {0x0301, kMark},    // combining acute accent
      {0x0663, kNumber},  // ARABIC-INDIC DIGIT THREE
      {0x0627, kLetter},  // ARABIC LETTER ALEF
      {0x093F, kMark},    // DEVANAGARI VOWEL SIGN I (spacing mark)
      {0x0E34, kMark},    // THAI CHARACTER SARA I
      {0x2028, kSeparator | kWhitespace},
      {0x200B, kOther},  // ZERO WIDTH SPACE is format, not white space
      {0x3000, kSeparator | kWhitespace},
      {0x3042, kLetter},   // HIRAGANA LETTER A
      {0x4E2D, kLetter},   // CJK ideograph
      {0x216B, kNumber},   // ROMAN NUMERAL TWELVE (Nl)
      {0x00BD, kNumber},   // VULGAR FRACTION ONE HALF (No)
      {0x00A9, kSymbol},   // COPYRIGHT SIGN
      {0xE000, kOther},    // private use
      {0xFEFF, kOther},    // byte order mark (format)
      {0x0378, kOther},    // unassigned
      {0x1F600, kSymbol},  // GRINNING FACE
      {0x1F3FD, kSymbol},  // skin tone modifier (Sk)
      {0x1D518, kLetter},  // MATHEMATICAL FRAKTUR CAPITAL U
      {0x1D7D8, kNumber},  // MATHEMATICAL DOUBLE-STRUCK DIGIT ZERO
      {0x20000, kLetter},  // CJK Extension B
      {0xE0001, kOther},   // LANGUAGE TAG (format)
      {0x10FFFF, kOther},  // noncharacter
      {0x110000, kOther},  // past the code space
  };
  for (const auto& [cp, expected] : cases) {
    EXPECT_EQ(flags(cp), expected) << "U+" << std::hex << cp;
  }
}

TEST(Unicode, RangeTableIsSortedAndCoversTheCodeSpace) {
  ASSERT_GT(unicode::kFlagRangeCount, 100u);
  EXPECT_EQ(unicode::kFlagRanges[0] >> 8, 0u);
  for (size_t i = 1; i < unicode::kFlagRangeCount; ++i) {
    ASSERT_LT(unicode::kFlagRanges[i - 1] >> 8, unicode::kFlagRanges[i] >> 8) << i;
    // Consecutive entries differ in flags, or they would be one range.
    ASSERT_NE(unicode::kFlagRanges[i - 1] & 0xFF, unicode::kFlagRanges[i] & 0xFF) << i;
  }
  EXPECT_LE(unicode::kFlagRanges[unicode::kFlagRangeCount - 1] >> 8, 0x10FFFFu);
}

std::vector<uint32_t> cps(const std::string& s) { return unicode::decode_utf8(s).cps; }

TEST(Unicode, DecodeReplacesMaximalSubparts) {
  // The example of Unicode's "U+FFFD Substitution of Maximal Subparts" (chapter 3.9).
  const std::string bytes = "\x61\xF1\x80\x80\xE1\x80\xC2\x62\x80\x63\x80\xBF\x64";
  const std::vector<uint32_t> want = {0x61,   0xFFFD, 0xFFFD, 0xFFFD, 0x62,
                                      0xFFFD, 0x63,   0xFFFD, 0xFFFD, 0x64};
  EXPECT_EQ(cps(bytes), want);
  // Surrogates, overlongs and values past U+10FFFF are malformed from their second byte.
  EXPECT_EQ(cps("\xED\xA0\x80"), (std::vector<uint32_t>{0xFFFD, 0xFFFD, 0xFFFD}));
  EXPECT_EQ(cps("\xC0\xAF"), (std::vector<uint32_t>{0xFFFD, 0xFFFD}));
  EXPECT_EQ(cps("\xE0\x80\xAF"), (std::vector<uint32_t>{0xFFFD, 0xFFFD, 0xFFFD}));
  EXPECT_EQ(cps("\xF4\x90\x80\x80"), (std::vector<uint32_t>{0xFFFD, 0xFFFD, 0xFFFD, 0xFFFD}));
  EXPECT_EQ(cps("\xF0\x9F\x98\x80\xE2\x82\xAC\xC3\xA9"),
            (std::vector<uint32_t>{0x1F600, 0x20AC, 0xE9}));
  const unicode::Decoded d = unicode::decode_utf8("a\xE2\x82\xACz");
  EXPECT_EQ(d.offsets, (std::vector<size_t>{0, 1, 4, 5}));
}

TEST(Unicode, IncompleteTailAndSanitize) {
  EXPECT_EQ(unicode::incomplete_utf8_tail("a\xE6\x97"), 2u);
  EXPECT_EQ(unicode::incomplete_utf8_tail("a\xE6"), 1u);
  EXPECT_EQ(unicode::incomplete_utf8_tail("\xF0\x9F\x98"), 3u);
  EXPECT_EQ(unicode::incomplete_utf8_tail("\xE6\x97\xA5"), 0u);  // complete
  EXPECT_EQ(unicode::incomplete_utf8_tail("a\x80"), 0u);         // stray continuation byte
  EXPECT_EQ(unicode::incomplete_utf8_tail("\xED\xA0"), 0u);      // would be a surrogate
  EXPECT_EQ(unicode::incomplete_utf8_tail(""), 0u);
  EXPECT_EQ(unicode::sanitize_utf8("ok\xE6\x97"), "ok\xEF\xBF\xBD");
  EXPECT_EQ(unicode::sanitize_utf8("\xFF"
                                   "a\xE2\x82\xAC"),
            "\xEF\xBF\xBD"
            "a\xE2\x82\xAC");
}

std::vector<std::string> split(const std::string& text, std::vector<unicode::Split> passes) {
  std::vector<std::string> out;
  for (const auto& [offset, len] : unicode::split_text(text, passes))
    out.push_back(text.substr(offset, len));
  return out;
}

using V = std::vector<std::string>;

TEST(PreTokenizer, Gpt2) {
  const std::vector<unicode::Split> gpt2 = {unicode::Split::kGpt2};
  EXPECT_EQ(split("Hello world", gpt2), (V{"Hello", " world"}));
  EXPECT_EQ(split("it's 2024!!  ok\n\n", gpt2), (V{"it", "'s", " 2024", "!!", " ", " ok", "\n\n"}));
  EXPECT_EQ(split("I'LL", gpt2), (V{"I", "'", "LL"}));  // contractions are case-sensitive
  EXPECT_EQ(split(" \tx", gpt2), (V{" ", "\t", "x"}));
  EXPECT_EQ(split("a   ", gpt2), (V{"a", "   "}));
  EXPECT_EQ(split("caf\xC3\xA9 \xE6\x97\xA5\xE6\x9C\xAC", gpt2),
            (V{"caf\xC3\xA9", " \xE6\x97\xA5\xE6\x9C\xAC"}));
  // Combining marks are not letters: they split off with the punctuation-like run.
  EXPECT_EQ(split("e\xCC\x81x", gpt2), (V{"e", "\xCC\x81", "x"}));
  EXPECT_EQ(split("", gpt2), V{});
}

TEST(PreTokenizer, SmolLMSplitsEveryDigit) {
  const std::vector<unicode::Split> smollm = {unicode::Split::kEachNumber, unicode::Split::kGpt2};
  EXPECT_EQ(split("x 123", smollm), (V{"x", " ", "1", "2", "3"}));
}

TEST(PreTokenizer, Llama3AndQwen2) {
  const std::vector<unicode::Split> llama3 = {unicode::Split::kLlama3};
  EXPECT_EQ(split("I'LL pay 1234567", llama3), (V{"I", "'LL", " pay", " ", "123", "456", "7"}));
  EXPECT_EQ(split("a\r\n\r\nb", llama3), (V{"a", "\r\n\r\n", "b"}));
  EXPECT_EQ(split("x  \n  y", llama3), (V{"x", "  \n", " ", " y"}));
  EXPECT_EQ(split("\tword ...\n\nnext", llama3), (V{"\tword", " ...\n\n", "next"}));
  const std::vector<unicode::Split> qwen2 = {unicode::Split::kQwen2};
  EXPECT_EQ(split("pay 1234", qwen2), (V{"pay", " ", "1", "2", "3", "4"}));
}

TEST(PreTokenizer, DefaultPasses) {
  const std::vector<unicode::Split> passes = {unicode::Split::kPunctuationRuns,
                                              unicode::Split::kGpt2, unicode::Split::kNumberRuns,
                                              unicode::Split::kAsciiDigitTriples};
  EXPECT_EQ(split("a+=b 12345", passes), (V{"a", "+=", "b", " ", "123", "45"}));
  EXPECT_EQ(split("12345", passes), (V{"123", "45"}));
}

TEST(PreTokenizer, MalformedBytesStayInThePieces) {
  const std::string text = "ab\xFF\xFE cd";
  std::string joined;
  for (const auto& piece : split(text, {unicode::Split::kGpt2})) joined += piece;
  EXPECT_EQ(joined, text);
}

// ---------------------------------------------------------------------------------------------
// Byte-level BPE

TEST(BpeTokenizer, MergesApplyInRankOrder) {
  BpeVocab v;
  const int32_t ab = v.add("ab"), bc = v.add("bc"), abc = v.add("abc");
  v.merges = {"b c", "a b", "ab c"};
  // b+c ranks first, and "a bc" is no merge.
  EXPECT_EQ(v.build()->tokenize("abc", false, false), (std::vector<int32_t>{'a', bc}));
  v.merges = {"a b", "b c", "ab c"};
  EXPECT_EQ(v.build()->tokenize("abc", false, false), (std::vector<int32_t>{abc}));
  v.merges = {"a b"};
  EXPECT_EQ(v.build()->tokenize("abab", false, false), (std::vector<int32_t>{ab, ab}));
}

TEST(BpeTokenizer, EqualRanksMergeLeftmostFirst) {
  BpeVocab v;
  const int32_t aa = v.add("aa");
  v.merges = {"a a"};
  EXPECT_EQ(v.build()->tokenize("aaa", false, false), (std::vector<int32_t>{aa, 'a'}));
}

TEST(BpeTokenizer, SpacesAndBytesUseTheByteCharacters) {
  BpeVocab v;
  const std::string space = byte_char(' ');  // U+0120
  const int32_t sp_a = v.add(space + "a");
  v.merges = {space + " a"};
  auto tok = v.build();
  EXPECT_EQ(tok->tokenize("a a", false, false), (std::vector<int32_t>{'a', sp_a}));
  // Any bytes survive a round trip, malformed UTF-8 included.
  const std::string bytes = "\xFF\xFE\x00\x01 x\xE6\x97";
  const std::string text(bytes.data(), 8);
  EXPECT_EQ(tok->detokenize(tok->tokenize(text, false, false)), text);
  EXPECT_EQ(tok->token_to_piece(sp_a), " a");
  EXPECT_EQ(tok->token_to_piece(0xE6), "\xE6");
}

TEST(BpeTokenizer, SpecialTokens) {
  BpeVocab v;
  const int32_t start = v.add("<|start|>", 3);
  const int32_t user = v.add("<tool>", 4);  // user-defined: matched even without parse_special
  MetadataWriter w = v.writer();
  w.u32("tokenizer.ggml.bos_token_id", start).u32("tokenizer.ggml.eos_token_id", start);
  auto file = w.open();
  auto tok = Tokenizer::from_gguf(*file);
  EXPECT_EQ(tok->tokenize("<|start|>x", false, true), (std::vector<int32_t>{start, 'x'}));
  const std::vector<int32_t> plain = tok->tokenize("<|start|>x", false, false);
  EXPECT_EQ(plain.size(), 10u);  // every byte on its own: this vocabulary has no merges
  EXPECT_EQ(tok->tokenize("a<tool>b", false, false), (std::vector<int32_t>{'a', user, 'b'}));
  EXPECT_EQ(tok->tokenize("x", true, false), (std::vector<int32_t>{start, 'x'}));
  EXPECT_EQ(tok->token_to_piece(start), "");
  EXPECT_EQ(tok->token_to_piece(start, true), "<|start|>");
  EXPECT_EQ(tok->token_to_piece(user), "<tool>");
  EXPECT_EQ(tok->detokenize({start, 'h', 'i'}), "hi");
}

TEST(BpeTokenizer, EndOfGeneration) {
  BpeVocab v;
  const int32_t eos = v.add("</s>", 3);
  const int32_t im_end = v.add("<|im_end|>", 3);
  const int32_t other = v.add("<|im_start|>", 3);
  MetadataWriter w = v.writer();
  w.u32("tokenizer.ggml.eos_token_id", eos);
  auto file = w.open();
  auto tok = Tokenizer::from_gguf(*file);
  EXPECT_TRUE(tok->is_end_of_generation(eos));
  EXPECT_TRUE(tok->is_end_of_generation(im_end));
  EXPECT_FALSE(tok->is_end_of_generation(other));
  EXPECT_FALSE(tok->is_end_of_generation('a'));
  EXPECT_EQ(tok->eos_id(), eos);
}

std::string error_of(const MetadataWriter& w) {
  try {
    auto file = w.open();
    Tokenizer::from_gguf(*file);
  } catch (const GGUFError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(TokenizerErrors, NameWhatWasFoundAndWhatIsSupported) {
  MetadataWriter none;
  none.str("general.architecture", "llama");
  EXPECT_NE(error_of(none).find("tokenizer.ggml.model"), std::string::npos) << error_of(none);

  BpeVocab v;
  MetadataWriter bert;
  bert.str("tokenizer.ggml.model", "bert").strs("tokenizer.ggml.tokens", v.tokens);
  const std::string bert_error = error_of(bert);
  EXPECT_NE(bert_error.find("'bert'"), std::string::npos) << bert_error;
  EXPECT_NE(bert_error.find("gpt2"), std::string::npos) << bert_error;
  EXPECT_NE(bert_error.find("llama"), std::string::npos) << bert_error;

  v.pre = "mystery-pre";
  const std::string pre_error = error_of(v.writer());
  EXPECT_NE(pre_error.find("'mystery-pre'"), std::string::npos) << pre_error;
  EXPECT_NE(pre_error.find("smollm"), std::string::npos) << pre_error;
  EXPECT_NE(pre_error.find("llama-bpe"), std::string::npos) << pre_error;
  EXPECT_NE(pre_error.find("qwen2"), std::string::npos) << pre_error;

  v.pre = "gpt2";
  MetadataWriter short_types;
  short_types.str("tokenizer.ggml.model", "gpt2")
      .strs("tokenizer.ggml.tokens", v.tokens)
      .ints("tokenizer.ggml.token_type", {1, 1})
      .strs("tokenizer.ggml.merges", {});
  const std::string types_error = error_of(short_types);
  EXPECT_NE(types_error.find("expected 256 types"), std::string::npos) << types_error;

  MetadataWriter short_scores;
  short_scores.str("tokenizer.ggml.model", "llama")
      .strs("tokenizer.ggml.tokens", {"<unk>", "<s>", "</s>"})
      .floats("tokenizer.ggml.scores", {0.0f});
  const std::string scores_error = error_of(short_scores);
  EXPECT_NE(scores_error.find("expected 3 scores"), std::string::npos) << scores_error;
  EXPECT_NE(scores_error.find("found 1"), std::string::npos) << scores_error;

  MetadataWriter bad_bos = v.writer();
  bad_bos.u32("tokenizer.ggml.bos_token_id", 100000);
  const std::string bos_error = error_of(bad_bos);
  EXPECT_NE(bos_error.find("tokenizer.ggml.bos_token_id"), std::string::npos) << bos_error;
  EXPECT_NE(bos_error.find("100000"), std::string::npos) << bos_error;

  MetadataWriter no_merges;
  no_merges.str("tokenizer.ggml.model", "gpt2").strs("tokenizer.ggml.tokens", v.tokens);
  EXPECT_NE(error_of(no_merges).find("tokenizer.ggml.merges"), std::string::npos);
}

TEST(TokenizerErrors, MissingPreFallsBackToDefault) {
  BpeVocab v;
  MetadataWriter w;
  w.str("tokenizer.ggml.model", "gpt2")
      .strs("tokenizer.ggml.tokens", v.tokens)
      .strs("tokenizer.ggml.merges", {});
  auto file = w.open();
  auto tok = Tokenizer::from_gguf(*file);
  EXPECT_EQ(tok->pre_name(), "default");
  EXPECT_THROW(tok->token_to_piece(256), ArgumentError);
  EXPECT_THROW(tok->token_to_piece(-1), ArgumentError);
  EXPECT_THROW(tok->tokenize("x", true, false), ArgumentError);  // no BOS to add
}

// ---------------------------------------------------------------------------------------------
// SentencePiece

const std::string kSp = "\xE2\x96\x81";  // U+2581

struct SpmVocab {
  std::vector<std::string> tokens = {"<unk>", "<s>", "</s>"};
  std::vector<float> scores = {0, 0, 0};
  std::vector<int32_t> types = {2, 3, 3};

  int32_t add(const std::string& text, float score, int32_t type = 1) {
    tokens.push_back(text);
    scores.push_back(score);
    types.push_back(type);
    return static_cast<int32_t>(tokens.size() - 1);
  }
  void add_bytes() {
    char name[8];
    for (int b = 0; b < 256; ++b) {
      std::snprintf(name, sizeof(name), "<0x%02X>", b);
      add(name, 0, 6);
    }
  }
  std::unique_ptr<Tokenizer> build() const {
    MetadataWriter w;
    w.str("tokenizer.ggml.model", "llama")
        .strs("tokenizer.ggml.tokens", tokens)
        .floats("tokenizer.ggml.scores", scores)
        .ints("tokenizer.ggml.token_type", types);
    auto file = w.open();
    return Tokenizer::from_gguf(*file);
  }
};

TEST(SpmTokenizer, MergesByScoreAndAddsTheSpacePrefix) {
  SpmVocab v;
  v.add_bytes();
  const int32_t sp = v.add(kSp, -10), a = v.add("a", -11), b = v.add("b", -12);
  const int32_t ab = v.add("ab", -1), sp_ab = v.add(kSp + "ab", -2), sp_a = v.add(kSp + "a", -3);
  auto tok = v.build();
  EXPECT_TRUE(tok->add_bos_default());
  EXPECT_TRUE(tok->add_space_prefix());
  // "ab" outscores "▁a", and "▁ab" then forms.
  EXPECT_EQ(tok->tokenize("ab", false, false), (std::vector<int32_t>{sp_ab}));
  EXPECT_EQ(tok->tokenize("ab", true, false), (std::vector<int32_t>{1, sp_ab}));
  EXPECT_EQ(tok->tokenize("a b", false, false), (std::vector<int32_t>{sp_a, sp, b}));
  EXPECT_EQ(tok->tokenize("ba", false, false), (std::vector<int32_t>{sp, b, a}));
  EXPECT_EQ(tok->tokenize("", false, false), std::vector<int32_t>{});
  // Characters outside the vocabulary fall back to their bytes.
  EXPECT_EQ(tok->tokenize("\xC3\xA9", false, false),
            (std::vector<int32_t>{sp, 3 + 0xC3, 3 + 0xA9}));
  EXPECT_EQ(tok->detokenize(tok->tokenize(" a b\xC3\xA9 ", true, false)), " a b\xC3\xA9 ");
  EXPECT_EQ(tok->token_to_piece(sp_ab), " ab");
  EXPECT_EQ(tok->token_to_piece(3 + 0xC3), "\xC3");
  EXPECT_EQ(tok->token_to_piece(ab), "ab");
}

TEST(SpmTokenizer, UnknownWithoutByteTokens) {
  SpmVocab v;
  v.add(kSp, -1);
  const int32_t x = v.add("x", -2);
  auto tok = v.build();
  EXPECT_EQ(tok->unk_id(), 0);
  EXPECT_EQ(tok->tokenize("x\xE6\x97\xA5", false, false), (std::vector<int32_t>{3, x, 0}));
}

// ---------------------------------------------------------------------------------------------
// Streaming

TEST(StreamDecoder, HoldsBackUnfinishedCharacters) {
  BpeVocab v;
  auto tok = v.build();  // one token per byte: id == byte value
  StreamDecoder d(*tok);
  const std::string text = "\xC3\xA9\xF0\x9F\x98\x80!";  // é 😀 !
  std::vector<std::string> out;
  for (unsigned char c : text) out.push_back(d.push(c));
  EXPECT_EQ(out, (V{"", "\xC3\xA9", "", "", "", "\xF0\x9F\x98\x80", "!"}));
  EXPECT_EQ(d.flush(), "");
}

TEST(StreamDecoder, ReplacesWhatCannotBecomeValid) {
  BpeVocab v;
  auto tok = v.build();
  StreamDecoder d(*tok);
  EXPECT_EQ(d.push(0xE6), "");
  EXPECT_EQ(d.push(0x97), "");
  EXPECT_EQ(d.push('A'),
            "\xEF\xBF\xBD"
            "A");                           // E6 97 was cut short
  EXPECT_EQ(d.push(0xFF), "\xEF\xBF\xBD");  // never valid
  EXPECT_EQ(d.push(0xF0), "");
  EXPECT_EQ(d.flush(), "\xEF\xBF\xBD");
  EXPECT_EQ(d.flush(), "");
}

}  // namespace
}  // namespace ggraph
