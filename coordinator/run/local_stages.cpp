#include "coordinator/run/local_stages.h"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>

#include "kernels/clock.h"
#include "kernels/error.h"

namespace strata {
namespace {

// The requests of a local run, all there from the start; each is named by its index (the
// sink maps results back by it) and keeps its own id in its result.
class VectorSource final : public RequestSource {
 public:
  explicit VectorSource(const std::vector<GenerationRequest>& requests)
      : requests_(requests), arrival_(wall_seconds()) {}

  std::vector<IncomingRequest> poll(size_t max) override {
    std::vector<IncomingRequest> out;
    for (; next_ < requests_.size() && out.size() < max; ++next_) {
      IncomingRequest r;
      r.request = requests_[next_];
      r.request.id = std::to_string(next_);
      r.where = fmt::format("request {} (id '{}')", next_, requests_[next_].id);
      r.arrival = arrival_;
      out.push_back(std::move(r));
    }
    return out;
  }
  bool exhausted() const override { return next_ == requests_.size(); }
  std::vector<IncomingRequest> stop() override { return poll(SIZE_MAX); }

 private:
  const std::vector<GenerationRequest>& requests_;
  double arrival_;
  size_t next_ = 0;
};

class VectorSink final : public ResultSink {
 public:
  VectorSink(const std::vector<GenerationRequest>& requests,
             const LocalCluster::ResultCallback& on_done)
      : requests_(requests), results_(requests.size()), on_done_(on_done) {}

  void write(const GenerationResult& result) override {
    size_t i = 0;
    const std::string& id = result.id;
    const auto [end, ec] = std::from_chars(id.data(), id.data() + id.size(), i);
    STRATA_CHECK(ec == std::errc() && end == id.data() + id.size() && i < results_.size(),
                 "a local run's result for request '{}', which it never read", id);
    results_[i] = result;
    results_[i].id = requests_[i].id;
    if (on_done_) on_done_(i, results_[i]);
  }
  void unfinished(const GenerationResult& partial, bool) override { write(partial); }
  bool flush(const Deadline&) override { return true; }
  std::vector<GenerationResult> take() { return std::move(results_); }

 private:
  const std::vector<GenerationRequest>& requests_;
  std::vector<GenerationResult> results_;
  const LocalCluster::ResultCallback& on_done_;
};

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
      R"("generation_tokens_per_s": {:.3f}, "decode_tokens_per_s": {:.3f}, "kv_cache_bytes": {}{}{}}})",
      prefill_seconds, decode_seconds, prompt_tokens, generated_tokens, prefill_steps, decode_steps,
      decode_tokens, generation_throughput(), decode_throughput(), kv_cache_bytes,
      packing ? ", \"packing\": " + packing->json() : std::string(),
      pie ? ", \"pie\": " + pie->json() : std::string());
}

void LocalStages::start(const ClusterPlan& plan) {
  STRATA_CHECK(plan.stages.size() == 1, "a local run has one stage, the plan has {}",
               plan.stages.size());
  stage_ = std::make_unique<PipelineStage>(plan, plan.stages[0], model_);
  stats_ = GenerationStats{};
  stats_.kv_cache_bytes = stage_->kv_cache_bytes();
  const KvCache& kv = stage_->kv_cache();
  stats_.kv_position_bytes =
      kv.bytes() / (static_cast<size_t>(kv.n_slots()) * static_cast<size_t>(kv.capacity()));
  rows_ = 0;
  timeline_ = StageStats{};
}

void LocalStages::dispatch(const ScheduledStep& step) {
  for (const SeqJoin& j : step.joins) stage_->join(j);
  const StepCommand& c = step.command;
  const double t0 = now_s();
  const double wall0 = wall_seconds();
  StepResult result{c.step_id, c.micro_batch, stage_->run(c, {}, {})};
  const double seconds = now_s() - t0;
  timeline_.add_span(wall0, wall0 + seconds);
  if (c.phase == Phase::kPrefill) {
    stats_.prefill_seconds += seconds;
    ++stats_.prefill_steps;
  } else {
    stats_.decode_seconds += seconds;
    ++stats_.decode_steps;
    stats_.decode_tokens += static_cast<int64_t>(result.tokens.size());
  }
  rows_ += static_cast<uint64_t>(c.rows());
  if (const KvSwap* swap = stage_->kv_cache().swap()) stats_.pie = swap->stats();
  results_.push_back(std::move(result));
  if (after_step_) after_step_(c, seconds);
}

