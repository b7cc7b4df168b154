#include "coordinator/coordinator.h"

#include <algorithm>
#include <chrono>
#include <optional>
#include <set>

#include "coordinator/planner.h"
#include "coordinator/scheduler.h"
#include "kernels/error.h"
#include "kernels/log.h"
#include "transport/control_channel.h"
#include "transport/peer_monitor.h"
#include "transport/tensor_channel.h"
#include "worker/dummy.h"

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
  void fail_unfinished(const std::string& why);
  void take_initial_requests();
  void take_requests(std::vector<IncomingRequest> batch);
  std::string validate(const GenerationRequest& r) const;
  void refuse(const GenerationRequest& r, const std::string& error);
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
  std::vector<IncomingRequest> initial_;
  int32_t capacity_ = 0;
  int32_t max_rows_ = 0;
  ClusterPlan plan_;
  std::unique_ptr<TensorLinks> links_;
  std::unique_ptr<RraScheduler> scheduler_;
  std::unique_ptr<PeerMonitor> monitor_;
  uint64_t next_seq_ = 0;
  uint64_t ping_seq_ = 0;
  Clock::time_point last_ping_;
  Clock::time_point started_;
  ClusterStats stats_;
};

ClusterStats Coordinator::run() {
  try {
    return run_plan();
  } catch (const std::exception& e) {
    fail_unfinished(e.what());
    throw;
  }
}

// The cluster failed: every request taken from the source and not finished gets an error
// result saying why, with the tokens it had, so none is lost without a word.
void Coordinator::fail_unfinished(const std::string& why) {
  const std::string error = "not completed: the cluster failed: " + why;
  try {
    for (const IncomingRequest& r : initial_) {
      ++stats_.errors;
      sink_.write(GenerationResult{r.request.id,
                                   r.request.prompt_ids,
                                   {},
                                   StopReason::kError,
                                   r.error.empty() ? error : r.error});
    }
    initial_.clear();
    if (scheduler_ == nullptr) return;
    for (FinishedRequest& f : scheduler_->drain(error)) {
      ++stats_.errors;
      sink_.write(f.result);
    }
  } catch (const std::exception& again) {
    log::get("coordinator")->error("writing the unfinished requests' results: {}", again.what());
  }
}

ClusterStats Coordinator::run_plan() {
  auto log = log::get("coordinator");
  take_initial_requests();
  PlanOptions po{options_.model_spec,
                 static_cast<int32_t>(workers_.size()),
                 options_.micro_batches,
                 options_.kv_slots,
                 capacity_,
                 max_rows_,
                 options_.stage_mem};
  plan_ = make_uniform_plan(config_, po);
  SchedulerOptions so{options_.micro_batches,   options_.decode_iters, options_.kv_slots, capacity_,
                      options_.max_step_tokens, config_.eos_token_ids};
  scheduler_ = std::make_unique<RraScheduler>(so);
  log->info("plan: {}", plan_.str());
  start_workers();
  wait_ready();
  take_requests(std::move(initial_));
  initial_.clear();
  serve();
  stats_.seconds = since(started_);
  shutdown_workers(world_, "all requests done", options_.step_timeout_s);
  collect_stats();
  return stats_;
}

// The requests known at start fix the context (KV capacity) and the step buffers, as
// the single-process generator sizes them.
void Coordinator::take_initial_requests() {
  initial_ = source_.poll(SIZE_MAX);
  int64_t need = 1;
  int32_t longest = 1;
  for (IncomingRequest& r : initial_) {
    tokenize(r, tokenizer_);
    if (!r.error.empty()) continue;
    const auto n = static_cast<int32_t>(r.request.prompt_ids.size());
    longest = std::max(longest, n);
    need = std::max<int64_t>(need, int64_t{n} + std::max(r.request.max_new_tokens - 1, 0));
  }
  const int32_t model_max = config_.max_positions;
  capacity_ = options_.max_context > 0 ? std::min(options_.max_context, model_max)
                                       : static_cast<int32_t>(std::min<int64_t>(need, model_max));
  max_rows_ = std::max({options_.max_step_tokens, options_.kv_slots, std::min(longest, capacity_)});
  stats_.model = options_.model_spec;
  stats_.ranks = world_.size();
  stats_.micro_batches = options_.micro_batches;
  stats_.decode_iters = options_.decode_iters;
}

