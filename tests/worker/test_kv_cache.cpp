// The KV cache's tiers on a host-compute engine: whatever share of layers keeps its cache in
// memory or on disk (O_DIRECT round trip per layer), generation equals the reference.
#include <gtest/gtest.h>

#include <filesystem>

#include "kernels/cpu_backend.h"
#include "kernels/error.h"
#include "support/stories_reference.h"
#include "worker/generator.h"
#include "worker/loader.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

std::string disk_dir() {
  const fs::path d = fs::path(STRATA_TEST_TMP) / "kv_cache";
  fs::create_directories(d);
  return d.string();
}

TEST(KvCacheTiers, SharesGoToWholeLayersSpreadEvenly) {
  const std::vector<Tier> t = tiers_from_shares(10, 20, 50, "cache");
  EXPECT_EQ(std::count(t.begin(), t.end(), Tier::kGpu), 2);
  EXPECT_EQ(std::count(t.begin(), t.end(), Tier::kCpu), 5);
  EXPECT_EQ(std::count(t.begin(), t.end(), Tier::kDisk), 3);
  EXPECT_EQ(spread_tiers(4, 0, 0), std::vector<Tier>(4, Tier::kDisk));
  EXPECT_EQ(spread_tiers(4, 4, 0), std::vector<Tier>(4, Tier::kGpu));
  EXPECT_THROW(tiers_from_shares(10, 60, 50, "cache"), InputError);
  EXPECT_THROW(tiers_from_shares(10, -1, 50, "cache"), InputError);
}

TEST(KvCacheTiers, DiskLayerRoundTripsThroughTheFile) {
  CpuBackend backend(1);
  ModelConfig c = load_model_config(testing::stories_dir());
  CachePlacement p;
  p.gpu_percent = 0;
  p.cpu_percent = 0;
  p.disk_dir = disk_dir();
  KvCache cache(backend, c, 2, 8, p);
  ASSERT_EQ(cache.tier(0), Tier::kDisk);
  EXPECT_THROW(cache.layer(0), Error);  // not staged yet
  cache.load(0);
  cache.layer(0).k[5] = 1.5f;
  cache.store(0);
  cache.load(1);  // the staging now holds layer 1 (zeros)
  EXPECT_EQ(cache.layer(1).k[5], 0.0f);
  cache.store(1);
  cache.load(0);
  EXPECT_EQ(cache.layer(0).k[5], 1.5f);
  EXPECT_GT(cache.disk_bytes_moved(), 0);
}

TEST(KvCacheTiers, HostComputeWithTheCacheOnDiskMatchesTheReference) {
  const auto refs = testing::load_stories_references();
  for (auto [cg, cc] : {std::pair{0, 0}, {0, 60}, {30, 30}}) {
    LoadedModel m = load_model(testing::stories_dir());
    CpuBackend backend(2);
    Model model(m.config, std::move(m.weights), backend, 64);
    CacheOptions o;
    o.placement = {cg, cc, disk_dir()};
    model.set_cache_options(o);
    std::vector<GenerationRequest> reqs;
    for (const auto& r : refs)
      reqs.push_back({r.name, r.prompt_ids, static_cast<int32_t>(r.output_ids.size()), {}, false});
    Generator gen(model, GeneratorOptions{3, 64, 0});
    const auto results = gen.run(reqs);
    for (size_t i = 0; i < refs.size(); ++i)
      EXPECT_EQ(results[i].output_ids, refs[i].output_ids)
          << refs[i].name << " " << o.placement.str();
  }
}

TEST(KvCacheTiers, MissingDiskDirIsAnInputError) {
  CpuBackend backend(1);
  CachePlacement p{0, 0, "/nonexistent/strata-kv"};
  EXPECT_THROW(KvCache(backend, load_model_config(testing::stories_dir()), 1, 4, p), InputError);
}

}  // namespace
}  // namespace strata
