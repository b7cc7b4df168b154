// The KV cache's tiers on a host-compute engine: whatever share of layers keeps its cache in
// memory or on disk (O_DIRECT round trip per layer), generation equals the reference.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>

#include "coordinator/run/local_stages.h"
#include "kernels/cpu_backend.h"
#include "kernels/dtype.h"
#include "kernels/error.h"
#include "support/forwarding_backend.h"
#include "support/stories_reference.h"
#include "worker/loader.h"
#include "worker/scoring.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

std::string disk_dir() {
  const fs::path d = fs::path(STRATA_TEST_TMP) / "kv_cache";
  fs::create_directories(d);
  return d.string();
}

// The reference for the 4-bit cache, written here from the formula (FlexGen §5, quant.h):
// each cached row of head_dim values is one group, scale = (max - min) / 15,
// q = clamp(round((x - min) / scale), 0, 15), x' = q * scale + min.
void naive_q4_round_trip(const float* x, int32_t n, float* y) {
  const float mn = *std::min_element(x, x + n), mx = *std::max_element(x, x + n);
  const float scale = (mx - mn) / 15.0f;
  for (int32_t i = 0; i < n; ++i) {
    const float q =
        scale == 0.0f ? 0.0f : std::clamp(std::nearbyint((x[i] - mn) / scale), 0.0f, 15.0f);
    y[i] = std::fma(q, scale, mn);
  }
}

// The test's own f16 round trip (round to nearest even, dtype.h) of one cached row.
void naive_f16_round_trip(const float* x, int32_t n, float* y) {
  for (int32_t i = 0; i < n; ++i) y[i] = f16_to_f32(f32_to_f16(x[i]));
}

// The CPU backend with an f32 cache whose every stored key and value row is first put
// through `round_trip` (one of the above): what a correct compressed or f16 cache hands to
// attention.
class NaiveRoundTripKvBackend final : public testing::ForwardingBackend {
 public:
  using RoundTrip = void (*)(const float* x, int32_t n, float* y);
  NaiveRoundTripKvBackend(CpuBackend& inner, RoundTrip round_trip)
      : ForwardingBackend(inner), round_trip_(round_trip) {}
  std::string name() const override { return "cpu with a naive KV round trip"; }
  void kv_store(const float* k, const float* v, const StepRows& step,
                const KvLayerView& c) override {
    int32_t rows = 0;
    for (const SeqSlice& s : step.seqs) rows = std::max(rows, s.row_begin + s.n_new);
    const size_t n = static_cast<size_t>(rows) * static_cast<size_t>(c.n_kv_heads * c.head_dim);
    std::vector<float> kq(n), vq(n);
    for (size_t r = 0; r < n; r += static_cast<size_t>(c.head_dim)) {
      round_trip_(k + r, c.head_dim, kq.data() + r);
      round_trip_(v + r, c.head_dim, vq.data() + r);
    }
    inner_.kv_store(kq.data(), vq.data(), step, c);
  }

 private:
  RoundTrip round_trip_;
};

std::vector<GenerationRequest> reference_requests(
    const std::vector<testing::StoriesReference>& refs) {
  std::vector<GenerationRequest> reqs;
  for (const auto& r : refs)
    reqs.push_back({r.name, r.prompt_ids, static_cast<int32_t>(r.output_ids.size()), {}, true});
  return reqs;
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
  cache.layer(0).k_f32()[5] = 1.5f;
  cache.store(0);
  cache.load(1);  // the staging now holds layer 1 (zeros)
  EXPECT_EQ(cache.layer(1).k_f32()[5], 0.0f);
  cache.store(1);
  cache.load(0);
  EXPECT_EQ(cache.layer(0).k_f32()[5], 1.5f);
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
    LocalCluster gen(model, LocalOptions{3, 64, 0});
    const auto results = gen.run(reqs);
    for (size_t i = 0; i < refs.size(); ++i)
      EXPECT_EQ(results[i].output_ids, refs[i].output_ids)
          << refs[i].name << " " << o.placement.str();
  }
}

