// FlexGen's cost model (appendix A.3) and the hardware constants it runs on: every term
// hand-evaluated from the paper's formulas for a tiny shape, properties that must hold
// whatever the numbers, and the T4 / OPT-30B runs of FlexGen's Table 21.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "kernels/error.h"
#include "placement/cost_model.h"
#include "placement/hardware.h"
#include "support/opt_shapes.h"

namespace strata {
namespace {

constexpr double kGiB = double(int64_t{1} << 30);

// h1 = 64, h2 = 256, l = 2, nh = 4; no biases, RMSNorm (two h1-sized weights per layer).
ModelShape tiny_shape() {
  ModelShape m;
  m.hidden = 64;
  m.intermediate = 256;
  m.n_layers = 2;
  m.n_heads = 4;
  m.n_kv_heads = 4;
  m.head_dim = 16;
  m.vocab = 100;
  m.max_positions = 64;
  m.linear_bias = false;
  m.norm_bias = false;
  m.weight_bytes_per_elem = 2;  // fp16, FlexGen's assumption
  return m;
}

using testing::opt_30b;

// Round numbers, so the expected values below read like the paper's formulas.
HardwareSpec round_hardware(OverlapModel model) {
  HardwareSpec h;
  h.gpu_mem = h.cpu_mem = h.disk_mem = 1e12;
  h.ctog_bdw = 1e9;
  h.gtoc_bdw_cache = 2e9;
  h.gtoc_bdw_hidden = 4e9;
  h.dtoc_bdw = 5e8;
  h.ctod_bdw_cache_prefill = 2.5e8;
  h.ctod_bdw_other = 1e9;
  h.mm_flops_prefill = 1e12;
  h.mm_flops_decode = 5e11;
  h.bmm_flops_prefill = 2e11;
  h.bmm_flops_decode = 1e10;
  h.cpu_flops = 1e9;
  h.overlap_model = model;
  return h;
}

Policy tiny_policy() {
  return Policy::parse("gbs=2,ngb=3,w=30/50/20,c=20/70/10,h=40/40/20,cpu_attn=1,cf16=1");
}

void expect_rel(double actual, double expected, const char* what) {
  EXPECT_NEAR(actual, expected, 1e-12 * std::abs(expected)) << what;
}

// The tiny case's constants, in the paper's names.
struct Tiny {
  double h1 = 64, h2 = 256, l = 2, nh = 4, s = 16, n = 8, gbs = 2, bls = 6;
  double wg = .3, wc = .5, wd = .2, cg = .2, cc = .7, cd = .1, hg = .4, hc = .4, hd = .2;
  // 8 h1^2 + 4 h1 h2 bytes of matrices, plus the two RMSNorm weights FlexGen leaves out.
  double W = 8 * h1 * h1 + 4 * h1 * h2 + 2 * h1 * 2;
};

TEST(CostModel, PrefillTermsMatchAppendixA3) {
  const Tiny t;
  const CostEstimate c =
      estimate_cost(tiny_shape(), {16, 8}, tiny_policy(), round_hardware(OverlapModel::kPaper));
  const double act = 2 * t.s * t.h1 * t.bls;          // 2 s h1 bls
  const double cache = 4 * (t.s + 1) * t.h1 * t.bls;  // 4 (s + 1) h1 bls
  expect_rel(c.prefill.ctog, ((t.wc + t.wd) * t.W + (t.hc + t.hd) * act) / 1e9, "ctog^p");
  expect_rel(c.prefill.gtoc, (t.cc + t.cd) * cache / 2e9 + (t.hc + t.hd) * act / 4e9, "gtoc^p");
  expect_rel(c.prefill.dtoc, (t.wd * t.W + t.hd * act) / 5e8, "dtoc^p");
  expect_rel(c.prefill.ctod, t.cd * cache / 2.5e8 + t.hd * act / 1e9, "ctod^p");
  const double linear = t.bls * (8 * t.s * t.h1 * t.h1 + 4 * t.s * t.h1 * t.h2);
  expect_rel(c.prefill.gpu_comp, linear / 1e12 + 4 * t.bls * t.s * t.s * t.h1 / 2e11, "comp^p");
  EXPECT_EQ(c.prefill.cpu_comp, 0);
}

TEST(CostModel, DecodeTermsMatchAppendixA3) {
  const Tiny t;
  const CostEstimate c =
      estimate_cost(tiny_shape(), {16, 8}, tiny_policy(), round_hardware(OverlapModel::kPaper));
  const double act = 2 * t.h1 * t.bls;                      // 2 h1 bls
  const double cache = 4 * t.bls * (t.s + t.n / 2) * t.h1;  // 4 bls (s + n/2) h1
  expect_rel(c.decode.ctog, ((t.wc + t.wd) * t.W + (t.hc + t.hd) * act) / 1e9, "ctog^g");
  expect_rel(c.decode.gtoc, (t.hc + t.hd) * act / 4e9, "gtoc^g");
  expect_rel(c.decode.dtoc, (t.cd * cache + t.wd * t.W + t.hd * act) / 5e8, "dtoc^g");
  expect_rel(c.decode.ctod, (4 * t.cd * t.bls * t.h1 + t.hd * act) / 1e9, "ctod^g");
  const double linear = t.bls * (8 * t.h1 * t.h1 + 4 * t.h1 * t.h2);
  expect_rel(c.decode.gpu_comp, linear / 5e11 + t.cg * cache / 1e10, "gpu_comp^g");
  expect_rel(c.decode.cpu_comp, (t.cc + t.cd) * cache / 1e9, "cpu_comp^g");
}

TEST(CostModel, TotalTimeAndThroughputFollowSection43) {
  const Tiny t;
  const CostEstimate c =
      estimate_cost(tiny_shape(), {16, 8}, tiny_policy(), round_hardware(OverlapModel::kPaper));
  const auto top = [](const PhaseCost& p) {
    return std::max({p.ctog, p.gtoc, p.dtoc, p.ctod, p.comp()});
  };
  expect_rel(c.prefill.time, top(c.prefill), "T_pre = max(...)");
  expect_rel(c.decode.time, top(c.decode), "T_gen = max(...)");
  expect_rel(c.total_time, c.prefill.time * t.l + c.decode.time * (t.n - 1) * t.l, "T");
  expect_rel(c.throughput, t.bls * t.n / c.total_time, "throughput = bls n / T");
  expect_rel(c.time_per_sequence(), c.total_time / t.bls, "T / bls");
}

TEST(CostModel, FittedOverlapChainsTransfersLikeFlexGensCostModel) {
  const CostEstimate c =
      estimate_cost(tiny_shape(), {16, 8}, tiny_policy(), round_hardware(OverlapModel::kFitted));
  const PhaseCost& p = c.prefill;
  const PhaseCost& g = c.decode;
  expect_rel(p.time, std::max({p.ctog + p.dtoc, p.gtoc + p.ctod, p.comp()}), "T_pre");
  expect_rel(g.time, g.ctog + std::max({g.gtoc, g.dtoc, g.ctod, g.comp()}), "T_gen");
}

TEST(CostModel, NoOverlapAddsEveryActivity) {
  Policy p = tiny_policy();
  p.overlap = false;
  const CostEstimate c =
      estimate_cost(tiny_shape(), {16, 8}, p, round_hardware(OverlapModel::kFitted));
  expect_rel(c.prefill.time, c.prefill.serial(), "T_pre");
  expect_rel(c.decode.time, c.decode.serial(), "T_gen");
  EXPECT_EQ(c.decode.binding, "serial");
}

TEST(CostModel, PeakMemoryMatchesAppendixA3) {
  const Tiny t;
  const CostEstimate c =
      estimate_cost(tiny_shape(), {16, 8}, tiny_policy(), round_hardware(OverlapModel::kPaper));
  const double cache_all = 4 * (t.s + t.n) * t.h1 * t.bls * t.l;  // 4 (s+n) h1 bls l
  const double sn = t.s + t.n;
  // GPU, prefill: home + 2(1-wg)W + (1-hg) 2 s h1 gbs + max(qkv, att1, att2, embed, mlp1,
  // mlp2). A.3 scales att1/att2 by cg, but prefill attention always runs on the GPU.
  const double att_p = t.gbs * (2 * t.s * t.h1 + 2 * t.s * t.h1 + 2 * t.nh * t.s * t.s);
  const double work_p = std::max(
      {8 * t.s * t.h1 * t.gbs, att_p, 4 * t.s * t.h1 * t.gbs, 2 * t.gbs * t.s * (t.h1 + t.h2)});
  expect_rel(c.peak.gpu_prefill,
             t.wg * t.W * t.l + t.hg * 2 * t.s * t.h1 * t.bls + t.cg * cache_all +
                 2 * (1 - t.wg) * t.W + (1 - t.hg) * 2 * t.s * t.h1 * t.gbs + work_p,
             "gpu_peak^p");
  // GPU, decode: the activation buffer holds one token per sequence (A.3 writes 2 s h1 gbs).
  const double att_g = t.cg * t.gbs * (2 * t.h1 + 2 * sn * t.h1 + 2 * t.nh * sn);
  const double work_g =
      std::max({8 * t.gbs * t.h1, att_g, 4 * t.gbs * t.h1, 2 * t.gbs * (t.h1 + t.h2)});
  expect_rel(c.peak.gpu_decode,
             t.wg * t.W * t.l + t.hg * 2 * t.h1 * t.bls + t.cg * cache_all + 2 * (1 - t.wg) * t.W +
                 (1 - t.hg) * 2 * t.h1 * t.gbs + work_g,
             "gpu_peak^g");
  expect_rel(c.peak.cpu_prefill,
             t.wc * t.W * t.l + t.hc * 2 * t.s * t.h1 * t.bls + t.cc * cache_all +
                 (1 - t.wg) * t.W + (1 - t.hg) * 2 * t.s * t.h1 * t.gbs,
             "cpu_peak^p");
  expect_rel(c.peak.cpu_decode,
             t.wc * t.W * t.l + t.hc * 2 * t.h1 * t.bls + t.cc * cache_all + t.wd * t.W +
                 2 * t.hd * 2 * t.h1 * t.gbs + 2 * t.cd * 4 * sn * t.h1 * t.gbs +
                 2 * t.nh * sn * t.gbs + 2 * t.h1 * t.gbs,
             "cpu_peak^g");
  expect_rel(c.peak.disk, t.W * t.wd * t.l + t.hd * 2 * t.s * t.h1 * t.bls + t.cd * cache_all,
             "nvme_peak");
}

// Pie with m of l = 8 layers on the host (cost_model.h): the GPU gives up m layers of the
// block's cache, the host holds m + 2, each link carries m / l of a layer per layer, and
// the bound swap / floor((l - 1) / (m + 2)) is what §3.3's FIFO can hide.
TEST(CostModel, PieMovesMLayersOfCacheToTheHostAndBoundsTheStepBySwaps) {
  ModelShape shape = tiny_shape();
  shape.n_layers = 8;
  const HardwareSpec hw = round_hardware(OverlapModel::kPaper);
  // Weights on the GPU, so the swaps are what bounds a decode step.
  const Policy flexgen = Policy::parse("gbs=2,ngb=3,w=100/0/0,c=100/0/0,h=40/40/20,cf16=1");
  const Tiny t;
  const double layer = 4 * t.h1 * (t.s + t.n) * t.bls;  // K and V, s + n positions, block
  for (int m : {1, 2, 5}) {
    Policy pie = flexgen;
    pie.pie_host_layers = m;
    const CostEstimate a = estimate_cost(shape, {16, 8}, flexgen, hw);
    const CostEstimate b = estimate_cost(shape, {16, 8}, pie, hw);
    SCOPED_TRACE(fmt::format("m = {}", m));
    expect_rel(b.peak.gpu_decode - a.peak.gpu_decode, -m * layer, "GPU decode peak");
    expect_rel(b.peak.gpu_prefill - a.peak.gpu_prefill, -m * layer, "GPU prefill peak");
    expect_rel(b.peak.cpu_decode - a.peak.cpu_decode, std::min(8, m + 2) * layer, "CPU peak");
    for (auto [pa, pb] : {std::pair{a.prefill, b.prefill}, std::pair{a.decode, b.decode}}) {
      expect_rel(pb.ctog - pa.ctog, m / 8.0 * layer / 1e9, "ctog");
      expect_rel(pb.gtoc - pa.gtoc, m / 8.0 * layer / 2e9, "gtoc");
      expect_rel(pb.comp(), pa.comp(), "comp");
    }
    // floor(7 / 3) = 2 layers per swap at m = 1; floor(7 / 4) = floor(7 / 7) = 1 at m = 2, 5.
    const double bound = layer / 1e9 / (m == 1 ? 2 : 1);
    const PhaseCost& g = b.decode;
    expect_rel(g.time, std::max({g.ctog, g.gtoc, g.dtoc, g.ctod, g.comp(), bound}), "T_gen");
    EXPECT_EQ(g.binding, "pie");
  }
  Policy too_many = flexgen;
  too_many.pie_host_layers = 6;
  try {
    estimate_cost(shape, {16, 8}, too_many, hw);
    ADD_FAILURE() << "pie=6 of 8 layers accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("at most l - 3 = 5 host layers"), std::string::npos)
        << e.what();
  }
}

// HeteGen at alpha = 0.4 (cost_model.h): 0.6 of the CPU-tier weights (wc) neither cross the
// link nor compute on the GPU; the CPU computes them at cpu_flops beside the rest.
TEST(CostModel, HeteGenKeepsTheCpuShareOfCpuTierWeightsOffTheLinkAndTheGpu) {
  const Tiny t;
  const HardwareSpec hw = round_hardware(OverlapModel::kPaper);
  Policy split = tiny_policy();
  split.hetegen_alpha_percent = 40;
  const CostEstimate a = estimate_cost(tiny_shape(), {16, 8}, tiny_policy(), hw);
  const CostEstimate b = estimate_cost(tiny_shape(), {16, 8}, split, hw);
  const double kept = 0.6 * t.wc;
  const double linear_tok = 8 * t.h1 * t.h1 + 4 * t.h1 * t.h2;
  expect_rel(b.decode.ctog - a.decode.ctog, -kept * t.W / 1e9, "ctog^g");
  expect_rel(b.prefill.ctog - a.prefill.ctog, -kept * t.W / 1e9, "ctog^p");
  expect_rel(b.decode.gpu_comp - a.decode.gpu_comp, -kept * t.bls * linear_tok / 5e11, "comp^g");
  expect_rel(b.prefill.gpu_comp - a.prefill.gpu_comp, -kept * t.bls * t.s * linear_tok / 1e12,
             "comp^p");
  expect_rel(b.decode.cpu_split, kept * t.bls * linear_tok / 1e9, "cpu split^g");
  expect_rel(b.prefill.cpu_split, kept * t.bls * t.s * linear_tok / 1e9, "cpu split^p");
  expect_rel(b.peak.gpu_decode - a.peak.gpu_decode, -kept * 2 * t.W, "GPU buffers");
  expect_rel(b.peak.cpu_decode, a.peak.cpu_decode, "CPU memory");
  const PhaseCost& g = b.decode;
  expect_rel(g.time, std::max({g.ctog, g.gtoc, g.dtoc, g.ctod, g.comp(), g.cpu_comp + g.cpu_split}),
             "T_gen: the CPU's share is its own bound, with CPU attention");
  EXPECT_EQ(a.decode.cpu_split, 0);
}

// HeteGen eq. 4-5 on the cost model: weights all on the CPU, batch 1, FlexGen's fitted chain
// (transfer then GPU compute). At eq. 5's alpha, here 1 / (Vcpu/Vcom + Vcpu/Vgpu + 1) with
// Vcpu = 1e9/2, Vcom = 1e9/2 bytes, Vgpu = 5e11/2 parameters/s, i.e. 0.4995 -> 50%, the CPU's
// (1 - alpha) W / Vcpu equals the GPU side's alpha W (1/Vcom + 1/Vgpu).
TEST(CostModel, HeteGenAtEquationFiveAlphaBalancesTheCpuAgainstTheLinkAndGpu) {
  const Tiny t;
  const HardwareSpec hw = round_hardware(OverlapModel::kFitted);
  const double alpha = 1 / ((1e9 / 2) / (1e9 / 2) + (1e9 / 2) / (5e11 / 2) + 1);
  EXPECT_NEAR(alpha, 0.4995, 1e-4);
  Policy streamed = Policy::parse("gbs=1,ngb=1,w=0/100/0,c=100/0/0,h=100/0/0,cpu_attn=0,cf16=1");
  Policy split = streamed;
  split.hetegen_alpha_percent = 50;
  const CostEstimate a = estimate_cost(tiny_shape(), {16, 8}, streamed, hw);
  const CostEstimate b = estimate_cost(tiny_shape(), {16, 8}, split, hw);
  const double attention = 4 * (t.s + t.n / 2) * t.h1 / 1e10;  // on the GPU, not split
  const double gpu_side = b.decode.ctog + b.decode.gpu_comp - attention;
  EXPECT_NEAR(b.decode.cpu_split / gpu_side, 1, 0.01);
  EXPECT_EQ(b.decode.binding, "ctog+comp");
  EXPECT_LT(b.decode.time, 0.6 * a.decode.time);  // about half: eq. 4 against streaming
}

TEST(CostModel, CompressionIsFourBitsPlusAMinAndScalePerGroupOf64) {
  // fp16: 64 elements -> 32 bytes of 4-bit values + 2 fp16 = 36 bytes, of 128.
  EXPECT_DOUBLE_EQ(compressed_fraction(2), 36.0 / 128.0);
  EXPECT_DOUBLE_EQ(compressed_fraction(4), (32.0 + 8.0) / 256.0);
}

TEST(CostModel, CompressingWeightsScalesTheirTrafficAndHomes) {
  const Tiny t;
  Policy p = tiny_policy();
  p.compress_weight = true;
  const HardwareSpec hw = round_hardware(OverlapModel::kPaper);
  const CostEstimate plain = estimate_cost(tiny_shape(), {16, 8}, tiny_policy(), hw);
  const CostEstimate packed = estimate_cost(tiny_shape(), {16, 8}, p, hw);
  const double saved = (1 - compressed_fraction(2)) * t.W;  // bytes per layer
  expect_rel(plain.decode.ctog - packed.decode.ctog, (t.wc + t.wd) * saved / 1e9, "ctog^g");
  expect_rel(plain.decode.dtoc - packed.decode.dtoc, t.wd * saved / 5e8, "dtoc^g");
  expect_rel(plain.peak.disk - packed.peak.disk, t.wd * saved * t.l, "disk");
  EXPECT_LT(packed.peak.cpu(), plain.peak.cpu());
}

// The KV cache is the engine's: f32 (8 h1 bytes a token, K and V) whatever the weights,
// unless the policy says cf16, FlexGen's 4 h1. For an fp16 model as for an f32 one, cf16
// halves the cache's homes (disk: cd x 4 (s+n) h1 bls l of the 8 (s+n) h1 bls l an f32 cache
// holds) -- the same bytes for both, so the weights' type does not size the cache.
TEST(CostModel, TheCacheIsF32UnlessThePolicySaysF16WhateverTheWeights) {
  const Tiny t;
  ModelShape f32 = tiny_shape();
  f32.weight_bytes_per_elem = 4;
  Policy plain = tiny_policy();
  plain.cache_f16 = false;
  const Policy half = tiny_policy();
  ASSERT_TRUE(half.cache_f16);
  const HardwareSpec hw = round_hardware(OverlapModel::kPaper);
  const double f16_cache_all = 4 * (t.s + t.n) * t.h1 * t.bls * t.l;
  for (const ModelShape& shape : {f32, tiny_shape()}) {
    const CostEstimate whole = estimate_cost(shape, {16, 8}, plain, hw);
    const CostEstimate halved = estimate_cost(shape, {16, 8}, half, hw);
    expect_rel(whole.peak.disk - halved.peak.disk, t.cd * f16_cache_all, "disk");
  }
}

TEST(CostModel, CompressionNeverGrowsMemory) {
  const HardwareSpec hw = HardwareSpec::flexgen_t4();
  for (const char* text : {"gbs=48,ngb=3,w=20/80/0,c=0/100/0,h=0/100/0,cpu_attn=0",
                           "gbs=8,ngb=4,w=0/50/50,c=30/30/40,h=50/50/0,cpu_attn=0",
                           "gbs=1,ngb=1,w=0/0/100,c=0/0/100,h=0/0/100,cpu_attn=0"}) {
    const Policy p = Policy::parse(text);
    Policy pc = p;
    pc.compress_weight = pc.compress_cache = true;
    const CostEstimate a = estimate_cost(opt_30b(), {512, 32}, p, hw);
    const CostEstimate b = estimate_cost(opt_30b(), {512, 32}, pc, hw);
    // The GPU also holds one layer dequantised, so its peak may not shrink when no weights
    // stream through it; CPU and disk hold only packed data.
    EXPECT_LE(b.peak.cpu(), a.peak.cpu()) << text;
    EXPECT_LE(b.peak.disk, a.peak.disk) << text;
    EXPECT_LE(b.decode.ctog + b.decode.dtoc, a.decode.ctog + a.decode.dtoc) << text;
  }
}

TEST(CostModel, MoreWeightsOnGpuNeverIncreaseCtog) {
  const HardwareSpec hw = HardwareSpec::flexgen_t4();
  double last_pre = INFINITY, last_gen = INFINITY;
  for (int wg = 0; wg <= 100; wg += 5) {
    const Policy p = Policy::parse(
        fmt::format("gbs=48,ngb=3,w={}/{}/0,c=0/100/0,h=0/100/0,cpu_attn=1", wg, 100 - wg));
    const CostEstimate c = estimate_cost(opt_30b(), {512, 32}, p, hw);
    EXPECT_LE(c.prefill.ctog, last_pre) << p.str();
    EXPECT_LE(c.decode.ctog, last_gen) << p.str();
    last_pre = c.prefill.ctog, last_gen = c.decode.ctog;
  }
}

TEST(CostModel, MovingDataFromDiskToCpuNeverIncreasesDiskTraffic) {
  const HardwareSpec hw = HardwareSpec::flexgen_t4();
  double last = INFINITY;
  for (int wc = 0; wc <= 100; wc += 10) {
    const Policy p = Policy::parse(fmt::format(
        "gbs=32,ngb=8,w=0/{}/{},c=0/{}/{},h=0/100/0,cpu_attn=1", wc, 100 - wc, wc, 100 - wc));
    const CostEstimate c = estimate_cost(opt_30b(), {512, 32}, p, hw);
    EXPECT_LE(c.decode.dtoc, last) << p.str();
    last = c.decode.dtoc;
  }
  EXPECT_EQ(last, 0);
}

TEST(CostModel, MoreCacheOnGpuGrowsGpuMemoryAndShrinksCpuMemory) {
  const HardwareSpec hw = HardwareSpec::flexgen_t4();
  const auto at = [&](int cg) {
    return estimate_cost(opt_30b(), {512, 32},
                         Policy::parse(fmt::format("gbs=4,ngb=2,w=0/100/0,c={}/{}/0,"
                                                   "h=0/100/0,cpu_attn=1",
                                                   cg, 100 - cg)),
                         hw);
  };
  EXPECT_LT(at(0).peak.gpu(), at(50).peak.gpu());
  EXPECT_GT(at(0).peak.cpu(), at(50).peak.cpu());
  EXPECT_GT(at(0).decode.cpu_comp, at(50).decode.cpu_comp);
}

TEST(CostModel, PerfectOverlapIsNeverSlowerThanFittedOrSerial) {
  HardwareSpec hw = HardwareSpec::flexgen_t4();
  for (const char* text : {"gbs=48,ngb=3,w=20/80/0,c=0/100/0,h=0/100/0,cpu_attn=1",
                           "gbs=32,ngb=8,w=0/50/50,c=0/0/100,h=0/100/0,cpu_attn=1",
                           "gbs=8,ngb=1,w=0/100/0,c=100/0/0,h=100/0/0,cpu_attn=0"}) {
    Policy p = Policy::parse(text);
    hw.overlap_model = OverlapModel::kPaper;
    const double paper = estimate_cost(opt_30b(), {512, 32}, p, hw).total_time;
    hw.overlap_model = OverlapModel::kFitted;
    const double fitted = estimate_cost(opt_30b(), {512, 32}, p, hw).total_time;
    p.overlap = false;
    const double serial = estimate_cost(opt_30b(), {512, 32}, p, hw).total_time;
    EXPECT_LE(paper, fitted) << text;
    EXPECT_LE(fitted, serial) << text;
  }
}

TEST(CostModel, CpuAttentionKeepsTheCacheOffTheLink) {
  const HardwareSpec hw = HardwareSpec::flexgen_t4();
  const Policy on = Policy::parse("gbs=48,ngb=3,w=20/80/0,c=0/100/0,h=0/100/0,cpu_attn=1,cf16=1");
  Policy off = on;
  off.cpu_cache_compute = false;
  const CostEstimate a = estimate_cost(opt_30b(), {512, 32}, on, hw);
  const CostEstimate b = estimate_cost(opt_30b(), {512, 32}, off, hw);
  // §4.2: attending on the CPU moves b h1 activations instead of b s h1 cache; s = 512.
  const double cache = 4.0 * 144 * (512 + 16) * 7168;
  EXPECT_NEAR(b.decode.ctog - a.decode.ctog, cache / hw.ctog_bdw, 1e-9);
  EXPECT_EQ(b.decode.cpu_comp, 0);
  EXPECT_GT(a.decode.cpu_comp, 0);
}

TEST(CostModel, CpuFlopsSlowDownForSmallGpuBatchesAsFlexGenFitted) {
  const HardwareSpec hw = HardwareSpec::flexgen_t4();
  EXPECT_DOUBLE_EQ(hw.cpu_flops_for(64, 7168), hw.cpu_flops);
  EXPECT_DOUBLE_EQ(hw.cpu_flops_for(8, 7168), hw.cpu_flops * (1 - 0.0328 * 3));
  EXPECT_DOUBLE_EQ(hw.cpu_flops_for(16, 1024),
                   hw.cpu_flops * (1 + 0.0168 * 4 - 0.0328 * 2 - 0.0621 * 2));
  HardwareSpec steep = hw;
  steep.cpu_flops_c2 = 0.5;
  EXPECT_DOUBLE_EQ(steep.cpu_flops_for(1, 7168), hw.cpu_flops * 0.1);  // floored: 1 - 0.5 * 6
  HardwareSpec off = hw;
  off.cpu_flops_c1 = off.cpu_flops_c2 = off.cpu_flops_c3 = 0;
  EXPECT_DOUBLE_EQ(off.cpu_flops_for(1, 64), hw.cpu_flops);
}

// FlexGen's Table 21 / 23 (T4, OPT-30B, prompt 512, 32 tokens), the runs that keep
// everything in CPU memory, with FlexGen's f16 cache (cf16=1); the disk rows ran under
// pagecache management and the model's fitted disk bandwidth does not reproduce them.
TEST(CostModel, ReproducesFlexGensMeasuredOpt30bRuns) {
  const HardwareSpec hw = HardwareSpec::flexgen_t4();
  struct Row {
    const char* policy;
    double measured;
    double tolerance;
  };
  const Row rows[] = {
      {"gbs=48,ngb=3,w=20/80/0,c=0/100/0,h=0/100/0,cpu_attn=1,cf16=1", 7.32, 0.05},
      {"gbs=48,ngb=3,w=0/100/0,c=0/100/0,h=0/100/0,cpu_attn=1,cf16=1", 7.26, 0.10},
      {"gbs=48,ngb=1,w=20/80/0,c=0/100/0,h=0/100/0,cpu_attn=1,cf16=1", 5.40, 0.05},
      {"gbs=48,ngb=3,w=20/80/0,c=0/100/0,h=0/100/0,cpu_attn=1,cf16=1,overlap=0", 5.86, 0.05},
  };
  double predicted[4];
  for (int i = 0; i < 4; ++i) {
    const CostEstimate c = estimate_cost(opt_30b(), {512, 32}, Policy::parse(rows[i].policy), hw);
    predicted[i] = c.throughput;
    fmt::print("  {:70s} FlexGen measured {:.2f} token/s, model {:.3f}\n", rows[i].policy,
               rows[i].measured, c.throughput);
    EXPECT_TRUE(c.fits(hw)) << c.str();
    EXPECT_NEAR(c.throughput, rows[i].measured, rows[i].tolerance * rows[i].measured) << c.str();
  }
  // The order FlexGen measured: the searched policy beats "no policy search", which beats
  // one GPU batch and no overlap.
  EXPECT_GT(predicted[0], predicted[1]);
  EXPECT_GT(predicted[1], predicted[3]);
  EXPECT_GT(predicted[3], predicted[2]);
}

TEST(CostModel, Opt30bPaperPolicyIsComputeBound) {
  const CostEstimate c =
      estimate_cost(opt_30b(), {512, 32},
                    Policy::parse("gbs=48,ngb=3,w=20/80/0,c=0/100/0,h=0/100/0,cpu_attn=1,cf16=1"),
                    HardwareSpec::flexgen_t4());
  EXPECT_EQ(c.prefill.bottleneck, "comp");
  EXPECT_EQ(c.prefill.binding, "comp");
  EXPECT_EQ(c.decode.bottleneck, "comp");
  EXPECT_EQ(c.decode.binding, "ctog+comp");
  EXPECT_LE(c.peak.gpu(), 16 * kGiB);  // FlexGen ran it on a 16 GB T4
  EXPECT_LE(c.peak.cpu(), 208 * kGiB);
  EXPECT_EQ(c.peak.disk, 0);
  EXPECT_TRUE(c.memory_shortfalls(HardwareSpec::flexgen_t4()).empty());
}

TEST(CostModel, ShortfallsNameTheTierAndTheBudget) {
  HardwareSpec hw = HardwareSpec::flexgen_t4();
  hw.cpu_mem = 100 * kGiB;
  const CostEstimate c = estimate_cost(
      opt_30b(), {512, 32},
      Policy::parse("gbs=48,ngb=3,w=20/80/0,c=0/100/0,h=0/100/0,cpu_attn=1,cf16=1"), hw);
  const auto lines = c.memory_shortfalls(hw);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0], fmt::format("CPU memory: needs {} (prefill) but cpu_mem is 100.0 GiB "
                                  "(short by {})",
                                  format_gib(c.peak.cpu()), format_gib(c.peak.cpu() - 100 * kGiB)));
  EXPECT_FALSE(c.fits(hw));
}

