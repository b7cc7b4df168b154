// Model loading: config.json parsing for both families, and the loader's refusals, each
// with a message that names the file and the tensor or field at fault.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "kernels/cpu_backend.h"
#include "kernels/error.h"
#include "support/stories_reference.h"
#include "worker/dummy.h"
#include "worker/loader.h"
#include "worker/model.h"
#include "worker/safetensors.h"
#include "worker/scoring.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

json stories_config() {
  std::ifstream in(testing::stories_dir() + "/config.json");
  return json::parse(in);
}

// A copy of stories260K with `edit` applied to its config and tensors.
struct ModelCopy {
  fs::path dir;
  explicit ModelCopy(const std::string& name) : dir(fs::path(STRATA_TEST_TMP) / "loader" / name) {
    fs::remove_all(dir);
    fs::create_directories(dir);
    fs::copy_file(fs::path(testing::stories_dir()) / "model.safetensors",
                  dir / "model.safetensors");
    write_config(stories_config());
  }
  void write_config(const json& j) const { std::ofstream(dir / "config.json") << j.dump(2); }
  // Rewrites the checkpoint keeping every tensor but those `keep` rejects, renaming or
  // reshaping through `edit`.
  template <typename Fn>
  void rewrite(Fn edit) const {
    auto src =
        SafetensorsFile::open((fs::path(testing::stories_dir()) / "model.safetensors").string());
    std::vector<TensorToWrite> out;
    std::vector<std::vector<float>> storage;
    storage.reserve(src->tensors().size());
    for (const auto& t : src->tensors()) {
      TensorToWrite w{t.name, src->view(t)};
      if (edit(w, storage)) out.push_back(w);
    }
    write_safetensors((dir / "model.safetensors").string(), out);
  }
};

template <typename Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const InputError& e) {
    return e.what();
  }
  return "<no InputError>";
}

TEST(Config, ParsesStoriesLlamaConfig) {
  const ModelConfig c = load_model_config(testing::stories_dir());
  EXPECT_TRUE(c.is_llama());
  EXPECT_EQ(c.hidden, 64);
  EXPECT_EQ(c.intermediate, 172);
  EXPECT_EQ(c.n_layers, 5);
  EXPECT_EQ(c.n_heads, 8);
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_EQ(c.vocab, 512);
  EXPECT_FLOAT_EQ(c.norm_eps, 1e-5f);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.eos_token_ids, std::vector<int32_t>{2});
}

TEST(Config, LlamaDefaultsFollowHuggingFace) {
  json j = {{"model_type", "llama"},
            {"hidden_size", 32},
            {"intermediate_size", 64},
            {"num_hidden_layers", 2},
            {"num_attention_heads", 4},
            {"vocab_size", 100},
            {"eos_token_id", json::array({2, 7})}};
  const ModelConfig c = parse_model_config(j, "cfg");
  EXPECT_EQ(c.n_kv_heads, 4);           // defaults to num_attention_heads
  EXPECT_EQ(c.head_dim, 8);             // hidden / heads
  EXPECT_FALSE(c.tie_word_embeddings);  // LlamaConfig default
  EXPECT_FLOAT_EQ(c.rope_theta, 10000.0f);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int32_t>{2, 7}));
}

TEST(Config, OptConventions) {
  json j = {{"architectures", {"OPTForCausalLM"}},
            {"hidden_size", 768},
            {"ffn_dim", 3072},
            {"num_hidden_layers", 12},
            {"num_attention_heads", 12},
            {"vocab_size", 50272},
            {"max_position_embeddings", 2048}};
  const ModelConfig c = parse_model_config(j, "cfg");
  EXPECT_TRUE(c.is_opt());
  EXPECT_EQ(c.position_offset, 2);
  EXPECT_TRUE(c.do_layer_norm_before);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_TRUE(c.attention_bias);
  EXPECT_TRUE(c.mlp_bias);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.word_embed_proj_dim, 768);
}

