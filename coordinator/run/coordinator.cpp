#include "coordinator/run/coordinator.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "coordinator/exegpt/rra_scheduler.h"
#include "coordinator/exegpt/simulator.h"
#include "coordinator/intake/choices.h"
#include "coordinator/intake/request_rules.h"
#include "coordinator/plan/cluster_plan.h"
#include "coordinator/run/run_history.h"
#include "kernels/clock.h"
#include "kernels/error.h"
#include "kernels/log.h"

namespace strata {
namespace {

using Clock = std::chrono::steady_clock;

double process_cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto s = [](const timeval& t) {
    return static_cast<double>(t.tv_sec) + 1e-6 * static_cast<double>(t.tv_usec);
  };
  return s(u.ru_utime) + s(u.ru_stime);
}

// KV slots of WAA's prefill side: as given, or B_E for each encoder batch in flight and one
// more, or --max-batch.
int32_t waa_encoder_slots(const WaaRun& w, int32_t kv_slots) {
  return w.encoder_slots > 0  ? w.encoder_slots
         : w.encode_batch > 0 ? w.encode_batch * (w.encoder_micro_batches + 1)
                              : kv_slots;
}

class Coordinator {
 public:
  Coordinator(Stages& stages, const CoordinatorOptions& o, const ModelConfig& config,
              const Tokenizer* tokenizer, RequestSource& source, ResultSink& sink)
      : stages_(stages),
        options_(o),
        config_(config),
        tokenizer_(tokenizer),
        source_(source),
        sink_(sink) {}

  ClusterStats run();

 private:
  ClusterStats run_plan();
  void size_run(const PlanOptions& po);
  int32_t encoder_slots() const { return waa_encoder_slots(*options_.waa, options_.kv_slots); }
  void end_unfinished(const std::string& why, bool failed);
  void return_unread(const std::string& why);
  void flush_results(double seconds);
  void admit();
  void take(IncomingRequest r);
  void refuse(const GenerationRequest& r, const std::string& error);
  bool stop_requested() const;
  void begin_stop();
  void serve();
  void dispatch(const ScheduledStep& step);
  void on_result(const StepResult& result);
  void choose_schedule(PlanOptions& plan_options, SchedulerOptions& scheduler_options);
  void use_waa(const Prediction& chosen, PlanOptions& plan_options);
  void budget_from_schedule(const Prediction& chosen, SchedulerOptions& scheduler_options);
  void observe(const FinishedRequest& f);
  void ended(const GenerationResult& r, bool unfinished);
  void token_times(const StepResult& result);
  void publish_load();
  void publish_schedule();
  std::unique_ptr<StepScheduler> make_scheduler(const SchedulerOptions& so) const;
  bool hand_over();

  Stages& stages_;
  CoordinatorOptions options_;
  const ModelConfig& config_;
  const Tokenizer* tokenizer_;
  RequestSource& source_;
  ResultSink& sink_;
  std::optional<Deadline> grace_;  // set when a stop signal came
  RecentIds recent_ids_;
  int32_t capacity_ = 0;
  PromptPrep prep_;  // how prompts are tokenized and bounded (size_run)
  ClusterPlan plan_;
  std::unique_ptr<StepScheduler> scheduler_;
  WaaScheduler* waa_ = nullptr;                      // scheduler_ when the run is WAA
  std::map<uint64_t, Clock::time_point> handovers_;  // started, not done
  std::unique_ptr<RunSchedule> schedule_;
  std::unique_ptr<KvReserver> reserver_;  // S3, when the run has a KV budget
  void use_packing(SchedulerOptions& so);
  uint64_t next_seq_ = 0;
  std::optional<Clock::time_point> first_step_;  // the run's time: first step sent ...
  Clock::time_point last_result_;                // ... to the last result in (idle excluded)
  double run_seconds() const { return first_step_ ? seconds_since(*first_step_) : 0.0; }
  void steady_window();
  TokenTally tokens_;  // the steady window's
  double first_finish_s_ = -1, admissions_end_s_ = -1;
  ClusterStats stats_;
  // Live metrics: requests in the scheduler (waiting or running), each running sequence's
  // last token, when the stages' statistics were last published; the latencies kept for
  // the report.
  ServeMetrics* metrics_ = options_.metrics;
  int64_t in_scheduler_ = 0;
  int64_t sampled_tokens_ = 0;
  std::unordered_map<uint64_t, Clock::time_point> last_token_;
  Clock::time_point stages_published_{};
  LatencyRecorder ttft_, e2e_, queue_wait_;
};

ClusterStats Coordinator::run() {
  try {
    return run_plan();
  } catch (const std::exception& e) {
    const std::string why = std::string("not completed: the cluster failed: ") + e.what();
    end_unfinished(why, true);
    return_unread(why);
    flush_results(std::min(options_.flush_timeout_s, 5.0));
    throw;
  }
}

// What the source read ahead and the coordinator never took goes back as never started:
// for the queue, with its delivery count restored (only what ran counts as a delivery).
void Coordinator::return_unread(const std::string& why) {
  try {
    if (scheduler_ == nullptr) return;  // failed before serving: nothing was taken
    for (IncomingRequest& r : source_.stop()) {
      ++stats_.unfinished;
      GenerationResult never{r.request.id, {}, {}, StopReason::kError, why};
      never.choice = r.request.choice;
      never.n = r.request.n;
      never.chat = r.request.chat;
      sink_.unfinished(never, false);
    }
  } catch (const std::exception& again) {
    log::get("coordinator")->error("handing back the requests read ahead: {}", again.what());
  }
}

// Every request taken from the source and not finished goes to the sink as unfinished,
// with the tokens it had and why, so none is lost without a word. After a failure, those
// that were running are suspects (one of them may be what failed the cluster).
void Coordinator::end_unfinished(const std::string& why, bool failed) {
  try {
    if (scheduler_ == nullptr) return;
    for (FinishedRequest& f : scheduler_->drain(why)) {
      ++stats_.unfinished;
      ended(f.result, true);
      last_token_.erase(f.seq_id);
      sink_.unfinished(f.result, failed && f.started);
    }
  } catch (const std::exception& again) {
    log::get("coordinator")->error("handing over the unfinished requests: {}", again.what());
  }
}

void Coordinator::flush_results(double seconds) {
  if (!sink_.flush(Deadline::after_seconds(seconds)))
    log::get("coordinator")
        ->error("results not all stored within {} s; their requests were not acknowledged",
                seconds);
}

}  // namespace

