// What the planner predicts for Pie and HeteGen (placement/offload_estimates.h): HeteGen's
// alpha and times by hand from eq. 4-5 on given speeds; Pie's stall-free host layers against
// §3.1's bound, the paper's worked example (Figure 4 runs two host layers of nine with swaps
// twice the compute, without a stall) and a swap no compute can hide.
#include <gtest/gtest.h>

#include "kernels/error.h"
#include "placement/offload_estimates.h"
#include "placement/pie.h"
#include "support/opt_shapes.h"

namespace strata {
namespace {
using testing::opt_30b;

TEST(PieEstimate, FigureFourRunsTwoHostLayersWithoutAStall) {
  // §3.3: "a nine-layer model where swapping time for each layer is twice the computation
  // time ... allocates two layers in the CPU", and that is the most: its FIFO is m + 2 = 4
  // layers long, each place held two compute times, 8 = n - 1 before the layer is needed
  // again. (§3.1's looser bound, t_compute * n / t_swap, would allow 4.5.)
  const int32_t m = max_stall_free_host_layers(9, 1.0, 2.0);
  EXPECT_EQ(m, 2);
  // One more stalls: the search stops at the first m that does.
  PieSimulator sim(PieSimConfig{9, m + 1, 1.0, 2.0});
  double stall = 0;
  for (int t = 0; t < 7; ++t) stall += sim.run_token().stall;
  EXPECT_GT(stall, 0);
}

TEST(PieEstimate, ASwapLongerThanATokenKeepsEveryLayerOnTheGpu) {
  // One layer's swap takes 20 layers of compute, more than a whole token of 9.
  EXPECT_EQ(max_stall_free_host_layers(9, 1.0, 20.0), 0);
}

TEST(PieEstimate, LayerCacheAndSwapTimeByHand) {
  const ModelShape s = opt_30b();  // h1 7168, h2 28672, 48 layers, fp16
  HardwareSpec hw = HardwareSpec::flexgen_t4();
  const Workload w{512, 32};
  const Policy p = Policy::parse("gbs=8,ngb=4,w=0/100/0,c=100/0/0,h=100/0/0,cf16=1");
  const PieEstimate e = estimate_pie(s, w, p, hw);
  // 32 sequences x 544 positions x K and V x 7168 x 2 bytes (FlexGen's f16 cache).
  EXPECT_EQ(e.layer_cache_bytes, int64_t{32} * 544 * 2 * 7168 * 2);  // 499,122,176
  // GPU -> CPU for the cache (0.97 GiB/s) is the slower way on the T4:
  // 499,122,176 / (0.97 * 2^30) = 0.479220 s.
  EXPECT_NEAR(e.swap_s, 0.479220, 1e-6);
  // A decode step of one layer for the block on the GPU (A.3): the linears, 2 x (4 h1^2 +
  // 4 h1 + 2 h1 h2 + h2 + h1) = 1,233,254,400 FLOPs a token, 32 tokens at 4.3 TFLOP/s:
  // 0.0091777 s; attention over s + n/2 = 528 positions, 4 x 32 x 528 x 7168 FLOPs at
  // 0.079 TFLOP/s: 0.0061322 s. Together 0.0153099 s.
  EXPECT_NEAR(e.compute_s, 0.0153099, 1e-7);
  // §3.3's protocol starts a swap only as a layer begins, one each way at a time, into a FIFO
  // of m + 2 places (Figure 4): m host layers are hidden iff floor((l - 1) / (m + 2)) layers'
  // compute covers one swap. One swap is 0.479220 / 0.0153099 = 31.3 layers here, more than
  // even m = 0's floor(47 / 2) = 23: every layer stays on the GPU.
  EXPECT_EQ(e.host_layers, 0);
  EXPECT_DOUBLE_EQ(e.expansion, 1.0);
  // Links 7x faster: a swap is 0.068460 s = 4.47 layers' compute. floor(47 / 9) = 5 covers
  // it, floor(47 / 10) = 4 does not: m = 7, expansion 48 / 41.
  hw.ctog_bdw *= 7;
  hw.gtoc_bdw_cache *= 7;
  const PieEstimate fast = estimate_pie(s, w, p, hw);
  EXPECT_NEAR(fast.swap_s, 0.068460, 1e-6);
  EXPECT_EQ(fast.host_layers, 7);
  EXPECT_DOUBLE_EQ(fast.expansion, 48.0 / 41.0);
}

// Pie swaps the cache the engine stores: 4 bytes an element (f32) whatever the weights, 2 with
// cf16 (as the cost model counts it).
TEST(PieEstimate, SwapsTheCacheInItsOwnElementSize) {
  for (const int64_t weight_bytes : {2, 4}) {
    ModelShape s = opt_30b();
    s.weight_bytes_per_elem = weight_bytes;
    const HardwareSpec hw = HardwareSpec::flexgen_t4();
    const Workload w{512, 32};
    Policy p = Policy::parse("gbs=8,ngb=4,w=0/100/0,c=100/0/0,h=100/0/0");
    EXPECT_EQ(estimate_pie(s, w, p, hw).layer_cache_bytes, int64_t{32} * 544 * 2 * 7168 * 4);
    p.cache_f16 = true;
    EXPECT_EQ(estimate_pie(s, w, p, hw).layer_cache_bytes, int64_t{32} * 544 * 2 * 7168 * 2);
  }
}

TEST(HeteGenEstimate, AlphaAndTimesByHand) {
  ModelShape s = opt_30b();
  HardwareSpec hw = HardwareSpec::flexgen_t4();
  hw.mm_flops_decode = 2e12;
  hw.cpu_flops = 2e11;
  hw.ctog_bdw = 1.6e10;
  // A block of 10: V_gpu = 2e12 / 20 = 1e11, V_cpu = 1e10 parameters/s; fp16 over 16 GB/s:
  // V_com = 8e9. Eq. 5: alpha = 1 / (1e10/8e9 + 1e10/1e11 + 1) = 1 / 2.35.
  const Policy p = Policy::parse("gbs=10,ngb=1,w=0/100/0,c=100/0/0,h=100/0/0");
  EXPECT_THROW(estimate_hetegen(s, p, 0, hw), InputError);
  const HeteGenEstimate e = estimate_hetegen(s, p, 10, hw);
  EXPECT_DOUBLE_EQ(e.v_gpu, 1e11);
  EXPECT_DOUBLE_EQ(e.v_cpu, 1e10);
  EXPECT_DOUBLE_EQ(e.v_com, 8e9);
  EXPECT_NEAR(e.alpha, 1 / 2.35, 1e-12);
  const auto W = static_cast<double>(s.params_per_layer());
  EXPECT_NEAR(e.split_s, (1 - 1 / 2.35) * W / 1e10, 1e-9);
  EXPECT_NEAR(e.stream_s, W / 8e9 + W / 1e11, 1e-9);
  // Eq. 4 balances: the CPU's share takes as long as the GPU's share's transfer and compute.
  EXPECT_NEAR(e.split_s, e.alpha * W * (1 / 8e9 + 1 / 1e11), 1e-9);
  EXPECT_LT(e.split_s, e.stream_s);
}

}  // namespace
}  // namespace strata