TEST(CostModel, PrintsItselfAndConvertsToJson) {
  const Policy p = Policy::parse("gbs=48,ngb=3,w=20/80/0,c=0/100/0,h=0/100/0,cpu_attn=1,cf16=1");
  const CostEstimate c = estimate_cost(opt_30b(), {512, 32}, p, HardwareSpec::flexgen_t4());
  const nlohmann::json j = c.to_json();
  EXPECT_EQ(j["policy"], p.compact());
  EXPECT_EQ(j["block_size"], 144);
  EXPECT_DOUBLE_EQ(j["throughput_token_s"].get<double>(), c.throughput);
  EXPECT_DOUBLE_EQ(j["decode_per_layer"]["cpu_comp_s"].get<double>(), c.decode.cpu_comp);
  EXPECT_EQ(j["prefill_per_layer"]["bottleneck"], "comp");
  EXPECT_DOUBLE_EQ(j["peak_memory_bytes"]["cpu_decode"].get<double>(), c.peak.cpu_decode);
  const std::string s = c.str();
  EXPECT_NE(s.find(p.str()), std::string::npos) << s;
  EXPECT_NE(s.find(fmt::format("throughput={:.3f} token/s", c.throughput)), std::string::npos) << s;
}

TEST(CostModel, RejectsBadInput) {
  const HardwareSpec hw = HardwareSpec::flexgen_t4();
  EXPECT_THROW(estimate_cost(opt_30b(), {0, 32}, Policy{}, hw), InputError);
  EXPECT_THROW(estimate_cost(opt_30b(), {512, 0}, Policy{}, hw), InputError);
  Policy bad;
  bad.w_cpu_percent = 50;  // 100 + 50
  EXPECT_THROW(estimate_cost(opt_30b(), {512, 32}, bad, hw), InputError);
  HardwareSpec zero = hw;
  zero.ctog_bdw = 0;
  EXPECT_THROW(estimate_cost(opt_30b(), {512, 32}, Policy{}, zero), InputError);
}

