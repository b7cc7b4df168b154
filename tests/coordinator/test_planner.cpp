// The uniform plan: layers split evenly over ranks 1..N-1 in order; refused, with a message
// that says what to change, when there are more stages than layers or a stage is over its
// memory budget.
#include <gtest/gtest.h>

#include "coordinator/planner.h"
#include "worker/dummy.h"

namespace strata {
namespace {

PlanOptions options(int32_t workers) {
  PlanOptions o;
  o.model_spec = "dummy:opt-125m";
  o.workers = workers;
  o.kv_slots = 8;
  o.kv_capacity = 128;
  o.max_batch_rows = 64;
  return o;
}

TEST(Planner, SplitsLayersEvenlyInRankOrder) {
  const ModelConfig c = dummy_model_config("opt-125m");  // 12 layers
  const ClusterPlan p = make_uniform_plan(c, options(5));
  ASSERT_EQ(p.stages.size(), 5u);
  const int32_t want[][2] = {{0, 3}, {3, 6}, {6, 8}, {8, 10}, {10, 12}};
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(p.stages[i].rank, static_cast<int32_t>(i) + 1);
    EXPECT_EQ(p.stages[i].layer_begin, want[i][0]);
    EXPECT_EQ(p.stages[i].layer_end, want[i][1]);
    EXPECT_EQ(p.stages[i].has_embedding, i == 0);
    EXPECT_EQ(p.stages[i].has_head, i == 4);
  }
  EXPECT_EQ(p.hidden_size, 768);
  EXPECT_EQ(p.kv_slots, 8);
}

TEST(Planner, RefusesMoreStagesThanLayers) {
  const ModelConfig c = dummy_model_config("opt-125m");
  try {
    make_uniform_plan(c, options(13));
    FAIL() << "13 stages for 12 layers accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("only 12 layers"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("mpirun -np 13"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(make_uniform_plan(c, options(12)));
  EXPECT_THROW(make_uniform_plan(c, options(0)), InputError);
}

TEST(Planner, RefusesAStageOverItsBudget) {
  const ModelConfig c = dummy_model_config("opt-125m");
  PlanOptions o = options(2);
  const ClusterPlan fits = make_uniform_plan(c, o);
  const StageMemory first = stage_memory(c, fits.stages[0], fits);
  // 6 layers of 7.1M f32 params + 38.6M embedding + positions: about 330 MiB.
  EXPECT_GT(first.weights, 300ll << 20);
  EXPECT_LT(first.weights, 360ll << 20);
  EXPECT_EQ(first.kv_cache, 2ll * 6 * 8 * 128 * 768 * 4);
  o.stage_mem = first.total() - 1;
  try {
    make_uniform_plan(c, o);
    FAIL() << "over-budget plan accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("--stage-mem"), std::string::npos) << e.what();
  }
  o.workers = 4;  // more ranks: smaller stages fit
  EXPECT_NO_THROW(make_uniform_plan(c, o));
}

}  // namespace
}  // namespace strata