int32_t run_context(const CoordinatorOptions& o, const ModelConfig& config) {
  const int32_t model_max = config.max_positions;
  int32_t capacity = o.max_context > 0 ? std::min(o.max_context, model_max) : model_max;
  // A sequence never holds more than its micro-batch's share of a KV budget.
  const int64_t share = o.packing.budget / std::max(1, o.micro_batches);
  if (o.packing.budget > 0 && share < capacity) {
    if (share < 2)
      fail_input("--kv-budget {} gives each of {} micro-batches fewer than 2 KV positions",
                 o.packing.budget, o.micro_batches);
    capacity = static_cast<int32_t>(share);
  }
  return capacity;
}

PlanOptions run_plan_options(const CoordinatorOptions& o, const ModelConfig& config,
                             int32_t workers) {
  PlanOptions po{o.model_spec,
                 workers,
                 o.micro_batches,
                 o.kv_slots,
                 run_context(o, config),
                 std::max(o.max_step_tokens, o.kv_slots),
                 o.stage_mem,
                 o.placement};
  po.nodes = o.nodes;
  if (!o.tensor_parallel.empty()) {
    if (o.waa || o.schedule)
      fail_input("--tensor-parallel with {}: {}", o.waa ? "--waa-encoders" : "--latency-bound",
                 o.waa ? "KV hand-over between tensor-parallel groups is not built"
                       : "the bound's search chooses the degrees itself; give one of them");
    po.tp_degrees = parse_tp_degrees(o.tensor_parallel, workers);
  }
  if (o.waa) {
    if (o.schedule)
      fail_input(
          "--waa-encoders with --latency-bound: the bound's search chooses the allocation itself "
          "(--schedule-policy waa-c,waa-m keeps it to WAA); give one of them");
    po.encoder_stages = o.waa->encoder_stages;
    po.encoder_kv_slots = waa_encoder_slots(*o.waa, o.kv_slots);
  }
  return po;
}

