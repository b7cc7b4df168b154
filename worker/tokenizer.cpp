#include "worker/tokenizer.h"

#include <sentencepiece_processor.h>

#include <algorithm>
#include <charconv>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "kernels/error.h"
#include "worker/model_path.h"

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
  for (int32_t id = 0; id < t->pieces_; ++id) {
    if (!t->sp_->IsControl(id) && !t->sp_->IsUnknown(id)) continue;
    std::string piece = t->sp_->IdToPiece(id);
    if (!piece.empty()) t->sp_specials_.emplace_back(std::move(piece), id);
  }
  std::sort(t->sp_specials_.begin(), t->sp_specials_.end(),
            [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  if (t->pieces_ > config.vocab)
    fail_input("{}: tokenizer has {} pieces but vocab_size in {} is {}", source, t->pieces_,
               config.source, config.vocab);
  if (t->bos_ < 0) t->bos_ = t->sp_->bos_id();
  t->eos_ = t->sp_->eos_id();
  return t;
}

namespace {

// A tokenizer_config.json special token: a string, or an AddedToken object with "content".
std::string special_token(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return {};
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && it->at("content").is_string())
    return it->at("content").get<std::string>();
  return {};
}

bool flag(const nlohmann::json& j, const char* key, bool fallback, const std::string& path) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_boolean())
    fail_input("{}: field '{}' must be true or false, got {}", path, key, it->dump());
  return it->get<bool>();
}

}  // namespace

void Tokenizer::read_tokenizer_config(const std::string& path, const InputLimits& limits) {
  const std::string text =
      read_file_bounded(path, limits, &InputLimits::json_file_bytes, "tokenizer_config.json");
  const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) fail_input("{}: not valid JSON", path);
  if (!j.is_object()) fail_input("{}: not a JSON object", path);
  add_bos_ = flag(j, "add_bos_token", add_bos_, path);
  add_eos_ = flag(j, "add_eos_token", add_eos_, path);
  const std::string bos = special_token(j, "bos_token"), eos = special_token(j, "eos_token");
  if (hf_ != nullptr) {
    if (auto id = hf_->token_to_id(bos); id && !bos.empty() && bos_ < 0) bos_ = *id;
    if (auto id = hf_->token_to_id(eos); id && !eos.empty()) eos_ = *id;
  }
  chat_ = ChatTemplate::from_config(j, path);
}

// transformers' newer layout: the template in its own file, which wins over the config's.
void Tokenizer::read_chat_template(const std::string& dir, const InputLimits& limits) {
  const fs::path file = fs::path(dir) / "chat_template.jinja";
  if (!fs::exists(file)) return;
  const std::string text = read_file_bounded(file.string(), limits, &InputLimits::json_file_bytes,
                                             "chat_template.jinja");
  const std::string bos = bos_ >= 0 ? piece(bos_) : std::string();
  const std::string eos = eos_ >= 0 ? piece(eos_) : std::string();
  chat_ = ChatTemplate::from_string(text, bos, eos, file.string());
}

void Tokenizer::check_size(const ModelConfig& config) const {
  if (hf_ != nullptr && hf_->vocab_size() > config.vocab)
    fail_input("{}: tokenizer has {} tokens but vocab_size in {} is {}", source_, hf_->vocab_size(),
               config.source, config.vocab);
}

std::string Tokenizer::kind() const {
  if (hf_ != nullptr) return vocab_merges_ ? "vocab.json+merges.txt" : "tokenizer.json";
  return sp_ != nullptr ? "sentencepiece" : "ids";
}

