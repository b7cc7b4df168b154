// Pipeline stages in one process: a model split into stages (each loading only its layers)
// and chained by hand gives the one-stage local run's tokens exactly, greedy and
// seeded; the layer-range loader builds only the stage's tensors. Stages that offload
// (weights over the tiers, KV cache off the device, several GPU batches per block,
// activations exchanged in device memory) give the same tokens: built twice like
// test_layer_feeder, with the CPU backend standing in for the device and, as the `gpu`
// label, with the CUDA backend.
#include <gtest/gtest.h>

#include "coordinator/run/local_stages.h"
#include "kernels/cpu_backend.h"
#include "kernels/error.h"
#include "support/stories_reference.h"
#include "support/test_device.h"
#include "worker/loader.h"
#include "worker/stage.h"

namespace strata {
namespace {

ClusterPlan plan_for(const std::string& spec, const ModelConfig& c,
                     std::vector<std::pair<int, int>> ranges) {
  ClusterPlan p;
  p.model_spec = spec;
  p.num_layers = c.n_layers;
  p.hidden_size = c.hidden;
  p.max_batch_rows = 64;
  p.kv_slots = 4;
  p.kv_capacity = 64;
  for (size_t i = 0; i < ranges.size(); ++i) {
    StagePlan s;
    s.rank = static_cast<int32_t>(i) + 1;
    s.layer_begin = ranges[i].first;
    s.layer_end = ranges[i].second;
    s.has_embedding = i == 0;
    s.has_head = i + 1 == ranges.size();
    p.stages.push_back(s);
  }
  p.validate();
  return p;
}

// Runs prompts through a chain of stages: one prefill step, then decode steps, the last
// stage sampling; returns each sequence's tokens. With `io_device` the activations between
// stages live in that backend's memory, as over an NCCL link.
std::vector<std::vector<int32_t>> run_chain(std::vector<std::unique_ptr<PipelineStage>>& stages,
                                            const std::vector<GenerationRequest>& requests,
                                            Backend* io_device = nullptr) {
  std::vector<std::vector<int32_t>> out(requests.size());
  StepCommand c{1, Phase::kPrefill, 0, {}};
  for (size_t i = 0; i < requests.size(); ++i) {
    stages.back()->join(SeqJoin{i, static_cast<int32_t>(i), requests[i].sampling});
    const auto n = static_cast<int32_t>(requests[i].prompt_ids.size());
    c.seqs.push_back(SeqStep{i, static_cast<int32_t>(i), 0, n, requests[i].prompt_ids});
  }
  const bool dev = io_device != nullptr;
  for (int32_t step = 0; step < requests[0].max_new_tokens; ++step) {
    std::vector<float> act;
    DeviceBuffer act_dev;
    std::vector<SeqToken> tokens;
    for (auto& s : stages) {
      const size_t n =
          s->last() ? 0 : static_cast<size_t>(c.rows()) * static_cast<size_t>(s->hidden());
      std::vector<float> next(dev ? 0 : n);
      DeviceBuffer next_dev = dev ? DeviceBuffer(*io_device, n * sizeof(float)) : DeviceBuffer();
      std::span<const float> from = act;
      std::span<float> to = next;
      if (dev) {
        from = std::span<const float>(act_dev.f32(), act_dev.size() / sizeof(float));
        to = std::span<float>(next_dev.f32(), n);
      }
      tokens = s->run(c, from, to, dev, dev);
      act = std::move(next);
      act_dev = std::move(next_dev);
    }
    StepCommand d{c.step_id + 1, Phase::kDecode, 0, {}};
    for (size_t i = 0; i < tokens.size(); ++i) {
      out[i].push_back(tokens[i].token);
      d.seqs.push_back(SeqStep{
          i, static_cast<int32_t>(i), c.seqs[i].n_past + c.seqs[i].n_new, 1, {tokens[i].token}});
    }
    c = d;
  }
  return out;
}

std::vector<GenerationResult> single_process(const std::string& spec,
                                             const std::vector<GenerationRequest>& requests,
                                             Backend* device = nullptr) {
  CpuBackend cpu(2);
  Backend& backend = device ? *device : cpu;
  LoadOptions lo;
  lo.device = device;
  LoadedModel m = load_model(spec, lo);
  Model model(m.config, std::move(m.weights), backend, 64, nullptr, std::move(m.feeder));
  LocalCluster gen(model, LocalOptions{4, 64, 64});
  return gen.run(requests);
}

void expect_chain_matches(const std::string& spec, std::vector<std::pair<int, int>> ranges,
                          std::vector<GenerationRequest> requests) {
  CpuBackend backend(2);
  const ModelConfig config = load_model(spec).config;
  const ClusterPlan plan = plan_for(spec, config, ranges);
  std::vector<std::unique_ptr<PipelineStage>> stages;
  for (const StagePlan& s : plan.stages)
    stages.push_back(std::make_unique<PipelineStage>(plan, s, backend, StageOptions{}));
  const auto chain = run_chain(stages, requests);
  const auto want = single_process(spec, requests);
  for (size_t i = 0; i < requests.size(); ++i)
    EXPECT_EQ(chain[i], want[i].output_ids) << spec << " request " << i;
}

std::vector<GenerationRequest> requests(std::vector<std::vector<int32_t>> prompts, int32_t n,
                                        float temperature) {
  std::vector<GenerationRequest> out;
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerationRequest r;
    r.prompt_ids = prompts[i];
    r.max_new_tokens = n;
    r.ignore_eos = true;
    r.sampling.temperature = temperature;
    r.sampling.top_k = temperature > 0 ? 40 : 0;
    r.sampling.seed = 7 + i;
    out.push_back(r);
  }
  return out;
}

TEST(PipelineStage, Stories260KChainMatchesLocalRunGreedy) {
  expect_chain_matches(STRATA_MODEL_DIR, {{0, 2}, {2, 3}, {3, 5}},
                       requests({{1, 403, 407, 261, 378}, {1, 291, 280}, {1, 317}}, 12, 0.0f));
}

TEST(PipelineStage, Stories260KChainMatchesLocalRunSeeded) {
  expect_chain_matches(STRATA_MODEL_DIR, {{0, 4}, {4, 5}},
                       requests({{1, 403, 407, 261, 378}, {1, 291, 280}}, 10, 0.9f));
}

TEST(PipelineStage, OptDummyChainMatchesLocalRun) {
  expect_chain_matches("dummy:opt-125m", {{0, 5}, {5, 12}},
                       requests({{2, 100, 200}, {2, 5, 6, 7, 8}}, 3, 0.0f));
}

std::string disk_dir() {
  return testing::test_tmp_dir("stage");
}

// Each stage offloads its own share: weights wg% on the device, wc% in host memory, the
// rest on disk; the KV cache half on the device and half in host memory (attended on the
// host); blocks of one-sequence GPU batches; activations handed over in device memory.
void expect_offloaded_chain_matches(const std::string& spec,
                                    std::vector<std::pair<int, int>> ranges, int wg, int wc,
                                    std::vector<GenerationRequest> reqs) {
  std::unique_ptr<Backend> device = testing::make_test_device();
  if (!device) GTEST_SKIP() << "no CUDA device";
  CpuBackend host(2);
  const ModelConfig config = load_model(spec).config;
  const ClusterPlan plan = plan_for(spec, config, ranges);
  StageOptions o;
  o.load.device = device.get();
  o.load.disk_dir = disk_dir();
  o.load.w_gpu_percent = wg;
  o.load.w_cpu_percent = wc;
  o.cache.placement.gpu_percent = 50;
  o.cache.placement.cpu_percent = 50;
  o.cache.cpu_attention = true;
  o.cache.host = &host;
  o.cache.placement.disk_dir = disk_dir();
  o.gpu_batch_size = 1;
  std::vector<std::unique_ptr<PipelineStage>> stages;
  for (const StagePlan& s : plan.stages)
    stages.push_back(std::make_unique<PipelineStage>(plan, s, *device, o));
  const auto chain = run_chain(stages, reqs, device.get());
  const auto want = single_process(spec, reqs, device.get());
  for (size_t i = 0; i < reqs.size(); ++i)
    EXPECT_EQ(chain[i], want[i].output_ids) << spec << " request " << i;
}

TEST(PipelineStageOffloading, Stories260KStagesOverEveryTierMatchLocalRun) {
  expect_offloaded_chain_matches(
      STRATA_MODEL_DIR, {{0, 2}, {2, 5}}, 20, 40,
      requests({{1, 403, 407, 261, 378}, {1, 291, 280}, {1, 317}}, 12, 0.0f));
}

TEST(PipelineStageOffloading, OptDummyStagesFromHostMemoryMatchLocalRun) {
  expect_offloaded_chain_matches("dummy:opt-125m", {{0, 6}, {6, 9}, {9, 12}}, 0, 100,
                                 requests({{2, 100, 200}, {2, 5, 6, 7, 8}}, 3, 0.0f));
}

TEST(PipelineStage, LoaderBuildsOnlyTheStageLayers) {
  LoadOptions whole;
  const LoadedModel full = load_model(STRATA_MODEL_DIR, whole);
  LoadOptions middle;
  middle.layer_begin = 2;
  middle.layer_end = 4;
  middle.embedding = false;
  middle.head = false;
  const LoadedModel part = load_model(STRATA_MODEL_DIR, middle);
  EXPECT_EQ(part.config.n_layers, 2);
  EXPECT_EQ(part.layer_begin, 2);
  ASSERT_EQ(part.weights.layers.size(), 2u);
  EXPECT_EQ(part.weights.embed.data, nullptr);
  EXPECT_EQ(part.weights.lm_head.data, nullptr);
  EXPECT_EQ(part.weights.final_norm.data, nullptr);
  const Tensor& a = part.weights.layers[0].q;
  const Tensor& b = full.weights.layers[2].q;
  ASSERT_EQ(a.bytes(), b.bytes());
  EXPECT_EQ(std::memcmp(a.data, b.data, a.bytes()), 0);  // layer 2 of the model, not layer 0
  LoadOptions bad;
  bad.layer_begin = 4;
  bad.layer_end = 9;
  EXPECT_THROW(load_model(STRATA_MODEL_DIR, bad), InputError);
}

}  // namespace
}  // namespace strata