namespace {

ClusterStats Coordinator::run_plan() {
  const double cpu0 = process_cpu_seconds();
  PlanOptions po = run_plan_options(options_, config_, stages_.count());
  size_run(po);
  plan_ = make_uniform_plan(config_, po);
  SchedulerOptions so{options_.micro_batches,   options_.decode_iters, options_.kv_slots, capacity_,
                      options_.max_step_tokens, config_.eos_token_ids, tokenizer_,        {}};
  log::get("coordinator")->info("plan: {}", plan_.str());
  stages_.start(plan_);
  if (options_.schedule) choose_schedule(po, so);
  if (options_.packing.budget > 0) use_packing(so);
  scheduler_ = make_scheduler(so);
  if (options_.waa) {
    waa_ = static_cast<WaaScheduler*>(scheduler_.get());
    stats_.waa = HandoverStats{};
  }
  stats_.micro_batches = so.micro_batches;
  stats_.decode_iters = so.decode_iters;
  publish_schedule();
  if (options_.on_ready) options_.on_ready();
  serve();
  if (waa_ != nullptr) stats_.waa->counters = waa_->counters();
  if (reserver_) {
    stats_.packing = reserver_->report(*scheduler_->packing());
    if (metrics_ != nullptr) metrics_->set_packing(*stats_.packing);
    reserver_->save();
  }
  if (first_step_)
    stats_.seconds = std::chrono::duration<double>(last_result_ - *first_step_).count();
  steady_window();
  stats_.cpu_seconds = process_cpu_seconds() - cpu0;
  if (schedule_) {
    stats_.schedule = schedule_->report();
    stats_.schedule->steady_from_s = stats_.steady_from_s;
    stats_.schedule->steady_to_s = stats_.steady_to_s;
  }
  stats_.pie = stages_.pie_stats();
  stats_.stages = stages_.finish(grace_ ? "stopped" : "all requests done");
  stats_.ttft = ttft_.summary();
  stats_.e2e = e2e_.summary();
  stats_.queue_wait = queue_wait_.summary();
  if (!sink_.flush(Deadline::after_seconds(options_.flush_timeout_s)))
    fail(ErrorKind::kDisconnected,
         "results not all stored within {} s (--flush-timeout); their requests were not "
         "acknowledged and will run again",
         options_.flush_timeout_s);
  if (metrics_ != nullptr) {
    metrics_->set_stages(stats_.stages);
    if (stats_.pie) metrics_->set_pie(*stats_.pie);
    metrics_->set_load(0, 0);
    metrics_->set_finished();
  }
  return stats_;
}

// S3: sequences reserve their predicted length (or the worst case, or what they declare)
// and the scheduler packs them into the KV budget.
void Coordinator::use_packing(SchedulerOptions& so) {
  if (options_.waa)
    fail_input("--kv-budget with WAA (--waa-encoders): S3's packing runs on the RRA schedule only");
  reserver_ = std::make_unique<KvReserver>(options_.packing, capacity_);
  so.kv_budget = options_.packing.budget;
  so.max_new_caps = options_.packing.length_hint;
  so.reserve = [this](const GenerationRequest& r) { return reserver_->reserve(r); };
  so.kv_admission = options_.packing.admission;
  so.outlook = [this](const GenerationRequest& r) { return reserver_->outlook(r); };
  so.pooled_z = pooled_margin(options_.packing.confidence);
  log::get("coordinator")->info("{}", options_.packing.str());
}

std::unique_ptr<StepScheduler> Coordinator::make_scheduler(const SchedulerOptions& so) const {
  if (!options_.waa) return std::make_unique<RraScheduler>(so);
  const WaaRun& w = *options_.waa;
  WaaOptions wo{
      so,         w.encoder_micro_batches, encoder_slots(), w.planned_input, w.planned_decode_batch,
      w.threshold};
  wo.common.encode_batch = w.encode_batch;
  auto s = std::make_unique<WaaScheduler>(wo);
  log::get("coordinator")->info("{}", wo.str());
  return s;
}

// The run's context and step buffers come from the configuration, never from the first
// requests seen: a queue may start empty and fill later.
void Coordinator::size_run(const PlanOptions& po) {
  if (options_.max_context > config_.max_positions)
    log::get("coordinator")
        ->warn("--max-context {} exceeds the model's {} positions; using {}", options_.max_context,
               config_.max_positions, config_.max_positions);
  capacity_ = po.kv_capacity;
  prep_ =
      PromptPrep{tokenizer_, capacity_, tokenizer_ != nullptr ? tokenizer_->max_token_bytes() : 0};
  source_.prepare_with(prep_);
  if (options_.packing.budget > 0)
    log::get("coordinator")
        ->info("context {} positions under --kv-budget {} (a micro-batch's share at most)",
               capacity_, options_.packing.budget);
  stats_.model = options_.model_spec;
  stats_.ranks = stages_.ranks();
  stats_.micro_batches = options_.micro_batches;
  stats_.decode_iters = options_.decode_iters;
}

void Coordinator::steady_window() {
  const SteadyWindow w =
      strata::steady_window(first_finish_s_, admissions_end_s_, stats_.seconds, tokens_);
  stats_.steady_from_s = w.from_s;
  stats_.steady_to_s = w.to_s;
  stats_.steady_tokens = w.tokens;
}

// ExeGPT at start: the profile of the stages just started (uniform), the best schedule under
// the bound (RRA, RRA with partial tensor parallelism, WAA-C or WAA-M), and the stages
// re-deployed when it wants other layers, groups or KV slots.
void Coordinator::choose_schedule(PlanOptions& po, SchedulerOptions& so) {
  SchedulePlanOptions sp;
  sp.model_spec = options_.model_spec;
  sp.max_step_tokens = options_.max_step_tokens;
  sp.max_encode_batch = options_.kv_slots;
  sp.max_context = capacity_;
  sp.placement = options_.placement;
  sp.stage_mem = options_.stage_mem;
  ScheduleTarget target = *options_.schedule;
  if (!stages_.runs_waa()) target.policies = {SchedulePolicy::kRra};  // one pipeline only
  schedule_ = std::make_unique<RunSchedule>(target, config_, sp);
  const Prediction& chosen = schedule_->plan(stages_, plan_);
  po.micro_batches = chosen.vars.micro_batches;
  po.kv_slots = chosen.kv_slots;
  po.tp_degrees = chosen.allocation.tp_degrees;
  if (chosen.vars.policy != SchedulePolicy::kRra) use_waa(chosen, po);
  ClusterPlan next = make_plan(config_, po, chosen.allocation.layers);
  next.plan_id = plan_.plan_id + 1;
  if (next.stages != plan_.stages || next.kv_slots != plan_.kv_slots ||
      next.micro_batches != plan_.micro_batches || next.encoder_stages != plan_.encoder_stages) {
    plan_ = next;
    log::get("coordinator")->info("re-deploying: {}", plan_.str());
    stages_.start(plan_);
  }
  so.micro_batches = chosen.vars.micro_batches;
  so.decode_iters = chosen.vars.decode_iters;
  so.encode_batch = chosen.vars.encode_batch;
  so.kv_slots = plan_.kv_slots;
  if (options_.packing.budget_from_schedule) budget_from_schedule(chosen, so);
}

// S3 under the bound: the packed plan's positions are the run's KV budget, each micro-batch
// an equal share of them. The search sized every share to hold the run's whole context
// (Simulator::rra_phases), so the plan never cuts a request short. A schedule that keeps whole
// slots (WAA, or the context rule) runs without packing.
void Coordinator::budget_from_schedule(const Prediction& chosen, SchedulerOptions& so) {
  if (chosen.kv_positions <= 0) {
    log::get("coordinator")
        ->info("KV packing: the chosen {} schedule keeps whole KV slots",
               policy_name(chosen.vars.policy));
    return;
  }
  options_.packing.budget = chosen.kv_positions;
  const int64_t share = chosen.kv_positions / std::max(1, so.micro_batches);
  STRATA_CHECK(share >= capacity_,
               "the chosen schedule gives each of {} micro-batches {} KV positions, less than "
               "the run's context of {}",
               so.micro_batches, share, capacity_);
  log::get("coordinator")
      ->info(
          "KV budget {} positions: the chosen schedule's packed plan ({} of the sequences "
          "expected to outgrow their first reservation)",
          chosen.kv_positions, chosen.reservations_exceeded);
}

// A WAA schedule (§4.1): its encoder stages prefill, B_E a batch with one batch in flight
// per encoder stage (and one more waiting for decode slots), the decode side's B_m
// micro-batches over ceil(B_D) slots; §5.2's adjustment keeps the encoder workload and the
// decode batch near the planned B_E x mean input and B_D.
void Coordinator::use_waa(const Prediction& chosen, PlanOptions& po) {
  WaaRun w;
  w.encoder_stages = chosen.allocation.encoder_stages;
  w.encoder_micro_batches = w.encoder_stages;
  w.encode_batch = chosen.vars.encode_batch;
  w.planned_input = options_.schedule->workload.input.mean();
  w.planned_decode_batch = chosen.decode_batch;
  options_.waa = w;
  po.encoder_stages = w.encoder_stages;
  po.encoder_kv_slots = encoder_slots();
}

// A finished request's lengths and latency for the schedule; a drift re-plans N_D and the
// batch on the same layers.
void Coordinator::observe(const FinishedRequest& f) {
  if (!schedule_ || f.result.stop_reason == StopReason::kError) return;
  const RequestTimes& t = f.result.times;
  const double latency = t.total_s >= 0 && t.queue_wait_s >= 0 ? t.total_s - t.queue_wait_s : -1;
  if (std::optional<Prediction> next =
          schedule_->observe(static_cast<int32_t>(f.result.prompt_ids.size()),
                             static_cast<int32_t>(f.result.output_ids.size()), latency,
                             run_seconds() - std::max(latency, 0.0))) {
    scheduler_->reschedule(next->vars.decode_iters, next->vars.encode_batch,
                           std::min(next->kv_slots, plan_.kv_slots));
    stats_.decode_iters = next->vars.decode_iters;
    publish_schedule();
  }
}

// A request's end, for the live metrics and the report's latencies.
void Coordinator::ended(const GenerationResult& r, bool unfinished) {
  if (r.stop_reason != StopReason::kError) {
    ++stats_.finished;
    if (r.times.first_token_s >= 0) ttft_.add(r.times.first_token_s);
    if (r.times.total_s >= 0) e2e_.add(r.times.total_s);
    if (r.times.queue_wait_s >= 0) queue_wait_.add(r.times.queue_wait_s);
  }
  if (metrics_ != nullptr) metrics_->request_ended(r, unfinished);
}

void Coordinator::refuse(const GenerationRequest& r, const std::string& error) {
  GenerationResult res;
  res.id = r.id;
  res.choice = r.choice;
  res.n = r.n;
  res.chat = r.chat;
  // No prompt ids: an oversized prompt's refusal would carry all of them (a 1 MB prompt,
  // 294,117 ids); the error names what was wrong.
  res.stop_reason = StopReason::kError;
  res.error = error;
  res.error_kind = ErrorKind::kInvalidInput;
  log::get("coordinator")
      ->warn("request {} refused: {}", log::printable(r.id), log::printable(error));
  ++stats_.errors;
  ended(res, false);
  sink_.write(res);
}

bool Coordinator::stop_requested() const {
  return options_.stop_signal != nullptr && options_.stop_signal->load() != 0;
}

// Prompt text to ids; a run without a tokenizer takes ids only.
void tokenize_with(IncomingRequest& r, const Tokenizer* tokenizer) {
  prepare_prompt(r, PromptPrep{tokenizer});
}

// A stop signal: nothing more is admitted; what the source read and the coordinator holds
// but has not started is unfinished at once; the running requests get the grace period.
void Coordinator::begin_stop() {
  stats_.stop_signal = options_.stop_signal->load();
  const std::string why =
      fmt::format("not started: the job was stopped (signal {})", stats_.stop_signal);
  for (IncomingRequest& r : source_.stop()) {
    tokenize_with(r, tokenizer_);
    ++stats_.requests;
    if (!r.error.empty()) {
      refuse(r.request, r.error);
      continue;
    }
    ++stats_.unfinished;
    GenerationResult never{r.request.id, r.request.prompt_ids, {}, StopReason::kError, why};
    never.choice = r.request.choice;
    never.n = r.request.n;
    never.chat = r.request.chat;
    ended(never, true);
    sink_.unfinished(never, false);
  }
  grace_ = Deadline::after_seconds(options_.grace_period_s);
  log::get("coordinator")
      ->warn("signal {}: admitting nothing more; the requests running get {} s to finish",
             stats_.stop_signal, options_.grace_period_s);
}

// Backpressure: only as many requests are taken from the source as can wait for the next
// prefill (one batch); the source keeps the rest.
void Coordinator::admit() {
  if (grace_) return;
  const auto window = static_cast<size_t>(options_.kv_slots);
  const size_t have = scheduler_->waiting();
  if (have >= window) return;
  const Clock::time_point t0 = Clock::now();
  for (IncomingRequest& r : source_.poll(window - have)) take(std::move(r));
  stats_.intake_seconds += seconds_since(t0);
}

// Validation (request_rules.h) and the scheduler's queue: the one way in for a request. A
// request redelivered after a failed run (deliveries > 1) arrives alone: the source holds
// nothing else while it runs (RedisQueue::recover), so it is admitted as any other.
void Coordinator::take(IncomingRequest r) {
  prepare_prompt(r, prep_);  // a no-op for what the source prepared on its own thread
  apply_generation_defaults(r, config_.generation);
  ++stats_.requests;
  if (r.request.choice == 0 && recent_ids_.seen_again(r.request.id)) {
    ++stats_.duplicate_ids;
    log::get("coordinator")
        ->warn("request id {} was seen before in this run ({})", log::printable(r.request.id),
               r.where);
  }
  const std::string error =
      r.error.empty() ? validate_request(r.request, config_.vocab, capacity_, tokenizer_) : r.error;
  if (!error.empty()) return refuse(r.request, error);
  if (r.request.max_new_tokens == 0) {
    GenerationResult done{r.request.id, r.request.prompt_ids, {}, StopReason::kLength, {}};
    done.choice = r.request.choice;
    done.n = r.request.n;
    done.chat = r.request.chat;
    const double waited = std::max(0.0, wall_seconds() - r.arrival);
    done.times = RequestTimes{waited, -1, waited};
    ended(done, false);
    sink_.write(done);
    return;
  }
  stats_.prompt_tokens += static_cast<int64_t>(r.request.prompt_ids.size());
  if (metrics_ != nullptr)
    metrics_->request_queued(static_cast<int64_t>(r.request.prompt_ids.size()));
  ++in_scheduler_;
  scheduler_->submit(r.request, next_seq_++, r.arrival);
}

void Coordinator::serve() {
  Backoff backoff;
  while (true) {
    if (!grace_ && stop_requested()) begin_stop();
    if (grace_ && grace_->expired()) {
      end_unfinished(fmt::format("interrupted: the job was stopped (signal {}) and the grace "
                                 "period of {} s ran out; the tokens so far are kept",
                                 stats_.stop_signal, options_.grace_period_s),
                     false);
      return;
    }
    admit();
    publish_load();
    if (admissions_end_s_ < 0 && first_step_ && source_.exhausted() && scheduler_->waiting() == 0) {
      admissions_end_s_ = run_seconds();
      tokens_.at_admissions_end = tokens_.total;
    }
    for (int32_t m = 0; m < scheduler_->micro_batches(); ++m) {
      if (scheduler_->in_flight(m)) continue;
      if (std::optional<ScheduledStep> step = scheduler_->next_step(m)) dispatch(*step);
    }
    if (scheduler_->idle() && (grace_ || source_.exhausted())) return;
    std::optional<StepResult> result = stages_.poll();
    if (result) on_result(*result);
    if (hand_over() || result) {
      backoff = Backoff();
      continue;
    }
    backoff.pause();
  }
}

// WAA: hand-overs that ended let their sequences decode; prefilled sequences with a free
// decode slot start the next. True when either happened.
bool Coordinator::hand_over() {
  if (waa_ == nullptr) return false;
  bool moved = false;
  HandoverStats& h = *stats_.waa;
  for (const HandoverDone& done : stages_.handovers_done()) {
    scheduler_->handed_over(done.handover_id);
    h.bytes += done.bytes;
    h.seconds += seconds_since(handovers_.at(done.handover_id));
    handovers_.erase(done.handover_id);
    moved = true;
  }
  while (std::optional<KvHandover> next = scheduler_->next_handover()) {
    stages_.hand_over(*next);
    handovers_[next->handover_id] = Clock::now();
    ++h.handovers;
    h.sequences += static_cast<int64_t>(next->moves.size());
    moved = true;
  }
  return moved;
}

void Coordinator::dispatch(const ScheduledStep& step) {
  if (!first_step_) {
    first_step_ = Clock::now();
    stats_.origin_wall_s = wall_seconds();
  }
  stages_.dispatch(step);
  if (step.command.phase == Phase::kPrefill) {
    ++stats_.prefill_steps;
  } else {
    ++stats_.decode_steps;
  }
  if (metrics_ != nullptr) metrics_->step_sent(step.command.phase == Phase::kPrefill);
}

void Coordinator::on_result(const StepResult& result) {
  last_result_ = Clock::now();
  tokens_.total += static_cast<int64_t>(result.tokens.size());
  sampled_tokens_ += static_cast<int64_t>(result.tokens.size());
  if (options_.on_tokens) options_.on_tokens(sampled_tokens_);
  std::vector<FinishedRequest> done = scheduler_->apply(result);
  if (metrics_ != nullptr) token_times(result);
  if (metrics_ != nullptr && reserver_)
    metrics_->set_packing(reserver_->report(*scheduler_->packing()));
  if (done.empty()) return;
  if (first_finish_s_ < 0) {
    first_finish_s_ = run_seconds();
    tokens_.at_first_finish = tokens_.total;
  }
  std::vector<uint64_t> left;
  for (FinishedRequest& f : done) {
    stats_.generated_tokens += static_cast<int64_t>(f.result.output_ids.size());
    if (reserver_) reserver_->finished(f.result);
    left.push_back(f.seq_id);
    --in_scheduler_;
    last_token_.erase(f.seq_id);
    ended(f.result, false);
    observe(f);
    const Clock::time_point t0 = Clock::now();
    sink_.write(f.result);
    stats_.result_seconds += seconds_since(t0);
  }
  stages_.leave(left);
}

// Inter-token latency: each sequence's token against its previous one (the first token
// only starts the clock; time to first token is the request's own measure).
void Coordinator::token_times(const StepResult& result) {
  const Clock::time_point now = last_result_;
  for (const SeqToken& t : result.tokens) {
    auto [it, first] = last_token_.try_emplace(t.seq_id, now);
    if (first) continue;
    metrics_->token_gap(std::chrono::duration<double>(now - it->second).count());
    it->second = now;
  }
}

// Running and waiting requests, and the stages' statistics every half second.
void Coordinator::publish_load() {
  if (metrics_ == nullptr) return;
  const auto waiting = static_cast<int64_t>(scheduler_->waiting());
  metrics_->set_load(std::max<int64_t>(0, in_scheduler_ - waiting), waiting);
  if (Clock::now() - stages_published_ < std::chrono::milliseconds(500)) return;
  stages_published_ = Clock::now();
  metrics_->set_stages(stages_.live());
  if (const std::optional<KvSwapStats> pie = stages_.pie_stats()) metrics_->set_pie(*pie);
}

// The schedule in force (the report's and the metrics' labels).
void Coordinator::publish_schedule() {
  std::string tp;
  for (const StagePlan& s : plan_.stages)
    tp += fmt::format("{}{}", tp.empty() ? "" : ",", s.tp_degree());
  const std::string policy = schedule_     ? policy_name(schedule_->current().vars.policy)
                             : plan_.waa() ? "WAA"
                                           : "RRA";
  stats_.schedule_in_force = {{"policy", policy},
                              {"stages", fmt::format("{}", plan_.stages.size())},
                              {"encoder_stages", fmt::format("{}", plan_.encoder_stages)},
                              {"micro_batches", fmt::format("{}", stats_.micro_batches)},
                              {"decode_iters", fmt::format("{}", stats_.decode_iters)},
                              {"kv_slots", fmt::format("{}", plan_.kv_slots)},
                              {"tp_degrees", tp},
                              {"planned_by", schedule_ ? "latency_bound" : "options"}};
  if (metrics_ == nullptr) return;
  metrics_->set_schedule(stats_.schedule_in_force);
  metrics_->set_kv_slots(plan_.kv_slots);
}

}  // namespace

