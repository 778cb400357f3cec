// Tokenizers built from a GGUF vocabulary. Both kinds share the vocabulary tables and the
// splitting of text at special-token strings; they differ in how a stretch of plain text
// becomes ids: byte-level BPE merges by rank inside pre-tokenizer words, SentencePiece merges by
// score over the whole stretch with spaces written as U+2581.
#include "tokenizer.h"

#include <algorithm>
#include <cstdio>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "unicode.h"

namespace ggraph {
namespace {

// tokenizer.ggml.token_type values.
enum TokenType : int32_t {
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,
  kUserDefined = 4,
  kUnused = 5,
  kByte = 6,
};

// Tokens that end a generation although the metadata may not name them: end-of-turn markers of
// chat vocabularies, and the fill-in-the-middle pad, repository and file-separator tokens, which
// end a code completion. The same texts llama.cpp recognises, so both stop at the same tokens.
const char* const kEndOfGenerationTexts[] = {
    "<|eot_id|>",      "<|im_end|>",         "<|end|>",       "<|return|>", "<|call|>",
    "<end_of_turn>",   "<|endoftext|>",      "<|eom_id|>",    "<EOT>",      "_<EOT>",
    "<|end_of_text|>", "<end_of_utterance>", "<|fim_pad|>",   "<fim-pad>",  "<fim_pad>",
    "<PAD>",           "<|fim_repo|>",       "<|repo_name|>", "<fim-repo>", "<REPO>",
    "<reponame>",      "<|file_sep|>",
};

const char kSpmSpace[] = "\xE2\x96\x81";  // U+2581, SentencePiece's visible space

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

// GPT-2's reversible map from bytes to printable codepoints: printable Latin-1 bytes stand for
// themselves, the rest take codepoints from U+0100 on, in byte order.
struct ByteMap {
  uint32_t byte_to_cp[256];
  int16_t cp_to_byte[512];

  ByteMap() {
    std::fill(std::begin(cp_to_byte), std::end(cp_to_byte), int16_t{-1});
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      byte_to_cp[b] = printable ? static_cast<uint32_t>(b) : next++;
      cp_to_byte[byte_to_cp[b]] = static_cast<int16_t>(b);
    }
  }
};

const ByteMap& byte_map() {
  static const ByteMap map;
  return map;
}

// A stretch of the input: either plain text or an already-matched special token.
struct Fragment {
  int32_t token;  // -1 for text
  size_t offset;
  size_t length;
};

// The vocabulary tables and everything both tokenizer kinds do alike.
class VocabTokenizer : public Tokenizer {
 public:
  VocabTokenizer(const GGUFFile& file, const std::string& model);
  VocabTokenizer(const VocabTokenizer&) = delete;
  VocabTokenizer& operator=(const VocabTokenizer&) = delete;

  std::vector<int32_t> tokenize(const std::string& text, bool add_bos,
                                bool parse_special) const override;

 protected:
  // Appends the ids of a stretch of plain text; after_special: it starts the input or follows a
  // control token.
  virtual void encode_text(const std::string& text, bool after_special,
                           std::vector<int32_t>* out) const = 0;

  int32_t find(std::string_view text) const {
    auto it = ids_.find(text);
    return it == ids_.end() ? -1 : it->second;
  }
  int32_t type(int32_t id) const { return types_[id]; }
  // The raw text of tokens that render as themselves rather than as decoded text.
  bool renders_raw(int32_t id, bool render_special, std::string* piece) const;
  void check_id(int32_t id) const;

  std::vector<std::string> texts_;
  std::vector<float> scores_;
  std::vector<int32_t> types_;
  std::unordered_map<std::string_view, int32_t> ids_;  // views into texts_

 private:
  std::vector<Fragment> split_special(const std::string& text, bool parse_special) const;
  int32_t read_id(const GGUFFile& file, const std::string& key, int32_t def) const;

  std::vector<int32_t> specials_;  // control, unknown and user-defined tokens, longest first
  // A trie of the specials' texts (node 0 the root; each node's children sorted by byte), and
  // the node each entry of specials_ ends at: one pass over a text finds which specials occur
  // in it, where a search of the text for each special costs as many passes as there are
  // specials (thousands in some vocabularies, most of them starting with '<').
  std::vector<std::vector<std::pair<uint8_t, int32_t>>> trie_;
  std::vector<int32_t> special_node_;
  int32_t trie_child(int32_t node, uint8_t c) const {
    const auto& next = trie_[size_t(node)];
    auto it = std::lower_bound(next.begin(), next.end(), std::make_pair(c, int32_t(-1)));
    return it != next.end() && it->first == c ? it->second : -1;
  }
};

VocabTokenizer::VocabTokenizer(const GGUFFile& file, const std::string& model) {
  model_ = model;
  texts_ = file.get_string_array("tokenizer.ggml.tokens");
  if (texts_.empty())
    throw GGUFError("tokenizer.ggml.tokens: expected tokens, found an empty list");
  if (texts_.size() > static_cast<size_t>(INT32_MAX))
    throw GGUFError("tokenizer.ggml.tokens: " + std::to_string(texts_.size()) +
                    " tokens do not fit 32-bit ids");
  n_vocab_ = static_cast<int32_t>(texts_.size());

  if (file.has("tokenizer.ggml.scores")) {
    scores_ = file.get_float_array("tokenizer.ggml.scores");
    if (scores_.size() != texts_.size())
      throw GGUFError("tokenizer.ggml.scores: expected " + std::to_string(texts_.size()) +
                      " scores (one per token), found " + std::to_string(scores_.size()));
  } else {
    scores_.assign(texts_.size(), 0.0f);
  }
  if (file.has("tokenizer.ggml.token_type")) {
    types_ = file.get_int_array("tokenizer.ggml.token_type");
    if (types_.size() != texts_.size())
      throw GGUFError("tokenizer.ggml.token_type: expected " + std::to_string(texts_.size()) +
                      " types (one per token), found " + std::to_string(types_.size()));
  } else {
    types_.assign(texts_.size(), kNormal);
  }

  ids_.reserve(texts_.size());
  for (int32_t id = 0; id < n_vocab_; ++id) ids_.emplace(texts_[id], id);  // first id wins

  for (int32_t id = 0; id < n_vocab_; ++id) {
    const int32_t t = types_[id];
    if ((t == kControl || t == kUnknown || t == kUserDefined) && !texts_[id].empty())
      specials_.push_back(id);
  }
  std::stable_sort(specials_.begin(), specials_.end(),
                   [this](int32_t a, int32_t b) { return texts_[a].size() > texts_[b].size(); });
  trie_.emplace_back();
  for (const int32_t id : specials_) {
    int32_t node = 0;
    for (const char ch : texts_[id]) {
      const uint8_t c = static_cast<uint8_t>(ch);
      int32_t child = trie_child(node, c);
      if (child < 0) {
        child = static_cast<int32_t>(trie_.size());
        auto& next = trie_[size_t(node)];
        next.insert(std::lower_bound(next.begin(), next.end(), std::make_pair(c, int32_t(-1))),
                    {c, child});
        trie_.emplace_back();
      }
      node = child;
    }
    special_node_.push_back(node);
  }

  const bool spm = model == "llama";
  bos_ = read_id(file, "tokenizer.ggml.bos_token_id", spm ? 1 : -1);
  eos_ = read_id(file, "tokenizer.ggml.eos_token_id", spm ? 2 : -1);
  unk_ = read_id(file, "tokenizer.ggml.unknown_token_id", spm ? 0 : -1);
  const int32_t eot = read_id(file, "tokenizer.ggml.eot_token_id", -1);
  const int32_t eom = read_id(file, "tokenizer.ggml.eom_token_id", -1);
  for (int32_t id : {eos_, eot, eom}) {
    if (id >= 0) end_of_generation_.push_back(id);
  }
  for (const char* marker : kEndOfGenerationTexts) {
    const int32_t id = find(marker);
    if (id >= 0) end_of_generation_.push_back(id);
  }
  std::sort(end_of_generation_.begin(), end_of_generation_.end());
  end_of_generation_.erase(std::unique(end_of_generation_.begin(), end_of_generation_.end()),
                           end_of_generation_.end());
}

int32_t VocabTokenizer::read_id(const GGUFFile& file, const std::string& key, int32_t def) const {
  if (!file.has(key)) return (def >= 0 && def < n_vocab_) ? def : -1;
  const int64_t v = file.get_int(key);
  // Converters write -1 (or its unsigned 32-bit image) for "no such token".
  if (v == -1 || v == 0xFFFFFFFFll) return -1;
  if (v < 0 || v >= n_vocab_)
    throw GGUFError(key + ": expected a token id in [0, " + std::to_string(n_vocab_) + "), found " +
                    std::to_string(v));
  return static_cast<int32_t>(v);
}

void VocabTokenizer::check_id(int32_t id) const {
  if (id < 0 || id >= n_vocab_)
    throw ArgumentError("token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                        std::to_string(n_vocab_) + ")");
}

std::vector<Fragment> VocabTokenizer::split_special(const std::string& text,
                                                    bool parse_special) const {
  std::vector<Fragment> frags;
  if (text.empty()) return frags;
  frags.push_back({-1, 0, text.size()});
  // Longest token first, over the whole text, as llama.cpp does: a longer special token wins
  // over a shorter one it contains. User-defined tokens always match (they are ordinary
  // vocabulary that the model was trained to see whole); control and unknown tokens only when
  // asked to.
  // The trie's nodes the text reaches from any position: a special occurs where its end node
  // is among them.
  std::vector<uint8_t> reached(trie_.size(), 0);
  for (size_t i = 0; i < text.size(); ++i) {
    int32_t node = 0;
    for (size_t j = i; j < text.size(); ++j) {
      node = trie_child(node, static_cast<uint8_t>(text[j]));
      if (node < 0) break;
      reached[size_t(node)] = 1;
    }
  }
  std::vector<Fragment> next;
  for (size_t k = 0; k < specials_.size(); ++k) {
    const int32_t id = specials_[k];
    if (!parse_special && types_[id] != kUserDefined) continue;
    if (!reached[size_t(special_node_[k])]) continue;
    const std::string& s = texts_[id];
    next.clear();
    for (const Fragment& f : frags) {
      if (f.token >= 0) {
        next.push_back(f);
        continue;
      }
      size_t pos = f.offset;
      const size_t end = f.offset + f.length;
      while (pos < end) {
        size_t hit = text.find(s, pos);
        if (hit == std::string::npos || hit + s.size() > end) break;
        if (hit > pos) next.push_back({-1, pos, hit - pos});
        next.push_back({id, hit, s.size()});
        pos = hit + s.size();
      }
      if (pos < end) next.push_back({-1, pos, end - pos});
    }
    frags.swap(next);
  }
  return frags;
}

std::vector<int32_t> VocabTokenizer::tokenize(const std::string& text, bool add_bos,
                                              bool parse_special) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 2);
  if (add_bos) {
    if (bos_ < 0)
      throw ArgumentError("tokenize: add_bos was requested but the vocabulary has no BOS token");
    out.push_back(bos_);
  }
  bool after_special = true;
  for (const Fragment& f : split_special(text, parse_special)) {
    if (f.token >= 0 && types_[f.token] == kUserDefined) {
      // A user-defined token is a piece of the text, as in SentencePiece: text starting with
      // one still gets the space prefix before it, and the text after it none.
      if (after_special) encode_text(std::string(), true, &out);
      out.push_back(f.token);
      after_special = false;
    } else if (f.token >= 0) {
      out.push_back(f.token);
      after_special = true;
    } else {
      encode_text(text.substr(f.offset, f.length), after_special, &out);
      after_special = false;
    }
  }
  return out;
}