std::unique_ptr<Tokenizer> Tokenizer::load(const std::string& path, const ModelConfig& config,
                                           const InputLimits& limits) {
  const bool file = fs::is_regular_file(path);
  const fs::path dir = file ? fs::path(path).parent_path() : fs::path(path);
  const auto has = [&](const char* name) {
    return file ? fs::path(path).filename() == name : fs::exists(dir / name);
  };
  const auto read = [&](const char* name) {
    return read_file_bounded((dir / name).string(), limits, &InputLimits::tokenizer_file_bytes,
                             name);
  };
  std::unique_ptr<Tokenizer> t;
  if (has("tokenizer.json")) {
    t = ids_only(config);
    t->source_ = (dir / "tokenizer.json").string();
    t->hf_ = HfTokenizer::from_json(read("tokenizer.json"), t->source_);
  } else if (!file && has("vocab.json") && has("merges.txt")) {
    t = ids_only(config);
    t->source_ = (dir / "vocab.json").string();
    t->hf_ = HfTokenizer::from_vocab_merges(read("vocab.json"), read("merges.txt"), t->source_);
    t->vocab_merges_ = true;
    t->add_bos_ = false;  // GPT-2's rule, unless tokenizer_config.json says otherwise
  } else if (has("tokenizer.model")) {
    t = from_bytes(read("tokenizer.model"), config, (dir / "tokenizer.model").string());
  } else {
    if (file)
      fail_input("{}: not a tokenizer file (tokenizer.json, tokenizer.model or a model folder)",
                 path);
    return ids_only(config);
  }
  t->check_size(config);
  const fs::path tc = dir / "tokenizer_config.json";
  if (fs::exists(tc)) t->read_tokenizer_config(tc.string(), limits);
  t->read_chat_template(dir.string(), limits);
  return t;
}

