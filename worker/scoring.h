// Teacher forcing: the logits a model assigns at every position of a given sequence, as an
// evaluation suite needs them (log-likelihoods, perplexity) and as the reference checks use.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "worker/model.h"

namespace strata {

// Logits [ids.size(), vocab]: row i is the distribution of the token after ids[0..i],
// computed with the KV cache holding ids[0..i]. `chunk` tokens are fed per step (1 walks
// the decode path, ids.size() a single prefill), capped by the model's step rows.
std::vector<float> teacher_forced_logits(Model& model, std::span<const int32_t> ids, int32_t chunk);

// log p(ids[i + 1] | ids[0..i]) for i in [0, ids.size() - 1), from teacher-forced logits.
std::vector<double> next_token_logprobs(std::span<const float> logits, std::span<const int32_t> ids,
                                        int32_t vocab);

}  // namespace strata
