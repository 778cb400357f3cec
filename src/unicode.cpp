#include "unicode.h"

#include <algorithm>

namespace ggraph {
namespace unicode {
namespace {

// Basic Multilingual Plane flags expanded once: text is nearly all BMP, and a direct index is
// several times faster than a binary search over the ranges.
const uint8_t* bmp_flags() {
  static const std::vector<uint8_t> table = [] {
    std::vector<uint8_t> t(0x10000);
    for (size_t i = 0; i < kFlagRangeCount; ++i) {
      const uint32_t first = kFlagRanges[i] >> 8;
      if (first >= 0x10000) break;
      const uint32_t last = i + 1 < kFlagRangeCount ? (kFlagRanges[i + 1] >> 8) : 0x110000;
      std::fill(t.begin() + first, t.begin() + std::min<uint32_t>(last, 0x10000),
                static_cast<uint8_t>(kFlagRanges[i] & 0xFF));
    }
    return t;
  }();
  return table.data();
}

}  // namespace

uint8_t flags(uint32_t cp) {
  if (cp < 0x10000) return bmp_flags()[cp];
  if (cp > 0x10FFFF) return kOther;
  const uint32_t key = (cp << 8) | 0xFF;
  const uint32_t* end = kFlagRanges + kFlagRangeCount;
  const uint32_t* it = std::upper_bound(kFlagRanges, end, key);
  return static_cast<uint8_t>(*(it - 1) & 0xFF);
}

Utf8Step decode_utf8_step(const char* s, size_t n) {
  Utf8Step step;
  const auto byte = [s](size_t i) { return static_cast<uint8_t>(s[i]); };
  const uint8_t b0 = byte(0);
  if (b0 < 0x80) {
    step.cp = b0;
    step.len = 1;
    step.valid = true;
    return step;
  }
  // Well-formed sequences (Unicode table 3-7): the lead byte fixes the length and the range of
  // the second byte; later bytes are always 80..BF.
  int len = 0;
  uint8_t lo = 0x80, hi = 0xBF;
  uint32_t cp = 0;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    len = 2;
    cp = b0 & 0x1F;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    len = 3;
    cp = b0 & 0x0F;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;  // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    len = 4;
    cp = b0 & 0x07;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;  // nothing past U+10FFFF
  }
  step.cp = kReplacementChar;
  if (len == 0) {
    step.len = 1;
    return step;
  }
  for (int i = 1; i < len; ++i) {
    if (static_cast<size_t>(i) >= n) {
      step.len = i;
      step.incomplete = true;
      return step;
    }
    const uint8_t b = byte(i);
    const uint8_t first_lo = i == 1 ? lo : 0x80;
    const uint8_t first_hi = i == 1 ? hi : 0xBF;
    if (b < first_lo || b > first_hi) {
      step.len = i;
      return step;
    }
    cp = (cp << 6) | (b & 0x3F);
  }
  step.cp = cp;
  step.len = len;
  step.valid = true;
  return step;
}

void append_utf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::string to_utf8(uint32_t cp) {
  std::string s;
  append_utf8(cp, &s);
  return s;
}

Decoded decode_utf8(const std::string& text) {
  Decoded d;
  d.cps.reserve(text.size());
  d.offsets.reserve(text.size() + 1);
  size_t pos = 0;
  while (pos < text.size()) {
    const Utf8Step step = decode_utf8_step(text.data() + pos, text.size() - pos);
    d.cps.push_back(step.cp);
    d.offsets.push_back(pos);
    pos += step.len;
  }
  d.offsets.push_back(text.size());
  return d;
}

size_t incomplete_utf8_tail(const std::string& s) {
  // A character is at most 4 bytes, so only the last 3 bytes can start an unfinished one.
  const size_t n = s.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const size_t start = n - back;
    const uint8_t b = static_cast<uint8_t>(s[start]);
    if ((b & 0xC0) == 0x80) continue;  // a continuation byte: the lead is further back
    const Utf8Step step = decode_utf8_step(s.data() + start, back);
    return step.incomplete ? back : 0;
  }
  return 0;
}

