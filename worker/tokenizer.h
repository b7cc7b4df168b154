// Text <-> token ids. Models with a sentencepiece `tokenizer.model` get a real tokenizer;
// a model without one (dummy shapes, OPT checkpoints with a BPE vocab) takes and returns
// token ids as whitespace- or comma-separated integers.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "worker/config.h"

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace strata {

class Tokenizer {
 public:
  // Loads <dir>/tokenizer.model if present (and tokenizer_config.json for add_bos_token);
  // otherwise an id-passthrough tokenizer. Throws InputError naming the file for a corrupt or
  // oversized (limits.tokenizer_file_bytes, json_file_bytes) tokenizer file, more pieces than
  // the config's vocab_size, or an add_bos_token that is not a boolean.
  static std::unique_ptr<Tokenizer> load(const std::string& dir, const ModelConfig& config,
                                         const InputLimits& limits = {});
  // A sentencepiece tokenizer from a serialized model (the bytes of tokenizer.model);
  // `source` names it in messages.
  static std::unique_ptr<Tokenizer> from_bytes(std::string_view model_bytes,
                                               const ModelConfig& config,
                                               const std::string& source);
  // Id passthrough for models without a tokenizer.
  static std::unique_ptr<Tokenizer> ids_only(const ModelConfig& config);
  ~Tokenizer();

  bool has_vocabulary() const { return sp_ != nullptr; }
  // Prompt text -> ids, BOS first when the model adds one. For an id-only tokenizer the
  // text must be integers ("1 403 407" or "1,403,407"); anything else is an InputError.
  std::vector<int32_t> encode(const std::string& text) const;
  // Ids -> text (control tokens such as BOS print as nothing). Id-only: "1 403 407".
  std::string decode(const std::vector<int32_t>& ids) const;
  // The text `output` adds after `prompt`: decoded with the prompt's last tokens as context,
  // so a word that starts the completion keeps its leading space (sentencepiece drops the
  // space of a text's first piece). Costs the output's length, not the prompt's.
  std::string completion(const std::vector<int32_t>& prompt,
                         const std::vector<int32_t>& output) const;

 private:
  Tokenizer() = default;
  void read_tokenizer_config(const std::string& path, const InputLimits& limits);

  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;
  std::string source_;  // the tokenizer file, for messages
  int32_t pieces_ = 0;
  bool add_bos_ = true;
  int32_t bos_ = -1;
  int32_t vocab_ = 0;
};

}  // namespace strata
