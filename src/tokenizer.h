// Tokenizers built from the GGUF vocabulary: byte-level BPE (gpt2) and SentencePiece (llama).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gguf.h"

namespace ggraph {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Builds the tokenizer named by tokenizer.ggml.model; throws GGUFError if absent or unsupported.
  static std::unique_ptr<Tokenizer> from_gguf(const GGUFFile& file);

  // add_bos: prepend BOS. parse_special: control-token text (e.g. "<|im_start|>") maps to its id;
  // otherwise it is tokenized as plain text. User-defined tokens map to their ids either way.
  virtual std::vector<int32_t> tokenize(const std::string& text, bool add_bos,
                                        bool parse_special) const = 0;
  // The bytes of one token as text (may be part of a UTF-8 character). Control tokens give "".
  // Ids outside the vocabulary throw ArgumentError.
  virtual std::string token_to_piece(int32_t id, bool render_special = false) const = 0;
  std::string detokenize(const std::vector<int32_t>& ids, bool render_special = false) const;

  int32_t n_vocab() const { return n_vocab_; }
  int32_t bos_id() const { return bos_; }
  int32_t eos_id() const { return eos_; }
  int32_t unk_id() const { return unk_; }  // -1 when the vocabulary has none
  bool add_bos_default() const { return add_bos_; }
  // SentencePiece vocabularies prefix text with a space; detokenize drops it again.
  bool add_space_prefix() const { return add_space_prefix_; }
  bool is_end_of_generation(int32_t id) const;  // EOS, EOT and the like
  // Those ids, ascending.
  const std::vector<int32_t>& end_of_generation() const { return end_of_generation_; }
  const std::string& model_name() const { return model_; }  // "gpt2" | "llama"
  const std::string& pre_name() const { return pre_; }

 protected:
  int32_t n_vocab_ = 0;
  int32_t bos_ = -1;
  int32_t eos_ = -1;
  int32_t unk_ = -1;
  bool add_bos_ = false;
  bool add_space_prefix_ = false;
  std::string model_;
  std::string pre_;
  std::vector<int32_t> end_of_generation_;
};

// Streaming detokenization: feed ids one at a time; returns only complete UTF-8 characters,
// holding back a token that ends mid-character until the next completes it.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok, bool render_special = false)
      : tok_(tok), render_special_(render_special) {}
  std::string push(int32_t id);
  std::string flush();  // whatever is pending, invalid bytes replaced by U+FFFD

 private:
  const Tokenizer& tok_;
  bool render_special_ = false;
  std::string pending_;
};

}  // namespace ggraph