std::string sanitize_utf8(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  size_t pos = 0;
  while (pos < s.size()) {
    const Utf8Step step = decode_utf8_step(s.data() + pos, s.size() - pos);
    if (step.valid) {
      out.append(s, pos, step.len);
    } else {
      append_utf8(kReplacementChar, &out);
    }
    pos += step.len;
  }
  return out;
}

namespace {

// A view of one piece of the text being split: codepoints [begin, end) with their flags.
// Positions at or past end read as nothing (flags 0), so a pattern's lookahead stops at the
// piece's edge, as a regex run over the piece alone would.
struct Piece {
  const uint32_t* cps;
  const uint8_t* flags;
  size_t begin;
  size_t end;

  uint32_t cp(size_t i) const { return i < end ? cps[i] : 0xFFFFFFFF; }
  uint8_t flag(size_t i) const { return i < end ? flags[i] : 0; }
  bool has(size_t i, uint8_t f) const { return (flag(i) & f) != 0; }
};

constexpr uint8_t kLetterOrNumber = kLetter | kNumber;
constexpr uint8_t kSpaceLetterNumber = kWhitespace | kLetter | kNumber;

uint32_t ascii_lower(uint32_t c) { return (c >= 'A' && c <= 'Z') ? c + ('a' - 'A') : c; }

// 's 't 're 've 'm 'll 'd at i (case-insensitive when fold_case): its length, or 0.
size_t match_contraction(const Piece& p, size_t i, bool fold_case) {
  if (p.cp(i) != '\'') return 0;
  const auto at = [&](size_t j) { return fold_case ? ascii_lower(p.cp(j)) : p.cp(j); };
  const uint32_t c1 = at(i + 1);
  if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return 2;
  const uint32_t c2 = at(i + 2);
  if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) return 3;
  return 0;
}

// Length of the run of whitespace starting at i.
size_t whitespace_run(const Piece& p, size_t i) {
  size_t j = i;
  while (p.has(j, kWhitespace)) ++j;
  return j - i;
}

// \s+(?!\S)|\s+ at i, given a whitespace run of n there: a run followed by more text leaves its
// last character to start the next match.
size_t match_trailing_whitespace(const Piece& p, size_t i, size_t n) {
  if (n > 1 && i + n < p.end) return n - 1;
  return n;
}

size_t match_gpt2(const Piece& p, size_t i) {
  if (size_t n = match_contraction(p, i, false)) return n;
  const size_t start = (p.cp(i) == ' ') ? i + 1 : i;  // the optional leading space
  const uint8_t f = p.flag(start);
  size_t j = start;
  if (f & kLetter) {
    while (p.has(j, kLetter)) ++j;
    return j - i;
  }
  if (f & kNumber) {
    while (p.has(j, kNumber)) ++j;
    return j - i;
  }
  if (f != 0 && !(f & kSpaceLetterNumber)) {
    while (p.flag(j) != 0 && !p.has(j, kSpaceLetterNumber)) ++j;
    return j - i;
  }
  if (size_t n = whitespace_run(p, i)) return match_trailing_whitespace(p, i, n);
  return 1;
}

bool is_cr_or_lf(uint32_t c) { return c == '\r' || c == '\n'; }

