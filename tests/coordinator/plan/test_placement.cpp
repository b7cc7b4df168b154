// The one placement decision, end to end: what the cluster planner places for each stage
// (placement/stage_placement.h, carried in StagePlan) is what the stage's worker allocates,
// byte for byte per tier, for resident, streamed-from-host, on-disk and compressed policies.
// No GPU here: the "device" of the streamed case is the CPU backend driving the offloading
// engine's device path (LayerFeeder, device slots, staged attention), so its arithmetic is
// the GPU's.
#include <gtest/gtest.h>

#include <filesystem>

#include "coordinator/plan/cluster_plan.h"
#include "kernels/cpu_backend.h"
#include "support/stories_reference.h"
#include "worker/dummy.h"
#include "worker/stage.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

std::string disk_dir() {
  const fs::path d = fs::path(STRATA_TEST_TMP) / "placement";
  fs::create_directories(d);
  return d.string();
}

struct Case {
  const char* name;
  const char* policy;  // "" : no policy
  bool device = false;
  int64_t stage_mem = -1;
};

// Plans `spec` over `workers` stages, builds every stage as its worker does, and compares
// the worker's allocation (its stage plus its link buffers, counted here: one in unless
// first, two out unless last, rows x hidden f32 each, host memory over MPI) with the plan.
void expect_plan_equals_allocation(const std::string& spec, const ModelConfig& c, const Case& k,
                                   int32_t workers) {
  SCOPED_TRACE(k.name);
  CpuBackend backend(2);
  PlanOptions po;
  po.model_spec = spec;
  po.workers = workers;
  po.kv_slots = 3;
  po.kv_capacity = 24;
  po.max_batch_rows = 16;
  po.stage_mem = k.stage_mem;
  if (*k.policy != '\0') po.placement.policy = Policy::parse(k.policy);
  po.placement.device_compute = k.device;
  const ClusterPlan plan = make_uniform_plan(c, po);
  for (const StagePlan& st : plan.stages) {
    ASSERT_TRUE(st.placed());
    StageOptions so;
    so.load.disk_dir = disk_dir();
    so.load.device = k.device ? &backend : nullptr;
    so.cache.placement.disk_dir = disk_dir();
    so.cache.host = &backend;
    PipelineStage stage(plan, st, backend, so);
    TierBytes allocated = stage.memory();
    const int64_t links = ((st.has_embedding ? 0 : 1) + (st.has_head ? 0 : 2)) *
                          int64_t{po.max_batch_rows} * c.hidden * 4;
    (k.device ? allocated.gpu : allocated.cpu) += links;
    const TierBytes planned{static_cast<int64_t>(st.placed_gpu_bytes),
                            static_cast<int64_t>(st.placed_cpu_bytes),
                            static_cast<int64_t>(st.placed_disk_bytes)};
    EXPECT_EQ(planned, allocated) << st.str() << "\n planned " << planned.str() << "\n allocated "
                                  << allocated.str();
    EXPECT_NO_THROW(check_allocation(st, allocated));
  }
}

const Case kCases[] = {
    {"resident", "", false, -1},
    {"resident-block", "gbs=1,ngb=3,h=0/100/0", false, -1},
    {"streamed-from-host", "w=40/60/0,c=50/50/0,cpu_attn=1", true, -1},
    {"streamed-staged-cache", "w=0/100/0,c=0/100/0", true, -1},
    {"on-disk", "w=0/40/60,c=40/20/40,h=0/100/0", false, -1},
    {"on-disk-device", "w=20/40/40,c=0/50/50", true, -1},
    {"compressed", "cw=1,cc=1,h=0/100/0", false, -1},
    {"compressed-device", "w=50/50/0,cw=1,cc=1,c=50/50/0", true, -1},
};

TEST(Placement, PlanEqualsWhatStoriesStagesAllocate) {
  const std::string dir = testing::stories_dir();
  const ModelConfig c = load_model_config(dir);
  for (const Case& k : kCases) {
    Case h = k;
    std::string policy = k.policy;
    if (k.device) {  // the device computes: activations on it
      policy += policy.empty() ? "h=100/0/0" : ",h=100/0/0";
      h.policy = policy.c_str();
    }
    expect_plan_equals_allocation(dir, c, h, 2);
  }
}

