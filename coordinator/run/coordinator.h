// The one request path: reads requests, validates them (request_rules.h), plans the stages,
// drives them with the RRA scheduler (rra_scheduler.h) over K micro-batches in flight -- or
// WAA's (waa_scheduler.h) over a prefill and a decode pipeline, with KV hand-overs -- writes
// results as they finish, and reports per-stage busy / idle time at the end. The stages
// are worker ranks (mpi_stages.h: rank 0 of a cluster) or this process (local_stages.h:
// `strata generate`, single-process serve); the loop is the same. A stage that dies or
// hangs ends the run with an Error within a bounded time, every request taken handed back
// as unfinished; a plan that cannot run is refused (InputError) before any stage loads.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "coordinator/exegpt/replanning.h"
#include "coordinator/exegpt/waa_scheduler.h"
#include "coordinator/intake/intake.h"
#include "coordinator/plan/cluster_plan.h"
#include "coordinator/plan/stages.h"
#include "coordinator/run/metrics.h"
#include "coordinator/run/run_history.h"
#include "coordinator/s3/kv_packing.h"
#include "transport/messages.h"
#include "worker/config.h"
#include "worker/tokenizer.h"

namespace strata {

// ExeGPT's WAA (waa_scheduler.h): the first `encoder_stages` worker ranks are the prefill
// pipeline, the rest the decode pipeline (CoordinatorOptions::micro_batches: B_m,
// kv_slots: the decode side's KV slots).
struct WaaRun {
  int32_t encoder_stages = 1;
  // The prefill side's KV slots; 0: B_E for each encoder batch in flight and one more
  // waiting for decode slots, or the decode side's slots when B_E is 0.
  int32_t encoder_slots = 0;
  int32_t encoder_micro_batches = 1;
  int32_t encode_batch = 0;  // B_E (0: what the prefill slots hold)
  double planned_input = 0;  // §5.2 (0: off)
  double planned_decode_batch = 0;
  double threshold = 0.25;
};

// What the KV hand-overs of a WAA run moved, and how long each took from the coordinator's
// request to the last stage's word.
struct HandoverStats {
  int64_t handovers = 0;
  int64_t sequences = 0;
  uint64_t bytes = 0;
  double seconds = 0;    // summed over hand-overs
  WaaCounters counters;  // the scheduler's, at the end of the run
  std::string json() const;
};

struct CoordinatorOptions {
  std::string model_spec;
  int32_t micro_batches = 1;
  int32_t decode_iters = 8;
  int32_t kv_slots = 32;          // --max-batch: sequences in flight over all micro-batches
  int32_t max_step_tokens = 512;  // prompt rows per prefill step (longer prompts: chunks)
  // KV positions per slot: the run's context, fixed before any request is seen (a queue
  // may start empty); 0: the model's context.
  int32_t max_context = 0;
  int64_t stage_mem = -1;           // bytes per stage (< 0: no limit)
  StagePlacementOptions placement;  // the policy and compute tier each stage is placed for
  // Each worker rank's node (cluster_plan.h PlanOptions::nodes): its compute tier and budgets
  // replace `placement`'s; empty: every stage alike.
  std::vector<StageNode> nodes;
  // Once *stop_signal is non-zero (SIGTERM, SIGINT): nothing more is admitted, requests in
  // flight get this long to finish, then the rest end as unfinished.
  const std::atomic<int>* stop_signal = nullptr;
  double grace_period_s = 30.0;
  double flush_timeout_s = 30.0;  // results handed to the sink, to be stored at the end
  // ExeGPT's scheduler (replanning.h): with a target, the run profiles its stages, plans
  // the schedule with the best throughput under the latency bound (its micro-batches, N_D,
  // KV slots and layers replace the ones above; --max-batch caps the slots), re-deploys the
  // stages with it, and re-plans when the lengths drift.
  std::optional<ScheduleTarget> schedule;
  std::optional<WaaRun> waa;  // run WAA instead of RRA
  // Partial tensor parallelism (--tensor-parallel, cluster_plan.h's parse_tp_degrees): the
  // degree of each pipeline stage; empty: one rank a stage.
  std::string tensor_parallel;
  // Live numbers for `serve --metrics-port` (null: none kept); outlives the run.
  ServeMetrics* metrics = nullptr;
  // Called once when every stage has loaded and requests are about to be taken (the
  // service's readiness: a log line, /health, sd_notify). Optional.
  std::function<void()> on_ready;
  // Progress (may be empty): called with the tokens sampled so far after each step result.
  std::function<void(int64_t tokens)> on_tokens;
  // S3 (kv_packing.h): a KV budget in positions that sequences reserve predicted lengths of.
  KvPackingOptions packing;
};

// A run's KV positions per sequence: the model's context, or --max-context, or a micro-batch's
// share of S3's KV budget where smaller.
int32_t run_context(const CoordinatorOptions& options, const ModelConfig& config);
// The plan a run of `options` over `workers` worker ranks starts with (make_uniform_plan's
// options: its context, step rows, tensor-parallel degrees, WAA's prefill side, the nodes):
// `strata plan --nodes` prints the plan `serve` starts with from these.
PlanOptions run_plan_options(const CoordinatorOptions& options, const ModelConfig& config,
                             int32_t workers);

// The steady part of a run (a batch job fills the cluster, runs, then drains), in run
// seconds: from the first request finished to the last admission (the source empty, nothing
// waiting), or to the last result when admissions never stopped. It never ends after the
// last result: a queue-fed run's source empties only when the job is stopped, which may be
// long after its last result. `first_finish_s`, `admissions_end_s` < 0: never happened.
// `tally`: the step results' tokens as they came (run_history.h), those in (from, to] counted.
struct SteadyWindow {
  double from_s = 0, to_s = 0;
  int64_t tokens = 0;
};
SteadyWindow steady_window(double first_finish_s, double admissions_end_s, double last_result_s,
                           const TokenTally& tally);

// Percentiles of one latency over the requests that finished (seconds; 0 when none did).
struct LatencySummary {
  int64_t count = 0;
  double mean = 0, p50 = 0, p90 = 0, p99 = 0, max = 0;
  static LatencySummary of(std::vector<double> values);
  std::string json() const;
};

struct ClusterStats {
  std::string model;
  int32_t ranks = 0;
  int32_t micro_batches = 0;
  int32_t decode_iters = 0;
  int64_t requests = 0;
  int64_t finished = 0;       // ended with a result of their own (eos, length, stop, context)
  int64_t errors = 0;         // refused requests (malformed, invalid)
  int64_t unfinished = 0;     // taken and not finished (stopped, or the cluster failed)
  int64_t duplicate_ids = 0;  // requests whose id an earlier request of the run had
  int stop_signal = 0;        // the signal that stopped the run, 0 if none
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;
  int64_t prefill_steps = 0;
  int64_t decode_steps = 0;
  double seconds = 0;  // first step sent to last result in
  // The steady part of the run (steady_window above) and the tokens generated in it.
  double steady_from_s = 0, steady_to_s = 0;
  int64_t steady_tokens = 0;
  // The coordinator's own cost per request: reading and parsing, validating and queueing
  // them (intake), and handing finished ones to the sink (results).
  double intake_seconds = 0;
  double result_seconds = 0;
  // CPU time of this process over the run (user + system): the coordinator's own cost on
  // rank 0 of a cluster (its polling included), everything in a one-process run.
  double cpu_seconds = 0;
  std::vector<StageReport> stages;
  // Over the finished requests, from their arrival: time to first token, end to end, and
  // the wait for a prefill.
  LatencySummary ttft, e2e, queue_wait;
  std::map<std::string, std::string> schedule_in_force;  // policy, micro-batches, N_D, ...
  std::optional<ScheduleReport> schedule;  // what a run with a schedule target planned
  std::optional<HandoverStats> waa;        // a WAA run's hand-overs
  std::optional<PackingStats> packing;     // a run with a KV budget
  std::optional<KvSwapStats> pie;          // a run with Pie on the KV cache

  double tokens_per_second() const;  // generated tokens / seconds (FlexGen's throughput)
  double steady_tokens_per_second() const;
  // The system-clock time of the first step: the timeline's zero.
  double origin_wall_s = 0;
  // `timeline`: with each stage's step spans (seconds from origin_wall_s; --stats-out).
  std::string json(bool timeline = false) const;
  std::string table() const;  // the human summary printed at the end
};

// Runs the whole job over `stages`. On any failure the stages are aborted, every request
// taken from `source` and not finished is handed to `sink.unfinished`, and the error
// propagates. `tokenizer` may be null: requests must then carry prompt ids, and stop
// strings are refused.
ClusterStats run_coordinator(Stages& stages, const CoordinatorOptions& options,
                             const ModelConfig& config, const Tokenizer* tokenizer,
                             RequestSource& source, ResultSink& sink);

}  // namespace strata
