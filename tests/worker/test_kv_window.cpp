// A sliding window bounds the KV cache (kernels/backend.h KvWindow): stories260K given an
// 8-position window on every layer (Mistral's rule) generates the same tokens, and scores the
// same logits, whether its slots hold the whole context or only the window's rows -- in every
// cache tier and format -- and the bounded cache holds n_slots x rows positions, the rows
// counted here by hand.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "coordinator/run/local_stages.h"
#include "kernels/cpu_backend.h"
#include "support/stories_reference.h"
#include "worker/loader.h"
#include "worker/scoring.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

constexpr int32_t kWindow = 8;
constexpr int32_t kStepRows = 16;  // the bounded model's max_rows and the prefill chunk
constexpr int32_t kSlots = 3;

std::string disk_dir() {
  const fs::path d = fs::path(STRATA_TEST_TMP) / "kv_window";
  fs::create_directories(d);
  return d.string();
}

LoadedModel windowed_stories() {
  LoadedModel m = load_model(testing::stories_dir());
  m.config.sliding_window = kWindow;
  m.config.sliding.assign(static_cast<size_t>(m.config.n_layers), 1);
  return m;
}

// Requests long enough that each sequence passes the bounded slot's rows many times over.
std::vector<GenerationRequest> long_requests() {
  std::vector<GenerationRequest> reqs;
  for (const auto& r : testing::load_stories_references())
    reqs.push_back({r.name, r.prompt_ids, 100, {}, false});
  return reqs;
}

std::vector<std::vector<int32_t>> generate(int32_t max_rows, const CachePlacement& placement) {
  LoadedModel m = windowed_stories();
  CpuBackend backend(2);
  Model model(m.config, std::move(m.weights), backend, max_rows);
  CacheOptions o;
  o.placement = placement;
  model.set_cache_options(o);
  LocalCluster gen(model, LocalOptions{kSlots, kStepRows, 0});
  std::vector<std::vector<int32_t>> out;
  for (const auto& r : gen.run(long_requests())) out.push_back(r.output_ids);
  return out;
}

TEST(KvWindow, SlotRowsByHand) {
  // rows = W - 1 + C + ceil(W / 8): 8 - 1 + 16 + 1.
  LoadedModel m = windowed_stories();
  CpuBackend backend(2);
  Model model(m.config, std::move(m.weights), backend, kStepRows);
  const auto cache = model.make_cache(kSlots, 256);
  EXPECT_EQ(cache->capacity(), 24);
  EXPECT_EQ(cache->positions(), 256);
  const auto kv_width = static_cast<size_t>(m.config.n_kv_heads * m.config.head_dim);
  EXPECT_EQ(cache->bytes(),
            2u * static_cast<size_t>(m.config.n_layers) * kSlots * 24 * kv_width * sizeof(float));
  // A window that would hold the whole context bounds nothing.
  EXPECT_EQ(model.make_cache(kSlots, 24)->capacity(), 24);
  EXPECT_EQ(model.make_cache(kSlots, 20)->capacity(), 20);
}

TEST(KvWindow, BoundedCacheGeneratesWhatTheWholeContextDoes) {
  // The reference model's 512 rows a step make its window hold the whole context: the same
  // attention over every position, masked to the window (checked against the NumPy forward
  // by tests/worker/families).
  CachePlacement whole;
  const auto want = generate(512, whole);
  int32_t longest = 0;
  for (const auto& r : long_requests())
    longest = std::max(longest, static_cast<int32_t>(r.prompt_ids.size()) + r.max_new_tokens);
  ASSERT_GT(longest, 3 * 24) << "the sequences must slide their window several times";
  for (const auto& [gpu, cpu] : {std::pair{100, 0}, {0, 0}, {30, 30}}) {
    CachePlacement p;
    p.gpu_percent = gpu;
    p.cpu_percent = cpu;
    p.disk_dir = disk_dir();
    EXPECT_EQ(generate(kStepRows, p), want) << p.str();
  }
}

TEST(KvWindow, BoundedFourBitAndHalfCachesGenerateWhatTheirWholeContextsDo) {
  // A row is quantised (or rounded) alone, so sliding rows moves their bytes unchanged: the
  // bounded 4-bit and f16 caches equal the unbounded ones of the same format.
  for (const bool q4 : {true, false}) {
    for (const auto& [gpu, cpu] : {std::pair{100, 0}, {0, 0}}) {
      CachePlacement p;
      p.gpu_percent = gpu;
      p.cpu_percent = cpu;
      p.disk_dir = disk_dir();
      p.compress = q4;
      p.dtype = q4 ? DType::kF32 : DType::kF16;
      EXPECT_EQ(generate(kStepRows, p), generate(512, p)) << p.str();
    }
  }
}

TEST(KvWindow, BoundedCacheScoresTheWholeContextsLogits) {
  // Teacher-forced logits of a 90-token sequence in 16-row chunks: every chunk after the
  // first slides the window.
  std::vector<int32_t> ids;
  for (const auto& r : testing::load_stories_references()) {
    const std::vector<int32_t> s = r.sequence();
    ids.insert(ids.end(), s.begin(), s.end());
  }
  ASSERT_GE(ids.size(), 90u);
  ids.resize(90);
  std::vector<float> got, want;
  for (const int32_t max_rows : {kStepRows, 512}) {
    LoadedModel m = windowed_stories();
    CpuBackend backend(2);
    Model model(m.config, std::move(m.weights), backend, max_rows);
    (max_rows == 512 ? want : got) = teacher_forced_logits(model, ids, kStepRows);
  }
  ASSERT_EQ(got.size(), want.size());
  // The same sums in another order (a slid slot's rows start elsewhere in the attention
  // kernels' chunks): f32 rounding relative to the logits' size, some ulps of it (the
  // largest is 22 for stories260K; 1.3e-5 apart on a 2-core EPYC).
  float worst = 0.0f, scale = 0.0f;
  for (size_t i = 0; i < got.size(); ++i) {
    worst = std::max(worst, std::fabs(got[i] - want[i]));
    scale = std::max(scale, std::fabs(want[i]));
  }
  EXPECT_LE(worst, 2e-6f * scale) << "largest logit " << scale;
}

}  // namespace
}  // namespace strata
