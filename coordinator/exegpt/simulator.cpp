#include "coordinator/exegpt/simulator.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <queue>
#include <span>

#include "coordinator/exegpt/allocator.h"
#include "kernels/error.h"

namespace strata {
namespace {

using json = nlohmann::json;

constexpr double kF32 = 4;

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// The mean length weighted by length: a prompt's rows come from long prompts more often, and
// each row's attention reads its own prefix.
double row_weighted_length(const LengthDistribution& d) {
  double sum = 0, sq = 0;
  for (int32_t s = 1; s <= d.max(); ++s) {
    sum += d.p(s) * s;
    sq += d.p(s) * s * s;
  }
  return sum > 0 ? sq / sum : 1.0;
}

// The standard normal's quantile: bisection on its distribution function.
double normal_quantile(double q) {
  double lo = -10, hi = 10;
  for (int i = 0; i < 100; ++i) {
    const double mid = (lo + hi) / 2;
    (normal_cdf(mid) < q ? lo : hi) = mid;
  }
  return (lo + hi) / 2;
}

// The prompt rows of a prefill phase of `a` sequences at quantile q of their sum (a normal, by
// the central limit theorem, no more than a times the longest prompt). The latency bound is
// for the worst case of a p99-length sequence: ExeGPT considers the encoder's variance too
// (section 7.6, Table 7), and with a small B_E or widely spread prompts a phase of long
// prompts costs a p99 sequence more than its whole decode.
double phase_rows_at(const LengthDistribution& input, double a, double q) {
  const double mean = a * input.mean();
  return std::min(mean + normal_quantile(q) * std::sqrt(a) * input.stddev(), a * input.max());
}

}  // namespace

const char* policy_name(SchedulePolicy p) {
  switch (p) {
    case SchedulePolicy::kRra:
      return "RRA";
    case SchedulePolicy::kWaaC:
      return "WAA-C";
    case SchedulePolicy::kWaaM:
      return "WAA-M";
    case SchedulePolicy::kBaseline:
      return "FT";
  }
  return "?";
}

std::vector<int32_t> ScheduleVars::stage_degrees(int32_t workers) const {
  const int32_t d = std::max(tp_degree, 1), g = tp_groups;
  STRATA_CHECK(g >= 0 && g * d <= workers, "{} tensor-parallel groups of {} over {} workers", g, d,
               workers);
  std::vector<int32_t> out(static_cast<size_t>(g), d);
  out.resize(static_cast<size_t>(workers - g * (d - 1)), 1);
  return out;
}

std::string ScheduleVars::str() const {
  const std::string tp =
      tp_groups > 0 ? fmt::format(" TP={}x{}", tp_groups, tp_degree) : std::string();
  switch (policy) {
    case SchedulePolicy::kRra:
      return fmt::format("RRA B_E={} N_D={} micro-batches={}{}", encode_batch, decode_iters,
                         micro_batches, tp);
    case SchedulePolicy::kWaaC:
    case SchedulePolicy::kWaaM:
      return fmt::format("{} B_E={} B_m={}", policy_name(policy), encode_batch, micro_batches);
    case SchedulePolicy::kBaseline:
      return fmt::format("FT batch={} micro-batches={}{}", encode_batch, micro_batches, tp);
  }
  return "?";
}

json ScheduleVars::to_json() const {
  json j{{"policy", policy_name(policy)},
         {"encode_batch", encode_batch},
         {"micro_batches", micro_batches},
         {"tp_degree", tp_degree},
         {"tp_groups", tp_groups}};
  if (policy == SchedulePolicy::kRra) j["decode_iters"] = decode_iters;
  return j;
}

// ---- §6's formulas -------------------------------------------------------------------

double pd_given_s(int32_t u, int32_t s, int32_t n_d) {
  STRATA_CHECK(n_d >= 1, "N_D {}", n_d);
  if (s <= 0 || u < 1 || u > n_d) return 0;
  if (s <= n_d) return u == s ? 1.0 : 0.0;
  if (u != 1 + (s - 1) % n_d) return 0;
  return 1.0 / static_cast<double>(ceil_div(s, n_d));
}

std::vector<double> pd_u(const LengthDistribution& d, int32_t n_d) {
  STRATA_CHECK(n_d >= 1, "N_D {}", n_d);
  std::vector<double> out(static_cast<size_t>(n_d) + 1, 0.0);
  for (int32_t s = 1; s <= d.max(); ++s) {
    if (d.p(s) == 0) continue;
    const int32_t u = s <= n_d ? s : 1 + (s - 1) % n_d;
    out[static_cast<size_t>(u)] += pd_given_s(u, s, n_d) * d.p(s);
  }
  return out;
}

double rra_decode_batch(double encode_batch, const std::vector<double>& pd) {
  double sum = 0;
  for (double p : pd) sum += p;
  STRATA_CHECK(sum > 0, "P_D(U) sums to {}", sum);
  return encode_batch / sum;
}

LengthDistribution decode_iterations(const LengthDistribution& output) {
  std::vector<double> w(static_cast<size_t>(std::max(output.max(), 1)), 0.0);
  for (int32_t s = 1; s <= output.max(); ++s) w[static_cast<size_t>(s - 1)] = output.p(s);
  return LengthDistribution::from_weights(std::move(w), "decode iterations");
}

LengthDistribution in_batch(const LengthDistribution& d, int32_t n_d) {
  std::vector<double> w(static_cast<size_t>(d.max()) + 1, 0.0);
  for (int32_t s = 1; s <= d.max(); ++s)
    w[static_cast<size_t>(s)] = d.p(s) * static_cast<double>(ceil_div(s, n_d));
  return LengthDistribution::from_weights(std::move(w), "decode lengths in the batch");
}

WaaSplit waa_split(int32_t workers, double encode, double decode) {
  if (workers < 2)
    fail_input("WAA needs at least two workers (one encodes, one decodes), got {}", workers);
  STRATA_CHECK(encode > 0 && decode > 0, "WAA split of {} and {}", encode, decode);
  const double fe = workers * encode / (encode + decode);
  const double fd = workers * decode / (encode + decode);
  WaaSplit w{static_cast<int32_t>(std::floor(fe)), static_cast<int32_t>(std::floor(fd))};
  if (w.encoders + w.decoders < workers) {
    if (fe - w.encoders >= fd - w.decoders) {
      ++w.encoders;
    } else {
      ++w.decoders;
    }
  }
  if (w.encoders == 0) ++w.encoders, --w.decoders;
  if (w.decoders == 0) ++w.decoders, --w.encoders;
  return w;
}

// ---- printing ---------------------------------------------------------------------------

std::string Allocation::str() const {
  std::string out;
  int32_t begin = 0;
  for (size_t s = 0; s < layers.size(); ++s) {
    if (encoder_stages > 0 && static_cast<int32_t>(s) == encoder_stages) {
      out += "| decode ";
      begin = 0;
    } else if (encoder_stages > 0 && s == 0) {
      out += "encode ";
    }
    out += fmt::format("[{}, {}){} ", begin, begin + layers[s],
                       degree(s) > 1 ? fmt::format("x{}", degree(s)) : std::string());
    begin += layers[s];
  }
  if (!out.empty()) out.pop_back();
  return out;
}

json Prediction::to_json() const {
  json stages_j = json::array();
  for (const StageEstimate& s : stages)
    stages_j.push_back({{"rank", s.rank},
                        {"layers", {s.layer_begin, s.layer_end}},
                        {"role", s.encoder && s.decoder ? "both"
                                 : s.encoder            ? "encode"
                                                        : "decode"},
                        {"busy_seconds_per_cycle", s.busy_seconds_per_cycle},
                        {"gpu_bytes", s.memory.gpu},
                        {"cpu_bytes", s.memory.cpu},
                        {"disk_bytes", s.memory.disk}});
  json j{{"control_variables", vars.to_json()},
         {"policy", policy_name(vars.policy)},
         {"feasible", feasible},
         {"predicted_throughput_tok_s", throughput_tok_s},
         {"predicted_p99_latency_s", p99_latency_s},
         {"p99_output_tokens", p99_output},
         {"decode_batch", decode_batch},
         {"kv_slots", kv_slots},
         {"kv_positions", kv_positions},
         {"reservations_exceeded", reservations_exceeded},
         {"kv_packing", kv_packing},
         {"allocation", allocation.layers},
         {"allocation_text", allocation.str()},
         {"stages", stages_j},
         {"outside_profile", outside_profile}};
  if (!infeasible_reason.empty()) j["infeasible_reason"] = infeasible_reason;
  return j;
}

std::string Prediction::str() const {
  if (!feasible) return fmt::format("{}: does not fit: {}", vars.str(), infeasible_reason);
  const std::string packed = kv_positions > 0
                                 ? fmt::format(" packed in {} positions ({:.1f}% outgrow)",
                                               kv_positions, 100 * reservations_exceeded)
                                 : std::string();
  return fmt::format(
      "{}: {:.1f} tok/s, p99 latency {:.3f} s ({} tokens), decode batch {:.1f}, {} KV slots{}, "
      "layers {}{}",
      vars.str(), throughput_tok_s, p99_latency_s, p99_output, decode_batch, kv_slots, packed,
      allocation.str(), outside_profile ? " (extrapolated beyond the profile)" : "");
}

// ---- the simulator -----------------------------------------------------------------------

// One micro-batch's steady cycle: its steps in order (the encode phase's prefill steps,
// then the decode iterations), the tokens it generates, and what it holds.
struct Simulator::Phases {
  struct Step {
    bool prefill = false;
    double rows = 0;     // rows of the step when it runs
    double length = 0;   // prefill: sequence length at its end; decode: context
    double samples = 0;  // rows that sample (the head's rows)
    // The chance the step runs at all: a phase ends early once every sequence in it has
    // finished (the scheduler starts the next phase), so a late iteration of a small batch
    // often never happens. Its expected time is chance x its time at `rows`.
    double chance = 1;
    // Its rows when a given sequence is known to be in the batch (the p99 sequence whose
    // latency is measured: its phases run every iteration up to its last; its prefill phase
    // at the same percentile of prompt rows, phase_rows_at).
    double rows_with_one = 0;
  };
  std::vector<Step> steps;
  int32_t micro_batches = 1;
  int32_t prefill_steps = 0;    // the first steps of a cycle
  int32_t decode_steps = 0;     // N_D (RRA), the longest output's iterations (baseline)
  double tokens_per_cycle = 0;  // generated per micro-batch per cycle
  double decode_batch = 0;      // over all micro-batches
  int32_t kv_slots = 0;
  int64_t kv_positions = 0;          // packed (0: whole slots)
  int32_t latency_decode_steps = 0;  // the p99 sequence's decode iterations after its prefill
  int32_t p99_output = 0;
};

Simulator::Simulator(SimulatorInputs inputs) : in_(std::move(inputs)) {
  if (in_.profile.ranks.empty()) fail_input("the layer profile has no ranks");
  if (in_.workload.input.empty() || in_.workload.output.empty())
    fail_input("workload {} has no lengths", in_.workload.name);
  if (in_.max_step_tokens <= 0)
    fail_input("--max-step-tokens must be positive, got {}", in_.max_step_tokens);
  capacity_ =
      in_.kv_capacity > 0 ? in_.kv_capacity : in_.workload.input.max() + in_.workload.output.max();
  if (in_.shape.n_layers < workers())
    fail_input("{} layers cannot be split over {} workers", in_.shape.n_layers, workers());
  if (in_.packing && in_.packing->reserve != KvReserve::kContext) {
    if (in_.device_compute)
      fail_input(
          "KV packing ({}) plans host-compute stages only: a device allocates its cache "
          "slot by slot",
          in_.packing->str());
    std::vector<double> exceeded;
    held_ = held_positions(*in_.packing, in_.workload.input.mean(), in_.workload.output, capacity_,
                           &exceeded);
    for (size_t d = 0; d < exceeded.size(); ++d)
      exceeded_ += in_.workload.output.p(static_cast<int32_t>(d) + 1) * exceeded[d];
  }
}

// What one micro-batch's share of the KV budget must hold: n0 decode-batch members whose
// decode iterations are d's held in the batch, and `prefill_only` sequences ending at their
// prefill. Reserved admission (S3): each member holds its reservation, the prefill-only ones
// the first. Pooled: the most the run's admission expects them to fill at its confidence.
double Simulator::packed_positions(const LengthDistribution& d, int32_t decode_iters, double n0,
                                   double prefill_only) const {
  const bool decoding = d.p(0) < 1;
  const LengthDistribution held = decoding ? in_batch(d, decode_iters) : LengthDistribution{};
  const ReservationModel& m = *in_.packing;
  if (m.admission == KvAdmission::kPooled) {
    const UsageProfile u = pooled_usage(m.reserve, in_.workload.input.mean(), in_.workload.output,
                                        held, n0, prefill_only, capacity_);
    return u.need(pooled_margin(m.confidence));
  }
  double member = 0;
  for (int32_t D = 1; decoding && D <= held.max(); ++D)
    member += held.p(D) * held_[static_cast<size_t>(D)];
  return n0 * member + prefill_only * held_[0];
}

Simulator::Phases Simulator::rra_phases(const ScheduleVars& v) const {
  if (v.encode_batch < 1 || v.decode_iters < 1 || v.micro_batches < 1)
    fail_input("RRA needs B_E, N_D and micro-batches >= 1 ({})", v.str());
  const TaskWorkload& w = in_.workload;
  Phases ph;
  ph.micro_batches = v.micro_batches;
  const double a = static_cast<double>(v.encode_batch) / v.micro_batches;  // admitted per phase
  const LengthDistribution d = decode_iterations(w.output);
  const double z = d.p(0);  // finish at the prefill
  double n0 = 0;            // the decode batch of one micro-batch at its phase start
  double position = 0;      // a batch member's mean decode position
  std::vector<double> pd(static_cast<size_t>(v.decode_iters) + 1, 0.0);
  if (z < 1) {
    const LengthDistribution held = in_batch(d, v.decode_iters);
    pd = pd_u(held, v.decode_iters);
    n0 = rra_decode_batch(a * (1 - z), pd);
    position = held.mean() / 2;
  }
  const double rows = a * w.input.mean();
  ph.prefill_steps = static_cast<int32_t>(std::max<int64_t>(
      1, static_cast<int64_t>(std::ceil(rows / static_cast<double>(in_.max_step_tokens)))));
  const double heavy = phase_rows_at(w.input, a, in_.percentile);  // the p99 sequence's phase
  for (int32_t i = 0; i < ph.prefill_steps; ++i)
    ph.steps.push_back({true, rows / ph.prefill_steps, row_weighted_length(w.input),
                        a / ph.prefill_steps, 1, heavy / ph.prefill_steps});
  // Decode iteration u: of the n0 sequences a phase starts with, each has finished before u
  // with probability done = sum_{u' < u} P_D(u'); the iteration runs unless all have.
  double done = 0, tokens = a;
  const double members = std::max(n0, 1.0);
  for (int32_t u = 1; u <= v.decode_iters; ++u) {
    const double left = n0 * (1 - done);
    const double chance = 1 - std::pow(std::min(done, 1.0), members);
    const double rows_if_run = chance > 1e-12 ? left / chance : 0.0;
    ph.steps.push_back({false, rows_if_run, w.input.mean() + position, rows_if_run, chance,
                        1 + std::max(n0 - 1, 0.0) * std::max(1 - done, 0.0)});
    tokens += left;
    done += pd[static_cast<size_t>(u)];
  }
  ph.decode_steps = v.decode_iters;
  ph.tokens_per_cycle = tokens;
  ph.decode_batch = n0 * v.micro_batches;
  ph.kv_slots = static_cast<int32_t>(std::ceil(v.micro_batches * (n0 + a * z) - 1e-9));
  ph.kv_slots = std::max(ph.kv_slots, v.micro_batches);
  if (!held_.empty()) {
    ph.kv_positions = static_cast<int64_t>(
        std::ceil(v.micro_batches * packed_positions(d, v.decode_iters, n0, a * z) - 1e-9));
    // The run gives each micro-batch an equal share of these positions and caps a sequence's
    // context at that share: below the context, a request the run admits would be cut short
    // by the plan. So a share holds at least one sequence of the whole context.
    ph.kv_positions = std::max<int64_t>(ph.kv_positions, int64_t{v.micro_batches} * capacity_);
  }
  ph.p99_output = w.output.percentile(in_.percentile);
  ph.latency_decode_steps = ph.p99_output - 1;
  return ph;
}

Simulator::Phases Simulator::baseline_phases(const ScheduleVars& v) const {
  if (v.encode_batch < v.micro_batches || v.micro_batches < 1)
    fail_input("the baseline needs a batch of at least one sequence per micro-batch ({})", v.str());
  const TaskWorkload& w = in_.workload;
  Phases ph;
  ph.micro_batches = v.micro_batches;
  const double a = static_cast<double>(v.encode_batch) / v.micro_batches;
  const double rows = a * w.input.mean();
  ph.prefill_steps = static_cast<int32_t>(std::max<int64_t>(
      1, static_cast<int64_t>(std::ceil(rows / static_cast<double>(in_.max_step_tokens)))));
  const double heavy = phase_rows_at(w.input, a, in_.percentile);
  for (int32_t i = 0; i < ph.prefill_steps; ++i)
    ph.steps.push_back({true, rows / ph.prefill_steps, row_weighted_length(w.input),
                        a / ph.prefill_steps, 1, heavy / ph.prefill_steps});
  // No early termination: the whole batch decodes to the longest output.
  const int32_t longest = w.output.max() - 1;
  for (int32_t u = 1; u <= longest; ++u)
    ph.steps.push_back({false, a, w.input.mean() + u, a, 1, a});
  ph.decode_steps = longest;
  ph.tokens_per_cycle = a * w.output.mean();  // the tokens anyone asked for
  ph.decode_batch = v.encode_batch;
  ph.kv_slots = v.encode_batch;
  ph.p99_output = w.output.max();  // the bound applies to the longest output
  ph.latency_decode_steps = longest;
  return ph;
}

Prediction Simulator::predict(const ScheduleVars& v) const {
  ++evaluations_;
  switch (v.policy) {
    case SchedulePolicy::kRra:
      return pipeline(v, rra_phases(v), nullptr);
    case SchedulePolicy::kBaseline:
      return pipeline(v, baseline_phases(v), nullptr);
    case SchedulePolicy::kWaaC:
    case SchedulePolicy::kWaaM:
      return waa(v);
  }
  return {};
}

Prediction Simulator::predict(const ScheduleVars& v, const Allocation& allocation) const {
  ++evaluations_;
  if (v.policy == SchedulePolicy::kRra) return pipeline(v, rra_phases(v), &allocation);
  if (v.policy == SchedulePolicy::kBaseline) return pipeline(v, baseline_phases(v), &allocation);
  fail_input("a fixed allocation is for RRA and the baseline; {} allocates its own", v.str());
}

namespace {

// One stage's time for a step of a phase: its layers, and the embedding or head it holds.
// A stage split over a tensor-parallel group of `degree` workers computes 1 / degree of each
// layer's heads and columns on each member (priced from each member's one-worker profile,
// the slowest setting the pace: every sum waits for it), then adds the partial sums twice a
// layer: each member sends its rows x hidden to the other degree - 1 and receives theirs,
// over the measured link. The embedding and head are not split (every member embeds; the
// leader, members[0], alone runs the head).
struct StepTimer {
  std::span<const RankProfile> members;
  int32_t layers;
  bool embedding, head;
  bool* outside;
  const LinkProfile* link = nullptr;
  double row_bytes = 0;

