#include "worker/tokenizer.h"

#include <sentencepiece_processor.h>

#include <charconv>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "kernels/error.h"

namespace strata {
namespace fs = std::filesystem;

Tokenizer::~Tokenizer() = default;

std::unique_ptr<Tokenizer> Tokenizer::ids_only(const ModelConfig& config) {
  std::unique_ptr<Tokenizer> t(new Tokenizer());
  t->bos_ = config.bos_token_id;
  t->vocab_ = config.vocab;
  return t;
}

std::unique_ptr<Tokenizer> Tokenizer::from_bytes(std::string_view model_bytes,
                                                 const ModelConfig& config,
                                                 const std::string& source) {
  auto t = ids_only(config);
  t->source_ = source;
  t->sp_ = std::make_unique<sentencepiece::SentencePieceProcessor>();
  sentencepiece::util::Status status;
  try {
    status = t->sp_->LoadFromSerializedProto(model_bytes);
  } catch (const std::exception& e) {
    // Found by fuzz_tokenizer: a piece of length zero makes sentencepiece's trie builder
    // (darts) throw instead of returning a status.
    fail_input("{}: cannot load sentencepiece model: {}", source, e.what());
  }
  if (!status.ok())
    fail_input("{}: cannot load sentencepiece model: {}", source, status.ToString());
  t->pieces_ = t->sp_->GetPieceSize();
  if (t->pieces_ <= 0) fail_input("{}: sentencepiece model has no pieces", source);
  if (t->pieces_ > config.vocab)
    fail_input("{}: tokenizer has {} pieces but vocab_size in {} is {}", source, t->pieces_,
               config.source, config.vocab);
  if (t->bos_ < 0) t->bos_ = t->sp_->bos_id();
  return t;
}

void Tokenizer::read_tokenizer_config(const std::string& path, const InputLimits& limits) {
  const std::string text =
      read_file_bounded(path, limits, &InputLimits::json_file_bytes, "tokenizer_config.json");
  const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) fail_input("{}: not valid JSON", path);
  if (!j.is_object()) fail_input("{}: not a JSON object", path);
  auto it = j.find("add_bos_token");
  if (it == j.end() || it->is_null()) return;
  if (!it->is_boolean())
    fail_input("{}: field 'add_bos_token' must be true or false, got {}", path, it->dump());
  add_bos_ = it->get<bool>();
}

std::unique_ptr<Tokenizer> Tokenizer::load(const std::string& dir, const ModelConfig& config,
                                           const InputLimits& limits) {
  const fs::path model = fs::path(dir) / "tokenizer.model";
  if (!fs::exists(model)) return ids_only(config);
  const std::string bytes = read_file_bounded(
      model.string(), limits, &InputLimits::tokenizer_file_bytes, "tokenizer.model");
  auto t = from_bytes(bytes, config, model.string());
  const fs::path tc = fs::path(dir) / "tokenizer_config.json";
  if (fs::exists(tc)) t->read_tokenizer_config(tc.string(), limits);
  return t;
}

// sentencepiece reports most failures as a status but a few by throwing (see from_bytes):
// either way the message names the tokenizer file.
namespace {
template <typename F>
sentencepiece::util::Status guarded(const std::string& source, F&& f) {
  try {
    return f();
  } catch (const std::exception& e) {
    fail_input("{}: sentencepiece failed: {}", source, e.what());
  }
}
}  // namespace

std::vector<int32_t> Tokenizer::encode(const std::string& text) const {
  std::vector<int32_t> ids;
  if (sp_ != nullptr) {
    if (add_bos_ && bos_ >= 0) ids.push_back(bos_);
    std::vector<int> pieces;
    const auto status = guarded(source_, [&] { return sp_->Encode(text, &pieces); });
    if (!status.ok()) fail_input("{}: cannot tokenize the prompt: {}", source_, status.ToString());
    ids.insert(ids.end(), pieces.begin(), pieces.end());
    return ids;
  }
  // Id-only: integers separated by spaces or commas.
  const char* p = text.data();
  const char* end = p + text.size();
  while (p < end) {
    if (*p == ' ' || *p == ',' || *p == '\t' || *p == '\n') {
      ++p;
      continue;
    }
    int32_t v = 0;
    const auto [next, ec] = std::from_chars(p, end, v);
    if (ec != std::errc() || v < 0 || v >= vocab_)
      fail_input(
          "this model has no tokenizer, so prompts are token ids in [0, {}); cannot read '{}'",
          vocab_, std::string(p, static_cast<size_t>(std::min<ptrdiff_t>(end - p, 20))));
    ids.push_back(v);
    p = next;
  }
  return ids;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids) const {
  if (sp_ != nullptr) {
    // The model's vocabulary may be larger than the tokenizer's (padded embeddings): say so
    // rather than pass sentencepiece's bare "Invalid id".
    for (int32_t id : ids)
      if (id < 0 || id >= pieces_)
        fail_input("{}: cannot decode token id {}: the tokenizer has {} pieces, ids [0, {})",
                   source_, id, pieces_, pieces_);
    std::vector<int> v(ids.begin(), ids.end());
    std::string out;
    const auto status = guarded(source_, [&] { return sp_->Decode(v, &out); });
    if (!status.ok()) fail_input("{}: cannot decode: {}", source_, status.ToString());
    return out;
  }
  std::string out;
  for (int32_t id : ids) {
    if (!out.empty()) out += ' ';
    out += std::to_string(id);
  }
  return out;
}

std::string Tokenizer::completion(const std::vector<int32_t>& prompt,
                                  const std::vector<int32_t>& output) const {
  if (sp_ == nullptr) return decode(output);
  constexpr size_t kContext = 16;  // pieces never merge across more than a few tokens
  std::vector<int32_t> all(prompt.end() - static_cast<ptrdiff_t>(std::min(prompt.size(), kContext)),
                           prompt.end());
  const std::string context = decode(all);
  all.insert(all.end(), output.begin(), output.end());
  const std::string full = decode(all);
  return full.rfind(context, 0) == 0 ? full.substr(context.size()) : decode(output);
}

}  // namespace strata