size_t match_llama3(const Piece& p, size_t i, size_t max_digits) {
  if (size_t n = match_contraction(p, i, true)) return n;
  const uint32_t c = p.cp(i);
  const uint8_t f = p.flag(i);
  // [^\r\n\p{L}\p{N}]?\p{L}+
  if ((f & kLetter) || (!is_cr_or_lf(c) && !(f & kLetterOrNumber) && p.has(i + 1, kLetter))) {
    size_t j = i + 1;
    while (p.has(j, kLetter)) ++j;
    return j - i;
  }
  // \p{N}{1,N}
  if (f & kNumber) {
    size_t j = i;
    while (j - i < max_digits && p.has(j, kNumber)) ++j;
    return j - i;
  }
  // ' ?[^\s\p{L}\p{N}]+[\r\n]*'
  const size_t start = (c == ' ') ? i + 1 : i;
  const uint8_t fs = p.flag(start);
  if (fs != 0 && !(fs & kSpaceLetterNumber)) {
    size_t j = start;
    while (p.flag(j) != 0 && !p.has(j, kSpaceLetterNumber)) ++j;
    while (is_cr_or_lf(p.cp(j))) ++j;
    return j - i;
  }
  const size_t n = whitespace_run(p, i);
  if (n > 0) {
    // \s*[\r\n]+ : the run up to and including its last line break.
    for (size_t k = n; k > 0; --k) {
      if (is_cr_or_lf(p.cp(i + k - 1))) return k;
    }
    return match_trailing_whitespace(p, i, n);
  }
  return 1;
}

bool is_ascii_digit(uint32_t c) { return c >= '0' && c <= '9'; }

// The characters of [\p{P}\$\+<=>\^~\|].
bool is_punctuation_run_char(uint32_t c, uint8_t f) {
  return (f & kPunctuation) || c == '$' || c == '+' || c == '<' || c == '=' || c == '>' ||
         c == '^' || c == '~' || c == '|';
}

// The length of the pass's match at i (0: none). The patterns of kGpt2, kLlama3 and kQwen2
// match at every position, so they partition a piece; the others leave gaps between matches.
size_t match_at(Split pass, const Piece& p, size_t i) {
  switch (pass) {
    case Split::kGpt2:
      return match_gpt2(p, i);
    case Split::kLlama3:
      return match_llama3(p, i, 3);
    case Split::kQwen2:
      return match_llama3(p, i, 1);
    case Split::kEachNumber:
      return p.has(i, kNumber) ? 1 : 0;
    case Split::kNumberRuns: {
      size_t j = i;
      while (p.has(j, kNumber)) ++j;
      return j - i;
    }
    case Split::kAsciiDigitTriples:
      return (is_ascii_digit(p.cp(i)) && is_ascii_digit(p.cp(i + 1)) && is_ascii_digit(p.cp(i + 2)))
                 ? 3
                 : 0;
    case Split::kPunctuationRuns: {
      size_t j = i;
      while (j < p.end && is_punctuation_run_char(p.cp(j), p.flag(j))) ++j;
      return j - i;
    }
  }
  return 0;
}

}  // namespace

std::vector<std::pair<size_t, size_t>> split_text(const std::string& text,
                                                  const std::vector<Split>& passes) {
  const Decoded d = decode_utf8(text);
  const size_t n = d.cps.size();
  std::vector<uint8_t> f(n);
  for (size_t i = 0; i < n; ++i) f[i] = flags(d.cps[i]);

  // Pieces as codepoint ranges [first, second).
  std::vector<std::pair<size_t, size_t>> pieces;
  if (n > 0) pieces.emplace_back(0, n);
  std::vector<std::pair<size_t, size_t>> next;
  for (const Split pass : passes) {
    next.clear();
    next.reserve(pieces.size() * 2);
    for (const auto& range : pieces) {
      const Piece p{d.cps.data(), f.data(), range.first, range.second};
      size_t gap = p.begin;
      size_t i = p.begin;
      while (i < p.end) {
        const size_t len = match_at(pass, p, i);
        if (len == 0) {
          ++i;
          continue;
        }
        if (gap < i) next.emplace_back(gap, i);
        next.emplace_back(i, i + len);
        i += len;
        gap = i;
      }
      if (gap < p.end) next.emplace_back(gap, p.end);
    }
    pieces.swap(next);
  }

  std::vector<std::pair<size_t, size_t>> out;
  out.reserve(pieces.size());
  for (const auto& range : pieces) {
    const size_t begin = d.offsets[range.first];
    out.emplace_back(begin, d.offsets[range.second] - begin);
  }
  return out;
}

}  // namespace unicode
}  // namespace ggraph
