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
#include "worker/tokenizer.h"
#include "worker/weights.h"

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
  EXPECT_EQ(c.family, ModelFamily::kLlama);
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

// A spec's config: a dummy's shape in the dtype asked for, a folder's config.json as stored.
TEST(Config, SpecIsADummyOrAFolder) {
  const ModelConfig dummy = load_spec_config("dummy:opt-125m", DType::kF16);
  EXPECT_EQ(dummy.source, "dummy:opt-125m");
  EXPECT_EQ(dummy.hidden, 768);
  EXPECT_EQ(dummy.n_layers, 12);
  EXPECT_EQ(dummy.dtype, DType::kF16);
  const ModelConfig folder = load_spec_config(testing::stories_dir(), DType::kF16);
  EXPECT_EQ(folder.hidden, 64);
  EXPECT_EQ(folder.dtype, load_model_config(testing::stories_dir()).dtype);
  EXPECT_NE(error_of([] { (void)load_spec_config("", DType::kF32); }).find("no model given"),
            std::string::npos);
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
  EXPECT_EQ(c.family, ModelFamily::kOpt);
  EXPECT_EQ(c.position_offset, 2);
  EXPECT_TRUE(c.do_layer_norm_before);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_TRUE(c.attention_bias);
  EXPECT_TRUE(c.mlp_bias);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.word_embed_proj_dim, 768);
}

// The table of architecture differences, against Hugging Face's modelling code:
// LlamaDecoderLayer (RMSNorm before attention and MLP, rotary, SwiGLU, a final norm) and
// OPTDecoderLayer (LayerNorm with bias, learned positions at offset 2, fc1-ReLU-fc2; with
// do_layer_norm_before false the norms follow the residual adds and OPTDecoder builds no
// final_layer_norm; OPT-350m embeds 512 wide and projects in and out).
TEST(Config, ArchitectureIsTheFamilyAsData) {
  const Architecture llama = parse_model_config(stories_config(), "cfg").architecture();
  EXPECT_EQ(llama.norm, NormKind::kRms);
  EXPECT_EQ(llama.mlp, MlpKind::kGatedSilu);
  EXPECT_EQ(llama.positions, PositionKind::kRotary);
  EXPECT_TRUE(llama.pre_norm);
  EXPECT_TRUE(llama.final_norm);
  EXPECT_EQ(llama.position_offset, 0);
  EXPECT_EQ(llama.embed_dim, 64);

  json opt = {{"architectures", {"OPTForCausalLM"}},
              {"hidden_size", 1024},
              {"ffn_dim", 4096},
              {"num_hidden_layers", 2},
              {"num_attention_heads", 16},
              {"vocab_size", 50272},
              {"max_position_embeddings", 2048}};
  const Architecture pre = parse_model_config(opt, "cfg").architecture();
  EXPECT_EQ(pre.norm, NormKind::kLayer);
  EXPECT_EQ(pre.mlp, MlpKind::kRelu);
  EXPECT_EQ(pre.positions, PositionKind::kLearned);
  EXPECT_TRUE(pre.pre_norm);
  EXPECT_TRUE(pre.final_norm);
  EXPECT_EQ(pre.position_offset, 2);
  EXPECT_EQ(pre.embed_dim, 1024);

  opt["do_layer_norm_before"] = false;
  opt["word_embed_proj_dim"] = 512;
  const Architecture post = parse_model_config(opt, "cfg").architecture();
  EXPECT_FALSE(post.pre_norm);
  EXPECT_FALSE(post.final_norm);
  EXPECT_EQ(post.embed_dim, 512);
}

