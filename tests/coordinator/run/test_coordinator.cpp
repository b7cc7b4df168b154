// The coordinator's loop in one process, over stages that misbehave on purpose: whatever
// the stages do (die mid-run, answer a step wrongly, fail to load), every request read
// comes back exactly once, finished or unfinished with why, and the run ends with the
// error instead of hanging. A stop signal ends the run within its grace period.
#include <gtest/gtest.h>

#include <atomic>
#include <map>

#include "coordinator/run/coordinator.h"
#include "worker/dummy.h"

namespace strata {
namespace {

// Requests held in memory, as a queue that has them all at once.
class ListSource final : public RequestSource {
 public:
  explicit ListSource(std::vector<GenerationRequest> requests) : requests_(std::move(requests)) {}
  std::vector<IncomingRequest> poll(size_t max) override {
    std::vector<IncomingRequest> out;
    while (next_ < requests_.size() && out.size() < max) {
      IncomingRequest r;
      r.request = requests_[next_++];
      r.where = "test";
      r.arrival = wall_seconds();
      out.push_back(std::move(r));
    }
    return out;
  }
  bool exhausted() const override { return next_ == requests_.size(); }
  std::vector<IncomingRequest> stop() override { return poll(SIZE_MAX); }
  size_t read() const { return next_; }

 private:
  std::vector<GenerationRequest> requests_;
  size_t next_ = 0;
};

struct Answer {
  GenerationResult result;
  bool unfinished = false;
  bool suspect = false;
};

class RecordingSink final : public ResultSink {
 public:
  void write(const GenerationResult& r) override { add(Answer{r, false, false}); }
  void unfinished(const GenerationResult& r, bool suspect) override {
    add(Answer{r, true, suspect});
  }
  bool flush(const Deadline&) override { return true; }
  std::map<std::string, Answer> answers;
  int duplicates = 0;

 private:
  void add(const Answer& a) { duplicates += !answers.emplace(a.result.id, a).second; }
};

// Stages that answer token 7 for every sampling sequence, and fail as told.
class FaultyStages final : public Stages {
 public:
  int64_t die_at_step = -1;            // poll() throws once this many steps were dispatched
  int64_t wrong_count_at = -1;         // the result of this step carries one token too many
  bool fail_start = false;             // loading fails
  std::atomic<int>* signal = nullptr;  // set to SIGTERM at step `signal_at`
  int64_t signal_at = -1;
  int64_t dispatched = 0;
  int64_t scheduled = 0;  // steps of requests (not the profiler's probes)
  std::vector<uint64_t> left;

  int32_t count() const override { return 2; }
  int32_t ranks() const override { return 3; }
  void start(const ClusterPlan& plan) override {
    if (fail_start) fail(ErrorKind::kFailed, "rank 2: cannot load {}", plan.model_spec);
    plans.push_back(plan);
  }
  std::vector<ClusterPlan> plans;  // every plan started, re-deployments included
  void dispatch(const ScheduledStep& step) override {
    ++dispatched;
    // The scheduler numbers steps from 1; the profiler's probe steps count down from the top.
    if (step.command.step_id < (uint64_t{1} << 63)) ++scheduled;
    if (signal != nullptr && dispatched == signal_at) signal->store(15);
    StepResult r{step.command.step_id, step.command.micro_batch, {}};
    for (const SeqStep& s : step.command.seqs)
      if (s.sample) r.tokens.push_back(SeqToken{s.seq_id, 7});
    if (dispatched == wrong_count_at) r.tokens.push_back(SeqToken{999, 7});
    results_.push_back(r);
  }
  void leave(const std::vector<uint64_t>& ids) override {
    left.insert(left.end(), ids.begin(), ids.end());
  }
  std::optional<StepResult> poll() override {
    if (die_at_step >= 0 && dispatched >= die_at_step)
      fail(ErrorKind::kDisconnected, "worker rank 2 is dead or hung");
    if (results_.empty()) return std::nullopt;
    StepResult r = results_.front();
    results_.erase(results_.begin());
    return r;
  }
  std::vector<StageReport> finish(const std::string&) override { return {}; }
  std::vector<StageReport> live() const override { return {}; }
  // Every stage's layers cost `layer_seconds` at every point; nothing else costs anything.
  ProfileResult profile(const ProfileRequest& r) override {
    ++profiled;
    ProfileResult out;
    for (int32_t rank = 1; rank <= count(); ++rank) {
      ProfileReport rep;
      rep.rank = rank;
      rep.host = "fake";
      rep.layers = 1;
      const double t = layer_seconds * (rank == 2 ? rank2_factor : 1.0);
      rep.prefill_seconds.assign(r.prefill_rows.size() * r.prefill_lengths.size(), t);
      rep.decode_seconds.assign(r.decode_seqs.size() * r.decode_contexts.size(), t);
      if (rank == 1) rep.embed_seconds.assign(r.embed_rows.size(), 0.0);
      if (rank == count()) rep.head_seconds.assign(r.head_rows.size(), 0.0);
      if (rank < count()) rep.transfer_seconds.assign(r.transfer_rows.size(), link_seconds);
      out.reports.push_back(rep);
    }
    return out;
  }
  void abort(const std::string&) noexcept override { ++aborted; }
  int aborted = 0;
  int profiled = 0;
  double layer_seconds = 1e-3;
  double rank2_factor = 1.0;  // rank 2's layers cost this many times rank 1's
  double link_seconds = 0;    // every transfer between ranks, whatever its size

