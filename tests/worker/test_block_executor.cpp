// The block executor over the transformer, watched through a backend that counts: with the
// cache made (Model::make_cache), a step allocates nothing on any backend; each GPU batch's
// ids and row table reach the backend in one upload per step, and every layer's kv_store and
// attention read that table instead of rebuilding it; the greedy tokens stay llama2.c's.
// Host compute and the device path (the CPU backend standing in for the device: feeder,
// streamed layers, delegated, staged and 4-bit cache) both.
#include <gtest/gtest.h>

#include <algorithm>

#include "kernels/cpu_backend.h"
#include "support/forwarding_backend.h"
#include "support/stories_reference.h"
#include "support/test_device.h"
#include "worker/loader.h"
#include "worker/model.h"

namespace strata {
namespace {

class CountingBackend final : public testing::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  std::string name() const override { return "counting cpu"; }
  void* allocate(size_t bytes) override {
    ++allocations;
    return inner_.allocate(bytes);
  }
  void* allocate_host(size_t bytes) override {
    ++allocations;
    return inner_.allocate_host(bytes);
  }
  void deallocate_host(void* p) override { inner_.deallocate_host(p); }
  void copy(void* d, const void* s, size_t b, CopyKind k) override {
    if (k == CopyKind::kHostToDevice) ++uploads;
    inner_.copy(d, s, b, k);
  }
  void reserve(const KernelBounds& b) override {
    bounds = b;
    inner_.reserve(b);
  }
  size_t reserved_bytes() const override { return inner_.reserved_bytes(); }
  void kv_store(const float* k, const float* v, const StepRows& rows,
                const KvLayerView& c) override {
    check_table(rows);
    inner_.kv_store(k, v, rows, c);
  }
  void kv_store_q4(const float* k, const float* v, const StepRows& rows,
                   const KvQ4LayerView& c) override {
    check_table(rows);
    inner_.kv_store_q4(k, v, rows, c);
  }
  void attention_q4(const float* q, const StepRows& rows, const KvQ4LayerView& c,
                    const AttentionDims& d, float* out) override {
    ++attentions;
    check_table(rows);
    inner_.attention_q4(q, rows, c, d, out);
  }
  void attention(const float* q, const StepRows& rows, const KvLayerView& c, const AttentionDims& d,
                 float* out) override {
    ++attentions;
    check_table(rows);
    inner_.attention(q, rows, c, d, out);
  }

  int64_t allocations = 0;
  int64_t uploads = 0;
  int64_t attentions = 0;
  int64_t tables = 0;      // kv_store / attention calls that came with the step's table
  int64_t bad_tables = 0;  // ... whose table disagrees with the slices
  KernelBounds bounds;

