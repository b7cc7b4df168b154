// ExeGPT's XSimulator (§6): given a layer profile, a workload's length distributions and a
// schedule's control variables, predict steady-state throughput (generated tokens / s), the
// latency of the 99th-percentile-length sequence, and what each stage holds in memory.
//
// RRA (§4.1, §6): every stage runs every phase; each of K micro-batches alternates one
// encode (prefill) phase with N_D decode iterations. P_D(U|S) and P_D(U) give the fraction
// of the decode batch that completes at each iteration of a phase, and B_D = B_E / sum_U
// P_D(U) keeps the batch steady. Strata's prefill samples a sequence's first token, so a
// sequence of S output tokens needs S - 1 decode iterations; and the decode batch holds each
// sequence for ceil(D / N_D) phases, so the distribution the formulas take is the batch's
// (each length weighted by its phases in the batch, Little's law), not the arrivals' — see
// docs/SCHEDULING.md. The phases of all micro-batches are laid on a pipeline timeline
// (each stage serves steps in order, activations cross the links, a step's next one waits
// for its result) and the steady state is read off it.
//
// WAA (§4.1): encoder stages and decoder stages, B_D = B_E * S_D, the GPU counts by WAA-C
// (encode / decode compute) or WAA-M (memory), B_m decoder micro-batches. Planned here;
// executed by the next issue (Strata's stages run RRA today).
//
// Baseline: FasterTransformer's way (§2): a static batch, no early termination (every
// sequence decodes to the longest output), pipeline only with micro-batches.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

#include "coordinator/exegpt/layer_profile.h"
#include "coordinator/plan/workload.h"
#include "coordinator/s3/kv_packing.h"
#include "placement/stage_placement.h"

namespace strata {

enum class SchedulePolicy { kRra, kWaaC, kWaaM, kBaseline };
const char* policy_name(SchedulePolicy p);  // "RRA", "WAA-C", "WAA-M", "FT"

// The control variables (§4.2, §5). micro_batches: RRA's pipeline micro-batches, WAA's
// decoder micro-batches (B_m), the baseline's micro-batches. The baseline's static batch is
// encode_batch.
struct ScheduleVars {
  SchedulePolicy policy = SchedulePolicy::kRra;
  int32_t encode_batch = 1;  // B_E
  int32_t decode_iters = 1;  // N_D (RRA); the encoding frequency is 1 / N_D
  int32_t micro_batches = 1;
  // Partial tensor parallelism (§4.2): the first `tp_groups` pipeline stages each split over
  // `tp_degree` consecutive workers, the rest one worker each (RRA and the baseline).
  int32_t tp_degree = 1;
  int32_t tp_groups = 0;
  // The degree of each pipeline stage over `workers` workers.
  std::vector<int32_t> stage_degrees(int32_t workers) const;
  std::string str() const;
  nlohmann::json to_json() const;
};

// ---- §6's formulas -------------------------------------------------------------------

// P_D(U = u | S = s) for a sequence needing s decode iterations, phases of n_d iterations:
// 1 at u = s when s <= n_d; 1 / ceil(s / n_d) at u = 1 + ((s - 1) mod n_d) otherwise.
double pd_given_s(int32_t u, int32_t s, int32_t n_d);
// P_D(U) = sum_S P_D(U|S) P_D(S), u = 1..n_d (index 0 is 0). `decode_lengths`: the
// distribution of decode iterations (lengths of 0 finish at the prefill and are skipped).
std::vector<double> pd_u(const LengthDistribution& decode_lengths, int32_t n_d);
// B_D = B_E / sum_U P_D(U).
double rra_decode_batch(double encode_batch, const std::vector<double>& pd);
// The decode iterations a sequence of each output length needs after its prefill (S - 1).
LengthDistribution decode_iterations(const LengthDistribution& output);
// The lengths as the decode batch holds them: each weighted by the phases it stays in the
// batch, ceil(D / n_d) (Little's law); D = 0 is dropped.
LengthDistribution in_batch(const LengthDistribution& decode_lengths, int32_t n_d);

// WAA-C / WAA-M (§4.1): of n workers, floor(n * e / (e + d)) encode and floor(n * d / (e + d))
// decode; a worker the floors leave over goes to the side with the larger remainder, and
// each side gets at least one. e, d: encode / decode time (WAA-C) or memory (WAA-M).
struct WaaSplit {
  int32_t encoders = 0;
  int32_t decoders = 0;
};
WaaSplit waa_split(int32_t workers, double encode, double decode);

// ---- the simulator ---------------------------------------------------------------------

// Layers per stage, in rank order. RRA and the baseline: every stage runs both phases, the
// first embeds, the last holds the head. WAA: the first `encoder_stages` stages are an
// encoder pipeline over all layers, the rest a decoder pipeline over all layers again.
struct Allocation {
  std::vector<int32_t> layers;
  int32_t encoder_stages = 0;
  // Each stage's tensor-parallel degree (its workers, consecutive); empty: one worker each.
  std::vector<int32_t> tp_degrees;
  // "[0, 5) [5, 12)", "[0, 5)x2 [5, 12)" (split over 2 workers) or
  // "encode [0, 12) | decode [0, 6) [6, 12)"
  std::string str() const;
  int32_t degree(size_t stage) const { return tp_degrees.empty() ? 1 : tp_degrees.at(stage); }
  bool operator==(const Allocation&) const = default;
};

struct StageEstimate {
  int32_t rank = 0;
  int32_t layer_begin = 0, layer_end = 0;
  bool encoder = true, decoder = true;
  double busy_seconds_per_cycle = 0;  // compute per steady cycle (RRA) or period (WAA)
  TierBytes memory;                   // as placement/ places it
  std::string memory_problem;         // a shortfall, empty when it fits
};

struct Prediction {
  ScheduleVars vars;
  bool feasible = false;          // fits in memory (the latency bound is the search's)
  std::string infeasible_reason;  // which stage and tier is short, when not
  double throughput_tok_s = 0;    // generated tokens per second in steady state
  double p99_latency_s = 0;       // the p99-length sequence, from its prefill to its last token
  double decode_batch = 0;        // B_D (WAA, RRA), the static batch (baseline)
  int32_t kv_slots = 0;           // KV slots each stage allocates
  // S3's packing (SimulatorInputs::packing): the KV positions the batch reserves -- the
  // --kv-budget that runs this schedule -- and the share of sequences that outgrow their
  // first reservation (each an extension in place or a preemption). 0: every slot whole.
  int64_t kv_positions = 0;
  double reservations_exceeded = 0;
  std::string kv_packing;  // how kv_positions was planned (ReservationModel::str)
  int32_t p99_output = 0;  // the output length the latency is for
  Allocation allocation;
  std::vector<StageEstimate> stages;
  bool outside_profile = false;  // some step's time was extrapolated beyond measured points

