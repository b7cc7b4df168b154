// A request as a producer sends it: the bytes as one JSONL line (Strata or OpenAI batch
// format), and the same bytes as a queue entry's fields (lines alternate name and value).
// Neither parse may throw or crash; a request they accept must be one the scheduler can
// run, and every result, whatever bytes its id or error hold, must print as JSON.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "coordinator/intake/request_format.h"
#include "coordinator/intake/request_rules.h"
#include "fuzz_common.h"
#include "worker/config.h"
#include "worker/text.h"

namespace {

using namespace strata;

const Tokenizer& ids_tokenizer() {
  static const std::unique_ptr<Tokenizer> t = [] {
    ModelConfig c;
    c.vocab = 1000;  // check_accepted relies on it
    return Tokenizer::ids_only(c);
  }();
  return *t;
}

FieldList as_fields(std::string_view text) {
  FieldList fields;
  std::string pending;
  bool have_name = false;
  for (size_t at = 0; at <= text.size();) {
    const size_t end = std::min(text.find('\n', at), text.size());
    std::string part(text.substr(at, end - at));
    at = end + 1;
    if (!have_name) {
      pending = std::move(part);
    } else {
      fields.emplace_back(std::move(pending), std::move(part));
    }
    have_name = !have_name;
  }
  return fields;
}

// What the coordinator does next with a parsed request: tokenize its text, then validate it
// (worker/request_rules). Whatever the bytes, a request that passes both must be runnable.
void check_accepted(IncomingRequest r, const InputLimits& limits) {
  if (!r.error.empty()) {
    fuzz::require(r.error.find(r.where) == 0, "an error names where the request came from");
    return;
  }
  fuzz::require(!(r.prompt.has_value() && !r.request.prompt_ids.empty()),
                "text to tokenize or ids, not both");
  fuzz::require(r.prompt.value_or("").size() <= static_cast<size_t>(limits.request_bytes),
                "a prompt within the request limit");
  fuzz::require(!r.request.id.empty(), "an accepted request has an id");
  tokenize(r, ids_tokenizer());
  if (!r.error.empty()) return;
  constexpr int32_t vocab = 1000;  // as ids_tokenizer() was made
  if (!validate_request(r.request, vocab, 512, &ids_tokenizer()).empty()) return;
  fuzz::require(!r.request.prompt_ids.empty(), "a runnable request has a prompt");
  for (int32_t t : r.request.prompt_ids) fuzz::require(t >= 0 && t < vocab, "ids in vocabulary");
  fuzz::require(r.request.max_new_tokens >= 0, "max_new_tokens not negative");
}

void check_result_prints(const IncomingRequest& r) {
  GenerationResult res{r.request.id,
                       r.request.prompt_ids,
                       {},
                       StopReason::kError,
                       r.error.empty() ? std::string("x") : r.error,
                       ErrorKind::kInvalidInput};
  const std::string text = result_object(res, ids_tokenizer()).dump();
  fuzz::require(first_invalid_utf8(text) < 0, "a result prints as valid UTF-8");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  InputLimits limits;
  limits.request_bytes = 4096;  // small, so the fuzzer reaches the limit too
  const IncomingRequest line = parse_request_line(text, "fuzz:1", limits);
  check_accepted(line, limits);
  check_result_prints(line);
  const IncomingRequest entry =
      parse_request_fields(as_fields(text), "fuzz-id", "fuzz 1-0", limits);
  check_accepted(entry, limits);
  check_result_prints(entry);
  (void)result_from_fields(as_fields(text))
      .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return 0;
}