bool VocabTokenizer::renders_raw(int32_t id, bool render_special, std::string* piece) const {
  const int32_t t = types_[id];
  if (t == kControl || t == kUnknown) {
    *piece = render_special ? texts_[id] : std::string();
    return true;
  }
  if (t == kUserDefined) {
    *piece = texts_[id];
    return true;
  }
  return false;
}

// ---------------------------------------------------------------------------------------------
// Byte-level BPE (tokenizer.ggml.model = "gpt2").

struct PreTokenizerSpec {
  const char* name;
  std::vector<unicode::Split> passes;
  bool ignore_merges;  // a word that is itself a token is taken whole (Llama 3)
  bool add_bos;        // default when the file does not say
};

const std::vector<PreTokenizerSpec>& pre_tokenizers() {
  using unicode::Split;
  static const std::vector<PreTokenizerSpec> specs = {
      {"default",
       {Split::kPunctuationRuns, Split::kGpt2, Split::kNumberRuns, Split::kAsciiDigitTriples},
       false,
       false},
      {"gpt2", {Split::kGpt2}, false, false},
      {"gpt-2", {Split::kGpt2}, false, false},
      {"smollm", {Split::kEachNumber, Split::kGpt2}, false, false},
      {"llama-bpe", {Split::kLlama3}, true, true},
      {"llama3", {Split::kLlama3}, true, true},
      {"llama-v3", {Split::kLlama3}, true, true},
      {"qwen2", {Split::kQwen2}, false, false},
  };
  return specs;
}

