// S3's length-aware packing (../shared/papers/s3.md section 3): first-fit decreasing into
// one bin, worked by hand; the RRA scheduler packing a micro-batch's KV budget by it; the
// supervisor growing a reservation in place or preempting the sequence, which is recomputed
// and ends with exactly the tokens it would have had; no request lost or duplicated.
#include <gtest/gtest.h>

#include <fstream>
#include <map>

#include "coordinator/exegpt/rra_scheduler.h"
#include "coordinator/plan/workload.h"
#include "coordinator/s3/kv_packing.h"
#include "kernels/error.h"
#include "support/input_error.h"
#include "support/test_device.h"

namespace strata {
namespace {

std::vector<size_t> ffd(std::vector<int64_t> sizes, int64_t capacity, size_t max_items = 100,
                        std::optional<size_t> first = {}) {
  return first_fit_decreasing(sizes, capacity, max_items, first);
}

// Largest first; each that still fits is taken; the bin's leftover is what the smaller ones
// may use. {4, 8, 1, 4, 2, 1} into 10: 8 (2 left), the 4s do not fit, 2 (0 left), done.
TEST(FirstFitDecreasing, HandWorkedSingleBin) {
  EXPECT_EQ(ffd({4, 8, 1, 4, 2, 1}, 10), (std::vector<size_t>{1, 4}));
  // Into 12: 8, then the first 4 (index 0 before index 3), 0 left.
  EXPECT_EQ(ffd({4, 8, 1, 4, 2, 1}, 12), (std::vector<size_t>{1, 0}));
  // Into 15: 8, 4, (4 does not fit: 3 left), 2, 1 (0 left).
  EXPECT_EQ(ffd({4, 8, 1, 4, 2, 1}, 15), (std::vector<size_t>{1, 0, 4, 2}));
  // Johnson's list {5,7,5,2,4,2,5,1,6} into 10: 7 (3 left), 2 (1 left), 1 (0 left).
  EXPECT_EQ(ffd({5, 7, 5, 2, 4, 2, 5, 1, 6}, 10), (std::vector<size_t>{1, 3, 7}));
  EXPECT_TRUE(ffd({11, 12}, 10).empty());
  EXPECT_TRUE(ffd({}, 10).empty());
}

TEST(FirstFitDecreasing, StopsAtMaxItems) {
  EXPECT_EQ(ffd({1, 5, 3}, 100, 2), (std::vector<size_t>{1, 2}));
  EXPECT_TRUE(ffd({1, 5, 3}, 100, 0).empty());
}

// An item forced first goes in before the larger ones, or nothing does.
TEST(FirstFitDecreasing, ForcedFirstItemBlocksWhenItDoesNotFit) {
  EXPECT_EQ(ffd({3, 9, 2}, 10, 100, 0), (std::vector<size_t>{0, 2}));  // 3, then 9 won't fit
  EXPECT_TRUE(ffd({11, 1}, 10, 100, 0).empty());
}

TEST(KvPackingOptions, RefusesWhatCannotRun) {
  KvPackingOptions o;
  o.budget = -1;
  EXPECT_THROW(o.validate(), InputError);
  o.budget = 0;
  o.reserve = KvReserve::kPredicted;
  EXPECT_THROW(o.validate(), InputError);  // nothing to pack into
  o.budget = 100;
  o.confidence = 0;
  EXPECT_THROW(o.validate(), InputError);
  o.confidence = 0.9;
  EXPECT_NO_THROW(o.validate());
  EXPECT_EQ(parse_kv_reserve("max-new"), KvReserve::kMaxNew);
  EXPECT_THROW(parse_kv_reserve("oracle"), InputError);
}

GenerationRequest req(const std::string& id, int32_t prompt_len, int32_t max_new) {
  GenerationRequest r;
  r.id = id;
  r.prompt_ids.assign(static_cast<size_t>(prompt_len), 5);
  for (int32_t i = 0; i < prompt_len; ++i) r.prompt_ids[static_cast<size_t>(i)] = 10 + i;
  r.max_new_tokens = max_new;
  r.ignore_eos = true;
  return r;
}

// Reservations by request id, as a predictor would give them.
SchedulerOptions packing(int64_t budget, std::map<std::string, int32_t> reserve) {
  SchedulerOptions o;
  o.micro_batches = 1;
  o.decode_iters = 1;
  o.kv_slots = 8;
  o.kv_capacity = 128;
  o.max_step_tokens = 256;
  o.eos_token_ids = {2};
  o.kv_budget = budget;
  o.reserve = [reserve](const GenerationRequest& r) { return reserve.at(r.id); };
  return o;
}

// A model whose token depends only on the sequence and the position it is sampled at, as
// a greedy model's does on its context: what a preempted sequence samples after its
// recompute must be what it would have sampled.
int32_t token_at(uint64_t seq, int32_t position) {
  return 3 + static_cast<int32_t>((seq * 31 + static_cast<uint64_t>(position) * 7) % 50);
}

StepResult answer(const ScheduledStep& s) {
  StepResult r{s.command.step_id, s.command.micro_batch, {}};
  for (const SeqStep& q : s.command.seqs)
    if (q.sample)
      r.tokens.push_back(SeqToken{q.seq_id, token_at(q.seq_id, q.n_past + q.n_new - 1)});
  return r;
}

std::vector<uint64_t> ids_of(const ScheduledStep& s) {
  std::vector<uint64_t> ids;
  for (const SeqStep& q : s.command.seqs) ids.push_back(q.seq_id);
  return ids;
}

// Reservations 20, 70, 30, 10 (prompt 4 each) into 100: FFD takes 70 and 30 (0 left); in
// arrival order 20 and 70 would have gone in and 30 would have waited.
TEST(RraPacking, AdmitsByFirstFitDecreasingIntoTheBudget) {
  RraScheduler s(packing(100, {{"a", 20}, {"b", 70}, {"c", 30}, {"d", 10}}));
  s.submit(req("a", 4, 100), 0, 0.0);
  s.submit(req("b", 4, 100), 1, 0.0);
  s.submit(req("c", 4, 100), 2, 0.0);
  s.submit(req("d", 4, 100), 3, 0.0);
  auto p = s.next_step(0);
  ASSERT_TRUE(p);
  EXPECT_EQ(ids_of(*p), (std::vector<uint64_t>{1, 2}));
  EXPECT_EQ(s.waiting(), 2u);
}

// A reservation is at least the prompt and one token, at most the context and the budget.
TEST(RraPacking, ClampsReservations) {
  RraScheduler s(packing(50, {{"tiny", 1}, {"huge", 1000}}));
  s.submit(req("tiny", 6, 40), 0, 0.0);
  s.submit(req("huge", 6, 40), 1, 0.0);
  auto p = s.next_step(0);  // 46 (prompt + max_new) does not leave room for 7
  ASSERT_TRUE(p);
  EXPECT_EQ(ids_of(*p), (std::vector<uint64_t>{1}));
}

// Runs to the end, answering every step; the finished results by id.
std::map<std::string, GenerationResult> run_all(RraScheduler& s) {
  std::map<std::string, GenerationResult> done;
  for (int guard = 0; guard < 10000 && !s.idle(); ++guard) {
    for (int32_t m = 0; m < s.micro_batches(); ++m) {
      if (s.in_flight(m)) continue;
      auto step = s.next_step(m);
      if (!step) continue;
      for (FinishedRequest& f : s.apply(answer(*step))) {
        EXPECT_FALSE(done.contains(f.result.id)) << f.result.id << " finished twice";
        done[f.result.id] = std::move(f.result);
      }
    }
  }
  EXPECT_TRUE(s.idle());
  return done;
}

std::vector<int32_t> expected_tokens(uint64_t seq, int32_t prompt, int32_t n) {
  std::vector<int32_t> out;
  for (int32_t k = 0; k < n; ++k) out.push_back(token_at(seq, prompt + k - 1));
  return out;
}

// A (prompt 4, 10 new) reserves 8 and B all it can use (4 + 20), 32 of 34. After A's 5th
// token its next decode would write position 8: doubling to 16, capped at what A can use
// (4 + 10), needs 32 - 8 + 14 = 38 > 34, so A is preempted; B runs on to its end (A's 14
// do not fit beside its 24); A comes back with its prompt and 5 tokens prefilled again, no second
// join, and ends with the tokens it would have had.
TEST(RraPacking, SupervisorPreemptsAndTheRecomputedSequenceEndsAsItWouldHave) {
  RraScheduler s(packing(34, {{"A", 8}, {"B", 24}}));
  s.submit(req("A", 4, 10), 0, 0.0);
  s.submit(req("B", 4, 20), 1, 0.0);
  auto p = s.next_step(0);
  ASSERT_EQ(ids_of(*p), (std::vector<uint64_t>{1, 0}));  // the larger reservation first
  s.apply(answer(*p));                                   // first tokens; n_past 4 each
  int decodes_with_a = 0;
  std::map<std::string, GenerationResult> done;
  std::optional<ScheduledStep> resumed;
  while (!resumed) {
    auto d = s.next_step(0);
    ASSERT_TRUE(d);
    if (d->command.phase == Phase::kPrefill) {
      resumed = d;
      break;
    }
    const auto ids = ids_of(*d);
    if (std::find(ids.begin(), ids.end(), 0u) != ids.end()) ++decodes_with_a;
    for (FinishedRequest& f : s.apply(answer(*d))) done[f.result.id] = f.result;
  }
  // Decodes at positions 4..7 fit A's 8 positions; the one at 8 would not.
  EXPECT_EQ(decodes_with_a, 4);
  EXPECT_EQ(s.packing()->preemptions, 1);
  EXPECT_EQ(s.packing()->extensions, 0);
  // The recompute: prompt (10..13) and A's 5 tokens so far, from position 0, sampling.
  ASSERT_EQ(resumed->command.seqs.size(), 1u);
  const SeqStep& q = resumed->command.seqs[0];
  EXPECT_EQ(q.seq_id, 0u);
  EXPECT_EQ(q.n_past, 0);
  EXPECT_EQ(q.n_new, 9);
  EXPECT_TRUE(q.sample);
  EXPECT_EQ(q.token_ids[3], 13);
  EXPECT_EQ(q.token_ids[4], token_at(0, 3));  // its first token, sampled at position 3
  EXPECT_TRUE(resumed->joins.empty());        // its sampler state stayed on the last stage
  for (FinishedRequest& f : s.apply(answer(*resumed))) done[f.result.id] = f.result;
  for (auto& [id, r] : run_all(s)) done[id] = r;
  ASSERT_EQ(done.size(), 2u);
  EXPECT_EQ(done["A"].output_ids, expected_tokens(0, 4, 10));
  EXPECT_EQ(done["B"].output_ids, expected_tokens(1, 4, 20));
  EXPECT_EQ(s.packing()->recomputed_tokens, 9);
}

// With room in the budget (8 + 24 -> 14 + 24 = 38 <= 40) the reservation grows in place.
TEST(RraPacking, SupervisorGrowsInPlaceWhenTheBudgetHasRoom) {
  RraScheduler s(packing(40, {{"A", 8}, {"B", 24}}));
  s.submit(req("A", 4, 10), 0, 0.0);
  s.submit(req("B", 4, 20), 1, 0.0);
  auto done = run_all(s);
  EXPECT_EQ(s.packing()->preemptions, 0);
  EXPECT_EQ(s.packing()->extensions, 1);
  EXPECT_EQ(done["A"].output_ids, expected_tokens(0, 4, 10));
}

// Forty requests of mixed lengths, each reserving only its prompt, into a budget of 120 over
// two micro-batches: every one ends once, with its own tokens. Returns the counters.
PackingCounters forty_requests_end_once(SchedulerOptions o) {
  o.micro_batches = 2;
  o.decode_iters = 3;
  o.kv_slots = 16;
  o.kv_budget = 120;
  o.reserve = [](const GenerationRequest& r) { return static_cast<int32_t>(r.prompt_ids.size()); };
  RraScheduler s(o);
  std::map<std::string, std::pair<uint64_t, GenerationRequest>> reqs;
  for (int i = 0; i < 40; ++i) {
    GenerationRequest r = req(fmt::format("r{}", i), 2 + i % 7, 5 + (i * 13) % 30);
    reqs[r.id] = {static_cast<uint64_t>(i), r};
    s.submit(r, static_cast<uint64_t>(i), 0.0);
  }
  auto done = run_all(s);
  EXPECT_EQ(done.size(), 40u);
  for (const auto& [id, sr] : reqs) {
    const auto& [seq, r] = sr;
    EXPECT_EQ(done[id].output_ids,
              expected_tokens(seq, static_cast<int32_t>(r.prompt_ids.size()), r.max_new_tokens))
        << id;
    EXPECT_EQ(done[id].stop_reason, StopReason::kLength) << id;
  }
  return *s.packing();
}

// All predicted one token long: many preemptions and extensions.
TEST(RraPacking, NoRequestLostOrDuplicatedAcrossPreemptions) {
  const PackingCounters c = forty_requests_end_once(packing(120, {}));
  EXPECT_GT(c.preemptions, 0);
  EXPECT_GT(c.extensions, 0);
}

// ---- pooled admission (KvAdmission::kPooled), worked by hand ------------------------------

// Standard normal quantiles from the tables (Abramowitz & Stegun 26.2).
TEST(NormalQuantile, MatchesTheTables) {
  EXPECT_NEAR(normal_quantile(0.5), 0.0, 1e-9);
  EXPECT_NEAR(normal_quantile(0.9), 1.2815515655, 1e-8);
  EXPECT_NEAR(normal_quantile(0.95), 1.6448536270, 1e-8);
  EXPECT_NEAR(normal_quantile(0.975), 1.9599639845, 1e-8);
  EXPECT_NEAR(normal_quantile(0.999), 3.0902323062, 1e-8);
  EXPECT_NEAR(normal_quantile(0.01), -2.3263478740, 1e-8);
}

// Two buckets of width 10, half each, the last open up to 20: L uniform on (0, 10] or (10, 20].
LengthOutlook halves(int32_t cap = 20) {
  LengthOutlook o;
  o.cap = cap;
  o.bucket_width = 10;
  o.bucket_probs = {0.5, 0.5};
  return o;
}

TEST(LengthOutlook, SurvivalByHand) {
  const LengthOutlook o = halves();
  EXPECT_DOUBLE_EQ(o.survival(0, 0), 1.0);
  EXPECT_DOUBLE_EQ(o.survival(0, 5), 0.75);  // 0.5 * 5/10 + 0.5
  EXPECT_DOUBLE_EQ(o.survival(0, 10), 0.5);
  EXPECT_DOUBLE_EQ(o.survival(0, 15), 0.25);
  EXPECT_DOUBLE_EQ(o.survival(0, 20), 0.0);
  EXPECT_DOUBLE_EQ(o.survival(5, 15), 0.25 / 0.75);  // given it made 5
  EXPECT_DOUBLE_EQ(o.survival(12, 16), (0.5 * 0.4) / (0.5 * 0.8));
  // A cap of 15 cuts the open bucket to (10, 15].
  EXPECT_DOUBLE_EQ(halves(15).survival(0, 12.5), 0.25);
  // It outran every bucket: uniform on (made, 2 * made].
  LengthOutlook short_one = halves(100);
  short_one.bucket_probs = {1.0, 0.0};
  EXPECT_DOUBLE_EQ(short_one.survival(10, 15), 0.5);
  EXPECT_DOUBLE_EQ(short_one.survival(12, 15), 0.75);
  // A point: exactly 7 tokens.
  LengthOutlook point;
  point.point = 7;
  EXPECT_DOUBLE_EQ(point.survival(0, 6), 1.0);
  EXPECT_DOUBLE_EQ(point.survival(0, 7), 0.0);
  EXPECT_DOUBLE_EQ(point.survival(8, 8), 1.0);  // past its point it runs one more at least
}

// One sequence filling 10 positions at its next step, lengths as below; points 1 apart.
TEST(UsageProfile, ExpectedPositionsAndVarianceByHand) {
  LengthOutlook two;  // exactly 2 tokens: runs at steps 0 and 1
  two.point = 2;
  UsageProfile p(4, 1);
  p.add(two, 0, 10);
  EXPECT_EQ(p.mean, (std::vector<double>{10, 11, 0, 0}));
  EXPECT_EQ(p.var, (std::vector<double>{0, 0, 0, 0}));
  EXPECT_EQ(p.used, 10);
  // L uniform on (0, 1] or (1, 2], half each: alive at step 1 with 1/2.
  LengthOutlook coin;
  coin.cap = 2;
  coin.bucket_width = 1;
  coin.bucket_probs = {0.5, 0.5};
  UsageProfile q(4, 1);
  q.add(coin, 0, 10);
  EXPECT_EQ(q.mean, (std::vector<double>{10, 5.5, 0, 0}));
  EXPECT_EQ(q.var, (std::vector<double>{0, 0.25 * 121, 0, 0}));
  EXPECT_DOUBLE_EQ(q.need(2.0), 5.5 + 2 * 5.5);
  EXPECT_DOUBLE_EQ(q.need(0.0), 10);
  // Points 2 apart: each the chance at its start and the positions at its end.
  LengthOutlook three;
  three.point = 3;
  UsageProfile r(3, 2);
  r.add(three, 0, 10);
  EXPECT_EQ(r.mean, (std::vector<double>{11, 13, 0}));
}

UsageProfile profile_of(const LengthOutlook& o, int64_t next, int32_t points = 16) {
  UsageProfile p(points, 1);
  p.add(o, 0, next);
  return p;
}

LengthOutlook exactly(int32_t n) {
  LengthOutlook o;
  o.point = n;
  return o;
}

// Reservations would not hold both (12 + 15 > 24), but the short one leaves first: together
// they fill 20, 22, 12, 13, 14 positions.
TEST(PooledFirstFitDecreasing, CountsASequencesMemoryOnlyWhileItRuns) {
  const std::vector<int64_t> sizes{12, 15};
  const std::vector<UsageProfile> items{profile_of(exactly(2), 10), profile_of(exactly(5), 10)};
  const UsageProfile empty(16, 1);
  EXPECT_EQ(pooled_first_fit_decreasing(sizes, items, empty, 1.28, 24, 10),
            (std::vector<size_t>{1, 0}));
  EXPECT_EQ(pooled_first_fit_decreasing(sizes, items, empty, 1.28, 21, 10),
            (std::vector<size_t>{1}));  // 22 at step 1
  EXPECT_EQ(first_fit_decreasing(sizes, 24, 10), (std::vector<size_t>{1}));
}

// Two uncertain sequences: mean 20 then 11 (sd sqrt(60.5) = 7.78) at step 1. At 1.28 sd
// they need 20.97 and fit 21; at 1.645 sd they need 23.8 and do not.
TEST(PooledFirstFitDecreasing, TheConfidenceSetsTheMargin) {
  LengthOutlook coin;
  coin.cap = 2;
  coin.bucket_width = 1;
  coin.bucket_probs = {0.5, 0.5};
  const std::vector<int64_t> sizes{12, 12};
  const std::vector<UsageProfile> items{profile_of(coin, 10), profile_of(coin, 10)};
  const UsageProfile empty(16, 1);
  EXPECT_EQ(pooled_first_fit_decreasing(sizes, items, empty, 1.2816, 21, 10).size(), 2u);
  EXPECT_EQ(pooled_first_fit_decreasing(sizes, items, empty, 1.6449, 21, 10).size(), 1u);
  // The positions filled at once (point 0, no spread) bind whatever the confidence: 10 + 10 > 19.
  EXPECT_EQ(pooled_first_fit_decreasing(sizes, items, empty, -5, 19, 10).size(), 1u);
  // A sequence alone runs even when its spread says it might not fit.
  EXPECT_EQ(pooled_first_fit_decreasing({&sizes[0], 1}, {&items[0], 1}, empty, 100, 12, 10),
            (std::vector<size_t>{0}));
  // Beside what is running it does not.
  UsageProfile running(16, 1);
  running.add(exactly(1), 0, 1);
  EXPECT_TRUE(
      pooled_first_fit_decreasing({&sizes[0], 1}, {&items[0], 1}, running, 100, 12, 10).empty());
}

// Pooled admission with outlooks by request id; contexts of 64 so the profile's points are
// one step apart.
SchedulerOptions pooled(int64_t budget, std::map<std::string, LengthOutlook> outlooks) {
  SchedulerOptions o = packing(budget, {});
  o.kv_capacity = 64;
  o.kv_admission = KvAdmission::kPooled;
  o.reserve = [outlooks](const GenerationRequest& r) {
    return static_cast<int32_t>(r.prompt_ids.size()) + std::max(1, outlooks.at(r.id).point);
  };
  o.outlook = [outlooks](const GenerationRequest& r) { return outlooks.at(r.id); };
  return o;
}

// A (prompt 4, 2 tokens) and B (prompt 4, 10 tokens) reserve 6 and 14: 20 > 18, so S3's
// admission takes B alone. Pooled, A is gone before B grows: at most 5 + 6 and then B's
// 14 positions; both run at once and end with their own tokens, nothing preempted.
TEST(RraPooled, AdmitsWhatReservationsWouldNotWhenTheShortOneLeavesFirst) {
  RraScheduler s(pooled(18, {{"A", exactly(2)}, {"B", exactly(10)}}));
  s.submit(req("A", 4, 2), 0, 0.0);
  s.submit(req("B", 4, 10), 1, 0.0);
  auto p = s.next_step(0);
  ASSERT_TRUE(p);
  EXPECT_EQ(ids_of(*p), (std::vector<uint64_t>{1, 0}));
  for (FinishedRequest& f : s.apply(answer(*p))) ADD_FAILURE() << f.result.id;
  auto done = run_all(s);
  EXPECT_EQ(done["A"].output_ids, expected_tokens(0, 4, 2));
  EXPECT_EQ(done["B"].output_ids, expected_tokens(1, 4, 10));
  EXPECT_EQ(s.packing()->preemptions, 0);

  SchedulerOptions reserved = pooled(18, {{"A", exactly(2)}, {"B", exactly(10)}});
  reserved.kv_admission = KvAdmission::kReserved;
  RraScheduler r(reserved);
  r.submit(req("A", 4, 2), 0, 0.0);
  r.submit(req("B", 4, 10), 1, 0.0);
  EXPECT_EQ(ids_of(*r.next_step(0)), (std::vector<uint64_t>{1}));
}

// A (prompt 6) is predicted 2 tokens and makes 12; B (prompt 4) 12 as predicted. Planned:
// 12, 14, then B's 7..16 beside nothing: both in 24. They fill 12 + 2j positions after
// decode j, 26 > 24 after the 7th: B has filled fewer (11 against 13) and is preempted; it
// waits until A's end (its 13 do not fit beside A's 14 and more), is recomputed (its prompt
// and 8 tokens) and ends with the tokens it would have had.
TEST(RraPooled, AnOverflowPreemptsTheFewestFilledWhichEndsAsItWouldHave) {
  RraScheduler s(pooled(24, {{"A", exactly(2)}, {"B", exactly(12)}}));
  s.submit(req("A", 6, 12), 0, 0.0);
  s.submit(req("B", 4, 12), 1, 0.0);
  auto p = s.next_step(0);
  ASSERT_EQ(ids_of(*p).size(), 2u);
  s.apply(answer(*p));
  std::map<std::string, GenerationResult> done;
  int decodes = 0;
  while (s.packing()->preemptions == 0) {
    auto d = s.next_step(0);
    ASSERT_TRUE(d);
    ASSERT_EQ(d->command.phase, Phase::kDecode);
    ++decodes;
    for (FinishedRequest& f : s.apply(answer(*d))) done[f.result.id] = f.result;
  }
  EXPECT_EQ(decodes, 7);
  EXPECT_EQ(s.waiting(), 1u);
  EXPECT_EQ(s.packing()->preempted_seqs, 1);
  EXPECT_EQ(s.packing()->recomputed_tokens, 4 + 8);  // B's prompt and its 8 tokens
  for (auto& [id, r] : run_all(s)) done[id] = r;
  EXPECT_EQ(done["A"].output_ids, expected_tokens(0, 6, 12));
  EXPECT_EQ(done["B"].output_ids, expected_tokens(1, 4, 12));
  EXPECT_EQ(s.packing()->preemptions, 1);
}

// The same forty, pooled, with outlooks that say "a token or two": many overflows.
TEST(RraPooled, NoRequestLostOrDuplicatedAcrossPreemptions) {
  SchedulerOptions o = pooled(120, {});
  o.outlook = [](const GenerationRequest&) {
    LengthOutlook l;
    l.cap = 40;
    l.bucket_width = 1;
    l.bucket_probs = {0.5, 0.5};
    return l;
  };
  EXPECT_GT(forty_requests_end_once(o).preemptions, 0);
}

// The reserver's outlooks: a point at what the rule reserves, or the predictor's buckets.
TEST(KvReserver, OutlooksFollowTheRule) {
  KvPackingOptions o;
  o.budget = 1000;
  o.reserve = KvReserve::kContext;
  const GenerationRequest r = req("x", 10, 30);
  EXPECT_EQ(KvReserver(o, 100).outlook(r).point, 90);
  o.reserve = KvReserve::kMaxNew;
  EXPECT_EQ(KvReserver(o, 100).outlook(r).point, 30);
  o.reserve = KvReserve::kPredicted;
  o.buckets = 4;
  o.bucket_width = 8;
  const LengthOutlook p = KvReserver(o, 100).outlook(r);
  EXPECT_EQ(p.bucket_probs.size(), 4u);
  EXPECT_EQ(p.bucket_width, 8);
  EXPECT_EQ(p.cap, 30);  // max_new_tokens is a length hint by default
  o.length_hint = false;
  EXPECT_EQ(KvReserver(o, 100).outlook(r).cap, 90);
  EXPECT_EQ(parse_kv_admission("pooled"), KvAdmission::kPooled);
  EXPECT_THROW(parse_kv_admission("loose"), InputError);
  KvPackingOptions off;
  off.admission = KvAdmission::kPooled;
  EXPECT_THROW(off.validate(), InputError);  // no budget to pack into
}

// Under --latency-bound the schedule search sizes the budget: a rule without one is valid
// until then, and the rule gives the search its model.
TEST(KvPackingOptions, TheScheduleMaySizeTheBudget) {
  KvPackingOptions o;
  o.reserve = KvReserve::kPredicted;
  EXPECT_THROW(o.validate(), InputError);
  o.budget_from_schedule = true;
  EXPECT_NO_THROW(o.validate());
  o.reserve = KvReserve::kContext;
  EXPECT_FALSE(reservation_model(o, ""));
  o.reserve = KvReserve::kMaxNew;
  o.admission = KvAdmission::kPooled;
  o.confidence = 0.8;
  const std::optional<ReservationModel> m = reservation_model(o, "");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->reserve, KvReserve::kMaxNew);
  EXPECT_EQ(m->admission, KvAdmission::kPooled);  // planned as the run admits
  EXPECT_EQ(m->confidence, 0.8);
  const std::string e2 = testing::input_error([&] { reservation_model(o, "eval.json"); });
  EXPECT_NE(e2.find("needs --kv-reserve predicted"), std::string::npos) << e2;
  o.reserve = KvReserve::kPredicted;
  const std::string e1 = testing::input_error([&] { reservation_model(o, ""); });
  EXPECT_NE(e1.find("--predict-eval"), std::string::npos) << e1;
}

// ---- the simulator's packing model (held_positions), worked by hand ------------------------

// Outputs up to 20 tokens in 2 buckets of S3's width 20 / 2 = 10: S in [1, 10] -> 0, else 1.
// True bucket 0 always reserves bucket 0 (10 tokens); true bucket 1 half the time bucket 0,
// half bucket 1 (20 tokens). Prompt 4, so the first reservations are 14 and 24 positions.
ReservationModel two_bucket_model() {
  ReservationModel m;
  m.reserve = KvReserve::kPredicted;
  m.buckets = 2;
  m.reserved_given_true = {1.0, 0.0, 0.5, 0.5};
  return m;
}

LengthDistribution up_to_20() {
  std::vector<int32_t> s;
  for (int32_t i = 1; i <= 20; ++i) s.push_back(i);
  return LengthDistribution::from_samples(s, "1..20");
}

// Pooled admission planned in a mean field. Outputs of 2 or 4 tokens, half each; decode-batch
// members with D = 1 or 3 iterations, half each; input 10. A member has made j = 1 with
// chance T(1) = 1/2 + 1/6 = 2/3, j = 2 or 3 with 1/6 each, filling 10 + j positions now and
// one more each step it runs. Worked by hand:
// - max-new (lengths known): of those that made 1, T(2)/T(1) = 1/4 run a step later and
//   T(3)/T(1) = 1/4 two steps later; all that made 2 run one more step; none that made 3.
//   Means 11.5, 2/3*1/4*12 + 1/6*13 = 25/6, 2/3*1/4*13 = 13/6, then 0; no variance.
// - predicted (the workload's lengths given what was made): made 1 runs on with P(S > 2) = 1/2
//   and P(S > 3) = 1/2; made 2 runs one more step surely (S > 2 means S = 4), made 3 none.
//   Means 11.5, 2/3*1/2*12 + 1/6*13 = 37/6, 2/3*1/2*13 = 13/3; variances 0,
//   2/3*1/4*144 = 24, 2/3*1/4*169 = 169/6.
TEST(PooledUsage, MeanFieldProfilesByHand) {
  const LengthDistribution output = LengthDistribution::from_weights({0, 0, 1, 0, 1}, "output");
  const LengthDistribution held = LengthDistribution::from_weights({0, 1, 0, 1}, "held");
  const UsageProfile known = pooled_usage(KvReserve::kMaxNew, 10, output, held, 1, 0, 20);
  ASSERT_EQ(known.stride, 1);
  const std::vector<double> known_mean{11.5, 25.0 / 6, 13.0 / 6, 0};
  const std::vector<double> guessed_mean{11.5, 37.0 / 6, 13.0 / 3, 0};
  const std::vector<double> guessed_var{0, 24, 169.0 / 6, 0};
  const UsageProfile guessed = pooled_usage(KvReserve::kPredicted, 10, output, held, 1, 0, 20);
  for (size_t k = 0; k < 4; ++k) {
    EXPECT_NEAR(known.mean[k], known_mean[k], 1e-12) << k;
    EXPECT_EQ(known.var[k], 0) << k;
    EXPECT_NEAR(guessed.mean[k], guessed_mean[k], 1e-12) << k;
    EXPECT_NEAR(guessed.var[k], guessed_var[k], 1e-12) << k;
  }
  // At 0.9 the margin is z = 1.2816 sd: one step ahead binds, 37/6 + z * sqrt(24) = 12.44.
  EXPECT_NEAR(guessed.need(pooled_margin(0.9)), 37.0 / 6 + 1.2815516 * std::sqrt(24.0), 1e-6);
  EXPECT_DOUBLE_EQ(known.need(pooled_margin(0.9)), 11.5);
  // Ten members: the means ten times, the spread only sqrt(10) times -- the sum's quantile.
  const UsageProfile ten = pooled_usage(KvReserve::kPredicted, 10, output, held, 10, 0, 20);
  EXPECT_NEAR(ten.need(pooled_margin(0.9)), 115, 1e-9);
  // Two that end at their prefill (input + 1 = 11 positions): known, only now; predicted, as
  // any new sequence: alive with P(S > t) = 1, 1, 1/2, 1/2 at 11 + t positions.
  const UsageProfile known2 = pooled_usage(KvReserve::kMaxNew, 10, output, held, 1, 2, 20);
  EXPECT_NEAR(known2.mean[0], 11.5 + 22, 1e-12);
  EXPECT_NEAR(known2.mean[1], 25.0 / 6, 1e-12);
  const UsageProfile guessed2 = pooled_usage(KvReserve::kPredicted, 10, output, held, 1, 2, 20);
  const std::vector<double> add_mean{22, 24, 13, 14}, add_var{0, 0, 84.5, 98};
  for (size_t k = 0; k < 4; ++k) {
    EXPECT_NEAR(guessed2.mean[k], guessed_mean[k] + add_mean[k], 1e-12) << k;
    EXPECT_NEAR(guessed2.var[k], guessed_var[k] + add_var[k], 1e-12) << k;
  }
}

TEST(HeldPositions, ContextAndMaxNewByHand) {
  ReservationModel m;
  std::vector<double> held = held_positions(m, 4, up_to_20(), 64);
  ASSERT_EQ(held.size(), 20u);  // D = 0..19
  EXPECT_EQ(held[0], 64);
  EXPECT_EQ(held[19], 64);
  m.reserve = KvReserve::kMaxNew;  // the prompt and S = D + 1 tokens, whatever D
  held = held_positions(m, 4, up_to_20(), 64);
  EXPECT_EQ(held[0], 5);
  EXPECT_EQ(held[3], 8);
  EXPECT_EQ(held[19], 24);
  EXPECT_EQ(held_positions(m, 4, up_to_20(), 20)[19], 20);  // never above the context
}

TEST(HeldPositions, PredictedReservationsDoubleWhenOutgrown) {
  std::vector<double> exceeded;
  const std::vector<double> held = held_positions(two_bucket_model(), 4, up_to_20(), 64, &exceeded);
  // D = 3 (S = 4, bucket 0): reserves 14, iterations need 5, 6, 7.
  EXPECT_DOUBLE_EQ(held[3], 14);
  EXPECT_DOUBLE_EQ(exceeded[3], 0);
  // D = 15 (S = 16, bucket 1). Reserving 14: iterations 1..10 need 5..14 and hold 14, 11
  // needs 15 and doubles it to 28 for 11..15: (10 * 14 + 5 * 28) / 15. Reserving 24: 24.
  EXPECT_NEAR(held[15], 0.5 * (280.0 / 15) + 0.5 * 24, 1e-12);
  EXPECT_DOUBLE_EQ(exceeded[15], 0.5);
  // D = 19: (10 * 14 + 9 * 28) / 19 and 24 (iteration 19 needs 23).
  EXPECT_NEAR(held[19], 0.5 * (392.0 / 19) + 0.5 * 24, 1e-12);
  EXPECT_DOUBLE_EQ(held[0], 14);  // S = 1 holds its first reservation
  // A context of 20 caps both: 14 then 20 -> (140 + 5 * 20) / 15; 24 -> 20.
  const std::vector<double> capped = held_positions(two_bucket_model(), 4, up_to_20(), 20);
  EXPECT_NEAR(capped[15], 0.5 * 16 + 0.5 * 20, 1e-12);
}

TEST(ReservationModel, ReadsTheEvaluationsMatrixAndNamesWhatIsWrong) {
  const std::string dir = testing::test_tmp_dir("kv_packing");
  const std::string good = dir + "/eval.json", bad = dir + "/bad.json";
  std::ofstream(good) << R"({"buckets": 2, "confusion": [[9, 9], [9, 9]],
                             "reservation_matrix": [[3, 1], [0, 0]]})";
  const ReservationModel m = ReservationModel::from_eval_json(good);
  EXPECT_EQ(m.buckets, 2);
  // Row 0 normalised; row 1 never seen: a true bucket reserves itself.
  EXPECT_EQ(m.reserved_given_true, (std::vector<double>{0.75, 0.25, 0.0, 1.0}));
  EXPECT_NE(m.str().find("eval.json"), std::string::npos);
  auto error_of = [](const std::string& path) {
    return testing::input_error([&] { ReservationModel::from_eval_json(path); });
  };
  std::ofstream(bad) << R"({"reservation_matrix": [[1, 2], [3]]})";
  EXPECT_NE(error_of(bad).find("row 1"), std::string::npos) << error_of(bad);
  std::ofstream(bad) << R"({"accuracy": 0.5})";
  EXPECT_NE(error_of(bad).find("reservation_matrix"), std::string::npos) << error_of(bad);
  EXPECT_NE(error_of(dir + "/none.json").find("cannot open"), std::string::npos);
}

}  // namespace
}  // namespace strata
