// HeteGen's decisions against the paper's formulas worked by hand: alpha from speeds
// (eq. 5-7) and from whole-module times with pinning (eq. 9), the alpha benchmark's fit and
// crossing (eq. 10-12) on synthetic timings whose crossing is solved in closed form here, the
// clamp when the fits never cross, and the module scheduler's gain order and budget cutoff
// (eq. 13) on a hand example. Bad input names the value at fault.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "kernels/error.h"
#include "placement/hetegen.h"
#include "support/input_error.h"

namespace strata::hetegen {
namespace {

using testing::input_error;

// V_cpu = 1, V_gpu = 10, V_com = 4 (parameters per second).
TEST(HeteGenAlpha, Eq5FromSpeeds) {
  // 1 / (1/4 + 1/10 + 1) = 1 / 1.35
  EXPECT_NEAR(alpha_from_speeds(1, 10, 4), 1.0 / 1.35, 1e-15);
  EXPECT_NEAR(alpha_from_speeds(1, 10, 4), 0.7407407407407407, 1e-15);
  // The first form of eq. 5: V_gpu V_com / (V_cpu V_gpu + V_cpu V_com + V_com V_gpu)
  // = 40 / (10 + 4 + 40) = 40 / 54.
  EXPECT_NEAR(alpha_from_speeds(1, 10, 4), 40.0 / 54.0, 1e-15);
}

TEST(HeteGenAlpha, Eq5BalancesEq4) {
  // (1 - alpha) W / V_cpu = alpha W / V_gpu + alpha W / V_com for W = 1 at other speeds.
  const double v_cpu = 3, v_gpu = 200, v_com = 7;
  const double a = alpha_from_speeds(v_cpu, v_gpu, v_com);
  EXPECT_NEAR((1 - a) / v_cpu, a / v_gpu + a / v_com, 1e-15);
}

TEST(HeteGenAlpha, Eq6DropsTheGpuTerm) {
  EXPECT_DOUBLE_EQ(alpha_ignoring_gpu(1, 4), 0.8);  // 4 / (4 + 1)
  // With an infinitely fast GPU eq. 5 tends to eq. 6.
  EXPECT_NEAR(alpha_from_speeds(1, 1e12, 4), 0.8, 1e-11);
}

TEST(HeteGenAlpha, Eq7FromWholeModuleTimes) {
  // T'_cpu = 1 / V_cpu = 1 s, T'_com = 1 / V_com = 0.25 s: 1 / 1.25 = 0.8, eq. 6's value.
  EXPECT_DOUBLE_EQ(alpha_from_times(1.0, 0.25), 0.8);
  EXPECT_DOUBLE_EQ(alpha_from_times(3.0, 1.0), 0.75);
}

TEST(HeteGenAlpha, Eq9TakesTheSlowerOfPinAndTransfer) {
  // Pin slower: 3 / (3 + max(1, 0.5)) = 3 / 4.
  EXPECT_DOUBLE_EQ(alpha_from_times(3.0, 1.0, 0.5), 0.75);
  // Transfer slower: 3 / (3 + max(0.5, 2)) = 3 / 5.
  EXPECT_DOUBLE_EQ(alpha_from_times(3.0, 0.5, 2.0), 0.6);
  // Memory already pinned: eq. 7 with T'_com = T'_trans.
  EXPECT_DOUBLE_EQ(alpha_from_times(3.0, 0.0, 1.0), 0.75);
}

TEST(HeteGenAlpha, BadSpeedsAndTimesAreNamed) {
  EXPECT_NE(input_error([] { alpha_from_speeds(0, 10, 4); }).find("V_cpu"), std::string::npos);
  EXPECT_NE(input_error([] { alpha_from_speeds(1, -10, 4); }).find("V_gpu must be a positive"),
            std::string::npos);
  EXPECT_NE(input_error([] { alpha_from_speeds(1, 10, NAN); }).find("V_com"), std::string::npos);
  EXPECT_NE(input_error([] { alpha_ignoring_gpu(1, 0); }).find("V_com"), std::string::npos);
  EXPECT_NE(input_error([] { alpha_from_times(-1, 1); }).find("T'_cpu"), std::string::npos);
  EXPECT_NE(input_error([] { alpha_from_times(1, 0, 0); }).find("max(T'_pin, T'_trans)"),
            std::string::npos);
  EXPECT_NE(input_error([] { alpha_from_times(1, -2, 1); }).find("T'_pin"), std::string::npos);
}

TEST(HeteGenFit, RecoversAQuadraticExactly) {
  // y = 2 - 3x + 5x^2 at five points: the fit reproduces it anywhere.
  const std::vector<double> x = {0.1, 0.3, 0.35, 0.6, 0.9};
  std::vector<double> y;
  for (double v : x) y.push_back(2 - 3 * v + 5 * v * v);
  const FittedPolynomial p = fit_polynomial(x, y, 2);
  for (double v : {0.0, 0.25, 0.5, 1.0}) EXPECT_NEAR(p(v), 2 - 3 * v + 5 * v * v, 1e-12) << v;
}

TEST(HeteGenFit, LeastSquaresLineThroughNoisyPoints) {
  // y = 0, 1, 0 at x = 0, 1, 2 (the middle one off a constant): the best line is y = 1/3.
  const FittedPolynomial p =
      fit_polynomial(std::vector<double>{0, 1, 2}, std::vector<double>{0, 1, 0}, 1);
  EXPECT_NEAR(p(0), 1.0 / 3, 1e-14);
  EXPECT_NEAR(p(2), 1.0 / 3, 1e-14);
}

// The CPU computes (1 - alpha) of a module taking T'_cpu = 10 s whole; the transfer carries
// alpha of one taking T'_trans = 4 s (pinning 3 s): T_cpu = 10 (1 - alpha), T_com = 4 alpha.
// They meet at 10 - 10 a = 4 a: a = 10 / 14, both 40 / 14.
TEST(HeteGenAlphaBenchmark, LinearTimingsCrossWhereEq9Says) {
  AlphaBenchmarkOptions o;
  o.alpha0 = 0.7;
  o.gamma = 0.1;
  o.lambda = 0.02;
  int calls = 0;
  const auto r = run_alpha_benchmark(o, [&](double a) {
    ++calls;
    return AlphaTiming{10 * (1 - a), 3 * a, 4 * a};
  });
  EXPECT_EQ(calls, 11);  // 0.60, 0.62, ..., 0.80
  ASSERT_EQ(r.samples.size(), 11u);
  EXPECT_NEAR(r.samples.front().alpha, 0.6, 1e-12);
  EXPECT_NEAR(r.samples.back().alpha, 0.8, 1e-12);
  EXPECT_TRUE(r.crossed);
  EXPECT_NEAR(r.alpha, 10.0 / 14.0, 1e-9);
  EXPECT_NEAR(r.t_cpu, 40.0 / 14.0, 1e-9);
  EXPECT_NEAR(r.t_com, 40.0 / 14.0, 1e-9);
  // Linear times: eq. 9 from the whole-module times gives the same alpha.
  EXPECT_NEAR(alpha_from_times(10, 3, 4), 10.0 / 14.0, 1e-15);
}

// Quadratic timings, transfer slower than pinning: T_cpu = 6 b + 3 b^2 with b = 1 - a, and
// T_com = T_trans = 2 a + a^2 = 3 - 4 b + b^2. Equal where 2 b^2 + 10 b - 3 = 0:
// b = (-10 + sqrt(124)) / 4, a = 1 - b = 0.71611781...
TEST(HeteGenAlphaBenchmark, QuadraticTimingsCrossAtTheClosedFormRoot) {
  const double b = (-10 + std::sqrt(124.0)) / 4;
  const double want = 1 - b;
  ASSERT_NEAR(want, 0.7161178, 1e-7);
  AlphaBenchmarkOptions o;
  o.alpha0 = 0.65;
  o.gamma = 0.1;
  o.lambda = 0.025;
  const auto r = run_alpha_benchmark(o, [](double a) {
    const double c = 1 - a;
    return AlphaTiming{6 * c + 3 * c * c, 0.5 * (2 * a + a * a), 2 * a + a * a};
  });
  EXPECT_TRUE(r.crossed);
  EXPECT_NEAR(r.alpha, want, 1e-9);
  EXPECT_NEAR(r.t_com, 2 * want + want * want, 1e-9);
  EXPECT_NEAR(r.t_cpu, r.t_com, 1e-9);
}

// The same with pinning the slower side: T_com = T_pin, so the crossing must move with it.
TEST(HeteGenAlphaBenchmark, PinSlowerThanTransferSetsTCom) {
  const double b = (-10 + std::sqrt(124.0)) / 4;
  const double want = 1 - b;
  const auto r = fit_alpha(
      [&] {
        std::vector<AlphaSample> s;
        for (double a = 0.6; a < 0.801; a += 0.05) {
          const double c = 1 - a;
          s.push_back({a, {6 * c + 3 * c * c, 2 * a + a * a, 0.1 * a}});
        }
        return s;
      }(),
      2);
  EXPECT_NEAR(r.alpha, want, 1e-9);
  EXPECT_NEAR(r.t_com, 2 * want + want * want, 1e-9);
}

TEST(HeteGenAlphaBenchmark, NoCrossingClampsToTheEndWithTheSmallerMax) {
  // The CPU is slower everywhere: T_cpu = 10 + (1 - a), T_com = a. max is 11 at 0, 10 at 1.
  std::vector<AlphaSample> slow_cpu;
  for (double a : {0.4, 0.5, 0.6}) slow_cpu.push_back({a, {10 + (1 - a), 0, a}});
  const auto r1 = fit_alpha(slow_cpu, 2);
  EXPECT_FALSE(r1.crossed);
  EXPECT_EQ(r1.alpha, 1.0);
  EXPECT_NEAR(r1.t_cpu, 10, 1e-9);
  EXPECT_NEAR(r1.t_com, 1, 1e-9);
  // The transfer is slower everywhere: T_cpu = 0.1 (1 - a), T_com = 5 + a. max 5 at 0, 6 at 1.
  std::vector<AlphaSample> slow_com;
  for (double a : {0.4, 0.5, 0.6}) slow_com.push_back({a, {0.1 * (1 - a), 5 + a, 0}});
  const auto r2 = fit_alpha(slow_com, 1);
  EXPECT_FALSE(r2.crossed);
  EXPECT_EQ(r2.alpha, 0.0);
  EXPECT_NEAR(r2.t_com, 5, 1e-9);
  EXPECT_NE(r2.str().find("no crossing"), std::string::npos);
}

// The engine's benchmark (--hetegen-alpha auto) on given timings, solved by hand:
//   T_cpu(a) = 11 - 10 a, T_pin(a) = 3 a, T_trans(a) = 0.5 + 4 a (T_com = T_trans: pin faster).
// Eq. 9's first guess from the whole-module times: T'_cpu = T_cpu(0) = 11, max(T'_pin,
// T'_trans) = max(3, 4.5) = 4.5, alpha0 = 11 / 15.5. The window alpha0 +- 0.1 in steps of
// 0.05 is 5 alphas; lines through them are the timings exactly, and F_cpu = F_com gives
// 11 - 10 a = 0.5 + 4 a: alpha-bar = 10.5 / 14 = 0.75, T-bar = 3.5 (eq. 10-12).
TEST(HeteGenAlphaBenchmark, EngineBenchmarkSolvesEq10To12ByHand) {
  std::vector<double> asked;
  const AlphaMeasure measure = [&](double a) {
    asked.push_back(a);
    return AlphaTiming{11 - 10 * a, 3 * a, 0.5 + 4 * a};
  };
  const AlphaBenchmarkResult r = benchmark_module(measure, engine_alpha_window());
  ASSERT_GE(asked.size(), 2u);
  EXPECT_EQ(asked[0], 0.0);  // T'_cpu: every row on the CPU
  EXPECT_EQ(asked[1], 1.0);  // T'_pin, T'_trans: the whole module moved
  ASSERT_EQ(r.samples.size(), 5u);
  EXPECT_NEAR(r.samples.front().alpha, 11.0 / 15.5 - 0.1, 1e-12);
  EXPECT_NEAR(r.samples.back().alpha, 11.0 / 15.5 + 0.1, 1e-12);
  EXPECT_TRUE(r.crossed);
  EXPECT_NEAR(r.alpha, 0.75, 1e-9);
  EXPECT_NEAR(r.t_cpu, 3.5, 1e-9);
  EXPECT_NEAR(r.t_com, 3.5, 1e-9);
  // Pinning slower than the transfer: T_pin(a) = 6 a sets T_com. alpha0 = 11 / 17; every
  // window alpha is above 0.25, where 6 a > 0.5 + 4 a, so 11 - 10 a = 6 a: alpha-bar = 11 / 16.
  const AlphaBenchmarkResult p = benchmark_module(
      [](double a) {
        return AlphaTiming{11 - 10 * a, 6 * a, 0.5 + 4 * a};
      },
      engine_alpha_window());
  EXPECT_NEAR(p.samples.front().alpha, 11.0 / 17 - 0.1, 1e-12);
  EXPECT_NEAR(p.alpha, 11.0 / 16, 1e-9);
  EXPECT_NEAR(p.t_com, 66.0 / 16, 1e-9);
}

TEST(HeteGenAlphaBenchmark, GridStaysInsideZeroToOne) {
  AlphaBenchmarkOptions o;
  o.alpha0 = 0.95;
  o.gamma = 0.1;
  o.lambda = 0.05;
  const auto g = alpha_grid(o);  // 0.85, 0.90, 0.95, 1.00 (1.05 left out)
  ASSERT_EQ(g.size(), 4u);
  EXPECT_NEAR(g[0], 0.85, 1e-12);
  EXPECT_NEAR(g[3], 1.0, 1e-12);
}

TEST(HeteGenAlphaBenchmark, BadInputIsNamed) {
  const AlphaMeasure m = [](double a) { return AlphaTiming{1 - a, 0, a}; };
  AlphaBenchmarkOptions o;
  o.gamma = 0;
  EXPECT_NE(input_error([&] { run_alpha_benchmark(o, m); }).find("gamma must be in (0, 1], got 0"),
            std::string::npos);
  o.gamma = 1.5;
  EXPECT_NE(input_error([&] { run_alpha_benchmark(o, m); }).find("gamma"), std::string::npos);
  o = {};
  o.lambda = 0.5;  // > 2 gamma
  EXPECT_NE(input_error([&] { run_alpha_benchmark(o, m); }).find("lambda"), std::string::npos);
  o = {};
  o.alpha0 = 1.2;
  EXPECT_NE(input_error([&] { run_alpha_benchmark(o, m); }).find("alpha0"), std::string::npos);
  o = {};
  o.degree = 0;
  EXPECT_NE(input_error([&] { run_alpha_benchmark(o, m); }).find("degree"), std::string::npos);
  o = {};
  o.lambda = 0.2;  // 0.4, 0.6: two alphas for a quadratic
  EXPECT_NE(input_error([&] { run_alpha_benchmark(o, m); }).find("needs 3"), std::string::npos);
  EXPECT_NE(input_error([] { fit_alpha({}, 2); }).find("no samples"), std::string::npos);
  const std::vector<AlphaSample> negative = {{0.1, {1, 0, 0}}, {0.2, {-1, 0, 0}}};
  EXPECT_NE(input_error([&] { fit_alpha(negative, 1); }).find("T_cpu at alpha 0.2"),
            std::string::npos);
}

// Gains (eq. 13, T_cpu / Mem): B 4/50 = 0.08, A 5/100 = 0.05, C 6/200 = 0.03, D 1/40 = 0.025.
// Split at alpha 0.5 they keep 50 + 25 + 100 + 20 = 195 bytes on the GPU. Budget 300:
// B whole (+25: 220), A whole (+50: 270), C would need +100 (370): the moves stop there, and
// D stays split although its +20 would fit.
TEST(HeteGenScheduler, MovesModulesByGainUntilTheBudgetStops) {
  const std::vector<Module> mods = {
      {"A", 100, 5, 0.5, 0}, {"B", 50, 4, 0.5, 0}, {"C", 200, 6, 0.5, 0}, {"D", 40, 1, 0.5, 0}};
  const HeteGenPlan p = schedule_modules(mods, 300);
  ASSERT_EQ(p.modules.size(), 4u);
  EXPECT_EQ(p.modules[0].placement, ModulePlacement::kGpu);  // A
  EXPECT_EQ(p.modules[1].placement, ModulePlacement::kGpu);  // B
  EXPECT_EQ(p.modules[2].placement, ModulePlacement::kSplit);
  EXPECT_EQ(p.modules[3].placement, ModulePlacement::kSplit);
  EXPECT_EQ(p.gpu_bytes, 270);
  EXPECT_EQ(p.modules[0].gpu_bytes, 100);
  EXPECT_EQ(p.modules[2].gpu_bytes, 100);  // 0.5 x 200
  EXPECT_DOUBLE_EQ(p.modules[1].gain, 0.08);
  EXPECT_DOUBLE_EQ(p.alpha_of("A"), 1.0);
  EXPECT_DOUBLE_EQ(p.alpha_of("C"), 0.5);
  EXPECT_DOUBLE_EQ(p.time, 6 + 1);  // the split modules' T-bar_cpu; whole ones take ~0
  EXPECT_NE(p.str().find("B: gpu alpha 1.0000"), std::string::npos) << p.str();
  EXPECT_NE(p.str().find("D: split alpha 0.5000"), std::string::npos) << p.str();

  // Budget 269: B and A need 270, so only B moves.
  const HeteGenPlan q = schedule_modules(mods, 269);
  EXPECT_EQ(q.modules[1].placement, ModulePlacement::kGpu);
  EXPECT_EQ(q.modules[0].placement, ModulePlacement::kSplit);
  EXPECT_EQ(q.gpu_bytes, 220);
  // Room for everything: all whole, 390 bytes.
  const HeteGenPlan all = schedule_modules(mods, 390);
  for (const ModulePlan& m : all.modules) EXPECT_EQ(m.placement, ModulePlacement::kGpu) << m.name;
  EXPECT_EQ(all.gpu_bytes, 390);
}

// The engine's accounting (streamed shares): a split module holds nothing of its own on the
// device, so a move costs the module's bytes. By hand: gains C 30/50 = 0.6, A 50/100 = 0.5,
// D 50/100 = 0.5 (after A: ties keep the given order), B 40/200 = 0.2. Budget 260: C (50),
// A (150), D (250); B would make 450 and stops the moves. With the paper's accounting (each
// split module keeps alpha 0.5 of its bytes: 225 to begin with) only C's 25 more fit.
TEST(HeteGenScheduler, StreamedSharesCostNothingUntilMovedWhole) {
  const std::vector<Module> m{{"A", 100, 50, 0.5, 0},
                              {"B", 200, 40, 0.5, 0},
                              {"C", 50, 30, 0.5, 0},
                              {"D", 100, 50, 0.5, 0}};
  const HeteGenPlan streamed = schedule_modules(m, 260, true);
  std::vector<std::string> whole;
  for (const ModulePlan& p : streamed.modules)
    if (p.placement == ModulePlacement::kGpu) whole.push_back(p.name);
  EXPECT_EQ(whole, (std::vector<std::string>{"A", "C", "D"}));
  EXPECT_EQ(streamed.gpu_bytes, 250);
  EXPECT_EQ(streamed.modules[1].gpu_bytes, 0);  // B split: its share streams
  EXPECT_DOUBLE_EQ(streamed.alpha_of("B"), 0.5);
  EXPECT_DOUBLE_EQ(streamed.alpha_of("D"), 1.0);
  const HeteGenPlan paper = schedule_modules(m, 260, false);
  EXPECT_EQ(paper.gpu_bytes, 250);  // 225 + C's 25
  EXPECT_EQ(paper.modules[2].placement, ModulePlacement::kGpu);
  EXPECT_EQ(paper.modules[0].placement, ModulePlacement::kSplit);
}

TEST(HeteGenScheduler, BadInputIsNamed) {
  const std::vector<Module> mods = {{"A", 100, 5, 0.5, 0}, {"B", 50, 4, 0.5, 0}};
  EXPECT_NE(input_error([&] { schedule_modules(mods, 74); }).find("below the 75 bytes"),
            std::string::npos);
  EXPECT_NE(input_error([] {
              schedule_modules(std::vector<Module>{{"Z", 0, 1, 0.5, 0}}, 10);
            }).find("module Z has 0 bytes"),
            std::string::npos);
  EXPECT_NE(input_error([] {
              schedule_modules(std::vector<Module>{{"Z", 10, 1, 1.5, 0}}, 10);
            }).find("Z alpha"),
            std::string::npos);
  EXPECT_NE(input_error([&] { schedule_modules(mods, 300).alpha_of("E"); }).find("'E'"),
            std::string::npos);
}

TEST(HeteGenOptionsTest, ValidatesAndPrints) {
  HeteGenOptions o;
  EXPECT_EQ(o.str(), "hetegen(off)");
  o.enabled = true;
  o.alpha = 0.7;
  EXPECT_EQ(o.str(), "hetegen(alpha=0.700, cpu_threads=0)");
  EXPECT_NO_THROW(o.validate());
  o.alpha = -0.1;
  EXPECT_NE(input_error([&] { o.validate(); }).find("alpha must be in [0, 1], got -0.1"),
            std::string::npos);
}

}  // namespace
}  // namespace strata::hetegen
