// The MoE expert placement (placement/moe_plan.h) against hand calculations: Fiddler's rule
// (copy time bytes / PCIe bandwidth against the CPU's max(bytes / bandwidth, FLOPs / rate)),
// the uniform-routing count of active experts, and Mixtral 8x7B on FlexGen's T4 machine.
#include <gtest/gtest.h>

#include <cmath>

#include "kernels/error.h"
#include "placement/moe_plan.h"
#include "support/moe_shapes.h"

namespace strata {
namespace {

ModelShape mixtral() {
  return testing::mixtral_8x7b();
}

TEST(FiddlerRule, FewRowsOnTheCpuManyRowsCopied) {
  const HardwareSpec hw = HardwareSpec::flexgen_t4();
  CpuExpertRates cpu;
  cpu.weight_bdw = 20e9;
  cpu.gemm_flops = 0.5e12;
  const double bytes = 3.0 * 4096 * 14336 * 2;  // 352,321,536: one Mixtral expert in f16
  const double flops_row = 2.0 * 3 * 4096 * 14336;
  // One row: the CPU reads the expert once, 17.6 ms; the copy alone is 25.5 ms.
  const ExpertSiteChoice one = fiddler_rule(bytes, flops_row, 1, hw.mm_flops_decode, hw, cpu);
  EXPECT_NEAR(one.cpu_s, bytes / 20e9, 1e-12);
  EXPECT_NEAR(one.copy_s, bytes / (12.89 * double(1 << 30)), 1e-12);
  EXPECT_TRUE(one.cpu);
  // 64 rows: 2 x 176M x 64 / 0.5e12 = 45.1 ms on the CPU against 25.5 + 5.2 ms.
  const ExpertSiteChoice many = fiddler_rule(bytes, flops_row, 64, hw.mm_flops_decode, hw, cpu);
  EXPECT_NEAR(many.cpu_s, flops_row * 64 / 0.5e12, 1e-12);
  EXPECT_NEAR(many.gpu_s, flops_row * 64 / hw.mm_flops_decode, 1e-12);
  EXPECT_FALSE(many.cpu);
}

TEST(MoePlan, MixtralOnTheT4KeepsDenseOnTheGpuAndExpertsOnTheHost) {
  HardwareSpec hw = HardwareSpec::flexgen_t4();
  hw.cpu_mem = 200.0 * (1 << 30);
  const Workload w{512, 32};
  bool fits = false;
  const MoePlan b1 = moe_plan_for(mixtral(), w, hw, MoePlanOptions{}, 1, true, fits);
  ASSERT_TRUE(fits);
  // GPU: 16 GiB less the embedding and head (2 x 32000 x 4096 x 2 B), 32 layers' attention,
  // norms and router (41.9M + 8192 + 32768 params, 2 B), a batch's KV cache and two expert
  // slots, leaves room for one expert per layer (32 x 336 MiB = 10.5 GiB).
  EXPECT_EQ(b1.gpu_experts, 1);
  EXPECT_EQ(b1.host_experts, 7);
  EXPECT_EQ(b1.disk_experts, 0);
  EXPECT_DOUBLE_EQ(b1.active_experts, 2.0);
  EXPECT_DOUBLE_EQ(b1.rows_per_expert, 1.0);
  EXPECT_TRUE(b1.decode_site.cpu);  // Fiddler: one row is cheaper on the CPU than a copy
  // Decode per layer: 2 active experts, 7/8 of them on the host: 1.75 x 17.6 ms on the CPU.
  EXPECT_NEAR(b1.t_cpu, 1.75 * b1.expert_bytes / 20e9, 1e-9);
  const MoePlan best = plan_moe(mixtral(), w, hw);
  EXPECT_GT(best.throughput, b1.throughput);
  EXPECT_FALSE(best.by_batch.empty());
  EXPECT_TRUE(best.by_batch.front().cpu_experts);  // batch 1: CPU experts
}

TEST(MoePlan, ADenseModelOrAGpuTooSmallIsRefusedByName) {
  ModelShape dense = mixtral();
  dense.n_experts = 0;
  EXPECT_THROW(plan_moe(dense, Workload{8, 8}, HardwareSpec::flexgen_t4()), InputError);
  HardwareSpec small = HardwareSpec::flexgen_t4();
  small.gpu_mem = 2.0 * (1 << 30);  // less than the dense part of the layers
  try {
    plan_moe(mixtral(), Workload{8, 8}, small);
    FAIL() << "accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("short by"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace strata
