// WAA's KV hand-over between pipeline stages in one process: the KV cache a decode stage
// receives from the prefill stages (each exporting the layers the two share) equals, bit for
// bit, the cache the decode stage computes itself when it prefills the same prompts; the
// next decode step samples the same tokens from either. Over a prefill side and a decode
// side split at different layers (so one decode stage receives from two prefill stages),
// with the cache f32 in memory, 4-bit compressed, and half on disk. The `gpu` label builds
// it again with the CUDA backend (the cache in device memory).
#include <gtest/gtest.h>

#include <cstring>

#include "kernels/cpu_backend.h"
#include "support/test_device.h"
#include "worker/loader.h"
#include "worker/stage.h"

namespace strata {
namespace {

using Ranges = std::vector<std::pair<int, int>>;

ClusterPlan waa_plan(const std::string& spec, const ModelConfig& c, const Ranges& prefill,
                     const Ranges& decode) {
  ClusterPlan p;
  p.model_spec = spec;
  p.num_layers = c.n_layers;
  p.hidden_size = c.hidden;
  p.max_batch_rows = 64;
  p.kv_slots = 4;
  p.kv_capacity = 32;
  p.encoder_stages = static_cast<int32_t>(prefill.size());
  p.encoder_kv_slots = 3;
  for (const Ranges* side : {&prefill, &decode})
    for (size_t i = 0; i < side->size(); ++i) {
      StagePlan s;
      s.rank = static_cast<int32_t>(p.stages.size()) + 1;
      s.layer_begin = (*side)[i].first;
      s.layer_end = (*side)[i].second;
      s.has_embedding = i == 0;
      s.has_head = i + 1 == side->size();
      p.stages.push_back(s);
    }
  p.validate();
  return p;
}

using Stages = std::vector<std::unique_ptr<PipelineStage>>;

// One step through a chain of stages, activations handed on by hand; the last samples.
std::vector<SeqToken> run(Stages& chain, const StepCommand& c) {
  std::vector<float> act;
  std::vector<SeqToken> tokens;
  for (auto& s : chain) {
    std::vector<float> next(
        s->last() ? 0 : static_cast<size_t>(c.rows()) * static_cast<size_t>(s->hidden()));
    tokens = s->run(c, act, next);
    act = std::move(next);
  }
  return tokens;
}

const std::vector<std::vector<int32_t>> kPrompts = {{1, 403, 407, 261, 378}, {1, 291, 280}};

StepCommand prefill(uint64_t step, const std::vector<int32_t>& slots) {
  StepCommand c{step, Phase::kPrefill, 0, {}};
  for (size_t i = 0; i < kPrompts.size(); ++i)
    c.seqs.push_back(
        SeqStep{i, slots[i], 0, static_cast<int32_t>(kPrompts[i].size()), kPrompts[i]});
  return c;
}

// The decode side's sequence ids for what it received (its own prefill used 0, 1).
constexpr uint64_t kHanded = 10;

StepCommand decode(uint64_t step, uint64_t first_id, const std::vector<int32_t>& slots,
                   const std::vector<SeqToken>& first) {
  StepCommand c{step, Phase::kDecode, 0, {}};
  for (size_t i = 0; i < kPrompts.size(); ++i)
    c.seqs.push_back(SeqStep{
        first_id + i, slots[i], static_cast<int32_t>(kPrompts[i].size()), 1, {first[i].token}});
  return c;
}

std::vector<int32_t> tokens(const std::vector<SeqToken>& t) {
  std::vector<int32_t> out;
  for (const SeqToken& x : t) out.push_back(x.token);
  return out;
}

std::vector<KvMove> moves(const std::vector<int32_t>& from, const std::vector<int32_t>& to) {
  std::vector<KvMove> out;
  for (size_t i = 0; i < kPrompts.size(); ++i)
    out.push_back(KvMove{i, from[i], to[i], static_cast<int32_t>(kPrompts[i].size())});
  return out;
}

std::vector<std::byte> exported(PipelineStage& s, const std::vector<KvMove>& m) {
  const StagePlan& p = s.stage();
  std::vector<std::byte> out(s.kv_bytes(m, p.layer_begin, p.layer_end));
  s.export_kv(m, p.layer_begin, p.layer_end, out.data());
  return out;
}

// The slot's first n positions of every kv head of one layer, K and V, read straight from
// an f32 cache in host memory ([slot][head][position][head_dim], worker/kv_cache.h).
std::vector<float> slot_rows(const KvCache& cache, int32_t layer, int32_t slot, int32_t n) {
  const KvLayerView v = cache.layer(layer);
  std::vector<float> out;
  for (const float* t : {v.k_f32(), v.v_f32()})
    for (int32_t h = 0; h < v.n_kv_heads; ++h) {
      const float* row = t + static_cast<size_t>(slot) * v.slot_stride() +
                         static_cast<size_t>(h) * v.head_stride();
      out.insert(out.end(), row, row + static_cast<size_t>(n) * v.head_dim);
    }
  return out;
}

struct Case {
  std::string spec;
  Ranges prefill, decode;
  bool compress = false;
  bool disk = false;
};

void expect_handover_exact(const Case& k, Backend& backend, bool host_cache) {
  const ModelConfig config = load_model(k.spec).config;
  const ClusterPlan plan = waa_plan(k.spec, config, k.prefill, k.decode);
  StageOptions o;
  o.cache.placement.compress = k.compress;
  if (k.disk) {
    o.cache.placement.gpu_percent = 50;
    o.cache.placement.cpu_percent = 0;
    o.cache.placement.disk_dir = testing::test_tmp_dir("kv_handover");
  }
  if (backend.device() != Device::kHost) o.load.device = &backend;
  Stages enc, dec;
  for (const StagePlan& s : plan.stages)
    (plan.encoder(s) ? enc : dec).push_back(std::make_unique<PipelineStage>(plan, s, backend, o));
  // Seeded sampling: the prefill side samples the first token, the decode side goes on
  // with the sequence's RNG one draw on (join_after_prefill), as one pipeline would.
  auto sampling = [](size_t i) {
    SamplingParams p;
    p.temperature = 0.8f;
    p.top_k = 20;
    p.seed = 7 + i;
    return p;
  };
  for (size_t i = 0; i < kPrompts.size(); ++i) {
    enc.back()->join(SeqJoin{i, 0, sampling(i)});
    dec.back()->join(SeqJoin{i, 0, sampling(i)});
    dec.back()->join_after_prefill(SeqJoin{kHanded + i, 0, sampling(i)});
  }
  // The prefill side prefills into its slots 1, 2; the decode side prefills the same
  // prompts itself into slots 3, 0, and receives the prefill side's into slots 1, 2.
  const std::vector<int32_t> enc_slots = {1, 2}, own = {3, 0}, handed = {1, 2};
  const std::vector<SeqToken> first = run(enc, prefill(1, enc_slots));
  const std::vector<SeqToken> own_first = run(dec, prefill(2, own));
  ASSERT_EQ(first, own_first);
  const std::vector<KvMove> m = moves(enc_slots, handed);
  size_t total = 0;
  for (auto& d : dec)
    for (auto& e : enc) {
      const int32_t b = std::max(d->stage().layer_begin, e->stage().layer_begin);
      const int32_t end = std::min(d->stage().layer_end, e->stage().layer_end);
      if (b >= end) continue;
      std::vector<std::byte> bytes(e->kv_bytes(m, b, end));
      e->export_kv(m, b, end, bytes.data());
      d->import_kv(m, b, end, bytes.data());
      total += bytes.size();
    }
  // What moved: every layer's K and V of 5 + 3 positions; f32 rows of kv_width floats, or
  // 4-bit codes plus an f32 min and scale per group of head_dim (64 at most) values.
  const auto positions = static_cast<size_t>(kPrompts[0].size() + kPrompts[1].size());
  const auto width = static_cast<size_t>(config.kv_width());
  const size_t group = static_cast<size_t>(std::min(config.head_dim, 64));
  const size_t per_row =
      k.compress ? width / 2 + 2 * sizeof(float) * width / group : width * sizeof(float);
  EXPECT_EQ(total, static_cast<size_t>(config.n_layers) * 2 * positions * per_row);
  for (auto& d : dec) {
    const std::vector<std::byte> got = exported(*d, moves(handed, handed));
    const std::vector<std::byte> want = exported(*d, moves(own, own));
    ASSERT_EQ(got.size(), want.size());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size()), 0)
        << "decode stage " << d->stage().str();
    if (!host_cache) continue;
    for (int32_t l = 0; l < d->stage().n_layers(); ++l)
      for (size_t i = 0; i < kPrompts.size(); ++i) {
        const auto n = static_cast<int32_t>(kPrompts[i].size());
        const std::vector<float> a = slot_rows(d->kv_cache(), l, handed[i], n);
        const std::vector<float> b = slot_rows(d->kv_cache(), l, own[i], n);
        EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
            << "layer " << l << " sequence " << i;
        EXPECT_TRUE(std::any_of(a.begin(), a.end(), [](float x) { return x != 0; }));
      }
  }
  // Decoding on from the handed-over slots samples what decoding from its own does.
  EXPECT_EQ(tokens(run(dec, decode(3, kHanded, handed, first))),
            tokens(run(dec, decode(4, 0, own, first))));
}

