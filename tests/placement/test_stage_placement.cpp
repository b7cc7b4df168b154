// The accelerator backend's kernel scratch in the stage's memory model, by hand for OPT-125m's
// shape (hidden 768, ffn 3072, vocab 50272): the CUDA backend rounds x to f16 for every
// half-precision or 4-bit linear (rows x the widest input) and dequantises a 4-bit matrix to
// f16 before its GEMM (the largest: fc1 / fc2, 3072 x 768). The planner counts it against
// the GPU budget; host compute has none.
#include <gtest/gtest.h>

#include "kernels/error.h"
#include "placement/hetegen.h"
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
// halved): q, k, v, o [768, 768] put 384 rows in the alpha share, 384 x 768 x 2 = 589824 bytes
// each; fc1 [3072, 768] 1536 rows and fc2 [768, 3072] 384 rows, 2359296 bytes each; the
// biases' halves 4 x 384 x 4 + 1536 x 4 + 384 x 4 = 13824. The alpha shares packed are those
// 7091712 bytes page-aligned, 7094272 (1732 pages), pinned in host memory and streamed
// through two device slots of that size; the CPU shares are the other 7091712 bytes; the four
// LayerNorm vectors of 768 f32 packed, 12288 (three pages), stay on the device.
TEST(StagePlacement, HeteGenSplitByHand) {
  StageRequest streamed = device_stage("w=0/100/0");
  StageRequest split = streamed;
  split.hetegen_alpha = 0.5;
  const StagePlacement s = place_stage(opt125m(DType::kF16), streamed);
  const StagePlacement p = place_stage(opt125m(DType::kF16), split);
  const int64_t shares = 4 * 589824 + 2 * 2359296 + 13824;
  const int64_t packed = 1732 * 4096;
  EXPECT_EQ(p.weights.split_layers(), 12);
  EXPECT_EQ(p.weights.streamed_layers(), 0);
  EXPECT_EQ(p.weights.split_gpu_bytes, 12288);
  EXPECT_EQ(p.weights.split_stream_bytes, packed);
  EXPECT_EQ(p.weights.split_stream_total(), 12 * packed);
  EXPECT_EQ(p.weights.host_layer_bytes, shares + packed);
  EXPECT_EQ(s.weights.split_layers(), 0);
  EXPECT_EQ(s.weights.streamed_layers(), 12);
  // Two device slots of the packed shares. The staging: x [64, 3072] and the CPU output
  // [64, 3072] in host memory, both shares [64, 3072] on the device.
  EXPECT_EQ(p.weights.device_staging_bytes, 2 * packed);
  EXPECT_EQ(p.weights.gpu_bytes(), s.weights.fixed_bytes + 12 * 12288 + 2 * packed);
  EXPECT_EQ(p.weights.cpu_bytes(), 12 * (shares + packed));
  EXPECT_EQ(p.compute_workspace_bytes - s.compute_workspace_bytes, 64 * 3072 * 4);
  EXPECT_EQ(p.host_workspace_bytes - s.host_workspace_bytes, 64 * (3072 + 3072) * 4);
}

