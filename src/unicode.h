// Unicode for the tokenizers: UTF-8 coding, general-category classes and the pre-tokenizer
// splits that byte-level BPE vocabularies were trained with.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace ggraph {
namespace unicode {

// The major class of a codepoint's general category (exactly one bit is set) and, independently,
// the White_Space property.
enum Flag : uint8_t {
  kLetter = 1,        // L*
  kNumber = 2,        // N*
  kPunctuation = 4,   // P*
  kSymbol = 8,        // S*
  kMark = 16,         // M*
  kSeparator = 32,    // Z*
  kOther = 64,        // C*: controls, format, surrogates, private use, unassigned
  kWhitespace = 128,  // White_Space (what \s matches)
};

// Generated tables (src/unicode_data.cpp).
extern const uint32_t kFlagRanges[];
extern const size_t kFlagRangeCount;
extern const char kUnicodeVersion[];

uint8_t flags(uint32_t cp);  // codepoints past U+10FFFF are kOther

constexpr uint32_t kReplacementChar = 0xFFFD;

// One step of UTF-8 decoding at the start of s (n bytes available). A malformed sequence is
// consumed by its maximal subpart, the unit that one U+FFFD replaces as Unicode recommends.
struct Utf8Step {
  uint32_t cp = 0;          // the character, or U+FFFD
  int len = 0;              // bytes consumed: the character, or the malformed subpart
  bool valid = false;       // a whole well-formed character
  bool incomplete = false;  // a well-formed prefix that ran into the end of the input
};
Utf8Step decode_utf8_step(const char* s, size_t n);

// Appends the UTF-8 encoding of cp.
void append_utf8(uint32_t cp, std::string* out);
std::string to_utf8(uint32_t cp);

// Codepoints of text with the byte offset each starts at; a malformed subpart becomes one U+FFFD.
struct Decoded {
  std::vector<uint32_t> cps;
  std::vector<size_t> offsets;  // cps.size() + 1 entries; the last is text.size()
};
Decoded decode_utf8(const std::string& text);

// Bytes at the end of s that begin a well-formed character still missing bytes (0-3).
size_t incomplete_utf8_tail(const std::string& s);
// s with every malformed subpart (an incomplete tail included) replaced by U+FFFD.
std::string sanitize_utf8(const std::string& s);

// One pass of a pre-tokenizer. A pass splits each piece it is given into the matches of its
// pattern and the stretches between matches, as llama.cpp's regex splits do.
enum class Split {
  // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  kGpt2,
  // (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
  // \s*[\r\n]+|\s+(?!\S)|\s+
  kLlama3,
  kQwen2,              // as kLlama3 with \p{N} for \p{N}{1,3}
  kEachNumber,         // \p{N}
  kNumberRuns,         // \p{N}+
  kAsciiDigitTriples,  // [0-9][0-9][0-9]
  kPunctuationRuns,    // [\p{P}\$\+<=>\^~\|]+
};

// Splits text into consecutive pieces (byte offset, byte length) that cover it exactly, applying
// the passes in order. Malformed UTF-8 takes part as U+FFFD but keeps its bytes in the pieces.
std::vector<std::pair<size_t, size_t>> split_text(const std::string& text,
                                                  const std::vector<Split>& passes);

}  // namespace unicode
}  // namespace ggraph
