#include "worker/generator.h"

#include <algorithm>
#include <chrono>
#include <deque>

#include "kernels/error.h"
#include "worker/request_rules.h"

namespace strata {
namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

double GenerationStats::generation_throughput() const {
  return total_seconds() > 0 ? static_cast<double>(generated_tokens) / total_seconds() : 0.0;
}

double GenerationStats::decode_throughput() const {
  return decode_seconds > 0 ? static_cast<double>(decode_tokens) / decode_seconds : 0.0;
}

std::string GenerationStats::json() const {
  return fmt::format(
      R"({{"prefill_seconds": {:.6f}, "decode_seconds": {:.6f}, "prompt_tokens": {}, )"
      R"("generated_tokens": {}, "prefill_steps": {}, "decode_steps": {}, "decode_tokens": {}, )"
      R"("generation_tokens_per_s": {:.3f}, "decode_tokens_per_s": {:.3f}, "kv_cache_bytes": {}}})",
      prefill_seconds, decode_seconds, prompt_tokens, generated_tokens, prefill_steps, decode_steps,
      decode_tokens, generation_throughput(), decode_throughput(), kv_cache_bytes);
}

struct Generator::Running {
  const GenerationRequest* request = nullptr;
  GenerationResult* result = nullptr;
  int32_t slot = -1;
  int32_t n_past = 0;  // tokens in the KV cache
  Rng rng;
};

Generator::Generator(Model& model, GeneratorOptions options, const Tokenizer* tokenizer)
    : model_(model), options_(options), tokenizer_(tokenizer) {
  if (options_.max_batch <= 0) fail_input("max batch must be positive, got {}", options_.max_batch);
  if (options_.max_step_tokens <= 0)
    fail_input("max step tokens must be positive, got {}", options_.max_step_tokens);
  STRATA_CHECK(model.max_rows() >= std::max(options_.max_batch, options_.max_step_tokens),
               "model workspace of {} rows < max(batch {}, step tokens {})", model.max_rows(),
               options_.max_batch, options_.max_step_tokens);
}

std::string Generator::validate(const GenerationRequest& r, int32_t capacity) const {
  return validate_request(r, model_.config().vocab, capacity, tokenizer_);
}

int32_t Generator::plan_capacity(const std::vector<GenerationRequest>& requests) const {
  const int32_t model_max = model_.config().max_positions;
  if (options_.max_context > 0) return std::min(options_.max_context, model_max);
  int64_t need = 1;
  for (const GenerationRequest& r : requests) {
    // The last generated token is never fed back, so it needs no cache position.
    need = std::max<int64_t>(
        need, static_cast<int64_t>(r.prompt_ids.size()) + std::max(r.max_new_tokens - 1, 0));
  }
  return static_cast<int32_t>(std::min<int64_t>(need, model_max));
}

std::vector<GenerationResult> Generator::run(const std::vector<GenerationRequest>& requests,
                                             GenerationStats* stats_out,
                                             const ResultCallback& on_done) {
  on_done_ = on_done ? &on_done : nullptr;
  requests_ = requests.data();
  GenerationStats stats;
  std::vector<GenerationResult> results(requests.size());
  const int32_t capacity = plan_capacity(requests);
  std::deque<size_t> waiting;
  for (size_t i = 0; i < requests.size(); ++i) {
    results[i].id = requests[i].id;
    results[i].prompt_ids = requests[i].prompt_ids;
    results[i].error = validate(requests[i], capacity);
    if (!results[i].error.empty()) {
      results[i].stop_reason = StopReason::kError;
      results[i].error_kind = ErrorKind::kInvalidInput;
    } else if (requests[i].max_new_tokens == 0) {
      results[i].stop_reason = StopReason::kLength;
    } else {
      waiting.push_back(i);
      continue;
    }
    if (on_done_) (*on_done_)(i, results[i]);
  }
  if (waiting.empty()) {
    if (stats_out) *stats_out = stats;
    return results;
  }
  const auto slots = static_cast<int32_t>(
      std::min<size_t>(static_cast<size_t>(options_.max_batch), waiting.size()));
  const std::unique_ptr<KvCache> owned_cache = model_.make_cache(slots, capacity);
  KvCache& cache = *owned_cache;
  stats.kv_cache_bytes = cache.bytes();
  // At most one logits row per sequence per step: the batch bounds the rows.
  logits_.resize(static_cast<size_t>(slots) * static_cast<size_t>(model_.config().vocab));

  std::vector<Running> pool(requests.size());
  std::vector<Running*> running;
  while (!waiting.empty() || !running.empty()) {
    std::vector<Running*> admitted;
    while (!waiting.empty() && cache.free_slots() > 0) {
      const size_t i = waiting.front();
      waiting.pop_front();
      Running& r = pool[i];
      r = Running{&requests[i], &results[i], cache.acquire(), 0, Rng(requests[i].sampling.seed)};
      stats.prompt_tokens += static_cast<int64_t>(requests[i].prompt_ids.size());
      admitted.push_back(&r);
    }
    if (!admitted.empty()) {
      prefill(admitted, cache, stats);
      for (Running* r : admitted)
        if (r->slot >= 0) running.push_back(r);
    }
    if (!running.empty()) decode(running, cache, stats);
  }
  for (const GenerationResult& r : results)
    stats.generated_tokens += static_cast<int64_t>(r.output_ids.size());
  if (stats_out) *stats_out = stats;
  return results;
}

// Prompts of the admitted sequences, packed into steps of at most max_step_tokens rows.
void Generator::prefill(std::vector<Running*>& admitted, KvCache& cache, GenerationStats& stats) {
  const double t0 = now_s();
  std::vector<Running*> in_step;
  size_t next = 0;
  while (next < admitted.size()) {
    batch_.clear();
    in_step.clear();
    int32_t budget = options_.max_step_tokens;
    while (next < admitted.size() && budget > 0) {
      Running& r = *admitted[next];
      const auto& prompt = r.request->prompt_ids;
      const auto remaining = static_cast<int32_t>(prompt.size()) - r.n_past;
      const int32_t take = std::min(remaining, budget);
      const bool last_chunk = take == remaining;
      batch_.add(
          r.slot, r.n_past,
          std::span(prompt).subspan(static_cast<size_t>(r.n_past), static_cast<size_t>(take)),
          last_chunk);
      r.n_past += take;
      budget -= take;
      if (last_chunk) {
        in_step.push_back(&r);
        ++next;
      }
    }
    model_.forward(batch_, cache, logits_.data());
    ++stats.prefill_steps;
    const auto vocab = static_cast<size_t>(model_.config().vocab);
    for (size_t i = 0; i < in_step.size(); ++i)
      accept(*in_step[i], logits_.data() + i * vocab, cache);
  }
  stats.prefill_seconds += now_s() - t0;
}

void Generator::decode(std::vector<Running*>& running, KvCache& cache, GenerationStats& stats) {
  const double t0 = now_s();
  batch_.clear();
  for (Running* r : running) {
    const int32_t last = r->result->output_ids.back();
    batch_.add(r->slot, r->n_past, std::span(&last, 1), true);
    r->n_past += 1;
  }
  model_.forward(batch_, cache, logits_.data());
  ++stats.decode_steps;
  stats.decode_tokens += static_cast<int64_t>(running.size());
  const auto vocab = static_cast<size_t>(model_.config().vocab);
  for (size_t i = 0; i < running.size(); ++i)
    accept(*running[i], logits_.data() + i * vocab, cache);
  // Finished sequences leave at once; their slots are already free for the next admission.
  std::erase_if(running, [](const Running* r) { return r->slot < 0; });
  stats.decode_seconds += now_s() - t0;
}

void Generator::accept(Running& seq, const float* logits, KvCache& cache) {
  const ModelConfig& c = model_.config();
  GenerationResult& res = *seq.result;
  res.output_ids.push_back(sampler_.sample(logits, c.vocab, seq.request->sampling, seq.rng));
  if (finish_if_done(*seq.request, c.eos_token_ids, tokenizer_, seq.n_past, cache.capacity(),
                     res)) {
    cache.release(seq.slot);
    seq.slot = -1;
    if (on_done_) (*on_done_)(static_cast<size_t>(seq.request - requests_), res);
  }
}

}  // namespace strata
