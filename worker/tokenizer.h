// Text <-> token ids, and chat messages -> text. A model folder's tokenizer, in the order
// Hugging Face's AutoTokenizer prefers them: tokenizer.json (worker/text/hf_tokenizer.h),
// vocab.json + merges.txt (GPT-2, OPT), a sentencepiece tokenizer.model; a model with none
// (dummy shapes) takes and returns token ids as whitespace- or comma-separated integers.
// tokenizer_config.json adds the BOS/EOS rules and the chat template (worker/text/
// chat_template.h; chat_template.jinja beside it wins, as in transformers).
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "worker/config.h"
#include "worker/text/chat_template.h"
#include "worker/text/hf_tokenizer.h"

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace strata {

class Tokenizer {
 public:
  // Loads the folder's tokenizer (see above); `path` may also name a tokenizer.json or
  // tokenizer.model file itself. Throws InputError naming the file for a corrupt, unsupported
  // or oversized (limits.tokenizer_file_bytes, json_file_bytes) tokenizer file, more pieces
  // than the config's vocab_size, an add_bos_token / add_eos_token that is not a boolean, or
  // a chat template that does not parse.
  static std::unique_ptr<Tokenizer> load(const std::string& path, const ModelConfig& config,
                                         const InputLimits& limits = {});
  // A tokenizer on its own, for tools (strata tokenize, predict): `path` is a tokenizer.json,
  // tokenizer.model or a folder holding one (its config.json, if any, gives the BOS id), or
  // a hub cache model (model_path.h: ORG/NAME, a repo or snapshot folder); any number of
  // tokens is accepted. InputError naming the path when it holds no tokenizer.
  static std::unique_ptr<Tokenizer> open(const std::string& spec, const InputLimits& limits);
  // A sentencepiece tokenizer from a serialized model (the bytes of tokenizer.model);
  // `source` names it in messages.
  static std::unique_ptr<Tokenizer> from_bytes(std::string_view model_bytes,
                                               const ModelConfig& config,
                                               const std::string& source);
  // Id passthrough for models without a tokenizer.
  static std::unique_ptr<Tokenizer> ids_only(const ModelConfig& config);
  ~Tokenizer();

  bool has_vocabulary() const { return sp_ != nullptr || hf_ != nullptr; }
  // "tokenizer.json", "vocab.json+merges.txt", "sentencepiece" or "ids".
  std::string kind() const;
  const std::string& source() const { return source_; }
  // Prompt text -> ids; with add_special, the special tokens the model's files add (BOS, EOS:
  // the post-processor of a tokenizer.json, add_bos_token / add_eos_token otherwise). For an
  // id-only tokenizer the text must be integers ("1 403 407" or "1,403,407"); anything else
  // is an InputError.
  std::vector<int32_t> encode(const std::string& text, bool add_special = true) const;
  // Ids -> text. skip_special: special tokens (BOS, EOS, chat markers) print as nothing, as
  // completions are shown; else as their text. Id-only: "1 403 407".
  std::string decode(const std::vector<int32_t>& ids, bool skip_special = true) const;
  // The token strings of the vocabulary ("Ġthe", "▁the"); the id for an id-only tokenizer.
  std::string piece(int32_t id) const;

  // The most bytes of text one token can stand for, as a bound on a prompt's length before
  // it is tokenized: a text with P printable ASCII bytes (0x21-0x7e) is at least P / this
  // many tokens. 0 where no such bound holds: ids only, a printable ASCII character with no
  // token of its own nor a byte-fallback one (it could be swallowed by an unknown token), a
  // normalizer or pre-tokenizer that may drop printable ASCII (Hugging Face's Replace, a
  // Split that removes; sentencepiece's user-defined rules). Costs a pass over the
  // vocabulary: call it once.
  size_t max_token_bytes() const;

  bool has_chat_template() const { return chat_.has_value(); }
  // A chat's messages as the prompt text its template writes (special tokens included, so it
  // is encoded with add_special false). InputError when the model has no chat template or
  // the messages or template refuse.
  std::string render_chat(const nlohmann::json& messages, bool add_generation_prompt,
                          const nlohmann::json& variables = nlohmann::json::object()) const;
  // The text `output` adds after `prompt`: decoded with the prompt's last tokens as context,
  // so a word that starts the completion keeps its leading space (sentencepiece drops the
  // space of a text's first piece). Costs the output's length, not the prompt's.
  std::string completion(const std::vector<int32_t>& prompt,
                         const std::vector<int32_t>& output) const;

 private:
  Tokenizer() = default;
  void read_tokenizer_config(const std::string& path, const InputLimits& limits);
  void read_chat_template(const std::string& dir, const InputLimits& limits);
  void check_size(const ModelConfig& config) const;

  std::vector<int32_t> encode_pieces(std::string_view text) const;

  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;
  // sentencepiece's control and unknown pieces ("<s>", "</s>", "<unk>"): matched
  // in text as their ids, as Hugging Face's tokenizers match special tokens, longest first.
  std::vector<std::pair<std::string, int32_t>> sp_specials_;
  std::unique_ptr<HfTokenizer> hf_;
  bool vocab_merges_ = false;  // hf_ from vocab.json + merges.txt
  std::optional<ChatTemplate> chat_;
  std::string source_;  // the tokenizer file, for messages
  int32_t pieces_ = 0;
  // sentencepiece and vocab.json: BOS / EOS as tokenizer_config.json says (tokenizer.json's
  // own post-processor decides for it).
  bool add_bos_ = true;
  bool add_eos_ = false;
  int32_t bos_ = -1;
  int32_t eos_ = -1;
  int32_t vocab_ = 0;
};

}  // namespace strata