// Nearest-rank percentiles: the p-th is the smallest value with at least p of the values
// at or below it.
LatencySummary LatencySummary::of(std::vector<double> values) {
  LatencySummary s;
  if (values.empty()) return s;
  std::sort(values.begin(), values.end());
  const auto n = static_cast<double>(values.size());
  auto rank = [&](double p) {
    const auto at = static_cast<size_t>(std::max(1.0, std::ceil(p * n)));
    return values[std::min(values.size(), at) - 1];
  };
  s.count = static_cast<int64_t>(values.size());
  s.mean = std::accumulate(values.begin(), values.end(), 0.0) / n;
  s.p50 = rank(0.50);
  s.p90 = rank(0.90);
  s.p99 = rank(0.99);
  s.max = values.back();
  return s;
}

std::string LatencySummary::json() const {
  return fmt::format(
      R"({{"count": {}, "mean": {:.6f}, "p50": {:.6f}, "p90": {:.6f}, "p99": {:.6f}, "max": {:.6f}}})",
      count, mean, p50, p90, p99, max);
}

double StageReport::bubble_fraction() const {
  return stats.window_seconds > 0 ? stats.idle_seconds / stats.window_seconds : 0.0;
}

double ClusterStats::tokens_per_second() const {
  return seconds > 0 ? static_cast<double>(generated_tokens) / seconds : 0.0;
}

