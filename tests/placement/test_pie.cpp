// Pie's swapping (papers/pie.md §3.3) against the paper's worked example (Figure 4), its FIFO
// argument, and the adaptive expansion of §3.4.2 closing the loop over the simulator.
//
// The paper numbers layers 1..9; the code numbers them 0..8, so the paper's layer p is our
// layer p - 1 (its "layer 8 and 9 on the CPU" are our layers 7 and 8). Times are in units of
// one layer's compute time: layer k of token t computes in [9t + k, 9t + k + 1) when nothing
// stalls, so the paper's "during layer p's computation" is our time p - 1.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "kernels/error.h"
#include "placement/pie.h"
#include "support/input_error.h"

namespace strata {
namespace {

using S = PieLayerState;

using testing::input_error;

// The largest m with no stall, from the paper's FIFO argument generalised: a swapped-out
// layer passes through a FIFO of m + 2 places (m on the host, one swapping out, one swapping
// in: "four layers long" for m = 2), advancing one place per swap. Swaps start only when a
// layer begins, so one swap takes ceil(t_swap / t_compute) compute times (2 in Figure 4). A
// layer swapped out as the next one begins is needed again n - 1 compute times later, so
// (m + 2) * ceil(t_swap / t_compute) <= n - 1. (Figure 4: 4 x 2 = 8 = 9 - 1, no stall.)
int32_t fifo_limit(int32_t n, double compute, double swap) {
  const auto cadence = static_cast<int32_t>(std::ceil(swap / compute - 1e-9));
  return std::clamp((n - 1) / cadence - 2, 0, n - 1);
}

double steady_stall(const PieSimResult& r, size_t warm_up) {
  double s = 0;
  for (size_t t = warm_up; t < r.tokens.size(); ++t) s += r.tokens[t].stall;
  return s;
}

// What state each layer is in at time t (taken strictly inside a span).
std::map<S, int> census(const PieSimResult& r, double t) {
  std::map<S, int> c;
  for (const auto& spans : r.timeline)
    for (const PieResidencySpan& s : spans)
      if (s.start <= t && t < s.end) ++c[s.state];
  return c;
}

TEST(PieMappingTable, LastLayersStartOnTheHostAndExpansionIsNOverNMinusM) {
  PieMappingTable t(9, 2);
  for (int32_t i = 0; i < 7; ++i) EXPECT_EQ(t.state(i), S::kOnGpu) << i;
  EXPECT_EQ(t.state(7), S::kOnHost);  // the paper's layers 8 and 9
  EXPECT_EQ(t.state(8), S::kOnHost);
  EXPECT_NEAR(t.expansion(), 1.28, 0.01);  // §3.3: "an expansion factor of 1.28"
  EXPECT_EQ(t.gpu_capacity(), 7);
  EXPECT_FALSE(t.has_free_gpu_space());
  EXPECT_NE(t.str().find("m=2 of 9"), std::string::npos) << t.str();
}

// Two-phase updates (§3.2): a started swap-out keeps the layer's GPU space; only its
// completion moves the layer to the host and frees the space for a swap-in.
TEST(PieMappingTable, OnlyCompletionMovesALayer) {
  PieMappingTable t(9, 2);
  t.start_swap_out(0);
  EXPECT_EQ(t.state(0), S::kSwappingOut);
  EXPECT_FALSE(t.on_gpu(0));
  EXPECT_FALSE(t.has_free_gpu_space());
  EXPECT_THROW(t.start_swap_in(7), Error);  // no space until the swap-out completes
  t.complete_swap_out(0);
  EXPECT_EQ(t.state(0), S::kOnHost);
  EXPECT_TRUE(t.has_free_gpu_space());
  t.start_swap_in(7);
  EXPECT_EQ(t.state(7), S::kSwappingIn);
  EXPECT_FALSE(t.on_gpu(7));                // compute must still wait
  EXPECT_THROW(t.start_swap_in(8), Error);  // one swap-in at a time
  t.complete_swap_in(7);
  EXPECT_TRUE(t.on_gpu(7));
  EXPECT_THROW(t.complete_swap_in(7), Error);
}

TEST(PieMappingTable, RefusesMOfNOrMore) {
  EXPECT_NE(input_error([] { PieMappingTable(9, 9); }).find("9 host layers of 9"),
            std::string::npos);
  EXPECT_NE(input_error([] { PieMappingTable(9, -1); }).find("-1 host layers"), std::string::npos);
  EXPECT_NE(input_error([] { PieMappingTable(0, 0); }).find("0 layers"), std::string::npos);
  PieMappingTable t(4, 0);
  EXPECT_NE(input_error([&] { t.set_host_layers(4); }).find("4 host layers of 4"),
            std::string::npos);
}

// §3.3's narrative, one decision at a time, with the table stepped by hand.
TEST(PieSwapPolicy, Figure4FirstFourLayers) {
  PieMappingTable t(9, 2);
  // Paper layer 1: no room for a swap-in; the coldest GPU layer is our 6 (needed 6 layers
  // on), and both host layers (7, 8: needed 7 and 8 layers on) are colder: no swap-out.
  EXPECT_EQ(PieSwapPolicy::coldest_gpu_layer(t, 0), 6);
  EXPECT_EQ(PieSwapPolicy::hottest_host_layer(t, 0), 7);
  PieSwapDecision d = PieSwapPolicy::decide(t, 0);
  EXPECT_EQ(d.swap_in, -1);
  EXPECT_EQ(d.swap_out, -1);
  // Paper layer 2: layer 1 (ours 0) finished last and is the coldest: swapped out. No room
  // for a swap-in.
  d = PieSwapPolicy::decide(t, 1);
  EXPECT_EQ(d.swap_out, 0) << d.str();
  EXPECT_EQ(d.swap_in, -1) << d.str();
  t.start_swap_out(0);
  // Paper layer 3: layer 1's swap-out still under way: both skipped.
  d = PieSwapPolicy::decide(t, 2);
  EXPECT_EQ(d.swap_out, -1) << d.str();
  EXPECT_EQ(d.swap_in, -1) << d.str();
  // Paper layer 4: layer 1 is on the CPU; layer 3 (ours 2) is the coldest and goes out;
  // layer 8 (ours 7), the hottest on the CPU, comes into layer 1's space.
  t.complete_swap_out(0);
  d = PieSwapPolicy::decide(t, 3);
  EXPECT_EQ(d.swap_out, 2) << d.str();
  EXPECT_EQ(d.swap_in, 7) << d.str();
  EXPECT_FALSE(d.early);
}

TEST(PieSwapPolicy, HottestIsTheLayerAboutToComputeAndEarlyMeansTheNextToken) {
  PieMappingTable t(5, 2);  // 3, 4 on the host
  t.start_swap_out(1);
  t.complete_swap_out(1);
  // From layer 4: 4 itself is needed now (a stall's fetch, not early).
  PieSwapDecision d = PieSwapPolicy::decide(t, 4);
  EXPECT_EQ(d.swap_in, 4);
  EXPECT_FALSE(d.early);
  // m = 1 of 5 with 0 and 1 on the host and room for one: from layer 2 every layer this
  // token still needs is on the GPU, so the swap-in is the next token's layer 0.
  PieMappingTable u(5, 1);  // 4 on the host
  u.start_swap_out(0);
  u.complete_swap_out(0);
  u.start_swap_in(4);
  u.complete_swap_in(4);
  u.start_swap_out(1);
  u.complete_swap_out(1);
  d = PieSwapPolicy::decide(u, 2);
  EXPECT_EQ(d.swap_in, 0);
  EXPECT_TRUE(d.early);
  // The host layer still waiting (1, needed 4 on) is colder than the coldest GPU layer (4,
  // needed 2 on): no swap-out.
  EXPECT_EQ(d.swap_out, -1);
}

// The simulated clock, against the events the paper's text implies for Figure 4. By hand
// (times in compute units, swaps take 2, ours 0-based):
//   t=1 (paper layer 2): out 0 [1,3)
//   t=3 (layer 4):       in 7 [3,5) into 0's space, out 2 [3,5)
//   t=5 (layer 6):       in 8 [5,7) (hottest host layer: 8 is needed 3 on, 0 is 4 on),
//                        out 4 [5,7)
//   t=7 (layer 8):       in 0 [7,9) (needed first by the next token), out 6 [7,9)
//   t=9 (token 2, layer 1): in 2 [9,11), out 8 [9,11)
//   t=11: in 4, out 1;  t=13: in 6, out 3;  t=15: in 8, out 5;  t=17: in 1, out 7 ...
// Each swapped-in layer arrives exactly as its layer begins (in 7 ends at 5, layer 7 begins
// at 7; in 0 ends at 9 = token 2's layer 0): no stall.
TEST(SimulatePie, Figure4Events) {
  const PieSimResult r = simulate_pie(9, 2, 1.0, 2.0, 4);
  struct E {
    int32_t layer;
    PieSwapKind kind;
    double start;
  };
  const PieSwapKind in = PieSwapKind::kIn, out = PieSwapKind::kOut;
  const std::vector<E> want = {{0, out, 1},  {7, in, 3},  {2, out, 3},  {8, in, 5},  {4, out, 5},
                               {0, in, 7},   {6, out, 7}, {2, in, 9},   {8, out, 9}, {4, in, 11},
                               {1, out, 11}, {6, in, 13}, {3, out, 13}, {8, in, 15}, {5, out, 15},
                               {1, in, 17},  {7, out, 17}};
  ASSERT_GE(r.events.size(), want.size()) << r.str();
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(r.events[i].layer, want[i].layer) << r.events[i].str();
    EXPECT_EQ(r.events[i].kind, want[i].kind) << r.events[i].str();
    EXPECT_DOUBLE_EQ(r.events[i].start, want[i].start) << r.events[i].str();
    EXPECT_DOUBLE_EQ(r.events[i].end, want[i].start + 2) << r.events[i].str();
  }
  EXPECT_TRUE(r.events[5].early);  // in 0 during token 1 is for token 2
  EXPECT_EQ(r.stall, 0) << r.str();
  EXPECT_DOUBLE_EQ(r.end, 4 * 9.0);
  // Never a swap during paper layers 1 and 3 (times 0 and 2).
  for (const PieSwapEvent& e : r.events) EXPECT_TRUE(e.start != 0 && e.start != 2) << e.str();
}

// "Each layer spends the equivalent of eight layer computation times" in the FIFO: from the
// start of its swap-out to the end of its swap-in, 2 out + 4 waiting + 2 in.
TEST(SimulatePie, Figure4EachLayerSpendsEightComputeTimesInTheFifo) {
  const PieSimResult r = simulate_pie(9, 2, 1.0, 2.0, 6);
  int pairs = 0;
  for (size_t i = 0; i < r.events.size(); ++i) {
    if (r.events[i].kind != PieSwapKind::kOut) continue;
    for (size_t j = i + 1; j < r.events.size(); ++j) {
      if (r.events[j].layer != r.events[i].layer) continue;
      ASSERT_EQ(r.events[j].kind, PieSwapKind::kIn);
      EXPECT_DOUBLE_EQ(r.events[j].end - r.events[i].start, 8.0) << r.events[i].str();
      ++pairs;
      break;
    }
  }
  EXPECT_GE(pairs, 20);
}

// "The FIFO queue is four layers long: two layers are physically on the CPU and two are in
// swapping"; the GPU holds n - m = 7 layers' space, two of them the swap buffers.
TEST(SimulatePie, Figure4ResidencyAfterWarmUp) {
  const PieSimResult r = simulate_pie(9, 2, 1.0, 2.0, 5);
  for (double t = 9.5; t < 45; t += 1.0) {
    SCOPED_TRACE(t);
    auto c = census(r, t);
    EXPECT_EQ(c[S::kOnHost], 2);
    EXPECT_EQ(c[S::kSwappingIn], 1);
    EXPECT_EQ(c[S::kSwappingOut], 1);
    EXPECT_EQ(c[S::kOnGpu], 5);
  }
  // Spans tile each layer's time line.
  for (const auto& spans : r.timeline) {
    EXPECT_EQ(spans.front().start, 0);
    EXPECT_EQ(spans.back().end, r.end);
    for (size_t i = 1; i < spans.size(); ++i) EXPECT_EQ(spans[i].start, spans[i - 1].end);
  }
}

// One GPU layer (m = n - 1): every layer waits for the last one's swap-out (2) and then its
// own swap-in (2) before it computes: 4 stalled per layer. Token 0 starts with layer 0 on the
// GPU, so it stalls 8 x 4 = 32; later tokens 9 x 4 = 36.
TEST(SimulatePie, SwapsBeyondWhatComputeHidesStall) {
  const PieSimResult r = simulate_pie(9, 8, 1.0, 2.0, 3);
  ASSERT_EQ(r.tokens.size(), 3u);
  EXPECT_DOUBLE_EQ(r.tokens[0].stall, 32);
  EXPECT_DOUBLE_EQ(r.tokens[1].stall, 36);
  EXPECT_DOUBLE_EQ(r.tokens[2].stall, 36);
  EXPECT_DOUBLE_EQ(r.end, 27 + 32 + 36 + 36);
  // Figure 4 with swaps 1.5 x slower: the FIFO of four takes 4 x 3 = 12 > 8 compute times.
  const PieSimResult slow = simulate_pie(9, 2, 1.0, 3.0, 6);
  for (size_t t = 2; t < slow.tokens.size(); ++t)
    EXPECT_GT(slow.tokens[t].stall, 0) << slow.tokens[t].str();
  EXPECT_EQ(steady_stall(simulate_pie(9, 2, 1.0, 2.0, 6), 0), 0);
}

TEST(SimulatePie, LargestStallFreeMIsTheFifoLimit) {
  for (int32_t n : {5, 9, 12, 32})
    for (double swap : {0.5, 1.0, 1.5, 2.0, 3.0}) {
      SCOPED_TRACE(::testing::Message() << "n=" << n << " t_swap=" << swap);
      const int32_t limit = fifo_limit(n, 1.0, swap);
      for (int32_t m = 1; m < n; ++m) {
        const double stall = steady_stall(simulate_pie(n, m, 1.0, swap, 12), 4);
        if (m <= limit) {
          EXPECT_EQ(stall, 0) << "m=" << m;
        } else {
          EXPECT_GT(stall, 0) << "m=" << m;
        }
      }
    }
}

// A raised m takes layers off the GPU by swap-outs alone; a lowered one brings them back by
// swap-ins alone (no swap-out while the GPU has room).
TEST(PieSimulator, ChangingMMovesLayersThroughTheTable) {
  PieSimulator sim({9, 0, 1.0, 1.0});
  sim.run_token();
  EXPECT_EQ(sim.result().events.size(), 0u);  // m = 0: nothing to swap
  sim.set_host_layers(3);
  for (int t = 0; t < 3; ++t) sim.run_token();
  auto host = [&] {
    int h = 0;
    for (int32_t i = 0; i < 9; ++i) h += sim.table().state(i) == S::kOnGpu ? 0 : 1;
    return h;
  };
  EXPECT_EQ(sim.table().gpu_resident(), 6);
  EXPECT_GE(host(), 3);
  sim.set_host_layers(0);
  for (int t = 0; t < 3; ++t) sim.run_token();
  EXPECT_EQ(host(), 0) << sim.table().str();
  const size_t swaps = sim.result().events.size();
  sim.run_token();
  EXPECT_EQ(sim.result().events.size(), swaps) << "m = 0 still swapping";
}

TEST(SimulatePie, RefusesBadInputNamingTheValue) {
  EXPECT_NE(input_error([] { simulate_pie(9, 9, 1, 2, 1); }).find("9 host layers of 9"),
            std::string::npos);
  EXPECT_NE(input_error([] { simulate_pie(9, 2, 0, 2, 1); }).find("compute time per layer 0"),
            std::string::npos);
  EXPECT_NE(input_error([] { simulate_pie(9, 2, 1, -2, 1); }).find("swap time per layer -2"),
            std::string::npos);
  EXPECT_NE(input_error([] { simulate_pie(9, 2, 1, 2, 0); }).find("0 tokens"), std::string::npos);
  PieSimulator sim({9, 2, 1, 2});
  EXPECT_NE(input_error([&] { sim.set_swap_time(NAN); }).find("swap time per layer nan"),
            std::string::npos);
}

TEST(Pie, StructsPrintThemselves) {
  EXPECT_EQ((PieSimConfig{9, 2, 1, 2}).str(), "PieSim(n=9, m=2, t_compute=1, t_swap=2)");
  const PieSwapEvent e{7, PieSwapKind::kIn, 3, 5, 0, false};
  EXPECT_EQ(e.str(), "in L7 [3, 5)");
  PieSwapDecision d;
  d.swap_out = 2;
  EXPECT_EQ(d.str(), "no swap-in, out L2");
  PieControllerOptions o;
  o.n_layers = 9;
  EXPECT_NE(o.str().find("m in [0, 8]"), std::string::npos) << o.str();
  EXPECT_NE(PieTokenObservation{}.str().find("stall 0"), std::string::npos);
  EXPECT_NE(simulate_pie(9, 2, 1, 2, 1).str().find("out L0 [1, 3)"), std::string::npos);
}

// --- adaptive expansion (§3.4.2) ---

PieControllerOptions controller_options(int32_t n) {
  PieControllerOptions o;
  o.n_layers = n;
  return o;
}

// The controller driving the simulator token by token; `swap_at(token)` is the swap time
// (background traffic on the bus), `throughput_cap` the expansion beyond which the workload
// has no more requests to batch (0: always more).
struct Loop {
  std::vector<int32_t> m;  // m during each token
  PieExpansionController controller;
};

template <class SwapAt>
Loop run_loop(int32_t n, int32_t tokens, SwapAt swap_at, double throughput_cap = 0) {
  PieSimulator sim({n, 0, 1.0, swap_at(0)});
  Loop l{{}, PieExpansionController(controller_options(n), 0)};
  for (int32_t t = 0; t < tokens; ++t) {
    sim.set_swap_time(swap_at(t));
    const PieTokenStats s = sim.run_token();
    l.m.push_back(s.host_layers);
    PieTokenObservation o{s.stall, s.seconds(), s.swap_ins, s.early_swap_ins, 0};
    // Pie's premise (§3.1): a larger effective memory batches more requests per token.
    if (throughput_cap > 0)
      o.throughput = std::min(sim.table().expansion(), throughput_cap) / s.seconds();
    sim.set_host_layers(l.controller.observe(o));
  }
  return l;
}

// The m held most often over tokens [from, to), and the range visited there.
struct Tail {
  int32_t mode, lo, hi;
};
Tail tail(const std::vector<int32_t>& m, size_t from, size_t to) {
  std::map<int32_t, int> count;
  for (size_t t = from; t < to; ++t) ++count[m[t]];
  Tail r{-1, count.begin()->first, count.rbegin()->first};
  int best = 0;
  for (auto [v, c] : count)
    if (c > best) best = c, r.mode = v;
  return r;
}

TEST(PieExpansionController, SettlesAtTheLargestStallFreeM) {
  for (auto [n, swap] : {std::pair{9, 1.0}, {9, 2.0}, {12, 0.5}, {12, 1.5}, {32, 2.0}}) {
    SCOPED_TRACE(::testing::Message() << "n=" << n << " t_swap=" << swap);
    const int32_t best = fifo_limit(n, 1.0, swap);  // 6, 2, 9, 3, 13
    const Loop l = run_loop(n, 400, [&](int32_t) { return swap; });
    const Tail t = tail(l.m, 200, 400);
    EXPECT_EQ(t.mode, best);
    EXPECT_GE(t.lo, best - 1);
    EXPECT_LE(t.hi, best + 1);  // the periodic probe of one more
    // It got there quickly: one raise per two tokens while nothing waits.
    const auto first = std::find(l.m.begin(), l.m.end(), best) - l.m.begin();
    EXPECT_LE(first, 2 * best + 2);
  }
}

TEST(PieExpansionController, FollowsBackgroundTrafficDownAndBackUp) {
  // Swaps twice as slow over tokens [300, 600): the limit drops from 6 to 2.
  const Loop l = run_loop(9, 900, [](int32_t t) { return t >= 300 && t < 600 ? 2.0 : 1.0; });
  EXPECT_EQ(tail(l.m, 150, 300).mode, 6);
  const Tail busy = tail(l.m, 450, 600);
  EXPECT_EQ(busy.mode, 2);
  EXPECT_GE(busy.lo, 1);
  EXPECT_EQ(tail(l.m, 750, 900).mode, 6);
  EXPECT_GE(l.controller.lowerings(), 4);
}

TEST(PieExpansionController, StopsRaisingWhenThroughputStopsScaling) {
  // The workload fills an expansion of 1.5 (m = 3 of 9) and no more, while the bus could
  // hide m = 6: beyond 3 the expansion buys nothing and costs swapping.
  const Loop l = run_loop(
      9, 400, [](int32_t) { return 1.0; }, 1.5);
  const Tail t = tail(l.m, 100, 400);
  EXPECT_EQ(t.mode, 3);
  EXPECT_EQ(t.hi, 4);  // it still probes now and then
  EXPECT_GE(t.lo, 3);
}

TEST(PieExpansionController, ToleratesOneWaitingTokenAndLowersOnTheSecond) {
  PieExpansionController c(controller_options(9), 4);
  const PieTokenObservation quiet{0, 9, 4, 0, 0};
  const PieTokenObservation waited{1, 10, 4, 0, 0};
  EXPECT_EQ(c.observe(waited), 4);
  EXPECT_EQ(c.observe(quiet), 4);
  EXPECT_EQ(c.observe(waited), 4);
  EXPECT_EQ(c.observe(waited), 3);
  EXPECT_EQ(c.lowerings(), 1);
  // Held there: quiet tokens (even with violations) do not raise it for probe_interval.
  const PieTokenObservation violated{0, 9, 4, 1, 0};
  EXPECT_EQ(c.observe(quiet), 3);  // settling
  for (int i = 0; i < 32; ++i) EXPECT_EQ(c.observe(violated), 3) << i;
  EXPECT_EQ(c.observe(violated), 4);
}

TEST(PieExpansionController, RaisesOnViolationsAndProbesWithout) {
  PieExpansionController c(controller_options(9), 2);
  EXPECT_EQ(c.observe({0, 9, 4, 1, 0}), 3);  // a next-token layer came in early
  EXPECT_EQ(c.observe({0, 9, 4, 1, 0}), 3);  // settling after the change
  for (int i = 0; i < 31; ++i) EXPECT_EQ(c.observe({0, 9, 4, 0, 0}), 3) << i;
  EXPECT_EQ(c.observe({0, 9, 4, 0, 0}), 4);  // the periodic probe
  EXPECT_EQ(c.raises(), 2);
  EXPECT_EQ(c.adjustments(), 2);
}

TEST(PieExpansionController, StaysWithinItsBounds) {
  PieControllerOptions o = controller_options(4);
  o.min_host_layers = 1;
  o.max_host_layers = 2;
  PieExpansionController c(o, 1);
  for (int i = 0; i < 10; ++i) c.observe({0, 4, 0, 0, 0});
  EXPECT_EQ(c.host_layers(), 2);
  for (int i = 0; i < 10; ++i) c.observe({4, 8, 2, 0, 0});
  EXPECT_EQ(c.host_layers(), 1);
  EXPECT_DOUBLE_EQ(c.expansion(), 4.0 / 3.0);
}

TEST(PieExpansionController, RefusesBadOptionsNamingTheValue) {
  PieControllerOptions o = controller_options(9);
  o.max_host_layers = 9;
  EXPECT_NE(input_error([&] { o.validate(); }).find("max host layers 9"), std::string::npos);
  o = controller_options(9);
  o.stall_tolerance = -0.5;
  EXPECT_NE(input_error([&] { o.validate(); }).find("stall tolerance -0.5"), std::string::npos);
  o = controller_options(1);
  EXPECT_NE(input_error([&] { o.validate(); }).find("1 layers"), std::string::npos);
  EXPECT_NE(input_error([] {
              PieExpansionController(controller_options(9), 9);
            }).find("initial host layers 9"),
            std::string::npos);
}

}  // namespace
}  // namespace strata