std::unique_ptr<Tokenizer> Tokenizer::open(const std::string& spec, const InputLimits& limits) {
  const std::string path = resolve_model_path(spec);  // a folder or file, or ORG/NAME
  std::error_code ec;
  if (!fs::exists(path, ec))
    fail_input("{}: no such tokenizer file (tokenizer.json, tokenizer.model) or model folder",
               path);
  ModelConfig config;
  config.source = path;
  const fs::path folder =
      fs::is_directory(path, ec) ? fs::path(path) : fs::path(path).parent_path();
  if (fs::exists(folder / "config.json", ec)) {
    try {
      config.bos_token_id = load_model_config(folder.string(), limits).bos_token_id;
    } catch (const InputError&) {
      // a tokenizer does not need its model's config to be whole
    }
  }
  config.vocab = INT32_MAX;
  auto t = load(path, config, limits);
  if (!t->has_vocabulary())
    fail_input("{}: no tokenizer.json, vocab.json + merges.txt or tokenizer.model in this folder",
               path);
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

std::vector<int32_t> Tokenizer::encode(const std::string& text, bool add_special) const {
  std::vector<int32_t> ids;
  if (hf_ != nullptr && !vocab_merges_) return hf_->encode(text, add_special);
  if (add_special && add_bos_ && bos_ >= 0 && has_vocabulary()) ids.push_back(bos_);
  if (hf_ != nullptr) {
    const std::vector<int32_t> body = hf_->encode(text, false);
    ids.insert(ids.end(), body.begin(), body.end());
  } else if (sp_ != nullptr) {
    const std::vector<int32_t> body = encode_pieces(text);
    ids.insert(ids.end(), body.begin(), body.end());
  }
  if (has_vocabulary()) {
    if (add_special && add_eos_ && eos_ >= 0) ids.push_back(eos_);
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

// Special pieces in the text become their ids; the text between them is encoded by
// sentencepiece on its own (each segment with its dummy prefix: transformers' legacy Llama
// behaviour, which the stories and Llama-2 tokenizer_config.json files ask for).
std::vector<int32_t> Tokenizer::encode_pieces(std::string_view text) const {
  std::vector<int32_t> ids;
  const auto encode_segment = [&](std::string_view segment) {
    if (segment.empty()) return;
    std::vector<int> pieces;
    const auto status = guarded(source_, [&] { return sp_->Encode(segment, &pieces); });
    if (!status.ok()) fail_input("{}: cannot tokenize the prompt: {}", source_, status.ToString());
    ids.insert(ids.end(), pieces.begin(), pieces.end());
  };
  size_t start = 0;
  for (size_t i = 0; i < text.size();) {
    const auto hit = std::find_if(sp_specials_.begin(), sp_specials_.end(), [&](const auto& s) {
      return text.compare(i, s.first.size(), s.first) == 0;
    });
    if (hit == sp_specials_.end()) {
      ++i;
      continue;
    }
    encode_segment(text.substr(start, i - start));
    ids.push_back(hit->second);
    i += hit->first.size();
    start = i;
  }
  encode_segment(text.substr(start));
  return ids;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  if (hf_ != nullptr) return hf_->decode(ids, skip_special);
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

std::string Tokenizer::piece(int32_t id) const {
  if (hf_ != nullptr) return hf_->id_to_token(id);
  if (sp_ != nullptr && id >= 0 && id < pieces_) return sp_->IdToPiece(id);
  return std::to_string(id);
}

namespace {

// The normalizer_spec.name (field 3, its field 1) of a serialized sentencepiece ModelProto;
// nullopt when the bytes cannot be walked.
std::optional<std::string> sp_normalizer_name(std::string_view proto) {
  const auto varint = [](std::string_view s, size_t& at, uint64_t& v) {
    v = 0;
    for (int shift = 0; at < s.size() && shift < 64; shift += 7) {
      const auto b = static_cast<uint8_t>(s[at++]);
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;
  };
  // The first length-delimited field `field` of a message; "" when it has none.
  const auto field_of = [&](std::string_view s, uint64_t field) -> std::optional<std::string_view> {
    size_t at = 0;
    uint64_t key = 0, len = 0;
    while (at < s.size()) {
      if (!varint(s, at, key)) return std::nullopt;
      switch (key & 7) {
        case 0:
          if (!varint(s, at, len)) return std::nullopt;
          break;
        case 1:
          at += 8;
          break;
        case 5:
          at += 4;
          break;
        case 2:
          if (!varint(s, at, len) || len > s.size() - at) return std::nullopt;
          if ((key >> 3) == field) return s.substr(at, len);
          at += len;
          break;
        default:
          return std::nullopt;
      }
    }
    return std::string_view();
  };
  const std::optional<std::string_view> spec = field_of(proto, 3);
  if (!spec) return std::nullopt;
  const std::optional<std::string_view> name = field_of(*spec, 1);
  if (!name) return std::nullopt;
  return std::string(*name);
}

}  // namespace

size_t Tokenizer::max_token_bytes() const {
  if (hf_ == nullptr && sp_ == nullptr) return 0;
  for (int c = 0x21; c <= 0x7e; ++c) {
    const std::string one(1, static_cast<char>(c));
    const std::string byte = fmt::format("<0x{:02X}>", c);
    const bool known = hf_ != nullptr ? hf_->token_to_id(one) || hf_->token_to_id(byte)
                                      : sp_->PieceToId(one) != sp_->unk_id() ||
                                            sp_->PieceToId(byte) != sp_->unk_id();
    if (!known) return 0;
  }
  if (hf_ != nullptr) return hf_->max_token_bytes();
  // The built-in rules keep printable ASCII (NFKC, case folding, whitespace rules); a
  // user-defined table may map anything to anything.
  const std::optional<std::string> name = sp_normalizer_name(sp_->serialized_model_proto());
  if (!name || (*name != "" && *name != "identity" && *name != "nmt_nfkc" && *name != "nfkc" &&
                *name != "nmt_nfkc_cf" && *name != "nfkc_cf"))
    return 0;
  size_t most = 0;
  for (int32_t id = 0; id < pieces_; ++id) most = std::max(most, sp_->IdToPiece(id).size());
  return most;
}

std::string Tokenizer::render_chat(const nlohmann::json& messages, bool add_generation_prompt,
                                   const nlohmann::json& variables) const {
  if (!chat_)
    fail_input(
        "{}: the model has no chat template (tokenizer_config.json 'chat_template' or "
        "chat_template.jinja), so it takes 'prompt', not 'messages'",
        source_.empty() ? std::string("this model") : source_);
  return chat_->render(messages, add_generation_prompt, variables);
}

std::string Tokenizer::completion(const std::vector<int32_t>& prompt,
                                  const std::vector<int32_t>& output) const {
  if (!has_vocabulary()) return decode(output);
  constexpr size_t kContext = 16;  // pieces never merge across more than a few tokens
  std::vector<int32_t> all(prompt.end() - static_cast<ptrdiff_t>(std::min(prompt.size(), kContext)),
                           prompt.end());
  const std::string context = decode(all);
  all.insert(all.end(), output.begin(), output.end());
  const std::string full = decode(all);
  return full.rfind(context, 0) == 0 ? full.substr(context.size()) : decode(output);
}

}  // namespace strata
