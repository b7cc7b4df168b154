// Batched generation over one model: continuous batching at iteration level. Requests wait
// in arrival order; whenever KV slots are free, waiting requests are admitted and
// prefilled (in chunks of at most max_step_tokens rows, no padding), then every running
// sequence decodes one token per step. A sequence that hits EOS or its token budget leaves
// the batch at once and its slot is reused by the next waiting request.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "kernels/error.h"
#include "kernels/sampling.h"
#include "worker/kv_cache.h"
#include "worker/model.h"
#include "worker/tokenizer.h"

namespace strata {

struct GenerationRequest {
  std::string id;
  std::vector<int32_t> prompt_ids;
  int32_t max_new_tokens = 64;
  SamplingParams sampling;
  bool ignore_eos = false;        // benchmarks: always generate max_new_tokens
  std::vector<std::string> stop;  // end once the completion contains one (cut before it)
  std::string latency_class;      // a client's hint for latency-aware schedulers; carried
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
};

struct GeneratorOptions {
  int32_t max_batch = 32;         // sequences decoding together (KV slots)
  int32_t max_step_tokens = 512;  // rows of one prefill step (longer prompts are chunked)
  int32_t max_context = 0;        // KV capacity per slot; 0: longest request, capped by the model
};

struct GenerationStats {
  double prefill_seconds = 0;
  double decode_seconds = 0;
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;
  int64_t decode_steps = 0;
  int64_t decode_tokens = 0;  // tokens produced by decode steps (the first comes from prefill)
  int64_t prefill_steps = 0;
  size_t kv_cache_bytes = 0;

  double total_seconds() const { return prefill_seconds + decode_seconds; }
  // FlexGen's throughput: generated tokens / (prefill + decode time).
  double generation_throughput() const;
  double decode_throughput() const;  // decode_tokens / decode time
  std::string json() const;
};

class Generator {
 public:
  // `tokenizer` (may be null) decodes completions for requests with stop strings.
  Generator(Model& model, GeneratorOptions options, const Tokenizer* tokenizer = nullptr);

  // Runs every request to completion. Results come back in request order; a request that is
  // invalid (empty prompt, token id outside the vocabulary, prompt longer than the context)
  // gets a kError result with a message and does not disturb the others.
  // `on_done`, when given, sees each result the moment it is final (refused at once, or its
  // last token sampled) with the request's index, so a caller can write it out before the
  // rest finish and a later failure loses nothing already computed.
  using ResultCallback = std::function<void(size_t index, const GenerationResult&)>;
  std::vector<GenerationResult> run(const std::vector<GenerationRequest>& requests,
                                    GenerationStats* stats = nullptr,
                                    const ResultCallback& on_done = {});

 private:
  struct Running;
  std::string validate(const GenerationRequest& r, int32_t capacity) const;
  int32_t plan_capacity(const std::vector<GenerationRequest>& requests) const;
  void prefill(std::vector<Running*>& admitted, KvCache& cache, GenerationStats& stats);
  void decode(std::vector<Running*>& running, KvCache& cache, GenerationStats& stats);
  // Samples from `logits` for `seq` and retires it (freeing its slot) if it is done.
  void accept(Running& seq, const float* logits, KvCache& cache);

  Model& model_;
  GeneratorOptions options_;
  const Tokenizer* tokenizer_;
  Sampler sampler_;
  StepBatch batch_;
  std::vector<float> logits_;
  const ResultCallback* on_done_ = nullptr;      // set for the duration of run()
  const GenerationRequest* requests_ = nullptr;  // run()'s requests: a Running's index
};

}  // namespace strata
