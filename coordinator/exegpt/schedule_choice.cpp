#include "coordinator/exegpt/schedule_choice.h"

#include <algorithm>
#include <cmath>

#include "kernels/error.h"

namespace strata {

SimulatorInputs simulator_inputs(const ModelConfig& config, const ClusterProfile& profile,
                                 const SchedulePlanOptions& o) {
  SimulatorInputs in;
  in.profile = profile;
  in.shape = config.shape();
  in.workload = o.workload;
  in.percentile = o.percentile;
  in.max_step_tokens = o.max_step_tokens;
  in.kv_capacity = o.max_context;
  in.policy = o.placement.policy;
  in.device_compute = o.placement.device_compute;
  in.model_spec = o.model_spec;
  in.packing = o.packing;
  // As the cluster planner sets them: unset tiers take stage_mem on the compute tier.
  in.budgets = o.placement.budgets;
  in.budgets.whole_stage = true;
  int64_t& compute = in.device_compute ? in.budgets.gpu : in.budgets.cpu;
  if (compute < 0) compute = o.stage_mem;
  const int32_t context = o.workload.input.max() + o.workload.output.max();
  if (o.max_context > 0 && o.max_context < context)
    fail_input(
        "workload {} needs {} positions (longest input {} + longest output {}) but the run's "
        "context is {}: raise --max-context or shrink the workload (--length-scale)",
        o.workload.name, context, o.workload.input.max(), o.workload.output.max(), o.max_context);
  if (context > config.max_positions)
    fail_input("workload {} needs {} positions but {} has {}: shrink it with --length-scale",
               o.workload.name, context, config.source, config.max_positions);
  return in;
}

ScheduleSearchOptions search_options(const Simulator& sim, const SchedulePlanOptions& o) {
  ScheduleSearchOptions s = ScheduleSearchOptions::defaults(sim, o.max_encode_batch);
  s.latency_bound = o.latency_bound;
  s.exhaustive = o.exhaustive;
  if (!o.micro_batches.empty()) s.micro_batches = o.micro_batches;
  if (!o.policies.empty()) s.policies = o.policies;
  return s;
}

std::vector<double> paper_bounds(const Simulator& sim, const ScheduleSearchOptions& search) {
  std::vector<Prediction> all;
  search_baseline(sim, std::numeric_limits<double>::infinity(), search.encode_batches,
                  search.micro_batches, &all);
  std::vector<double> lat;
  for (const Prediction& p : all) lat.push_back(p.p99_latency_s);
  std::sort(lat.begin(), lat.end());
  std::vector<double> out;
  if (lat.empty()) return {std::numeric_limits<double>::infinity()};
  for (double q : {0.1, 0.3, 0.7})
    out.push_back(lat[static_cast<size_t>(std::floor(q * static_cast<double>(lat.size() - 1)))]);
  out.push_back(std::numeric_limits<double>::infinity());
  return out;
}

}  // namespace strata
