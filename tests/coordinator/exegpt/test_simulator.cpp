// XSimulator (coordinator/exegpt/simulator.h) against hand-worked examples: §6's P_D(U|S), P_D(U)
// and B_D; the steady decode batch against the real RRA scheduler driving requests (an
// independent implementation of the same schedule); WAA-C / WAA-M counts by §4.1's formula;
// and throughput / latency of tiny pipelines whose timelines are worked out by hand.
#include <gtest/gtest.h>

#include <cmath>

#include "coordinator/exegpt/rra_scheduler.h"
#include "coordinator/exegpt/simulator.h"
#include "kernels/error.h"
#include "support/input_error.h"

namespace strata {
namespace {

LengthDistribution lengths(std::vector<int32_t> v) {
  return LengthDistribution::from_samples(v, "test lengths");
}

// ---- §6's formulas by hand ----------------------------------------------------------------

TEST(RraFormulas, PdGivenSFollowsSection6) {
  // N_D = 4. S <= N_D: completes at U = S for sure.
  EXPECT_EQ(pd_given_s(3, 3, 4), 1.0);
  EXPECT_EQ(pd_given_s(2, 3, 4), 0.0);
  EXPECT_EQ(pd_given_s(4, 4, 4), 1.0);
  // S = 6 needs ceil(6/4) = 2 phases, ends at U = 1 + (5 mod 4) = 2 of its last: 1/2.
  EXPECT_EQ(pd_given_s(2, 6, 4), 0.5);
  EXPECT_EQ(pd_given_s(1, 6, 4), 0.0);
  // S = 9: 3 phases, U = 1 + (8 mod 4) = 1: 1/3. S = 8: 2 phases, U = 4: 1/2.
  EXPECT_DOUBLE_EQ(pd_given_s(1, 9, 4), 1.0 / 3);
  EXPECT_EQ(pd_given_s(4, 8, 4), 0.5);
  EXPECT_EQ(pd_given_s(5, 3, 4), 0.0);  // no iteration 5 in a phase of 4
}

TEST(RraFormulas, PdUAndDecodeBatchByHand) {
  // P(S=3) = 1/2, P(S=6) = P(S=9) = 1/4, N_D = 4:
  // P_D(1) = 1/4 * 1/3 = 1/12, P_D(2) = 1/4 * 1/2 = 1/8, P_D(3) = 1/2, P_D(4) = 0.
  const LengthDistribution d = lengths({3, 3, 6, 9});
  const std::vector<double> pd = pd_u(d, 4);
  ASSERT_EQ(pd.size(), 5u);
  EXPECT_DOUBLE_EQ(pd[1], 1.0 / 12);
  EXPECT_DOUBLE_EQ(pd[2], 1.0 / 8);
  EXPECT_DOUBLE_EQ(pd[3], 0.5);
  EXPECT_DOUBLE_EQ(pd[4], 0.0);
  // sum = 17/24, so B_E = 17 keeps B_D = 17 / (17/24) = 24.
  EXPECT_DOUBLE_EQ(rra_decode_batch(17, pd), 24.0);
}

TEST(RraFormulas, InBatchWeightsEachLengthByItsPhases) {
  // The same lengths held by the decode batch: weights 1/2 * 1, 1/4 * 2, 1/4 * 3 (phases in
  // the batch) = 2/7, 2/7, 3/7. P_D(U): U=3 2/7, U=2 2/7 * 1/2, U=1 3/7 * 1/3; sum 4/7, so
  // B_D = B_E * 7/4 = B_E * E[ceil(S / N_D)] = B_E * (1/2 + 2/4 + 3/4): Little's law.
  const LengthDistribution held = in_batch(lengths({3, 3, 6, 9}), 4);
  EXPECT_DOUBLE_EQ(held.p(3), 2.0 / 7);
  EXPECT_DOUBLE_EQ(held.p(9), 3.0 / 7);
  const std::vector<double> pd = pd_u(held, 4);
  EXPECT_DOUBLE_EQ(pd[1], 1.0 / 7);
  EXPECT_DOUBLE_EQ(pd[2], 1.0 / 7);
  EXPECT_DOUBLE_EQ(pd[3], 2.0 / 7);
  EXPECT_NEAR(rra_decode_batch(8, pd), 14.0, 1e-12);
}

TEST(RraFormulas, DecodeIterationsAreTheOutputLessThePrefillsToken) {
  const LengthDistribution d = decode_iterations(lengths({1, 3, 3, 10}));
  EXPECT_DOUBLE_EQ(d.p(0), 0.25);  // finishes at its prefill
  EXPECT_DOUBLE_EQ(d.p(2), 0.5);
  EXPECT_DOUBLE_EQ(d.p(9), 0.25);
}

// The RRA scheduler itself (one micro-batch, N_D = 4, 14 KV slots) over requests whose
// decode iterations cycle 2, 2, 6, 9 (outputs 3, 3, 7, 10): in the steady state it admits
// B_E = B_D / E[ceil(D / N_D)] = 14 / 1.75 = 8 requests per prefill phase, as the in-batch
// P_D(U) says. (P_D(U) over the arrivals would give 14 * 17/24 = 9.9.)
TEST(RraFormulas, TheSchedulerAdmitsWhatTheFormulaSays) {
  SchedulerOptions so;
  so.micro_batches = 1;
  so.decode_iters = 4;
  so.kv_slots = 14;
  so.kv_capacity = 64;
  so.clock = [] { return 0.0; };
  RraScheduler sched(so);
  const int32_t outputs[] = {3, 3, 7, 10};
  for (uint64_t i = 0; i < 4000; ++i)
    sched.submit(GenerationRequest{std::to_string(i), {1, 2, 3}, outputs[i % 4], {}, true}, i, 0.0);
  std::vector<size_t> admitted;  // per prefill phase
  while (!sched.idle() && admitted.size() < 600) {
    std::optional<ScheduledStep> s = sched.next_step(0);
    ASSERT_TRUE(s);
    if (s->command.phase == Phase::kPrefill) admitted.push_back(s->joins.size());
    StepResult r{s->command.step_id, 0, {}};
    for (const SeqStep& q : s->command.seqs)
      if (q.sample) r.tokens.push_back({q.seq_id, 5});
    sched.apply(r);
  }
  ASSERT_GE(admitted.size(), 500u);
  double sum = 0;
  for (size_t i = 100; i < 500; ++i) sum += static_cast<double>(admitted[i]);
  const double per_phase = sum / 400;
  const LengthDistribution d = decode_iterations(lengths({3, 3, 7, 10}));
  const double predicted = 14.0 / rra_decode_batch(1.0, pd_u(in_batch(d, 4), 4));
  EXPECT_NEAR(predicted, 8.0, 1e-12);
  EXPECT_NEAR(per_phase, predicted, 0.3) << "admitted per phase";
}

// ---- WAA ------------------------------------------------------------------------------------

TEST(WaaFormulas, GpuCountsFollowSection41) {
  // floor(4 * 3/10) = 1 encoder, floor(4 * 7/10) = 2 decoders, the fourth to the larger
  // remainder (0.8 of the decoders').
  EXPECT_EQ(waa_split(4, 3, 7).encoders, 1);
  EXPECT_EQ(waa_split(4, 3, 7).decoders, 3);
  EXPECT_EQ(waa_split(4, 1, 1).encoders, 2);
  EXPECT_EQ(waa_split(8, 7, 1).encoders, 7);
  EXPECT_EQ(waa_split(8, 7, 1).decoders, 1);
  // floor(3 * 0.001) = 0 encoders: each side keeps at least one.
  EXPECT_EQ(waa_split(3, 0.01, 10).encoders, 1);
  EXPECT_EQ(waa_split(3, 0.01, 10).decoders, 2);
  EXPECT_THROW(waa_split(1, 1, 1), InputError);
}

// ---- tiny pipelines by hand ----------------------------------------------------------------

// stories260K's shape with `layers` layers (placement/'s memory model needs a real one).
ModelShape tiny_shape(int64_t layers) {
  ModelShape s;
  s.hidden = 64;
  s.intermediate = 172;
  s.n_layers = layers;
  s.n_heads = 8;
  s.n_kv_heads = 4;
  s.head_dim = 8;
  s.vocab = 512;
  s.max_positions = 512;
  s.gated_mlp = true;
  s.weight_bytes_per_elem = 4;
  return s;
}

// Every step of one layer costs 1 ms whatever its size; nothing else costs anything.
ClusterProfile constant_profile(int32_t workers) {
  const TimeGrid one({1, 1e6}, {1, 1e6}, {1e-3, 1e-3, 1e-3, 1e-3});
  const TimeGrid zero = TimeGrid::curve({1, 1e6}, {0, 0});
  ClusterProfile p;
  for (int32_t r = 1; r <= workers; ++r) {
    p.ranks.push_back(RankProfile{r, "h", one, one, zero, zero});
    p.hosts.push_back("h");
  }
  return p;
}

Simulator tiny_simulator(int32_t workers, std::vector<int32_t> outputs) {
  SimulatorInputs in;
  in.profile = constant_profile(workers);
  in.shape = tiny_shape(workers);
  in.workload = TaskWorkload{"hand", lengths({10}), lengths(std::move(outputs))};
  return Simulator(in);
}

TEST(Simulator, OneWorkerRraByHand) {
  // Output 5 = 4 decode iterations. B_E = 2, N_D = 4: B_D = 2, one prefill step and four
  // decode steps of 1 ms: 2 + 4 * 2 = 10 tokens per 5 ms = 2000 tok/s; the p99 sequence
  // takes the whole cycle, 5 ms.
  const Simulator sim = tiny_simulator(1, {5});
  const Prediction a = sim.predict(ScheduleVars{SchedulePolicy::kRra, 2, 4, 1, 1});
  ASSERT_TRUE(a.feasible) << a.infeasible_reason;
  EXPECT_DOUBLE_EQ(a.decode_batch, 2);
  EXPECT_EQ(a.kv_slots, 2);
  EXPECT_NEAR(a.throughput_tok_s, 2000, 1e-6);
  EXPECT_NEAR(a.p99_latency_s, 5e-3, 1e-12);
  // N_D = 2 encodes twice as often: each sequence stays two phases, B_D = 4; a cycle of
  // 3 ms makes 2 + 4 + 4 = 10 tokens (3333 tok/s), and the p99 sequence now spans two
  // cycles: 6 ms. Throughput up, latency up (§4.2).
  const Prediction b = sim.predict(ScheduleVars{SchedulePolicy::kRra, 2, 2, 1, 1});
  EXPECT_DOUBLE_EQ(b.decode_batch, 4);
  EXPECT_NEAR(b.throughput_tok_s, 10 / 3e-3, 1e-6);
  EXPECT_NEAR(b.p99_latency_s, 6e-3, 1e-12);
}

TEST(Simulator, APhaseEndsWhenItsLastSequenceDoes) {
  // One sequence a phase (B_E = 1), outputs 2 or 5 tokens (1 or 4 decode iterations), N_D = 4.
  // Half the phases are a prefill and one decode (2 ms, 2 tokens), half a prefill and four
  // (5 ms, 5 tokens): the scheduler starts the next phase as soon as the batch is empty, so
  // 3.5 tokens per 3.5 ms = 1000 tok/s. (Phases always N_D long would give 3.5 per 5 ms.)
  // The p99 sequence (5 tokens) runs its whole phase: 5 ms.
  const Simulator sim = tiny_simulator(1, {2, 5});
  const Prediction p = sim.predict(ScheduleVars{SchedulePolicy::kRra, 1, 4, 1, 1});
  ASSERT_TRUE(p.feasible) << p.infeasible_reason;
  EXPECT_NEAR(p.throughput_tok_s, 1000, 1e-6);
  EXPECT_NEAR(p.p99_latency_s, 5e-3, 1e-12);
}

TEST(Simulator, TheP99SequencesPrefillPhaseIsAHeavyOne) {
  // A prefill costs 1 ms per prompt row, a decode nothing. Prompts of 10 or 30 rows (mean
  // 20, std 10), outputs of 2 tokens. B_E = 16: the mean phase has 320 rows (throughput:
  // 32 tokens per 320 ms = 100 tok/s); the p99 sequence's phase has 320 + z_0.99 * 4 * 10 =
  // 413.05 rows (z_0.99 = 2.326348, a normal table), so its latency is 413.05 ms. B_E = 4:
  // 80 + 2.326348 * 2 * 10 = 126.5 rows, more than four of the longest: 120 ms.
  SimulatorInputs in;
  in.profile = constant_profile(1);
  in.profile.ranks[0].prefill = TimeGrid({1, 1e6}, {1, 1e6}, {1e-3, 1e-3, 1e3, 1e3});
  in.profile.ranks[0].decode = TimeGrid::curve({1, 1e6}, {0, 0});
  in.shape = tiny_shape(1);
  in.workload = TaskWorkload{"spread", lengths({10, 30}), lengths({2})};
  const Simulator sim(in);
  const Prediction a = sim.predict(ScheduleVars{SchedulePolicy::kRra, 16, 1, 1, 1});
  ASSERT_TRUE(a.feasible) << a.infeasible_reason;
  EXPECT_NEAR(a.throughput_tok_s, 100, 1e-6);
  EXPECT_NEAR(a.p99_latency_s, 0.320 + 2.326348e-3 * 40, 1e-6);
  const Prediction b = sim.predict(ScheduleVars{SchedulePolicy::kRra, 4, 1, 1, 1});
  EXPECT_NEAR(b.p99_latency_s, 0.120, 1e-9);
  // The baseline's batch is priced the same way.
  const Prediction f = sim.predict(ScheduleVars{SchedulePolicy::kBaseline, 16, 1, 1, 1});
  EXPECT_NEAR(f.p99_latency_s, 0.320 + 2.326348e-3 * 40, 1e-6);
  // Outputs of 3 tokens with N_D = 1 span two phases: only the first is the sequence's own
  // (heavy) prefill, the next admits others at the mean: 413.05 + 320 ms.
  in.workload.output = lengths({3});
  const Prediction two = Simulator(in).predict(ScheduleVars{SchedulePolicy::kRra, 16, 1, 1, 1});
  EXPECT_NEAR(two.p99_latency_s, 0.320 + 2.326348e-3 * 40 + 0.320, 1e-6);
}

TEST(Simulator, TwoStagePipelineWithTwoMicroBatchesByHand) {
  // Two workers of one layer each, two micro-batches of one sequence (B_E = 2): a step
  // crosses both stages in 2 ms and the micro-batches alternate, so each gets a step every
  // 2 ms: a cycle of 5 steps takes 10 ms for 5 tokens per micro-batch: 1000 tok/s, and the
  // p99 sequence's cycle is 10 ms.
  const Simulator sim = tiny_simulator(2, {5});
  const Prediction p = sim.predict(ScheduleVars{SchedulePolicy::kRra, 2, 4, 2, 1});
  ASSERT_TRUE(p.feasible) << p.infeasible_reason;
  EXPECT_EQ(p.allocation.layers, (std::vector<int32_t>{1, 1}));
  EXPECT_NEAR(p.throughput_tok_s, 1000, 1e-6);
  EXPECT_NEAR(p.p99_latency_s, 10e-3, 1e-12);
  // Each stage is busy 1 ms of every 1 ms-slot: 10 steps (5 per micro-batch) of 1 ms per
  // cycle.
  EXPECT_NEAR(p.stages[0].busy_seconds_per_cycle, 10e-3, 1e-12);
}

TEST(Simulator, PartialTensorParallelismByHand) {
  // Two workers and two layers of 1 ms a step, a link of 0.1 ms whatever the bytes. As one
  // stage split over both workers (TP=1x2), a layer computes half its heads and columns on
  // each (0.5 ms) and sums twice (0.2 ms): a step of both layers takes 1.4 ms. B_E = 2,
  // N_D = 4, one micro-batch: a cycle of 5 steps is 7 ms for 10 tokens (1428.6 tok/s), and
  // the p99 sequence's latency is the cycle, 7 ms.
  SimulatorInputs in;
  in.profile = constant_profile(2);
  in.profile.link.latency_s = 1e-4;
  in.shape = tiny_shape(2);
  in.workload = TaskWorkload{"hand", lengths({10}), lengths({5})};
  const Simulator sim(in);
  ScheduleVars v{SchedulePolicy::kRra, 2, 4, 1, 2};
  v.tp_groups = 1;
  const Prediction tp = sim.predict(v);
  ASSERT_TRUE(tp.feasible) << tp.infeasible_reason;
  EXPECT_EQ(tp.allocation.layers, (std::vector<int32_t>{2}));
  EXPECT_EQ(tp.allocation.tp_degrees, (std::vector<int32_t>{2}));
  EXPECT_EQ(tp.allocation.str(), "[0, 2)x2");
  EXPECT_NEAR(tp.throughput_tok_s, 10 / 7e-3, 1e-6);
  EXPECT_NEAR(tp.p99_latency_s, 7e-3, 1e-12);
  // The same workers as a two-stage pipeline: 1 ms + 0.1 ms link + 1 ms a step, 10.5 ms a
  // cycle. Partial TP shortens the pipeline: lower latency (§4.2).
  const Prediction pp = sim.predict(ScheduleVars{SchedulePolicy::kRra, 2, 4, 1, 1});
  EXPECT_TRUE(pp.allocation.tp_degrees.empty());
  EXPECT_NEAR(pp.p99_latency_s, 10.5e-3, 1e-12);
  // A running cluster re-planning on its allocation keeps its groups, whatever the variables.
  const Prediction again =
      sim.predict(ScheduleVars{SchedulePolicy::kRra, 2, 4, 1, 1}, tp.allocation);
  EXPECT_NEAR(again.p99_latency_s, 7e-3, 1e-12);
  EXPECT_EQ(again.vars.tp_groups, 1);
  // A group goes at its slowest member's pace (every sum waits for it): worker 2 at 2 ms a
  // layer makes a layer 2 / 2 + 0.2 = 1.2 ms, a step 2.4 ms, a cycle 12 ms.
  SimulatorInputs slow = in;
  slow.profile.ranks[1].decode = TimeGrid({1, 1e6}, {1, 1e6}, {2e-3, 2e-3, 2e-3, 2e-3});
  slow.profile.ranks[1].prefill = slow.profile.ranks[1].decode;
  EXPECT_NEAR(Simulator(slow).predict(v).p99_latency_s, 12e-3, 1e-12);
  // Each shard holds half the heads and MLP columns: less memory than a whole layer's stage.
  EXPECT_LT(tp.stages[0].memory.cpu, 2 * pp.stages[0].memory.cpu);
}

TEST(Simulator, BaselineDecodesEveryoneToTheLongestOutput) {
  // Outputs 3 and 5: FT decodes both sequences 4 iterations (no early termination): a batch
  // of 2 makes its 3 + 5 = 8 wanted tokens in 1 + 4 steps = 5 ms: 1600 tok/s; its latency
  // (the bound applies to the longest) is 5 ms.
  const Simulator sim = tiny_simulator(1, {3, 5});
  const Prediction p = sim.predict(ScheduleVars{SchedulePolicy::kBaseline, 2, 1, 1, 1});
  ASSERT_TRUE(p.feasible);
  EXPECT_NEAR(p.throughput_tok_s, 1600, 1e-6);
  EXPECT_NEAR(p.p99_latency_s, 5e-3, 1e-12);
  EXPECT_EQ(p.p99_output, 5);
}

TEST(Simulator, WaaDecodeBatchIsEncodeBatchTimesOutputLength) {
  // Output 33 tokens = 32 decode iterations: B_D = B_E * S_D = 8 * 32.
  const Simulator sim = tiny_simulator(2, {33});
  const Prediction p = sim.predict(ScheduleVars{SchedulePolicy::kWaaC, 8, 1, 1, 1});
  EXPECT_DOUBLE_EQ(p.decode_batch, 256);
  EXPECT_EQ(p.allocation.encoder_stages, 1);
  EXPECT_EQ(p.allocation.layers, (std::vector<int32_t>{2, 2})) << "each side holds every layer";
}

TEST(Simulator, WaaByHandWithTheCoordinatorsTurns) {
  // 1 encoder + 1 decoder worker, 2 layers of 1 ms a step each; inputs 10, outputs 5 (4
  // decode iterations); the coordinator's turn 0.5 ms + 0.1 ms a row. B_E 1: an encode is
  // 2 ms of layers + a 10-row turn of 1.5 ms = 3.5 ms; B_D = 4 in one micro-batch: a trip is
  // 2 ms + 0.9 ms. The period is the encoder's 3.5 ms: 5 tokens per 3.5 ms = 1428.6 tok/s.
  // The p99 sequence: its encode 3.5 ms, the hand-over 2 x 0.5 ms + half the decode stage's
  // 2 ms step, half a period to join, 4 periods: 3.5 + 2 + 1.75 + 14 = 21.25 ms.
  SimulatorInputs in = tiny_simulator(2, {5}).inputs();
  in.profile.step_overhead_s = 0.5e-3;
  in.profile.step_overhead_per_row_s = 0.1e-3;
  const Prediction p = Simulator(in).predict(ScheduleVars{SchedulePolicy::kWaaC, 1, 1, 1, 1});
  ASSERT_TRUE(p.feasible) << p.infeasible_reason;
  EXPECT_DOUBLE_EQ(p.decode_batch, 4);
  EXPECT_NEAR(p.throughput_tok_s, 5 / 3.5e-3, 1e-6);
  EXPECT_NEAR(p.p99_latency_s, 21.25e-3, 1e-12);
}

TEST(Simulator, WaaDecodeSlotsAreCappedByTheRunsSlots) {
  // B_D = 8 * 32 = 256 decode slots: a run of 255 (--max-batch) cannot hold them.
  SimulatorInputs in = tiny_simulator(2, {33}).inputs();
  in.max_kv_slots = 255;
  const Prediction p = Simulator(in).predict(ScheduleVars{SchedulePolicy::kWaaC, 8, 1, 1, 1});
  EXPECT_FALSE(p.feasible);
  EXPECT_NE(p.infeasible_reason.find("256 decode KV slots (B_D 256.0), more than the run's 255"),
            std::string::npos)
      << p.infeasible_reason;
  in.max_kv_slots = 256;
  EXPECT_TRUE(Simulator(in).predict(ScheduleVars{SchedulePolicy::kWaaC, 8, 1, 1, 1}).feasible);
}

TEST(Simulator, AStageThatDoesNotFitIsInfeasibleAndSaysWhere) {
  SimulatorInputs in;
  in.profile = constant_profile(1);
  in.shape = tiny_shape(1);
  in.workload = TaskWorkload{"hand", lengths({10}), lengths({5})};
  in.budgets = TierBudgets{-1, 200 * 1024, -1, true};  // 200 KiB of host memory
  const Simulator sim(in);
  const Prediction p = sim.predict(ScheduleVars{SchedulePolicy::kRra, 64, 4, 1, 1});
  EXPECT_FALSE(p.feasible);
  EXPECT_NE(p.infeasible_reason.find("stage 1"), std::string::npos) << p.infeasible_reason;
  EXPECT_NE(p.infeasible_reason.find("cpu needs"), std::string::npos) << p.infeasible_reason;
  EXPECT_TRUE(std::isinf(p.p99_latency_s));
}

// One worker, input 10, output 5 (as in OneWorkerRraByHand), a context of `context`
// positions; B_E = 2, N_D = 4 gives B_D = 2. `packing`: max-new reservations.
struct HandPacking {
  SimulatorInputs in;
  ScheduleVars v{SchedulePolicy::kRra, 2, 4, 1, 1};
  explicit HandPacking(int32_t context) {
    in.profile = constant_profile(1);
    in.shape = tiny_shape(1);
    in.workload = TaskWorkload{"hand", lengths({10}), lengths({5})};
    in.kv_capacity = context;
  }
  Prediction predict(bool packing, KvAdmission admission = KvAdmission::kReserved) {
    in.packing.reset();
    if (packing) in.packing = ReservationModel{KvReserve::kMaxNew, 0, {}, "", admission};
    return Simulator(in).predict(v);
  }
  static int64_t stage_bytes(const Prediction& p) {
    return p.stages[0].memory.gpu + p.stages[0].memory.cpu + p.stages[0].memory.disk;
  }
};

// S3's packing (issue 16): the same schedule reserves prompt + output per decode-batch member
// instead of a whole slot. With a 20-position context that is 40 positions whole, 2 x 15 = 30
// packed at max-new, and the stage's cache shrinks by 10 positions x (K and V) x 4 KV heads x
// 8 dims x 4 bytes = 2560 bytes, a layer.
TEST(Simulator, PackingBoundsMemoryByTheReservedPositions) {
  HandPacking h(20);
  const Prediction whole = h.predict(false);
  const Prediction packed = h.predict(true);
  ASSERT_TRUE(whole.feasible && packed.feasible);
  EXPECT_EQ(whole.kv_positions, 0);
  EXPECT_EQ(packed.kv_slots, 2);
  EXPECT_EQ(packed.kv_positions, 30);
  EXPECT_EQ(packed.reservations_exceeded, 0);
  EXPECT_EQ(HandPacking::stage_bytes(whole) - HandPacking::stage_bytes(packed), 10 * 2 * 4 * 8 * 4);
  EXPECT_DOUBLE_EQ(packed.throughput_tok_s, whole.throughput_tok_s);  // same compute
  // A budget between the two: only the packed schedule fits.
  h.in.budgets = TierBudgets{-1, HandPacking::stage_bytes(packed), -1, true};
  EXPECT_TRUE(h.predict(true).feasible);
  EXPECT_FALSE(h.predict(false).feasible);
}

// Pooled admission counts what the members fill, not what they reserve: each of the B_D = 2
// runs its 4 decode iterations at 11, 12, 13 and 14 positions, 12.5 on average, and with
// known lengths nothing is uncertain -- 25 positions where reservations take 30.
TEST(Simulator, PooledPackingPlansThePositionsFilled) {
  HandPacking h(20);
  const Prediction reserved = h.predict(true);
  const Prediction pooled = h.predict(true, KvAdmission::kPooled);
  ASSERT_TRUE(reserved.feasible && pooled.feasible);
  EXPECT_EQ(reserved.kv_positions, 30);
  EXPECT_EQ(pooled.kv_positions, 25);
  EXPECT_DOUBLE_EQ(pooled.decode_batch, reserved.decode_batch);
  EXPECT_DOUBLE_EQ(pooled.throughput_tok_s, reserved.throughput_tok_s);  // same compute
}

// The plan against the real scheduler: outputs 3, 3, 7, 10 after a 3-token prompt, arriving in
// that order as they are taken (a backlog would let first-fit decreasing take the longest
// first and skew the batch), B_E = 8, N_D = 4, lengths known (max-new outlooks), admission
// pooled and bounded by memory alone (slots to spare). At the planned budget (92 positions)
// the run admits what the plan assumed, B_E a phase, and preempts nothing; at 3/4 of it memory
// binds and fewer are admitted (80 already admits 7). So the plan's positions are what pooled
// admission needs, not far more or less. The same with predicted outlooks (the workload's
// lengths, as the plan assumes): there the positions filled now bind, as with known ones.
struct PooledRun {
  double admitted_per_phase = 0;
  int64_t preemptions = 0;
};
PooledRun run_pooled(int64_t budget, bool known = true) {
  SchedulerOptions so;
  so.decode_iters = 4;
  so.encode_batch = 8;
  so.kv_slots = 64;
  so.kv_capacity = 13;
  so.kv_budget = budget;
  so.kv_admission = KvAdmission::kPooled;
  so.reserve = [](const GenerationRequest& r) {
    return static_cast<int32_t>(r.prompt_ids.size()) + r.max_new_tokens;
  };
  so.outlook = [known](const GenerationRequest& r) {
    LengthOutlook l;
    l.point = l.cap = r.max_new_tokens;
    if (known) return l;
    l.cap = 10;  // the workload's lengths: bucket b holds length b + 1
    l.bucket_width = 1;
    l.bucket_probs = {0, 0, 0.5, 0, 0, 0, 0.25, 0, 0, 0.25};
    return l;
  };
  so.clock = [] { return 0.0; };
  RraScheduler sched(so);
  const int32_t outputs[] = {3, 3, 7, 10};
  uint64_t next = 0;
  std::vector<size_t> admitted;  // per prefill phase
  while (admitted.size() < 600) {
    for (; sched.waiting() < 8; ++next)  // requests arrive as they are taken, in order
      sched.submit(GenerationRequest{std::to_string(next), {1, 2, 3}, outputs[next % 4], {}, true},
                   next, 0.0);
    std::optional<ScheduledStep> s = sched.next_step(0);
    if (!s) break;
    if (s->command.phase == Phase::kPrefill) admitted.push_back(s->joins.size());
    StepResult r{s->command.step_id, 0, {}};
    for (const SeqStep& q : s->command.seqs)
      if (q.sample) r.tokens.push_back({q.seq_id, 5});
    sched.apply(r);
  }
  PooledRun out;
  if (admitted.size() < 500) return out;
  double sum = 0;
  for (size_t i = 100; i < 500; ++i) sum += static_cast<double>(admitted[i]);
  out.admitted_per_phase = sum / 400;
  out.preemptions = sched.packing()->preemptions;
  return out;
}

TEST(Simulator, PooledPlanHoldsWhatTheRealSchedulerAdmits) {
  for (const bool known : {true, false}) {
    SimulatorInputs in;
    in.profile = constant_profile(1);
    in.shape = tiny_shape(1);
    in.workload = TaskWorkload{"hand", lengths({3}), lengths({3, 3, 7, 10})};
    // predicted: the reservation matrix only says who outgrows; the plan reads the workload.
    in.packing = known ? ReservationModel{KvReserve::kMaxNew, 0, {}, "", KvAdmission::kPooled}
                       : ReservationModel{
                             KvReserve::kPredicted, 2, {1, 0, 0, 1}, "hand", KvAdmission::kPooled};
    const ScheduleVars v{SchedulePolicy::kRra, 8, 4, 1, 1};
    const Prediction p = Simulator(in).predict(v);
    ASSERT_TRUE(p.feasible) << p.infeasible_reason;
    in.packing->admission = KvAdmission::kReserved;
    EXPECT_LT(p.kv_positions, Simulator(in).predict(v).kv_positions) << known;
    const PooledRun planned = run_pooled(p.kv_positions, known);
    EXPECT_NEAR(planned.admitted_per_phase, 8, 0.25) << p.kv_positions << " positions, " << known;
    EXPECT_EQ(planned.preemptions, 0) << known;
    const PooledRun short_run = run_pooled(p.kv_positions * 3 / 4, known);
    EXPECT_LT(short_run.admitted_per_phase, 7.5) << p.kv_positions * 3 / 4 << " positions";
  }
}

// The run caps a sequence's context at its micro-batch's share of the planned positions, so
// the share never falls below the context: with a 64-position context the same schedule's 30
// reserved positions become 64 (128 over 2 micro-batches), and the stage holds them -- 64
// positions less than the 2 whole slots, not 98.
TEST(Simulator, APackedShareHoldsAWholeContext) {
  HandPacking h(64);
  const Prediction whole = h.predict(false);
  const Prediction packed = h.predict(true);
  ASSERT_TRUE(whole.feasible && packed.feasible);
  EXPECT_EQ(packed.kv_positions, 64);
  EXPECT_EQ(HandPacking::stage_bytes(whole) - HandPacking::stage_bytes(packed), 64 * 2 * 4 * 8 * 4);
  h.v.micro_batches = 2;
  const Prediction two = h.predict(true);
  ASSERT_TRUE(two.feasible) << two.infeasible_reason;
  EXPECT_EQ(two.kv_positions, 2 * 64);
}

// Outputs 5, 5, 5, 45 in 2 buckets of 23 tokens; a predictor that always reserves bucket 0
// (23 tokens) leaves the 45s -- a quarter of the sequences -- to outgrow it.
TEST(Simulator, PackingReportsTheShareThatOutgrowsItsReservation) {
  SimulatorInputs in;
  in.profile = constant_profile(1);
  in.shape = tiny_shape(1);
  in.workload = TaskWorkload{"hand", lengths({10}), lengths({5, 5, 5, 45})};
  in.packing = ReservationModel{KvReserve::kPredicted, 2, {1, 0, 1, 0}, "test"};
  const Prediction p = Simulator(in).predict(ScheduleVars{SchedulePolicy::kRra, 2, 4, 1, 1});
  ASSERT_TRUE(p.feasible) << p.infeasible_reason;
  EXPECT_DOUBLE_EQ(p.reservations_exceeded, 0.25);
  EXPECT_GT(p.kv_positions, 0);
  EXPECT_LT(p.kv_positions, int64_t{p.kv_slots} * 55);  // less than whole slots of 10 + 45
  in.device_compute = true;                             // a device allocates its cache slot by slot
  const std::string refused = testing::input_error([&] { Simulator{in}; });
  EXPECT_NE(refused.find("host-compute"), std::string::npos) << refused;
}

}  // namespace
}  // namespace strata