// generation_config.json as Llama-3 ships it: two more eos ids, sampling defaults.
TEST(Config, GenerationConfigAddsEosIdsAndSamplingDefaults) {
  ModelConfig c = dummy_model_config("llama-110m");
  c.eos_token_ids = {2};
  read_generation_config(
      R"({"bos_token_id": 1, "eos_token_id": [2, 7, 9], "do_sample": true, "temperature": 0.6,)"
      R"( "top_p": 0.9, "top_k": 40, "max_new_tokens": 100})",
      "m/generation_config.json", c);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int32_t>{2, 7, 9}));  // 2 once
  EXPECT_FLOAT_EQ(*c.generation.temperature, 0.6f);
  EXPECT_FLOAT_EQ(*c.generation.top_p, 0.9f);
  EXPECT_EQ(*c.generation.top_k, 40);
  EXPECT_EQ(*c.generation.max_new_tokens, 100);
  EXPECT_FALSE(c.generation.repetition_penalty.has_value());
  EXPECT_EQ(c.generation.str(), "temperature=0.6 top_k=40 top_p=0.9 max_new_tokens=100");
  try {
    read_generation_config(R"({"temperature": "warm"})", "m/generation_config.json", c);
    ADD_FAILURE() << "a string temperature was accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("m/generation_config.json: field 'temperature'"),
              std::string::npos)
        << e.what();
  }
  // The stories folder's file (do_sample false, no sampling fields) sets no defaults.
  const ModelConfig stories = load_model_config(STRATA_MODEL_DIR);
  EXPECT_EQ(stories.generation.str(), "none");
  EXPECT_EQ(stories.eos_token_ids, (std::vector<int32_t>{2}));
}

TEST(Config, RejectsHeadsNotDividingHidden) {
  json j = stories_config();
  j["num_attention_heads"] = 7;
  j.erase("head_dim");  // a head_dim of its own need not be hidden / heads (Gemma-2, Qwen3)
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

// Failure 2 of issue 10: nonsense values that would run to garbage are refused by name.
TEST(Config, RejectsNormEpsilonOutOfRange) {
  for (double eps : {1e308, 0.0, -1e-5, 0.5}) {
    json j = stories_config();
    j["rms_norm_eps"] = eps;
    const std::string msg = error_of([&] { parse_model_config(j, "m/config.json"); });
    EXPECT_NE(msg.find("m/config.json"), std::string::npos) << msg;
    EXPECT_NE(msg.find("rms_norm_eps"), std::string::npos) << msg;
  }
  json j = stories_config();
  j["rms_norm_eps"] = 1e-12;  // BERT-style, the smallest in common use
  EXPECT_FLOAT_EQ(parse_model_config(j, "c").norm_eps, 1e-12f);
}

TEST(Config, RejectsRopeFactorsThatAreNotPositive) {
  for (const char* type : {"linear", "llama3"}) {
    for (double factor : {0.0, -1.0}) {
      json j = stories_config();
      j["rope_scaling"] = {{"rope_type", type}, {"factor", factor}};
      const std::string msg = error_of([&] { parse_model_config(j, "c.json"); });
      EXPECT_NE(msg.find("rope_scaling.factor must be positive"), std::string::npos) << msg;
    }
  }
  json j = stories_config();
  j["rope_scaling"] = {{"rope_type", "llama3"},
                       {"factor", 8.0},
                       {"low_freq_factor", 4.0},
                       {"high_freq_factor", 4.0}};
  EXPECT_NE(error_of([&] {
              parse_model_config(j, "c.json");
            }).find("rope_scaling.high_freq_factor 4 must be above low_freq_factor 4"),
            std::string::npos);
  j["rope_scaling"] = {{"rope_type", "llama3"},
                       {"factor", 8.0},
                       {"original_max_position_embeddings", 1024}};  // context is 512
  EXPECT_NE(error_of([&] { parse_model_config(j, "c.json"); })
                .find("rope_scaling.original_max_position_embeddings = 1024 is outside [1, "
                      "max_position_embeddings = 512]"),
            std::string::npos);
  j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 1e39}};  // above FLT_MAX
  EXPECT_NE(error_of([&] {
              parse_model_config(j, "c.json");
            }).find("'rope_scaling.factor' = 1e+39 is not a finite 32-bit float"),
            std::string::npos);
}