  double operator()(bool prefill, double rows, double length, double samples) const {
    const auto degree = static_cast<double>(members.size());
    double layer = 0, embed = 0;
    for (const RankProfile& r : members) {
      layer = std::max(layer, prefill ? r.prefill.at(rows, length, outside)
                                      : r.decode.at(rows, length, outside));
      if (embedding) embed = std::max(embed, r.embed.at(rows, outside));
    }
    if (members.size() > 1)
      layer = layer / degree + 2 * link->time((degree - 1) * rows * row_bytes);
    double t = layers * layer + embed;
    if (head) t += members[0].head.at(samples, outside);
    return t;
  }
};

// The first worker of each stage (the leader of a tensor-parallel group), by index.
std::vector<int32_t> stage_leaders(const std::vector<int32_t>& degrees) {
  std::vector<int32_t> out;
  int32_t w = 0;
  for (int32_t d : degrees) {
    out.push_back(w);
    w += d;
  }
  return out;
}

// The profiles of stage `s`'s workers, its leader first.
std::span<const RankProfile> group_profiles(const ClusterProfile& profile,
                                            const std::vector<int32_t>& leaders,
                                            const std::vector<int32_t>& degrees, int32_t s) {
  const auto si = static_cast<size_t>(s);
  return std::span<const RankProfile>(profile.ranks)
      .subspan(static_cast<size_t>(leaders[si]), static_cast<size_t>(degrees[si]));
}

// The bytes of one activation row crossing a link (f32 hidden states).
double activation_row_bytes(const ModelShape& shape) {
  return static_cast<double>(shape.hidden) * kF32;
}

std::vector<int32_t> degrees_of(const Allocation& a) {
  return a.tp_degrees.empty() ? std::vector<int32_t>(a.layers.size(), 1) : a.tp_degrees;
}

}  // namespace

StageRequest Simulator::stage_request(int32_t layers, bool embedding, bool head, int32_t kv_slots,
                                      int64_t kv_positions) const {
  StageRequest r;
  r.layer_begin = 0;
  r.layer_end = layers;
  r.embedding = embedding;
  r.head = head;
  r.device_compute = in_.device_compute;
  r.max_rows = std::max(in_.max_step_tokens, kv_slots);
  r.kv_slots = kv_slots;
  r.kv_capacity = capacity_;
  r.kv_positions = kv_positions;
  r.policy = in_.policy;
  r.budgets = in_.budgets;
  return r;
}

// The most layers each stage's memory holds (a tensor-parallel stage: its shard's).
std::vector<int32_t> Simulator::max_layers(int32_t kv_slots, int64_t kv_positions,
                                           const std::vector<int32_t>& degrees) const {
  std::vector<int32_t> out;
  const auto L = static_cast<int32_t>(in_.shape.n_layers);
  const auto stages = static_cast<int32_t>(degrees.size());
  for (int32_t s = 0; s < stages; ++s) {
    const ModelShape shape = in_.shape.tp_shard(degrees[static_cast<size_t>(s)]);
    auto fits = [&](int32_t n) {
      const StageRequest r = stage_request(n, s == 0, s == stages - 1, kv_slots, kv_positions);
      return shortfalls(place_stage(shape, r), in_.budgets).empty();
    };
    int32_t lo = 0, hi = L;  // lo fits (0 layers: nothing to hold), find the largest
    while (lo < hi) {
      const int32_t mid = (lo + hi + 1) / 2;
      if (fits(mid)) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    out.push_back(lo);
  }
  return out;
}

Allocation Simulator::balance(const Phases& ph, const std::vector<int32_t>& degrees) const {
  const auto S = static_cast<int32_t>(degrees.size());
  const std::vector<int32_t> room = max_layers(ph.kv_slots, ph.kv_positions, degrees);
  const std::vector<int32_t> leaders = stage_leaders(degrees);
  const double row_bytes = activation_row_bytes(in_.shape);
  std::vector<StageCost> costs;
  bool outside = false;
  for (int32_t s = 0; s < S; ++s) {
    const std::span<const RankProfile> members = group_profiles(in_.profile, leaders, degrees, s);
    const StepTimer layer{members, 1, false, false, &outside, &in_.profile.link, row_bytes};
    const StepTimer fixed{members, 0, s == 0, s == S - 1, &outside, &in_.profile.link, row_bytes};
    StageCost c;
    c.max_layers = std::max(room[static_cast<size_t>(s)], 1);
    for (const Phases::Step& st : ph.steps) {
      c.per_layer += layer(st.prefill, st.rows, st.length, 0);
      c.fixed += fixed(st.prefill, st.rows, st.length, st.samples);
    }
    costs.push_back(c);
  }
  Allocation a;
  if (std::any_of(degrees.begin(), degrees.end(), [](int32_t d) { return d > 1; }))
    a.tp_degrees = degrees;
  int64_t total_room = 0;
  for (const StageCost& c : costs) total_room += c.max_layers;
  if (total_room < in_.shape.n_layers) {  // cannot fit: split evenly, the memory check says why
    for (int32_t s = 0; s < S; ++s)
      a.layers.push_back(
          static_cast<int32_t>(in_.shape.n_layers / S + (s < in_.shape.n_layers % S ? 1 : 0)));
    return a;
  }
  a.layers = balance_layers(static_cast<int32_t>(in_.shape.n_layers), costs);
  return a;
}

void Simulator::check_memory(Prediction& p, int32_t kv_slots, int64_t kv_positions) const {
  const auto S = static_cast<int32_t>(p.allocation.layers.size());
  const int32_t enc = p.allocation.encoder_stages;
  int32_t begin = 0;
  for (int32_t s = 0; s < S; ++s) {
    if (enc > 0 && s == enc) begin = 0;
    const int32_t n = p.allocation.layers[static_cast<size_t>(s)];
    const bool first = s == 0 || (enc > 0 && s == enc);
    const bool last = s == S - 1 || (enc > 0 && s == enc - 1);
    // WAA's encoders hold one encode batch; everyone else the decode batch.
    const int32_t slots = enc > 0 && s < enc ? std::max(p.vars.encode_batch, 1) : kv_slots;
    StageRequest r = stage_request(n, first, last, slots, enc > 0 ? 0 : kv_positions);
    r.layer_begin = begin;
    r.layer_end = begin + n;
    const StagePlacement placed =
        place_stage(in_.shape.tp_shard(p.allocation.degree(static_cast<size_t>(s))), r);
    StageEstimate& est = p.stages[static_cast<size_t>(s)];
    est.memory = placed.total();
    est.memory.gpu += placed.kernel_scratch_bytes;
    for (const std::string& line : shortfalls(placed, in_.budgets)) {
      est.memory_problem = line;
      if (p.feasible) {
        p.feasible = false;
        p.infeasible_reason = fmt::format("stage {} (layers [{}, {})): {}", est.rank, r.layer_begin,
                                          r.layer_end, line);
      }
    }
    begin += n;
  }
}

// ---- RRA and the baseline: the pipeline timeline -----------------------------------------

namespace {

// A fixed allocation's tensor-parallel groups are the schedule's (partial TP, §4.2).
void take_tp_groups(ScheduleVars& v, const std::vector<int32_t>& degrees) {
  v.tp_degree = *std::max_element(degrees.begin(), degrees.end());
  v.tp_groups = static_cast<int32_t>(
      std::count_if(degrees.begin(), degrees.end(), [](int32_t d) { return d > 1; }));
}

// Each pipeline stage runs both phases over its consecutive layers; its rank is its leader's.
void add_pipeline_stages(Prediction& p, const std::vector<int32_t>& leaders) {
  int32_t begin = 0;
  for (size_t s = 0; s < leaders.size(); ++s) {
    const int32_t n = p.allocation.layers[s];
    p.stages.push_back({leaders[s] + 1, begin, begin + n, true, true, 0, {}, {}});
    begin += n;
  }
}

}  // namespace

// What each step of a cycle costs in one case -- expected (a step that may not run counts
// its chance), or in the phases the p99 sequence is in (it runs every iteration up to its
// last): its time on each stage, its activations' time on the link after each stage, and
// half the coordinator's turn around it (the command out, the result back).
struct Simulator::StepCosts {
  std::vector<std::vector<double>> stage;  // per stage, per step
  std::vector<double> link;                // per step
  std::vector<double> half_turn;           // per step
};

// The cycles a timeline runs: a warm-up, then enough for the p99 sequence to finish after
// the prefill of cycle `warmup`, which it joins; the steady state is read over cycles
// warmup .. total - 1.
struct Simulator::Cycles {
  int32_t warmup = 0;    // c0
  int32_t p99_span = 0;  // the cycles after c0 the p99 sequence decodes in
  int32_t total = 0;
  int32_t measured() const { return total - 1 - warmup; }
};

// One run of the timeline.
struct Simulator::Timeline {
  std::vector<std::vector<double>> cycle_start;  // per micro-batch, per cycle
  std::vector<double> results;                   // micro-batch 0's steps from cycle c0 on
  std::vector<double> busy;                      // per stage over the steady cycles
};

// The steady state of K micro-batches cycling through the pipeline: each stage serves steps
// in the order they reach it, a step's activations cross the link to the next stage, and a
// micro-batch's next step is dispatched once its previous result is back.
Prediction Simulator::pipeline(const ScheduleVars& v, const Phases& ph,
                               const Allocation* fixed) const {
  Prediction p = phases_prediction(v, ph);
  const std::vector<int32_t> degrees =
      fixed != nullptr ? degrees_of(*fixed) : v.stage_degrees(workers());
  p.allocation = fixed != nullptr ? *fixed : balance(ph, degrees);
  if (fixed != nullptr && !fixed->tp_degrees.empty()) take_tp_groups(p.vars, degrees);
  check_workers(p.allocation, degrees);
  const std::vector<int32_t> leaders = stage_leaders(degrees);
  StepCosts expected, with_p99;
  stage_costs(ph, p.allocation.layers, degrees, leaders, &p.outside_profile, expected, with_p99);
  add_pipeline_stages(p, leaders);
  check_memory(p, ph.kv_slots, ph.kv_positions);
  check_kv_slots(p, ph.kv_slots);
  if (!p.feasible) {
    p.p99_latency_s = std::numeric_limits<double>::infinity();
    return p;
  }
  link_costs(ph, expected, with_p99);
  const Cycles cycles = timeline_cycles(ph);
  const Timeline expected_run = run_timeline(ph, expected, with_p99, cycles, false);
  const Timeline p99_run = run_timeline(ph, expected, with_p99, cycles, true);
  p.throughput_tok_s = steady_throughput(ph, expected_run, cycles);
  for (size_t s = 0; s < p.stages.size(); ++s)  // one cycle of every micro-batch
    p.stages[s].busy_seconds_per_cycle = expected_run.busy[s] / cycles.measured();
  p.p99_latency_s = p99_latency(ph, p99_run, cycles);
  return p;
}

// What a prediction takes from the phases before any timing: B_D, the KV it reserves.
Prediction Simulator::phases_prediction(const ScheduleVars& v, const Phases& ph) const {
  Prediction p;
  p.vars = v;
  p.feasible = true;
  p.decode_batch = ph.decode_batch;
  p.kv_slots = ph.kv_slots;
  p.p99_output = ph.p99_output;
  p.kv_positions = ph.kv_positions;
  if (ph.kv_positions > 0) {
    p.reservations_exceeded = exceeded_;
    p.kv_packing = in_.packing->str();
  }
  return p;
}

void Simulator::check_workers(const Allocation& a, const std::vector<int32_t>& degrees) const {
  const int32_t used = std::accumulate(degrees.begin(), degrees.end(), 0);
  if (a.layers.size() != degrees.size() || used != workers())
    fail_input("an allocation of {} stages over {} workers for {} workers", a.layers.size(), used,
               workers());
}

// Each stage's time for each step of the cycle, expected and with the p99 sequence.
void Simulator::stage_costs(const Phases& ph, const std::vector<int32_t>& layers,
                            const std::vector<int32_t>& degrees,
                            const std::vector<int32_t>& leaders, bool* outside, StepCosts& expected,
                            StepCosts& with_p99) const {
  const auto S = static_cast<int32_t>(degrees.size());
  const size_t n_steps = ph.steps.size();
  expected.stage.assign(degrees.size(), std::vector<double>(n_steps));
  with_p99.stage = expected.stage;
  for (int32_t s = 0; s < S; ++s) {
    const auto si = static_cast<size_t>(s);
    const StepTimer timer{group_profiles(in_.profile, leaders, degrees, s),
                          layers[si],
                          s == 0,
                          s == S - 1,
                          outside,
                          &in_.profile.link,
                          activation_row_bytes(in_.shape)};
    for (size_t k = 0; k < n_steps; ++k) {
      const Phases::Step& st = ph.steps[k];
      const double mean = timer(st.prefill, st.rows, st.length, st.samples);
      expected.stage[si][k] = st.chance * mean;
      // The p99 sequence's prefill phase is a heavier one of the same chunks (more rows would
      // be more chunks, not longer ones): its time scaled by the rows, within the profile.
      with_p99.stage[si][k] = st.prefill
                                  ? mean * st.rows_with_one / std::max(st.rows, 1e-9)
                                  : timer(false, st.rows_with_one, st.length, st.rows_with_one);
    }
  }
}

// The run's --max-batch caps the KV slots a stage allocates.
void Simulator::check_kv_slots(Prediction& p, int32_t kv_slots) const {
  if (p.feasible && in_.max_kv_slots > 0 && kv_slots > in_.max_kv_slots) {
    p.feasible = false;
    p.infeasible_reason = fmt::format("{} KV slots, more than the run's {} (--max-batch)", kv_slots,
                                      in_.max_kv_slots);
  }
}

// Each step's link time and the coordinator's turn around it, expected and with the p99
// sequence.
void Simulator::link_costs(const Phases& ph, StepCosts& expected, StepCosts& with_p99) const {
  const size_t n_steps = ph.steps.size();
  const double row_bytes = activation_row_bytes(in_.shape);
  expected.link.assign(n_steps, 0.0);
  expected.half_turn.assign(n_steps, 0.0);
  with_p99.link.assign(n_steps, 0.0);
  with_p99.half_turn.assign(n_steps, 0.0);
  for (size_t k = 0; k < n_steps; ++k) {
    const Phases::Step& st = ph.steps[k];
    expected.link[k] = st.chance * in_.profile.link.time(st.rows * row_bytes);
    with_p99.link[k] = in_.profile.link.time(st.rows_with_one * row_bytes);
    expected.half_turn[k] = st.chance * in_.profile.step_overhead(st.rows) / 2;
    with_p99.half_turn[k] = in_.profile.step_overhead(st.rows_with_one) / 2;
  }
}

Simulator::Cycles Simulator::timeline_cycles(const Phases& ph) {
  Cycles c;
  c.warmup = 2 + ph.micro_batches;
  c.p99_span =
      ph.decode_steps > 0 ? (std::max(ph.latency_decode_steps, 1) - 1) / ph.decode_steps : 0;
  c.total = c.warmup + c.p99_span + 2;
  return c;
}

// The timeline of the micro-batches' steps, with expected step times (throughput, stage busy
// time) or, `track_p99`, with micro-batch 0 holding the p99 sequence from cycle c0 until it
// ends (its latency).
Simulator::Timeline Simulator::run_timeline(const Phases& ph, const StepCosts& expected,
                                            const StepCosts& with_p99, const Cycles& cycles,
                                            bool track_p99) {
  const int32_t K = ph.micro_batches;
  const int32_t c0 = cycles.warmup;
  Timeline tl;
  tl.cycle_start.assign(static_cast<size_t>(K),
                        std::vector<double>(static_cast<size_t>(cycles.total) + 1, 0));
  tl.busy.assign(expected.stage.size(), 0.0);
  std::vector<double> free(expected.stage.size(), 0.0);
  using Ready = std::pair<double, int32_t>;  // (dispatch time, micro-batch)
  std::priority_queue<Ready, std::vector<Ready>, std::greater<>> ready;
  std::vector<int32_t> cycle(static_cast<size_t>(K), 0), step(static_cast<size_t>(K), 0);
  for (int32_t m = 0; m < K; ++m) ready.push({0.0, m});
  while (!ready.empty()) {
    const auto [dispatch, m] = ready.top();
    ready.pop();
    const auto mi = static_cast<size_t>(m);
    const auto k = static_cast<size_t>(step[mi]);
    const int32_t c = cycle[mi];
    if (k == 0) tl.cycle_start[mi][static_cast<size_t>(c)] = dispatch;
    if (c == cycles.total) continue;
    // The p99 sequence's own prefill phase is the heavy one; later phases admit others.
    const bool one = track_p99 && m == 0 && c >= c0 && c <= c0 + cycles.p99_span &&
                     (c == c0 || !ph.steps[k].prefill);
    const bool steady = c >= c0 && c < cycles.total - 1;
    const double result =
        through_stages(one ? with_p99 : expected, k, dispatch, free, steady ? &tl.busy : nullptr);
    if (m == 0 && c >= c0) tl.results.push_back(result);
    if (++step[mi] == static_cast<int32_t>(ph.steps.size())) {
      step[mi] = 0;
      ++cycle[mi];
    }
    ready.push({result, m});
  }
  return tl;
}

// Step k dispatched at `dispatch` through the stages in order, each starting it once it has
// arrived and the stage is free (`free`: when each stage is next free); the time its result
// is back. `busy`, when given, accumulates each stage's time.
double Simulator::through_stages(const StepCosts& c, size_t k, double dispatch,
                                 std::vector<double>& free, std::vector<double>* busy) {
  const size_t S = c.stage.size();
  double at = dispatch + c.half_turn[k];
  for (size_t s = 0; s < S; ++s) {
    const double begin_at = std::max(at, free[s]);
    free[s] = begin_at + c.stage[s][k];
    if (busy != nullptr) (*busy)[s] += c.stage[s][k];
    at = free[s] + (s + 1 < S ? c.link[k] : 0.0);
  }
  return at + c.half_turn[k];
}

// Generated tokens per second: each micro-batch's tokens per cycle over its steady cycle
// time.
double Simulator::steady_throughput(const Phases& ph, const Timeline& expected,
                                    const Cycles& cycles) {
  double tokens_per_s = 0;
  for (int32_t m = 0; m < ph.micro_batches; ++m) {
    const auto& cs = expected.cycle_start[static_cast<size_t>(m)];
    const double cycle_s =
        (cs[static_cast<size_t>(cycles.total - 1)] - cs[static_cast<size_t>(cycles.warmup)]) /
        cycles.measured();
    tokens_per_s += ph.tokens_per_cycle / cycle_s;
  }
  return tokens_per_s;
}

// The p99 sequence joins at cycle c0's prefill and ends with its last decode iteration (or
// the prefill, when it has none).
double Simulator::p99_latency(const Phases& ph, const Timeline& with_p99, const Cycles& cycles) {
  const int32_t D = ph.latency_decode_steps;
  size_t last;
  if (D <= 0) {
    last = static_cast<size_t>(ph.prefill_steps) - 1;
  } else {
    const int32_t c = (D - 1) / ph.decode_steps, u = (D - 1) % ph.decode_steps;
    last = static_cast<size_t>(c) * ph.steps.size() + static_cast<size_t>(ph.prefill_steps + u);
  }
  STRATA_CHECK(last < with_p99.results.size(), "latency step {} of {} simulated", last,
               with_p99.results.size());
  return with_p99.results[last] - with_p99.cycle_start[0][static_cast<size_t>(cycles.warmup)];
}

// ---- WAA: encoder and decoder pipelines ----------------------------------------------------

namespace {

// WAA's batches (§4.1, §6): an encode of B_E sequences, B_D = B_E * S_D decoding (S_D: the
// decode iterations per sequence), at the decode batch's mean context.
struct WaaBatches {
  double encode = 0;       // B_E
  double decode = 0;       // B_D
  double context = 0;      // a decode row's mean context
  double encode_rows = 0;  // B_E's prompt rows
  int64_t chunks = 1;      // the prefill steps of an encode (--max-step-tokens)
  double chunk_rows() const { return encode_rows / chunks; }
};

WaaBatches waa_batches(const SimulatorInputs& in, int32_t encode_batch) {
  const TaskWorkload& w = in.workload;
  const LengthDistribution d = decode_iterations(w.output);
  WaaBatches b;
  b.encode = encode_batch;
  b.decode = b.encode * d.mean();
  b.context = w.input.mean() + d.mean() / 2;
  b.encode_rows = b.encode * w.input.mean();
  b.chunks =
      std::max<int64_t>(1, static_cast<int64_t>(std::ceil(b.encode_rows / in.max_step_tokens)));
  return b;
}

// The whole model on one worker (the first's profile): an encode of B_E sequences and a
// decode iteration of B_D, per layer and for the embedding and head.
struct WholeModelTimes {
  double encode_layer = 0, encode_fixed = 0;
  double decode_layer = 0, decode_fixed = 0;
};

WholeModelTimes whole_model_times(const SimulatorInputs& in, const WaaBatches& b, bool* out) {
  const RankProfile& r0 = in.profile.ranks.front();
  const double rows = b.chunk_rows();
  WholeModelTimes t;
  t.encode_layer = b.chunks * r0.prefill.at(rows, row_weighted_length(in.workload.input), out);
  t.encode_fixed = b.chunks * r0.embed.at(rows, out) + r0.head.at(b.encode, out);
  t.decode_layer = r0.decode.at(b.decode, b.context, out);
  t.decode_fixed = r0.embed.at(b.decode, out) + r0.head.at(b.decode, out);
  return t;
}

// The whole model's bytes on one worker holding `slots` KV slots (WAA-M's measure).
double whole_model_bytes(const SimulatorInputs& in, int32_t kv_capacity, int32_t slots) {
  StageRequest r;
  r.device_compute = in.device_compute;
  r.max_rows = std::max(in.max_step_tokens, slots);
  r.kv_slots = slots;
  r.kv_capacity = kv_capacity;
  r.policy = in.policy;
  const TierBytes bytes = place_stage(in.shape, r).total();
  return static_cast<double>(bytes.gpu + bytes.cpu);
}

// WAA-C splits the workers by the whole model's encode and decode times on one worker,
// WAA-M by the memory each side holds (an encode batch's KV slots, the decode batch's).
WaaSplit waa_workers(const SimulatorInputs& in, int32_t kv_capacity, const ScheduleVars& v,
                     const WholeModelTimes& t, int32_t decode_slots) {
  const int32_t N = in.profile.workers();
  const int32_t L = static_cast<int32_t>(in.shape.n_layers);
  if (v.policy == SchedulePolicy::kWaaC)
    return waa_split(N, L * t.encode_layer + t.encode_fixed, L * t.decode_layer + t.decode_fixed);
  return waa_split(N, whole_model_bytes(in, kv_capacity, v.encode_batch),
                   whole_model_bytes(in, kv_capacity, decode_slots));
}

// Fewer decoder micro-batches than decoder stages leave stages idle every iteration, and in
// this cost model more only repeat each stage's weight reads (the period B_m * t grows with
// B_m): one micro-batch per decoder stage dominates, so B_m is at least that.
int32_t decoder_micro_batches(int32_t requested, const WaaSplit& split) {
  return std::max(requested, split.decoders);
}

// Each side's layers balanced over its stages: the encoders' by an encode of B_E, the
// decoders' by a decode step of one micro-batch (b_m rows).
Allocation waa_allocation(const SimulatorInputs& in, const WaaSplit& split,
                          const WholeModelTimes& t, const WaaBatches& b, double b_m, bool* out) {
  const int32_t L = static_cast<int32_t>(in.shape.n_layers);
  const RankProfile& r0 = in.profile.ranks.front();
  auto side = [&](int32_t stages, double per_layer, double embed, double head) {
    std::vector<StageCost> c(static_cast<size_t>(stages), StageCost{per_layer, 0});
    c.front().fixed += embed;
    c.back().fixed += head;
    return balance_layers(L, c);
  };
  const double dec_mb = r0.decode.at(b_m, b.context, out);
  const std::vector<int32_t> enc =
      side(split.encoders, t.encode_layer, t.encode_fixed - r0.head.at(b.encode, out),
           r0.head.at(b.encode, out));
  const std::vector<int32_t> dec =
      side(split.decoders, dec_mb, r0.embed.at(b_m, out), r0.head.at(b_m, out));
  Allocation a;
  a.layers = enc;
  a.layers.insert(a.layers.end(), dec.begin(), dec.end());
  a.encoder_stages = split.encoders;
  return a;
}

// The encoder side's pace: one encode's latency through it, and the period it sets.
struct EncodeSide {
  double latency = 0, period = 0;
};

// Encoder stages: an encode of B_E sequences, then the KV of their layers to the decoders.
// Adds each encoder stage to `stages`.
EncodeSide encode_side(const SimulatorInputs& in, const WaaBatches& b, const Allocation& a,
                       bool* out, std::vector<StageEstimate>& stages) {
  const int32_t encoders = a.encoder_stages;
  const double act_e = in.profile.link.time(b.chunk_rows() * in.shape.hidden * kF32);
  const double kv_per_layer =
      b.encode * in.workload.input.mean() * 2 * static_cast<double>(in.shape.kv_width()) * kF32;
  EncodeSide e;
  for (int32_t s = 0; s < encoders; ++s) {
    const RankProfile& r = in.profile.ranks[static_cast<size_t>(s)];
    const int32_t n = a.layers[static_cast<size_t>(s)];
    double ts =
        b.chunks * n * r.prefill.at(b.chunk_rows(), row_weighted_length(in.workload.input), out);
    if (s == 0) ts += b.chunks * r.embed.at(b.chunk_rows(), out);
    if (s == encoders - 1) ts += r.head.at(b.encode, out);
    ts += in.profile.link.time(kv_per_layer * n);
    e.period = std::max(e.period, ts);
    e.latency += ts + (s + 1 < encoders ? b.chunks * act_e : 0.0);
    stages.push_back({s + 1, 0, 0, true, false, ts, {}, {}});
  }
  // The coordinator turns every encode step (the command out, the first tokens back) as it
  // turns a decode step. With one encoder batch in flight per encoder stage, an encode comes
  // out every slowest stage or every trip shared by the batches, whichever is longer.
  e.latency += b.chunks * in.profile.step_overhead(b.chunk_rows());
  e.period = std::max(e.period, e.latency / encoders);
  return e;
}

// The decoder side's pace: a micro-batch's trip through all decoder stages, and the slowest
// stage's step.
struct DecodeSide {
  double trip = 0, widest = 0;
};

// Decoder stages: B_m micro-batches of B_D / B_m (b_m rows); a micro-batch gets a token per
// trip through all of them, and the stages are shared by the micro-batches. Adds each
// decoder stage to `stages`.
DecodeSide decode_side(const SimulatorInputs& in, const WaaBatches& b, const Allocation& a,
                       int32_t micro, double b_m, bool* out, std::vector<StageEstimate>& stages) {
  const int32_t encoders = a.encoder_stages;
  const auto decoders = static_cast<int32_t>(a.layers.size()) - encoders;
  DecodeSide d;
  for (int32_t s = 0; s < decoders; ++s) {
    const RankProfile& r = in.profile.ranks[static_cast<size_t>(encoders + s)];
    const int32_t n = a.layers[static_cast<size_t>(encoders + s)];
    double ts = n * r.decode.at(b_m, b.context, out);
    if (s == 0) ts += r.embed.at(b_m, out);
    if (s == decoders - 1) ts += r.head.at(b_m, out);
    d.widest = std::max(d.widest, ts);
    d.trip += ts + (s + 1 < decoders ? in.profile.link.time(b_m * in.shape.hidden * kF32) : 0.0);
    stages.push_back({encoders + s + 1, 0, 0, false, true, ts * micro, {}, {}});
  }
  d.trip += in.profile.step_overhead(b_m);
  return d;
}

// The p99 sequence: its encode at the quantile of its batch's prompt rows (its time scaled
// by the rows: the encode's layers are linear in them to within the chunking), the
// hand-over, then a token every period.
double waa_p99_latency(const SimulatorInputs& in, const WaaBatches& b, const EncodeSide& e,
                       const DecodeSide& d, double period, int32_t p99_output) {
  const double encode =
      e.latency * (phase_rows_at(in.workload.input, b.encode, in.percentile) / b.encode_rows);
  // The hand-over (docs/CLUSTER.md): two control messages through the coordinator, and the
  // decode stage's next pause between steps (half its step on average) before it stores the
  // KV; the bytes themselves are in the encoder stages' times above.
  const double handover = 2 * in.profile.step_overhead(0) + d.widest / 2;
  return encode + handover + period / 2 + std::max(p99_output - 1, 0) * period;
}

// Each side's stages hold consecutive layers from layer 0: encoders, then decoders.
void set_waa_layer_ranges(Prediction& p) {
  int32_t begin = 0;
  for (size_t s = 0; s < p.stages.size(); ++s) {
    if (static_cast<int32_t>(s) == p.allocation.encoder_stages) begin = 0;
    p.stages[s].layer_begin = begin;
    p.stages[s].layer_end = begin + p.allocation.layers[s];
    begin += p.allocation.layers[s];
  }
}

}  // namespace

Prediction Simulator::waa(const ScheduleVars& v) const {
  if (v.encode_batch < 1 || v.micro_batches < 1)
    fail_input("WAA needs B_E and B_m >= 1 ({})", v.str());
  const WaaBatches b = waa_batches(in_, v.encode_batch);
  Prediction p;
  p.vars = v;
  p.feasible = true;
  p.decode_batch = b.decode;
  p.kv_slots = std::max(static_cast<int32_t>(std::ceil(b.decode - 1e-9)), 1);
  p.p99_output = in_.workload.output.percentile(in_.percentile);
  bool* out = &p.outside_profile;
  const WholeModelTimes t = whole_model_times(in_, b, out);
  const WaaSplit split = waa_workers(in_, capacity_, v, t, p.kv_slots);
  const int32_t micro = decoder_micro_batches(v.micro_batches, split);
  p.vars.micro_batches = micro;
  const double b_m = b.decode / micro;
  p.allocation = waa_allocation(in_, split, t, b, b_m, out);
  const EncodeSide e = encode_side(in_, b, p.allocation, out, p.stages);
  const DecodeSide d = decode_side(in_, b, p.allocation, micro, b_m, out, p.stages);
  const double period = std::max({d.trip, micro * d.widest, e.period});
  p.throughput_tok_s = b.encode * in_.workload.output.mean() / period;
  p.p99_latency_s = waa_p99_latency(in_, b, e, d, period, p.p99_output);
  set_waa_layer_ranges(p);
  check_memory(p, p.kv_slots);
  // The decode side holds ceil(B_D) slots, each a row of its decode step: no more than the
  // run has (--max-batch), as for RRA.
  if (p.feasible && in_.max_kv_slots > 0 && p.kv_slots > in_.max_kv_slots) {
    p.feasible = false;
    p.infeasible_reason = fmt::format(
        "{} decode KV slots (B_D {:.1f}), more than the run's {} "
        "(--max-batch)",
        p.kv_slots, b.decode, in_.max_kv_slots);
  }
  if (!p.feasible) p.p99_latency_s = std::numeric_limits<double>::infinity();
  return p;
}

}  // namespace strata
