// Pie's swapping in the engine (worker/kv_swap.h), on the CPU backend standing in for the
// device (and, built as test_kv_swap_cuda with the `gpu` label, the equality tests on a GPU):
// greedy ids with the KV cache swapping equal the all-resident cache's (stories260K:
// llama2.c's reference ids) for fixed m up to n - 1 and for adaptive expansion; swap counts
// derived by hand from §3.3's protocol; and a backend whose copies finish only when waited
// on shows that no kernel touches a layer while one of its swaps is under way.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cpu_backend.h"
#include "kernels/error.h"
#include "placement/stage_placement.h"
#include "support/forwarding_backend.h"
#include "support/input_error.h"
#include "support/stories_reference.h"
#include "support/test_device.h"
#include "worker/loader.h"
#include "worker/model.h"

namespace strata {
namespace {

// Copies held back until waited on (or polled `polls_to_finish` times; -1: never), so the
// kernels run ahead of them unless the engine orders itself. Every KV view a kernel gets,
// and every new copy, is checked against the copies still pending.
class DeferredCopyBackend final : public testing::ForwardingBackend {
 public:
  DeferredCopyBackend(CpuBackend& inner, int polls_to_finish,
                      std::chrono::microseconds wait_cost = {})
      : ForwardingBackend(inner), polls_to_finish_(polls_to_finish), wait_cost_(wait_cost) {}
  std::string name() const override { return "deferred-copy cpu"; }

  TransferTicket transfer(void* dst, const void* src, size_t bytes, CopyKind) override {
    // A copy may read what a pending copy reads, nothing else a pending copy touches.
    if (touches_pending(dst, bytes, true) || touches_pending(src, bytes, false)) ++hazards;
    pending_.push_back(
        {next_id_++, static_cast<std::byte*>(dst), static_cast<const std::byte*>(src), bytes, 0});
    ++transfers;
    return {pending_.back().id};
  }
  bool transfer_done(TransferTicket t) override {
    auto p = std::find_if(pending_.begin(), pending_.end(),
                          [&](const Pending& q) { return q.id == t.id; });
    if (p == pending_.end()) return true;
    if (polls_to_finish_ < 0 || ++p->polls < polls_to_finish_) return false;
    finish_until(t.id);
    return true;
  }
  void host_waits(TransferTicket t) override {
    if (!is_pending(t.id)) return;
    ++waits;
    std::this_thread::sleep_for(wait_cost_);
    finish_until(t.id);
  }
  void compute_waits(TransferTicket t) override { finish_until(t.id); }
  void copy(void* d, const void* s, size_t b, CopyKind k) override {
    if (touches_pending(d, b, true) || touches_pending(s, b, false)) ++hazards;
    inner_.copy(d, s, b, k);
  }
  void kv_store(const float* k, const float* v, const StepRows& rows,
                const KvLayerView& c) override {
    check(c);
    inner_.kv_store(k, v, rows, c);
  }
  void attention(const float* q, const StepRows& rows, const KvLayerView& c, const AttentionDims& d,
                 float* out) override {
    check(c);
    ++attentions;
    inner_.attention(q, rows, c, d, out);
  }

  int64_t hazards = 0;  // a kernel or copy touched memory a pending copy reads or writes
  int64_t transfers = 0;
  int64_t waits = 0;  // host_waits that found the copy still pending
  int64_t attentions = 0;

 private:
  struct Pending {
    uint64_t id;
    std::byte* dst;
    const std::byte* src;
    size_t bytes;
    int polls;
  };
  static bool overlap(const void* a, size_t n, const void* b, size_t m) {
    const auto* x = static_cast<const std::byte*>(a);
    const auto* y = static_cast<const std::byte*>(b);
    return x < y + m && y < x + n;
  }
  // `write`: the caller writes [p, p + n) (so a pending copy's source counts too).
  bool touches_pending(const void* p, size_t n, bool write) const {
    for (const Pending& q : pending_)
      if (overlap(p, n, q.dst, q.bytes) || (write && overlap(p, n, q.src, q.bytes))) return true;
    return false;
  }
  void check(const KvLayerView& c) {
    const size_t bytes = c.slot_stride() * static_cast<size_t>(c.n_slots) * sizeof(float);
    if (touches_pending(c.k, bytes, true) || touches_pending(c.v, bytes, true)) ++hazards;
  }
  bool is_pending(uint64_t id) const {
    return std::any_of(pending_.begin(), pending_.end(),
                       [&](const Pending& p) { return p.id == id; });
  }
  // One in-order queue, as the CUDA backend's transfer stream: a copy ends after those
  // issued before it.
  void finish_until(uint64_t id) {
    while (!pending_.empty() && pending_.front().id <= id) {
      const Pending p = pending_.front();
      pending_.pop_front();
      std::memcpy(p.dst, p.src, p.bytes);
    }
  }

