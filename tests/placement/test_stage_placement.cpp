// The accelerator backend's kernel scratch in the stage's memory model, by hand for OPT-125m's
// shape (hidden 768, ffn 3072, vocab 50272): the CUDA backend rounds x to f16 for every
// half-precision or 4-bit linear (rows x the widest input) and dequantises a 4-bit matrix to
// f16 before its GEMM (the largest: fc1 / fc2, 3072 x 768). The planner counts it against
// the GPU budget; host compute has none.
#include <gtest/gtest.h>

#include "kernels/error.h"
#include "placement/stage_placement.h"

namespace strata {
namespace {

ModelShape opt125m(DType dtype) {
  ModelShape s;
  s.hidden = 768;
  s.intermediate = 3072;
  s.n_layers = 12;
  s.n_heads = 12;
  s.n_kv_heads = 12;
  s.head_dim = 64;
  s.vocab = 50272;
  s.max_positions = 2048;
  s.learned_positions = true;
  s.position_offset = 2;
  s.linear_bias = s.norm_bias = s.attention_bias = s.mlp_bias = true;
  s.dtype = dtype;
  s.weight_bytes_per_elem = static_cast<int64_t>(dtype_size(dtype));
  s.embed_dim = 768;
  return s;
}

StageRequest device_stage(const char* policy) {
  StageRequest r;
  r.device_compute = true;
  r.max_rows = 64;
  r.kv_slots = 4;
  r.kv_capacity = 128;
  r.policy = Policy::parse(policy);
  return r;
}

TEST(StagePlacement, KernelScratchByHand) {
  // f16 weights, 4-bit layers: x in f16, 64 rows x 3072 (fc2's input) x 2 bytes = 393216;
  // fc1 dequantised, 3072 x 768 x 2 bytes = 4718592.
  EXPECT_EQ(place_stage(opt125m(DType::kF16), device_stage("cw=1")).kernel_scratch_bytes,
            393216 + 4718592);
  EXPECT_EQ(place_stage(opt125m(DType::kF16), device_stage("w=100/0/0")).kernel_scratch_bytes,
            393216);
  EXPECT_EQ(place_stage(opt125m(DType::kF32), device_stage("w=100/0/0")).kernel_scratch_bytes, 0);
  StageRequest host = device_stage("cw=1");
  host.device_compute = false;
  EXPECT_EQ(place_stage(opt125m(DType::kF16), host).kernel_scratch_bytes, 0);
}

TEST(StagePlacement, KernelScratchCountsAgainstTheGpuBudget) {
  const StagePlacement p = place_stage(opt125m(DType::kF16), device_stage("cw=1"));
  const int64_t need = p.total().gpu + p.kernel_scratch_bytes;
  EXPECT_TRUE(shortfalls(p, TierBudgets{need, -1, -1, true}).empty());
  const auto lines = shortfalls(p, TierBudgets{need - 1, -1, -1, true});
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("gpu needs"), std::string::npos) << lines[0];
  EXPECT_NE(lines[0].find("(1 bytes)"), std::string::npos) << lines[0];
  EXPECT_NE(p.str().find("kernel scratch 4.9 MiB on the device"), std::string::npos) << p.str();
}

// HeteGen by hand for OPT-125m in f16 at alpha 0.5 (every row count even, so each linear is
// halved): q, k, v, o [768, 768] keep 384 rows on the device, 384 x 768 x 2 = 589824 bytes
// each; fc1 [3072, 768] 1536 rows and fc2 [768, 3072] 384 rows, 2359296 bytes each; the
// biases' halves 4 x 384 x 4 + 1536 x 4 + 384 x 4 = 13824; the four LayerNorm vectors of 768
// f32 packed, 12288 (three pages), on the device only.
TEST(StagePlacement, HeteGenSplitByHand) {
  StageRequest streamed = device_stage("w=0/100/0");
  StageRequest split = streamed;
  split.hetegen_alpha = 0.5;
  const StagePlacement s = place_stage(opt125m(DType::kF16), streamed);
  const StagePlacement p = place_stage(opt125m(DType::kF16), split);
  const int64_t matrices = 4 * 589824 + 2 * 2359296;
  EXPECT_EQ(p.weights.split_layers(), 12);
  EXPECT_EQ(p.weights.streamed_layers(), 0);
  EXPECT_EQ(p.weights.split_gpu_bytes, matrices + 13824 + 12288);
  EXPECT_EQ(p.weights.host_layer_bytes, matrices + 13824);
  EXPECT_EQ(s.weights.split_layers(), 0);
  EXPECT_EQ(s.weights.streamed_layers(), 12);
  // No device slots: nothing streams. The staging: x [64, 3072] and the CPU output [64, 3072]
  // in host memory, both shares [64, 3072] on the device.
  EXPECT_EQ(p.weights.device_staging_bytes, 0);
  EXPECT_EQ(p.weights.gpu_bytes(), s.weights.fixed_bytes + 12 * p.weights.split_gpu_bytes);
  EXPECT_EQ(p.weights.cpu_bytes(), 12 * (matrices + 13824));
  EXPECT_EQ(p.compute_workspace_bytes - s.compute_workspace_bytes, 64 * 3072 * 4);
  EXPECT_EQ(p.host_workspace_bytes - s.host_workspace_bytes, 64 * (3072 + 3072) * 4);
}

TEST(StagePlacement, HeteGenFillsTheGpuBudgetAroundTheSplitLayers) {
  // A --gpu-mem of the fixed tensors, 4 whole layers and 8 split ones: 4 on the GPU, 8 split,
  // and it fits to the byte; one byte less and a layer moves to the split side.
  StageRequest r;
  r.device_compute = true;
  const WeightPlacement whole = place_weights(opt125m(DType::kF16), r);
  r.hetegen_alpha = 0.3;
  const int64_t S = place_weights(opt125m(DType::kF16), r).split_gpu_bytes;
  ASSERT_LT(S, whole.layer_bytes);
  r.budgets.gpu = whole.fixed_bytes + 4 * whole.layer_bytes + 8 * S;
  const WeightPlacement p = place_weights(opt125m(DType::kF16), r);
  EXPECT_EQ(p.count(Tier::kGpu), 4) << p.str();
  EXPECT_EQ(p.split_layers(), 8) << p.str();
  EXPECT_EQ(p.gpu_bytes(), r.budgets.gpu);
  r.budgets.gpu -= 1;
  EXPECT_EQ(place_weights(opt125m(DType::kF16), r).count(Tier::kGpu), 3);
}

TEST(StagePlacement, HeteGenRefusals) {
  StageRequest r = device_stage("w=0/100/0");
  for (double alpha : {-0.5, 1.5}) {
    r.hetegen_alpha = alpha;
    EXPECT_THROW(place_stage(opt125m(DType::kF16), r), InputError) << alpha;
  }
  r.hetegen_alpha = 0.5;
  r.device_compute = false;
  try {
    place_stage(opt125m(DType::kF16), r);
    ADD_FAILURE() << "HeteGen on host compute accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("needs device compute"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace strata
