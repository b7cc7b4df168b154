#include "coordinator/intake/request_format.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>

#include "kernels/error.h"
#include "worker/text.h"

namespace strata {
namespace {

using nlohmann::json;

constexpr size_t kMaxIdBytes = 1024;
constexpr const char* kStrataFields[] = {
    "id",    "prompt", "prompt_ids", "max_new_tokens", "temperature",  "top_k",
    "top_p", "seed",   "stop",       "ignore_eos",     "latency_class"};
constexpr const char* kOpenAiBodyFields[] = {"model",  "prompt", "max_tokens", "temperature",
                                             "top_p",  "seed",   "stop",       "n",
                                             "stream", "echo",   "logprobs",   "user"};

template <size_t N>
bool known(const char* const (&names)[N], std::string_view key) {
  return std::find(std::begin(names), std::end(names), key) != std::end(names);
}

template <size_t N>
std::string list(const char* const (&names)[N]) {
  return fmt::format("{}", fmt::join(std::begin(names), std::end(names), ", "));
}

// Refuses nesting deeper than `limit` before the parser sees the text, so no input can
// make parsing, printing or freeing the value recurse without bound.
void check_depth(std::string_view text, int limit) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > limit) fail_input("JSON nested deeper than {} levels", limit);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
}

template <typename T>
T integer(const json& j, const std::string& name, T fallback) {
  if (!j.contains(name)) return fallback;
  const json& v = j.at(name);
  const bool fits = std::is_unsigned_v<T> ? v.is_number_unsigned()
                                          : v.is_number_integer() &&
                                                v.get<int64_t>() >= std::numeric_limits<T>::min() &&
                                                v.get<int64_t>() <= std::numeric_limits<T>::max();
  if (!fits)
    fail_input("field '{}' must be an integer in [{}, {}], got {}", name,
               std::numeric_limits<T>::min(), std::numeric_limits<T>::max(), preview(v));
  return v.get<T>();
}

float number(const json& j, const std::string& name, float fallback) {
  if (!j.contains(name)) return fallback;
  const json& v = j.at(name);
  if (!v.is_number()) fail_input("field '{}' must be a number, got {}", name, preview(v));
  return v.get<float>();
}

bool boolean(const json& j, const std::string& name, bool fallback) {
  if (!j.contains(name)) return fallback;
  if (!j.at(name).is_boolean())
    fail_input("field '{}' must be true or false, got {}", name, preview(j.at(name)));
  return j.at(name).get<bool>();
}

std::string text(const json& j, const std::string& name) {
  if (!j.at(name).is_string())
    fail_input("field '{}' must be a string, got {}", name, preview(j.at(name)));
  return j.at(name).get<std::string>();
}

std::vector<int32_t> token_ids(const json& list, const std::string& name) {
  if (!list.is_array())
    fail_input("field '{}' must be an array of token ids, got {}", name, preview(list));
  std::vector<int32_t> ids;
  ids.reserve(list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    if (!list[i].is_number_integer() || list[i].get<int64_t>() < INT32_MIN ||
        list[i].get<int64_t>() > INT32_MAX)
      fail_input("{}[{}] must be a 32-bit integer, got {}", name, i, preview(list[i]));
    ids.push_back(list[i].get<int32_t>());
  }
  return ids;
}

std::vector<std::string> stop_strings(const json& v, const std::string& name) {
  if (v.is_string()) return {v.get<std::string>()};
  if (!v.is_array())
    fail_input("field '{}' must be a string or an array of strings, got {}", name, preview(v));
  std::vector<std::string> out;
  for (size_t i = 0; i < v.size(); ++i) {
    if (!v[i].is_string()) fail_input("{}[{}] must be a string, got {}", name, i, preview(v[i]));
    out.push_back(v[i].get<std::string>());
  }
  return out;
}

void set_id(const json& v, const char* name, IncomingRequest& r) {
  if (v.is_number_integer()) {
    r.request.id = v.dump();
    return;
  }
  if (!v.is_string())
    fail_input("field '{}' must be a string or an integer, got {}", name, preview(v));
  const std::string& id = v.get_ref<const std::string&>();
  if (id.empty() || id.size() > kMaxIdBytes)
    fail_input("field '{}' must have 1 to {} bytes, got {}", name, kMaxIdBytes, id.size());
  r.request.id = id;
}