// ---- hardware spec -----------------------------------------------------------------

TEST(HardwareSpec, T4PresetHasFlexGensFittedConstantsInBinaryUnits) {
  const HardwareSpec h = HardwareSpec::flexgen_t4();
  EXPECT_EQ(h.gpu_mem, 16 * kGiB);
  EXPECT_EQ(h.cpu_mem, 208 * kGiB);
  EXPECT_EQ(h.disk_mem, 1500 * kGiB);
  EXPECT_DOUBLE_EQ(h.ctog_bdw, 12.89 * kGiB);
  EXPECT_DOUBLE_EQ(h.gtoc_bdw_cache, 0.97 * kGiB);
  EXPECT_DOUBLE_EQ(h.gtoc_bdw_hidden, 4.82 * kGiB);
  EXPECT_DOUBLE_EQ(h.dtoc_bdw, 0.473 * kGiB);
  EXPECT_DOUBLE_EQ(h.ctod_bdw_cache_prefill, 0.746 * kGiB);
  EXPECT_DOUBLE_EQ(h.ctod_bdw_other, 2.015 * kGiB);
  EXPECT_DOUBLE_EQ(h.mm_flops_prefill, 21.24e12);
  EXPECT_DOUBLE_EQ(h.mm_flops_decode, 4.3e12);
  EXPECT_DOUBLE_EQ(h.bmm_flops_prefill, 9.97e12);
  EXPECT_DOUBLE_EQ(h.bmm_flops_decode, 0.079e12);
  EXPECT_DOUBLE_EQ(h.cpu_flops, 0.0123e12);
  EXPECT_EQ(h.overlap_model, OverlapModel::kFitted);
  EXPECT_NO_THROW(h.validate("preset"));
}