TEST(Config, RejectsTokenIdsOutsideTheVocabulary) {
  struct Case {
    const char* field;
    json value;
    const char* says;
  };
  const Case cases[] = {
      {"bos_token_id", 600, "bos_token_id = 600 is outside the vocabulary [0, 512)"},
      {"pad_token_id", 512, "pad_token_id = 512 is outside"},
      {"eos_token_id", json::array({2, 9999}), "eos_token_id[1] = 9999 is outside"},
      {"eos_token_id", -5, "eos_token_id = -5 is outside"},
      {"bos_token_id", 1e10, "'bos_token_id' must be a token id"}};
  for (const Case& c : cases) {
    json j = stories_config();
    j[c.field] = c.value;
    const std::string msg = error_of([&] { parse_model_config(j, "s/config.json"); });
    EXPECT_NE(msg.find(c.says), std::string::npos) << msg;
    EXPECT_NE(msg.find("s/config.json"), std::string::npos) << msg;
  }
}

// Failure 7: wrong types are refused naming the file and the field's full path, not with
// nlohmann's "type must be string, but is number".
TEST(Config, WrongTypesNameTheField) {
  struct Case {
    const char* field;
    json value;
  };
  for (const Case& c : {Case{"model_type", 5}, Case{"hidden_act", false}, Case{"rope_theta", "big"},
                        Case{"tie_word_embeddings", 1}}) {
    json j = stories_config();
    j[c.field] = c.value;
    const std::string msg = error_of([&] { parse_model_config(j, "t/config.json"); });
    EXPECT_NE(msg.find("t/config.json"), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::string("'") + c.field + "'"), std::string::npos) << msg;
  }
  json j = stories_config();
  j["rope_scaling"] = {{"rope_type", "llama3"}, {"original_max_position_embeddings", "8k"}};
  EXPECT_NE(error_of([&] {
              parse_model_config(j, "c.json");
            }).find("'rope_scaling.original_max_position_embeddings' must be an integer"),
            std::string::npos);
  j["rope_scaling"] = {{"type", 3}};
  EXPECT_NE(error_of([&] { parse_model_config(j, "c.json"); }).find("'rope_scaling.type'"),
            std::string::npos);
}

