#include "coordinator/exegpt/replanning.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>

#include "coordinator/exegpt/profiler.h"
#include "kernels/error.h"
#include "kernels/log.h"

namespace strata {

namespace {

double p99(std::vector<double> v) {
  if (v.empty()) return 0;
  const auto k = static_cast<size_t>(std::ceil(0.99 * static_cast<double>(v.size()))) - 1;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
  return v[k];
}

// The latencies of the requests admitted in [from, to] with outputs up to `longest`; all
// requests up to `longest` when none was admitted there.
std::vector<double> pick(const std::vector<ScheduleReport::Sample>& samples, double from, double to,
                         int32_t longest) {
  std::vector<double> v;
  for (const auto& s : samples)
    if (s.admitted_at >= from && s.admitted_at <= to && s.output <= longest) v.push_back(s.latency);
  if (v.empty())
    for (const auto& s : samples)
      if (s.output <= longest) v.push_back(s.latency);
  return v;
}

}  // namespace

double ScheduleReport::measured_p99_latency() const {
  return p99(pick(latencies, steady_from_s, steady_to_s, planned.p99_output));
}

double ScheduleReport::measured_p99_all_latency() const {
  return p99(pick(latencies, steady_from_s, steady_to_s, std::numeric_limits<int32_t>::max()));
}

std::string ScheduleReport::json(double achieved_tok_s) const {
  nlohmann::json j = planned.to_json();
  j["profile"] = profile;
  j["replans"] = replans;
  j["achieved_throughput_tok_s"] = achieved_tok_s;
  j["measured_p99_latency_s"] = measured_p99_latency();
  j["measured_p99_all_latency_s"] = measured_p99_all_latency();
  j["measured_requests"] = latencies.size();
  return j.dump();
}

std::string ScheduleReport::line(double achieved_tok_s) const {
  return fmt::format(
      "schedule {}: predicted {:.1f} tok/s, p99 latency {:.3f} s; measured {:.1f} tok/s "
      "({:+.0f}%), p99 latency {:.3f} s ({:+.0f}%; {:.3f} s over every length) over {} "
      "requests; {} re-plans; layers {}",
      planned.vars.str(), planned.throughput_tok_s, planned.p99_latency_s, achieved_tok_s,
      planned.throughput_tok_s > 0 ? 100 * (achieved_tok_s / planned.throughput_tok_s - 1) : 0.0,
      measured_p99_latency(),
      planned.p99_latency_s > 0 ? 100 * (measured_p99_latency() / planned.p99_latency_s - 1) : 0.0,
      measured_p99_all_latency(), latencies.size(), replans, planned.allocation.str());
}

RunSchedule::RunSchedule(const ScheduleTarget& target, const ModelConfig& config,
                         SchedulePlanOptions options)
    : target_(target), config_(config), options_(std::move(options)) {
  options_.workload = target.workload;
  options_.latency_bound = target.latency_bound;
  options_.policies = target.policies;
  options_.packing = target.packing;
  planned_workload_ = target.workload;
}

const Prediction& RunSchedule::plan(Stages& stages, const ClusterPlan& started) {
  auto log = log::get("coordinator");
  const ProfileKey key =
      profile_key(options_.model_spec, config_.dtype, options_.placement.policy, target_.hosts);
  const ProfileGrid grid =
      ProfileGrid::for_limits(started.max_batch_rows, started.kv_slots, started.kv_capacity);
  const ClusterProfile profile =
      load_or_measure_profile(stages, started, key, grid, target_.profile_path);
  SimulatorInputs in = simulator_inputs(config_, profile, options_);
  in.max_kv_slots = started.kv_slots;
  simulator_ = std::make_unique<Simulator>(in);
  const ScheduleChoice choice = search_schedule(*simulator_, search_options(*simulator_, options_));
  if (choice.fits_nowhere())
    fail_input(
        "workload {} on these {} stages: {}; raise --stage-mem, lower --max-context, or "
        "add stages",
        target_.workload.name, stages.count(), choice.why_none());
  if (!choice.feasible)
    fail_input(
        "--latency-bound {:.3f} s cannot be met for workload {} on these {} stages: the fastest "
        "achievable p{:.0f} latency is {:.3f} s ({} output tokens); raise the bound, add "
        "stages, or shorten the outputs",
        target_.latency_bound, target_.workload.name, stages.count(), 100 * options_.percentile,
        choice.fastest_latency_s, target_.workload.output.percentile(options_.percentile));
  report_.planned = choice.best;
  report_.profile = profile.source;
  // The stages get exactly the chosen KV slots: a re-plan cannot ask for more.
  in.max_kv_slots = choice.best.kv_slots;
  simulator_ = std::make_unique<Simulator>(in);
  log->info("chose {} ({} points evaluated of {}; the FT-style baseline {})", choice.best.str(),
            choice.points_evaluated, choice.grid_points,
            choice.baseline ? choice.baseline->str() : std::string("meets no bound"));
  return report_.planned;
}

std::optional<Prediction> RunSchedule::observe(int32_t input, int32_t output, double latency_s,
                                               double admitted_at_s) {
  if (latency_s >= 0) report_.latencies.push_back({admitted_at_s, latency_s, output});
  observed_.add(input, output);
  const int64_t min_samples = target_.replan_min_samples > 0
                                  ? target_.replan_min_samples
                                  : std::max<int64_t>(64, 4 * int64_t{report_.planned.kv_slots});
  if (simulator_ == nullptr ||
      !observed_.drifted(planned_workload_, min_samples, target_.replan_tolerance))
    return std::nullopt;
  TaskWorkload seen = observed_.workload("observed");
  auto log = log::get("coordinator");
  SimulatorInputs in = simulator_->inputs();
  in.workload = seen;
  in.kv_capacity = simulator_->kv_capacity();  // the cache the stages hold
  std::unique_ptr<Simulator> sim;
  try {
    sim = std::make_unique<Simulator>(in);
  } catch (const InputError& e) {
    log->warn("observed lengths ({}) cannot be planned: {}", seen.str(), e.what());
    return std::nullopt;
  }
  SchedulePlanOptions o = options_;
  o.workload = seen;
  ScheduleSearchOptions s = search_options(*sim, o);
  // The same layers: RRA re-plans on them; WAA allocates its own, so a WAA re-plan that
  // would move layers is not taken (that needs a new run).
  const bool waa = report_.planned.vars.policy != SchedulePolicy::kRra;
  if (!waa) {
    s.micro_batches = {report_.planned.vars.micro_batches};
    s.fixed_allocation = report_.planned.allocation;
  }
  s.policies = {report_.planned.vars.policy};
  const ScheduleChoice choice = search_schedule(*sim, s);
  planned_workload_ = seen;
  if (!choice.feasible) {
    log->warn("the observed lengths ({}) put the bound out of reach ({}); keeping {}", seen.str(),
              choice.why_none(), report_.planned.vars.str());
    return std::nullopt;
  }
  if (waa && choice.best.allocation != report_.planned.allocation) {
    log->warn("the observed lengths ({}) want WAA on other layers ({}); keeping {}", seen.str(),
              choice.best.allocation.str(), report_.planned.vars.str());
    return std::nullopt;
  }
  ++report_.replans;
  log->info("lengths drifted to {}: re-planned {} -> {}", seen.str(), report_.planned.vars.str(),
            choice.best.str());
  report_.planned = choice.best;
  simulator_ = std::move(sim);
  return report_.planned;
}

}  // namespace strata
