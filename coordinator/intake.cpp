#include "coordinator/intake.h"

#include <algorithm>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "kernels/error.h"

namespace strata {
namespace {

using nlohmann::json;

template <typename T>
T field(const json& j, const char* name, T fallback) {
  if (!j.contains(name)) return fallback;
  const json& v = j.at(name);
  if constexpr (std::is_same_v<T, bool>) {
    if (!v.is_boolean()) fail_input("field '{}' must be true or false, got {}", name, v.dump());
  } else if constexpr (std::is_integral_v<T>) {
    const bool fits = std::is_unsigned_v<T>
                          ? v.is_number_unsigned()
                          : v.is_number_integer() &&
                                v.get<int64_t>() >= std::numeric_limits<T>::min() &&
                                v.get<int64_t>() <= std::numeric_limits<T>::max();
    if (!fits)
      fail_input("field '{}' must be an integer in [{}, {}], got {}", name,
                 std::numeric_limits<T>::min(), std::numeric_limits<T>::max(), v.dump());
  } else {
    if (!v.is_number()) fail_input("field '{}' must be a number, got {}", name, v.dump());
  }
  return v.get<T>();
}

std::string id_of(const json& j, const std::string& where) {
  if (!j.is_object() || !j.contains("id")) return where;
  const json& id = j.at("id");
  if (id.is_string()) return id.get<std::string>();
  if (id.is_number_integer()) return id.dump();
  return where;
}

void read_prompt(const json& j, IncomingRequest& r) {
  const bool text = j.contains("prompt"), ids = j.contains("prompt_ids");
  if (text == ids) fail_input("give exactly one of 'prompt' (text) and 'prompt_ids' (token ids)");
  if (text) {
    if (!j.at("prompt").is_string())
      fail_input("field 'prompt' must be a string, got {}", j.at("prompt").dump());
    r.prompt = j.at("prompt").get<std::string>();
    return;
  }
  const json& list = j.at("prompt_ids");
  if (!list.is_array())
    fail_input("field 'prompt_ids' must be an array of token ids, got {}", list.dump());
  for (size_t i = 0; i < list.size(); ++i) {
    if (!list[i].is_number_integer() || list[i].get<int64_t>() < INT32_MIN ||
        list[i].get<int64_t>() > INT32_MAX)
      fail_input("prompt_ids[{}] must be a 32-bit integer, got {}", i, list[i].dump());
    r.request.prompt_ids.push_back(list[i].get<int32_t>());
  }
}

void read_request(const json& j, IncomingRequest& r) {
  static const char* const kFields[] = {"id",          "prompt", "prompt_ids", "max_new_tokens",
                                        "temperature", "top_k",  "top_p",      "seed",
                                        "ignore_eos"};
  if (!j.is_object()) fail_input("a request must be a JSON object, got {}", j.dump());
  for (const auto& [key, value] : j.items()) {
    if (std::find(std::begin(kFields), std::end(kFields), key) == std::end(kFields))
      fail_input(
          "unknown field '{}' (known: id, prompt, prompt_ids, max_new_tokens, temperature, top_k, "
          "top_p, seed, ignore_eos)",
          key);
  }
  if (j.contains("id") && !j.at("id").is_string() && !j.at("id").is_number_integer())
    fail_input("field 'id' must be a string or an integer, got {}", j.at("id").dump());
  read_prompt(j, r);
  GenerationRequest& g = r.request;
  const int64_t max_new = field<int64_t>(j, "max_new_tokens", 64);
  if (max_new < 0 || max_new > INT32_MAX)
    fail_input("field 'max_new_tokens' must be in [0, 2^31), got {}", max_new);
  g.max_new_tokens = static_cast<int32_t>(max_new);
  g.sampling.temperature = field<float>(j, "temperature", 0.0f);
  g.sampling.top_k = field<int32_t>(j, "top_k", 0);
  g.sampling.top_p = field<float>(j, "top_p", 1.0f);
  g.sampling.seed = field<uint64_t>(j, "seed", 0);
  g.ignore_eos = field<bool>(j, "ignore_eos", false);
  g.sampling.validate();
}

}  // namespace

IncomingRequest parse_request_line(const std::string& line, const std::string& where) {
  IncomingRequest r;
  r.where = where;
  r.request.id = where;
  try {
    const json j = json::parse(line);
    r.request.id = id_of(j, where);
    read_request(j, r);
  } catch (const json::exception& e) {
    r.error = fmt::format("{}: not valid JSON: {}", where, e.what());
  } catch (const std::exception& e) {
    r.error = fmt::format("{}: {}", where, e.what());
  }
  return r;
}

void tokenize(IncomingRequest& r, const Tokenizer& tokenizer) {
  if (!r.error.empty() || !r.prompt) return;
  try {
    r.request.prompt_ids = tokenizer.encode(*r.prompt);
    r.prompt.reset();  // tokenized once
  } catch (const std::exception& e) {
    r.error = fmt::format("{}: prompt: {}", r.where, e.what());
  }
}

JsonlRequestSource::JsonlRequestSource(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail_input("cannot open request file '{}'", path);
  std::string line;
  for (size_t n = 1; std::getline(in, line); ++n) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    requests_.push_back(parse_request_line(line, fmt::format("{}:{}", path, n)));
  }
}

std::vector<IncomingRequest> JsonlRequestSource::poll(size_t max) {
  std::vector<IncomingRequest> out;
  while (next_ < requests_.size() && out.size() < max) out.push_back(std::move(requests_[next_++]));
  return out;
}

std::string result_line(const GenerationResult& r, const Tokenizer& tok) {
  nlohmann::ordered_json j;
  j["id"] = r.id;
  j["prompt_ids"] = r.prompt_ids;
  j["output_ids"] = r.output_ids;
  if (r.stop_reason != StopReason::kError) {
    std::vector<int32_t> all = r.prompt_ids;
    all.insert(all.end(), r.output_ids.begin(), r.output_ids.end());
    const std::string full = tok.decode(all);
    const std::string prompt_text = tok.decode(r.prompt_ids);
    j["text"] = full;
    j["completion"] = full.rfind(prompt_text, 0) == 0 ? full.substr(prompt_text.size())
                                                      : tok.decode(r.output_ids);
  }
  j["stop_reason"] = stop_reason_name(r.stop_reason);
  if (!r.error.empty()) j["error"] = r.error;
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

JsonlResultSink::JsonlResultSink(const std::string& path, const Tokenizer& tokenizer)
    : path_(path), tokenizer_(tokenizer) {
  file_ = std::fopen(path.c_str(), "wb");
  if (file_ == nullptr) fail_input("cannot open result file '{}' for writing", path);
}

JsonlResultSink::~JsonlResultSink() {
  if (file_ != nullptr) std::fclose(file_);
}

void JsonlResultSink::write(const GenerationResult& r) {
  const std::string line = result_line(r, tokenizer_) + "\n";
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() || std::fflush(file_) != 0)
    fail(ErrorKind::kFailed, "cannot write to result file '{}'", path_);
  ++written_;
}

}  // namespace strata
