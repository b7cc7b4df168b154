// What a request is and what comes back for it. The coordinator owns requests: it takes
// them from a source (intake.h), validates them and ends them (request_rules.h), schedules
// them (rra_scheduler.h) and hands their results to a sink. Stages never see these types, only
// the steps the scheduler makes of them (transport/messages.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kernels/error.h"
#include "kernels/sampling.h"

namespace strata {

struct GenerationRequest {
  std::string id;
  std::vector<int32_t> prompt_ids;
  int32_t max_new_tokens = 64;
  SamplingParams sampling;
  bool ignore_eos = false;              // benchmarks: always generate max_new_tokens
  std::vector<std::string> stop;        // end once the completion contains one (cut before it)
  std::vector<int32_t> stop_token_ids;  // end after one of these (kept, as EOS is)
  std::string latency_class;            // a client's hint for latency-aware schedulers; carried
  // Completions asked for (`n`); the coordinator runs each as its own sequence, `choice` of
  // them, with seed + choice, and answers with one result (choices.h).
  int32_t n = 1;
  int32_t choice = 0;
  bool chat = false;  // its prompt came from messages: its result is a chat completion
};

// kStop: the completion reached one of the request's stop strings.
enum class StopReason { kEos, kLength, kContext, kError, kStop };
const char* stop_reason_name(StopReason r);

// Seconds from the moment a request was queued (its queue entry's time, or when it was
// read) to its admission into a prefill, to its first token, and to its result; -1: unknown.
struct RequestTimes {
  double queue_wait_s = -1;
  double first_token_s = -1;
  double total_s = -1;
};

struct GenerationResult {
  std::string id;
  std::vector<int32_t> prompt_ids;
  std::vector<int32_t> output_ids;
  StopReason stop_reason = StopReason::kLength;
  std::string error;  // set when stop_reason == kError: why it was refused or did not finish
  // With kError: kInvalidInput when the request itself is at fault (refused), another kind
  // when it is not (the run failed or stopped before it finished).
  ErrorKind error_kind = ErrorKind::kFailed;
  std::optional<std::string> text;  // the completion when a stop string cut it short
  RequestTimes times;
  // With sampling.logprobs >= 0: one entry per output token, in order.
  std::vector<Logprobs> logprobs;
  int32_t choice = 0;  // its request's choice of n (GenerationRequest)
  int32_t n = 1;
  bool chat = false;
  // A request of n > 1 completions: this result is choice 0, and `choices` holds all n (0 too)
  // in order, each with its own output, stop reason, text and logprobs.
  std::vector<GenerationResult> choices;
};

}  // namespace strata
