// Partial tensor parallelism in one process: a stage's layers split over a group of shards
// (heads and KV heads by rows of q / k / v, MLP columns by rows of gate / up, the matching
// columns of o / down), each shard on its own thread and the group's all-reduce an in-process
// stand-in, give the whole layers' output up to float rounding, and every shard the same bits.
// On stories260K (GQA: 8 heads over 4 KV heads, real safetensors) and a dummy OPT (biases,
// LayerNorm), prefill then decode steps over a cache. The `gpu` label builds it again with
// the CUDA backend, where the sums go through GroupBlockReduce's host staging.
#include <gtest/gtest.h>

#include <barrier>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>

#include "kernels/error.h"
#include "support/stories_reference.h"
#include "support/test_device.h"
#include "worker/loader.h"
#include "worker/model.h"
#include "worker/tensor_parallel.h"

namespace strata {
namespace {

constexpr int32_t kRows = 16;

// The group's sum between threads: every shard posts its partial, each adds all of them in
// shard order (as MPI's group does), and only then does any overwrite its own.
struct ThreadGroupState {
  explicit ThreadGroupState(int degree) : parts(static_cast<size_t>(degree)), sync(degree) {}
  std::vector<const float*> parts;
  std::barrier<> sync;
};

class ThreadAllReduce final : public AllReduceGroup {
 public:
  ThreadAllReduce(std::vector<int> members, int me, ThreadGroupState& state)
      : AllReduceGroup(std::move(members), me), state_(state) {}
  const char* name() const override { return "threads"; }
  bool device_buffers() const override { return false; }
  void all_reduce(float* data, size_t count, const Deadline&) override {
    state_.parts[static_cast<size_t>(index_)] = data;
    state_.sync.arrive_and_wait();
    std::vector<float> sum(count);
    for (size_t j = 0; j < count; ++j) {
      float s = state_.parts[0][j];
      for (size_t k = 1; k < state_.parts.size(); ++k) s += state_.parts[k][j];
      sum[j] = s;
    }
    state_.sync.arrive_and_wait();  // everyone has read every partial
    std::memcpy(data, sum.data(), count * sizeof(float));
  }

