// Chat templates: turns an OpenAI-style message list into the prompt text a model was
// trained on, by rendering the model's Jinja chat template (tokenizer_config.json) the way
// transformers' apply_chat_template does. See docs/TEXT.md, "Chat templates".
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

#include "worker/text/jinja.h"

namespace strata {

class ChatTemplate {
 public:
  // From a tokenizer_config.json object: `chat_template` (a string, or a list of
  // {"name", "template"} of which "default" is used) and the special tokens (bos_token,
  // eos_token, unk_token, pad_token, sep_token, cls_token, mask_token: a string, an
  // AddedToken object {"content": ...}, or null; additional_special_tokens). nullopt when
  // the config has no chat_template. `source` names the file in errors.
  static std::optional<ChatTemplate> from_config(const nlohmann::json& tokenizer_config,
                                                 const std::string& source);
  static ChatTemplate from_string(std::string_view tmpl, std::string bos_token,
                                  std::string eos_token, const std::string& source);

  // messages: a JSON array of {"role", "content", ...} objects as OpenAI sends them. content
  // is a string, null (assistant messages carrying tool_calls only), or a list of
  // {"type": "text", "text": ...} parts joined with "\n". Other fields (tool_calls,
  // reasoning_content, name, ...) pass through. Bad input throws InputError naming
  // messages[i].field. The context is what transformers provides: messages, tools=None,
  // documents=None, add_generation_prompt, the special tokens, raise_exception and
  // strftime_now(format); `extra` (a JSON object, e.g. {"tools": [...],
  // "enable_thinking": false}) is merged in last and wins.
  std::string render(const nlohmann::json& messages, bool add_generation_prompt,
                     const nlohmann::json& extra = nlohmann::json::object()) const;

  // The same with key order kept (nlohmann::json sorts object keys; Python keeps them, and
  // tojson of tools or tool-call arguments shows it). Parse OpenAI requests as ordered_json
  // and call this to match transformers exactly.
  std::string render_ordered(
      const nlohmann::ordered_json& messages, bool add_generation_prompt,
      const nlohmann::ordered_json& extra = nlohmann::ordered_json::object()) const;

  const std::string& bos_token() const { return bos_token_; }
  const std::string& eos_token() const { return eos_token_; }

 private:
  template <typename J>
  J context(const J& messages, bool add_generation_prompt, const J& extra) const;
  static const jinja::Functions& functions();

  ChatTemplate(jinja::Template tmpl, nlohmann::json special_tokens, std::string bos_token,
               std::string eos_token);

  jinja::Template template_;
  nlohmann::json special_tokens_;  // object: name -> string (or list of strings)
  std::string bos_token_;
  std::string eos_token_;
};

}  // namespace strata
