// strata plan --workload ... --latency-bound ...: ExeGPT's scheduler (docs/SCHEDULING.md).
// The workers' layer profile (measured by `strata profile-layers`, or modelled for N
// workers of this machine's kind or of a node description), a workload and a bound go in;
// the chosen schedule comes out as the paper's tables show one -- policy, control
// variables, predicted p99 latency and throughput, the layers of each rank -- with the
// FT-style baseline beside it.
#include "launch/plan_schedule.h"

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <optional>

#include "coordinator/exegpt/schedule_choice.h"
#include "kernels/error.h"
#include "kernels/limits.h"
#include "launch/commands.h"
#include "launch/progress.h"
#include "worker/dummy.h"

namespace strata::cli {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// A host worker like this machine: its GEMM FLOP/s and read bandwidth measured now.
NodeModel this_machine() {
  const MachineLimits l = measure_machine_limits(0);
  return NodeModel::host_worker("this machine", l.gemm_gflops * 1e9, l.memory_read_gbs * 1e9);
}

std::string seconds(double s) {
  return std::isfinite(s) ? fmt::format("{:.3f} s", s) : std::string("inf");
}

std::string schedule_table(const ScheduleChoice& c, const SchedulePlanOptions& o) {
  std::string out = fmt::format("latency bound {} on the p{:.0f}-length output ({} tokens)\n",
                                seconds(c.latency_bound), 100 * o.percentile,
                                o.workload.output.percentile(o.percentile));
  out += fmt::format("{:<6} {:<34} {:>12} {:>14}  {}\n", "policy", "control variables",
                     "p99 latency", "throughput", "layers per rank");
  auto row = [&](const Prediction& p, const char* mark) {
    out += fmt::format("{:<6} {:<34} {:>12} {:>10.1f} tok/s  {}{}\n", policy_name(p.vars.policy),
                       p.vars.str().substr(p.vars.str().find(' ') + 1), seconds(p.p99_latency_s),
                       p.throughput_tok_s, p.allocation.str(), mark);
  };
  for (const Prediction& p : c.per_search)
    row(p, c.feasible && p.vars.str() == c.best.vars.str() ? "   <- chosen" : "");
  if (c.baseline) row(*c.baseline, "   (baseline)");
  if (!c.feasible)
    out += fmt::format("no schedule meets the bound: {}\n", c.why_none());
  else if (c.baseline)
    out += fmt::format("speed-up over the baseline: {:.2f}x\n",
                       c.best.throughput_tok_s / c.baseline->throughput_tok_s);
  else
    out += "the baseline meets no configuration within the bound\n";
  out += fmt::format("points evaluated: {} of {} in the grids (the baseline: {})",
                     c.points_evaluated, c.grid_points, c.baseline_points);
  return out;
}

// The packing model --kv-reserve and --predict-eval ask for; nullopt: plan without.
std::optional<ReservationModel> packing_model(const ScheduleCliOptions& o) {
  KvPackingOptions p;  // as serve's, the budget the search's to size
  p.reserve = parse_kv_reserve(o.kv_reserve);
  p.admission = parse_kv_admission(o.kv_admission);
  p.confidence = o.confidence;
  p.budget_from_schedule = true;
  p.validate();
  std::optional<ReservationModel> m = reservation_model(p, o.predict_eval);
  if (!m && p.admission != KvAdmission::kReserved)
    fail_input("--kv-admission {} plans packing: give --kv-reserve max-new or predicted",
               o.kv_admission);
  return m;
}

// What packing changed: the chosen schedules' decode batches, memory and throughput.
std::string packing_line(const ScheduleChoice& whole, const ScheduleChoice& packed,
                         const ReservationModel& m, int32_t capacity) {
  if (!packed.feasible)
    return fmt::format("with {} packing: no schedule meets the bound: {}", m.str(),
                       packed.why_none());
  const Prediction& b = packed.best;
  std::string out = fmt::format("with {} packing: {} ", m.str(), b.str());
  if (b.kv_positions > 0 && b.vars.policy == SchedulePolicy::kRra) {
    std::string tp;
    if (!b.allocation.tp_degrees.empty())
      for (int32_t d : b.allocation.tp_degrees) tp += fmt::format("{}{}", tp.empty() ? "" : ",", d);
    out += fmt::format(
        "\n  run it: strata serve --micro-batches {} --decode-iters {} --max-batch {}{} "
        "--kv-budget {} --kv-reserve {}{}{}",
        b.vars.micro_batches, b.vars.decode_iters, b.kv_slots,
        tp.empty() ? "" : " --tensor-parallel " + tp, b.kv_positions, kv_reserve_name(m.reserve),
        m.reserve == KvReserve::kPredicted ? " --predictor MODEL_FILE" : "",
        m.admission == KvAdmission::kPooled
            ? fmt::format(" --kv-admission pooled --predict-confidence {}", m.confidence)
            : std::string());
  }
  if (!whole.feasible) return out + "\n  (without packing no schedule meets the bound)";
  const Prediction& a = whole.best;
  return out + fmt::format(
                   "\n  decode batch B_D {:.1f} -> {:.1f}; KV positions {} -> {}; {:.1f} -> "
                   "{:.1f} tok/s ({:.2f}x); {:.1f}% of sequences outgrow their first reservation",
                   a.decode_batch, b.decode_batch, int64_t{a.kv_slots} * capacity,
                   b.kv_positions > 0 ? b.kv_positions : int64_t{b.kv_slots} * capacity,
                   a.throughput_tok_s, b.throughput_tok_s, b.throughput_tok_s / a.throughput_tok_s,
                   100 * b.reservations_exceeded);
}

// The search's options from plan's; the profile's compute tier and memory come with it.
SchedulePlanOptions schedule_plan_options(const ScheduleCliInputs& in,
                                          const ScheduleCliOptions& o) {
  SchedulePlanOptions po;
  po.model_spec = in.model;
  po.workload = TaskWorkload::parse(o.workload).scaled(o.length_scale);
  po.latency_bound = parse_latency_bound(o.latency_bound);
  po.max_step_tokens = in.max_step_tokens;
  po.max_encode_batch = o.max_encode_batch();
  po.exhaustive = o.exhaustive;
  if (o.rra_only) po.policies = {SchedulePolicy::kRra};
  if (!in.policy.empty()) po.placement.policy = Policy::parse(in.policy);
  return po;
}

// The workers planned for: --profile's, or --nodes modelled workers of a node (--hardware,
// or this machine), whose compute tier, memory and policy (by default everything on the
// compute tier) the search's options take.
struct PlannedCluster {
  ClusterProfile profile;
  NodeModel node;  // the modelled workers' (profile.modelled)
};

PlannedCluster planned_cluster(const ScheduleCliInputs& in, const ScheduleCliOptions& o,
                               const ModelConfig& config, SchedulePlanOptions& po) {
  PlannedCluster c;
  if (!o.profile.empty()) {
    c.profile = ClusterProfile::load(o.profile);
    po.placement.device_compute = !in.host_compute;
  } else {
    c.node = in.hardware.empty() ? this_machine() : NodeModel::parse(in.hardware);
    po.placement.device_compute = c.node.device && !in.host_compute;
    if (!po.placement.policy) po.placement.policy = Policy::parse("w=100/0/0,c=100/0/0");
    const int32_t context = po.workload.input.max() + po.workload.output.max();
    c.profile = modelled_profile(
        config.shape(), in.model, c.node, o.nodes,
        ProfileGrid::for_limits(po.max_step_tokens, o.max_encode_batch() * 8, context));
    po.stage_mem = static_cast<int64_t>(c.node.memory_bytes);
  }
  if (!o.stage_mem.empty()) po.stage_mem = parse_size(o.stage_mem, "--stage-mem");
  return c;
}

// The simulator of the plan with S3's packing, beside the one without; nullopt: no packing.
std::optional<Simulator> packed_simulator(const ModelConfig& config, const ClusterProfile& profile,
                                          const SchedulePlanOptions& po,
                                          const std::optional<ReservationModel>& packing,
                                          const std::string& kv_reserve) {
  if (!packing) return std::nullopt;
  if (po.placement.device_compute)
    fail_input(
        "--kv-reserve {}: packing plans host-compute workers (--host-compute); a device "
        "allocates its KV cache slot by slot",
        kv_reserve);
  SchedulePlanOptions packed = po;
  packed.packing = packing;
  return Simulator(simulator_inputs(config, profile, packed));
}

// One bound's choices: without packing, and with it when planned.
struct BoundPlan {
  ScheduleChoice whole;
  std::optional<ScheduleChoice> packed;
  const ScheduleChoice& last() const { return packed ? *packed : whole; }
};

BoundPlan plan_at_bound(const Simulator& sim, const std::optional<Simulator>& packed_sim,
                        const SchedulePlanOptions& po) {
  BoundPlan b{search_schedule(sim, search_options(sim, po)), std::nullopt};
  if (packed_sim) b.packed = search_schedule(*packed_sim, search_options(*packed_sim, po));
  return b;
}

nlohmann::json bound_json(const BoundPlan& b, const Simulator& sim,
                          const std::optional<Simulator>& packed_sim, const std::string& model,
                          const ClusterProfile& profile, const TaskWorkload& workload) {
  nlohmann::json j = b.whole.to_json();
  if (b.packed) {
    const ReservationModel& m = *packed_sim->inputs().packing;
    j["packing"] = {{"reserve", kv_reserve_name(m.reserve)},
                    {"admission", kv_admission_name(m.admission)},
                    {"confidence", m.confidence},
                    {"model", m.str()},
                    {"kv_capacity", sim.kv_capacity()},
                    {"choice", b.packed->to_json()}};
  }
  j["model"] = model;
  j["workers"] = profile.workers();
  j["workload"] = workload.to_json();
  j["profile"] = profile.source;
  return j;
}

std::string bound_text(const BoundPlan& b, const Simulator& sim,
                       const std::optional<Simulator>& packed_sim, const SchedulePlanOptions& po) {
  std::string text = schedule_table(b.whole, po);
  if (b.packed)
    text +=
        "\n" + packing_line(b.whole, *b.packed, *packed_sim->inputs().packing, sim.kv_capacity());
  return text;
}

}  // namespace