std::string Coordinator::validate(const GenerationRequest& r) const {
  if (r.prompt_ids.empty()) return "empty prompt: at least one token id is needed";
  for (size_t i = 0; i < r.prompt_ids.size(); ++i) {
    const int32_t t = r.prompt_ids[i];
    if (t < 0 || t >= config_.vocab)
      return fmt::format("prompt token {} at index {} is outside the vocabulary [0, {})", t, i,
                         config_.vocab);
  }
  const auto n = static_cast<int64_t>(r.prompt_ids.size());
  if (n > capacity_)
    return fmt::format("prompt of {} tokens exceeds the context of {} positions", n, capacity_);
  if (n > max_rows_)
    return fmt::format("prompt of {} tokens exceeds the step buffers of {} rows", n, max_rows_);
  return {};
}

void Coordinator::refuse(const GenerationRequest& r, const std::string& error) {
  GenerationResult res;
  res.id = r.id;
  res.prompt_ids = r.prompt_ids;
  res.stop_reason = StopReason::kError;
  res.error = error;
  log::get("coordinator")->warn("request {} refused: {}", r.id, error);
  ++stats_.errors;
  sink_.write(res);
}

void Coordinator::take_requests(std::vector<IncomingRequest> batch) {
  for (IncomingRequest& r : batch) {
    tokenize(r, tokenizer_);
    ++stats_.requests;
    std::string error = r.error.empty() ? validate(r.request) : r.error;
    if (!error.empty()) {
      refuse(r.request, error);
    } else if (r.request.max_new_tokens == 0) {
      sink_.write(
          GenerationResult{r.request.id, r.request.prompt_ids, {}, StopReason::kLength, {}});
    } else {
      stats_.prompt_tokens += static_cast<int64_t>(r.request.prompt_ids.size());
      scheduler_->submit(r.request, next_seq_++);
    }
  }
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
  started_ = Clock::now();
}

void Coordinator::serve() {
  Backoff backoff;
  while (true) {
    if (!source_.exhausted()) take_requests(source_.poll(SIZE_MAX));
    for (int32_t m = 0; m < scheduler_->micro_batches(); ++m) {
      if (scheduler_->in_flight(m)) continue;
      if (std::optional<ScheduledStep> step = scheduler_->next_step(m)) dispatch(*step);
    }
    if (scheduler_->idle() && source_.exhausted()) return;
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
  std::vector<FinishedRequest> done = scheduler_->apply(result);
  if (done.empty()) return;
  FinishedSequences left;
  for (FinishedRequest& f : done) {
    stats_.generated_tokens += static_cast<int64_t>(f.result.output_ids.size());
    left.seqs.push_back(FinishedSequence{f.seq_id, finish_reason(f.result.stop_reason)});
    sink_.write(f.result);
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
      R"("prompt_tokens": {}, "generated_tokens": {}, "prefill_steps": {}, "decode_steps": {}, "seconds": {:.6f}, )"
      R"("tokens_per_s": {:.3f}, "stages": [{}]}})",
      model, ranks, micro_batches, decode_iters, requests, errors, prompt_tokens, generated_tokens,
      prefill_steps, decode_steps, seconds, tokens_per_second(), stages_json);
}

std::string ClusterStats::table() const {
  std::string out = fmt::format(
      "{} ranks, {} micro-batches, N_D {}: {} requests ({} refused), {} tokens generated in {:.3f} "
      "s = {:.1f} tok/s "
      "({} prefill + {} decode steps)\n",
      ranks, micro_batches, decode_iters, requests, errors, generated_tokens, seconds,
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