SteadyWindow steady_window(double first_finish_s, double admissions_end_s, double last_result_s,
                           const TokenTally& tally) {
  SteadyWindow w;
  w.from_s = std::max(first_finish_s, 0.0);
  const bool ends_at_admissions = admissions_end_s > w.from_s && admissions_end_s <= last_result_s;
  w.to_s = admissions_end_s > w.from_s ? std::min(admissions_end_s, last_result_s) : last_result_s;
  w.tokens =
      (ends_at_admissions && tally.at_admissions_end >= 0 ? tally.at_admissions_end : tally.total) -
      (first_finish_s >= 0 ? tally.at_first_finish : 0);
  return w;
}

double ClusterStats::steady_tokens_per_second() const {
  const double w = steady_to_s - steady_from_s;
  return w > 0 ? static_cast<double>(steady_tokens) / w : tokens_per_second();
}

namespace {

// A stage's steps as [start, end] pairs of seconds from `origin`.
std::string spans_json(const StageStats& s, double origin) {
  std::string out = R"(, "step_spans_s": [)";
  for (size_t i = 0; i + 1 < s.step_spans.size(); i += 2)
    out += fmt::format("{}[{:.6f}, {:.6f}]", i == 0 ? "" : ", ", s.step_spans[i] - origin,
                       s.step_spans[i + 1] - origin);
  return out + fmt::format(R"(], "step_spans_dropped": {})", s.step_spans_dropped);
}

}  // namespace