TEST(Placement, PlanEqualsWhatDummyOptStagesAllocate) {
  // OPT: LayerNorm biases, learned positions, linear biases; f16 matrices.
  const std::string spec = "dummy:opt-125m";
  const ModelConfig c = dummy_model_config("opt-125m", DType::kF32);
  expect_plan_equals_allocation(spec, c, {"opt-resident", "", false, -1}, 3);
  expect_plan_equals_allocation(spec, c, {"opt-disk", "w=0/50/50,c=50/0/50,h=0/100/0", false, -1},
                                4);
}

TEST(Placement, StreamingPlanFromABudgetEqualsAllocation) {
  const std::string dir = testing::stories_dir();
  const ModelConfig c = load_model_config(dir);
  // A budget below the weights: the planner puts layers on disk, the worker follows.
  expect_plan_equals_allocation(dir, c, {"budget-streams", "", false, 900 << 10}, 1);
}

// Unequal nodes in one plan: a device stage (the CPU standing in), a host stage, and a host
// stage of 640 kB, below the 669824 bytes its three layers and head need with every weight
// streamed, so its KV cache goes to disk too; each is what its worker allocates.
TEST(Placement, APlanOverUnequalNodesEqualsWhatEachStageAllocates) {
  const std::string dir = testing::stories_dir();
  const ModelConfig c = load_model_config(dir);
  CpuBackend backend(2);
  PlanOptions po;
  po.model_spec = dir;
  po.workers = 3;
  po.kv_slots = 3;
  po.kv_capacity = 24;
  po.max_batch_rows = 16;
  for (int32_t r = 1; r <= 3; ++r) {
    StageNode n;
    n.rank = r;
    n.name = fmt::format("rank {}", r);
    n.device_compute = r == 1;
    n.budgets = TierBudgets{-1, r == 3 ? 640'000 : -1, -1, true};
    n.compute_read_gbs = 10;
    n.disk_read_gbs = 1;
    po.nodes.push_back(n);
  }
  const ClusterPlan plan = make_plan(c, po, {1, 1, 3});
  for (const StagePlan& st : plan.stages) {
    StageOptions so;
    so.load.disk_dir = disk_dir();
    so.load.device = st.use_gpu ? &backend : nullptr;
    so.cache.placement.disk_dir = disk_dir();
    so.cache.host = &backend;
    PipelineStage stage(plan, st, backend, so);
    TierBytes allocated = stage.memory();
    allocated += link_buffer_bytes(st, plan);  // over MPI: host memory
    EXPECT_EQ(link_buffer_bytes(st, plan).gpu, 0);
    EXPECT_NO_THROW(check_allocation(st, allocated)) << st.str();
    EXPECT_LE(allocated.cpu, po.nodes[static_cast<size_t>(st.rank - 1)].budgets.cpu < 0
                                 ? allocated.cpu
                                 : po.nodes[static_cast<size_t>(st.rank - 1)].budgets.cpu);
  }
  EXPECT_TRUE(plan.stages[0].use_gpu);
  EXPECT_FALSE(plan.stages[2].use_gpu);
  EXPECT_GT(plan.stages[2].placed_disk_bytes, 0u);  // its budget streams
}

TEST(Placement, AMismatchNamesTheTierAndBothNumbers) {
  StagePlan st;
  st.rank = 2;
  st.layer_begin = 3;
  st.layer_end = 5;
  st.weight_tiers = {1, 1};
  st.cache_tiers = {0, 0};
  st.placed_cpu_bytes = 1000;
  try {
    check_allocation(st, TierBytes{0, 1001, 0});
    FAIL() << "a mismatch passed";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("layers [3, 5)"), std::string::npos) << m;
    EXPECT_NE(m.find("cpu: the plan placed 1000 bytes, the worker allocated 1001 bytes"),
              std::string::npos)
        << m;
  }
  EXPECT_NO_THROW(check_allocation(st, TierBytes{0, 1000, 0}));
}

}  // namespace
}  // namespace strata