class BpeTokenizer : public VocabTokenizer {
 public:
  explicit BpeTokenizer(const GGUFFile& file);
  std::string token_to_piece(int32_t id, bool render_special) const override;

 private:
  void encode_text(const std::string& text, bool after_special,
                   std::vector<int32_t>* out) const override;
  void encode_word(const char* word, size_t n, std::vector<int32_t>* out) const;

  struct Merge {
    int32_t rank;
    int32_t result;
  };
  static uint64_t pair_key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }

  std::vector<unicode::Split> passes_;
  bool ignore_merges_ = false;
  int32_t byte_token_[256];  // the token of each byte's GPT-2 character, -1 when absent
  std::unordered_map<uint64_t, Merge> merges_;
};

BpeTokenizer::BpeTokenizer(const GGUFFile& file) : VocabTokenizer(file, "gpt2") {
  const GGUFValue* pre = file.find("tokenizer.ggml.pre");
  // Files written before the key existed used the default split, as llama.cpp assumes.
  pre_ = pre ? file.get_string("tokenizer.ggml.pre") : "default";
  const PreTokenizerSpec* spec = nullptr;
  std::vector<std::string> names;
  for (const auto& s : pre_tokenizers()) {
    names.push_back(s.name);
    if (pre_ == s.name) spec = &s;
  }
  if (!spec)
    throw GGUFError("tokenizer.ggml.pre: pre-tokenizer '" + pre_ +
                    "' is not supported; supported: " + join(names));
  passes_ = spec->passes;
  ignore_merges_ = spec->ignore_merges;
  add_bos_ = file.get_bool("tokenizer.ggml.add_bos_token", spec->add_bos) && bos_ >= 0;

  const ByteMap& bm = byte_map();
  for (int b = 0; b < 256; ++b) byte_token_[b] = find(unicode::to_utf8(bm.byte_to_cp[b]));

  if (!file.has("tokenizer.ggml.merges"))
    throw GGUFError(
        "tokenizer.ggml.merges: a gpt2 (byte-level BPE) vocabulary needs its merges; "
        "the key is missing");
  const std::vector<std::string> merges = file.get_string_array("tokenizer.ggml.merges");
  merges_.reserve(merges.size());
  std::string joined;
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const std::string& m = merges[rank];
    // The separator is the first space after the first character: BPE symbols never hold a
    // raw space, but a left symbol could in principle be one.
    const size_t sep = m.find(' ', 1);
    if (sep == std::string::npos)
      throw GGUFError("tokenizer.ggml.merges[" + std::to_string(rank) +
                      "]: expected two symbols separated by a space, found '" + m + "'");
    const std::string_view left(m.data(), sep);
    const std::string_view right(m.data() + sep + 1, m.size() - sep - 1);
    const int32_t a = find(left), b = find(right);
    joined.assign(left);
    joined.append(right);
    const int32_t ab = find(joined);
    // A merge whose parts or result are not tokens can never fire on token symbols.
    if (a < 0 || b < 0 || ab < 0) continue;
    merges_.emplace(pair_key(a, b), Merge{static_cast<int32_t>(rank), ab});  // first rank wins
  }
}