TEST(Config, ConfigFileIsReadBounded) {
  ModelCopy copy("BigConfig");
  InputLimits limits;
  limits.json_file_bytes = 100;  // stories260K's config.json is larger
  const std::string msg = error_of([&] { load_model_config(copy.dir.string(), limits); });
  EXPECT_NE(msg.find((copy.dir / "config.json").string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("limit of 100 (input limit json_file_bytes"), std::string::npos) << msg;
}

// --check-weights: one NaN and one infinity, placed by hand, found at their indices.
TEST(Loader, CheckWeightsNamesTheFirstNonFiniteElement) {
  ModelCopy copy("NanWeight");
  const std::string q = "model.layers.2.self_attn.q_proj.weight";  // [64, 64]
  copy.rewrite([&](TensorToWrite& w, std::vector<std::vector<float>>& storage) {
    if (w.name != q) return true;
    const float* src = w.tensor.as<const float>();
    storage.emplace_back(src, src + w.tensor.shape.numel());
    storage.back()[3 * 64 + 17] = std::nanf("");
    storage.back()[40 * 64 + 1] = INFINITY;
    w.tensor.data = storage.back().data();
    return true;
  });
  LoadOptions o;
  EXPECT_NO_THROW(load_model(copy.dir.string(), o));  // the scan is opt-in
  o.check_weights = true;
  const std::string msg = error_of([&] { load_model(copy.dir.string(), o); });
  EXPECT_NE(msg.find((copy.dir / "model.safetensors").string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("'" + q + "' element [3, 17] (flat index 209) is nan"), std::string::npos)
      << msg;
  EXPECT_NO_THROW(load_model(testing::stories_dir(), o));  // the real model is finite
}

TEST(Loader, FirstNonFiniteCoversEveryFloatType) {
  std::vector<float> f = {1.f, -0.f, 3e38f, -INFINITY, NAN};
  EXPECT_EQ(first_non_finite(Tensor{f.data(), DType::kF32, {5}}), 3);
  // f16: 0x3c00 = 1, 0x7bff = 65504 (largest finite), 0xfc00 = -inf, 0x7e00 = NaN.
  std::vector<uint16_t> h = {0x3c00, 0x7bff, 0xfc00, 0x7e00};
  EXPECT_EQ(first_non_finite(Tensor{h.data(), DType::kF16, {4}}), 2);
  // bf16: 0x7f7f = largest finite, 0x7fc0 = NaN.
  std::vector<uint16_t> b = {0x3f80, 0x7f7f, 0x7fc0};
  EXPECT_EQ(first_non_finite(Tensor{b.data(), DType::kBF16, {3}}), 2);
  std::vector<uint16_t> fine = {0x3f80, 0x7f7f, 0xff7f};
  EXPECT_EQ(first_non_finite(Tensor{fine.data(), DType::kBF16, {3}}), -1);
}

TEST(Tokenizer, RefusalsNameTheTokenizerFile) {
  ModelCopy copy("BadTokenizer");
  const fs::path model = copy.dir / "tokenizer.model";
  std::ofstream(model, std::ios::binary) << "not a sentencepiece model";
  const ModelConfig c = load_model_config(copy.dir.string());
  EXPECT_NE(error_of([&] { Tokenizer::load(copy.dir.string(), c); }).find(model.string()),
            std::string::npos);
  // Found by fuzz_tokenizer: a model whose second piece is empty; sentencepiece's trie
  // builder threw "zero-length key", which escaped naming no file.
  const unsigned char empty_piece[] = {0x0a, 0x0e, 0x0a, 0x05, 0x3c, 0x75, 0x6e, 0x6b, 0x3e, 0x15,
                                       0x00, 0x00, 0x00, 0x00, 0x18, 0x02, 0x0a, 0x0c, 0x0a, 0x03,
                                       0x3c, 0x0a, 0x0e, 0x0a, 0x05, 0x00, 0x00, 0x00, 0x00, 0x18};
  std::ofstream(model, std::ios::binary)
      .write(reinterpret_cast<const char*>(empty_piece), sizeof(empty_piece));
  EXPECT_NE(error_of([&] {
              Tokenizer::load(copy.dir.string(), c);
            }).find(model.string() + ": cannot load sentencepiece model"),
            std::string::npos);
  fs::copy_file(fs::path(testing::stories_dir()) / "tokenizer.model", model,
                fs::copy_options::overwrite_existing);
  InputLimits small;
  small.tokenizer_file_bytes = 1000;  // the file has 7522 bytes
  EXPECT_NE(error_of([&] {
              Tokenizer::load(copy.dir.string(), c, small);
            }).find("tokenizer.model size in bytes = 7522 is above the limit of 1000"),
            std::string::npos);
  std::ofstream(copy.dir / "tokenizer_config.json") << R"({"add_bos_token": "yes"})";
  const std::string msg = error_of([&] { Tokenizer::load(copy.dir.string(), c); });
  EXPECT_NE(msg.find("tokenizer_config.json: field 'add_bos_token' must be true or false"),
            std::string::npos)
      << msg;
  fs::remove(copy.dir / "tokenizer_config.json");
  // A model vocabulary larger than the tokenizer's: an id past the pieces is named.
  ModelConfig wide = c;
  wide.vocab = 600;
  const auto tok = Tokenizer::load(copy.dir.string(), wide);
  EXPECT_NE(error_of([&] {
              tok->decode({1, 550});
            }).find(model.string() + ": cannot decode token id 550: the tokenizer has 512 pieces"),
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