double parse_latency_bound(const std::string& text) {
  if (text == "inf" || text == "infinity" || text == "none") return kInf;
  try {
    size_t used = 0;
    const double v = std::stod(text, &used);
    if (used == text.size() && v > 0 && std::isfinite(v)) return v;
  } catch (const std::exception&) {
  }
  fail_input("--latency-bound {}: need seconds (> 0) or inf", text);
}

void add_schedule_options(CLI::App* cmd, ScheduleCliOptions& o) {
  cmd->add_option("--workload", o.workload,
                  "ExeGPT mode: a task of the paper's Table 3 (S, T, G, C1, C2) or a JSONL file of "
                  "requests (input / output lengths)");
  cmd->add_option("--length-scale", o.length_scale,
                  "Scale every length of the workload (a small model's context)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--latency-bound", o.latency_bound,
                  "Seconds for the p99-length output (inf: unbounded)");
  cmd->add_option_function<std::string>(
         "--nodes",
         [&o](const std::string& v) {
           const bool count =
               !v.empty() && v.size() <= 4 &&
               std::all_of(v.begin(), v.end(), [](char c) { return c >= '0' && c <= '9'; });
           if (!count) {
             o.node_file = v;
           } else if (const int n = std::stoi(v); n >= 1 && n <= 4096) {
             o.nodes = n;
           } else {
             throw CLI::ValidationError("--nodes", fmt::format("{} workers: 1 to 4096", v));
           }
         },
         "N: workers to model (with --hardware, or this machine's kind); FILE: a node file "
         "(docs/CLUSTER.md), whose cluster plan serve starts with is printed")
      ->type_name("N|FILE");
  cmd->add_option("--profile", o.profile,
                  "A layer profile JSON (strata profile-layers) instead of a modelled cluster");
  cmd->add_option("--max-batch", o.max_batch,
                  "The largest encode batch B_E to try (default 256); with --nodes FILE serve's "
                  "KV slots (default 32)")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--stage-mem", o.stage_mem,
                  "Memory per worker on its compute tier, e.g. 16GiB or 800MiB (a bare number "
                  "is GiB; default: the node's)");
  cmd->add_flag("--exhaustive", o.exhaustive, "Evaluate every grid point (to compare)");
  cmd->add_flag("--rra-only", o.rra_only, "Only RRA schedules (one pipeline running both phases)");
  cmd->add_option("--kv-reserve", o.kv_reserve,
                  "Also plan with S3's KV packing: max-new (the true lengths, the oracle) or "
                  "predicted (--predict-eval); context: no packing");
  cmd->add_option("--predict-eval", o.predict_eval,
                  "The predictor's evaluation (strata predict eval --json) for --kv-reserve "
                  "predicted");
  cmd->add_option("--kv-admission", o.kv_admission,
                  "How the run fits them (as serve's): reserved (S3) or pooled (the summed "
                  "positions' quantile at --predict-confidence)")
      ->check(CLI::IsMember({"reserved", "pooled"}));
  cmd->add_option("--predict-confidence", o.confidence,
                  "The confidence the run packs at (as serve's)")
      ->capture_default_str();
  cmd->add_flag(
      "--paper-bounds", o.paper_bounds,
      "Plan at the paper's four bounds: the baseline's bottom 10/30/70% latencies and inf");
}

