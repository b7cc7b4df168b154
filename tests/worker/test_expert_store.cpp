// Experts over host memory and disk (worker/expert_store.h): the offloader writes a layer's
// non-resident experts and empties them, the store reads exactly the experts asked for back
// byte for byte, computes cached ones first, evicts the least popular, and the popularity
// window forgets routings older than its window.
#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <vector>

#include "kernels/moe_route.h"
#include "worker/expert_store.h"

namespace strata {
namespace {

constexpr int64_t kHidden = 64, kWidth = 32;

// A layer of `n` experts whose every element is 1000 * expert + member * 100 + (i % 97).
struct Layer {
  std::vector<std::unique_ptr<OwnedTensor>> owned;
  LayerWeights w;
};

Layer make_layer(int32_t n) {
  Layer l;
  l.w.experts.resize(static_cast<size_t>(n));
  for (int32_t e = 0; e < n; ++e) {
    int member = 0;
    for (const ExpertMember m : kExpertMembers) {
      const Shape s = m == &ExpertWeights::down ? Shape{kHidden, kWidth} : Shape{kWidth, kHidden};
      l.owned.push_back(std::make_unique<OwnedTensor>(DType::kF32, s));
      float* p = l.owned.back()->view.as<float>();
      for (int64_t i = 0; i < s.numel(); ++i)
        p[i] = static_cast<float>(1000 * e + 100 * member + i % 97);
      l.w.experts[static_cast<size_t>(e)].*m = l.owned.back()->view;
      ++member;
    }
  }
  return l;
}

void expect_expert(const ExpertWeights& x, int32_t e) {
  int member = 0;
  for (const ExpertMember m : kExpertMembers) {
    const Tensor& t = x.*m;
    ASSERT_EQ(t.shape.numel(), kHidden * kWidth);
    for (int64_t i = 0; i < t.shape.numel(); i += 37)
      ASSERT_EQ(t.as<float>()[i], static_cast<float>(1000 * e + 100 * member + i % 97))
          << "expert " << e << " member " << member << " element " << i;
    ++member;
  }
}

ExpertRouting routing_of(std::vector<int32_t> rows_per_expert) {
  ExpertRouting r;
  r.n_experts = static_cast<int32_t>(rows_per_expert.size());
  r.offsets.assign(1, 0);
  for (int32_t n : rows_per_expert) r.offsets.push_back(r.offsets.back() + n);
  return r;
}

std::string scratch_dir() {
  const auto d = std::filesystem::temp_directory_path() / "strata-expert-store-test";
  std::filesystem::create_directories(d);  // the offloader refuses a missing --disk-dir
  return d.string();
}

TEST(ExpertStore, DiskExpertsComeBackAsWrittenAndOnlyThoseAsked) {
  ExpertOffloader off(2, 4, /*resident=*/1, scratch_dir());
  ASSERT_TRUE(off.active());
  Layer l0 = make_layer(4), l1 = make_layer(4);
  off(0, l0.w);
  off(1, l1.w);
  EXPECT_NE(l0.w.experts[0].gate.data, nullptr);  // resident
  for (int32_t e = 1; e < 4; ++e)
    EXPECT_EQ(l0.w.experts[static_cast<size_t>(e)].gate.data, nullptr);
  std::unique_ptr<ExpertStore> store = off.finish(2);
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->disk_experts(), 6);
  EXPECT_FALSE(store->holds(0, 0));
  EXPECT_TRUE(store->holds(1, 3));
  const std::vector<int32_t> want = {3, 1};
  const std::span<const int32_t> o = store->request(1, want);
  const std::vector<int32_t> order(o.begin(), o.end());
  EXPECT_EQ(order, want);
  for (const int32_t e : order) {
    expect_expert(store->wait(1, e), e);
    store->release(1, e);
  }
  EXPECT_EQ(store->stats().reads, 2);
  EXPECT_EQ(store->stats().requested, 2);
}

TEST(ExpertStore, CachedExpertsFirstThenReadsInOrderEvictingTheLeastPopular) {
  ExpertOffloader off(1, 4, 0, scratch_dir());
  Layer l = make_layer(4);
  off(0, l.w);
  std::unique_ptr<ExpertStore> store = off.finish(3);
  ExpertPopularity pop(1, 4, 8);
  store->set_popularity(&pop);
  auto run = [&](std::vector<int32_t> experts) {
    const std::span<const int32_t> o = store->request(0, experts);
    std::vector<int32_t> order(o.begin(), o.end());
    for (const int32_t e : order) {
      expect_expert(store->wait(0, e), e);
      store->release(0, e);
    }
    return order;
  };
  EXPECT_EQ(run({1, 2}), (std::vector<int32_t>{1, 2}));
  pop.record(0, routing_of({0, 5, 1, 0}));         // expert 1 popular, 2 less, 0 and 3 not at all
  EXPECT_EQ(run({3}), (std::vector<int32_t>{3}));  // into the empty slot
  // 0 is read into the slot of the least popular cached expert (3), not of the least
  // recently used (1, which LRU would drop).
  EXPECT_EQ(run({0}), (std::vector<int32_t>{0}));
  EXPECT_EQ(store->stats().reads, 4);
  // A miss and two hits: the hits first (the order compute must take).
  EXPECT_EQ(run({3, 2, 1}), (std::vector<int32_t>{2, 1, 3}));
  EXPECT_EQ(store->stats().hits, 2);
  EXPECT_EQ(store->stats().reads, 5);
  EXPECT_EQ(store->stats().bytes_read, 5 * (store->memory().disk / 4));
  // More experts than slots in one step: each read waits for a computed one's slot.
  EXPECT_EQ(run({0, 1, 2, 3}).size(), 4u);
}

TEST(ExpertPopularity, CountsTheLastWindowOfRoutingsOnly) {
  ExpertPopularity p(2, 3, /*window=*/2);
  p.record(0, routing_of({4, 0, 1}));
  p.record(0, routing_of({0, 2, 1}));
  EXPECT_EQ(p.count(0, 0), 4);
  EXPECT_EQ(p.count(0, 2), 2);
  p.record(0, routing_of({0, 0, 3}));  // the first routing leaves the window
  EXPECT_EQ(p.count(0, 0), 0);
  EXPECT_EQ(p.count(0, 1), 2);
  EXPECT_EQ(p.count(0, 2), 4);
  EXPECT_EQ(p.total(1), 0);  // layers count apart
  EXPECT_EQ(p.ranked(0), (std::vector<int32_t>{2, 1, 0}));
}

}  // namespace
}  // namespace strata