TEST(StagePlacement, HeteGenWholeModulesMoveToTheDevice) {
  // The module scheduler's choice for layer 3: fc1 and fc2 whole on the device (2 x 4718592
  // bytes and their biases 12288 + 3072, beside the norms), out of the streamed shares and the
  // CPU's; every other layer as before.
  StageRequest r = device_stage("w=0/100/0");
  r.hetegen_alpha = 0.5;
  const WeightPlacement plain = place_weights(opt125m(DType::kF16), r);
  r.hetegen_whole.assign(12 * hetegen::kModuleSlots, 0);
  r.hetegen_whole[3 * hetegen::kModuleSlots + 5] = 1;  // up (fc1)
  r.hetegen_whole[3 * hetegen::kModuleSlots + 6] = 1;  // down (fc2)
  const WeightPlacement p = place_weights(opt125m(DType::kF16), r);
  const int64_t attn_shares = 4 * 589824 + 4 * 1536;  // page-aligned: 2365440 -> 578 pages
  EXPECT_EQ(p.split[3].gpu, 12288 + 2 * 4718592 + 12288 + 3072 + 1024);  // page-aligned
  EXPECT_EQ(p.split[3].stream, 578 * 4096);
  EXPECT_EQ(p.split[3].host, attn_shares + 578 * 4096);
  EXPECT_EQ(p.split[2].gpu, plain.split_gpu_bytes);
  EXPECT_EQ(p.gpu_bytes() - plain.gpu_bytes(), p.split[3].gpu - 12288);
  EXPECT_EQ(p.split_stream_total(),
            plain.split_stream_total() - plain.split_stream_bytes + 578 * 4096);
  r.hetegen_whole.pop_back();
  EXPECT_THROW(place_weights(opt125m(DType::kF16), r), InputError);
}