int run_schedule_plan(const ScheduleCliInputs& in, const ScheduleCliOptions& o) {
  const std::optional<ReservationModel> packing = packing_model(o);  // refused before any work
  ModelConfig config = load_spec_config(in.model, in.dtype);
  config.dtype = in.dtype;
  SchedulePlanOptions po = schedule_plan_options(in, o);
  const PlannedCluster cluster = planned_cluster(in, o, config, po);
  const Simulator sim(simulator_inputs(config, cluster.profile, po));
  const std::optional<Simulator> packed_sim =
      packed_simulator(config, cluster.profile, po, packing, o.kv_reserve);
  std::vector<double> bounds{po.latency_bound};
  if (o.paper_bounds) bounds = paper_bounds(sim, search_options(sim, po));
  nlohmann::json runs = nlohmann::json::array();
  std::string text = fmt::format(
      "{}\n{}\nworkload {}\n", config.shape().str(),
      cluster.profile.modelled ? cluster.node.str() : cluster.profile.str(), po.workload.str());
  std::optional<ScheduleChoice> refused;
  Progress progress("schedule searches", bounds.size());
  for (double bound : bounds) {
    progress.update(static_cast<size_t>(runs.size()));
    po.latency_bound = bound;
    const BoundPlan b = plan_at_bound(sim, packed_sim, po);
    if (!b.last().feasible && !refused) refused = b.last();
    runs.push_back(bound_json(b, sim, packed_sim, in.model, cluster.profile, po.workload));
    text += "\n" + bound_text(b, sim, packed_sim, po) + "\n";
  }
  progress.finish(bounds.size());
  if (in.format == "json") {
    std::printf("%s\n", (o.paper_bounds ? runs : runs.front()).dump(2).c_str());
  } else {
    std::printf("%s", text.c_str());
  }
  if (!refused) return 0;
  std::fprintf(stderr,
               "strata: --latency-bound %s cannot be met for workload %s on %d workers: %s\n",
               seconds(refused->latency_bound).c_str(), po.workload.name.c_str(),
               cluster.profile.workers(), refused->why_none().c_str());
  return 1;
}

}  // namespace strata::cli
