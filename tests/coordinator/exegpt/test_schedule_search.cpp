// Algorithm 1 (coordinator/exegpt/schedule_search.h): on grids small enough to enumerate, the
// branch-and-bound returns exhaustive search's optimum while evaluating fewer points --
// synthetic monotonic grids, and the simulator's own grid for OPT-13B on four modelled A40
// workers (the paper's setting) at several latency bounds. A bound nothing meets is
// refused with the fastest achievable latency.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "coordinator/exegpt/schedule_search.h"
#include "worker/dummy.h"

namespace strata {
namespace {

// Throughput and latency that grow with both indices: cumulative sums of random positive
// steps (seeded), so every grid is monotonic but irregular.
struct MonotoneGrid {
  int32_t n1, n2;
  std::vector<double> thr, lat;
  MonotoneGrid(int32_t a, int32_t b, uint32_t seed) : n1(a), n2(b) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<double> step(0.1, 1.0);
    thr.resize(static_cast<size_t>(a * b));
    lat.resize(thr.size());
    for (int32_t i = 0; i < a; ++i)
      for (int32_t j = 0; j < b; ++j) {
        const size_t k = static_cast<size_t>(i * b + j);
        const double left_t = j > 0 ? thr[k - 1] : 0,
                     below_t = i > 0 ? thr[k - static_cast<size_t>(b)] : 0;
        const double left_l = j > 0 ? lat[k - 1] : 0,
                     below_l = i > 0 ? lat[k - static_cast<size_t>(b)] : 0;
        thr[k] = std::max(left_t, below_t) + step(rng);
        lat[k] = std::max(left_l, below_l) + step(rng);
      }
  }
  Perf operator()(int32_t i, int32_t j) const {
    const size_t k = static_cast<size_t>(i * n2 + j);
    return {thr[k], lat[k]};
  }
};

TEST(BranchAndBound, EqualsExhaustiveSearchOnMonotonicGridsWithFewerPoints) {
  int64_t bnb_points = 0, all_points = 0;
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    const MonotoneGrid g(24, 16, seed);
    const PerfFn f = [&](int32_t i, int32_t j) { return g(i, j); };
    const double max_lat = g(23, 15).latency;
    for (double frac : {0.15, 0.3, 0.5, 0.7, 0.9}) {
      const double bound = frac * max_lat;
      const BnbResult want = exhaustive(24, 16, f, bound);
      const BnbResult got = branch_and_bound(24, 16, f, BnbOptions{bound, 0, 0});
      ASSERT_EQ(got.found, want.found) << "seed " << seed << " bound " << bound;
      if (!want.found) continue;
      EXPECT_DOUBLE_EQ(got.perf.throughput, want.perf.throughput) << "seed " << seed;
      EXPECT_LE(got.perf.latency, bound);
      bnb_points += got.points_evaluated;
      all_points += want.points_evaluated;
    }
  }
  RecordProperty("bnb_points", static_cast<int>(bnb_points));
  RecordProperty("exhaustive_points", static_cast<int>(all_points));
  std::printf("branch-and-bound evaluated %lld points, exhaustive %lld\n",
              static_cast<long long>(bnb_points), static_cast<long long>(all_points));
  EXPECT_LT(bnb_points, all_points / 2);
}

TEST(BranchAndBound, AnUnboundedSearchStopsAtTheTopCorner) {
  const MonotoneGrid g(10, 10, 7);
  const BnbResult r = branch_and_bound(
      10, 10, [&](int32_t i, int32_t j) { return g(i, j); }, BnbOptions{});
  EXPECT_TRUE(r.found);
  EXPECT_EQ(r.i1, 9);
  EXPECT_EQ(r.i2, 9);
  EXPECT_EQ(r.points_evaluated, 2);
}

TEST(BranchAndBound, ABoundBelowEveryPointIsRefusedWithTheFastestLatency) {
  const MonotoneGrid g(8, 8, 3);
  const BnbResult r = branch_and_bound(
      8, 8, [&](int32_t i, int32_t j) { return g(i, j); }, BnbOptions{g(0, 0).latency * 0.5, 0, 0});
  EXPECT_FALSE(r.found);
  EXPECT_DOUBLE_EQ(r.fastest_latency, g(0, 0).latency);
}

// OPT-13B (the paper's model for this size) on four modelled A40 workers, task S.
Simulator opt13b_on_a40(
    int32_t workers, const std::string& task,
    int64_t gpu_budget = static_cast<int64_t>(NodeModel::preset("a40").memory_bytes)) {
  const ModelConfig c = dummy_model_config("opt-13b", DType::kF16);
  SimulatorInputs in;
  in.shape = c.shape();
  in.workload = TaskWorkload::preset(task);
  in.profile = modelled_profile(
      in.shape, "dummy:opt-13b", NodeModel::preset("a40"), workers,
      ProfileGrid::for_limits(512, 256, in.workload.input.max() + in.workload.output.max()));
  in.device_compute = true;
  in.budgets = TierBudgets{gpu_budget, -1, -1, true};
  in.policy = Policy::parse("w=100/0/0,c=100/0/0");
  return Simulator(in);
}

