// A chat template as bytes, parsed and rendered over a fixed conversation: output or an
// InputError (a syntax error, a refused construct, raise_exception, a limit), never a crash,
// a hang or an escaped exception of another kind.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string_view>

#include "fuzz_common.h"
#include "worker/text/chat_template.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace strata;
  static const nlohmann::json messages = nlohmann::json::parse(R"([
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi {{ x }} <s>"},
    {"role": "assistant", "content": "Hello", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
    {"role": "user", "content": [{"type": "text", "text": "part"}]}])");
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  fuzz::expect_input_error_or_success([&] {
    const ChatTemplate t = ChatTemplate::from_string(text, "<s>", "</s>", "fuzz/chat_template");
    (void)t.render(messages, true);
    (void)t.render(messages, false, nlohmann::json{{"enable_thinking", false}});
  });
  return 0;
}