#ifndef STRATA_TEST_CUDA
TEST(KvHandover, Stories260KSidesSplitDifferentlyF32) {
  CpuBackend cpu(1);
  expect_handover_exact({STRATA_MODEL_DIR, {{0, 3}, {3, 5}}, {{0, 2}, {2, 4}, {4, 5}}}, cpu, true);
}

TEST(KvHandover, Stories260KCompressedCache) {
  CpuBackend cpu(1);
  expect_handover_exact({STRATA_MODEL_DIR, {{0, 5}}, {{0, 2}, {2, 5}}, true}, cpu, false);
}

TEST(KvHandover, OptDummyCacheHalfOnDisk) {
  CpuBackend cpu(1);
  expect_handover_exact({"dummy:opt-125m", {{0, 7}, {7, 12}}, {{0, 4}, {4, 12}}, false, true}, cpu,
                        false);
}

TEST(KvHandover, MoveOutsideTheStageIsNamed) {
  CpuBackend cpu(1);
  const ModelConfig config = load_model(STRATA_MODEL_DIR).config;
  const ClusterPlan plan = waa_plan(STRATA_MODEL_DIR, config, {{0, 5}}, {{0, 2}, {2, 5}});
  PipelineStage d(plan, plan.stages[1], cpu, StageOptions{});
  std::vector<std::byte> buf(1 << 16);
  try {
    d.import_kv({{KvMove{7, 0, 9, 3}}}, 0, 2, buf.data());
    FAIL() << "slot 9 of 4 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("seq 7 slot 0 -> 9 (3 positions) does not fit 4 KV slots"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(d.export_kv({{KvMove{7, 0, 0, 3}}}, 1, 4, buf.data()), Error);  // layers [1, 4)
}
#else
TEST(KvHandoverCuda, Stories260KCacheInDeviceMemory) {
  std::unique_ptr<Backend> device = testing::make_test_device();
  if (!device) GTEST_SKIP() << "no CUDA device";
  expect_handover_exact({STRATA_MODEL_DIR, {{0, 3}, {3, 5}}, {{0, 2}, {2, 5}}}, *device, false);
  expect_handover_exact({STRATA_MODEL_DIR, {{0, 5}}, {{0, 4}, {4, 5}}, true}, *device, false);
}
#endif

}  // namespace
}  // namespace strata