TEST(KvCacheTiers, FourBitRowsComeBackWithinHalfAScale) {
  // kv_store_q4 then kv_dequantize: every value within half its group's scale.
  CpuBackend backend(1);
  ModelConfig c = load_model_config(testing::stories_dir());
  CachePlacement p;
  p.compress = true;
  KvCache cache(backend, c, 2, 8, p);
  const int32_t w = c.kv_width();
  std::vector<float> k(static_cast<size_t>(3 * w)), v(k.size());
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = std::sin(0.37f * static_cast<float>(i)) * 3.0f;
    v[i] = std::cos(0.11f * static_cast<float>(i)) - 0.5f;
  }
  const std::vector<SeqSlice> seqs{{0, 2, 3, 1},
                                   {2, 1, 0, 0}};  // rows 0-1 -> slot 1 @3, row 2 -> slot 0 @0
  const KvQ4LayerView q = cache.q4_layer(0);
  backend.kv_store_q4(k.data(), v.data(), seqs, q);
  KvLayerView out{nullptr, nullptr, 2, 8, c.n_kv_heads, c.head_dim, DType::kF32};
  std::vector<float> ko(out.slot_stride() * 2), vo(ko.size());
  out.k = ko.data();
  out.v = vo.data();
  backend.kv_dequantize(q, out);
  const int32_t hd = c.head_dim;
  auto check = [&](int32_t row, int32_t slot, int32_t pos) {
    for (int32_t h = 0; h < c.n_kv_heads; ++h) {
      for (const auto& [src, dst] : {std::pair{&k, &ko}, {&v, &vo}}) {
        const float* x = src->data() + row * w + h * hd;
        const float* y = dst->data() + slot * out.slot_stride() + h * out.head_stride() + pos * hd;
        const float mn = *std::min_element(x, x + hd), mx = *std::max_element(x, x + hd);
        for (int32_t d = 0; d < hd; ++d)
          EXPECT_NEAR(y[d], x[d], (mx - mn) / 15 / 2 + 1e-6) << row << " " << h;
      }
    }
  };
  check(0, 1, 3);
  check(1, 1, 4);
  check(2, 0, 0);
  EXPECT_EQ(ko[0 * out.slot_stride() + 1 * hd], 0.0f);  // slot 0, position 1: never written
  // head_dim 8: 4 bytes of codes and 8 of min/scale per 8 values, against 32 bytes in f32.
  EXPECT_EQ(cache.bytes() * 8, KvCache(backend, c, 2, 8).bytes() * 3);
}

// Teacher-forced logits of stories260K with the cache stored as `stored` says, in memory, on
// disk and split, against the f32-cache model over `naive` (the CPU backend rounding each
// stored row as the test's own code does): within `worst_limit` of it, and the naive model
// at least `moved_min` from llama2.c's f32 logits, so that a cache that skipped the rounding
// would show.
void expect_naive_round_trip_logits(testing::ForwardingBackend& naive_backend, Backend& backend,
                                    const CachePlacement& stored, double worst_limit,
                                    double moved_min) {
  const auto refs = testing::load_stories_references();
  LoadedModel nm = load_model(testing::stories_dir());
  Model naive(nm.config, std::move(nm.weights), naive_backend, 64);
  for (auto [cg, cc] : {std::pair{100, 0}, {0, 0}, {30, 30}}) {
    LoadedModel m = load_model(testing::stories_dir());
    Model model(m.config, std::move(m.weights), backend, 64);
    CacheOptions o;
    o.placement = stored;
    o.placement.gpu_percent = cg;
    o.placement.cpu_percent = cc;
    o.placement.disk_dir = disk_dir();
    model.set_cache_options(o);
    for (const auto& r : refs) {
      for (int32_t chunk : {64, 1}) {
        const auto got = teacher_forced_logits(model, r.sequence(), chunk);
        const auto want = teacher_forced_logits(naive, r.sequence(), chunk);
        ASSERT_EQ(got.size(), want.size());
        double worst = 0, moved = 0;  // vs the naive round trip; vs llama2.c's f32 logits
        for (size_t i = 0; i < got.size(); ++i) {
          worst = std::max(worst, double(std::fabs(got[i] - want[i])));
          moved = std::max(moved, double(std::fabs(want[i] - r.logits[i])));
        }
        EXPECT_LT(worst, worst_limit) << r.name << " chunk " << chunk << " " << o.placement.str();
        EXPECT_GT(moved, moved_min) << r.name;
      }
    }
  }
}

TEST(KvCacheTiers, CompressedCacheComputesTheNaiveRoundTripInEveryTier) {
  // Equal up to f32 rounding (a code that flips on a rounding tie moves one value by one
  // scale step); the 4-bit round trip moves the logits by more than 0.05 at this size.
  CpuBackend backend(2);
  NaiveRoundTripKvBackend naive_backend(backend, naive_q4_round_trip);
  CachePlacement q4;
  q4.compress = true;
  expect_naive_round_trip_logits(naive_backend, backend, q4, 2e-3, 0.05);
}

TEST(KvCacheTiers, CompressedCacheGivesTheNaiveRoundTripsOutputInEveryTier) {
  // Greedy generation with the 4-bit cache, in memory or on disk, token for token equal to
  // generation with the naive round trip (and so, between tiers, equal to each other).
  const auto refs = testing::load_stories_references();
  CpuBackend backend(2);
  NaiveRoundTripKvBackend naive_backend(backend, naive_q4_round_trip);
  LoadedModel nm = load_model(testing::stories_dir());
  Model naive(nm.config, std::move(nm.weights), naive_backend, 64);
  LocalCluster naive_gen(naive, LocalOptions{3, 64, 0});
  std::vector<std::vector<int32_t>> want;
  for (const auto& res : naive_gen.run(reference_requests(refs))) want.push_back(res.output_ids);
  int64_t agree = 0, total = 0;
  for (size_t i = 0; i < refs.size(); ++i)
    for (size_t t = 0; t < refs[i].output_ids.size(); ++t, ++total)
      agree += want[i][t] == refs[i].output_ids[t];
  std::printf(
      "stories260K greedy with a 4-bit KV cache: %lld of %lld tokens equal to the f32 reference\n",
      static_cast<long long>(agree), static_cast<long long>(total));
  EXPECT_LT(agree, total) << "the round trip should change some tokens of this tiny model";
  for (auto [cg, cc] : {std::pair{100, 0}, {0, 0}, {30, 30}}) {
    LoadedModel m = load_model(testing::stories_dir());
    Model model(m.config, std::move(m.weights), backend, 64);
    CacheOptions o;
    o.placement = {cg, cc, disk_dir(), true};
    model.set_cache_options(o);
    LocalCluster gen(model, LocalOptions{3, 64, 0});
    std::vector<std::vector<int32_t>> outs;
    for (const auto& res : gen.run(reference_requests(refs))) outs.push_back(res.output_ids);
    EXPECT_EQ(outs, want) << o.placement.str();
  }
}

