// The uniform plan: layers split evenly over ranks 1..N-1 in order, each stage placed by
// placement/ with the engine's memory model; refused, naming the stage, the tier and the
// shortfall, only when the engine could not run it.
#include <gtest/gtest.h>

#include <algorithm>

#include "coordinator/plan/cluster_plan.h"
#include "support/stories_reference.h"
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

// Partial tensor parallelism: a stage of degree d takes d consecutive ranks, led by the
// first; the rest follow on.
TEST(Planner, TensorParallelStagesTakeConsecutiveRanks) {
  const ModelConfig c = dummy_model_config("opt-125m");  // 12 layers, 12 heads, 3072 columns
  PlanOptions o = options(5);
  o.tp_degrees = {1, 3, 1};
  const ClusterPlan p = make_uniform_plan(c, o);
  ASSERT_EQ(p.stages.size(), 3u);
  EXPECT_EQ(p.stages[0].rank, 1);
  EXPECT_TRUE(p.stages[0].tp_ranks.empty());
  EXPECT_EQ(p.stages[1].rank, 2);
  EXPECT_EQ(p.stages[1].tp_ranks, (std::vector<int32_t>{2, 3, 4}));
  EXPECT_EQ(p.stages[2].rank, 5);
  EXPECT_EQ(p.stages[1].layer_begin, 4);
  EXPECT_EQ(p.stages[1].layer_end, 8);
  // The split stage holds a third of each layer's matrices: its placement is well under the
  // whole layers' (the norms and the o / down biases stay whole).
  const ClusterPlan whole = make_uniform_plan(c, options(3));
  EXPECT_LT(p.stages[1].placed_cpu_bytes, whole.stages[1].placed_cpu_bytes * 6 / 10);
  o.tp_degrees = {1, 5};  // 5 does not divide 12 heads
  EXPECT_THROW(make_uniform_plan(c, o), InputError);
}

