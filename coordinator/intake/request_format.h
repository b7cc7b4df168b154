// The wire format of requests and results, for every intake (JSONL files, the Redis
// queue); docs/QUEUE.md is its user-facing description.
//
// A request is a JSON object (one JSONL line, or the `json` field of a queue entry):
//   {"id": "a" | 7, "prompt": "text" | "prompt_ids": [1, 2], "max_new_tokens": 64,
//    "temperature": 0, "top_k": 0, "top_p": 1, "seed": 0, "stop": ["\n\n"],
//    "ignore_eos": false, "latency_class": "batch"}
// or an OpenAI Batch API input line ({"custom_id", "method": "POST", "url":
// "/v1/completions", "body": {"prompt", "max_tokens", "temperature", "top_p", "seed",
// "stop", ...}}), or, in a queue entry, the same fields as flat field/value strings.
// Anything else (bad JSON, a wrong type, an unknown field, a value out of range, invalid
// UTF-8, an input past its size or nesting limit) becomes a request with `error` set, which
// gets an error result naming the problem and never reaches the workers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "coordinator/intake/request.h"
#include "worker/input_limits.h"
#include "worker/tokenizer.h"

namespace strata {

// Which sampling fields a request set, so that the model's generation_config.json fills only
// the others (apply_generation_defaults).
enum SamplingField : uint32_t {
  kSetTemperature = 1u << 0,
  kSetTopK = 1u << 1,
  kSetTopP = 1u << 2,
  kSetMinP = 1u << 3,
  kSetRepetitionPenalty = 1u << 4,
  kSetMaxNewTokens = 1u << 5,
};

struct IncomingRequest {
  GenerationRequest request;          // prompt_ids empty when the prompt is text
  std::optional<std::string> prompt;  // text to tokenize
  // A chat: the messages (a JSON array of {"role", "content"}), rendered by the model's chat
  // template into the prompt, with these extra template variables (chat_template_kwargs).
  std::optional<nlohmann::json> messages;
  bool add_generation_prompt = true;
  nlohmann::json chat_variables = nlohmann::json::object();
  uint32_t sampling_set = 0;  // SamplingField bits
  std::string error;          // non-empty: malformed, answered with an error result
  std::string where;          // "requests.jsonl:3", "strata:requests 1700000000000-0"
  double arrival = 0;         // when it was queued (system clock, seconds since 1970)
  // How often the queue has handed this entry out; more than once means it was in flight
  // when an earlier run died; the queue then hands it out alone (docs/QUEUE.md, "Poison").
  int64_t deliveries = 1;
};

// One JSON line (a Strata request or an OpenAI batch line); `where` names it in errors.
// Sizes are checked against limits.request_bytes and limits.json_depth before parsing.
// Never throws.
IncomingRequest parse_request_line(std::string_view line, const std::string& where,
                                   const InputLimits& limits = {});

// A request's JSON text, parsed once its size (limits.request_bytes) and nesting
// (limits.json_depth) are known to be within bounds; throws InputError or json::exception.
nlohmann::json parse_request_json(std::string_view text, const InputLimits& limits);

using FieldList = std::vector<std::pair<std::string, std::string>>;

// A queue entry's fields: either one `json` (a request line) or `openai` (a batch line)
// field, or the request's fields as strings (numbers as decimal text, prompt_ids as a JSON
// array or space-separated ids, stop as a JSON array; a stop value not starting with '[' is
// one stop string). A request without an id is called `default_id`. Never throws.
IncomingRequest parse_request_fields(const FieldList& fields, const std::string& default_id,
                                     const std::string& where, const InputLimits& limits = {});

// What a request's text is prepared with: the tokenizer (null: the run takes ids only), the
// run's context in positions and the tokenizer's max_token_bytes (either 0: no bound).
struct PromptPrep {
  const Tokenizer* tokenizer = nullptr;
  int32_t context = 0;
  size_t max_token_bytes = 0;
};

// Fills prompt_ids from the prompt text, or from the messages through the tokenizer's chat
// template (rendered first); a prompt the tokenizer refuses, messages without a template,
// text without a tokenizer, or text whose printable ASCII bytes alone make more tokens than
// the context (checked before it is tokenized) set `error`. A request without text, or
// already refused, is left as it is. Safe from any thread: the queue's reader calls it.
void prepare_prompt(IncomingRequest& r, const PromptPrep& prep);

// prepare_prompt with the tokenizer alone (no context bound).
void tokenize(IncomingRequest& r, const Tokenizer& tokenizer);

// The sampling fields the request did not set, from the model's generation_config.json.
void apply_generation_defaults(IncomingRequest& r, const GenerationDefaults& defaults);

// A result as one JSON object, in the documented order: id, status ("ok" | "error"), text
// (the completion), output_ids, stop_reason, prompt_tokens, completion_tokens, logprobs (when
// asked for), choices (n > 1), chat (a chat request), the timings that are known
// (queue_wait_s, first_token_s, total_s), error and error_type ("invalid_request" |
// "server_error") for errors, prompt_ids.
nlohmann::ordered_json result_object(const GenerationResult& result, const Tokenizer& tokenizer);

// A result stored as flat strings (a queue entry: result_object's fields, arrays and
// numbers as JSON text) read back as typed JSON; fields it does not know stay strings.
nlohmann::ordered_json result_from_fields(const FieldList& fields);

// A short rendering of a JSON value for error messages (bounded, whatever its size).
std::string preview(const nlohmann::json& value);

}  // namespace strata