 private:
  void check_table(const StepRows& rows) {
    if (rows.table == nullptr) return;
    ++tables;
    int64_t i = 0;
    for (const SeqSlice& s : rows.seqs)
      for (int32_t t = 0; t < s.n_new; ++t, ++i)
        if (i >= rows.n_rows || rows.table[i].row != s.row_begin + t ||
            rows.table[i].slot != s.slot || rows.table[i].pos != s.n_past + t)
          ++bad_tables;
    if (i != rows.n_rows) ++bad_tables;
  }
};

constexpr int32_t kSeqs = 4;
constexpr int32_t kDecodeSteps = 6;

// Greedy continuation of the first kSeqs reference prompts, every sequence in every step,
// by hand (no scheduler): one prefill step, then kDecodeSteps decode steps.
std::vector<std::vector<int32_t>> greedy(Model& model, KvCache& cache, int64_t* step_uploads,
                                         CountingBackend& counted) {
  const auto refs = testing::load_stories_references();
  const int32_t vocab = model.config().vocab;
  std::vector<std::vector<int32_t>> out(kSeqs);
  std::vector<int32_t> past(kSeqs, 0);
  std::vector<float> logits(static_cast<size_t>(kSeqs * vocab));
  StepBatch b;
  for (int step = 0; step <= kDecodeSteps; ++step) {
    b.clear();
    for (int32_t s = 0; s < kSeqs; ++s) {
      const auto& r = refs[static_cast<size_t>(s)];
      const std::vector<int32_t> ids = step == 0 ? r.prompt_ids : std::vector{out[s].back()};
      b.add(s, past[static_cast<size_t>(s)], ids, true);
      past[static_cast<size_t>(s)] += static_cast<int32_t>(ids.size());
    }
    const int64_t before = counted.uploads;
    model.forward(b, cache, logits.data());
    step_uploads[step] = counted.uploads - before;
    for (int32_t s = 0; s < kSeqs; ++s) {
      const float* row = logits.data() + static_cast<size_t>(s) * vocab;
      out[static_cast<size_t>(s)].push_back(
          static_cast<int32_t>(std::max_element(row, row + vocab) - row));
    }
  }
  return out;
}

void expect_reference_tokens(const std::vector<std::vector<int32_t>>& got) {
  const auto refs = testing::load_stories_references();
  for (int32_t s = 0; s < kSeqs; ++s) {
    const auto& want = refs[static_cast<size_t>(s)].output_ids;
    ASSERT_GE(want.size(), got[static_cast<size_t>(s)].size());
    EXPECT_TRUE(std::equal(got[s].begin(), got[s].end(), want.begin())) << refs[s].name;
  }
}

TEST(BlockExecutor, HostStepsAllocateNothingAndUploadEachGpuBatchOnce) {
  CpuBackend cpu(2);
  CountingBackend backend(cpu);
  LoadedModel m = load_model(testing::stories_dir());
  Model model(m.config, std::move(m.weights), backend, 128);
  model.set_gpu_batch_size(2);  // a block of two GPU batches
  auto cache = model.make_cache(kSeqs, 64);
  // Bounds by hand (stories260K: hidden 64, intermediate 172, f32): down_proj reads 172.
  EXPECT_EQ(backend.bounds.max_rows, 128);
  EXPECT_EQ(backend.bounds.max_in_features, 172);
  EXPECT_FALSE(backend.bounds.half_weights);
  EXPECT_EQ(backend.bounds.max_positions, 64);
  const size_t reserved = cpu.reserved_bytes();
  const int64_t allocations = backend.allocations;
  int64_t uploads[kDecodeSteps + 1];
  expect_reference_tokens(greedy(model, *cache, uploads, backend));
  EXPECT_EQ(backend.allocations, allocations) << "a step allocated";
  EXPECT_EQ(cpu.reserved_bytes(), reserved) << "a kernel's scratch grew on the token path";
  for (int step = 0; step <= kDecodeSteps; ++step) EXPECT_EQ(uploads[step], 2) << step;
  // 5 layers x 2 GPU batches x 7 steps, kv_store and attention each with the table.
  EXPECT_EQ(backend.attentions, 5 * 2 * (kDecodeSteps + 1));
  EXPECT_EQ(backend.tables, 2 * backend.attentions);
  EXPECT_EQ(backend.bad_tables, 0);
}

struct DevicePath {
  const char* name;
  int wg, wc;  // weight shares
  int cg, cc;  // cache shares
  bool cpu_attention;
  bool compress_cache;
};

TEST(BlockExecutor, DeviceStepsAllocateNothingOnTheDeviceOrTheHost) {
  const DevicePath paths[] = {
      {"streamed, cache delegated", 0, 50, 0, 50, true, false},
      {"streamed, cache staged", 20, 40, 40, 20, false, false},
      {"resident, 4-bit cache", 100, 0, 100, 0, false, true},
  };
  const std::string dir = testing::test_tmp_dir("block_executor");
  for (const DevicePath& p : paths) {
    SCOPED_TRACE(p.name);
    CpuBackend cpu(2), host_cpu(2);
    CountingBackend device(cpu), host(host_cpu);
    LoadOptions lo;
    lo.device = &device;
    lo.disk_dir = dir;
    lo.w_gpu_percent = p.wg;
    lo.w_cpu_percent = p.wc;
    LoadedModel m = load_model(testing::stories_dir(), lo);
    Model model(m.config, std::move(m.weights), device, 128, nullptr, std::move(m.feeder));
    CacheOptions co;
    co.placement.gpu_percent = p.cg;
    co.placement.cpu_percent = p.cc;
    co.placement.disk_dir = dir;
    co.placement.compress = p.compress_cache;
    co.cpu_attention = p.cpu_attention;
    co.host = &host;
    model.set_cache_options(co);
    model.set_gpu_batch_size(2);
    auto cache = model.make_cache(kSeqs, 64);
    const int64_t device_allocations = device.allocations;
    const int64_t host_allocations = host.allocations;
    int64_t uploads[kDecodeSteps + 1];
    const auto got = greedy(model, *cache, uploads, device);
    if (!p.compress_cache) expect_reference_tokens(got);
    EXPECT_EQ(device.allocations, device_allocations) << "a step allocated on the device";
    EXPECT_EQ(host.allocations, host_allocations) << "a step allocated on the host backend";
    EXPECT_EQ(device.bad_tables + host.bad_tables, 0);
    if (p.cpu_attention) {
      EXPECT_GT(host.attentions, 0) << "attention was not delegated to the host";
    } else {
      EXPECT_GT(device.tables, 0);
    }
  }
}

}  // namespace
}  // namespace strata