TEST(ScheduleSearch, BranchAndBoundFindsExhaustiveSearchsScheduleOnTheSimulator) {
  const Simulator sim = opt13b_on_a40(4, "S");
  ScheduleSearchOptions o;
  o.encode_batches = {1, 2, 4, 8, 16, 32, 64};
  o.decode_iters = {1, 2, 4, 8, 16, 32, 62};
  o.micro_batches = {1, 2};
  o.decoder_micro_batches = {1};
  o.policies = {SchedulePolicy::kRra, SchedulePolicy::kWaaC};
  ScheduleSearchOptions all = o;
  all.exhaustive = true;
  all.latency_bound = std::numeric_limits<double>::infinity();
  const ScheduleChoice unbounded = search_schedule(sim, all);
  ASSERT_TRUE(unbounded.feasible);
  int64_t bnb_points = 0, grid_points = 0;
  for (double frac : {0.2, 0.4, 0.7, 1.0}) {
    o.latency_bound = all.latency_bound = frac * unbounded.best.p99_latency_s;
    const ScheduleChoice want = search_schedule(sim, all);
    const ScheduleChoice got = search_schedule(sim, o);
    ASSERT_EQ(got.feasible, want.feasible) << frac;
    if (!want.feasible) continue;
    EXPECT_NEAR(got.best.throughput_tok_s, want.best.throughput_tok_s,
                1e-9 * want.best.throughput_tok_s)
        << "bound " << o.latency_bound << ": " << got.best.str() << " vs " << want.best.str();
    EXPECT_LE(got.best.p99_latency_s, o.latency_bound);
    bnb_points += got.points_evaluated;
    grid_points += want.points_evaluated;
  }
  std::printf("simulator grid: branch-and-bound %lld points, exhaustive %lld\n",
              static_cast<long long>(bnb_points), static_cast<long long>(grid_points));
  EXPECT_LT(bnb_points, grid_points);
}

// §4.2 / §5.1: with the degree fixed, applying tensor parallelism to more workers shortens
// the pipeline and the latency, and costs throughput (the sums) -- the pipeline kept full,
// one micro-batch per stage; a bound below what any pipeline without it reaches is met by
// a schedule with it, which the search then picks.
TEST(ScheduleSearch, PartialTensorParallelismTradesThroughputForLatency) {
  const Simulator sim = opt13b_on_a40(4, "S");
  double last_latency = std::numeric_limits<double>::infinity(), last_tput = last_latency;
  for (int32_t groups = 0; groups <= 2; ++groups) {
    ScheduleVars v{SchedulePolicy::kRra, 4 * (4 - groups), 8, 4 - groups, 2};
    v.tp_groups = groups;
    const Prediction p = sim.predict(v);
    ASSERT_TRUE(p.feasible) << p.infeasible_reason;
    EXPECT_EQ(p.allocation.layers.size(), static_cast<size_t>(4 - groups));
    EXPECT_LT(p.p99_latency_s, last_latency) << groups << " groups";
    EXPECT_LT(p.throughput_tok_s, last_tput) << groups << " groups";
    last_latency = p.p99_latency_s;
    last_tput = p.throughput_tok_s;
  }
  ScheduleSearchOptions o = ScheduleSearchOptions::defaults(sim, 64);
  o.policies = {SchedulePolicy::kRra};
  EXPECT_EQ(o.tp_degrees, (std::vector<int32_t>{2, 4}));  // 40 heads, 20480 columns
  ScheduleSearchOptions without = o;
  without.tp_degrees.clear();
  without.latency_bound = 1e-6;
  const double fastest = search_schedule(sim, without).fastest_latency_s;
  o.latency_bound = 0.9 * fastest;
  const ScheduleChoice c = search_schedule(sim, o);
  ASSERT_TRUE(c.feasible) << c.str();
  EXPECT_GT(c.best.vars.tp_groups, 0) << c.best.str();
  EXPECT_FALSE(c.best.allocation.tp_degrees.empty());
  EXPECT_LE(c.best.p99_latency_s, o.latency_bound);
}

TEST(ScheduleSearch, AnUnmeetableBoundNamesTheFastestLatency) {
  const Simulator sim = opt13b_on_a40(4, "S");
  ScheduleSearchOptions o = ScheduleSearchOptions::defaults(sim, 64);
  o.latency_bound = 1e-4;
  const ScheduleChoice c = search_schedule(sim, o);
  EXPECT_FALSE(c.feasible);
  EXPECT_GT(c.fastest_latency_s, 1e-4);
  EXPECT_TRUE(std::isfinite(c.fastest_latency_s));
  EXPECT_NE(c.str().find("fastest achievable p99 latency"), std::string::npos) << c.str();
}

// 26 GB of OPT-13B weights over four 4 GiB stages: no point fits, so no latency is
// achievable, and the refusal names the smallest schedule, its stage and its shortfall.
TEST(ScheduleSearch, NothingThatFitsSaysWhereTheSmallestScheduleFallsShort) {
  const Simulator sim = opt13b_on_a40(4, "S", int64_t{4} << 30);
  ScheduleSearchOptions o = ScheduleSearchOptions::defaults(sim, 64);
  o.latency_bound = std::numeric_limits<double>::infinity();
  const ScheduleChoice c = search_schedule(sim, o);
  EXPECT_FALSE(c.feasible);
  EXPECT_FALSE(std::isfinite(c.fastest_latency_s));
  ASSERT_TRUE(c.fits_nowhere());
  EXPECT_EQ(c.smallest_unfit->vars.encode_batch, 1);
  const std::string why = c.why_none();
  for (const char* part :
       {"no schedule fits; the smallest tried, ", "B_E=1", "stage 1", "gpu needs", "short by"})
    EXPECT_NE(why.find(part), std::string::npos) << part << " in: " << why;
  EXPECT_NE(c.str().find(why), std::string::npos) << c.str();
}

}  // namespace
}  // namespace strata
