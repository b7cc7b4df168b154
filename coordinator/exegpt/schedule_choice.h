// A run's schedule, chosen (ExeGPT §3's flow): the workers' layer profile and a workload go
// into the simulator, the branch-and-bound search picks the control variables and layer
// allocation with the best throughput under the latency bound, and the FT-style baseline is
// searched beside it. `strata plan --workload` prints the choice; `strata serve
// --latency-bound` runs it.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "coordinator/exegpt/layer_profile.h"
#include "coordinator/exegpt/schedule_search.h"
#include "coordinator/exegpt/simulator.h"
#include "coordinator/plan/cluster_plan.h"
#include "coordinator/plan/workload.h"
#include "worker/config.h"

namespace strata {

struct SchedulePlanOptions {
  std::string model_spec;
  TaskWorkload workload;
  double latency_bound = std::numeric_limits<double>::infinity();
  double percentile = 0.99;         // the bound is on this output-length percentile's latency
  int32_t max_step_tokens = 512;    // prompt rows of one prefill step
  int32_t max_encode_batch = 256;   // the largest B_E tried
  int32_t max_context = 0;          // KV positions per slot; 0: max input + max output
  StagePlacementOptions placement;  // each stage's policy, compute tier and budgets
  int64_t stage_mem = -1;           // bytes per stage on its compute tier (< 0: no limit)
  // The allocation policies searched (RRA, WAA-C, WAA-M); empty: all three.
  std::vector<SchedulePolicy> policies;
  bool exhaustive = false;                  // enumerate every point instead of branch-and-bound
  std::vector<int32_t> micro_batches;       // RRA's micro-batch counts; empty: 1, 2, 4 (<= workers)
  std::optional<ReservationModel> packing;  // S3's packing of RRA's KV memory (simulator.h)
};

SimulatorInputs simulator_inputs(const ModelConfig& config, const ClusterProfile& profile,
                                 const SchedulePlanOptions& options);
ScheduleSearchOptions search_options(const Simulator& sim, const SchedulePlanOptions& options);

// The bounds the paper evaluates at (§7.1): the baseline's latencies over its configurations,
// at the bottom 10%, 30% and 70%, and infinity.
std::vector<double> paper_bounds(const Simulator& sim, const ScheduleSearchOptions& search);

}  // namespace strata
