// S3's length-aware KV packing (../shared/papers/s3.md section 3): each sequence reserves
// the KV positions it is expected to need -- its prompt plus a predicted output length --
// instead of the whole context, and the scheduler packs waiting sequences into the KV
// budget by first-fit decreasing. A sequence that reaches its reservation unfinished grows
// in place when the budget has room, and is otherwise preempted by the supervisor: its
// cache is dropped, its reservation doubled, and it rejoins the queue to be recomputed
// (prompt and tokens so far prefilled again) -- see RraScheduler::supervise.
//
// Why recompute rather than swap the cache out: the scheduler sits on rank 0 while the
// cache is spread over every stage; recomputing is one prefill of positions the stages
// compute at GEMM speed, with no second copy of the cache anywhere and no new transfer
// path; a swap would move 2 x layers x positions x KV width bytes out and back per stage
// and, on a CPU worker, free nothing (its cache already lives in host memory). Greedy
// outputs stay identical: the prefill computes the same keys and values.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "coordinator/intake/request.h"

namespace strata {

class LengthDistribution;
class LengthPredictor;

// What a sequence reserves (KV positions) when it is admitted.
enum class KvReserve {
  kContext,    // the whole context: worst case (ORCA / FasterTransformer; S3's baseline)
  kMaxNew,     // prompt + max_new_tokens: exact when clients send true lengths (the oracle)
  kPredicted,  // prompt + the predictor's reservation (S3)
};
const char* kv_reserve_name(KvReserve r);
KvReserve parse_kv_reserve(const std::string& name);  // InputError naming the choices

// How admission fits sequences into a micro-batch's share of the budget.
enum class KvAdmission {
  // S3: each sequence's reservation covers its length with the predictor's confidence, and
  // the reservations together stay within the budget; one outgrown is doubled in place or
  // preempted.
  kReserved,
  // The sum's quantile instead of the sum of quantiles: at every future step, the positions
  // the micro-batch's sequences fill -- each alive with the chance its predicted length
  // (given the tokens it has made) leaves it -- stay within the budget with the confidence,
  // and the positions filled now always do. When a step would overflow, the sequence that
  // has filled the fewest positions (the cheapest to recompute) is preempted. A weak
  // predictor's spread is paid once per micro-batch instead of once per sequence, and a
  // sequence's memory counts only while it is expected to run.
  kPooled,
};
const char* kv_admission_name(KvAdmission a);
KvAdmission parse_kv_admission(const std::string& name);  // InputError naming the choices

// A sequence's output length as a distribution. It falls in the predictor's buckets with
// `bucket_probs` (bucket b: lengths (b*width, (b+1)*width], uniform within it; bucket 0
// from 0, the last open up to `cap`; every piece cut at `cap`); no buckets: exactly `point`
// tokens (a reservation rule that knows, or assumes, the length).
struct LengthOutlook {
  int32_t cap = 0;  // the most output tokens it may make (the context's rest, max_new_tokens)
  int32_t point = 0;
  int32_t bucket_width = 0;
  std::vector<double> bucket_probs;

  // P(length > x | length > made): the chance it still runs after x tokens, given it runs
  // after `made`. If no mass is left above `made` (it outran every bucket), the length is
  // taken as uniform between made and twice made, as S3's supervisor doubles a reservation
  // outgrown.
  double survival(int32_t made, double x) const;
};

// The positions a micro-batch's sequences fill at future decode steps: expected value and
// variance at steps 0, stride, 2*stride, ... (each point an upper bound for the stride that
// follows it: the chance to run at its start, the positions at its end). Pooled admission
// keeps mean + z * sqrt(var) within the budget at every point.
struct UsageProfile {
  int32_t stride = 1;
  std::vector<double> mean, var;
  int64_t used = 0;  // positions filled at the next step, exactly

