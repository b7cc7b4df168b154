// Layer allocation beyond ExeGPT (coordinator/exegpt/allocator.h): contiguous ranges that balance
// stage times worked out by hand -- a head that costs six layers, a slower worker, a stage
// whose memory holds fewer layers -- and, through the simulator, OPT-125m on two modelled
// workers, whose last stage carries a head about as costly as its layers.
#include <gtest/gtest.h>

#include <algorithm>

#include "coordinator/exegpt/allocator.h"
#include "coordinator/exegpt/layer_profile.h"
#include "coordinator/exegpt/simulator.h"
#include "kernels/error.h"
#include "worker/dummy.h"

namespace strata {
namespace {

double bottleneck(const std::vector<int32_t>& counts, const std::vector<StageCost>& c) {
  const std::vector<double> t = stage_times(counts, c);
  return *std::max_element(t.begin(), t.end());
}

TEST(Allocator, TheHeadsStageTakesFewerLayers) {
  // 12 layers of 1 s, a head of 6 s on the last stage: 9 and 3 (9 s each).
  const std::vector<StageCost> c{{1, 0}, {1, 6}};
  EXPECT_EQ(balance_layers(12, c), (std::vector<int32_t>{9, 3}));
}

TEST(Allocator, ThreeStagesByHand) {
  // Embedding 1 s on the first, head 4 s on the last, 12 layers of 1 s: a bottleneck of
  // 5 s cannot hold them (4 + 5 + 1 = 10 layers), 6 s can (5 + 6 + 2 = 13 >= 12).
  const std::vector<StageCost> c{{1, 1}, {1, 0}, {1, 4}};
  const std::vector<int32_t> n = balance_layers(12, c);
  EXPECT_EQ(n[0] + n[1] + n[2], 12);
  EXPECT_DOUBLE_EQ(bottleneck(n, c), 6);
}

TEST(Allocator, ASlowerWorkerGetsFewerLayers) {
  // Rank 1 takes 2 s a layer, rank 2 1 s: 4 and 8 (8 s each).
  const std::vector<StageCost> c{{2, 0}, {1, 0}};
  EXPECT_EQ(balance_layers(12, c), (std::vector<int32_t>{4, 8}));
  // Rank 2's memory holds 6 layers: rank 1 must take the other 6 (12 s).
  const std::vector<StageCost> tight{{2, 0}, {1, 0, 6}};
  EXPECT_EQ(balance_layers(12, tight), (std::vector<int32_t>{6, 6}));
}

TEST(Allocator, RefusesWhatTheStagesCannotHold) {
  const std::vector<StageCost> c{{1, 0, 5}, {1, 0, 5}};
  try {
    balance_layers(12, c);
    FAIL() << "12 layers in stages holding 10";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("hold 10 layers"), std::string::npos) << e.what();
  }
  EXPECT_THROW(balance_layers(1, std::vector<StageCost>{{1, 0}, {1, 0}}), InputError);
}

TEST(Allocator, BalancesOpt125mWhoseLastStageCarriesTheHead) {
  // OPT-125m's head (50272 x 768) is about five of its layers' weights: on two modelled
  // workers the balanced split gives the last stage fewer layers, and the two stages' busy
  // times come closer than the uniform 6 + 6 split's.
  const ModelConfig c = dummy_model_config("opt-125m", DType::kF16);
  SimulatorInputs in;
  in.shape = c.shape();
  in.profile = modelled_profile(in.shape, "dummy:opt-125m", NodeModel::preset("a40"), 2,
                                ProfileGrid::for_limits(512, 64, 2048));
  in.workload = TaskWorkload::preset("C1");
  in.device_compute = true;
  const Simulator sim(in);
  const ScheduleVars v{SchedulePolicy::kRra, 2, 8, 2, 1};  // small decode batches: the head weighs
  const Prediction balanced = sim.predict(v);
  ASSERT_TRUE(balanced.feasible) << balanced.infeasible_reason;
  ASSERT_EQ(balanced.allocation.layers.size(), 2u);
  EXPECT_GT(balanced.allocation.layers[0], balanced.allocation.layers[1]);
  const Prediction uniform = sim.predict(v, Allocation{{6, 6}, 0});
  auto imbalance = [](const Prediction& p) {
    const double a = p.stages[0].busy_seconds_per_cycle, b = p.stages[1].busy_seconds_per_cycle;
    return std::max(a, b) / std::min(a, b);
  };
  EXPECT_LT(imbalance(balanced), imbalance(uniform));
  EXPECT_LT(imbalance(balanced), 1.25);
  EXPECT_GE(balanced.throughput_tok_s, uniform.throughput_tok_s);
}

}  // namespace
}  // namespace strata
