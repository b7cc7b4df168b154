// The subset of Jinja2 that Hugging Face chat templates use, rendered the way transformers
// renders them: trim_blocks and lstrip_blocks on, loop controls (break/continue) enabled,
// default (non-strict) Undefined, an immutable sandbox (no mutating methods), and
// transformers' tojson (json.dumps without HTML escaping, keys unsorted). See docs/TEXT.md,
// "Chat templates", for what is supported and what is refused.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace strata::jinja {

namespace detail {
struct Program;
}  // namespace detail

// A host function a template may call, e.g. strftime_now(format). Arguments arrive as JSON
// (an undefined argument as null); the result is a JSON value.
using Function = std::function<nlohmann::json(const std::vector<nlohmann::json>& args)>;
using Functions = std::map<std::string, Function, std::less<>>;

// Limits that keep a hostile template from hanging or exhausting a worker.
inline constexpr std::size_t kMaxOutputBytes = std::size_t{16} << 20;  // any one string too
inline constexpr int kMaxNesting = 256;                   // nested blocks and expressions
inline constexpr std::int64_t kMaxLoopSteps = 1'000'000;  // loop iterations per render

class Template {
 public:
  // Parses once. A syntax error or an unsupported construct throws InputError naming
  // `name`, the line and the construct: "chat_template line 3: filter 'wordcount' is not
  // supported".
  static Template parse(std::string_view source, const std::string& name);

  // Renders with the variables of `context` (a JSON object). raise_exception(msg) in the
  // template throws InputError "<name>: <msg>"; any other failure throws InputError
  // "<name> line N: ...". Thread-safe: the parsed program is shared and immutable.
  std::string render(const nlohmann::json& context) const;
  std::string render(const nlohmann::json& context, const Functions& functions) const;
  // The same for a context whose objects keep their key order, as Python's dicts do (and so
  // tojson prints them). nlohmann::json sorts keys; parse requests as ordered_json to
  // render exactly what transformers renders for them.
  std::string render_ordered(const nlohmann::ordered_json& context,
                             const Functions& functions = {}) const;

  const std::string& name() const;

 private:
  explicit Template(std::shared_ptr<const detail::Program> program);
  std::shared_ptr<const detail::Program> program_;
};

}  // namespace strata::jinja
