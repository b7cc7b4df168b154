#include "coordinator/run/mpi_stages.h"

#include <algorithm>
#include <map>
#include <set>

#include "kernels/clock.h"
#include "kernels/error.h"
#include "kernels/log.h"

namespace strata {
namespace {

using Clock = std::chrono::steady_clock;

std::chrono::milliseconds ms(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

}  // namespace

MpiStages::MpiStages(const Communicator& world, const MpiStagesOptions& options)
    : world_(world), options_(options), control_(world) {
  for (int r = 1; r < world.size(); ++r) workers_.push_back(r);
}

void MpiStages::start(const ClusterPlan& plan) {
  plan_ = plan;
  live_.clear();
  const Deadline deadline = Deadline::after_seconds(options_.load_timeout_s);
  for (int r : workers_) control_.send(r, plan_, deadline);
  links_ = std::make_unique<TensorLinks>(TensorLinks::create(world_, -1, deadline));
  wait_ready();
}

// Every stage answers a ping once it has loaded its layers; a load failure comes back as an
// ErrorReport and ends the run at once, and so does a stop signal (loads can take minutes).
void MpiStages::wait_ready() {
  const Deadline deadline = Deadline::after_seconds(options_.load_timeout_s);
  const uint64_t seq = ++ping_seq_;
  for (int r : workers_) control_.send(r, Heartbeat{0, seq, false}, deadline);
  std::set<int> waiting(workers_.begin(), workers_.end());
  while (!waiting.empty()) {
    Received r = recv_watching(waiting, deadline,
                               fmt::format("stages {} to load", fmt::join(waiting, ", ")), true);
    if (auto* e = std::get_if<ErrorReport>(&r.message)) e->raise();
    if (auto* h = std::get_if<Heartbeat>(&r.message); h && h->reply && h->sequence == seq)
      waiting.erase(r.source);
  }
  log::get("coordinator")->info("all {} stages loaded", workers_.size());
  monitor_ = std::make_unique<PeerMonitor>(workers_, ms(options_.heartbeat_timeout_s));
  last_ping_ = Clock::now();
  // From here the run loop names a lost worker itself (check_alive), so that every request
  // it holds is answered or handed back before the job ends.
  if (options_.links != nullptr) options_.links->on_lost(nullptr);
}

// The next control message from any rank, while watching the links of the ranks in
// `awaited` and, when `stoppable`, the stop signal.
Received MpiStages::recv_watching(const std::set<int>& awaited, const Deadline& deadline,
                                  const std::string& what, bool stoppable) {
  Backoff backoff;
  while (true) {
    if (std::optional<Received> r = control_.try_recv(kAnySource, deadline)) return *r;
    check_links(&awaited);
    if (stoppable && options_.stop_signal != nullptr && options_.stop_signal->load() != 0)
      fail(ErrorKind::kFailed, "stopped by signal {} while waiting for {}",
           options_.stop_signal->load(), what);
    if (deadline.expired()) fail_timeout(deadline, "any rank", what);
    backoff.pause();
  }
}

// A step goes to the pipeline that runs its phase: every stage (RRA), or one side (WAA).
void MpiStages::dispatch(const ScheduledStep& step) {
  const Deadline deadline = Deadline::after_seconds(options_.step_timeout_s);
  const Phase phase = step.command.phase;
  if (!step.joins.empty()) control_.send(last_rank(phase), BatchUpdate{step.joins, {}}, deadline);
  StepCommand bare = step.command;  // later stages need no token ids
  for (SeqStep& s : bare.seqs) s.token_ids.clear();
  for (const StagePlan& s : plan_.pipeline(phase))
    for (int32_t r : s.ranks())  // every member of a tensor-parallel group runs the step
      control_.send(r, s.has_embedding ? step.command : bare, deadline);
}

// The decode pipeline's last stage samples a running sequence (a WAA prefill stage forgets
// a sequence once it has sampled its first token).
void MpiStages::leave(const std::vector<uint64_t>& seq_ids) {
  control_.send(last_rank(Phase::kDecode), BatchUpdate{{}, seq_ids},
                Deadline::after_seconds(options_.step_timeout_s));
}

void MpiStages::hand_over(const KvHandover& handover) {
  if (!plan_.waa()) Stages::hand_over(handover);
  const Deadline deadline = Deadline::after_seconds(options_.step_timeout_s);
  handovers_[handover.handover_id] = Handover{};
  for (const StagePlan& s : plan_.stages) control_.send(s.rank, handover, deadline);
}

void MpiStages::on_handover_done(const KvHandoverDone& done) {
  auto it = handovers_.find(done.handover_id);
  if (it == handovers_.end())
    fail(ErrorKind::kFailed, "rank {} finished KV hand-over {}, which is not in progress",
         done.rank, done.handover_id);
  const StagePlan* stage = plan_.stage_of_rank(done.rank);
  if (stage != nullptr && plan_.encoder(*stage)) it->second.bytes += done.bytes;
  if (++it->second.acks < plan_.stages.size()) return;
  handovers_done_.push_back(HandoverDone{done.handover_id, it->second.bytes});
  handovers_.erase(it);
}

std::vector<HandoverDone> MpiStages::handovers_done() {
  return std::exchange(handovers_done_, {});
}

std::optional<StepResult> MpiStages::poll() {
  check_links(nullptr);
  if (std::optional<Received> r =
          control_.try_recv(kAnySource, Deadline::after_seconds(options_.step_timeout_s))) {
    on_message(*r);
    return std::exchange(result_, std::nullopt);
  }
  if (seconds_since(last_ping_) >= options_.heartbeat_interval_s) ping_workers();
  check_alive();
  return std::nullopt;
}

void MpiStages::on_message(const Received& r) {
  monitor_->heard_from(r.source);
  if (auto* result = std::get_if<StepResult>(&r.message)) {
    result_ = *result;
  } else if (auto* done = std::get_if<KvHandoverDone>(&r.message)) {
    on_handover_done(*done);
  } else if (auto* report = std::get_if<ErrorReport>(&r.message)) {
    on_error_report(*report);
  } else if (auto* beat = std::get_if<Heartbeat>(&r.message)) {
    if (beat->reply && beat->stats) live_[r.source] = *beat->stats;
  } else {
    fail(ErrorKind::kFailed, "unexpected {} from rank {} while serving", message_name(r.message),
         r.source);
  }
}

void MpiStages::ping_workers() {
  const uint64_t seq = ++ping_seq_;
  for (int r : workers_)
    control_.send(r, Heartbeat{0, seq, false}, Deadline::after_seconds(options_.step_timeout_s));
  last_ping_ = Clock::now();
}

std::string MpiStages::describe(int rank) const {
  const StagePlan* stage = plan_.stage_of_rank(rank);
  const char* role = stage != nullptr && stage->tp_degree() > 1 ? "tensor-parallel stage"
                     : !plan_.waa() || stage == nullptr         ? "stage"
                     : plan_.encoder(*stage)                    ? "prefill stage"
                                                                : "decode stage";
  return fmt::format("worker rank {} ({} layers [{}, {}))", rank, role,
                     stage ? stage->layer_begin : -1, stage ? stage->layer_end : -1);
}

// A lost link of a rank in `awaited` (nullptr: any worker) ends the wait.
void MpiStages::check_links(const std::set<int>* awaited) const {
  if (options_.links == nullptr) return;
  const std::optional<int> lost = options_.links->lost();
  if (!lost || (awaited != nullptr && !awaited->contains(*lost))) return;
  fail(ErrorKind::kDisconnected,
       "{} is dead: its process ended (its liveness link to rank 0 closed){}", describe(*lost),
       handovers_.empty() ? ""
                          : fmt::format(" ({} KV hand-overs were in progress)", handovers_.size()));
}

void MpiStages::check_alive() const {
  check_links(nullptr);
  const std::optional<int> silent = monitor_->silent_rank();
  if (!silent) return;
  try {
    monitor_->check();
  } catch (const Error& e) {
    fail(ErrorKind::kDisconnected, "{} is dead or hung: {}{}", describe(*silent), e.what(),
         handovers_.empty()
             ? ""
             : fmt::format(" ({} KV hand-overs were in progress)", handovers_.size()));
  }
}

// A worker's error is often a symptom (a send to a rank that died): ask every worker for
// a sign of life first, and name the ones that give none.
void MpiStages::on_error_report(const ErrorReport& report) {
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

namespace {

std::vector<StageReport> by_rank(std::vector<StageReport> reports) {
  std::sort(reports.begin(), reports.end(),
            [](const StageReport& a, const StageReport& b) { return a.rank() < b.rank(); });
  return reports;
}

}  // namespace

std::vector<StageReport> MpiStages::live() const {
  std::vector<StageReport> reports;
  for (const auto& [rank, stats] : live_)
    if (const StagePlan* stage = plan_.stage_of_rank(rank))
      reports.push_back(StageReport{*stage, stats});
  return by_rank(std::move(reports));
}

std::vector<StageReport> MpiStages::finish(const std::string& reason) {
  shutdown_workers(world_, reason, options_.step_timeout_s);
  std::set<int> waiting(workers_.begin(), workers_.end());
  const Deadline deadline = Deadline::after_seconds(options_.step_timeout_s);
  std::vector<StageReport> reports;
  while (!waiting.empty()) {
    Received r = recv_watching(waiting, deadline, "stage statistics", false);
    auto* s = std::get_if<StageStats>(&r.message);
    if (s == nullptr) continue;  // late pings and such
    if (const StagePlan* stage = plan_.stage_of_rank(r.source))
      reports.push_back(StageReport{*stage, *s});
    waiting.erase(r.source);
  }
  return by_rank(std::move(reports));
}

// Every worker times its stage and its link, answering pings meanwhile; the coordinator
// keeps pinging (a worker takes a silent coordinator for a dead one) until every report is
// in. Then the round trip to the last stage, polled as the run loop polls for results.
ProfileResult MpiStages::profile(const ProfileRequest& request) {
  const Deadline deadline = Deadline::after_seconds(options_.load_timeout_s);
  for (int r : workers_) control_.send(r, request, deadline);
  std::map<int, ProfileReport> reports;
  Backoff backoff;
  while (reports.size() < workers_.size()) {
    if (deadline.expired())
      fail(ErrorKind::kDisconnected, "profiling: {} of {} stages reported within {} s",
           reports.size(), workers_.size(), options_.load_timeout_s);
    if (std::optional<Received> r =
            control_.try_recv(kAnySource, Deadline::after_seconds(options_.step_timeout_s))) {
      monitor_->heard_from(r->source);
      if (auto* report = std::get_if<ProfileReport>(&r->message)) {
        reports[r->source] = *report;
      } else if (auto* e = std::get_if<ErrorReport>(&r->message)) {
        on_error_report(*e);
      }
      backoff = Backoff();
      continue;
    }
    if (seconds_since(last_ping_) >= options_.heartbeat_interval_s) ping_workers();
    check_alive();
    backoff.pause();
  }
  ProfileResult out;
  for (const StagePlan& s : plan_.stages) out.reports.push_back(reports.at(s.rank));
  constexpr int kTrips = 8;
  double total = 0;
  for (int i = 0; i < kTrips; ++i) {
    const uint64_t seq = ++ping_seq_;
    const auto t0 = Clock::now();
    const int last = last_rank(Phase::kDecode);
    control_.send(last, Heartbeat{0, seq, false}, deadline);
    Backoff wait;
    while (true) {
      std::optional<Received> r = control_.try_recv(last, deadline);
      if (r) {
        if (auto* h = std::get_if<Heartbeat>(&r->message); h && h->reply && h->sequence == seq)
          break;
        continue;
      }
      if (deadline.expired()) fail(ErrorKind::kDisconnected, "profiling: no ping reply in time");
      wait.pause();
    }
    total += seconds_since(t0);
  }
  out.round_trip_s = total / kTrips;
  last_ping_ = Clock::now();
  return out;
}

void MpiStages::abort(const std::string& reason) noexcept {
  try {
    shutdown_workers(world_, reason, 1.0);
  } catch (const std::exception& e) {
    log::get("coordinator")->error("stopping the workers: {}", e.what());
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