  int polls_to_finish_;
  std::chrono::microseconds wait_cost_;
  std::deque<Pending> pending_;
  uint64_t next_id_ = 1;
};

struct Outcome {
  std::vector<std::vector<int32_t>> ids;  // per sequence, the greedy continuation
  bool pie = false;
  KvSwapStats stats;
  TierBytes memory;                           // the KV cache's
  std::vector<std::vector<std::byte>> slot0;  // slot 0 of each layer as stored, after the run
};

struct Workload {
  std::vector<std::vector<int32_t>> prompts;
  int decode_steps = 6;
  int32_t capacity = 64;
  bool compress = false;
  DType cache_dtype = DType::kF32;  // of an uncompressed cache: f32 or f16 (policy cf16)
  int32_t gpu_batch_size = 0;
};

// The model computing on `device` with every weight there (the CPU backend standing in).
std::unique_ptr<Model> device_model(const std::string& spec, Backend& device) {
  LoadOptions lo;
  lo.device = &device;
  lo.w_gpu_percent = 100;
  lo.w_cpu_percent = 0;
  lo.disk_dir = testing::test_tmp_dir("kv_swap");
  LoadedModel m = load_model(spec, lo);
  return std::make_unique<Model>(m.config, std::move(m.weights), device, 64, nullptr,
                                 std::move(m.feeder));
}

// Greedy decoding by hand over a new cache, every sequence in every step: one prefill
// step, then `decode_steps` steps of one token each.
Outcome greedy(Model& model, Backend& device, const Workload& s, const PieOptions& pie) {
  CacheOptions co;
  co.placement.pie = pie;
  co.placement.compress = s.compress;
  co.placement.dtype = s.cache_dtype;
  model.set_cache_options(co);
  model.set_gpu_batch_size(s.gpu_batch_size);
  const auto n = static_cast<int32_t>(s.prompts.size());
  auto cache = model.make_cache(n, s.capacity);
  const int32_t vocab = model.config().vocab;
  Outcome r;
  r.ids.resize(static_cast<size_t>(n));
  std::vector<int32_t> past(static_cast<size_t>(n), 0);
  std::vector<float> logits(static_cast<size_t>(n) * static_cast<size_t>(vocab));
  StepBatch b;
  for (int step = 0; step <= s.decode_steps; ++step) {
    b.clear();
    for (int32_t q = 0; q < n; ++q) {
      const auto i = static_cast<size_t>(q);
      const std::vector<int32_t> in = step == 0 ? s.prompts[i] : std::vector{r.ids[i].back()};
      b.add(q, past[i], in, true);
      past[i] += static_cast<int32_t>(in.size());
    }
    model.forward(b, *cache, logits.data());
    for (int32_t q = 0; q < n; ++q) {
      const float* row = logits.data() + static_cast<size_t>(q) * static_cast<size_t>(vocab);
      r.ids[static_cast<size_t>(q)].push_back(
          static_cast<int32_t>(std::max_element(row, row + vocab) - row));
    }
  }
  r.pie = cache->swap() != nullptr;
  if (r.pie) r.stats = cache->swap()->stats();
  r.memory = cache->memory();
  for (int32_t i = 0; i < model.config().n_layers; ++i) {
    std::vector<std::byte> bytes(cache->slot_bytes(past[0]));
    cache->read_slot(device, i, 0, past[0], bytes.data());
    r.slot0.push_back(std::move(bytes));
  }
  return r;
}

PieOptions fixed(int32_t m) {
  PieOptions o;
  o.host_layers = m;
  return o;
}

PieOptions adaptive(int32_t start) {
  PieOptions o;
  o.adaptive = true;
  o.host_layers = start;
  return o;
}

Workload stories() {
  Workload s;
  const auto refs = testing::load_stories_references();
  for (size_t i = 0; i < 4; ++i) s.prompts.push_back(refs[i].prompt_ids);
  return s;
}

void expect_stories_reference(const Outcome& r) {
  const auto refs = testing::load_stories_references();
  for (size_t s = 0; s < r.ids.size(); ++s) {
    const auto& want = refs[s].output_ids;
    ASSERT_GE(want.size(), r.ids[s].size());
    EXPECT_TRUE(std::equal(r.ids[s].begin(), r.ids[s].end(), want.begin())) << refs[s].name;
  }
}

// stories260K: 5 layers; one layer's K (or V) of 4 slots x 64 positions x 4 KV heads x 8
// dims in f32 is 32 KiB, so one buffer (K then V) and one swap are 64 KiB.
constexpr int64_t kStoriesSwapBytes = 2 * 4 * 64 * 4 * 8 * 4;

// The equality tests run on the device under test: the CPU backend standing in for it, or
// the GPU in test_kv_swap_cuda (skipped where there is none).
class KvSwapOnDevice : public ::testing::Test {
 protected:
  void SetUp() override {
    device_ = testing::make_test_device();
    if (!device_) GTEST_SKIP() << "no CUDA device";
  }
  std::unique_ptr<Backend> device_;
};

TEST_F(KvSwapOnDevice, StoriesGreedyIdsAreLlama2csForEveryM) {
  Backend& device = *device_;
  auto model = device_model(testing::stories_dir(), device);
  const Outcome resident = greedy(*model, device, stories(), PieOptions{});
  expect_stories_reference(resident);
  EXPECT_FALSE(resident.pie);
  for (int32_t m = 1; m <= 4; ++m) {
    SCOPED_TRACE(m);
    const Outcome r = greedy(*model, device, stories(), fixed(m));
    ASSERT_TRUE(r.pie);
    expect_stories_reference(r);
    EXPECT_EQ(r.slot0, resident.slot0);
    // The device keeps n - m layer buffers, the host m + 2 (at most n).
    EXPECT_EQ(r.memory.gpu, (5 - m) * kStoriesSwapBytes);
    EXPECT_EQ(r.memory.cpu, std::min(5, m + 2) * kStoriesSwapBytes);
    EXPECT_EQ(r.stats.bytes_in, r.stats.swap_ins * kStoriesSwapBytes);
    EXPECT_EQ(r.stats.bytes_out, r.stats.swap_outs * kStoriesSwapBytes);
    EXPECT_EQ(r.stats.host_layers, m);
    EXPECT_EQ(r.stats.steps, 7);
  }
}

// The CPU backend's copies end at once, so each swap started when a layer begins has ended
// by the next layer. By hand, with n = 5 over 7 steps:
//  m = 2 (3, 4 on the host): step 0 swaps out 0 at layer 1; then at each layer k from 2 on,
//   in k + 1 and out k - 1, mod 5 (at layer 4: in 0, for the next step: early). Step 0: 3 in, 4
//   out; every later step 5 and 5, one early each: 33 in, 34 out, 7 early.
//  m = 4 (one device buffer): at each layer but step 0's first, out the last layer, wait,
//   in this one: step 0: 4 and 4; later steps 5 and 5: 34 in, 34 out, none early.
TEST(KvSwap, StoriesSwapCountsFollowTheProtocol) {
  CpuBackend device(2);
  auto model = device_model(testing::stories_dir(), device);
  const Outcome two = greedy(*model, device, stories(), fixed(2));
  EXPECT_EQ(two.stats.swap_ins, 33);
  EXPECT_EQ(two.stats.swap_outs, 34);
  EXPECT_EQ(two.stats.early_swap_ins, 7);
  EXPECT_EQ(two.stats.stall_seconds, 0) << "a layer waited with m = 2";
  const Outcome four = greedy(*model, device, stories(), fixed(4));
  EXPECT_EQ(four.stats.swap_ins, 34);
  EXPECT_EQ(four.stats.swap_outs, 34);
  EXPECT_EQ(four.stats.early_swap_ins, 0);
}

TEST_F(KvSwapOnDevice, StoriesAdaptiveGreedyIdsAreLlama2cs) {
  Backend& device = *device_;
  auto model = device_model(testing::stories_dir(), device);
  for (int32_t start : {0, 4}) {
    SCOPED_TRACE(start);
    const Outcome r = greedy(*model, device, stories(), adaptive(start));
    expect_stories_reference(r);
    // From m = 0 the first step swaps nothing (no layer on the host): more expansion. (On
    // a GPU the copies overlap compute and the controller's later moves depend on timing.)
    if (start == 0 && dynamic_cast<CpuBackend*>(&device) != nullptr) {
      EXPECT_GE(r.stats.host_layers, 1) << r.stats.str();
    }
    EXPECT_EQ(r.memory.gpu, 5 * kStoriesSwapBytes);  // room for m = 0
  }
}

Workload dummy_llama() {
  Workload s;
  s.prompts = {{1, 450, 2001, 77}, {1, 9, 8, 7, 6, 5}, {1, 31999}};
  s.capacity = 32;
  return s;
}

TEST_F(KvSwapOnDevice, DummyLlamaGreedyIdsEqualTheResidentRun) {
  Backend& device = *device_;
  auto model = device_model("dummy:llama-12m", device);  // 4 layers
  Workload s = dummy_llama();
  const Outcome resident = greedy(*model, device, s, PieOptions{});
  for (const PieOptions& pie : {fixed(1), fixed(2), fixed(3), adaptive(0)}) {
    SCOPED_TRACE(pie.str());
    const Outcome r = greedy(*model, device, s, pie);
    EXPECT_EQ(r.ids, resident.ids);
    EXPECT_EQ(r.slot0, resident.slot0);
    EXPECT_GT(r.stats.swap_ins, 0);
  }
  // Two GPU batches per layer (the zig-zag block) share each layer's swap.
  s.gpu_batch_size = 2;
  EXPECT_EQ(greedy(*model, device, s, fixed(2)).ids, resident.ids);
  // A 4-bit cache swaps as stored.
  s.compress = true;
  const Outcome q4 = greedy(*model, device, s, PieOptions{});
  const Outcome q4_pie = greedy(*model, device, s, fixed(3));
  EXPECT_EQ(q4_pie.ids, q4.ids);
  EXPECT_EQ(q4_pie.slot0, q4.slot0);
  // So does an f16 one: half the bytes a swap, the same rows as the resident f16 cache.
  s.compress = false;
  s.cache_dtype = DType::kF16;
  const Outcome f16 = greedy(*model, device, s, PieOptions{});
  const Outcome f16_pie = greedy(*model, device, s, fixed(3));
  EXPECT_EQ(f16_pie.ids, f16.ids);
  EXPECT_EQ(f16_pie.slot0, f16.slot0);
  Workload f32 = s;
  f32.cache_dtype = DType::kF32;
  const KvSwapStats f32_pie = greedy(*model, device, f32, fixed(3)).stats;
  ASSERT_GT(f16_pie.stats.swap_ins, 0);
  ASSERT_GT(f32_pie.swap_ins, 0);
  EXPECT_EQ(2 * f16_pie.stats.bytes_in / f16_pie.stats.swap_ins,
            f32_pie.bytes_in / f32_pie.swap_ins);
}

// The mapping table's two phases against copies that only end when waited on (or after a
// few polls): a layer's attention must wait for its swap-in, a swap-in must not overwrite a
// buffer whose swap-out is pending, and a swap-out must leave after the layer's compute.
TEST(KvSwap, NoKernelTouchesALayerWhileItsSwapIsUnderWay) {
  for (int polls : {-1, 2}) {
    for (const PieOptions& pie : {fixed(1), fixed(2), fixed(4), adaptive(0)}) {
      SCOPED_TRACE(::testing::Message() << pie.str() << " polls " << polls);
      CpuBackend cpu(2);
      DeferredCopyBackend device(cpu, polls);
      auto model = device_model(testing::stories_dir(), device);
      const Outcome r = greedy(*model, device, stories(), pie);
      expect_stories_reference(r);
      EXPECT_EQ(device.hazards, 0);
      EXPECT_EQ(device.transfers, r.stats.swap_ins + r.stats.swap_outs);
      EXPECT_GT(device.attentions, 0);
      if (polls < 0) {
        EXPECT_GT(device.waits, 0) << "every copy ends by a wait";
      }
    }
  }
}

// Copies that never end by themselves and cost time to wait for: every m > 0 stalls, so
// the controller lowers m one step at a time down to 0, and the ids stay llama2.c's.
TEST(KvSwap, AdaptiveExpansionBacksOffWhenSwapsStall) {
  CpuBackend cpu(2);
  DeferredCopyBackend device(cpu, -1, std::chrono::milliseconds(2));
  PieOptions pie = adaptive(4);
  pie.controller.patience = 1;
  pie.controller.settle_tokens = 0;
  auto model = device_model(testing::stories_dir(), device);
  const Outcome r = greedy(*model, device, stories(), pie);
  expect_stories_reference(r);
  EXPECT_EQ(r.stats.host_layers, 0) << r.stats.str();
  EXPECT_EQ(r.stats.adjustments, 4) << r.stats.str();
  EXPECT_GT(r.stats.stall_seconds, 0);
  EXPECT_EQ(device.hazards, 0);
}

// KV hand-over between steps reads and writes a slot wherever the layer is now.
TEST(KvSwap, SlotCopiesFollowTheMappingTable) {
  CpuBackend device(2);
  LoadOptions lo;
  lo.device = &device;
  lo.w_gpu_percent = 100;
  LoadedModel m = load_model(testing::stories_dir(), lo);
  Model model(m.config, std::move(m.weights), device, 16, nullptr, std::move(m.feeder));
  CacheOptions co;
  co.placement.pie = fixed(3);
  model.set_cache_options(co);
  auto cache = model.make_cache(2, 16);
  StepBatch b;
  b.add(0, 0, std::vector<int32_t>{1, 2, 3}, true);
  std::vector<float> logits(static_cast<size_t>(m.config.vocab));
  model.forward(b, *cache, logits.data());
  const size_t bytes = cache->slot_bytes(3);
  for (int32_t i = 0; i < 5; ++i) {
    SCOPED_TRACE(i);
    std::vector<std::byte> in(bytes), out(bytes);
    for (size_t j = 0; j < bytes; ++j) in[j] = static_cast<std::byte>((j * 7 + 3 * i) & 0xff);
    cache->write_slot(device, i, 1, 3, in.data());
    cache->read_slot(device, i, 1, 3, out.data());
    EXPECT_EQ(in, out);
  }
  // Some layers were on the host when copied: the table decided, not the tier.
  int32_t on_host = 0;
  for (int32_t i = 0; i < 5; ++i) on_host += cache->swap()->table().on_gpu(i) ? 0 : 1;
  EXPECT_GT(on_host, 0);
}

using testing::input_error;

TEST(KvSwap, RefusesWhatItCannotRun) {
  CpuBackend cpu(2);
  LoadedModel m = load_model(testing::stories_dir());
  {  // the host computes: nothing to swap to
    Model host(m.config, std::move(m.weights), cpu, 16);
    CacheOptions co;
    co.placement.pie = fixed(1);
    host.set_cache_options(co);
    EXPECT_NE(input_error([&] { host.make_cache(1, 16); }).find("computes on the host"),
              std::string::npos);
  }
  CachePlacement p;
  p.device_tier = true;
  p.pie = fixed(1);
  p.gpu_percent = 60;
  p.cpu_percent = 40;
  EXPECT_NE(input_error([&] {
              KvCache(cpu, m.config, 1, 16, p);
            }).find("c=60/40/0 pie(m=1) puts 2 of 5 layers elsewhere"),
            std::string::npos);
  p.gpu_percent = 100;
  p.cpu_percent = 0;
  p.pie = fixed(5);
  EXPECT_NE(input_error([&] { KvCache(cpu, m.config, 1, 16, p); }).find("5 host layers of 5"),
            std::string::npos);
  p.pie = adaptive(1);
  p.pie.min_host_layers = 2;
  EXPECT_NE(input_error([&] {
              KvCache(cpu, m.config, 1, 16, p);
            }).find("starts at 1 host layers, outside [2, 4]"),
            std::string::npos);
}

// What a model computing with Pie holds, per tier, is what placement/ counts for it
// (place_stage with StageRequest::pie): the device n - lowest m layer buffers, the host
// min(n, highest m + 2), each a layer's K then its V at the next 256-byte boundary; f32 and
// 4-bit, fixed m and adaptive bounds, at a capacity whose layers are not whole 256 bytes.
TEST(KvSwap, PieMemoryIsWhatPlacementCounts) {
  CpuBackend cpu(2);
  constexpr int32_t kSlots = 3, kCapacity = 37, kRows = 64;
  PieOptions bounded = adaptive(2);
  bounded.min_host_layers = 1;
  bounded.max_host_layers = 3;
  for (bool compress : {false, true}) {
    for (const PieOptions& pie : {PieOptions{}, fixed(1), fixed(4), adaptive(0), bounded}) {
      LoadOptions lo;
      lo.device = &cpu;
      lo.w_gpu_percent = 100;
      lo.w_cpu_percent = 0;
      lo.disk_dir = testing::test_tmp_dir("kv_swap");
      LoadedModel m = load_model(testing::stories_dir(), lo);
      const ModelShape shape = m.config.shape();
      const int32_t n = m.config.n_layers;
      Model model(m.config, std::move(m.weights), cpu, kRows, nullptr, std::move(m.feeder));
      CacheOptions co;
      co.placement.pie = pie;
      co.placement.compress = compress;
      model.set_cache_options(co);
      const std::unique_ptr<KvCache> cache = model.make_cache(kSlots, kCapacity);
      TierBytes allocated = model.memory();
      allocated += cache->memory();

      StageRequest r = weight_request(lo);
      r.policy->compress_cache = compress;
      r.max_rows = kRows;
      r.kv_slots = kSlots;
      r.kv_capacity = kCapacity;
      if (pie.enabled())
        r.pie = PieHostLayers{pie.lowest_host_layers(), pie.highest_host_layers(n)};
      const StagePlacement planned = place_stage(shape, r);
      const std::string what =
          fmt::format("{} {}: {}", compress ? "4-bit" : "f32", pie.str(), planned.str());
      EXPECT_EQ(planned.total(), allocated)
          << what << "\nplanned " << planned.total().str() << ", allocated " << allocated.str();
      EXPECT_EQ(planned.cache_bytes(), cache->memory()) << what;

      // The cache's own bytes, from its shape alone.
      const auto layer = static_cast<int64_t>(cache->layer_bytes());
      const int64_t buffer = 2 * ((layer + 255) / 256 * 256);
      ASSERT_NE(layer % 256, 0) << "the capacity should leave V's alignment gap";
      if (!pie.enabled()) {
        EXPECT_EQ(cache->memory().gpu, 2 * layer * n) << what;
        continue;
      }
      const int32_t lowest = pie.adaptive ? pie.min_host_layers : pie.host_layers;
      const int32_t highest = !pie.adaptive             ? pie.host_layers
                              : pie.max_host_layers < 0 ? n - 1
                                                        : pie.max_host_layers;
      EXPECT_EQ(cache->memory().gpu, (n - lowest) * buffer) << what;
      EXPECT_EQ(cache->memory().cpu, std::min(n, highest + 2) * buffer) << what;
      EXPECT_EQ(cache->swap()->stats().host_layers, pie.host_layers) << what;
    }
  }
}

TEST(KvSwap, OptionsAndStatsPrintThemselves) {
  EXPECT_EQ(PieOptions{}.str(), "pie(off)");
  EXPECT_EQ(fixed(2).str(), "pie(m=2)");
  EXPECT_EQ(adaptive(0).str(), "pie(adaptive, m=0 in [0, n-1])");
  CachePlacement p;
  p.pie = fixed(2);
  EXPECT_EQ(p.str(), "c=100/0/0 pie(m=2)");
  KvSwapStats s;
  s.host_layers = 2;
  s.expansion = 9.0 / 7;
  s.swap_ins = 3;
  EXPECT_NE(s.str().find("pie m=2 (expansion 1.29): 3 swap-ins"), std::string::npos) << s.str();
  s.bytes_in = 196608;
  EXPECT_NE(s.json().find(R"("host_layers": 2, "expansion": 1.2857, "swap_ins": 3, )"),
            std::string::npos)
      << s.json();
  EXPECT_NE(s.json().find(R"("bytes_in": 196608, )"), std::string::npos) << s.json();
}

}  // namespace
}  // namespace strata
