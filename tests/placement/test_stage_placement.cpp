// The accelerator backend's kernel scratch in the stage's memory model, by hand for OPT-125m's
// shape (hidden 768, ffn 3072, vocab 50272): the CUDA backend rounds x to f16 for every
// half-precision or 4-bit linear (rows x the widest input) and dequantises a 4-bit matrix to
// f16 before its GEMM (the largest: fc1 / fc2, 3072 x 768). The planner counts it against
// the GPU budget; host compute has none.
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace strata