void BpeTokenizer::encode_text(const std::string& text, bool after_special,
                               std::vector<int32_t>* out) const {
  for (const auto& word : unicode::split_text(text, passes_))
    encode_word(text.data() + word.first, word.second, out);
}

void BpeTokenizer::encode_word(const char* word, size_t n, std::vector<int32_t>* out) const {
  const ByteMap& bm = byte_map();
  if (ignore_merges_) {
    std::string mapped;
    for (size_t i = 0; i < n; ++i)
      unicode::append_utf8(bm.byte_to_cp[static_cast<uint8_t>(word[i])], &mapped);
    const int32_t id = find(mapped);
    if (id >= 0) {
      out->push_back(id);
      return;
    }
  }

  // Symbols form a linked list over the word's bytes; a merge keeps the left symbol and marks the
  // right one dead (id kDead), so stale candidates fail the id check when they come up.
  constexpr int32_t kDead = -2;
  struct Symbol {
    int32_t id;
    int32_t next;
  };
  struct Candidate {
    int32_t rank;
    int32_t left;
    int32_t right;
    int32_t left_id;
    int32_t right_id;
    int32_t result;
  };
  // Lowest rank first, then leftmost.
  const auto later = [](const Candidate& x, const Candidate& y) {
    return x.rank != y.rank ? x.rank > y.rank : x.left > y.left;
  };

  std::vector<Symbol> syms(n);
  std::vector<int32_t> prev(n);
  for (size_t i = 0; i < n; ++i) {
    syms[i] = {byte_token_[static_cast<uint8_t>(word[i])],
               i + 1 < n ? static_cast<int32_t>(i + 1) : -1};
    prev[i] = static_cast<int32_t>(i) - 1;
  }
  std::vector<Candidate> heap;
  const auto consider = [&](int32_t l, int32_t r) {
    if (l < 0 || r < 0 || syms[l].id < 0 || syms[r].id < 0) return;
    auto it = merges_.find(pair_key(syms[l].id, syms[r].id));
    if (it == merges_.end()) return;
    heap.push_back({it->second.rank, l, r, syms[l].id, syms[r].id, it->second.result});
    std::push_heap(heap.begin(), heap.end(), later);
  };
  for (size_t i = 0; i + 1 < n; ++i) consider(static_cast<int32_t>(i), static_cast<int32_t>(i + 1));

  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), later);
    const Candidate c = heap.back();
    heap.pop_back();
    Symbol& l = syms[c.left];
    Symbol& r = syms[c.right];
    if (l.id != c.left_id || r.id != c.right_id || l.next != c.right) continue;
    l.id = c.result;
    l.next = r.next;
    if (r.next >= 0) prev[r.next] = c.left;
    r.id = kDead;
    consider(prev[c.left], c.left);
    consider(c.left, l.next);
  }

  // A byte whose character the vocabulary lacks yields nothing, as in llama.cpp.
  for (int32_t i = 0; i >= 0 && static_cast<size_t>(i) < n; i = syms[i].next) {
    if (syms[i].id >= 0) out->push_back(syms[i].id);
  }
}

std::string BpeTokenizer::token_to_piece(int32_t id, bool render_special) const {
  check_id(id);
  std::string piece;
  if (renders_raw(id, render_special, &piece)) return piece;
  const ByteMap& bm = byte_map();
  const std::string& text = texts_[id];
  size_t pos = 0;
  while (pos < text.size()) {
    const unicode::Utf8Step step = unicode::decode_utf8_step(text.data() + pos, text.size() - pos);
    const int b = (step.valid && step.cp < 512) ? bm.cp_to_byte[step.cp] : -1;
    if (b >= 0) {
      piece.push_back(static_cast<char>(b));
    } else {
      piece.append(text, pos, step.len);  // not a byte character: the text stands for itself
    }
    pos += step.len;
  }
  return piece;
}

// ---------------------------------------------------------------------------------------------
// SentencePiece BPE (tokenizer.ggml.model = "llama").

class SpmTokenizer : public VocabTokenizer {
 public:
  explicit SpmTokenizer(const GGUFFile& file);
  std::string token_to_piece(int32_t id, bool render_special) const override;

