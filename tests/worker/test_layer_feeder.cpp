// Weights fed to a compute device from three tiers (layer_feeder.h): whatever the split over
// GPU / CPU / disk and with prefetch on or off, generation equals the all-resident run token
// for token. Built twice: with the CPU backend standing in for the device (every CI run;
// transfers are plain copies, so the schedule's bookkeeping is what is tested) and, as the
// `gpu` label, with the CUDA backend where a GPU is present.
#include <gtest/gtest.h>

#include "coordinator/local_stages.h"
#include "kernels/cpu_backend.h"
#include "kernels/error.h"
#include "support/stories_reference.h"
#include "support/test_device.h"
#include "worker/loader.h"
#include "worker/scoring.h"

namespace strata {
namespace {

std::string disk_dir() {
  return testing::test_tmp_dir("layer_feeder");
}

struct FeedRun {
  std::vector<std::vector<int32_t>> outputs;
  FeedStats feed;
  WeightPlacement placement;
  int64_t layer_bytes = 0;  // as the feeder packs it
};

std::vector<GenerationRequest> requests_for(const std::string& model, int32_t vocab) {
  std::vector<GenerationRequest> reqs;
  if (model == testing::stories_dir()) {
    for (const auto& r : testing::load_stories_references())
      reqs.push_back({r.name, r.prompt_ids, static_cast<int32_t>(r.output_ids.size()), {}, false});
    return reqs;
  }
  // Dummy weights: mixed prompt lengths and budgets; ids spread over the vocabulary.
  for (int32_t i = 0; i < 4; ++i) {
    std::vector<int32_t> prompt;
    for (int32_t t = 0; t < 3 + 5 * i; ++t) prompt.push_back((17 + 131 * t + 7 * i) % vocab);
    reqs.push_back({fmt::format("r{}", i), prompt, 4 + 3 * i, {}, true});
  }
  return reqs;
}

// Generates with the model's weights placed by the shares (wg, wc) and the cache as `cache`.
FeedRun generate(Backend& device, const std::string& model, int wg, int wc, bool overlap,
                 CacheOptions cache = {}, int32_t gpu_batch_size = 0, bool compress = false) {
  LoadOptions lo;
  lo.device = &device;
  lo.dummy_dtype = DType::kF16;
  lo.disk_dir = disk_dir();
  lo.overlap = overlap;
  lo.w_gpu_percent = wg;
  lo.w_cpu_percent = wc;
  lo.compress_weight = compress;
  LoadedModel m = load_model(model, lo);
  FeedRun run;
  run.placement = m.placement;
  Model engine(m.config, std::move(m.weights), device, 64, nullptr, std::move(m.feeder));
  CpuBackend host(2);
  cache.host = &host;
  cache.placement.disk_dir = disk_dir();
  engine.set_cache_options(cache);
  engine.set_gpu_batch_size(gpu_batch_size);
  LocalCluster gen(engine, LocalOptions{gpu_batch_size > 0 ? 4 : 3, 64, 0});
  for (const auto& res : gen.run(requests_for(model, m.config.vocab))) {
    EXPECT_TRUE(res.error.empty()) << res.error;
    run.outputs.push_back(res.output_ids);
  }
  run.feed = engine.feeder()->stats();
  run.layer_bytes = static_cast<int64_t>(engine.feeder()->layer_bytes());
  return run;
}

class LayerFeederTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    device_ = testing::make_test_device();
    if (!device_) GTEST_SKIP() << "no CUDA device";
  }
  std::unique_ptr<Backend> device_;
};

TEST_P(LayerFeederTest, EveryWeightSplitGivesTheAllResidentOutput) {
  const std::string model = GetParam();
  const FeedRun resident = generate(*device_, model, 100, 0, true);
  EXPECT_EQ(resident.feed.layers_from_cpu + resident.feed.layers_from_disk, 0);
  if (model == testing::stories_dir()) {
    const auto refs = testing::load_stories_references();
    for (size_t i = 0; i < refs.size(); ++i)
      EXPECT_EQ(resident.outputs[i], refs[i].output_ids) << refs[i].name;
  }
  struct Split {
    int wg, wc;
    bool overlap;
  };
  std::vector<Split> splits{{0, 50, true}, {20, 40, false}};
  // Every split on the small model (and on a GPU); two on the dummy one, whose CPU runs are slow.
  if (model == testing::stories_dir() || device_->device() == Device::kCuda) {
    splits.clear();
    for (bool overlap : {true, false})
      for (auto [wg, wc] : {std::pair{0, 100}, {0, 0}, {40, 40}, {20, 40}, {60, 0}})
        splits.push_back({wg, wc, overlap});
  }
  for (Split s : splits) {
    {
      const bool overlap = s.overlap;
      const FeedRun r = generate(*device_, model, s.wg, s.wc, overlap);
      const std::string what = fmt::format("w={}/{}/{} overlap {} ({})", s.wg, s.wc,
                                           100 - s.wg - s.wc, overlap, r.placement.str());
      EXPECT_EQ(r.outputs, resident.outputs) << what;
      EXPECT_EQ(r.feed.layers_from_cpu > 0, r.placement.count(Tier::kCpu) > 0) << what;
      EXPECT_EQ(r.feed.layers_from_disk > 0, r.placement.count(Tier::kDisk) > 0) << what;
      EXPECT_EQ(r.feed.bytes_from_cpu, r.feed.layers_from_cpu * r.layer_bytes) << what;
      EXPECT_NEAR(static_cast<double>(r.placement.layer_bytes), static_cast<double>(r.layer_bytes),
                  0.01 * static_cast<double>(r.layer_bytes))
          << "the placement's estimate of a layer's size";
    }
  }
}