 private:
  ThreadGroupState& state_;
};

// Layers [begin, end) of `spec` as a middle stage (activations in and out): whole, or shard
// `index` of `degree`.
std::unique_ptr<Model> load_layers(const std::string& spec, Backend& backend, bool device,
                                   int32_t begin, int32_t end, int32_t index, int32_t degree) {
  LoadOptions o;
  o.layer_begin = begin;
  o.layer_end = end;
  o.embedding = false;
  o.head = false;
  o.tp_index = index;
  o.tp_degree = degree;
  if (device) o.device = &backend;
  LoadedModel m = load_model(spec, o);
  return std::make_unique<Model>(m.config, std::move(m.weights), backend, kRows,
                                 std::move(m.streamer), std::move(m.feeder));
}

// Two sequences: a prefill of 3 and 2 tokens, then two decode steps of one token each.
std::vector<StepBatch> steps() {
  std::vector<StepBatch> out(3);
  out[0].add(0, 0, std::vector<int32_t>{0, 0, 0}, true);
  out[0].add(1, 0, std::vector<int32_t>{0, 0}, true);
  for (int32_t d = 0; d < 2; ++d) {
    out[static_cast<size_t>(d + 1)].add(0, 3 + d, std::vector<int32_t>{0}, true);
    out[static_cast<size_t>(d + 1)].add(1, 2 + d, std::vector<int32_t>{0}, true);
  }
  return out;
}

std::vector<float> random_rows(int32_t rows, int32_t hidden, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(rows) * static_cast<size_t>(hidden));
  for (float& v : x) v = u(rng);
  return x;
}

void expect_split_matches_whole(const std::string& spec, int32_t begin, int32_t end,
                                int32_t degree) {
  std::unique_ptr<Backend> backend = testing::make_test_device();
  if (!backend) GTEST_SKIP() << "no device";
  const bool device = backend->device() != Device::kHost;
  std::unique_ptr<Model> whole = load_layers(spec, *backend, device, begin, end, 0, 1);
  std::unique_ptr<KvCache> whole_cache = whole->make_cache(2, 32);
  ThreadGroupState state(degree);
  std::vector<int> members;
  for (int k = 0; k < degree; ++k) members.push_back(k + 1);
  // Each shard computes on its own backend, as each rank of a group does (a backend's
  // scratch serves one caller at a time).
  struct Shard {
    std::unique_ptr<Backend> backend;
    std::unique_ptr<Model> model;
    std::unique_ptr<KvCache> cache;
    std::unique_ptr<ThreadAllReduce> group;
    std::unique_ptr<GroupBlockReduce> reduce;
    std::vector<float> out;
  };
  std::vector<Shard> shards(static_cast<size_t>(degree));
  for (int32_t k = 0; k < degree; ++k) {
    Shard& s = shards[static_cast<size_t>(k)];
    s.backend = testing::make_test_device();
    s.model = load_layers(spec, *s.backend, device, begin, end, k, degree);
    EXPECT_EQ(s.model->config().n_heads * degree, whole->config().n_heads);
    EXPECT_EQ(s.model->config().intermediate * degree, whole->config().intermediate);
    s.cache = s.model->make_cache(2, 32);
    // Each shard caches only its own KV heads.
    EXPECT_EQ(s.cache->bytes() * static_cast<size_t>(degree), whole_cache->bytes());
    s.group = std::make_unique<ThreadAllReduce>(members, k + 1, state);
    s.reduce = std::make_unique<GroupBlockReduce>(*s.backend, *s.group, 30.0);
    s.model->set_block_reduce(s.reduce.get());
  }
  const int32_t hidden = whole->config().hidden;
  uint32_t seed = 7;
  for (const StepBatch& batch : steps()) {
    const std::vector<float> in = random_rows(batch.rows(), hidden, seed++);
    std::vector<float> expected(in.size());
    whole->forward_stage(batch, *whole_cache, StepIo{in.data(), expected.data(), false});
    std::vector<std::thread> threads;
    for (Shard& s : shards) {
      s.out.assign(in.size(), 0.0f);
      threads.emplace_back([&] {
        s.model->forward_stage(batch, *s.cache, StepIo{in.data(), s.out.data(), false});
      });
    }
    for (std::thread& t : threads) t.join();
    double worst = 0;
    for (size_t j = 0; j < expected.size(); ++j)
      worst = std::max(worst, std::abs(static_cast<double>(shards[0].out[j]) - expected[j]) /
                                  (1.0 + std::abs(static_cast<double>(expected[j]))));
    EXPECT_LT(worst, 2e-5) << spec << " step of " << batch.rows() << " rows";
    for (const Shard& s : shards)
      EXPECT_EQ(std::memcmp(s.out.data(), shards[0].out.data(), in.size() * sizeof(float)), 0)
          << "the shards' residual streams differ";
  }
}

TEST(TensorParallel, Stories260kHeadsAndMlpSplitInTwo) {
  expect_split_matches_whole(testing::stories_dir(), 1, 4, 2);
}

TEST(TensorParallel, Stories260kSplitInFour) {
  expect_split_matches_whole(testing::stories_dir(), 0, 5, 4);
}

TEST(TensorParallel, OptBiasesCountOnce) {
  expect_split_matches_whole("dummy:opt-125m", 2, 4, 2);
}

TEST(TensorParallel, ShardConfigRefusesDegreesThatDoNotDivide) {
  const ModelConfig c = load_model_config(testing::stories_dir());
  const ModelConfig half = tensor_parallel_shard(c, 2);
  EXPECT_EQ(half.n_heads, 4);
  EXPECT_EQ(half.n_kv_heads, 2);
  EXPECT_EQ(half.intermediate, 86);
  EXPECT_EQ(half.hidden, 64);
  try {
    (void)tensor_parallel_shard(c, 3);
    FAIL() << "degree 3 accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("does not divide its 8 attention heads"),
              std::string::npos)
        << e.what();
  }
  // 8 heads split in 8, but 4 KV heads do not.
  EXPECT_THROW((void)tensor_parallel_shard(c, 8), InputError);
}

}  // namespace
}  // namespace strata