TEST(Config, RejectsHeadsNotDividingHidden) {
  json j = stories_config();
  j["num_attention_heads"] = 7;
  const std::string msg = error_of([&] { parse_model_config(j, "my/config.json"); });
  EXPECT_NE(msg.find("my/config.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("num_attention_heads 7"), std::string::npos) << msg;
  EXPECT_NE(msg.find("hidden_size 64"), std::string::npos) << msg;
}

TEST(Config, RejectsKvHeadsNotDividingHeads) {
  json j = stories_config();
  j["num_key_value_heads"] = 3;
  const std::string msg = error_of([&] { parse_model_config(j, "c.json"); });
  EXPECT_NE(msg.find("num_key_value_heads 3"), std::string::npos) << msg;
}

TEST(Config, RejectsMissingFieldUnknownArchitectureAndBadJson) {
  json j = stories_config();
  j.erase("hidden_size");
  EXPECT_NE(error_of([&] { parse_model_config(j, "c.json"); }).find("'hidden_size'"),
            std::string::npos);
  json k = stories_config();
  k["model_type"] = "gpt2";
  k["architectures"] = {"GPT2LMHeadModel"};
  EXPECT_NE(error_of([&] { parse_model_config(k, "c.json"); }).find("gpt2"), std::string::npos);
  ModelCopy copy("BadJson");
  std::ofstream(copy.dir / "config.json") << "{ not json";
  EXPECT_NE(error_of([&] { load_model_config(copy.dir.string()); }).find("not valid JSON"),
            std::string::npos);
}

TEST(Loader, MissingModelDirectory) {
  const std::string msg = error_of([] { load_model("/nonexistent/model-dir"); });
  EXPECT_NE(msg.find("/nonexistent/model-dir"), std::string::npos) << msg;
  EXPECT_NE(msg.find("does not exist"), std::string::npos) << msg;
}

TEST(Loader, UnknownDummyName) {
  const std::string msg = error_of([] { load_model("dummy:opt-7t"); });
  EXPECT_NE(msg.find("opt-7t"), std::string::npos) << msg;
  EXPECT_NE(msg.find("opt-125m"), std::string::npos) << "should list the known names: " << msg;
}

TEST(Loader, RejectsShapeThatDisagreesWithConfig) {
  ModelCopy copy("ShapeMismatch");
  json j = stories_config();
  j["intermediate_size"] = 160;  // the checkpoint's MLP is 172 wide
  copy.write_config(j);
  const std::string msg = error_of([&] { load_model(copy.dir.string()); });
  EXPECT_NE(msg.find("model.safetensors"), std::string::npos) << msg;
  EXPECT_NE(msg.find("model.layers.0.mlp.gate_proj.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[172, 64]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[160, 64]"), std::string::npos) << msg;
}

TEST(Loader, RejectsMissingTensor) {
  ModelCopy copy("MissingTensor");
  copy.rewrite(
      [](TensorToWrite& w, auto&) { return w.name != "model.layers.3.self_attn.v_proj.weight"; });
  const std::string msg = error_of([&] { load_model(copy.dir.string()); });
  EXPECT_NE(msg.find("model.layers.3.self_attn.v_proj.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("missing"), std::string::npos) << msg;
  EXPECT_NE(msg.find(copy.dir.string()), std::string::npos) << msg;
}

TEST(Loader, UntiedHeadNeedsLmHead) {
  ModelCopy copy("UntiedNoHead");
  json j = stories_config();
  j["tie_word_embeddings"] = false;
  copy.write_config(j);
  copy.rewrite([](TensorToWrite& w, auto&) { return w.name != "lm_head.weight"; });
  EXPECT_NE(error_of([&] { load_model(copy.dir.string()); }).find("lm_head.weight"),
            std::string::npos);
}

TEST(Loader, HalfPrecisionCheckpointLoadsAndStaysClose) {
  // bf16 and f16 copies of stories260K: matrices stay in their dtype, vectors become f32.
  for (DType dt : {DType::kF16, DType::kBF16}) {
    ModelCopy copy(std::string("Half_") + dtype_name(dt));
    copy.rewrite([dt](TensorToWrite& w, std::vector<std::vector<float>>& storage) {
      const size_t n = static_cast<size_t>(w.tensor.shape.numel());
      storage.emplace_back((n * 2 + 3) / 4);
      convert_from_f32(dt, w.tensor.as<const float>(), storage.back().data(), n);
      w.tensor.data = storage.back().data();
      w.tensor.dtype = dt;
      return true;
    });
    LoadedModel m = load_model(copy.dir.string());
    EXPECT_EQ(m.weights.layers[0].q.dtype, dt);
    EXPECT_EQ(m.weights.layers[0].attn_norm.dtype, DType::kF32);
    EXPECT_EQ(m.weights.embed.dtype, dt);
    // Teacher-forced logits stay near the f32 reference (rounding the weights is the only change).
    const auto ref = testing::load_stories_references().front();
    const auto seq = ref.sequence();
    CpuBackend backend(1);
    Model model(m.config, std::move(m.weights), backend, 128);
    const std::vector<float> logits = teacher_forced_logits(model, seq, 128);
    float worst = 0;
    for (size_t i = 0; i < logits.size(); ++i)
      worst = std::max(worst, std::fabs(logits[i] - ref.logits[i]));
    const float bound = dt == DType::kF16 ? 0.05f : 0.5f;  // 11 vs 8 significand bits
    EXPECT_LT(worst, bound) << dtype_name(dt);
    EXPECT_GT(worst, 0.0f) << "rounded weights should change the logits a little";
    std::printf("%s weights: max |logit - f32 reference| = %.5f\n", dtype_name(dt), worst);
  }
}

TEST(Dummy, ShapesMatchFlexGenAndLlama) {
  const ModelConfig opt = dummy_model_config("opt-30b");
  EXPECT_EQ(opt.hidden, 7168);
  EXPECT_EQ(opt.intermediate, 28672);
  EXPECT_EQ(opt.n_layers, 48);
  EXPECT_EQ(opt.n_heads, 56);
  EXPECT_NEAR(static_cast<double>(opt.shape().total_params()) / 1e9, 30.0, 0.2);
  const ModelConfig llama = dummy_model_config("llama-110m");
  EXPECT_EQ(llama.hidden, 768);
  EXPECT_EQ(llama.intermediate, 2048);
  EXPECT_EQ(llama.n_layers, 12);
  EXPECT_EQ(llama.n_heads, 12);
  EXPECT_EQ(llama.vocab, 32000);
  const ModelConfig l7 = dummy_model_config("llama-7b");
  EXPECT_NEAR(static_cast<double>(l7.shape().total_params()) / 1e9, 6.74, 0.02);
  const ModelConfig o175 = dummy_model_config("opt-175b");
  EXPECT_NEAR(static_cast<double>(o175.shape().total_params()) / 1e9, 175.0, 1.0);
}

TEST(Dummy, WeightsAreDeterministicPerTensorAndSeed) {
  OwnedTensor a(DType::kF32, {64, 32}), b(DType::kF32, {64, 32}), c(DType::kF32, {64, 32});
  fill_dummy_tensor(3, "model.layers.5.mlp.up_proj.weight", 32, a.view);
  fill_dummy_tensor(3, "model.layers.5.mlp.up_proj.weight", 32, b.view);
  fill_dummy_tensor(4, "model.layers.5.mlp.up_proj.weight", 32, c.view);
  EXPECT_EQ(0, std::memcmp(a.view.data, b.view.data, a.view.bytes()));
  EXPECT_NE(0, std::memcmp(a.view.data, c.view.data, a.view.bytes()));
  // Values stay within the fan-in scale.
  for (int64_t i = 0; i < a.view.shape.numel(); ++i)
    EXPECT_LE(std::fabs(a.view.as<float>()[i]), 1.0f / std::sqrt(32.0f));
}

TEST(Dummy, HugeShapeIsRefusedBeforeAllocating) {
  try {
    load_model("dummy:opt-175b");
    FAIL() << "opt-175b cannot fit in host memory here";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kOverloaded);
    EXPECT_NE(std::string(e.what()).find("GiB"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace strata