class HardwareFile : public ::testing::Test {
 protected:
  std::filesystem::path dir = std::filesystem::path(STRATA_TEST_TMP) / "hardware";
  void SetUp() override { std::filesystem::create_directories(dir); }
  std::string write(const std::string& name, const std::string& text) {
    const std::string path = (dir / name).string();
    std::ofstream(path) << text;
    return path;
  }
  std::string load_error(const std::string& path) {
    try {
      HardwareSpec::load(path);
    } catch (const InputError& e) {
      return e.what();
    }
    return "(no error)";
  }
  std::string edited(const char* field, const nlohmann::json& value) {
    nlohmann::json j = HardwareSpec::flexgen_t4().to_json();
    j[field] = value;
    return write(std::string(field) + ".json", j.dump());
  }
};

TEST_F(HardwareFile, SaveThenLoadRoundTrips) {
  HardwareSpec h = HardwareSpec::flexgen_t4();
  h.overlap_model = OverlapModel::kPaper;
  const std::string path = (dir / "t4.json").string();
  h.save(path);
  EXPECT_EQ(HardwareSpec::load(path).to_json(), h.to_json());
  EXPECT_EQ(h.to_json()["overlap_model"], "paper");
}

TEST_F(HardwareFile, ErrorsNameTheFileAndTheField) {
  nlohmann::json j = HardwareSpec::flexgen_t4().to_json();
  j.erase("dtoc_bdw");
  const std::string missing = write("missing.json", j.dump());
  EXPECT_EQ(load_error(missing), missing + ": hardware field 'dtoc_bdw' (bytes/s) is missing");

  const std::string text = edited("ctog_bdw", "fast");
  EXPECT_EQ(load_error(text),
            text + ": hardware field 'ctog_bdw' must be a number (bytes/s), got string \"fast\"");

  const std::string negative = edited("gpu_mem", -1);
  EXPECT_EQ(load_error(negative),
            negative + ": hardware field 'gpu_mem' must be a positive number (bytes), got -1");

  EXPECT_NO_THROW(HardwareSpec::load(edited("cpu_flops_c1", 0)));

  const std::string unknown = edited("gpu_mam", 1);
  EXPECT_NE(load_error(unknown).find(unknown + ": unknown hardware field 'gpu_mam'"),
            std::string::npos);

  const std::string model = edited("overlap_model", "perfect");
  EXPECT_EQ(load_error(model), model +
                                   ": hardware field 'overlap_model' must be \"paper\" or "
                                   "\"fitted\", got \"perfect\"");
}

TEST_F(HardwareFile, RejectsFilesThatAreNotASpec) {
  const std::string array = write("array.json", "[1, 2]");
  EXPECT_NE(load_error(array).find(array + ": hardware spec must be a JSON object"),
            std::string::npos);
  const std::string broken = write("broken.json", "{\"gpu_mem\": ");
  EXPECT_NE(load_error(broken).find(broken + ": not valid JSON"), std::string::npos);
  const std::string absent = (dir / "absent.json").string();
  EXPECT_EQ(load_error(absent), absent + ": cannot open hardware spec file");
}

}  // namespace
}  // namespace strata
