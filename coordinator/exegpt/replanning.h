// A run's schedule under a latency bound (ExeGPT; docs/SCHEDULING.md), as the coordinator's
// loop executes it: at start, the stages' layer profile (loaded, or measured through the
// started stages) and the workload give the best schedule -- RRA (layers per stage, KV
// slots, micro-batches, N_D) or WAA-C / WAA-M (the two pipelines, B_E, B_m) -- or a
// refusal naming the fastest achievable latency before
// any request runs; during the run, every finished request's lengths are observed, and
// when they drift from the planned workload the schedule is re-planned on the same layers
// (N_D and the batch; RRA adapts without re-deployment, §7.6). The run's statistics put the
// measured throughput and 99th-percentile latency next to the prediction.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "coordinator/exegpt/schedule_choice.h"
#include "coordinator/plan/cluster_plan.h"
#include "coordinator/plan/stages.h"
#include "coordinator/plan/workload.h"
#include "worker/config.h"

namespace strata {

struct ScheduleTarget {
  TaskWorkload workload;
  double latency_bound = std::numeric_limits<double>::infinity();
  std::string profile_path;        // reused when it matches the run; else measured and saved
  std::vector<std::string> hosts;  // the workers' host names, in rank order (the profile's key)
  double replan_tolerance = 0.15;  // relative drift of the output mean or p99 that re-plans
  // Finished requests before drift counts (0: 4 x the KV slots, at least 64).
  int64_t replan_min_samples = 0;
  std::vector<SchedulePolicy> policies;  // searched (--schedule-policy); empty: RRA, WAA-C, WAA-M
  // S3's packing of RRA's KV memory (--kv-reserve with --latency-bound): the chosen plan's
  // positions become the run's KV budget.
  std::optional<ReservationModel> packing;
};

// What a run planned and what it measured. The prediction is a steady state; the
// measurements compare with it over the run's steady window (coordinator.h ClusterStats):
// throughput there, and the latency of the requests admitted in it.
struct ScheduleReport {
  Prediction planned;
  std::string profile;  // where the layer profile came from
  int32_t replans = 0;
  // Each finished request: when it was admitted (run seconds), its latency from there to its
  // last token, and its output tokens.
  struct Sample {
    double admitted_at = 0, latency = 0;
    int32_t output = 0;
  };
  std::vector<Sample> latencies;
  double steady_from_s = 0, steady_to_s = 0;

  // What the bound is on (the paper's SLA-(b), §7.6): the latency of a sequence of the
  // planned p99 output length -- the 99th percentile over the requests admitted in the
  // steady window whose outputs are no longer than that (all of them when none was).
  double measured_p99_latency() const;
  // SLA-(a): the 99th percentile over all of them, whatever their length. A bound met for
  // the p99-length sequence can miss this one: a longer output spans another RRA phase.
  double measured_p99_all_latency() const;
  std::string json(double achieved_tok_s) const;
  std::string line(double achieved_tok_s) const;
};

class RunSchedule {
 public:
  RunSchedule(const ScheduleTarget& target, const ModelConfig& config, SchedulePlanOptions options);

  // Profiles the started stages (`started` is their plan) and chooses the schedule.
  // InputError when no schedule meets the bound, naming the fastest achievable latency.
  const Prediction& plan(Stages& stages, const ClusterPlan& started);
  // A finished request: its lengths and its latency from admission. Returns the new schedule
  // when the lengths drifted and a re-plan on the same layers found one.
  std::optional<Prediction> observe(int32_t input, int32_t output, double latency_s,
                                    double admitted_at_s);

  const Prediction& current() const { return report_.planned; }
  const ScheduleReport& report() const { return report_; }

 private:
  ScheduleTarget target_;
  const ModelConfig& config_;
  SchedulePlanOptions options_;
  std::unique_ptr<Simulator> simulator_;
  ObservedLengths observed_;
  TaskWorkload planned_workload_;
  ScheduleReport report_;
};

}  // namespace strata
