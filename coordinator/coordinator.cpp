#include "coordinator/coordinator.h"

#include <algorithm>
#include <chrono>
#include <optional>
#include <set>
#include <unordered_set>

#include "coordinator/planner.h"
#include "coordinator/scheduler.h"
#include "kernels/error.h"
#include "kernels/log.h"
#include "transport/control_channel.h"
#include "transport/peer_monitor.h"
#include "transport/tensor_channel.h"
#include "worker/dummy.h"
#include "worker/request_rules.h"

namespace strata {
namespace {

using Clock = std::chrono::steady_clock;

FinishReason finish_reason(StopReason r) {
  switch (r) {
    case StopReason::kEos:
      return FinishReason::kEos;
    case StopReason::kLength:
      return FinishReason::kLength;
    case StopReason::kContext:
      return FinishReason::kContext;
    case StopReason::kError:
      return FinishReason::kError;
    case StopReason::kStop:
      return FinishReason::kStop;
  }
  return FinishReason::kError;
}

double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

std::chrono::milliseconds ms(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

class Coordinator {
 public:
  Coordinator(const Communicator& world, const CoordinatorOptions& o, const ModelConfig& config,
              const Tokenizer& tokenizer, RequestSource& source, ResultSink& sink)
      : world_(world),
        options_(o),
        config_(config),
        tokenizer_(tokenizer),
        source_(source),
        sink_(sink),
        control_(world) {
    for (int r = 1; r < world.size(); ++r) workers_.push_back(r);
  }

  ClusterStats run();

 private:
  ClusterStats run_plan();
  void size_run();
  void end_unfinished(const std::string& why, bool failed);
  void flush_results(double seconds);
  void admit();
  void take(IncomingRequest r);
  void submit(const IncomingRequest& r);
  std::string validate(const GenerationRequest& r) const;
  void refuse(const GenerationRequest& r, const std::string& error);
  bool stop_requested() const;
  void begin_stop();
  void start_workers();
  void wait_ready();
  void serve();
  void dispatch(const ScheduledStep& step);
  void on_message(const Received& r);
  void on_result(const StepResult& result);
  void ping_workers();
  void check_alive() const;
  [[noreturn]] void on_error_report(const ErrorReport& report);
  void collect_stats();
  int last_rank() const { return plan_.stages.back().rank; }

  const Communicator& world_;
  CoordinatorOptions options_;
  const ModelConfig& config_;
  const Tokenizer& tokenizer_;
  RequestSource& source_;
  ResultSink& sink_;
  ControlChannel control_;
  std::vector<int> workers_;
  std::optional<Deadline> grace_;  // set when a stop signal came
  std::unordered_set<std::string> ids_seen_;
  int32_t capacity_ = 0;
  int32_t max_rows_ = 0;
  ClusterPlan plan_;
  std::unique_ptr<TensorLinks> links_;
  std::unique_ptr<RraScheduler> scheduler_;
  std::unique_ptr<PeerMonitor> monitor_;
  uint64_t next_seq_ = 0;
  uint64_t ping_seq_ = 0;
  Clock::time_point last_ping_;
  std::optional<Clock::time_point> first_step_;  // the run's time: first step sent ...
  Clock::time_point last_result_;                // ... to the last result in (idle excluded)
  ClusterStats stats_;
};

ClusterStats Coordinator::run() {
  try {
    return run_plan();
  } catch (const std::exception& e) {
    end_unfinished(std::string("not completed: the cluster failed: ") + e.what(), true);
    flush_results(std::min(options_.flush_timeout_s, 5.0));
    throw;
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

ClusterStats Coordinator::run_plan() {
  auto log = log::get("coordinator");
  size_run();
  PlanOptions po{options_.model_spec,
                 static_cast<int32_t>(workers_.size()),
                 options_.micro_batches,
                 options_.kv_slots,
                 capacity_,
                 max_rows_,
                 options_.stage_mem,
                 options_.placement};
  plan_ = make_uniform_plan(config_, po);
  SchedulerOptions so{options_.micro_batches,   options_.decode_iters, options_.kv_slots, capacity_,
                      options_.max_step_tokens, config_.eos_token_ids, &tokenizer_,       {}};
  scheduler_ = std::make_unique<RraScheduler>(so);
  log->info("plan: {}", plan_.str());
  start_workers();
  wait_ready();
  serve();
  if (first_step_)
    stats_.seconds = std::chrono::duration<double>(last_result_ - *first_step_).count();
  shutdown_workers(world_, grace_ ? "stopped" : "all requests done", options_.step_timeout_s);
  collect_stats();
  if (!sink_.flush(Deadline::after_seconds(options_.flush_timeout_s)))
    fail(ErrorKind::kDisconnected,
         "results not all stored within {} s (--flush-timeout); their requests were not "
         "acknowledged and will run again",
         options_.flush_timeout_s);
  return stats_;
}

// The run's context and step buffers come from the configuration, never from the first
// requests seen: a queue may start empty and fill later.
void Coordinator::size_run() {
  const int32_t model_max = config_.max_positions;
  capacity_ = options_.max_context > 0 ? std::min(options_.max_context, model_max) : model_max;
  if (options_.max_context > model_max)
    log::get("coordinator")
        ->warn("--max-context {} exceeds the model's {} positions; using {}", options_.max_context,
               model_max, model_max);
  max_rows_ = std::max(options_.max_step_tokens, options_.kv_slots);
  stats_.model = options_.model_spec;
  stats_.ranks = world_.size();
  stats_.micro_batches = options_.micro_batches;
  stats_.decode_iters = options_.decode_iters;
}

std::string Coordinator::validate(const GenerationRequest& r) const {
  std::string error = validate_request(r, config_.vocab, capacity_, &tokenizer_);
  if (error.empty() && static_cast<int64_t>(r.prompt_ids.size()) > max_rows_)
    error = fmt::format(
        "prompt of {} tokens exceeds the {} rows of a prefill step (--max-step-tokens): the "
        "cluster prefills a prompt in one step",
        r.prompt_ids.size(), max_rows_);
  return error;
}

void Coordinator::refuse(const GenerationRequest& r, const std::string& error) {
  GenerationResult res;
  res.id = r.id;
  res.prompt_ids = r.prompt_ids;
  res.stop_reason = StopReason::kError;
  res.error = error;
  res.error_kind = ErrorKind::kInvalidInput;
  log::get("coordinator")->warn("request {} refused: {}", r.id, error);
  ++stats_.errors;
  sink_.write(res);
}

bool Coordinator::stop_requested() const {
  return options_.stop_signal != nullptr && options_.stop_signal->load() != 0;
}

// A stop signal: nothing more is admitted; what the source read and the coordinator holds
// but has not started is unfinished at once; the running requests get the grace period.
void Coordinator::begin_stop() {
  stats_.stop_signal = options_.stop_signal->load();
  const std::string why =
      fmt::format("not started: the job was stopped (signal {})", stats_.stop_signal);
  for (IncomingRequest& r : source_.stop()) {
    tokenize(r, tokenizer_);
    ++stats_.requests;
    if (!r.error.empty()) {
      refuse(r.request, r.error);
      continue;
    }
    ++stats_.unfinished;
    sink_.unfinished(
        GenerationResult{r.request.id, r.request.prompt_ids, {}, StopReason::kError, why}, false);
  }
  grace_ = Deadline::after_seconds(options_.grace_period_s);
  log::get("coordinator")
      ->warn("signal {}: admitting nothing more; the requests running get {} s to finish",
             stats_.stop_signal, options_.grace_period_s);
}

// Backpressure: only as many requests are taken from the source as can wait for the next
// prefill (one batch); the source keeps the rest.
void Coordinator::admit() {
  if (!grace_) {
    const auto window = static_cast<size_t>(options_.kv_slots);
    const size_t have = scheduler_->waiting();
    if (have < window) {
      const Clock::time_point t0 = Clock::now();
      for (IncomingRequest& r : source_.poll(window - have)) take(std::move(r));
      stats_.intake_seconds += since(t0);
    }
  }
}

void Coordinator::take(IncomingRequest r) {
  tokenize(r, tokenizer_);
  ++stats_.requests;
  if (!ids_seen_.insert(r.request.id).second) {
    ++stats_.duplicate_ids;
    log::get("coordinator")
        ->warn("request id {} was seen before in this run ({})", r.request.id, r.where);
  }
  const std::string error = r.error.empty() ? validate(r.request) : r.error;
  if (!error.empty()) return refuse(r.request, error);
  if (r.request.max_new_tokens == 0) {
    GenerationResult done{r.request.id, r.request.prompt_ids, {}, StopReason::kLength, {}};
    const double waited = std::max(0.0, wall_seconds() - r.arrival);
    done.times = RequestTimes{waited, -1, waited};
    sink_.write(done);
    return;
  }
  // A request redelivered after a failed run (deliveries > 1) arrives alone: the source
  // holds nothing else while it runs (RedisQueue::recover), so it is admitted as any other.
  submit(r);
}

void Coordinator::submit(const IncomingRequest& r) {
  stats_.prompt_tokens += static_cast<int64_t>(r.request.prompt_ids.size());
  scheduler_->submit(r.request, next_seq_++, r.arrival);
}

void Coordinator::start_workers() {
  const Deadline deadline = Deadline::after_seconds(options_.load_timeout_s);
  for (int r : workers_) control_.send(r, plan_, deadline);
  links_ = std::make_unique<TensorLinks>(TensorLinks::create(world_, -1, deadline));
}

// Every stage answers a ping once it has loaded its layers; a load failure comes back as an
// ErrorReport and ends the run at once.
void Coordinator::wait_ready() {
  const Deadline deadline = Deadline::after_seconds(options_.load_timeout_s);
  const uint64_t seq = ++ping_seq_;
  for (int r : workers_) control_.send(r, Heartbeat{0, seq, false}, deadline);
  std::set<int> waiting(workers_.begin(), workers_.end());
  while (!waiting.empty()) {
    Received r = control_.recv(kAnySource, deadline,
                               fmt::format("stages {} to load", fmt::join(waiting, ", ")));
    if (auto* e = std::get_if<ErrorReport>(&r.message)) e->raise();
    if (auto* h = std::get_if<Heartbeat>(&r.message); h && h->reply && h->sequence == seq)
      waiting.erase(r.source);
  }
  log::get("coordinator")->info("all {} stages loaded", workers_.size());
  monitor_ = std::make_unique<PeerMonitor>(workers_, ms(options_.heartbeat_timeout_s));
  last_ping_ = Clock::now();
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
    for (int32_t m = 0; m < scheduler_->micro_batches(); ++m) {
      if (scheduler_->in_flight(m)) continue;
      if (std::optional<ScheduledStep> step = scheduler_->next_step(m)) dispatch(*step);
    }
    if (scheduler_->idle() && (grace_ || source_.exhausted())) return;
    if (std::optional<Received> r =
            control_.try_recv(kAnySource, Deadline::after_seconds(options_.step_timeout_s))) {
      on_message(*r);
      backoff = Backoff();
      continue;
    }
    if (since(last_ping_) >= options_.heartbeat_interval_s) ping_workers();
    check_alive();
    backoff.pause();
  }
}

void Coordinator::dispatch(const ScheduledStep& step) {
  const Deadline deadline = Deadline::after_seconds(options_.step_timeout_s);
  if (!first_step_) first_step_ = Clock::now();
  if (!step.joins.empty()) control_.send(last_rank(), BatchUpdate{step.joins, {}}, deadline);
  StepCommand bare = step.command;  // later stages need no token ids
  for (SeqStep& s : bare.seqs) s.token_ids.clear();
  for (const StagePlan& s : plan_.stages)
    control_.send(s.rank, s.has_embedding ? step.command : bare, deadline);
  if (step.command.phase == Phase::kPrefill) {
    ++stats_.prefill_steps;
  } else {
    ++stats_.decode_steps;
  }
}

void Coordinator::on_message(const Received& r) {
  monitor_->heard_from(r.source);
  if (auto* result = std::get_if<StepResult>(&r.message)) {
    on_result(*result);
  } else if (auto* report = std::get_if<ErrorReport>(&r.message)) {
    on_error_report(*report);
  } else if (!std::holds_alternative<Heartbeat>(r.message)) {
    fail(ErrorKind::kFailed, "unexpected {} from rank {} while serving", message_name(r.message),
         r.source);
  }
}

void Coordinator::on_result(const StepResult& result) {
  last_result_ = Clock::now();
  std::vector<FinishedRequest> done = scheduler_->apply(result);
  if (done.empty()) return;
  FinishedSequences left;
  for (FinishedRequest& f : done) {
    stats_.generated_tokens += static_cast<int64_t>(f.result.output_ids.size());
    left.seqs.push_back(FinishedSequence{f.seq_id, finish_reason(f.result.stop_reason)});
    const Clock::time_point t0 = Clock::now();
    sink_.write(f.result);
    stats_.result_seconds += since(t0);
  }
  control_.send(last_rank(), left, Deadline::after_seconds(options_.step_timeout_s));
}

void Coordinator::ping_workers() {
  const uint64_t seq = ++ping_seq_;
  for (int r : workers_)
    control_.send(r, Heartbeat{0, seq, false}, Deadline::after_seconds(options_.step_timeout_s));
  last_ping_ = Clock::now();
}

void Coordinator::check_alive() const {
  const std::optional<int> silent = monitor_->silent_rank();
  if (!silent) return;
  const StagePlan* stage = plan_.stage_of_rank(*silent);
  try {
    monitor_->check();
  } catch (const Error& e) {
    fail(ErrorKind::kDisconnected, "worker rank {} (stage layers [{}, {})) is dead or hung: {}",
         *silent, stage ? stage->layer_begin : -1, stage ? stage->layer_end : -1, e.what());
  }
}

// A worker's error is often a symptom (a send to a rank that died): ask every worker for
// a sign of life first, and name the ones that give none.
void Coordinator::on_error_report(const ErrorReport& report) {
  log::get("coordinator")->error("{}", report.str());
  std::vector<int> others;
  for (int r : workers_)
    if (r != report.rank) others.push_back(r);
  std::vector<Received> other;
  try {
    ping_all(control_, others, ++ping_seq_, *monitor_,
             Deadline::after_seconds(std::min(options_.heartbeat_timeout_s, 5.0)), other);
  } catch (const Error& e) {
    fail(ErrorKind::kDisconnected, "{}; rank {} reported: {}", e.what(), report.rank,
         report.message);
  }
  report.raise();
}

void Coordinator::collect_stats() {
  std::set<int> waiting(workers_.begin(), workers_.end());
  const Deadline deadline = Deadline::after_seconds(options_.step_timeout_s);
  while (!waiting.empty()) {
    Received r = control_.recv(kAnySource, deadline, "stage statistics");
    auto* s = std::get_if<StageStats>(&r.message);
    if (s == nullptr) continue;  // late pings and such
    const StagePlan* stage = plan_.stage_of_rank(r.source);
    if (stage != nullptr) stats_.stages.push_back(StageReport{*stage, *s});
    waiting.erase(r.source);
  }
  std::sort(stats_.stages.begin(), stats_.stages.end(),
            [](const StageReport& a, const StageReport& b) { return a.stage.rank < b.stage.rank; });
}

}  // namespace

double StageReport::bubble_fraction() const {
  return stats.window_seconds > 0 ? stats.idle_seconds / stats.window_seconds : 0.0;
}

double ClusterStats::tokens_per_second() const {
  return seconds > 0 ? static_cast<double>(generated_tokens) / seconds : 0.0;
}

std::string ClusterStats::json() const {
  std::string stages_json;
  for (const StageReport& s : stages) {
    stages_json += fmt::format(
        R"({}{{"rank": {}, "layers": [{}, {}], "steps": {}, "rows": {}, "busy_seconds": {:.6f}, )"
        R"("idle_seconds": {:.6f}, "window_seconds": {:.6f}, "bubble_fraction": {:.4f}}})",
        stages_json.empty() ? "" : ", ", s.stage.rank, s.stage.layer_begin, s.stage.layer_end,
        s.stats.steps, s.stats.rows, s.stats.busy_seconds, s.stats.idle_seconds,
        s.stats.window_seconds, s.bubble_fraction());
  }
  return fmt::format(
      R"({{"model": "{}", "ranks": {}, "micro_batches": {}, "decode_iters": {}, "requests": {}, "errors": {}, )"
      R"("unfinished": {}, "duplicate_ids": {}, "stop_signal": {}, "intake_seconds": {:.6f}, )"
      R"("result_seconds": {:.6f}, )"
      R"("prompt_tokens": {}, "generated_tokens": {}, "prefill_steps": {}, "decode_steps": {}, "seconds": {:.6f}, )"
      R"("tokens_per_s": {:.3f}, "stages": [{}]}})",
      model, ranks, micro_batches, decode_iters, requests, errors, unfinished, duplicate_ids,
      stop_signal, intake_seconds, result_seconds, prompt_tokens, generated_tokens, prefill_steps,
      decode_steps, seconds, tokens_per_second(), stages_json);
}

std::string ClusterStats::table() const {
  std::string out = fmt::format(
      "{} ranks, {} micro-batches, N_D {}: {} requests ({} refused, {} unfinished), {} tokens "
      "generated in {:.3f} s = {:.1f} tok/s ({} prefill + {} decode steps)\n",
      ranks, micro_batches, decode_iters, requests, errors, unfinished, generated_tokens, seconds,
      tokens_per_second(), prefill_steps, decode_steps);
  out += "  rank  layers      steps   busy s   idle s  bubble\n";
  for (const StageReport& s : stages)
    out += fmt::format("  {:>4}  [{:>3}, {:>3})  {:>6}  {:>7.3f}  {:>7.3f}  {:>5.1f}%\n",
                       s.stage.rank, s.stage.layer_begin, s.stage.layer_end, s.stats.steps,
                       s.stats.busy_seconds, s.stats.idle_seconds, 100 * s.bubble_fraction());
  return out;
}

ModelConfig load_plan_config(const std::string& spec, DType dummy_dtype) {
  if (spec.empty()) fail_input("no model given: pass a model directory or dummy:NAME");
  return is_dummy_model(spec) ? dummy_model_config(spec.substr(6), dummy_dtype)
                              : load_model_config(spec);
}

ClusterStats run_coordinator(const Communicator& world, const CoordinatorOptions& options,
                             const ModelConfig& config, const Tokenizer& tokenizer,
                             RequestSource& source, ResultSink& sink) {
  try {
    Coordinator c(world, options, config, tokenizer, source, sink);
    return c.run();
  } catch (const std::exception& e) {
    shutdown_workers(world, std::string("coordinator failed: ") + e.what(), 1.0);
    throw;
  }
}

void shutdown_workers(const Communicator& world, const std::string& reason, double seconds) {
  ControlChannel control(world);
  for (int r = 1; r < world.size(); ++r) {
    try {
      control.send(r, Shutdown{reason}, Deadline::after_seconds(seconds));
    } catch (const Error& e) {
      log::get("coordinator")->warn("shutdown of rank {}: {}", r, e.what());
    }
  }
}

}  // namespace strata