std::string ClusterStats::json(bool timeline) const {
  std::string stages_json;
  for (const StageReport& s : stages) {
    stages_json += fmt::format(
        R"({}{{"rank": {}, "layers": [{}, {}], "steps": {}, "rows": {}, "busy_seconds": {:.6f}, )"
        R"("idle_seconds": {:.6f}, "window_seconds": {:.6f}, "bubble_fraction": {:.4f}, )"
        R"("bytes_from_cpu": {}, "bytes_from_disk": {}, "device_compute": {}, )"
        R"("allocated": {{"gpu": {}, "cpu": {}, "disk": {}}}, "rss_before_load_bytes": {}, )"
        R"("load_peak_rss_bytes": {}, "peak_rss_bytes": {}{}}})",
        stages_json.empty() ? "" : ", ", s.rank(), s.stage.layer_begin, s.stage.layer_end,
        s.stats.steps, s.stats.rows, s.stats.busy_seconds, s.stats.idle_seconds,
        s.stats.window_seconds, s.bubble_fraction(), s.stats.bytes_from_cpu,
        s.stats.bytes_from_disk, s.stage.use_gpu, s.stats.allocated_gpu_bytes,
        s.stats.allocated_cpu_bytes, s.stats.allocated_disk_bytes, s.stats.rss_before_load_bytes,
        s.stats.load_peak_rss_bytes, s.stats.peak_rss_bytes,
        timeline ? spans_json(s.stats, origin_wall_s) : std::string());
  }
  return fmt::format(
      R"({{"model": "{}", "ranks": {}, "micro_batches": {}, "decode_iters": {}, "requests": {}, "finished": {}, "errors": {}, )"
      R"("unfinished": {}, "duplicate_ids": {}, "stop_signal": {}, "intake_seconds": {:.6f}, )"
      R"("result_seconds": {:.6f}, "cpu_seconds": {:.3f}, )"
      R"("prompt_tokens": {}, "generated_tokens": {}, "prefill_steps": {}, "decode_steps": {}, "seconds": {:.6f}, )"
      R"("tokens_per_s": {:.3f}, "steady_from_s": {:.6f}, "steady_to_s": {:.6f}, )"
      R"("steady_tokens": {}, "steady_tokens_per_s": {:.3f}, "latency_s": {{"ttft": {}, "e2e": {}, )"
      R"("queue_wait": {}}}, "schedule_in_force": {}, "stages": [{}]{}{}{}{}}})",
      model, ranks, micro_batches, decode_iters, requests, finished, errors, unfinished,
      duplicate_ids, stop_signal, intake_seconds, result_seconds, cpu_seconds, prompt_tokens,
      generated_tokens, prefill_steps, decode_steps, seconds, tokens_per_second(), steady_from_s,
      steady_to_s, steady_tokens, steady_tokens_per_second(), ttft.json(), e2e.json(),
      queue_wait.json(), nlohmann::json(schedule_in_force).dump(), stages_json,
      schedule ? ", \"schedule\": " + schedule->json(steady_tokens_per_second()) : std::string(),
      waa ? ", \"waa\": " + waa->json() : std::string(),
      packing ? ", \"packing\": " + packing->json() : std::string(),
      pie ? ", \"pie\": " + pie->json() : std::string());
}

