// A one-stage cluster inside this process: the whole model as one PipelineStage, each step
// computed as it is dispatched. `strata generate`, `strata bench` and single-process
// `strata serve` run the coordinator's loop (coordinator.h) over it, so a request takes the
// same path (validation, RRA scheduling, the stop rule, sampling at the last stage) as it
// does across ranks.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "coordinator/plan/stages.h"
#include "coordinator/run/coordinator.h"
#include "worker/model.h"
#include "worker/stage.h"

namespace strata {

// FlexGen's view of a run: prefill and decode time apart.
struct GenerationStats {
  double prefill_seconds = 0;
  double decode_seconds = 0;
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;
  int64_t decode_steps = 0;
  int64_t decode_tokens = 0;  // tokens produced by decode steps (the first comes from prefill)
  int64_t prefill_steps = 0;
  size_t kv_cache_bytes = 0;
  size_t kv_position_bytes = 0;  // one position of one sequence: K and V of every layer, as stored
  std::optional<PackingStats> packing;  // with a KV budget (S3)
  std::optional<KvSwapStats> pie;       // with Pie on the KV cache

  double total_seconds() const { return prefill_seconds + decode_seconds; }
  // FlexGen's throughput: generated tokens / (prefill + decode time).
  double generation_throughput() const;
  double decode_throughput() const;  // decode_tokens / decode time
  std::string json() const;
};

// Called after each step with what it computed and its seconds, outside the step's timing
// (a benchmark measures the machine between steps with it).
using AfterStep = std::function<void(const StepCommand& step, double seconds)>;

class LocalStages final : public Stages {
 public:
  // Over `model`, loaded by the caller with every layer, the embedding and the head; its
  // workspace must hold the plan's rows. `model` outlives this.
  explicit LocalStages(Model& model, AfterStep after_step = {})
      : model_(model), after_step_(std::move(after_step)) {}

  int32_t count() const override { return 1; }
  int32_t ranks() const override { return 1; }
  void start(const ClusterPlan& plan) override;
  void dispatch(const ScheduledStep& step) override;
  void leave(const std::vector<uint64_t>& seq_ids) override;
  std::optional<StepResult> poll() override;
  std::vector<StageReport> finish(const std::string& reason) override;
  std::vector<StageReport> live() const override;
  ProfileResult profile(const ProfileRequest& request) override;
  void abort(const std::string&) noexcept override {}
  std::optional<KvSwapStats> pie_stats() const override { return stats_.pie; }

  // Time and steps by phase, and the KV cache's size (tokens are counted by the caller).
  const GenerationStats& stats() const { return stats_; }

 private:
  Model& model_;
  AfterStep after_step_;
  std::unique_ptr<PipelineStage> stage_;
  std::deque<StepResult> results_;
  GenerationStats stats_;
  uint64_t rows_ = 0;    // activation rows over all steps (the stage report's)
  StageStats timeline_;  // its step spans (StageStats::add_span)
};

// What a local run needs beyond the model (CoordinatorOptions' counterparts).
struct LocalOptions {
  int32_t max_batch = 32;         // KV slots: sequences decoding together
  int32_t max_step_tokens = 512;  // rows of one prefill step (longer prompts are chunked)
  int32_t max_context = 0;        // KV positions per slot; 0: longest request, capped by the model
  std::function<void(int64_t tokens)> on_tokens;  // CoordinatorOptions::on_tokens
  KvPackingOptions packing;                       // CoordinatorOptions::packing
  AfterStep after_step;                           // LocalStages' hook
};

// `requests` run to completion on `model` through the coordinator's loop over LocalStages,
// as continuous batching (one micro-batch, a prefill phase whenever a slot is free).
// Results come back in request order; an invalid request gets a kError result saying why
// and does not disturb the others. `on_done`, when given, sees each result the moment it is
// final, with the request's index, so a caller can write it out before the rest finish.
class LocalCluster {
 public:
  using ResultCallback = std::function<void(size_t index, const GenerationResult&)>;
  // `tokenizer` (may be null) decodes completions for requests with stop strings.
  LocalCluster(Model& model, LocalOptions options, const Tokenizer* tokenizer = nullptr);
  std::vector<GenerationResult> run(const std::vector<GenerationRequest>& requests,
                                    GenerationStats* stats = nullptr,
                                    const ResultCallback& on_done = {});

 private:
  CoordinatorOptions coordinator_options(const std::vector<GenerationRequest>& requests) const;

  Model& model_;
  LocalOptions options_;
  const Tokenizer* tokenizer_;
};

}  // namespace strata
