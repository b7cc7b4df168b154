#include "worker/text/chat_template.h"

#include <ctime>

#include "kernels/error.h"

namespace strata {
namespace {

using nlohmann::json;

// A special token is a string or an AddedToken object {"content": ...}; null means none.
std::optional<std::string> token_text(const json& config, const char* key,
                                      const std::string& source) {
  const auto it = config.find(key);
  if (it == config.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object()) {
    const auto content = it->find("content");
    if (content != it->end() && content->is_string()) return content->get<std::string>();
  }
  fail_input("{}: {} must be a string or an object with a string \"content\"", source, key);
}

std::string pick_template(const json& value, const std::string& source) {
  if (value.is_string()) return value.get<std::string>();
  if (!value.is_array())
    fail_input("{}: chat_template must be a string or a list of named templates", source);
  std::string names;
  for (std::size_t i = 0; i < value.size(); ++i) {
    const json& entry = value[i];
    if (!entry.is_object() || !entry.contains("name") || !entry["name"].is_string() ||
        !entry.contains("template") || !entry["template"].is_string()) {
      fail_input("{}: chat_template[{}] must be an object with string \"name\" and \"template\"",
                 source, i);
    }
    if (entry["name"] == "default") return entry["template"].get<std::string>();
    names += (names.empty() ? "" : ", ") + entry["name"].get<std::string>();
  }
  fail_input("{}: chat_template has no template named \"default\" (has: {})", source, names);
}

// OpenAI content: a string, or text parts which are joined with newlines (as vLLM does for
// templates that expect string content).
template <typename J>
J normalize_content(const J& content, std::size_t i) {
  if (content.is_string() || content.is_null()) return content;
  if (!content.is_array())
    fail_input("messages[{}].content must be a string, null or a list of parts", i);
  std::string text;
  for (std::size_t k = 0; k < content.size(); ++k) {
    const json& part = content[k];
    if (!part.is_object() || !part.contains("type") || !part["type"].is_string())
      fail_input("messages[{}].content[{}] must be an object with a string \"type\"", i, k);
    if (part["type"] != "text")
      fail_input("messages[{}].content[{}].type '{}' is not supported (only \"text\")", i, k,
                 part["type"].template get<std::string>());
    if (!part.contains("text") || !part["text"].is_string())
      fail_input("messages[{}].content[{}].text must be a string", i, k);
    if (k) text += '\n';
    text += part["text"].template get<std::string>();
  }
  return J(text);
}

template <typename J>
J normalize_messages(const J& messages) {
  if (!messages.is_array()) fail_input("messages must be a JSON array");
  J out = J::array();
  for (std::size_t i = 0; i < messages.size(); ++i) {
    const J& m = messages[i];
    if (!m.is_object()) fail_input("messages[{}] must be an object", i);
    if (!m.contains("role") || !m["role"].is_string())
      fail_input("messages[{}].role must be a string", i);
    J copy = m;
    const auto content = m.find("content");
    const bool tool_calls = m.contains("tool_calls") && !m["tool_calls"].is_null();
    if (content == m.end() || content->is_null()) {
      if (!(m["role"] == "assistant" && tool_calls))
        fail_input(
            "messages[{}].content is missing (only an assistant message with tool_calls may omit "
            "it)",
            i);
    } else {
      copy["content"] = normalize_content(*content, i);
    }
    out.push_back(std::move(copy));
  }
  return out;
}

// Python's datetime.now().strftime(format): local time.
json strftime_now(const std::vector<json>& args) {
  if (args.size() != 1 || !args[0].is_string()) fail_input("strftime_now(format) takes one string");
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  const std::string format = args[0].get<std::string>();
  if (format.empty()) return "";
  std::string buf(256 + format.size() * 8, '\0');
  const std::size_t n = std::strftime(buf.data(), buf.size(), format.c_str(), &tm);
  if (n == 0) fail_input("strftime_now: format '{}' produced nothing or too much", format);
  buf.resize(n);
  return buf;
}

}  // namespace

ChatTemplate::ChatTemplate(jinja::Template tmpl, json special_tokens, std::string bos_token,
                           std::string eos_token)
    : template_(std::move(tmpl)),
      special_tokens_(std::move(special_tokens)),
      bos_token_(std::move(bos_token)),
      eos_token_(std::move(eos_token)) {}

std::optional<ChatTemplate> ChatTemplate::from_config(const json& config,
                                                      const std::string& source) {
  if (!config.is_object()) fail_input("{}: tokenizer config must be a JSON object", source);
  const auto it = config.find("chat_template");
  if (it == config.end() || it->is_null()) return std::nullopt;
  const std::string text = pick_template(*it, source);
  // transformers passes tokenizer.special_tokens_map: the tokens that are set.
  json special = json::object();
  for (const char* key : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                          "cls_token", "mask_token"}) {
    if (auto t = token_text(config, key, source)) special[key] = *t;
  }
  if (const auto extra = config.find("additional_special_tokens");
      extra != config.end() && extra->is_array()) {
    json list = json::array();
    for (const json& t : *extra) {
      if (t.is_string()) list.push_back(t);
      if (t.is_object() && t.contains("content") && t["content"].is_string())
        list.push_back(t["content"]);
    }
    if (!list.empty()) special["additional_special_tokens"] = std::move(list);
  }
  std::string bos = special.value("bos_token", std::string());
  std::string eos = special.value("eos_token", std::string());
  return ChatTemplate(jinja::Template::parse(text, source + " chat_template"), std::move(special),
                      std::move(bos), std::move(eos));
}

ChatTemplate ChatTemplate::from_string(std::string_view tmpl, std::string bos_token,
                                       std::string eos_token, const std::string& source) {
  json special = {{"bos_token", bos_token}, {"eos_token", eos_token}};
  return ChatTemplate(jinja::Template::parse(tmpl, source), std::move(special),
                      std::move(bos_token), std::move(eos_token));
}

template <typename J>
J ChatTemplate::context(const J& messages, bool add_generation_prompt, const J& extra) const {
  if (!extra.is_object())
    fail_input("{}: extra template variables must be a JSON object", template_.name());
  J context = J::parse(special_tokens_.dump());
  context["messages"] = normalize_messages(messages);
  context["tools"] = nullptr;
  context["documents"] = nullptr;
  context["add_generation_prompt"] = add_generation_prompt;
  for (const auto& [k, v] : extra.items()) context[k] = v;
  return context;
}

const jinja::Functions& ChatTemplate::functions() {
  static const jinja::Functions functions = {{"strftime_now", strftime_now}};
  return functions;
}

std::string ChatTemplate::render(const json& messages, bool add_generation_prompt,
                                 const json& extra) const {
  return template_.render(context(messages, add_generation_prompt, extra), functions());
}

std::string ChatTemplate::render_ordered(const nlohmann::ordered_json& messages,
                                         bool add_generation_prompt,
                                         const nlohmann::ordered_json& extra) const {
  return template_.render_ordered(context(messages, add_generation_prompt, extra), functions());
}

}  // namespace strata