TEST(Planner, TensorParallelDegreesParse) {
  EXPECT_EQ(parse_tp_degrees("1,2,1", 4), (std::vector<int32_t>{1, 2, 1}));
  EXPECT_EQ(parse_tp_degrees("2", 6), (std::vector<int32_t>{2, 2, 2}));
  auto refusal = [](const std::string& text, int32_t workers) {
    try {
      (void)parse_tp_degrees(text, workers);
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(refusal("1,2,1", 5).find("the stages take 4 worker ranks but the job has 5"),
            std::string::npos);
  EXPECT_NE(refusal("2", 5).find("5 worker ranks do not split into groups of 2"),
            std::string::npos);
  EXPECT_NE(refusal("1,x", 2).find("'x' is not a degree"), std::string::npos);
  EXPECT_NE(refusal("0,2", 2).find("'0' is not a degree"), std::string::npos);
}

// stories260K as one stage on the host: 2 KV slots of 16 positions, 8 rows a step. Every
// number below is worked out by hand from config.json (hidden 64, intermediate 172, 5
// layers, 8 heads and 4 KV heads of 8, vocab 512, 512 positions, tied head, f32).
constexpr int64_t kFixed = 512 * 64 * 4 + 64 * 4;  // embedding (= head) + final norm: 131328
// A layer's tensors: 2 norms, q and o [64, 64], k and v [32, 64], gate, up, down [172, 64].
constexpr int64_t kLayer = 2 * 256 + 2 * 16384 + 2 * 8192 + 3 * 44032;  // 181760 as held
constexpr int64_t kPacked = 45 * 4096;                 // 181760 rounded up to a page: 184320 packed
constexpr int64_t kKv = 5 * 2 * (2 * 16 * 4 * 8 * 4);  // K and V, 5 layers: 40960
// Step buffers of 8 rows: one layer's temporaries h, sel [8, 64]; q, attn [8, 64]; k, v
// [8, 32]; two MLP [8, 172]; the head's logits [8, 512]; the rotary tables [512, 4] x 2; one
// GPU batch's state: x [8, 64], token ids, positions and rope rows [8] and the row table (8
// entries of 3 int32).
constexpr int64_t kActivations = 8 * 4 * (2 * 64 + 2 * 64 + 2 * 32 + 2 * 172) + 8 * 512 * 4 +
                                 2 * 512 * 4 * 4 + (8 * 64 * 4 + 3 * 8 * 4 + 8 * 12);  // 56256
constexpr int64_t kStageHost = 2 * 512 * 4 + 8 * 4;  // the stage's logits and token ids: 4128
constexpr int64_t kStaging = 2 * (kPacked + 4096);   // two disk staging buffers

PlanOptions stories(int64_t stage_mem, const char* policy = nullptr) {
  PlanOptions o;
  o.model_spec = testing::stories_dir();
  o.workers = 1;
  o.kv_slots = 2;
  o.kv_capacity = 16;
  o.max_batch_rows = 8;
  o.stage_mem = stage_mem;
  if (policy != nullptr) o.placement.policy = Policy::parse(policy);
  return o;
}

std::string refusal(const ModelConfig& c, const PlanOptions& o) {
  try {
    make_uniform_plan(c, o);
  } catch (const InputError& e) {
    return e.what();
  }
  return "(accepted)";
}

TEST(Planner, AResidentStageIsTheSumWorkedOutByHand) {
  const ModelConfig c = load_model_config(testing::stories_dir());
  const ClusterPlan p = make_uniform_plan(c, stories(-1));
  const StagePlan& s = p.stages[0];
  EXPECT_EQ(s.placed_cpu_bytes,
            static_cast<uint64_t>(kFixed + 5 * kLayer + kKv + kActivations + kStageHost));
  EXPECT_EQ(s.placed_cpu_bytes, 1141472u);
  EXPECT_EQ(s.placed_gpu_bytes, 0u);
  EXPECT_EQ(s.placed_disk_bytes, 0u);
  EXPECT_EQ(s.weight_tiers, std::vector<uint8_t>(5, 1));
}

// WAA: the prefill pipeline (rank 1, every layer, the embedding and the head) with its own
// KV slots, and the decode pipeline over every layer again. The prefill stage is the
// resident stage above with 1 KV slot instead of 2: half the cache (20480) and one row of
// logits (2048) less: 1118912 bytes.
TEST(Planner, WaaPlansTwoPipelinesEachWithItsSlots) {
  const ModelConfig c = load_model_config(testing::stories_dir());
  PlanOptions o = stories(-1);
  o.workers = 3;
  o.encoder_stages = 1;
  o.encoder_kv_slots = 1;
  const ClusterPlan p = make_uniform_plan(c, o);
  ASSERT_EQ(p.stages.size(), 3u);
  const int32_t want[][2] = {{0, 5}, {0, 3}, {3, 5}};
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(p.stages[i].layer_begin, want[i][0]) << i;
    EXPECT_EQ(p.stages[i].layer_end, want[i][1]) << i;
  }
  EXPECT_TRUE(p.stages[0].has_embedding && p.stages[0].has_head);
  EXPECT_TRUE(p.stages[1].has_embedding && !p.stages[1].has_head);
  EXPECT_TRUE(!p.stages[2].has_embedding && p.stages[2].has_head);
  EXPECT_EQ(p.stages[0].placed_cpu_bytes,
            static_cast<uint64_t>(kFixed + 5 * kLayer + kKv / 2 + kActivations + 512 * 4 + 8 * 4));
  EXPECT_EQ(p.stages[0].placed_cpu_bytes, 1118944u);
  o.workers = 7;
  o.encoder_stages = 1;
  EXPECT_NE(refusal(c, o).find("WAA with 1 prefill and 6 decode ranks but"), std::string::npos)
      << refusal(c, o);
  o.encoder_stages = 7;
  EXPECT_NE(refusal(c, o).find("each side needs at least one"), std::string::npos);
}

TEST(Planner, RefusalNamesTheStageTheTierAndTheShortfall) {
  const ModelConfig c = load_model_config(testing::stories_dir());
  // w=100/0/0 keeps every layer resident: 1141472 bytes against a 1 MiB budget.
  const std::string m = refusal(c, stories(1 << 20, "w=100/0/0,h=0/100/0"));
  EXPECT_NE(m.find("stage 1 (layers [0, 5)): cpu needs 1.1 MiB (1141472 bytes), budget 1.0 MiB "
                   "(1048576 bytes): short by 0.1 MiB (92896 bytes)"),
            std::string::npos)
      << m;
}

TEST(Planner, RefusesWhatDoesNotFitEvenWithEveryLayerOnDisk) {
  const ModelConfig c = load_model_config(testing::stories_dir());
  // Every weight and KV-cache layer on disk still needs the embedding, two weight staging
  // buffers, the cache's two (K or V of a layer, 4096 bytes each) and the buffers resident:
  // 131328 + 376832 + 8192 + 56256 + 4128 = 576736 bytes, what the refusal names.
  const std::string m = refusal(c, stories(512 << 10));
  EXPECT_NE(m.find("stage 1 (layers [0, 5)): cpu needs 0.6 MiB (576736 bytes), budget 0.5 MiB "
                   "(524288 bytes): short by 0.1 MiB (52448 bytes)"),
            std::string::npos)
      << m;
}

TEST(Planner, AcceptsAStageThatFitsByStreaming) {
  const ModelConfig c = load_model_config(testing::stories_dir());
  // 900 KiB is less than the weights alone (131328 + 5 * 181760 = 1040128 bytes), so a
  // planner that keeps every weight resident refuses it; streaming four layers from disk
  // fits: one layer resident, four on disk (spread: layers 1-4), two staging buffers.
  const int64_t budget = 900 << 10;
  ASSERT_GT(kFixed + 5 * kLayer, budget);
  const ClusterPlan p = make_uniform_plan(c, stories(budget));
  const StagePlan& s = p.stages[0];
  EXPECT_EQ(s.weight_tiers, (std::vector<uint8_t>{1, 2, 2, 2, 2}));
  EXPECT_EQ(s.placed_cpu_bytes,
            static_cast<uint64_t>(kFixed + kLayer + kStaging + kKv + kActivations + kStageHost));
  EXPECT_LE(s.placed_cpu_bytes, static_cast<uint64_t>(budget));
  EXPECT_EQ(s.placed_disk_bytes, static_cast<uint64_t>(4 * kPacked));
}

TEST(Planner, ADeviceStageIsPlacedOnTheGpuTier) {
  const ModelConfig c = load_model_config(testing::stories_dir());
  PlanOptions o = stories(-1, "w=40/60/0,h=100/0/0");
  o.placement.device_compute = true;
  const ClusterPlan p = make_uniform_plan(c, o);
  const StagePlan& s = p.stages[0];
  // 2 of 5 layers on the device (lround(2.0)), 3 pinned packed on the host; the device holds
  // the embedding, those 2 layers, two slots for the streamed ones, the cache and buffers.
  EXPECT_EQ(s.weight_tiers, (std::vector<uint8_t>{0, 1, 0, 1, 1}));
  EXPECT_EQ(s.placed_gpu_bytes,
            static_cast<uint64_t>(kFixed + 2 * kPacked + 2 * kPacked + kKv + kActivations));
  EXPECT_EQ(s.placed_cpu_bytes, static_cast<uint64_t>(3 * kPacked + kStageHost));
  // A GPU budget one byte short is refused on the gpu tier by one byte.
  o.placement.budgets.gpu = static_cast<int64_t>(s.placed_gpu_bytes) - 1;
  const std::string m = refusal(c, o);
  EXPECT_NE(m.find("gpu needs"), std::string::npos) << m;
  EXPECT_NE(m.find("short by 0.0 MiB (1 bytes)"), std::string::npos) << m;
}

TEST(Planner, WithoutAPolicyTheCacheLeavesTheComputeTierBeforeARefusal) {
  const ModelConfig c = load_model_config(testing::stories_dir());
  // Every weight on disk needs 609504 bytes (above); each KV-cache layer on disk takes its
  // 2 x 4096 bytes out of host memory and the disk tier's two staging buffers 2 x 4096 come
  // once: 609504 - 4 x 8192 + 8192 = 584928 bytes with one cache layer left resident, the
  // first count that fits under 590000 (two resident: 593120).
  const ClusterPlan p = make_uniform_plan(c, stories(590000));
  const StagePlan& s = p.stages[0];
  EXPECT_EQ(s.weight_tiers, (std::vector<uint8_t>{2, 2, 2, 2, 2}));
  EXPECT_EQ(std::count(s.cache_tiers.begin(), s.cache_tiers.end(), 2), 4);
  EXPECT_EQ(std::count(s.cache_tiers.begin(), s.cache_tiers.end(), 0), 1);
  EXPECT_EQ(s.placed_cpu_bytes, 584928u);
  EXPECT_EQ(s.placed_disk_bytes, static_cast<uint64_t>(5 * kPacked + 4 * 2 * 4096));
  // The operator's policy is kept as given: the same budget with the cache on the compute
  // tier is refused.
  EXPECT_NE(refusal(c, stories(590000, "w=0/0/100,h=0/100/0")).find("short by"), std::string::npos);
}

StageNode node(int32_t rank, double read_gbs, int64_t cpu = -1) {
  StageNode n;
  n.rank = rank;
  n.name = fmt::format("rank {} on test", rank);
  n.budgets = TierBudgets{-1, cpu, -1, true};
  n.compute_read_gbs = read_gbs;
  n.disk_read_gbs = 1;
  return n;
}

TEST(Planner, UnequalNodesGetTheSplitWithTheShortestSlowestStage) {
  const ModelConfig c = load_model_config(testing::stories_dir());
  PlanOptions o = stories(-1);
  o.workers = 2;
  o.nodes = {node(1, 10), node(2, 40)};
  const std::vector<int32_t> got = balanced_layers(c, o);
  // Against every split of the 5 layers: none has a shorter slowest stage.
  const ClusterPlan shared = make_plan(c, o, got);
  auto slowest = [&](const std::vector<int32_t>& layers) {
    const ClusterPlan plan = make_plan(c, o, layers);
    double worst = 0;
    for (const StagePlan& st : plan.stages)
      worst = std::max(worst,
                       decode_step_seconds(choose_stage(c, plan, st, o).placed, *o.node(st.rank)));
    return worst;
  };
  for (int32_t k = 1; k <= 4; ++k) EXPECT_LE(slowest(got), slowest({k, 5 - k})) << k;
  // Four times the read rate: the second node takes the larger share.
  EXPECT_GT(got[1], got[0]);
  EXPECT_EQ(shared.stages[0].layer_end, got[0]);
  // The stages keep their own node's budget: the first node's is short by its embedding.
  o.nodes[0].budgets.cpu = 100'000;
  const std::string m = refusal(c, o);
  EXPECT_NE(m.find("stage 1 (layers [0, "), std::string::npos) << m;
  EXPECT_NE(m.find("rank 1 on test): cpu needs"), std::string::npos) << m;
  EXPECT_EQ(m.find("stage 2"), std::string::npos) << m;
}

TEST(Planner, EachStageComputesOnItsOwnNodesTier) {
  const ModelConfig c = load_model_config(testing::stories_dir());
  PlanOptions o = stories(-1);
  o.workers = 2;
  o.nodes = {node(1, 10), node(2, 10)};
  o.nodes[0].device_compute = true;
  const ClusterPlan p = make_plan(c, o, {2, 3});
  EXPECT_TRUE(p.stages[0].use_gpu);
  EXPECT_FALSE(p.stages[1].use_gpu);
  EXPECT_GT(p.stages[0].placed_gpu_bytes, 0u);
  EXPECT_EQ(p.stages[1].placed_gpu_bytes, 0u);
  // No CUDA device (no NCCL key): the link between them is MPI's, its buffers on the host.
  EXPECT_FALSE(p.stages[0].nccl);
  EXPECT_EQ(link_buffer_bytes(p.stages[0], p).gpu, 0);
  EXPECT_EQ(link_buffer_bytes(p.stages[0], p).cpu, 2 * 8 * 64 * 4);
}

}  // namespace
}  // namespace strata