void LocalStages::leave(const std::vector<uint64_t>& seq_ids) {
  for (uint64_t id : seq_ids) stage_->leave(id);
}

std::optional<StepResult> LocalStages::poll() {
  if (results_.empty()) return std::nullopt;
  StepResult r = std::move(results_.front());
  results_.pop_front();
  return r;
}

// One process computes every step as it comes: the stage is never idle inside the run.
std::vector<StageReport> LocalStages::live() const {
  if (!stage_) return {};
  const double busy = stats_.total_seconds();
  const auto steps = static_cast<uint64_t>(stats_.prefill_steps + stats_.decode_steps);
  const WeightTraffic traffic = stage_->weight_traffic();
  return {StageReport{stage_->stage(), StageStats{stage_->stage().rank, steps, rows_, busy, 0.0,
                                                  busy, traffic.from_cpu, traffic.from_disk}}};
}

std::vector<StageReport> LocalStages::finish(const std::string&) {
  std::vector<StageReport> reports = live();
  if (!reports.empty()) {
    reports[0].stats.step_spans = timeline_.step_spans;
    reports[0].stats.step_spans_dropped = timeline_.step_spans_dropped;
  }
  return reports;
}

// One stage in this process: no link, and the coordinator's turn is a function call.
ProfileResult LocalStages::profile(const ProfileRequest& request) {
  ProfileReport report = stage_->profile(request);
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  report.host = host;
  return ProfileResult{{std::move(report)}, 0.0};
}

LocalCluster::LocalCluster(Model& model, LocalOptions options, const Tokenizer* tokenizer)
    : model_(model), options_(options), tokenizer_(tokenizer) {
  if (options_.max_batch <= 0) fail_input("max batch must be positive, got {}", options_.max_batch);
  if (options_.max_step_tokens <= 0)
    fail_input("max step tokens must be positive, got {}", options_.max_step_tokens);
}

// All requests are known before the run, so the KV cache is sized for them: slots for
// as many as run together, positions for the longest (the last token generated is never
// fed back, so it needs none). A queue's run cannot know this and sizes from the
// configuration instead.
CoordinatorOptions LocalCluster::coordinator_options(
    const std::vector<GenerationRequest>& requests) const {
  CoordinatorOptions c;
  c.model_spec = "local";
  c.micro_batches = 1;
  c.decode_iters = 1;  // a prefill phase whenever a slot is free: continuous batching
  c.kv_slots = static_cast<int32_t>(std::min<size_t>(static_cast<size_t>(options_.max_batch),
                                                     std::max<size_t>(requests.size(), 1)));
  c.max_step_tokens = options_.max_step_tokens;
  c.on_tokens = options_.on_tokens;
  c.packing = options_.packing;
  int64_t need = 1;
  for (const GenerationRequest& r : requests)
    need = std::max<int64_t>(
        need, static_cast<int64_t>(r.prompt_ids.size()) + std::max(r.max_new_tokens - 1, 0));
  c.max_context =
      options_.max_context > 0
          ? options_.max_context
          : static_cast<int32_t>(std::min<int64_t>(need, model_.config().max_positions));
  return c;
}

std::vector<GenerationResult> LocalCluster::run(const std::vector<GenerationRequest>& requests,
                                                GenerationStats* stats,
                                                const ResultCallback& on_done) {
  if (requests.empty()) {
    if (stats) *stats = GenerationStats{};
    return {};
  }
  LocalStages stages(model_, options_.after_step);
  VectorSource source(requests);
  VectorSink sink(requests, on_done);
  const ClusterStats cs = run_coordinator(stages, coordinator_options(requests), model_.config(),
                                          tokenizer_, source, sink);
  if (stats) {
    *stats = stages.stats();
    stats->prompt_tokens = cs.prompt_tokens;
    stats->generated_tokens = cs.generated_tokens;
    stats->packing = cs.packing;
  }
  return sink.take();
}

}  // namespace strata