TEST(StagePlacement, HeteGenFillsTheGpuBudgetAroundTheSplitLayers) {
  // A --gpu-mem of the fixed tensors, 4 whole layers, 8 split ones' norms and two slots of
  // alpha shares: 4 on the GPU, 8 split, and it fits to the byte; one byte less and a layer
  // moves to the split side.
  StageRequest r;
  r.device_compute = true;
  const WeightPlacement whole = place_weights(opt125m(DType::kF16), r);
  r.hetegen_alpha = 0.3;
  const WeightPlacement all_split = place_weights(opt125m(DType::kF16), r);
  const int64_t S = all_split.split_gpu_bytes, X = all_split.split_stream_bytes;
  ASSERT_LT(S, whole.layer_bytes);
  r.budgets.gpu = whole.fixed_bytes + 4 * whole.layer_bytes + 8 * S + 2 * X;
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

// Pie (StageRequest::pie): opt-125m's 12 layers, 4 slots x 128 positions x 768 f32 = 1.5 MiB
// per K or V (a whole number of 256-byte blocks, so a buffer is exactly K + V). Fixed m = 4:
// the device keeps 8 buffers, the host 6; adaptive in [2, 9]: the device 10, the host 11.
TEST(StagePlacement, PieCountsItsBuffers) {
  const int64_t layer = 4 * 128 * 768 * 4;
  StageRequest r = device_stage("w=100/0/0,c=100/0/0");
  const StagePlacement whole = place_stage(opt125m(DType::kF16), r);
  EXPECT_EQ(whole.cache_bytes(), (TierBytes{12 * 2 * layer, 0, 0}));
  r.pie = PieHostLayers{4, 4};
  const StagePlacement fixed = place_stage(opt125m(DType::kF16), r);
  EXPECT_EQ(fixed.cache_bytes(), (TierBytes{8 * 2 * layer, 6 * 2 * layer, 0})) << fixed.str();
  EXPECT_EQ(whole.total().gpu - fixed.total().gpu, 4 * 2 * layer);
  r.pie = PieHostLayers{2, 9};
  EXPECT_EQ(place_stage(opt125m(DType::kF16), r).cache_bytes(),
            (TierBytes{10 * 2 * layer, 11 * 2 * layer, 0}));
}

TEST(StagePlacement, PieRefusals) {
  auto refusal = [](const StageRequest& r) {
    try {
      place_stage(opt125m(DType::kF16), r);
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  StageRequest r = device_stage("w=100/0/0,c=50/50/0");
  r.pie = PieHostLayers{2, 2};
  EXPECT_NE(refusal(r).find("the policy 'w=100/0/0,c=50/50/0"), std::string::npos) << refusal(r);
  r = device_stage("w=100/0/0,c=100/0/0");
  r.pie = PieHostLayers{2, 2};
  r.device_compute = false;
  EXPECT_NE(refusal(r).find("it needs device compute"), std::string::npos) << refusal(r);
  r.device_compute = true;
  r.pie = PieHostLayers{12, 12};  // every layer on the host
  EXPECT_NE(refusal(r).find("Pie buffers"), std::string::npos) << refusal(r);
}

// An f16 cache (policy cf16): K or V of a layer is slots x capacity x kv width x 2 bytes, half
// the f32 cache's, in every tier. With device compute it may live on the GPU tier and be
// attended there, or off it and be attended on the host or staged to the device.
TEST(StagePlacement, HalfCacheByHandInEveryTier) {
  const int64_t f32_layer = 4 * 128 * 768 * 4;
  StageRequest r = device_stage("w=100/0/0,c=0/100/0,cpu_attn=1,cf16=1");
  const StagePlacement half = place_stage(opt125m(DType::kF16), r);
  EXPECT_TRUE(half.cache.f16);
  EXPECT_EQ(half.cache.layer_bytes, f32_layer / 2);
  EXPECT_EQ(half.cache_bytes(), (TierBytes{0, 12 * f32_layer, 0})) << half.str();
  EXPECT_NE(half.cache.str().find("KvPlacement(f16"), std::string::npos) << half.cache.str();
  r.device_compute = false;  // host compute: the "GPU" tier is host memory
  r.policy = Policy::parse("cf16=1");
  EXPECT_EQ(place_stage(opt125m(DType::kF16), r).cache_bytes(), (TierBytes{0, 12 * f32_layer, 0}));
  // Device compute: half the layers on the GPU, half in host memory (K and V of a layer are
  // f32_layer together).
  for (const char* policy : {"c=50/50/0,cpu_attn=1,cf16=1", "c=50/50/0,cpu_attn=0,cf16=1"}) {
    const StagePlacement p = place_stage(opt125m(DType::kF16), device_stage(policy));
    EXPECT_EQ(p.cache_bytes(), (TierBytes{6 * f32_layer, 6 * f32_layer, 0})) << policy;
  }
}

// Mistral-7B's shape: 32 layers, 8 KV heads of 128, a 4096-position window on every layer.
ModelShape mistral7b(int64_t cache_window) {
  ModelShape s;
  s.hidden = 4096;
  s.intermediate = 14336;
  s.n_layers = 32;
  s.n_heads = 32;
  s.n_kv_heads = 8;
  s.head_dim = 128;
  s.vocab = 32000;
  s.max_positions = 32768;
  s.gated_mlp = true;
  s.dtype = DType::kF16;
  s.weight_bytes_per_elem = 2;
  s.embed_dim = 4096;
  s.cache_window = cache_window;
  return s;
}

TEST(StagePlacement, SlidingWindowBoundsTheCacheByHand) {
  // 4 slots of a 32768-position context, steps of 512 rows: a slot holds
  // W - 1 + C + ceil(W / 8) = 4095 + 512 + 512 = 5119 rows, K or V of a layer
  // 4 x 5119 x 8 x 128 x 4 bytes (f32), not 4 x 32768 x ...
  StageRequest r;
  r.max_rows = 512;
  r.kv_slots = 4;
  r.kv_capacity = 32768;
  const int64_t layer = int64_t{4} * 5119 * 8 * 128 * 4;
  const StagePlacement w = place_stage(mistral7b(4096), r);
  EXPECT_EQ(w.cache.slot_rows, 5119);
  EXPECT_EQ(w.cache.layer_bytes, layer);
  EXPECT_EQ(w.cache_bytes(), (TierBytes{0, 2 * 32 * layer, 0})) << w.str();  // host compute
  // Gemma-2's alternating layers (cache_window 0): every slot holds the context.
  const StagePlacement whole = place_stage(mistral7b(0), r);
  EXPECT_EQ(whole.cache.slot_rows, 32768);
  EXPECT_EQ(whole.cache.layer_bytes, int64_t{4} * 32768 * 8 * 128 * 4);
  // A context the window's rows would cover: nothing to bound.
  r.kv_capacity = 4096;
  EXPECT_EQ(place_stage(mistral7b(4096), r).cache.slot_rows, 4096);
}

}  // namespace
}  // namespace strata