  nlohmann::json to_json() const;
  std::string str() const;
};

// Everything a prediction depends on besides the control variables.
struct SimulatorInputs {
  ClusterProfile profile;
  ModelShape shape;
  TaskWorkload workload;
  double percentile = 0.99;       // the latency bound is for this output-length percentile
  int32_t max_step_tokens = 512;  // prompt rows of one prefill step (longer: chunks)
  int32_t kv_capacity = 0;        // positions per KV slot (0: max input + max output)
  int32_t max_kv_slots = 0;       // the most KV slots a stage may hold (--max-batch; 0: any)
  // Each stage's memory model and budgets (placement/): the policy it runs, whether it
  // computes on a device, and budgets per tier (whole stage; < 0: unlimited).
  std::optional<Policy> policy;
  bool device_compute = false;
  TierBudgets budgets{-1, -1, -1, true};
  std::string model_spec;
  // S3's packing for RRA (issue 16): each decode-batch member holds what `packing` reserves
  // for its length (kv_packing.h held_positions) instead of a whole KV slot, so memory
  // bounds B_D by the packed positions. Host compute only: a device's cache is allocated
  // slot by slot (the constructor refuses it). WAA and the baseline reserve whole slots, as
  // their runs do.
  std::optional<ReservationModel> packing;
};

class Simulator {
 public:
  explicit Simulator(SimulatorInputs inputs);

  // A prediction with the layer allocation that balances this schedule's stage times
  // (allocator.h), or WAA's split.
  Prediction predict(const ScheduleVars& vars) const;
  // The same on a given allocation (a running cluster re-planning keeps its layers).
  Prediction predict(const ScheduleVars& vars, const Allocation& allocation) const;

  const SimulatorInputs& inputs() const { return in_; }
  int32_t workers() const { return in_.profile.workers(); }
  int32_t kv_capacity() const { return capacity_; }
  int64_t evaluations() const { return evaluations_; }

 private:
  struct Phases;  // one micro-batch's steady cycle: its steps and their sizes
  Phases rra_phases(const ScheduleVars& v) const;
  double packed_positions(const LengthDistribution& d, int32_t decode_iters, double n0,
                          double prefill_only) const;
  Phases baseline_phases(const ScheduleVars& v) const;
  // RRA and the baseline: the micro-batches' phases on one pipeline's timeline.
  struct StepCosts;  // each step's time on each stage and link, and the coordinator's turn
  struct Cycles;     // the cycles a timeline runs, its warm-up and its steady state
  struct Timeline;   // one run of it
  Prediction pipeline(const ScheduleVars& v, const Phases& ph, const Allocation* fixed) const;
  Prediction phases_prediction(const ScheduleVars& v, const Phases& ph) const;
  void check_workers(const Allocation& a, const std::vector<int32_t>& degrees) const;
  void stage_costs(const Phases& ph, const std::vector<int32_t>& layers,
                   const std::vector<int32_t>& degrees, const std::vector<int32_t>& leaders,
                   bool* outside, StepCosts& expected, StepCosts& with_p99) const;
  void link_costs(const Phases& ph, StepCosts& expected, StepCosts& with_p99) const;
  void check_kv_slots(Prediction& p, int32_t kv_slots) const;
  static Cycles timeline_cycles(const Phases& ph);
  static Timeline run_timeline(const Phases& ph, const StepCosts& expected,
                               const StepCosts& with_p99, const Cycles& cycles, bool track_p99);
  static double through_stages(const StepCosts& c, size_t k, double dispatch,
                               std::vector<double>& free, std::vector<double>* busy);
  static double steady_throughput(const Phases& ph, const Timeline& expected, const Cycles& cycles);
  static double p99_latency(const Phases& ph, const Timeline& with_p99, const Cycles& cycles);
  // WAA: an encoder pipeline and a decoder pipeline.
  Prediction waa(const ScheduleVars& v) const;
  Allocation balance(const Phases& ph, const std::vector<int32_t>& degrees) const;
  std::vector<int32_t> max_layers(int32_t kv_slots, int64_t kv_positions,
                                  const std::vector<int32_t>& degrees) const;
  StageRequest stage_request(int32_t layers, bool embedding, bool head, int32_t kv_slots,
                             int64_t kv_positions = 0) const;
  void check_memory(Prediction& p, int32_t kv_slots, int64_t kv_positions = 0) const;

  SimulatorInputs in_;
  int32_t capacity_ = 0;
  // With packing: held_positions per decode-iteration count, and the outgrown share of the
  // workload's sequences.
  std::vector<double> held_;
  double exceeded_ = 0;
  mutable int64_t evaluations_ = 0;
};

}  // namespace strata
