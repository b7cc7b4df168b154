#include "coordinator/intake/request_format.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <optional>

#include "coordinator/intake/request_rules.h"
#include "kernels/error.h"
#include "worker/text.h"

namespace strata {
namespace {

using nlohmann::json;

constexpr size_t kMaxIdBytes = 1024;
constexpr const char* kStrataFields[] = {"id",
                                         "prompt",
                                         "prompt_ids",
                                         "messages",
                                         "max_new_tokens",
                                         "temperature",
                                         "top_k",
                                         "top_p",
                                         "min_p",
                                         "seed",
                                         "presence_penalty",
                                         "frequency_penalty",
                                         "repetition_penalty",
                                         "n",
                                         "logprobs",
                                         "top_logprobs",
                                         "stop",
                                         "stop_token_ids",
                                         "ignore_eos",
                                         "add_generation_prompt",
                                         "chat_template_kwargs",
                                         "latency_class"};
// What both endpoints' bodies take: OpenAI's fields and the sampling extras vLLM's server
// accepts; then each endpoint's own.
constexpr const char* kOpenAiBodyFields[] = {"model",
                                             "max_tokens",
                                             "temperature",
                                             "top_p",
                                             "seed",
                                             "stop",
                                             "n",
                                             "stream",
                                             "logprobs",
                                             "user",
                                             "presence_penalty",
                                             "frequency_penalty",
                                             "top_k",
                                             "min_p",
                                             "repetition_penalty",
                                             "stop_token_ids",
                                             "ignore_eos"};
constexpr const char* kCompletionFields[] = {"prompt", "echo"};
constexpr const char* kChatFields[] = {"messages", "max_completion_tokens", "top_logprobs",
                                       "add_generation_prompt", "chat_template_kwargs"};

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

// A sampling number the model's generation_config may default: recorded as set when given.
void sampling_number(const json& j, const char* name, float& out, uint32_t bit,
                     IncomingRequest& r) {
  if (!j.contains(name)) return;
  out = number(j, name, out);
  r.sampling_set |= bit;
}

// logprobs: an integer k (OpenAI completions, vLLM: the sampled token's and the top k), or
// true with top_logprobs = k (chat completions); null or false: none.
int32_t read_logprobs(const json& j) {
  const json* v = j.contains("logprobs") ? &j.at("logprobs") : nullptr;
  const bool top_given = j.contains("top_logprobs") && !j.at("top_logprobs").is_null();
  int32_t k = -1;
  if (v != nullptr && v->is_boolean()) {
    if (v->get<bool>()) k = top_given ? integer<int32_t>(j, "top_logprobs", 0) : 0;
  } else if (v != nullptr && !v->is_null()) {
    if (top_given)
      fail_input(
          "give the number of top log-probabilities once: 'logprobs' is {} and "
          "'top_logprobs' is set too",
          preview(*v));
    k = integer<int32_t>(j, "logprobs", 0);
  }
  if (k == -1 && top_given) fail_input("field 'top_logprobs' needs 'logprobs': true");
  if (k < -1 || k > kMaxTopLogprobs)
    fail_input("field 'top_logprobs' must be in [0, {}], got {}", kMaxTopLogprobs, k);
  return k;
}

// The sampling and stopping fields every format shares, under OpenAI's and vLLM's names.
void read_sampling(const json& j, IncomingRequest& r) {
  GenerationRequest& g = r.request;
  sampling_number(j, "temperature", g.sampling.temperature, kSetTemperature, r);
  sampling_number(j, "top_p", g.sampling.top_p, kSetTopP, r);
  sampling_number(j, "min_p", g.sampling.min_p, kSetMinP, r);
  sampling_number(j, "repetition_penalty", g.sampling.repetition_penalty, kSetRepetitionPenalty, r);
  if (j.contains("top_k") && !j.at("top_k").is_null()) {
    // vLLM's -1 means off, as 0 does here.
    const auto k = integer<int32_t>(j, "top_k", 0);
    g.sampling.top_k = k == -1 ? 0 : k;
    r.sampling_set |= kSetTopK;
  }
  g.sampling.presence_penalty = number(j, "presence_penalty", 0.0f);
  g.sampling.frequency_penalty = number(j, "frequency_penalty", 0.0f);
  g.sampling.seed =
      j.contains("seed") && j.at("seed").is_null() ? 0 : integer<uint64_t>(j, "seed", 0);
  g.sampling.logprobs = read_logprobs(j);
  g.n = integer<int32_t>(j, "n", 1);
  if (g.n < 1 || g.n > kMaxChoices)
    fail_input("field 'n' must be in [1, {}], got {}", kMaxChoices, g.n);
  g.ignore_eos = boolean(j, "ignore_eos", false);
  if (j.contains("stop") && !j.at("stop").is_null()) g.stop = stop_strings(j.at("stop"), "stop");
  if (j.contains("stop_token_ids") && !j.at("stop_token_ids").is_null())
    g.stop_token_ids = token_ids(j.at("stop_token_ids"), "stop_token_ids");
  g.sampling.validate();
}

void read_max_tokens(const json& j, const char* name, int64_t fallback, IncomingRequest& r) {
  if (j.contains(name) && !j.at(name).is_null()) r.sampling_set |= kSetMaxNewTokens;
  const auto max_new =
      j.contains(name) && j.at(name).is_null() ? fallback : integer<int64_t>(j, name, fallback);
  if (max_new < 0 || max_new > INT32_MAX)
    fail_input("field '{}' must be in [0, 2^31), got {}", name, max_new);
  r.request.max_new_tokens = static_cast<int32_t>(max_new);
}

// A chat's messages: a non-empty array of objects (the chat template checks their fields).
void read_messages(const json& j, IncomingRequest& r) {
  const json& m = j.at("messages");
  if (!m.is_array() || m.empty())
    fail_input(
        "field 'messages' must be a non-empty array of {{\"role\", \"content\"}} objects, "
        "got {}",
        preview(m));
  for (size_t i = 0; i < m.size(); ++i)
    if (!m[i].is_object())
      fail_input("messages[{}] must be an object with 'role' and 'content', got {}", i,
                 preview(m[i]));
  r.messages = m;
  r.request.chat = true;
  r.add_generation_prompt = boolean(j, "add_generation_prompt", true);
  if (j.contains("chat_template_kwargs")) {
    if (!j.at("chat_template_kwargs").is_object())
      fail_input("field 'chat_template_kwargs' must be an object, got {}",
                 preview(j.at("chat_template_kwargs")));
    r.chat_variables = j.at("chat_template_kwargs");
  }
}

void read_strata(const json& j, IncomingRequest& r) {
  for (const auto& [key, value] : j.items()) {
    if (!known(kStrataFields, key))
      fail_input("unknown field '{}' (known: {})", key.substr(0, 64), list(kStrataFields));
  }
  if (j.contains("id")) set_id(j.at("id"), "id", r);
  const int prompts =
      int{j.contains("prompt")} + int{j.contains("prompt_ids")} + int{j.contains("messages")};
  if (prompts != 1)
    fail_input(
        "give exactly one of 'prompt' (text), 'prompt_ids' (token ids) and 'messages' "
        "(a chat)");
  if (j.contains("prompt")) {
    r.prompt = text(j, "prompt");
  } else if (j.contains("prompt_ids")) {
    r.request.prompt_ids = token_ids(j.at("prompt_ids"), "prompt_ids");
  } else {
    read_messages(j, r);
  }
  if (!r.messages && (j.contains("add_generation_prompt") || j.contains("chat_template_kwargs")))
    fail_input("'add_generation_prompt' and 'chat_template_kwargs' go with 'messages'");
  read_max_tokens(j, "max_new_tokens", 64, r);
  read_sampling(j, r);
  if (j.contains("latency_class")) r.request.latency_class = text(j, "latency_class");
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

template <size_t N>
void check_body_fields(const json& b, const char* const (&own)[N]) {
  for (const auto& [key, value] : b.items()) {
    if (!known(kOpenAiBodyFields, key) && !known(own, key))
      fail_input("body.{} is not supported (supported: {}, {})", key.substr(0, 64), list(own),
                 list(kOpenAiBodyFields));
  }
}

void read_openai_body(const json& b, bool chat, IncomingRequest& r) {
  if (chat) {
    check_body_fields(b, kChatFields);
    if (!b.contains("messages")) fail_input("body.messages is missing");
    read_messages(b, r);
  } else {
    check_body_fields(b, kCompletionFields);
    if (!b.contains("prompt")) fail_input("body.prompt is missing");
    read_openai_prompt(b.at("prompt"), r);
    if (boolean(b, "echo", false)) fail_input("body.echo is not supported");
  }
  if (b.contains("model") && !b.at("model").is_string())
    fail_input("body.model must be a string, got {}", preview(b.at("model")));
  if (boolean(b, "stream", false)) fail_input("body.stream must be false in a batch");
  // The API's defaults: 16 tokens for completions, the context for chat (capped by the run).
  if (chat && b.contains("max_completion_tokens")) {
    read_max_tokens(b, "max_completion_tokens", INT32_MAX, r);
  } else {
    read_max_tokens(b, "max_tokens", chat ? INT32_MAX : 16, r);
  }
  r.request.sampling.temperature = 1.0f;  // the API's default
  read_sampling(b, r);
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
  const bool chat = j.contains("url") && j.at("url") == "/v1/chat/completions";
  if (j.contains("url") && !chat && j.at("url") != "/v1/completions")
    fail_input(
        "OpenAI batch line: url must be \"/v1/completions\" or \"/v1/chat/completions\" (the "
        "endpoints served), got {}",
        preview(j.at("url")));
  if (!j.contains("body") || !j.at("body").is_object())
    fail_input("OpenAI batch line: 'body' must be the request object");
  read_openai_body(j.at("body"), chat, r);
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

// The producer's id in a request that will not parse (too large, not JSON): the string value
// of its first "custom_id" or "id" key, read by a scan of its first 64 KiB -- a plain,
// short, valid UTF-8 string, or none.
std::optional<std::string> scan_id(std::string_view text) {
  text = text.substr(0, size_t{64} << 10);
  for (const std::string_view key : {"\"custom_id\"", "\"id\""}) {
    for (size_t at = text.find(key); at != std::string_view::npos; at = text.find(key, at + 1)) {
      size_t i = at + key.size();
      auto skip = [&] {
        while (i < text.size() &&
               (text[i] == ' ' || text[i] == '\t' || text[i] == '\n' || text[i] == '\r'))
          ++i;
      };
      skip();
      if (i >= text.size() || text[i] != ':') continue;
      ++i;
      skip();
      if (i >= text.size() || text[i] != '"') continue;
      const size_t end = text.find('"', i + 1);
      if (end == std::string_view::npos) continue;
      const std::string_view id = text.substr(i + 1, end - i - 1);
      const bool plain = std::none_of(id.begin(), id.end(), [](char c) {
        return c == '\\' || static_cast<unsigned char>(c) < 0x20;
      });
      if (!id.empty() && id.size() <= kMaxIdBytes && plain && first_invalid_utf8(id) < 0)
        return std::string(id);
    }
  }
  return std::nullopt;
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

bool field_boolean(const std::string& name, const std::string& v) {
  if (v == "true" || v == "1") return true;
  if (v == "false" || v == "0") return false;
  fail_input("field '{}' must be true, false, 1 or 0, got '{}'", name, v.substr(0, 64));
}

json field_ids(const std::string& name, const std::string& v) {
  json ids = json::array();  // "1 2 3" or "1,2,3"
  size_t i = 0;
  while (i < v.size()) {
    if (v[i] == ' ' || v[i] == ',') {
      ++i;
      continue;
    }
    const size_t end = v.find_first_of(" ,", i);
    ids.push_back(field_integer(name, v.substr(i, end - i)));
    i = end == std::string::npos ? v.size() : end;
  }
  return ids;
}

bool one_of(const std::string& name, std::initializer_list<const char*> names) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

json field_value(const std::string& name, const std::string& v, const InputLimits& limits) {
  if (first_invalid_utf8(v) >= 0) fail_input("field '{}' is not valid UTF-8", name);
  if (one_of(name, {"max_new_tokens", "top_k", "n", "top_logprobs"})) return field_integer(name, v);
  if (name == "seed") {
    uint64_t out = 0;
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
    if (ec != std::errc() || end != v.data() + v.size() || v.empty())
      fail_input("field 'seed' must be an integer in [0, 2^64), got '{}'", v.substr(0, 64));
    return out;
  }
  if (one_of(name, {"temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty"}))
    return field_number(name, v);
  if (one_of(name, {"ignore_eos", "add_generation_prompt"})) return field_boolean(name, v);
  if (name == "logprobs") {  // true / false, or the number of top log-probabilities
    if (v == "true" || v == "false") return v == "true";
    return field_integer(name, v);
  }
  const bool ids = one_of(name, {"prompt_ids", "stop_token_ids"});
  if (ids && (v.empty() || v.front() != '[')) return field_ids(name, v);
  if (ids || one_of(name, {"messages", "chat_template_kwargs"}) ||
      (name == "stop" && !v.empty() && v.front() == '[')) {
    try {
      return parse_request_json(v, limits);
    } catch (const json::exception& e) {
      fail_input("field '{}' is not valid JSON: {}", name, e.what());
    }
  }
  return v;  // id, prompt, latency_class, and a stop value that is one string
}

void read_fields(const FieldList& fields, const InputLimits& limits, IncomingRequest& r) {
  int64_t bytes = 0;
  for (const auto& [name, value] : fields) {
    bytes += static_cast<int64_t>(name.size() + value.size());
    // The producer's id first, so that a refusal below is answered under it.
    const bool whole = name == "json" || name == "openai";
    std::optional<std::string> id = whole ? scan_id(value) : std::nullopt;
    if (name == "id" && !value.empty() && value.size() <= kMaxIdBytes &&
        first_invalid_utf8(value) < 0)
      id = value;
    if (id) r.request.id = *id;
  }
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
  // Said which: a producer matching on its own ids finds none here.
  if (!r.error.empty() && r.request.id == default_id && default_id != where)
    r.error += " (answered under the entry id: no id or custom_id could be read)";
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
    if (std::optional<std::string> id = scan_id(line)) r.request.id = *id;
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

namespace {

// The cheap bound: no token covers more than max_token_bytes of the text's printable ASCII
// bytes, so it is at least that many tokens however it is tokenized.
std::string too_long_for_context(std::string_view text, const char* field, const PromptPrep& p) {
  if (p.context <= 0 || p.max_token_bytes == 0) return {};
  const auto ascii = static_cast<size_t>(
      std::count_if(text.begin(), text.end(), [](char c) { return c > 0x20 && c < 0x7f; }));
  const size_t at_least = (ascii + p.max_token_bytes - 1) / p.max_token_bytes;
  if (at_least <= static_cast<size_t>(p.context)) return {};
  return fmt::format(
      "field '{}': at least {} tokens exceed the context of {} positions (--max-context, at "
      "most the model's): its {} printable ASCII bytes make that many, since no token covers "
      "more than {} bytes; refused before tokenizing",
      field, at_least, p.context, ascii, p.max_token_bytes);
}

}  // namespace

void prepare_prompt(IncomingRequest& r, const PromptPrep& p) {
  if (!r.error.empty() || (!r.prompt && !r.messages)) return;
  const char* field = r.messages ? "messages" : "prompt";
  if (p.tokenizer == nullptr) {
    r.error = fmt::format("field '{}': this run has no tokenizer; send prompt_ids", field);
    return;
  }
  try {
    if (r.messages) {
      // The template writes the special tokens itself (Hugging Face's apply_chat_template).
      const std::string text =
          p.tokenizer->render_chat(*r.messages, r.add_generation_prompt, r.chat_variables);
      r.error = too_long_for_context(text, field, p);
      if (!r.error.empty()) return;
      r.request.prompt_ids = p.tokenizer->encode(text, /*add_special=*/false);
      r.messages.reset();
    } else {
      r.error = too_long_for_context(*r.prompt, field, p);
      if (!r.error.empty()) return;
      r.request.prompt_ids = p.tokenizer->encode(*r.prompt);
      r.prompt.reset();  // tokenized once
    }
  } catch (const std::exception& e) {
    r.error = fmt::format("{}: {}: {}", r.where, r.request.chat ? "messages" : "prompt", e.what());
  }
}

void tokenize(IncomingRequest& r, const Tokenizer& tokenizer) {
  prepare_prompt(r, PromptPrep{&tokenizer});
}

void apply_generation_defaults(IncomingRequest& r, const GenerationDefaults& d) {
  SamplingParams& s = r.request.sampling;
  const auto fill = [&](uint32_t bit, const auto& value, auto& field) {
    if (!(r.sampling_set & bit) && value) field = *value;
  };
  fill(kSetTemperature, d.temperature, s.temperature);
  fill(kSetTopK, d.top_k, s.top_k);
  fill(kSetTopP, d.top_p, s.top_p);
  fill(kSetMinP, d.min_p, s.min_p);
  fill(kSetRepetitionPenalty, d.repetition_penalty, s.repetition_penalty);
  fill(kSetMaxNewTokens, d.max_new_tokens, r.request.max_new_tokens);
}

namespace {

using ojson = nlohmann::ordered_json;

// The text token `candidate` adds at output position `i`: Tokenizer::completion after the
// tokens before it (a few of the prompt's, then the output's), so a word keeps its leading
// space and the texts of the output's tokens add up to the completion. A byte-level token may end
// mid-character: its text is then the valid part (U+FFFD for the rest), its bytes exact.
std::string token_text(const Tokenizer& tok, const GenerationResult& r, size_t i,
                       int32_t candidate) {
  constexpr size_t kContext = 8;
  std::vector<int32_t> before;
  const size_t from_prompt = i >= kContext ? 0 : std::min(kContext - i, r.prompt_ids.size());
  before.assign(r.prompt_ids.end() - static_cast<ptrdiff_t>(from_prompt), r.prompt_ids.end());
  const size_t from_output = std::min(i, kContext);
  before.insert(before.end(), r.output_ids.begin() + static_cast<ptrdiff_t>(i - from_output),
                r.output_ids.begin() + static_cast<ptrdiff_t>(i));
  try {
    return tok.completion(before, {candidate});
  } catch (const std::exception&) {
    return {};  // an id the tokenizer cannot decode: the id says it
  }
}

ojson logprobs_object(const GenerationResult& r, const Tokenizer& tok) {
  ojson out = ojson::array();
  for (size_t i = 0; i < r.logprobs.size() && i < r.output_ids.size(); ++i) {
    const Logprobs& l = r.logprobs[i];
    ojson top = ojson::array();
    for (const TokenLogprob& t : l.top)
      top.push_back({{"token", t.token},
                     {"text", to_valid_utf8(token_text(tok, r, i, t.token))},
                     {"logprob", t.logprob}});
    const std::string text = token_text(tok, r, i, r.output_ids[i]);
    std::vector<int> bytes(text.begin(), text.end());
    for (int& b : bytes) b &= 0xff;
    out.push_back({{"token", r.output_ids[i]},
                   {"text", to_valid_utf8(text)},
                   {"bytes", bytes},
                   {"logprob", l.logprob},
                   {"top_logprobs", std::move(top)}});
  }
  return out;
}

ojson choice_object(const GenerationResult& c, const Tokenizer& tok) {
  ojson j;
  j["index"] = c.choice;
  j["text"] = to_valid_utf8(completion_text(c, tok));
  j["output_ids"] = c.output_ids;
  j["stop_reason"] = stop_reason_name(c.stop_reason);
  j["completion_tokens"] = c.output_ids.size();
  if (!c.logprobs.empty()) j["logprobs"] = logprobs_object(c, tok);
  return j;
}

}  // namespace

nlohmann::ordered_json result_object(const GenerationResult& r, const Tokenizer& tokenizer) {
  nlohmann::ordered_json j;
  j["id"] = to_valid_utf8(r.id);
  j["status"] = r.stop_reason == StopReason::kError ? "error" : "ok";
  j["text"] = to_valid_utf8(completion_text(r, tokenizer));
  j["output_ids"] = r.output_ids;
  j["stop_reason"] = stop_reason_name(r.stop_reason);
  j["prompt_tokens"] = r.prompt_ids.size();
  size_t completion_tokens = r.output_ids.size();
  for (size_t c = 1; c < r.choices.size(); ++c) completion_tokens += r.choices[c].output_ids.size();
  j["completion_tokens"] = completion_tokens;
  if (!r.logprobs.empty()) j["logprobs"] = logprobs_object(r, tokenizer);
  if (!r.choices.empty()) {
    j["choices"] = ojson::array();
    for (const GenerationResult& c : r.choices) j["choices"].push_back(choice_object(c, tokenizer));
  }
  if (r.chat) j["chat"] = true;
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
                       name == "completion_tokens" || name == "logprobs" || name == "choices" ||
                       name == "chat" || name.ends_with("_s");
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
