// The pipeline stages as the coordinator's loop (coordinator.h) reaches them: the one seam
// between the request path (intake, scheduler, results: the same for every run) and where
// the layers compute. MpiStages (mpi_stages.h) drives worker ranks over MPI; LocalStages
// (local_stages.h) is a one-stage cluster inside this process (`strata generate`,
// single-process `serve`). Tests put faults behind it.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "coordinator/plan/scheduled_step.h"
#include "kernels/error.h"
#include "transport/messages.h"
#include "worker/kv_swap.h"

namespace strata {

struct StageReport {
  StagePlan stage;
  StageStats stats;
  double bubble_fraction() const;  // idle / window of the stage's first to last step
  // The rank that reported: the stage's, or a member of its tensor-parallel group.
  int32_t rank() const { return stats.rank > 0 ? stats.rank : stage.rank; }
};

// What the stages measured for the profiler (coordinator/exegpt/profiler.h): each stage's report,
// in rank order, and the coordinator's round trip to the last stage (a step's overhead).
// A KV hand-over every stage finished (WAA): the KV bytes the prefill stages sent.
struct HandoverDone {
  uint64_t handover_id = 0;
  uint64_t bytes = 0;
};

struct ProfileResult {
  std::vector<ProfileReport> reports;
  double round_trip_s = 0;
};

class Stages {
 public:
  virtual ~Stages() = default;
  // Stages to plan for (ranks 1..count()).
  virtual int32_t count() const = 0;
  // Processes the run spans, the coordinator's included (statistics).
  virtual int32_t ranks() const = 0;
  // Hands each stage its part of the plan; returns once every one has loaded it. A stage
  // that cannot load is an Error naming it.
  virtual void start(const ClusterPlan& plan) = 0;
  // Starts a step on every stage (its new sequences join the last stage's sampler first).
  virtual void dispatch(const ScheduledStep& step) = 0;
  // The sequences finished: the last stage forgets them.
  virtual void leave(const std::vector<uint64_t>& seq_ids) = 0;
  // A step's result if one is in, else nullopt at once. Keeps the stages' liveness
  // checked meanwhile: a stage that failed, died or hangs is an Error naming it.
  virtual std::optional<StepResult> poll() = 0;
  // Ends the stages after a run (`reason` for their logs); returns their statistics.
  virtual std::vector<StageReport> finish(const std::string& reason) = 0;
  // The stages' statistics so far, as their latest heartbeats carried them (live metrics;
  // a stage not heard from yet is missing).
  virtual std::vector<StageReport> live() const = 0;
  // ExeGPT's XProfiler: every stage times its part as `request` asks, under its real
  // placement, and its link to the next (worker/stage.h PipelineStage::profile). Between
  // start() and the first dispatch().
  virtual ProfileResult profile(const ProfileRequest& request) = 0;
  // Whether these stages can run a WAA plan (two pipelines and KV hand-overs).
  virtual bool runs_waa() const { return false; }
  // WAA (plan.waa()): hands the KV of a prefill's sequences to the decode pipeline
  // (KvHandover: every stage of both sides takes part). Stages without WAA refuse it.
  virtual void hand_over(const KvHandover& handover) {
    fail(ErrorKind::kFailed, "{}: these stages run no WAA plan (one pipeline)", handover.str());
  }
  // The hand-overs every stage has finished since the last call, in no particular order.
  virtual std::vector<HandoverDone> handovers_done() { return {}; }
  // Pie's swapping so far, where the stages' KV cache runs it (a local stage only; a
  // cluster's plan places no Pie).
  virtual std::optional<KvSwapStats> pie_stats() const { return std::nullopt; }
  // Best effort after a failure: tells the stages to stop, bounded in time, never throws.
  virtual void abort(const std::string& reason) noexcept = 0;
};

}  // namespace strata