  UsageProfile(int32_t points, int32_t stride);
  // What pooled admission looks at: a context ahead, in 64 points.
  static UsageProfile over_context(int32_t context);
  // A sequence that fills `next` positions at its next step and has made `made` tokens.
  void add(const LengthOutlook& outlook, int32_t made, int64_t next);
  // `count` sequences alike (a simulator's mean field: count may be fractional) that fill
  // `next` positions at their next step, alive(t) of them still running t steps later. Each
  // is independent with that chance, or, `known` (their lengths known), alive(t) of them
  // certainly are: no variance. `used` is left alone (what it counts is exact).
  template <class Alive>
  void add_alike(double count, double next, Alive alive, bool known) {
    for (size_t k = 0; k < mean.size(); ++k) {
      const double a = alive(static_cast<int32_t>(k) * stride);
      if (a <= 0) break;  // survival only falls
      const double positions = next + static_cast<double>(k) * stride + stride - 1;
      mean[k] += count * a * positions;
      if (!known) var[k] += count * a * (1 - a) * positions * positions;
    }
  }
  void add(const UsageProfile& other);
  // The most positions at confidence z over the points.
  double need(double z) const;
};

// z such that P(N(0, 1) <= z) = p, p in (0, 1): the pooled admission's margin in standard
// deviations for a confidence (Acklam's rational approximation, |error| < 1.2e-9).
double normal_quantile(double p);
// Pooled admission's z for a confidence in (0, 1]: 1 is taken as 1 - 1e-6, since a certain
// bound would admit nothing beside a sequence whose length is uncertain.
double pooled_margin(double confidence);

struct KvPackingOptions {
  // KV positions over all micro-batches (each gets an equal share); 0: no budget, the KV
  // slots alone bound the batch (every sequence holds a whole slot).
  int64_t budget = 0;
  // The run's schedule search (--latency-bound) sizes the budget: its packed plan's positions.
  bool budget_from_schedule = false;
  KvReserve reserve = KvReserve::kContext;
  KvAdmission admission = KvAdmission::kReserved;
  double confidence = 0.9;  // the predictor's reservation covers the true length this often
  // max_new_tokens caps the reservation (and is a predictor feature). Off: the run treats
  // it as a stop rule only -- benchmarks that enforce true lengths through it use this to
  // keep the predictor from reading the answer.
  bool length_hint = true;
  std::string predictor_path;  // the model file (kPredicted); empty: start untrained
  bool learn = true;           // train online from every finished request, save at the end
  // An untrained predictor's length buckets (a file brings its own): S3's 10 of max / 10.
  int32_t buckets = 10;
  int32_t bucket_width = 50;

  void validate() const;  // InputError naming the option
  std::string str() const;
};

// First-fit decreasing into one bin (S3: "orders sequences in the request pool by length in
// decreasing order and iterates through the pool", taking each that still fits): indices
// of `sizes` chosen, largest first (ties: lower index first), at most `max_items`. With
// `first`, that item is considered before all others and nothing is chosen unless it fits
// (a request passed over too often stops smaller ones from overtaking it).
std::vector<size_t> first_fit_decreasing(std::span<const int64_t> sizes, int64_t capacity,
                                         size_t max_items, std::optional<size_t> first = {});

// First-fit decreasing, in the same order as first_fit_decreasing (`sizes`: the
// reservations), where an item fits while the load with its profile needs at most
// `capacity` at `z` (at point 0, what is filled at once, with no spread). Into an empty
// load an item always fits (a sequence's context is within the budget's share): no livelock.
std::vector<size_t> pooled_first_fit_decreasing(std::span<const int64_t> sizes,
                                                std::span<const UsageProfile> items,
                                                UsageProfile load, double z, int64_t capacity,
                                                size_t max_items, std::optional<size_t> first = {});

// S3's packing as ExeGPT's simulator sees it (docs/S3.md, "Planning with packing"): what a
// sequence reserves under a rule, as a distribution over the workload's lengths rather than
// per request. kPredicted carries the predictor's measured behaviour -- P(reserved bucket |
// true bucket) at its confidence, from `strata predict eval --json` -- and applies it to a
// workload on that workload's own buckets (S3's width: max length / bucket count), so a
// predictor measured on one task says how tightly it would pack another of its kind.
struct ReservationModel {
  KvReserve reserve = KvReserve::kContext;
  int32_t buckets = 0;
  std::vector<double> reserved_given_true;  // buckets x buckets, row = true bucket, sums to 1
  std::string source;                       // the file it came from
  // How the run fits the sequences into its budget (--kv-admission, --predict-confidence):
  // pooled plans with pooled_usage below instead of the reservations held.
  KvAdmission admission = KvAdmission::kReserved;
  double confidence = 0.9;

