// Weights on disk: whatever the split between resident and streamed layers, and with the
// prefetch on or off, generation equals the all-resident run token for token (and the
// logits bit for bit, since the same kernels read the same values).
#include <gtest/gtest.h>

#include <filesystem>

#include "coordinator/run/local_stages.h"
#include "kernels/cpu_backend.h"
#include "kernels/error.h"
#include "support/stories_reference.h"
#include "worker/loader.h"
#include "worker/scoring.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

std::string disk_dir() {
  const fs::path d = fs::path(STRATA_TEST_TMP) / "layer_store";
  fs::create_directories(d);
  return d.string();
}

// A budget that leaves exactly `resident` stories260K layers in memory (the two staging
// buffers cost two layers, so at most 2 of its 5 layers can stay resident with any on disk).
WeightPlacement stories_weights(int64_t cpu_mem) {
  StageRequest r;
  r.budgets.cpu = cpu_mem;
  return place_weights(load_model_config(testing::stories_dir()).shape(), r);
}

int64_t budget_for(int32_t resident) {
  const WeightPlacement all = stories_weights(-1);
  const int64_t staging = 2 * (all.layer_bytes + kPageBytes);
  return all.fixed_bytes + staging + resident * all.host_layer_bytes + all.host_layer_bytes / 2;
}

struct StoriesRun {
  std::vector<std::vector<int32_t>> outputs;
  std::vector<float> logits;
  StreamStats stream;
};

StoriesRun run_stories(int64_t cpu_mem, bool overlap, int32_t expect_disk_layers) {
  LoadOptions lo;
  lo.cpu_mem = cpu_mem;
  lo.disk_dir = disk_dir();
  lo.overlap = overlap;
  LoadedModel m = load_model(testing::stories_dir(), lo);
  EXPECT_EQ(static_cast<int32_t>(m.placement.disk_layers.size()), expect_disk_layers);
  CpuBackend backend(2);
  Model model(m.config, std::move(m.weights), backend, 256, std::move(m.streamer));
  const auto refs = testing::load_stories_references();
  std::vector<GenerationRequest> reqs;
  for (const auto& r : refs)
    reqs.push_back({r.name, r.prompt_ids, static_cast<int32_t>(r.output_ids.size()), {}, false});
  LocalCluster gen(model, LocalOptions{3, 256, 0});
  StoriesRun run;
  for (const auto& res : gen.run(reqs)) run.outputs.push_back(res.output_ids);
  run.logits = teacher_forced_logits(model, refs.front().sequence(), 7);
  if (model.streamer()) run.stream = model.streamer()->stats();
  return run;
}

TEST(LayerStore, EverySplitAndOverlapSettingGivesTheResidentOutput) {
  const StoriesRun resident = run_stories(-1, true, 0);
  const auto refs = testing::load_stories_references();
  for (size_t i = 0; i < refs.size(); ++i)
    EXPECT_EQ(resident.outputs[i], refs[i].output_ids) << refs[i].name;
  for (int32_t kept : {2, 1, 0}) {
    for (bool overlap : {true, false}) {
      const StoriesRun r = run_stories(budget_for(kept), overlap, 5 - kept);
      EXPECT_EQ(r.outputs, resident.outputs) << kept << " resident, overlap " << overlap;
      EXPECT_EQ(r.logits, resident.logits) << kept << " resident, overlap " << overlap;
      EXPECT_GT(r.stream.layers_read, 0);
      EXPECT_EQ(r.stream.bytes_read % static_cast<int64_t>(kDirectAlignment), 0);
    }
  }
}

TEST(LayerStore, DisabledOverlapReadsExactlyTheLayersUsed) {
  // Without prefetch a disk layer is read only when it is needed and not already in one of
  // the two slots, and never ahead of time.
  LoadOptions lo;
  lo.cpu_mem = budget_for(2);
  lo.disk_dir = disk_dir();
  lo.overlap = false;
  LoadedModel m = load_model(testing::stories_dir(), lo);
  // 3 of 5 layers spread evenly: layer i goes to disk when floor((i + 1) * 3 / 5) grows,
  // i.e. at i = 1 (0 -> 1), 3 (1 -> 2) and 4 (2 -> 3).
  ASSERT_EQ(m.placement.disk_layers, (std::vector<int32_t>{1, 3, 4}));
  CpuBackend backend(1);
  Model model(m.config, std::move(m.weights), backend, 64, std::move(m.streamer));
  teacher_forced_logits(model, std::vector<int32_t>{1, 403, 407}, 1);  // three steps
  // By hand, two slots A and B, each step acquiring 1, 3, 4 in order; a layer is read into
  // the slot other than the one handed out last:
  //   constructor: read 1 -> A                                     1 read
  //   step 1: 1 is in A (no read); 3 -> B; 4 -> A                  2 reads
  //   step 2: 1 -> B; 3 -> A; 4 -> B (each evicted just before)    3 reads
  //   step 3: 1 -> A; 3 -> B; 4 -> A                               3 reads
  // 9 in all. A streamer that never reuses a loaded slot reads 1 again in step 1: 10.
  const StreamStats s = model.streamer()->stats();
  EXPECT_EQ(s.layers_read, 9);
  EXPECT_EQ(s.bytes_read, 9 * static_cast<int64_t>(model.streamer()->layout().bytes()));
}

TEST(LayerStore, SpreadsDiskLayersEvenly) {
  EXPECT_EQ(spread_disk_layers(5, 0), std::vector<int32_t>{});
  EXPECT_EQ(spread_disk_layers(5, 5), (std::vector<int32_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(spread_disk_layers(8, 2), (std::vector<int32_t>{3, 7}));
  EXPECT_EQ(spread_disk_layers(12, 4).size(), 4u);
}

TEST(LayerStore, LayoutPacksAndBindsEveryTensor) {
  LoadedModel m = load_model(testing::stories_dir());
  const LayerWeights& src = m.weights.layers[2];
  const LayerLayout layout = LayerLayout::of(src);
  EXPECT_EQ(layout.bytes() % kDirectAlignment, 0u);
  Buffer blob(layout.bytes());
  layout.pack(src, blob.data());
  const LayerWeights back = layout.bind(blob.data());
  for (auto pair : {std::pair{&src.q, &back.q},
                    {&src.k, &back.k},
                    {&src.down, &back.down},
                    {&src.attn_norm, &back.attn_norm},
                    {&src.mlp_norm, &back.mlp_norm}}) {
    ASSERT_EQ(pair.first->shape, pair.second->shape);
    EXPECT_EQ(0, std::memcmp(pair.first->data, pair.second->data, pair.first->bytes()));
  }
}

TEST(LayerStore, BudgetTooSmallSaysByHowMuch) {
  try {
    stories_weights(1000);
    FAIL() << "a 1000-byte budget cannot hold the embeddings";
  } catch (const InputError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("--cpu-mem"), std::string::npos) << msg;
    EXPECT_NE(msg.find("short by"), std::string::npos) << msg;
  }
}

TEST(LayerStore, MissingDiskDirIsAnInputError) {
  LoadOptions lo;
  lo.cpu_mem = budget_for(1);
  lo.disk_dir = "/nonexistent/strata-disk";
  EXPECT_THROW(load_model(testing::stories_dir(), lo), InputError);
}

}  // namespace
}  // namespace strata