 private:
  std::vector<StepResult> results_;
};

std::vector<GenerationRequest> requests(int n, int32_t max_new) {
  std::vector<GenerationRequest> out;
  for (int i = 0; i < n; ++i) {
    GenerationRequest r;
    r.id = "r" + std::to_string(i);
    r.prompt_ids = {1, 2, 3, static_cast<int32_t>(4 + i)};
    r.max_new_tokens = max_new;
    r.ignore_eos = true;
    out.push_back(r);
  }
  return out;
}

CoordinatorOptions options() {
  CoordinatorOptions o;
  o.model_spec = "dummy:llama-110m";
  o.micro_batches = 2;
  o.decode_iters = 2;
  o.kv_slots = 4;
  o.max_step_tokens = 8;
  o.max_context = 64;
  o.grace_period_s = 0;
  return o;
}

struct LoopRun {
  ModelConfig config = dummy_model_config("llama-110m");
  ListSource source;
  RecordingSink sink;
  explicit LoopRun(std::vector<GenerationRequest> r) : source(std::move(r)) {}
  ClusterStats go(FaultyStages& stages, const CoordinatorOptions& o = options()) {
    return run_coordinator(stages, o, config, nullptr, source, sink);
  }
};

// Step results at 0.1 .. 0.5 s (4, 4, 4, 2, 1 tokens); the window counts those in (from, to].
// The coordinator keeps only running totals (TokenTally): the total after the result at the
// first finish, and at the end of admissions, as it would have seen them.
const std::vector<std::pair<double, size_t>> kTokenLog = {
    {0.1, 4}, {0.2, 4}, {0.3, 4}, {0.4, 2}, {0.5, 1}};

TokenTally tally_of(double first_finish_s, double admissions_end_s) {
  TokenTally t;
  for (const auto& [when, n] : kTokenLog) {
    if (admissions_end_s >= 0 && when > admissions_end_s && t.at_admissions_end < 0)
      t.at_admissions_end = t.total;
    t.total += static_cast<int64_t>(n);
    if (when <= first_finish_s) t.at_first_finish = t.total;
  }
  if (admissions_end_s >= 0 && t.at_admissions_end < 0) t.at_admissions_end = t.total;
  return t;
}

SteadyWindow steady_window(double first_finish_s, double admissions_end_s, double last_result_s,
                           const std::vector<std::pair<double, size_t>>&) {
  return strata::steady_window(first_finish_s, admissions_end_s, last_result_s,
                               tally_of(first_finish_s, admissions_end_s));
}

TEST(SteadyWindow, ABatchRunFromTheFirstFinishToTheLastAdmission) {
  const SteadyWindow w = steady_window(0.2, 0.4, 0.5, kTokenLog);
  EXPECT_DOUBLE_EQ(w.from_s, 0.2);
  EXPECT_DOUBLE_EQ(w.to_s, 0.4);
  EXPECT_EQ(w.tokens, 4 + 2);
}

TEST(SteadyWindow, AQueueStoppedLongAfterItsLastResultEndsAtThatResult) {
  // A stream source empties only at the stop, 9 s in: the window still ends at 0.5 s, or a
  // quickstart's 238 tokens read as ~500 tok/s instead of thousands.
  const SteadyWindow w = steady_window(0.2, 9.0, 0.5, kTokenLog);
  EXPECT_DOUBLE_EQ(w.to_s, 0.5);
  EXPECT_EQ(w.tokens, 4 + 2 + 1);
}

TEST(SteadyWindow, AdmissionsThatNeverStopOrStoppedBeforeTheFirstFinishRunToTheEnd) {
  for (double end : {-1.0, 0.05}) {
    const SteadyWindow w = steady_window(0.2, end, 0.5, kTokenLog);
    EXPECT_DOUBLE_EQ(w.from_s, 0.2) << end;
    EXPECT_DOUBLE_EQ(w.to_s, 0.5) << end;
    EXPECT_EQ(w.tokens, 7) << end;
  }
  const SteadyWindow none = steady_window(-1, -1, 0.5, kTokenLog);  // nothing finished
  EXPECT_DOUBLE_EQ(none.from_s, 0);
  EXPECT_EQ(none.tokens, 4 + 4 + 4 + 2 + 1);
}

TEST(CoordinatorLoop, EveryRequestFinishesOnceOverHealthyStages) {
  LoopRun run(requests(10, 5));
  FaultyStages stages;
  const ClusterStats stats = run.go(stages);
  EXPECT_EQ(stats.requests, 10);
  EXPECT_EQ(stats.generated_tokens, 50);
  ASSERT_EQ(run.sink.answers.size(), 10u);
  EXPECT_EQ(run.sink.duplicates, 0);
  for (const auto& [id, a] : run.sink.answers) {
    EXPECT_FALSE(a.unfinished) << id;
    EXPECT_EQ(a.result.output_ids, std::vector<int32_t>(5, 7)) << id;
    EXPECT_EQ(a.result.stop_reason, StopReason::kLength) << id;
  }
  EXPECT_EQ(stages.left.size(), 10u);  // every finished sequence left the last stage
}

TEST(CoordinatorLoop, AStageThatDiesMidRunLosesNoRequest) {
  LoopRun run(requests(10, 6));
  FaultyStages stages;
  stages.die_at_step = 5;
  EXPECT_THROW(run.go(stages), Error);
  EXPECT_EQ(stages.aborted, 1);
  // Everything read was answered once; the running ones are suspects, the waiting not.
  EXPECT_EQ(run.sink.answers.size(), run.source.read());
  EXPECT_EQ(run.sink.duplicates, 0);
  int suspects = 0;
  for (const auto& [id, a] : run.sink.answers) {
    EXPECT_TRUE(a.unfinished) << id;
    EXPECT_NE(a.result.error.find("the cluster failed"), std::string::npos) << a.result.error;
    suspects += a.suspect;
  }
  EXPECT_GT(suspects, 0);
  EXPECT_LE(suspects, 4);  // at most the four KV slots were running
}

TEST(CoordinatorLoop, AWrongResultEndsTheRunAndHandsEverythingBack) {
  LoopRun run(requests(6, 4));
  FaultyStages stages;
  stages.wrong_count_at = 3;
  try {
    run.go(stages);
    FAIL() << "a step answered with a token too many was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("returned 3 tokens for 2 sequences"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(run.sink.answers.size(), run.source.read());
  for (const auto& [id, a] : run.sink.answers) EXPECT_TRUE(a.unfinished) << id;
}

TEST(CoordinatorLoop, StagesThatCannotLoadTakeNoRequest) {
  LoopRun run(requests(3, 4));
  FaultyStages stages;
  stages.fail_start = true;
  EXPECT_THROW(run.go(stages), Error);
  EXPECT_EQ(run.source.read(), 0u);  // nothing taken, nothing to hand back
  EXPECT_TRUE(run.sink.answers.empty());
}

TEST(CoordinatorLoop, InvalidRequestsAreRefusedAndTheRestRun) {
  std::vector<GenerationRequest> r = requests(3, 2);
  r[1].prompt_ids = {1, 32000};  // outside llama-110m's vocabulary of 32000
  LoopRun run(r);
  FaultyStages stages;
  const ClusterStats stats = run.go(stages);
  EXPECT_EQ(stats.errors, 1);
  const Answer& bad = run.sink.answers.at("r1");
  EXPECT_EQ(bad.result.error_kind, ErrorKind::kInvalidInput);
  EXPECT_NE(bad.result.error.find("outside the vocabulary [0, 32000)"), std::string::npos)
      << bad.result.error;
  // A refusal never echoes the prompt: a 1 MB prompt's error result would be 1 MB too.
  EXPECT_TRUE(bad.result.prompt_ids.empty());
  EXPECT_EQ(run.sink.answers.at("r0").result.output_ids.size(), 2u);
  EXPECT_EQ(run.sink.answers.at("r2").result.output_ids.size(), 2u);
}

TEST(CoordinatorLoop, AStopSignalEndsTheRunWithEveryRequestAnswered) {
  LoopRun run(requests(12, 50));
  FaultyStages stages;
  std::atomic<int> signal{0};
  stages.signal = &signal;
  stages.signal_at = 4;
  CoordinatorOptions o = options();
  o.stop_signal = &signal;
  const ClusterStats stats = run.go(stages, o);
  EXPECT_EQ(stats.stop_signal, 15);
  EXPECT_EQ(run.sink.answers.size(), 12u);  // the rest of the source was read and answered
  EXPECT_EQ(stats.unfinished, 12);          // none could finish 50 tokens in a 0 s grace
  for (const auto& [id, a] : run.sink.answers) EXPECT_TRUE(a.unfinished) << id;
}

// ---- ExeGPT's schedule in the loop --------------------------------------------------------

// Requests of 4 prompt tokens and `out` new ones, and a target whose workload says so.
ScheduleTarget target(int32_t out, double bound) {
  const std::vector<int32_t> in{4}, outs{out};
  return ScheduleTarget{TaskWorkload{"test", LengthDistribution::from_samples(in, "in"),
                                     LengthDistribution::from_samples(outs, "out")},
                        bound,
                        "",
                        {"a", "b"},
                        0.15,
                        8};
}

TEST(CoordinatorSchedule, AnUnmeetableBoundIsRefusedBeforeAnyRequestRuns) {
  LoopRun run(requests(6, 5));
  FaultyStages stages;  // 1 ms a layer: 12 layers x 5 tokens take far more than 0.1 ms
  CoordinatorOptions o = options();
  o.schedule = target(5, 1e-4);
  try {
    run.go(stages, o);
    FAIL() << "a bound of 0.1 ms was accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot be met"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("fastest achievable p99 latency"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(stages.profiled, 1);
  EXPECT_EQ(stages.scheduled, 0);
  EXPECT_EQ(run.source.read(), 0u);  // nothing taken, nothing lost
}

TEST(CoordinatorSchedule, TheChosenLayersAreDeployedAndEveryRequestRuns) {
  LoopRun run(requests(20, 5));
  FaultyStages stages;
  stages.rank2_factor = 2.0;  // rank 2 is twice as slow: it should get a third of the layers
  // A link of 0.5 ms: the pipeline pays it once a step, a tensor-parallel group of the two
  // ranks twice a layer (24 sums a step), so the pipeline wins.
  stages.link_seconds = 0.5e-3;
  CoordinatorOptions o = options();
  o.schedule = target(5, std::numeric_limits<double>::infinity());
  const ClusterStats stats = run.go(stages, o);
  ASSERT_EQ(stages.plans.size(), 2u) << "uniform to profile, then the schedule's";
  EXPECT_EQ(stages.plans[0].stages[0].layer_end, 6);
  EXPECT_EQ(stages.plans[1].stages[0].layer_end, 8);  // 8 layers of 1 ms, 4 of 2 ms
  ASSERT_TRUE(stats.schedule.has_value());
  const Prediction& p = stats.schedule->planned;
  EXPECT_EQ(stats.micro_batches, p.vars.micro_batches);
  EXPECT_EQ(stats.decode_iters, p.vars.decode_iters);
  EXPECT_EQ(stages.plans[1].kv_slots, p.kv_slots);
  EXPECT_LE(p.kv_slots, 4);  // --max-batch
  EXPECT_EQ(run.sink.answers.size(), 20u);
  for (const auto& [id, a] : run.sink.answers) EXPECT_EQ(a.result.output_ids.size(), 5u) << id;
  EXPECT_EQ(stats.schedule->latencies.size(), 20u);
}

TEST(CoordinatorSchedule, LengthsThatDriftArePlannedAgain) {
  LoopRun run(requests(40, 20));  // the workload said 5 tokens; they ask for 20
  FaultyStages stages;
  CoordinatorOptions o = options();
  o.schedule = target(5, std::numeric_limits<double>::infinity());
  const ClusterStats stats = run.go(stages, o);
  ASSERT_TRUE(stats.schedule.has_value());
  EXPECT_GE(stats.schedule->replans, 1);
  EXPECT_EQ(run.sink.answers.size(), 40u);
}

}  // namespace
}  // namespace strata
