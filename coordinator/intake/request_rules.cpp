#include "coordinator/intake/request_rules.h"

#include <algorithm>

#include "kernels/error.h"

namespace strata {

const char* stop_reason_name(StopReason r) {
  switch (r) {
    case StopReason::kEos:
      return "eos";
    case StopReason::kLength:
      return "length";
    case StopReason::kContext:
      return "context";
    case StopReason::kError:
      return "error";
    case StopReason::kStop:
      return "stop";
  }
  return "?";
}

namespace {

// The completion cut before the earliest stop string it contains, if any.
std::optional<std::string> cut_at_stop(const GenerationRequest& r, const Tokenizer& tokenizer,
                                       const GenerationResult& result) {
  std::string text = tokenizer.completion(r.prompt_ids, result.output_ids);
  size_t cut = std::string::npos;
  for (const std::string& s : r.stop) cut = std::min(cut, text.find(s));
  if (cut == std::string::npos) return std::nullopt;
  text.resize(cut);
  return text;
}

}  // namespace

bool finish_if_done(const GenerationRequest& r, const std::vector<int32_t>& eos_ids,
                    const Tokenizer* tokenizer, int32_t n_past, int32_t capacity,
                    GenerationResult& result) {
  STRATA_CHECK(!result.output_ids.empty(), "request {}: no token to check", r.id);
  const int32_t token = result.output_ids.back();
  if (!r.ignore_eos && std::find(eos_ids.begin(), eos_ids.end(), token) != eos_ids.end()) {
    result.stop_reason = StopReason::kEos;
    return true;
  }
  // vLLM's rule: ignore_eos does not switch these off.
  if (std::find(r.stop_token_ids.begin(), r.stop_token_ids.end(), token) !=
      r.stop_token_ids.end()) {
    result.stop_reason = StopReason::kStop;
    return true;
  }
  if (!r.stop.empty()) {
    STRATA_CHECK(tokenizer != nullptr, "request {}: stop strings without a tokenizer", r.id);
    if (std::optional<std::string> text = cut_at_stop(r, *tokenizer, result)) {
      result.stop_reason = StopReason::kStop;
      result.text = std::move(text);
      return true;
    }
  }
  if (static_cast<int32_t>(result.output_ids.size()) >= r.max_new_tokens) {
    result.stop_reason = StopReason::kLength;
  } else if (n_past >= capacity) {
    result.stop_reason = StopReason::kContext;  // no position left to feed the new token
  } else {
    return false;
  }
  return true;
}

namespace {

std::string validate_stop_strings(const GenerationRequest& r, const Tokenizer* tokenizer) {
  if (r.stop.empty()) return {};
  if (tokenizer == nullptr) return "field 'stop': this run has no tokenizer to match stop strings";
  if (r.stop.size() > kMaxStopStrings)
    return fmt::format("field 'stop': {} strings, at most {} are allowed", r.stop.size(),
                       kMaxStopStrings);
  for (size_t i = 0; i < r.stop.size(); ++i) {
    if (r.stop[i].empty()) return fmt::format("field 'stop': string {} is empty", i);
    if (r.stop[i].size() > kMaxStopStringBytes)
      return fmt::format("field 'stop': string {} has {} bytes, at most {} are allowed", i,
                         r.stop[i].size(), kMaxStopStringBytes);
  }
  return {};
}

}  // namespace

std::string validate_request(const GenerationRequest& r, int32_t vocab, int32_t capacity,
                             const Tokenizer* tokenizer) {
  if (r.prompt_ids.empty()) return "empty prompt: at least one token id is needed";
  for (size_t i = 0; i < r.prompt_ids.size(); ++i) {
    const int32_t t = r.prompt_ids[i];
    if (t < 0 || t >= vocab)
      return fmt::format("prompt token {} at index {} is outside the vocabulary [0, {})", t, i,
                         vocab);
  }
  if (r.max_new_tokens < 0)
    return fmt::format("max_new_tokens must be >= 0, got {}", r.max_new_tokens);
  if (static_cast<int64_t>(r.prompt_ids.size()) > capacity)
    return fmt::format(
        "field 'prompt': {} tokens exceed the context of {} positions (--max-context, at most "
        "the model's)",
        r.prompt_ids.size(), capacity);
  try {
    r.sampling.validate();
  } catch (const InputError& e) {
    return e.what();
  }
  if (r.n < 1 || r.n > kMaxChoices)
    return fmt::format("field 'n' must be in [1, {}], got {}", kMaxChoices, r.n);
  if (r.stop_token_ids.size() > kMaxStopTokenIds)
    return fmt::format("field 'stop_token_ids': {} ids, at most {} are allowed",
                       r.stop_token_ids.size(), kMaxStopTokenIds);
  for (size_t i = 0; i < r.stop_token_ids.size(); ++i)
    if (r.stop_token_ids[i] < 0 || r.stop_token_ids[i] >= vocab)
      return fmt::format(
          "field 'stop_token_ids': id {} at index {} is outside the vocabulary "
          "[0, {})",
          r.stop_token_ids[i], i, vocab);
  return validate_stop_strings(r, tokenizer);
}

}  // namespace strata