std::string HandoverStats::json() const {
  const double per_seq = sequences > 0 ? static_cast<double>(bytes) / sequences : 0.0;
  return fmt::format(
      R"({{"handovers": {}, "sequences": {}, "kv_bytes": {}, "kv_bytes_per_sequence": {:.1f}, )"
      R"("handover_seconds": {:.6f}, "seconds_per_handover": {:.6f}, "encoder_batches": {}, )"
      R"("encoder_adjustments": {}, "decoder_adjustments": {}}})",
      handovers, sequences, bytes, per_seq, seconds, handovers > 0 ? seconds / handovers : 0.0,
      counters.encoder_batches, counters.encoder_adjustments, counters.decoder_adjustments);
}

std::string ClusterStats::table() const {
  std::string out = fmt::format("run report: {} over {} ranks\n", model, ranks);
  out += fmt::format("  requests    {} taken: {} ok, {} refused, {} unfinished\n", requests,
                     finished, errors, unfinished);
  out += fmt::format("  tokens      {} prompt, {} generated\n", prompt_tokens, generated_tokens);
  out += fmt::format(
      "  throughput  {:.1f} tok/s over {:.3f} s (steady part {:.1f} tok/s); {} prefill + {} "
      "decode steps\n",
      tokens_per_second(), seconds, steady_tokens_per_second(), prefill_steps, decode_steps);
  std::string labels;
  for (const auto& [k, v] : schedule_in_force)
    labels += fmt::format("{}{} {}", labels.empty() ? "" : ", ", k, v);
  out += fmt::format("  schedule    {}\n", labels);
  out += "  latency s       count      mean       p50       p90       p99       max\n";
  for (const auto& [name, l] : {std::pair{"first token", &ttft}, std::pair{"end to end", &e2e},
                                std::pair{"queue wait", &queue_wait}})
    out += fmt::format("    {:<11}  {:>7}  {:>8.3f}  {:>8.3f}  {:>8.3f}  {:>8.3f}  {:>8.3f}\n",
                       name, l->count, l->mean, l->p50, l->p90, l->p99, l->max);
  out += "  rank  layers      steps   busy s   idle s  bubble   MB from cpu  MB from disk\n";
  for (const StageReport& s : stages)
    out += fmt::format(
        "  {:>4}  [{:>3}, {:>3})  {:>6}  {:>7.3f}  {:>7.3f}  {:>5.1f}%  {:>12.1f}  {:>12.1f}\n",
        s.rank(), s.stage.layer_begin, s.stage.layer_end, s.stats.steps, s.stats.busy_seconds,
        s.stats.idle_seconds, 100 * s.bubble_fraction(),
        static_cast<double>(s.stats.bytes_from_cpu) / 1e6,
        static_cast<double>(s.stats.bytes_from_disk) / 1e6);
  if (schedule) out += "  " + schedule->line(steady_tokens_per_second()) + "\n";
  if (waa)
    out += fmt::format(
        "  WAA: {} KV hand-overs of {} sequences, {:.1f} KiB and {:.3f} ms each on average; "
        "encoder batches {} ({} adjusted for their workload, {} for the decode batch)\n",
        waa->handovers, waa->sequences,
        waa->handovers > 0 ? static_cast<double>(waa->bytes) / waa->handovers / 1024 : 0.0,
        waa->handovers > 0 ? 1e3 * waa->seconds / waa->handovers : 0.0,
        waa->counters.encoder_batches, waa->counters.encoder_adjustments,
        waa->counters.decoder_adjustments);
  if (packing) out += packing->table();
  if (pie) out += "  " + pie->str() + "\n";
  return out;
}

ClusterStats run_coordinator(Stages& stages, const CoordinatorOptions& options,
                             const ModelConfig& config, const Tokenizer* tokenizer,
                             RequestSource& source, ResultSink& sink) {
  try {
    ChoiceSource choice_source(source);
    ChoiceSink choice_sink(sink);
    Coordinator c(stages, options, config, tokenizer, choice_source, choice_sink);
    return c.run();
  } catch (const std::exception& e) {
    stages.abort(std::string("coordinator failed: ") + e.what());
    throw;
  }
}

}  // namespace strata
