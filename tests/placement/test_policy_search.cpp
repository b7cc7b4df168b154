// FlexGen's policy search (§4.3, Eq. 1): the placement LP against the cost model, the
// outer search over (gbs, number of GPU batches), its refusals, and the paper's worked
// example -- OPT-30B on the T4 machine, prompt 512, 32 generated tokens.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "kernels/error.h"
#include "placement/policy_search.h"
#include "support/opt_shapes.h"

namespace strata {
namespace {

constexpr double kGiB = double(int64_t{1} << 30);
const Workload kWorkload{512, 32};

ModelShape opt(int64_t hidden, int64_t ffn, int64_t layers, int64_t heads) {
  return testing::opt_shape(hidden, ffn, layers, heads);
}

ModelShape opt_30b() {
  return opt(7168, 28672, 48, 56);
}
ModelShape opt_6_7b() {
  return opt(4096, 16384, 32, 32);
}

// Eq. 1's objective at a placement, each phase its slowest bound:
// (T_pre + (n - 1) T_gen) x l / bls.
double time_per_sequence(const CostModelTerms& t, const Placement& x) {
  const auto top = [&](const PhaseTerms& p) {
    double m = 0;
    for (const TimeBound& b : p.bounds) m = std::max(m, b.time.eval(x));
    return m;
  };
  return (top(t.prefill) + double(t.gen_len - 1) * top(t.decode)) * double(t.n_layers) /
         double(t.block_size);
}

// FlexGen's policy for OPT-30B on the T4 (Table 4, 15, 21, 23), its f16 cache: 7.32 token/s
// measured.
const char* kPaperOpt30b = "gbs=48,ngb=3,w=20/80/0,c=0/100/0,h=0/100/0,cpu_attn=1,cf16=1";
constexpr double kPaperOpt30bThroughput = 7.32;

// FlexGen's own setting: its f16 KV cache (cf16). Strata's engine keeps an f32 cache unless
// told otherwise, and the search plans what the engine runs; the cases that reproduce
// FlexGen's paper search as FlexGen did.
SearchOptions flexgens() {
  SearchOptions o;
  o.cache_f16 = true;
  return o;
}

std::string search_error(const HardwareSpec& hw, const SearchOptions& o = {}) {
  try {
    search_policy(opt_30b(), kWorkload, hw, o);
  } catch (const InputError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(PolicySearch, Opt30bOnT4LandsInThePapersRegion) {
  const HardwareSpec hw = HardwareSpec::flexgen_t4();
  const SearchResult r = search_policy(opt_30b(), kWorkload, hw, flexgens());
  const CostEstimate paper = estimate_cost(opt_30b(), kWorkload, Policy::parse(kPaperOpt30b), hw);
  fmt::print("  FlexGen (Tables 15/21): {} -> {:.2f} token/s measured, {:.3f} predicted here\n",
             Policy::parse(kPaperOpt30b).str(), kPaperOpt30bThroughput, paper.throughput);
  fmt::print("  search:                 {} -> {:.3f} token/s predicted\n", r.policy.str(),
             r.cost.throughput);
  fmt::print("  {}\n", r.str());
  const Policy& p = r.policy;
  EXPECT_GE(p.gpu_batch_size, 32);  // the grid's neighbours of 48
  EXPECT_LE(p.gpu_batch_size, 64);
  EXPECT_GE(p.num_gpu_batches, 2);
  EXPECT_LE(p.num_gpu_batches, 4);
  EXPECT_NEAR(p.w_gpu_percent, 20, 5);  // about 20% of the weights on the GPU,
  EXPECT_EQ(p.w_disk_percent(), 0);     // the rest on the CPU
  EXPECT_EQ(p.cache_cpu_percent, 100);  // cache and activations on the CPU
  EXPECT_EQ(p.act_cpu_percent, 100);
  EXPECT_TRUE(p.cpu_cache_compute);
  EXPECT_NEAR(r.cost.throughput, kPaperOpt30bThroughput, 0.1 * kPaperOpt30bThroughput);
  EXPECT_TRUE(r.cost.fits(hw));
}

// The search's optimum against an independent brute force: every policy on a grid (each
// schedule; weights and cache in 10% steps, activations in 20% steps over GPU/CPU/disk)
// evaluated with the cost model, the fastest that fits kept. The search is an LP
// relaxation rounded to neighbouring grid points, not an exhaustive one: measured against
// this grid it comes within 2% (OPT-30B with 40 GiB of host memory: 0.6437 against the
// grid's 0.6559 token/s at the time of writing), inside the 5% the search itself treats as
// a tie. So the bound is 2.5% below the grid's best; and since the search places cache and
// activations in whole percents, it may beat the grid, but not by more than 5%.
struct BruteForce {
  Policy best;
  double throughput = 0;
  int64_t evaluated = 0;
};

std::vector<std::pair<int, int>> splits(int step) {  // (GPU, CPU) percents; disk is the rest
  std::vector<std::pair<int, int>> out;
  for (int g = 0; g <= 100; g += step)
    for (int c = 0; g + c <= 100; c += step) out.emplace_back(g, c);
  return out;
}

BruteForce brute_force(const ModelShape& shape, const HardwareSpec& hw,
                       const std::vector<int64_t>& sizes, int64_t max_ngb) {
  BruteForce out;
  const auto tenths = splits(10), fifths = splits(20);
  for (int64_t gbs : sizes) {
    for (int64_t ngb = 1; ngb <= max_ngb; ++ngb) {
      for (auto [wg, wc] : tenths) {
        for (auto [cg, cc] : tenths) {
          for (auto [hg, hc] : fifths) {
            Policy p;
            p.gpu_batch_size = gbs, p.num_gpu_batches = ngb;
            p.w_gpu_percent = wg, p.w_cpu_percent = wc;
            p.cache_gpu_percent = cg, p.cache_cpu_percent = cc;
            p.act_gpu_percent = hg, p.act_cpu_percent = hc;
            p.cpu_cache_compute = true;
            p.cache_f16 = true;  // as flexgens() searches
            const CostEstimate c = estimate_cost(shape, kWorkload, p, hw);
            ++out.evaluated;
            if (c.throughput > out.throughput && c.fits(hw)) {
              out.throughput = c.throughput;
              out.best = p;
            }
          }
        }
      }
    }
  }
  return out;
}

void expect_search_agrees_with_brute_force(const ModelShape& shape, const HardwareSpec& hw,
                                           const char* what) {
  SearchOptions o = flexgens();
  o.gpu_batch_sizes = {8, 32, 48};
  o.max_num_gpu_batches = 4;
  o.weight_step_percent = 10;
  o.tie_tolerance = 0;  // the fastest, as the brute force keeps
  const SearchResult r = search_policy(shape, kWorkload, hw, o);
  const BruteForce bf = brute_force(shape, hw, o.gpu_batch_sizes, o.max_num_gpu_batches);
  ASSERT_GT(bf.throughput, 0) << what << ": the grid has a policy that fits";
  fmt::print("  {}: search {} -> {:.4f} token/s; brute force over {} policies {} -> {:.4f}\n", what,
             r.policy.compact(), r.cost.throughput, bf.evaluated, bf.best.compact(), bf.throughput);
  // What the search reports is what the cost model says of its policy, and it fits.
  const CostEstimate again = estimate_cost(shape, kWorkload, r.policy, hw);
  EXPECT_TRUE(again.fits(hw)) << what;
  EXPECT_DOUBLE_EQ(again.throughput, r.cost.throughput) << what;
  EXPECT_EQ(r.policy.w_gpu_percent % 10, 0) << what;
  EXPECT_EQ(r.policy.w_cpu_percent % 10, 0) << what;
  EXPECT_GE(r.cost.throughput, bf.throughput * (1 - 0.025)) << what << ": missed " << bf.best.str();
  EXPECT_LE(r.cost.throughput, bf.throughput * 1.05) << what;
}

TEST(PolicySearch, Opt30bOnT4AgreesWithBruteForce) {
  expect_search_agrees_with_brute_force(opt_30b(), HardwareSpec::flexgen_t4(), "OPT-30B on T4");
}

TEST(PolicySearch, Opt30bWithTheWeightsPartlyOnDiskAgreesWithBruteForce) {
  // 40 GiB of host memory for 55 GiB of weights: some must go to disk.
  HardwareSpec hw = HardwareSpec::flexgen_t4();
  hw.cpu_mem = 40 * kGiB;
  expect_search_agrees_with_brute_force(opt_30b(), hw, "OPT-30B, 40 GiB host");
}

TEST(PolicySearch, Opt6_7bOnT4AgreesWithBruteForce) {
  expect_search_agrees_with_brute_force(opt_6_7b(), HardwareSpec::flexgen_t4(), "OPT-6.7B on T4");
}

TEST(PolicySearch, TiesWithinTheToleranceGoToTheSmallestBlock) {
  const HardwareSpec hw = HardwareSpec::flexgen_t4();
  SearchOptions exact = flexgens();
  exact.tie_tolerance = 0;
  const SearchResult fastest = search_policy(opt_30b(), kWorkload, hw, exact);
  const SearchResult chosen = search_policy(opt_30b(), kWorkload, hw, flexgens());
  const CostEstimate paper = estimate_cost(opt_30b(), kWorkload, Policy::parse(kPaperOpt30b), hw);
  fmt::print("  highest predicted throughput: {} -> {:.3f} token/s\n", fastest.policy.str(),
             fastest.cost.throughput);
  EXPECT_GE(fastest.cost.throughput, chosen.cost.throughput);
  EXPECT_GE(fastest.cost.throughput, paper.throughput);
  EXPECT_GE(chosen.cost.throughput, 0.95 * fastest.cost.throughput);
  EXPECT_LE(chosen.policy.block_size(), fastest.policy.block_size());
}

TEST(PolicySearch, LpIsALowerBoundOnAnyFeasiblePolicy) {
  const HardwareSpec hw = HardwareSpec::flexgen_t4();
  const Policy paper = Policy::parse(kPaperOpt30b);
  const auto lp = solve_placement_lp(opt_30b(), kWorkload, paper, hw);
  ASSERT_TRUE(lp.has_value());
  const CostEstimate at_paper = estimate_cost(opt_30b(), kWorkload, paper, hw);
  EXPECT_LE(lp->time_per_sequence, at_paper.time_per_sequence() * (1 + 1e-9));
  // The cache and the activations stay on the CPU (CPU attention) and the weights take the
  // GPU's memory: FlexGen's 20% relaxed to what the GPU holds. By hand, A.3's GPU peak in
  // prefill (the larger one) at gbs 48, s 512, h1 7168, nh 56, with a layer's weights
  // w = 2 bytes x 616,655,872 parameters = 1,233,311,744 B:
  //   wg x 48 w                         the GPU's share of the weights
  //   + (1 - wg) x 2 w                  the double buffer for the streamed ones
  //   + 2 s h1 gbs x 2 B = 352,321,536  the activation buffer
  //   + 2 gbs (2 s h1 + nh s^2) x 2 B   the largest working set, attention's scores
  //     = 2,113,929,216                 <= 16 GiB = 17,179,869,184
  // so wg <= 12,246,994,944 / 56,732,340,224 = 0.215873.
  EXPECT_NEAR(lp->placement[kWg], 0.215873, 1e-5);
  EXPECT_NEAR(lp->placement[kWc], 1 - 0.215873, 1e-5);
  EXPECT_NEAR(lp->placement[kCc], 1.0, 1e-6);
  EXPECT_NEAR(lp->placement[kHc], 1.0, 1e-6);
  // And no placement of that kind beats it: a brute-force sweep of wg in steps of 0.001
  // finds its best feasible point at the last step below 0.215873, no faster than the LP.
  const CostModelTerms t = cost_model_terms(opt_30b(), kWorkload, paper, hw);
  double best = 0, best_time = 0;
  for (int k = 0; k <= 1000; ++k) {
    Placement x{};
    x[kWg] = k / 1000.0, x[kWc] = 1 - x[kWg], x[kCc] = 1, x[kHc] = 1;
    if (t.gpu_prefill.eval(x) > hw.gpu_mem || t.gpu_decode.eval(x) > hw.gpu_mem ||
        t.cpu_prefill.eval(x) > hw.cpu_mem || t.cpu_decode.eval(x) > hw.cpu_mem)
      continue;
    const double time = time_per_sequence(t, x);
    if (best_time == 0 || time < best_time) best = x[kWg], best_time = time;
  }
  EXPECT_DOUBLE_EQ(best, 0.215);
  EXPECT_LE(lp->time_per_sequence, best_time * (1 + 1e-9));
}

TEST(PolicySearch, LpOptimumSatisfiesEveryConstraintAndItsEpigraphIsTight) {
  const HardwareSpec hw = HardwareSpec::flexgen_t4();
  for (auto [gbs, ngb] : {std::pair{8, 4}, {48, 3}, {64, 1}, {32, 8}}) {
    Policy s;
    s.gpu_batch_size = gbs, s.num_gpu_batches = ngb, s.cpu_cache_compute = true;
    const auto lp = solve_placement_lp(opt_30b(), kWorkload, s, hw);
    ASSERT_TRUE(lp.has_value()) << gbs << "x" << ngb;
    const Placement& x = lp->placement;
    for (int first : {kWg, kCg, kHg}) EXPECT_NEAR(x[first] + x[first + 1] + x[first + 2], 1, 1e-9);
    for (double v : x) EXPECT_TRUE(v >= 0 && v <= 1);
    const CostModelTerms t = cost_model_terms(opt_30b(), kWorkload, s, hw);
    const double slack = 1 + 1e-7;
    EXPECT_LE(t.gpu_prefill.eval(x), hw.gpu_mem * slack);
    EXPECT_LE(t.gpu_decode.eval(x), hw.gpu_mem * slack);
    EXPECT_LE(t.cpu_prefill.eval(x), hw.cpu_mem * slack);
    EXPECT_LE(t.cpu_decode.eval(x), hw.cpu_mem * slack);
    EXPECT_LE(t.disk.eval(x), hw.disk_mem * slack);
    const auto top = [&](const PhaseTerms& p) {
      double m = 0;
      for (const TimeBound& b : p.bounds) m = std::max(m, b.time.eval(x));
      return m;
    };
    const double per_seq = (top(t.prefill) + 31 * top(t.decode)) * 48 / double(gbs * ngb);
    EXPECT_NEAR(lp->time_per_sequence, per_seq, 1e-6 * per_seq) << gbs << "x" << ngb;
  }
}

TEST(PolicySearch, AModelThatFitsOnTheGpuStaysThere) {
  // FlexGen runs OPT-6.7B entirely on the T4 (Table 15: 2x1, all on the GPU).
  const SearchResult r = search_policy(opt_6_7b(), kWorkload, HardwareSpec::flexgen_t4());
  fmt::print("  OPT-6.7B: {} -> {:.2f} token/s predicted (FlexGen: 2x1, all on GPU, 25.26)\n",
             r.policy.str(), r.cost.throughput);
  EXPECT_EQ(r.policy.w_gpu_percent, 100);
  EXPECT_EQ(r.policy.cache_gpu_percent, 100);
  EXPECT_EQ(r.policy.act_gpu_percent, 100);
}

TEST(PolicySearch, PerfectOverlapTradesGpuWeightsForGpuCache) {
  // Under A.3 as printed the weight transfer hides behind decode compute, so GPU memory is
  // worth more as cache (which spares CPU attention) than as weights: the opposite of what
  // FlexGen measured and chose, and why the T4 preset uses the fitted overlap model.
  HardwareSpec hw = HardwareSpec::flexgen_t4();
  hw.overlap_model = OverlapModel::kPaper;
  const SearchResult r = search_policy(opt_30b(), kWorkload, hw);
  fmt::print("  A.3 perfect overlap: {} -> {:.3f} token/s predicted\n", r.policy.str(),
             r.cost.throughput);
  EXPECT_GT(r.policy.cache_gpu_percent, 0);
  EXPECT_LT(r.policy.w_gpu_percent, 20);
}

TEST(PolicySearch, HonoursTheOptions) {
  const HardwareSpec hw = HardwareSpec::flexgen_t4();
  SearchOptions o;
  o.gpu_batch_sizes = {48};
  o.max_num_gpu_batches = 3;
  o.weight_step_percent = 10;
  const SearchResult r = search_policy(opt_30b(), kWorkload, hw, o);
  EXPECT_EQ(r.policy.gpu_batch_size, 48);
  EXPECT_LE(r.policy.num_gpu_batches, 3);
  EXPECT_EQ(r.policy.w_gpu_percent % 10, 0);
  EXPECT_EQ(r.schedules_tried, 3);

  o = SearchOptions{};
  o.compress_weight = true;
  const SearchResult packed = search_policy(opt_30b(), kWorkload, hw, o);
  EXPECT_TRUE(packed.policy.compress_weight);
  EXPECT_GE(packed.cost.throughput, search_policy(opt_30b(), kWorkload, hw).cost.throughput);

  o = SearchOptions{};
  o.overlap = false;
  EXPECT_FALSE(search_policy(opt_30b(), kWorkload, hw, o).policy.overlap);
}

// With Pie and HeteGen allowed, FlexGen's own case (T4, OPT-30B) keeps FlexGen's answer:
// the T4's 1 GB/s cache link gives Pie no stall-free layer, and at a block of ~150 eq. 5
// leaves the 12 GFLOP/s CPU almost nothing (docs/PIE_HETEGEN.md).
TEST(PolicySearch, PieAndHeteGenLeaveFlexGensT4CaseAlone) {
  const HardwareSpec hw = HardwareSpec::flexgen_t4();
  SearchOptions o;
  o.pie = o.hetegen = true;
  const SearchResult both = search_policy(opt_30b(), kWorkload, hw, o);
  const SearchResult flexgen = search_policy(opt_30b(), kWorkload, hw);
  EXPECT_EQ(both.policy, flexgen.policy);
  EXPECT_GT(both.schedules_tried, flexgen.schedules_tried);  // the variants were solved
}

// A CPU of 1.5 TFLOP/s beside the T4's link, decode-heavy work (32 in, 512 out): splitting
// the CPU-tier linears beats streaming them, at eq. 5's alpha for the chosen block.
TEST(PolicySearch, ChoosesHeteGenWhenTheCpuCanTakeAShare) {
  HardwareSpec hw = HardwareSpec::flexgen_t4();
  hw.cpu_flops = 1.5e12;
  const Workload w{32, 512};
  SearchOptions o;
  o.hetegen = true;
  const SearchResult split = search_policy(opt_30b(), w, hw, o);
  const SearchResult flexgen = search_policy(opt_30b(), w, hw);
  fmt::print("  FlexGen: {} -> {:.2f} token/s\n  HeteGen: {} -> {:.2f} token/s\n",
             flexgen.policy.compact(), flexgen.cost.throughput, split.policy.compact(),
             split.cost.throughput);
  ASSERT_GT(split.policy.hetegen_alpha_percent, 0);
  EXPECT_GT(split.policy.w_cpu_percent, 0);
  EXPECT_GT(split.cost.throughput, 1.2 * flexgen.cost.throughput);
  const double rows = double(split.policy.block_size());
  const double v_cpu = hw.cpu_flops / (2 * rows), v_gpu = hw.mm_flops_decode / (2 * rows);
  const double v_com = hw.ctog_bdw / 2;  // fp16 bytes
  const double alpha = 1 / (v_cpu / v_com + v_cpu / v_gpu + 1);
  EXPECT_EQ(split.policy.hetegen_alpha_percent, std::lround(alpha * 100));
}

// A Grace-Hopper-like link (400 GB/s each way) with a slow CPU for attention, OPT-66B: the
// search keeps the cache on the GPU tier with Pie's host layers, none of them stalling.
HardwareSpec grace_hopper_like() {
  HardwareSpec hw = HardwareSpec::flexgen_t4();
  hw.ctog_bdw = hw.gtoc_bdw_cache = hw.gtoc_bdw_hidden = 400e9;
  hw.mm_flops_decode = 20e12, hw.mm_flops_prefill = 400e12;
  hw.bmm_flops_decode = 2e12, hw.bmm_flops_prefill = 200e12;
  hw.gpu_mem = 96 * kGiB, hw.cpu_mem = 480 * kGiB;
  hw.cpu_flops = 1e11;
  hw.overlap_model = OverlapModel::kPaper;
  return hw;
}

TEST(PolicySearch, ChoosesPieWhenTheLinkHidesTheSwaps) {
  const HardwareSpec hw = grace_hopper_like();
  const ModelShape opt_66b = opt(9216, 36864, 64, 72);
  const Workload w{512, 256};
  SearchOptions o = flexgens();
  o.pie = true;
  const SearchResult pie = search_policy(opt_66b, w, hw, o);
  const SearchResult flexgen = search_policy(opt_66b, w, hw, flexgens());
  fmt::print("  FlexGen: {} -> {:.2f} token/s\n  Pie:     {} -> {:.2f} token/s\n",
             flexgen.policy.compact(), flexgen.cost.throughput, pie.policy.compact(),
             pie.cost.throughput);
  ASSERT_GT(pie.policy.pie_host_layers, 0);
  EXPECT_LE(pie.policy.pie_host_layers, 64 - 3);
  EXPECT_EQ(pie.policy.cache_gpu_percent, 100);
  EXPECT_NE(pie.cost.decode.binding, "pie");  // stall-free
  EXPECT_GE(pie.cost.throughput, (1 - o.tie_tolerance) * flexgen.cost.throughput);
}

// FlexGen's LP puts the T4's cache on the CPU (its 1 GB/s GPU->CPU link is slow but CPU
// attention needs no link); with Pie the cache must stay on the GPU tier.
TEST(PolicySearch, ThePlacementLpOfAPieScheduleKeepsTheCacheOnTheGpuTier) {
  const HardwareSpec hw = HardwareSpec::flexgen_t4();
  const Policy flexgen = Policy::parse("gbs=8,ngb=2,cpu_attn=1,cf16=1");
  Policy pie = flexgen;
  pie.pie_host_layers = 2;
  const auto a = solve_placement_lp(opt_30b(), kWorkload, flexgen, hw);
  const auto b = solve_placement_lp(opt_30b(), kWorkload, pie, hw);
  ASSERT_TRUE(a && b);
  EXPECT_LT(a->placement[kCg], 0.5);
  EXPECT_EQ(b->placement[kCg], 1);
  EXPECT_EQ(b->placement[kCc] + b->placement[kCd], 0);
}

// An f16 cache (cf16) is FlexGen's own: half the bytes of the engine's default f32 cache. On
// the T4, OPT-6.7B's placement LP keeps at least as much of it on the GPU as of the f32 one,
// and most of it (AModelThatFitsOnTheGpuStaysThere), at no greater cost; the search keeps cf16
// with or without CPU attention, and tries Pie's variants for it as for the default cache.
TEST(PolicySearch, AnF16CacheIsPlacedAsFlexGensCache) {
  const HardwareSpec hw = HardwareSpec::flexgen_t4();
  Policy schedule = Policy::parse("gbs=2,ngb=1,cpu_attn=1");
  const auto f32 = solve_placement_lp(opt_6_7b(), kWorkload, schedule, hw);
  schedule.cache_f16 = true;
  const auto f16 = solve_placement_lp(opt_6_7b(), kWorkload, schedule, hw);
  ASSERT_TRUE(f32 && f16);
  EXPECT_GT(f16->placement[kCg], 0.5);
  EXPECT_GE(f16->placement[kCg], f32->placement[kCg] - 1e-9);
  EXPECT_LE(f16->time_per_sequence, f32->time_per_sequence * (1 + 1e-9));

  SearchOptions o = flexgens();
  const SearchResult r = search_policy(opt_6_7b(), kWorkload, hw, o);
  EXPECT_TRUE(r.policy.cache_f16);
  EXPECT_GT(r.policy.cache_gpu_percent, 50);
  o.cpu_attention = false;  // attended on the GPU, whatever tier holds it
  EXPECT_TRUE(search_policy(opt_6_7b(), kWorkload, hw, o).policy.cache_f16);
  // Pie's variants (more LPs than the plain search) with the f16 cache as with the default.
  const HardwareSpec fast = grace_hopper_like();
  SearchOptions pie;
  pie.pie = true;
  const SearchResult plain = search_policy(opt_6_7b(), kWorkload, fast, SearchOptions{});
  EXPECT_GT(search_policy(opt_6_7b(), kWorkload, fast, pie).schedules_tried, plain.schedules_tried);
  pie.cache_f16 = true;
  const SearchResult f16_plain = search_policy(opt_6_7b(), kWorkload, fast, flexgens());
  const SearchResult f16_pie = search_policy(opt_6_7b(), kWorkload, fast, pie);
  EXPECT_TRUE(f16_pie.policy.cache_f16);
  EXPECT_GT(f16_pie.schedules_tried, f16_plain.schedules_tried);
}

TEST(PolicySearch, RejectsBadOptions) {
  const HardwareSpec hw = HardwareSpec::flexgen_t4();
  SearchOptions o;
  o.weight_step_percent = 7;
  EXPECT_NE(search_error(hw, o).find("weight_step_percent=7 must divide 100"), std::string::npos);
  o = SearchOptions{};
  o.max_num_gpu_batches = 0;
  EXPECT_NE(search_error(hw, o).find("max_num_gpu_batches=0"), std::string::npos);
  o = SearchOptions{};
  o.gpu_batch_sizes = {16, 0};
  EXPECT_NE(search_error(hw, o).find("GPU batch size 0"), std::string::npos);
  o = SearchOptions{};
  o.tie_tolerance = 1.5;
  EXPECT_NE(search_error(hw, o).find("tie_tolerance"), std::string::npos);
  o = SearchOptions{};
  o.compress_cache = true;  // with cpu_attention, which FlexGen turns off for it
  EXPECT_NE(search_error(hw, o).find("compress_cache=1 with cpu_attention=1"), std::string::npos);
}

TEST(PolicySearch, TooLittleGpuMemorySaysHowMuchIsMissing) {
  HardwareSpec hw = HardwareSpec::flexgen_t4();
  hw.gpu_mem = 1 * kGiB;
  // The least GPU memory any placement of the smallest schedule needs: everything off the
  // GPU, which still double-buffers a layer's weights and holds its working set.
  const CostEstimate least = estimate_cost(
      opt_30b(), kWorkload, Policy::parse("gbs=1,ngb=1,w=0/100/0,c=0/100/0,h=0/100/0,cpu_attn=1"),
      HardwareSpec::flexgen_t4());
  EXPECT_EQ(search_error(hw),
            fmt::format("policy search: no policy fits. GPU memory: the smallest configuration "
                        "(gpu_batch_size=1, num_gpu_batches=1) needs {} but gpu_mem is 1.0 GiB "
                        "(short by {})",
                        format_gib(least.peak.gpu()), format_gib(least.peak.gpu() - kGiB)));
}

TEST(PolicySearch, TooLittleCpuMemorySaysSo) {
  HardwareSpec hw = HardwareSpec::flexgen_t4();
  hw.cpu_mem = 0.5 * kGiB;  // less than one layer's staging buffer
  const std::string e = search_error(hw);
  EXPECT_NE(e.find("CPU memory: the smallest configuration"), std::string::npos) << e;
  EXPECT_NE(e.find("but cpu_mem is 0.5 GiB (short by"), std::string::npos) << e;
  EXPECT_EQ(e.find("GPU memory"), std::string::npos) << e;
}

TEST(PolicySearch, AModelLargerThanAllTiersIsChargedToTheDisk) {
  HardwareSpec hw = HardwareSpec::flexgen_t4();
  hw.cpu_mem = 10 * kGiB;
  hw.disk_mem = 10 * kGiB;  // 36 GiB in all for 55 GiB of weights
  const std::string e = search_error(hw);
  EXPECT_NE(e.find("Disk memory: the smallest configuration"), std::string::npos) << e;
  EXPECT_NE(e.find("but disk_mem is 10.0 GiB (short by"), std::string::npos) << e;
}

}  // namespace
}  // namespace strata
