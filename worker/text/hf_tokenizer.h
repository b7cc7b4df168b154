// Hugging Face tokenizer.json (BPE models: byte-level as GPT-2/Llama-3/Qwen, sentencepiece-style
// as Llama-2) with the encode/decode semantics of the `tokenizers` library. Anything in a file
// that would change ids and is not implemented is refused at load, by name (docs/TEXT.md).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace strata {

class HfTokenizer {
 public:
  // The text of a tokenizer.json; `source` (its path) names it in every error. Throws
  // InputError naming source and the JSON path of the field at fault for malformed JSON or any
  // component/option not supported.
  static std::unique_ptr<HfTokenizer> from_json(std::string_view json_text,
                                                const std::string& source);
  // A GPT-2 style folder: vocab.json (token -> id) + merges.txt ("#version" line optional),
  // byte-level BPE with GPT-2's pre-tokenizer regex, as HF's GPT2Tokenizer. "<|endoftext|>",
  // when in the vocab, is a special added token as in GPT-2's own tokenizer.json.
  static std::unique_ptr<HfTokenizer> from_vocab_merges(std::string_view vocab_json,
                                                        std::string_view merges_txt,
                                                        const std::string& source);
  ~HfTokenizer();
  HfTokenizer(const HfTokenizer&) = delete;
  HfTokenizer& operator=(const HfTokenizer&) = delete;

  // HF's encode(text, add_special_tokens=add_special). `text` must be valid UTF-8 (InputError
  // naming the byte offset otherwise). Safe to call from several threads at once.
  std::vector<int32_t> encode(std::string_view text, bool add_special) const;
  // HF's decode(ids, skip_special_tokens). Ids outside [0, vocab_size()) -> InputError naming
  // the id and source; ids inside it that no token has decode to nothing, as in HF.
  std::string decode(std::span<const int32_t> ids, bool skip_special = false) const;
  int32_t vocab_size() const;  // max id (model vocab and added tokens) + 1
  // The most bytes a vocabulary or added token's string has (a byte-level token's string is
  // at least as long as the bytes it stands for), or 0 when the normalizer may drop printable
  // ASCII (a Replace): then no prompt length is bounded by it (Tokenizer::max_token_bytes).
  size_t max_token_bytes() const;
  std::optional<int32_t> token_to_id(std::string_view token) const;  // added token or vocab
  std::string id_to_token(int32_t id) const;  // the raw vocabulary string ("Ġthe"), "" if none
  bool is_special(int32_t id) const;          // an added token with special=true
  const std::string& source() const;

  struct Impl;  // defined in hf_tokenizer.cpp

 private:
  explicit HfTokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata
