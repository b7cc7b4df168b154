// The rules of the one request path (the scheduler, rra_scheduler.h, for `strata generate` and
// every cluster alike): what makes a request valid and what ends a sequence, in one place.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "coordinator/intake/request.h"
#include "worker/tokenizer.h"

namespace strata {

// The stop rule, in this order: EOS (unless ignore_eos), a stop token id, a stop string in the
// completion, the token budget, the context. `result.output_ids` has just gained a token and
// `n_past` of `capacity` KV positions are filled. Sets result.stop_reason and returns true when the
// sequence is done; for a stop string result.text is the completion cut before it. `tokenizer`
// decodes completions for requests with stop strings (validate_request refuses those without one).
bool finish_if_done(const GenerationRequest& request, const std::vector<int32_t>& eos_ids,
                    const Tokenizer* tokenizer, int32_t n_past, int32_t capacity,
                    GenerationResult& result);

// An empty string when the request can run in a KV slot of `capacity` positions of a model
// with `vocab` ids, else the problem: an empty prompt, an id outside the vocabulary, a
// prompt longer than the context, bad sampling values, stop strings past their limits or
// without a tokenizer to match them.
std::string validate_request(const GenerationRequest& request, int32_t vocab, int32_t capacity,
                             const Tokenizer* tokenizer);

inline constexpr size_t kMaxStopStrings = 16;
inline constexpr size_t kMaxStopStringBytes = 1024;
inline constexpr size_t kMaxStopTokenIds = 64;
inline constexpr int32_t kMaxChoices = 16;  // `n`: each choice holds a KV slot of its own

}  // namespace strata