 private:
  void encode_text(const std::string& text, bool after_special,
                   std::vector<int32_t>* out) const override;
  // The token a merge may produce from this text, or -1. Control, unknown and byte tokens are
  // not merge results, as in SentencePiece.
  int32_t mergeable(std::string_view text) const {
    const int32_t id = find(text);
    if (id < 0) return -1;
    const int32_t t = types_[id];
    return (t == kNormal || t == kUserDefined || t == kUnused) ? id : -1;
  }

  int32_t byte_token_[256];  // <0xXX> tokens, -1 when absent
};

SpmTokenizer::SpmTokenizer(const GGUFFile& file) : VocabTokenizer(file, "llama") {
  pre_ = file.get_string("tokenizer.ggml.pre", "default");
  add_bos_ = file.get_bool("tokenizer.ggml.add_bos_token", true) && bos_ >= 0;
  add_space_prefix_ = file.get_bool("tokenizer.ggml.add_space_prefix", true);
  char name[8];
  for (int b = 0; b < 256; ++b) {
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    const int32_t id = find(name);
    byte_token_[b] = (id >= 0 && types_[id] == kByte) ? id : -1;
  }
}

void SpmTokenizer::encode_text(const std::string& raw, bool after_special,
                               std::vector<int32_t>* out) const {
  std::string text;
  text.reserve(raw.size() + raw.size() / 2 + 3);
  if (add_space_prefix_ && after_special) text += kSpmSpace;
  for (char c : raw) {
    if (c == ' ') {
      text += kSpmSpace;
    } else {
      text.push_back(c);
    }
  }

  // Symbols are byte ranges of text, one character each to begin with (a malformed byte
  // sequence is one symbol, and will fall back to byte tokens).
  struct Symbol {
    size_t offset;
    size_t len;  // 0 once merged into its left neighbour
    int32_t prev;
    int32_t next;
  };
  std::vector<Symbol> syms;
  syms.reserve(text.size());
  for (size_t pos = 0; pos < text.size();) {
    const unicode::Utf8Step step = unicode::decode_utf8_step(text.data() + pos, text.size() - pos);
    const int32_t index = static_cast<int32_t>(syms.size());
    syms.push_back({pos, static_cast<size_t>(step.len), index - 1, index + 1});
    pos += step.len;
  }
  if (syms.empty()) return;
  syms.back().next = -1;

  struct Candidate {
    float score;
    int32_t left;
    int32_t right;
    size_t len;  // left.len + right.len when proposed; a mismatch marks it stale
  };
  // Highest score first, then leftmost.
  const auto later = [](const Candidate& x, const Candidate& y) {
    return x.score != y.score ? x.score < y.score : x.left > y.left;
  };
  std::vector<Candidate> heap;
  const auto consider = [&](int32_t l, int32_t r) {
    if (l < 0 || r < 0) return;
    const size_t len = syms[l].len + syms[r].len;
    const int32_t id = mergeable(std::string_view(text.data() + syms[l].offset, len));
    if (id < 0) return;
    heap.push_back({scores_[id], l, r, len});
    std::push_heap(heap.begin(), heap.end(), later);
  };
  for (size_t i = 0; i + 1 < syms.size(); ++i)
    consider(static_cast<int32_t>(i), static_cast<int32_t>(i + 1));

  // Merges whose result is an unused token, to split that token again afterwards, as
  // SentencePiece does: key (offset, length) of the merged symbol, value the left part's length.
  std::unordered_map<uint64_t, size_t> unused_splits;
  const auto span_key = [](size_t offset, size_t len) {
    return (static_cast<uint64_t>(offset) << 32) | static_cast<uint64_t>(len);
  };

  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), later);
    const Candidate c = heap.back();
    heap.pop_back();
    Symbol& l = syms[c.left];
    Symbol& r = syms[c.right];
    if (l.len == 0 || r.len == 0 || l.next != c.right || l.len + r.len != c.len) continue;
    const int32_t id = find(std::string_view(text.data() + l.offset, c.len));
    if (types_[id] == kUnused) unused_splits[span_key(l.offset, c.len)] = l.len;
    l.len = c.len;
    l.next = r.next;
    if (r.next >= 0) syms[r.next].prev = c.left;
    r.len = 0;
    consider(l.prev, c.left);
    consider(c.left, l.next);
  }

  // Emits the tokens of one span: itself, its parts if it is an unused token, or bytes.
  std::vector<std::pair<size_t, size_t>> stack;
  for (int32_t i = 0; i >= 0; i = syms[i].next) {
    stack.emplace_back(syms[i].offset, syms[i].len);
    while (!stack.empty()) {
      const auto [offset, len] = stack.back();
      stack.pop_back();
      const int32_t id = mergeable(std::string_view(text.data() + offset, len));
      if (id >= 0 && types_[id] != kUnused) {
        out->push_back(id);
        continue;
      }
      auto split = unused_splits.find(span_key(offset, len));
      if (split != unused_splits.end()) {
        stack.emplace_back(offset + split->second, len - split->second);  // right, popped last
        stack.emplace_back(offset, split->second);
        continue;
      }
      if (id >= 0) {
        out->push_back(id);  // an unused single character: nothing smaller to fall back to
        continue;
      }
      for (size_t k = 0; k < len; ++k) {
        const int32_t b = byte_token_[static_cast<uint8_t>(text[offset + k])];
        if (b >= 0) {
          out->push_back(b);
        } else if (unk_ >= 0) {
          out->push_back(unk_);
          break;  // one unknown token per character
        }
      }
    }
  }
}