void read_strata(const json& j, IncomingRequest& r) {
  for (const auto& [key, value] : j.items()) {
    if (!known(kStrataFields, key))
      fail_input("unknown field '{}' (known: {})", key.substr(0, 64), list(kStrataFields));
  }
  if (j.contains("id")) set_id(j.at("id"), "id", r);
  const bool has_text = j.contains("prompt"), has_ids = j.contains("prompt_ids");
  if (has_text == has_ids)
    fail_input("give exactly one of 'prompt' (text) and 'prompt_ids' (token ids)");
  if (has_text) {
    r.prompt = text(j, "prompt");
  } else {
    r.request.prompt_ids = token_ids(j.at("prompt_ids"), "prompt_ids");
  }
  GenerationRequest& g = r.request;
  const auto max_new = integer<int64_t>(j, "max_new_tokens", 64);
  if (max_new < 0 || max_new > INT32_MAX)
    fail_input("field 'max_new_tokens' must be in [0, 2^31), got {}", max_new);
  g.max_new_tokens = static_cast<int32_t>(max_new);
  g.sampling.temperature = number(j, "temperature", 0.0f);
  g.sampling.top_k = integer<int32_t>(j, "top_k", 0);
  g.sampling.top_p = number(j, "top_p", 1.0f);
  g.sampling.seed = integer<uint64_t>(j, "seed", 0);
  g.ignore_eos = boolean(j, "ignore_eos", false);
  if (j.contains("stop")) g.stop = stop_strings(j.at("stop"), "stop");
  if (j.contains("latency_class")) g.latency_class = text(j, "latency_class");
  g.sampling.validate();
}

// The prompt of a completions body: a string, or token ids; a list holds exactly one.
void read_openai_prompt(const json& p, IncomingRequest& r) {
  if (p.is_string()) {
    r.prompt = p.get<std::string>();
    return;
  }
  if (p.is_array() && !p.empty() && p[0].is_number_integer()) {
    r.request.prompt_ids = token_ids(p, "body.prompt");
    return;
  }
  if (p.is_array() && p.size() == 1) return read_openai_prompt(p[0], r);
  fail_input(
      "body.prompt must be a string, an array of token ids, or a list of exactly one of those "
      "(one prompt per request line), got {}",
      preview(p));
}

void read_openai(const json& j, IncomingRequest& r) {
  for (const auto& [key, value] : j.items()) {
    if (key != "custom_id" && key != "method" && key != "url" && key != "body")
      fail_input("OpenAI batch line: unknown field '{}' (known: custom_id, method, url, body)",
                 key.substr(0, 64));
  }
  if (!j.contains("custom_id")) fail_input("OpenAI batch line: 'custom_id' is missing");
  set_id(j.at("custom_id"), "custom_id", r);
  if (j.contains("method") && j.at("method") != "POST")
    fail_input("OpenAI batch line: method must be \"POST\", got {}", preview(j.at("method")));
  if (j.contains("url") && j.at("url") != "/v1/completions")
    fail_input(
        "OpenAI batch line: url must be \"/v1/completions\" (the only endpoint served), got {}",
        preview(j.at("url")));
  if (!j.contains("body") || !j.at("body").is_object())
    fail_input("OpenAI batch line: 'body' must be the request object");
  const json& b = j.at("body");
  for (const auto& [key, value] : b.items()) {
    if (!known(kOpenAiBodyFields, key))
      fail_input("body.{} is not supported (supported: {})", key.substr(0, 64),
                 list(kOpenAiBodyFields));
  }
  if (!b.contains("prompt")) fail_input("body.prompt is missing");
  read_openai_prompt(b.at("prompt"), r);
  if (b.contains("model") && !b.at("model").is_string())
    fail_input("body.model must be a string, got {}", preview(b.at("model")));
  if (integer<int64_t>(b, "n", 1) != 1) fail_input("body.n must be 1 (one completion per line)");
  if (boolean(b, "stream", false)) fail_input("body.stream must be false in a batch");
  if (boolean(b, "echo", false)) fail_input("body.echo is not supported");
  if (b.contains("logprobs") && !b.at("logprobs").is_null())
    fail_input("body.logprobs is not supported");
  GenerationRequest& g = r.request;
  const auto max_tokens = integer<int64_t>(b, "max_tokens", 16);  // the API's default
  if (max_tokens < 0 || max_tokens > INT32_MAX)
    fail_input("body.max_tokens must be in [0, 2^31), got {}", max_tokens);
  g.max_new_tokens = static_cast<int32_t>(max_tokens);
  g.sampling.temperature = number(b, "temperature", 1.0f);  // the API's default
  g.sampling.top_p = number(b, "top_p", 1.0f);
  g.sampling.seed = integer<uint64_t>(b, "seed", 0);
  if (b.contains("stop") && !b.at("stop").is_null()) g.stop = stop_strings(b.at("stop"), "stop");
  g.sampling.validate();
}