TEST_P(LayerFeederTest, EveryCachePlacementGivesTheOnDeviceOutput) {
  // The cache off the device: attended on the host (delegation) or copied to the device
  // around each attention; on disk it round-trips through the file every layer.
  const std::string model = GetParam();
  const FeedRun resident = generate(*device_, model, 100, 0, true);
  struct Split {
    int cg, cc;
    bool cpu_attention;
  };
  for (Split s : {Split{0, 100, true}, Split{0, 100, false}, Split{0, 0, true},
                  Split{40, 30, false}, Split{20, 40, true}}) {
    CacheOptions cache;
    cache.placement.gpu_percent = s.cg;
    cache.placement.cpu_percent = s.cc;
    cache.cpu_attention = s.cpu_attention;
    const FeedRun r = generate(*device_, model, 50, 50, true, cache);
    EXPECT_EQ(r.outputs, resident.outputs)
        << cache.placement.str() << " cpu attention " << s.cpu_attention;
    if (model != testing::stories_dir() && device_->device() != Device::kCuda)
      break;  // slow on the CPU
  }
}

TEST_P(LayerFeederTest, SeveralGpuBatchesPerBlockGiveTheSameOutput) {
  // Zig-zag: a block of 4 sequences as 4, 2 or 1 GPU batches (weights fetched once per layer
  // for the whole block), with streamed weights and the cache off the device.
  const std::string model = GetParam();
  const FeedRun one = generate(*device_, model, 100, 0, true);
  CacheOptions cache;
  cache.placement = {50, 50, disk_dir()};
  cache.cpu_attention = true;
  for (int32_t gbs : {1, 2}) {
    const FeedRun r = generate(*device_, model, 20, 50, true, cache, gbs);
    EXPECT_EQ(r.outputs, one.outputs) << "GPU batch " << gbs;
    if (model != testing::stories_dir() && device_->device() != Device::kCuda)
      break;  // slow on the CPU
  }
}

TEST_P(LayerFeederTest, CompressedWeightsGiveTheSameOutputInEveryTier) {
  // 4-bit weights are stored packed in every tier (device, pinned host, disk) and
  // dequantised just before use, so where they live changes nothing.
  const std::string model = GetParam();
  const FeedRun resident = generate(*device_, model, 100, 0, true, {}, 0, true);
  for (auto [wg, wc] : {std::pair{0, 50}, {20, 40}}) {
    const FeedRun r = generate(*device_, model, wg, wc, true, {}, 0, true);
    EXPECT_EQ(r.outputs, resident.outputs) << r.placement.str();
    EXPECT_EQ(r.feed.bytes_from_cpu, r.feed.layers_from_cpu * r.layer_bytes);
    EXPECT_NEAR(static_cast<double>(r.placement.layer_bytes), static_cast<double>(r.layer_bytes),
                0.01 * static_cast<double>(r.layer_bytes));
    if (model != testing::stories_dir() && device_->device() != Device::kCuda)
      break;  // slow on the CPU
  }
}

TEST_P(LayerFeederTest, CompressedCacheGivesTheSameOutputWhereverItLives) {
  // A 4-bit cache on the device, in host memory (CPU attention or staged) or on disk.
  const std::string model = GetParam();
  if (model != testing::stories_dir() && device_->device() != Device::kCuda)
    GTEST_SKIP() << "the dummy model's runs are slow on the CPU; stories260K covers the paths";
  CacheOptions on_device;
  on_device.placement.compress = true;
  const FeedRun ref = generate(*device_, model, 100, 0, true, on_device);
  struct Split {
    int cg, cc;
    bool cpu_attention;
  };
  for (Split s : {Split{0, 100, true}, Split{0, 100, false}, Split{30, 30, true}}) {
    CacheOptions cache;
    cache.placement.gpu_percent = s.cg;
    cache.placement.cpu_percent = s.cc;
    cache.placement.compress = true;
    cache.cpu_attention = s.cpu_attention;
    const FeedRun r = generate(*device_, model, 100, 0, true, cache);
    EXPECT_EQ(r.outputs, ref.outputs)
        << cache.placement.str() << " cpu attention " << s.cpu_attention;
  }
}

TEST_P(LayerFeederTest, WithoutOverlapEachStreamedLayerLoadsOncePerStep) {
  const std::string model = GetParam();
  LoadOptions lo;
  lo.device = device_.get();
  lo.dummy_dtype = DType::kF16;
  lo.disk_dir = disk_dir();
  lo.overlap = false;
  lo.w_gpu_percent = 0;
  lo.w_cpu_percent = 50;
  LoadedModel m = load_model(model, lo);
  const int32_t streamed = m.placement.count(Tier::kCpu) + m.placement.count(Tier::kDisk);
  Model engine(m.config, std::move(m.weights), *device_, 16, nullptr, std::move(m.feeder));
  KvCache cache(*device_, m.config, 1, 16);
  StepBatch b;
  const std::vector<int32_t> prompt{1, 2, 3};
  b.add(0, 0, prompt, true);
  std::vector<float> logits(static_cast<size_t>(m.config.vocab));
  for (int step = 1; step <= 3; ++step) {
    engine.forward(b, cache, logits.data());
    const FeedStats f = engine.feeder()->stats();
    EXPECT_EQ(f.layers_from_cpu + f.layers_from_disk, step * streamed);
    b.clear();
    const std::vector<int32_t> next{4};
    b.add(0, 2 + step, next, true);
  }
}

INSTANTIATE_TEST_SUITE_P(Models, LayerFeederTest,
                         ::testing::Values(testing::stories_dir(), std::string("dummy:opt-125m")),
                         [](const auto& p) {
                           return p.index == 0 ? std::string("stories260K")
                                               : std::string("opt125m");
                         });

}  // namespace
}  // namespace strata