std::string SpmTokenizer::token_to_piece(int32_t id, bool render_special) const {
  check_id(id);
  std::string piece;
  if (renders_raw(id, render_special, &piece)) return piece;
  const std::string& text = texts_[id];
  if (types_[id] == kByte) {
    unsigned value = 0;
    if (text.size() == 6 && std::sscanf(text.c_str(), "<0x%02X>", &value) == 1)
      return std::string(1, static_cast<char>(value));
  }
  piece.reserve(text.size());
  for (size_t pos = 0; pos < text.size();) {
    if (text.compare(pos, 3, kSpmSpace) == 0) {
      piece.push_back(' ');
      pos += 3;
    } else {
      piece.push_back(text[pos++]);
    }
  }
  return piece;
}

}  // namespace

std::unique_ptr<Tokenizer> Tokenizer::from_gguf(const GGUFFile& file) {
  if (!file.has("tokenizer.ggml.model"))
    throw GGUFError(
        "tokenizer.ggml.model: the file has no tokenizer (key missing); supported "
        "tokenizers: gpt2 (byte-level BPE), llama (SentencePiece)");
  const std::string model = file.get_string("tokenizer.ggml.model");
  if (model == "gpt2") return std::make_unique<BpeTokenizer>(file);
  if (model == "llama") return std::make_unique<SpmTokenizer>(file);
  throw GGUFError("tokenizer.ggml.model: tokenizer '" + model +
                  "' is not supported; supported: gpt2 (byte-level BPE), llama (SentencePiece)");
}

std::string Tokenizer::detokenize(const std::vector<int32_t>& ids, bool render_special) const {
  std::string out;
  // SentencePiece's leading space is an artefact of encoding: the first piece that produces
  // text gives it back.
  bool strip_space = add_space_prefix_;
  for (const int32_t id : ids) {
    std::string piece = token_to_piece(id, render_special);
    if (strip_space && !piece.empty()) {
      if (piece[0] == ' ') piece.erase(0, 1);
      strip_space = false;
    }
    out += piece;
  }
  return out;
}

bool Tokenizer::is_end_of_generation(int32_t id) const {
  return std::binary_search(end_of_generation_.begin(), end_of_generation_.end(), id);
}

std::string StreamDecoder::push(int32_t id) {
  pending_ += tok_.token_to_piece(id, render_special_);
  // Everything but an unfinished character at the end can go out now; a malformed sequence
  // cannot become valid with more bytes, so it is replaced at once.
  const size_t keep = unicode::incomplete_utf8_tail(pending_);
  std::string out = unicode::sanitize_utf8(pending_.substr(0, pending_.size() - keep));
  pending_.erase(0, pending_.size() - keep);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out = unicode::sanitize_utf8(pending_);
  pending_.clear();
  return out;
}

}  // namespace ggraph
