// The model families' config.json as data on the one transformer: each field Hugging Face's
// configuration and modelling files read either honoured (with the values their rules give,
// worked out by hand here) or refused by name.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "kernels/error.h"
#include "placement/layer_linears.h"
#include "worker/config.h"

namespace strata {
namespace {

using json = nlohmann::json;

json base(const char* type, const char* arch) {
  return {{"model_type", type},       {"architectures", {arch}}, {"hidden_size", 64},
          {"intermediate_size", 96},  {"num_hidden_layers", 4},  {"num_attention_heads", 4},
          {"num_key_value_heads", 2}, {"vocab_size", 256},       {"max_position_embeddings", 512},
          {"rms_norm_eps", 1e-6}};
}

std::string refusal(const json& j) {
  try {
    parse_model_config(j, "config.json");
  } catch (const InputError& e) {
    return e.what();
  }
  return "<accepted>";
}

std::vector<int32_t> windows(const ModelConfig& c) {
  std::vector<int32_t> w;
  for (int32_t i = 0; i < c.n_layers; ++i) w.push_back(c.layer_window(i));
  return w;
}

TEST(Families, MistralWindowsEveryLayer) {
  json j = base("mistral", "MistralForCausalLM");
  j["sliding_window"] = 16;
  const ModelConfig c = parse_model_config(j, "config.json");
  EXPECT_EQ(c.family, ModelFamily::kMistral);
  EXPECT_EQ(windows(c), (std::vector<int32_t>{16, 16, 16, 16}));
  j["sliding_window"] = nullptr;  // Mistral-7B-v0.2 and later: no window
  EXPECT_EQ(windows(parse_model_config(j, "config.json")), (std::vector<int32_t>{0, 0, 0, 0}));
}

TEST(Families, QwenWindowsOnlyWithUseSlidingWindowFromMaxWindowLayers) {
  json j = base("qwen2", "Qwen2ForCausalLM");
  j["sliding_window"] = 32;
  j["max_window_layers"] = 2;
  EXPECT_EQ(windows(parse_model_config(j, "config.json")), (std::vector<int32_t>{0, 0, 0, 0}));
  j["use_sliding_window"] = true;
  const ModelConfig c = parse_model_config(j, "config.json");
  EXPECT_EQ(windows(c), (std::vector<int32_t>{0, 0, 32, 32}));
  // Qwen2: biases on q, k and v, none on o.
  const LayerLinears l = layer_linears(c.shape());
  EXPECT_TRUE(linear_of(l, LinearSlot::kQ).bias && linear_of(l, LinearSlot::kV).bias);
  EXPECT_FALSE(linear_of(l, LinearSlot::kO).bias);
  // A stage of layers [2, 4) keeps the whole model's windows.
  ModelConfig stage = c;
  stage.n_layers = 2;
  stage.first_layer = 2;
  EXPECT_EQ(windows(stage), (std::vector<int32_t>{32, 32}));
}

TEST(Families, LayerTypesOverrideTheRuleAndAreChecked) {
  json j = base("qwen3", "Qwen3ForCausalLM");
  j["use_sliding_window"] = true;
  j["sliding_window"] = 8;
  j["layer_types"] = {"full_attention", "sliding_attention", "full_attention", "sliding_attention"};
  const ModelConfig c = parse_model_config(j, "config.json");
  EXPECT_EQ(windows(c), (std::vector<int32_t>{0, 8, 0, 8}));
  EXPECT_TRUE(c.architecture().qk_norm);
  j["layer_types"][2] = "chunked_attention";
  EXPECT_NE(refusal(j).find("layer_types[2] = 'chunked_attention'"), std::string::npos);
  j["layer_types"] = {"full_attention"};
  EXPECT_NE(refusal(j).find("layer_types must list num_hidden_layers = 4"), std::string::npos);
}

TEST(Families, Gemma2AsItsConfigurationSays) {
  json j = base("gemma2", "Gemma2ForCausalLM");
  j["hidden_size"] = 3072;
  j["num_attention_heads"] = 16;
  j["head_dim"] = 256;
  j["query_pre_attn_scalar"] = 144;
  j["attn_logit_softcapping"] = 50.0;
  j["final_logit_softcapping"] = 30.0;
  j["sliding_window"] = 4096;
  j["hidden_activation"] = "gelu_pytorch_tanh";
  j["torch_dtype"] = "bfloat16";
  const ModelConfig c = parse_model_config(j, "config.json");
  const Architecture a = c.architecture();
  EXPECT_EQ(a.mlp, MlpKind::kGatedGeluTanh);
  EXPECT_TRUE(a.post_norms);
  EXPECT_EQ(a.norm_offset, 1.0f);
  // sqrt(3072) = 55.4256 is 1.73205 x 2^5; bf16 keeps 7 mantissa bits: 222 / 128 x 32 = 55.5.
  EXPECT_EQ(a.embed_scale, 55.5f);
  EXPECT_FLOAT_EQ(c.score_scale(), 1.0f / 12.0f);  // 144^-1/2, not head_dim's 256^-1/2
  EXPECT_EQ(c.attn_softcap, 50.0f);
  EXPECT_EQ(c.final_softcap, 30.0f);
  EXPECT_TRUE(c.tie_word_embeddings);                               // Gemma2Config's default
  EXPECT_EQ(windows(c), (std::vector<int32_t>{4096, 0, 4096, 0}));  // even layers local
  EXPECT_EQ(c.head_dim, 256);  // its own, not hidden / heads = 192
  j["hidden_activation"] = "gelu";
  EXPECT_NE(refusal(j).find("hidden_activation 'gelu' is not supported for gemma2"),
            std::string::npos);
}

TEST(Families, Phi3LongropeAttentionFactorByHand) {
  json j = base("phi3", "Phi3ForCausalLM");
  j["original_max_position_embeddings"] = 128;
  std::vector<float> ones(8, 1.0f), twos(8, 2.0f);
  j["rope_scaling"] = {{"type", "longrope"}, {"short_factor", ones}, {"long_factor", twos}};
  const ModelConfig c = parse_model_config(j, "config.json");
  EXPECT_EQ(c.rope_scaling_type, "longrope");
  // sqrt(1 + ln(512 / 128) / ln(128)) = sqrt(1 + 2 ln 2 / 7 ln 2) = sqrt(9 / 7).
  EXPECT_FLOAT_EQ(c.rope_attention_factor, std::sqrt(9.0f / 7.0f));
  EXPECT_EQ(c.rope_original_max_positions, 128);
  j["rope_scaling"]["long_factor"] = std::vector<float>(7, 1.0f);
  EXPECT_NE(refusal(j).find("rope_scaling.long_factor has 7 numbers; head_dim / 2 = 8"),
            std::string::npos);
  j["rope_scaling"] = {{"type", "yarn"}, {"factor", 4.0}};
  EXPECT_NE(refusal(j).find("rope_scaling type 'yarn' is not supported for phi3"),
            std::string::npos);
  j["rope_scaling"] = nullptr;
  j["partial_rotary_factor"] = 0.75;
  EXPECT_NE(refusal(j).find("partial_rotary_factor = 0.75"), std::string::npos);
}

TEST(Families, LongropeIsPhi3sOnly) {
  json j = base("llama", "LlamaForCausalLM");
  j["rope_scaling"] = {{"rope_type", "longrope"},
                       {"short_factor", std::vector<float>(8, 1.0f)},
                       {"long_factor", std::vector<float>(8, 1.0f)}};
  EXPECT_NE(refusal(j).find("rope_scaling type 'longrope' is not supported for llama"),
            std::string::npos);
}

TEST(Families, LlamaMlpBiasBiasesTheGateToo) {
  json j = base("llama", "LlamaForCausalLM");
  j["mlp_bias"] = true;
  const LayerLinears l = layer_linears(parse_model_config(j, "config.json").shape());
  EXPECT_TRUE(linear_of(l, LinearSlot::kGate).bias);  // LlamaMLP: gate_proj bias=mlp_bias
  EXPECT_TRUE(linear_of(l, LinearSlot::kUp).bias && linear_of(l, LinearSlot::kDown).bias);
  EXPECT_FALSE(linear_of(l, LinearSlot::kQ).bias);
}

TEST(Families, DtypeAsWellAsTorchDtype) {
  json j = base("llama", "LlamaForCausalLM");
  j["dtype"] = "bfloat16";
  j["torch_dtype"] = "float16";  // older field, written beside the newer one: dtype wins
  EXPECT_EQ(parse_model_config(j, "config.json").dtype, DType::kBF16);
  j["dtype"] = "int8";
  EXPECT_NE(refusal(j).find("dtype 'int8' is not a weight dtype"), std::string::npos);
}

TEST(Families, ModelTypeAndArchitectureMustAgree) {
  json j = base("llama", "Qwen2ForCausalLM");
  EXPECT_NE(refusal(j).find("architectures[0] 'Qwen2ForCausalLM' is not model_type 'llama''s"),
            std::string::npos);
  json k = base("qwen2", "Qwen2ForCausalLM");
  k.erase("model_type");  // the architecture alone names the family
  EXPECT_EQ(parse_model_config(k, "config.json").family, ModelFamily::kQwen2);
  json m = base("gpt_neox", "GPTNeoXForCausalLM");
  EXPECT_NE(refusal(m).find("supported: llama (LlamaForCausalLM), mistral"), std::string::npos);
}

}  // namespace
}  // namespace strata