  // The "reservation_matrix" (or, from an older file, the argmax "confusion") of an
  // evaluation JSON; a true bucket never seen reserves its own bucket. InputError naming
  // the file and field.
  static ReservationModel from_eval_json(const std::string& path);
  std::string str() const;
};

// The model the run's packing plans with: none for the context rule (whole slots), the true
// lengths for max-new, `predict_eval`'s matrix for predicted; admitted as `packing` admits
// (its admission and confidence). InputError when predicted has no evaluation file, or
// another rule has one.
std::optional<ReservationModel> reservation_model(const KvPackingOptions& packing,
                                                  const std::string& predict_eval);

// What a sequence holds reserved while it decodes, per decode-iteration count D = 0..max
// (index D; a sequence of S output tokens decodes S - 1 times, iteration j needing input + j
// positions): the mean over its iterations of its reservation -- the first one (the prompt,
// `input`, plus what the rule reserves for S tokens), doubled by the supervisor each time the
// sequence reaches it (RraScheduler::supervise), never above `capacity`. D = 0 holds the
// first reservation. `exceeded` (optional) gets, per D, the chance the first reservation is
// outgrown (an extension in place or a preemption).
std::vector<double> held_positions(const ReservationModel& model, double input,
                                   const LengthDistribution& output, int32_t capacity,
                                   std::vector<double>* exceeded = nullptr);

// Pooled admission in a simulator's mean field: the usage profile over `context`
// (UsageProfile::over_context, add_alike) of `members` decode-batch sequences whose
// decode-iteration counts D are `held`, each at a uniform one of its D iterations j (it has
// made j tokens and fills input + j positions: a member has made j with chance
// T(j) = sum over D >= j of P(D) / D), plus `prefill_only` sequences that end at their
// prefill (made 0, input + 1 positions, as the run counts one being prefilled). Each is seen
// as the run's admission sees it. Under max-new its length is known: a share T(j + t) / T(j)
// of those that made j certainly still runs t steps later. Under predicted (no request's
// features here) its length is the workload's output given what it has made, alive with
// chance P(S > j + t) / P(S > j), independently. The context rule has no profile.
UsageProfile pooled_usage(KvReserve rule, double input, const LengthDistribution& output,
                          const LengthDistribution& held, double members, double prefill_only,
                          int32_t context);

// What packing did over a run.
struct PackingCounters {
  int64_t admitted = 0;           // admissions (a preempted sequence counts again)
  int64_t preemptions = 0;        // sequences preempted at their reservation
  int64_t preempted_seqs = 0;     // distinct sequences preempted at least once
  int64_t extensions = 0;         // reservations doubled in place (the budget had room)
  int64_t recomputed_tokens = 0;  // positions prefilled again after preemptions
  int64_t decode_steps = 0;
  int64_t decode_rows = 0;   // sequences over all decode steps (mean batch size)
  int64_t reserved_sum = 0;  // positions reserved over all decode steps
  int64_t used_sum = 0;      // positions filled over all decode steps
  double mean_decode_batch() const;
  std::string json() const;
};

// How the predictor did over a run: its bucket for each finished request against the bucket
// the request's output fell in (S3's accuracy and mean distance of the wrong predictions).
struct PredictionStats {
  int64_t predicted = 0;
  int64_t correct = 0;
  int64_t distance_wrong = 0;  // summed |predicted - true| bucket over the wrong ones
  int64_t under_reserved = 0;  // outputs longer than their first reservation allowed
  int64_t learned = 0;         // online updates
  double accuracy() const;
  double mean_distance_wrong() const;
  std::string json() const;
};

// What S3's packing did over a run (or so far).
struct PackingStats {
  int64_t budget = 0;
  std::string reserve;
  std::string admission = "reserved";
  PackingCounters counters;
  std::optional<PredictionStats> prediction;  // when reservations were predicted
  std::string json() const;
  std::string table() const;  // the run report's lines
};

// What each request reserves (KvReserve), and the supervisor's retraining of the predictor
// from every finished request (S3 section 3). One per run, on the coordinator's thread.
class KvReserver {
 public:
  // `context`: the run's positions per sequence. Loads options.predictor_path when the
  // reservations are predicted and the file exists (else starts untrained: S3's predictor
  // learns online from the first requests).
  KvReserver(const KvPackingOptions& options, int32_t context);
  ~KvReserver();
  KvReserver(const KvReserver&) = delete;
  KvReserver& operator=(const KvReserver&) = delete;

  int32_t reserve(const GenerationRequest& request);  // KV positions, its prompt included
  // Its final positions as a distribution (pooled admission): the predictor's buckets, or
  // a point at what the rule reserves.
  LengthOutlook outlook(const GenerationRequest& request) const;
  // A finished request (not an error): scored against its prediction and learned from.
  void finished(const GenerationResult& result);
  // Writes the predictor back to options.predictor_path when it learned online.
  void save() const;
  const PredictionStats& stats() const { return stats_; }
  // The run's packing so far: the scheduler's counters with this reserver's numbers.
  PackingStats report(const PackingCounters& counters) const;
  const KvPackingOptions& options() const { return options_; }

 private:
  struct Pending {
    int32_t bucket = 0;
    int32_t max_new_tokens = 0;  // 0 when it is not a length hint
    int32_t reserved_tokens = 0;
  };
  KvPackingOptions options_;
  int32_t context_;
  std::unique_ptr<LengthPredictor> predictor_;
  std::unordered_map<std::string, Pending> pending_;  // by request id
  PredictionStats stats_;
};

}  // namespace strata