bool is_openai_line(const json& j) {
  return j.is_object() && (j.contains("custom_id") || j.contains("body"));
}

void read_json_request(const json& j, IncomingRequest& r) {
  if (!j.is_object()) fail_input("a request must be a JSON object, got {}", preview(j));
  if (is_openai_line(j)) return read_openai(j, r);
  read_strata(j, r);
}

// The id to name the request by in its error result, read before anything can fail.
void early_id(const json& j, IncomingRequest& r) {
  if (!j.is_object()) return;
  for (const char* name : {"id", "custom_id"}) {
    if (!j.contains(name)) continue;
    const json& v = j.at(name);
    if (v.is_number_integer()) r.request.id = v.dump();
    if (v.is_string() && !v.get_ref<const std::string&>().empty() &&
        v.get_ref<const std::string&>().size() <= kMaxIdBytes)
      r.request.id = v.get<std::string>();
  }
}

// Flat queue fields to the JSON object of a Strata request.
int64_t field_integer(const std::string& name, const std::string& v) {
  int64_t out = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
  if (ec != std::errc() || end != v.data() + v.size() || v.empty())
    fail_input("field '{}' must be an integer, got '{}'", name, v.substr(0, 64));
  return out;
}

double field_number(const std::string& name, const std::string& v) {
  double out = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
  if (ec != std::errc() || end != v.data() + v.size() || v.empty() || !std::isfinite(out))
    fail_input("field '{}' must be a number, got '{}'", name, v.substr(0, 64));
  return out;
}

json field_value(const std::string& name, const std::string& v, const InputLimits& limits) {
  if (first_invalid_utf8(v) >= 0) fail_input("field '{}' is not valid UTF-8", name);
  if (name == "max_new_tokens" || name == "top_k") return field_integer(name, v);
  if (name == "seed") {
    uint64_t out = 0;
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
    if (ec != std::errc() || end != v.data() + v.size() || v.empty())
      fail_input("field 'seed' must be an integer in [0, 2^64), got '{}'", v.substr(0, 64));
    return out;
  }
  if (name == "temperature" || name == "top_p") return field_number(name, v);
  if (name == "ignore_eos") {
    if (v == "true" || v == "1") return true;
    if (v == "false" || v == "0") return false;
    fail_input("field 'ignore_eos' must be true, false, 1 or 0, got '{}'", v.substr(0, 64));
  }
  if (name == "prompt_ids" && (v.empty() || v.front() != '[')) {
    json ids = json::array();  // "1 2 3" or "1,2,3"
    size_t i = 0;
    while (i < v.size()) {
      if (v[i] == ' ' || v[i] == ',') {
        ++i;
        continue;
      }
      const size_t end = v.find_first_of(" ,", i);
      ids.push_back(field_integer("prompt_ids", v.substr(i, end - i)));
      i = end == std::string::npos ? v.size() : end;
    }
    return ids;
  }
  if ((name == "prompt_ids" || name == "stop") && !v.empty() && v.front() == '[') {
    try {
      return parse_request_json(v, limits);
    } catch (const json::exception& e) {
      fail_input("field '{}' is not a valid JSON array: {}", name, e.what());
    }
  }
  return v;  // id, prompt, latency_class, and a stop value that is one string
}