// S3's packing keeps many slots of the whole context: a slot a new sequence takes gives the
// last one's pages back (they read as zeros again) and leaves every other slot alone.
TEST(KvCacheTiers, DiscardedSlotReadsZeroAndOthersKeepTheirRows) {
  CpuBackend backend(1);
  ModelConfig c = load_model_config(testing::stories_dir());
  KvCache cache(backend, c, 64, 512, CachePlacement{});  // 4 MiB a tensor: mapped lazily
  const KvLayerView v = cache.layer(0);
  const size_t per_slot = v.slot_stride();
  ASSERT_GE(per_slot * sizeof(float), size_t{16} << 10);  // whole pages inside each slot
  std::fill(v.k_f32(), v.k_f32() + per_slot * 64, 1.0f);
  std::fill(v.v_f32(), v.v_f32() + per_slot * 64, 2.0f);
  cache.discard_slot(backend, 5);
  for (int32_t slot : {4, 5, 6}) {
    const float* k = v.k_f32() + per_slot * static_cast<size_t>(slot);
    const float* vv = v.v_f32() + per_slot * static_cast<size_t>(slot);
    const float want_k = slot == 5 ? 0.0f : 1.0f, want_v = slot == 5 ? 0.0f : 2.0f;
    EXPECT_EQ(std::count(k, k + per_slot, want_k), static_cast<ptrdiff_t>(per_slot)) << slot;
    EXPECT_EQ(std::count(vv, vv + per_slot, want_v), static_cast<ptrdiff_t>(per_slot)) << slot;
  }
}

TEST(KvCacheTiers, HalfCacheComputesTheNaiveRoundTripInEveryTier) {
  // Attention reads the same values from an f16 cache as from an f32 cache of rounded rows,
  // so the logits agree to f32 rounding; the rounding moves them by 0.016-0.029 here.
  CpuBackend backend(2);
  NaiveRoundTripKvBackend naive_backend(backend, naive_f16_round_trip);
  CachePlacement f16;
  f16.dtype = DType::kF16;
  expect_naive_round_trip_logits(naive_backend, backend, f16, 1e-5, 1e-3);
}

TEST(KvCacheTiers, HalfCacheHoldsHalfTheBytesInEveryTier) {
  CpuBackend backend(1);
  ModelConfig c = load_model_config(testing::stories_dir());
  CachePlacement half;
  half.dtype = DType::kF16;
  KvCache f16(backend, c, 3, 10, half), f32(backend, c, 3, 10);
  EXPECT_EQ(f16.bytes() * 2, f32.bytes());
  EXPECT_EQ(f16.layer_bytes(), size_t{3} * 10 * static_cast<size_t>(c.kv_width()) * 2);
  EXPECT_EQ(f16.slot_bytes(7) * 2, f32.slot_bytes(7));
  EXPECT_EQ(f16.layer(0).dtype, DType::kF16);
  EXPECT_EQ(f16.layer(0).tensor_bytes(), f16.layer_bytes());
  auto refused = [&](CachePlacement p, const std::string& says) {
    try {
      KvCache(backend, c, 1, 4, p);
      ADD_FAILURE() << p.str() << " was taken";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  CachePlacement both = half;
  both.compress = true;
  refused(both, "either 4-bit or f16");
  CachePlacement bf16;
  bf16.dtype = DType::kBF16;
  refused(bf16, "bf16");
  // The GPU tier of device compute (whose kernels read f16 as the host's do), and host memory
  // beside it: half the bytes in each.
  CachePlacement device = half;
  device.device_tier = true;
  device.gpu_percent = 50;
  device.cpu_percent = 50;
  const KvCache split(backend, c, 3, 10, device);
  EXPECT_EQ(split.bytes(), f16.bytes());
  EXPECT_EQ(split.tier(0), Tier::kGpu);
  EXPECT_EQ(split.tier(c.n_layers - 1), Tier::kCpu);
  EXPECT_EQ(split.layer(0).dtype, DType::kF16);
}

TEST(KvCacheTiers, MissingDiskDirIsAnInputError) {
  CpuBackend backend(1);
  CachePlacement p{0, 0, "/nonexistent/strata-kv"};
  EXPECT_THROW(KvCache(backend, load_model_config(testing::stories_dir()), 1, 4, p), InputError);
}

}  // namespace
}  // namespace strata