void read_fields(const FieldList& fields, const InputLimits& limits, IncomingRequest& r) {
  int64_t bytes = 0;
  for (const auto& [name, value] : fields)
    bytes += static_cast<int64_t>(name.size() + value.size());
  limits.check(&InputLimits::request_bytes, bytes, "request", "bytes");
  for (const auto& [name, value] : fields) {
    if (name != "json" && name != "openai") continue;
    if (fields.size() != 1)
      fail_input(
          "a '{}' field carries the whole request and comes alone, but the entry has {} fields",
          name, fields.size());
    const json j = parse_request_json(value, limits);
    early_id(j, r);
    if (name == "openai" && !is_openai_line(j))
      fail_input("field 'openai' must hold an OpenAI batch line (custom_id, method, url, body)");
    return read_json_request(j, r);
  }
  json j = json::object();
  for (const auto& [name, value] : fields) {
    if (first_invalid_utf8(name) >= 0 || !known(kStrataFields, name))
      fail_input("unknown field '{}' (known: json, openai, {})",
                 first_invalid_utf8(name) < 0 ? name.substr(0, 64) : "(not UTF-8)",
                 list(kStrataFields));
    if (j.contains(name)) fail_input("field '{}' appears twice", name);
    j[name] = field_value(name, value, limits);
    if (name == "id") early_id(j, r);
  }
  read_strata(j, r);
}

std::string completion_text(const GenerationResult& r, const Tokenizer& tokenizer) {
  if (r.text) return *r.text;
  if (r.output_ids.empty()) return {};
  try {
    return tokenizer.completion(r.prompt_ids, r.output_ids);
  } catch (const std::exception&) {
    return {};  // ids the tokenizer cannot decode (a refused prompt): the ids say it all
  }
}

template <typename Parse>
IncomingRequest parse_guarded(const std::string& where, const std::string& default_id,
                              Parse&& parse) {
  IncomingRequest r;
  r.where = where;
  r.request.id = default_id;
  try {
    parse(r);
  } catch (const json::exception& e) {
    r.error = fmt::format("{}: not valid JSON: {}", where, e.what());
  } catch (const std::exception& e) {
    r.error = fmt::format("{}: {}", where, e.what());
  }
  return r;
}

}  // namespace

nlohmann::json parse_request_json(std::string_view text, const InputLimits& limits) {
  limits.check(&InputLimits::request_bytes, static_cast<int64_t>(text.size()), "request", "bytes");
  check_depth(text, static_cast<int>(limits.json_depth));
  return json::parse(text);
}

std::string preview(const json& value) {
  constexpr size_t kMax = 80;
  std::string s = value.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > kMax) s = s.substr(0, kMax) + "...";
  return s;
}

IncomingRequest parse_request_line(std::string_view line, const std::string& where,
                                   const InputLimits& limits) {
  return parse_guarded(where, where, [&](IncomingRequest& r) {
    const json j = parse_request_json(line, limits);
    early_id(j, r);
    read_json_request(j, r);
  });
}

IncomingRequest parse_request_fields(const FieldList& fields, const std::string& default_id,
                                     const std::string& where, const InputLimits& limits) {
  return parse_guarded(where, default_id,
                       [&](IncomingRequest& r) { read_fields(fields, limits, r); });
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

nlohmann::ordered_json result_object(const GenerationResult& r, const Tokenizer& tokenizer) {
  nlohmann::ordered_json j;
  j["id"] = to_valid_utf8(r.id);
  j["status"] = r.stop_reason == StopReason::kError ? "error" : "ok";
  j["text"] = to_valid_utf8(completion_text(r, tokenizer));
  j["output_ids"] = r.output_ids;
  j["stop_reason"] = stop_reason_name(r.stop_reason);
  j["prompt_tokens"] = r.prompt_ids.size();
  j["completion_tokens"] = r.output_ids.size();
  const auto time = [&](const char* name, double seconds) {
    if (seconds >= 0) j[name] = std::round(seconds * 1e6) / 1e6;
  };
  time("queue_wait_s", r.times.queue_wait_s);
  time("first_token_s", r.times.first_token_s);
  time("total_s", r.times.total_s);
  if (r.stop_reason == StopReason::kError) {
    j["error"] = to_valid_utf8(r.error);
    j["error_type"] = r.error_kind == ErrorKind::kInvalidInput ? "invalid_request" : "server_error";
  }
  j["prompt_ids"] = r.prompt_ids;
  return j;
}

nlohmann::ordered_json result_from_fields(const FieldList& fields) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  for (const auto& [name, value] : fields) {
    const bool typed = name == "output_ids" || name == "prompt_ids" || name == "prompt_tokens" ||
                       name == "completion_tokens" || name.ends_with("_s");
    j[name] = value;
    if (!typed) continue;
    try {
      check_depth(value, static_cast<int>(InputLimits{}.json_depth));
      j[name] = nlohmann::ordered_json::parse(value);
    } catch (const std::exception&) {
      // not what Strata writes: kept as the string it is
    }
  }
  return j;
}

}  // namespace strata
