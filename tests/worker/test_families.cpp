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

namespace strata {
namespace {

// ---- mixture of experts -------------------------------------------------------------

TEST(MoeFamilies, MixtralRenormalisesItsTopTwoAndHasNoDenseMlp) {
  json j = base("mixtral", "MixtralForCausalLM");
  j["num_local_experts"] = 8;
  j["num_experts_per_tok"] = 2;
  j["sliding_window"] = nullptr;
  const ModelConfig c = parse_model_config(j, "config.json");
  EXPECT_EQ(c.family, ModelFamily::kMixtral);
  EXPECT_EQ(c.n_experts, 8);
  EXPECT_EQ(c.experts_per_token, 2);
  EXPECT_EQ(c.expert_intermediate, 96);  // Mixtral's intermediate_size is an expert's
  EXPECT_EQ(c.intermediate, 0);
  EXPECT_TRUE(c.norm_topk_prob);
  const LayerLinears l = layer_linears(c.shape());
  EXPECT_FALSE(linear_of(l, LinearSlot::kGate).present);
  EXPECT_FALSE(linear_of(l, LinearSlot::kDown).present);
  // 4 layers x (attention 64x64 + 2 x 64x32 + 64x64, 8 experts x 3 x 64x96, router 8x64,
  // norms 2 x 64) + embedding and head 2 x 256x64 + final norm 64.
  const int64_t layer = 64 * 64 * 2 + 2 * 64 * 32 + 8 * 3 * 64 * 96 + 8 * 64 + 2 * 64;
  EXPECT_EQ(c.shape().total_params(), 4 * layer + 2 * 256 * 64 + 64);
  EXPECT_EQ(c.shape().active_params_per_layer(), layer - 6 * 3 * 64 * 96);
}

TEST(MoeFamilies, Qwen2MoeHasASharedExpertAndKeepsItsWeightsUnnormalised) {
  json j = base("qwen2_moe", "Qwen2MoeForCausalLM");
  j["num_experts"] = 60;
  j["num_experts_per_tok"] = 4;
  j["moe_intermediate_size"] = 32;
  j["shared_expert_intermediate_size"] = 128;
  j["decoder_sparse_step"] = 1;
  j["mlp_only_layers"] = json::array();
  const ModelConfig c = parse_model_config(j, "config.json");
  EXPECT_EQ(c.family, ModelFamily::kQwen2Moe);
  EXPECT_EQ(c.intermediate, 128);  // the shared expert is the layer's dense MLP
  EXPECT_EQ(c.expert_intermediate, 32);
  EXPECT_FALSE(c.norm_topk_prob);  // Qwen2MoeConfig's default
  EXPECT_TRUE(c.attention_bias && c.qkv_bias_only);
  EXPECT_TRUE(c.shape().shared_expert_gate);
}

TEST(MoeFamilies, OlmoeNormsWholeProjectionsQwen3MoeEachHead) {
  json o = base("olmoe", "OlmoeForCausalLM");
  o["num_experts"] = 64;
  o["num_experts_per_tok"] = 8;
  const ModelConfig c = parse_model_config(o, "config.json");
  EXPECT_TRUE(c.architecture().qk_norm_whole);
  EXPECT_FALSE(c.architecture().qk_norm);
  EXPECT_EQ(c.shape().qk_norm_elems(), 64 + 32);  // q 4 x 16, k 2 x 16
  json q = base("qwen3_moe", "Qwen3MoeForCausalLM");
  q["num_experts"] = 16;
  q["num_experts_per_tok"] = 4;
  q["moe_intermediate_size"] = 32;
  q["norm_topk_prob"] = true;
  q["head_dim"] = 24;
  const ModelConfig d = parse_model_config(q, "config.json");
  EXPECT_TRUE(d.architecture().qk_norm);
  EXPECT_TRUE(d.norm_topk_prob);
  EXPECT_EQ(d.shape().qk_norm_elems(), 2 * 24);
}

TEST(MoeFamilies, WhatOneLayoutCannotHoldIsRefusedByName) {
  json j = base("qwen3_moe", "Qwen3MoeForCausalLM");
  j["num_experts"] = 16;
  j["num_experts_per_tok"] = 4;
  j["moe_intermediate_size"] = 32;
  json dense = j;
  dense["mlp_only_layers"] = {0, 2};
  EXPECT_NE(refusal(dense).find("mlp_only_layers = [0,2] is not supported"), std::string::npos)
      << refusal(dense);
  json step = j;
  step["decoder_sparse_step"] = 2;
  EXPECT_NE(refusal(step).find("decoder_sparse_step = 2"), std::string::npos) << refusal(step);
  json topk = j;
  topk["num_experts_per_tok"] = 17;
  EXPECT_NE(refusal(topk).find("num_experts_per_tok = 17 must be in [1, num_experts = 16]"),
            std::string::npos)
      << refusal(topk);
  json clip = base("olmoe", "OlmoeForCausalLM");
  clip["num_experts"] = 8;
  clip["num_experts_per_tok"] = 2;
  clip["clip_qkv"] = 8.0;
  EXPECT_NE(refusal(clip).find("clip_qkv = 8.0 is not supported"), std::string::npos)
      << refusal(clip);
  json missing = j;
  missing.erase("moe_intermediate_size");
  EXPECT_NE(refusal(missing).find("missing required field 'moe_intermediate_size'"),
            std::string::npos)
      << refusal(missing);
}

TEST(MoeFamilies, TensorParallelShardsSplitEachExpertAndKeepTheRouter) {
  json j = base("mixtral", "MixtralForCausalLM");
  j["num_local_experts"] = 8;
  j["num_experts_per_tok"] = 2;
  const ModelConfig c = parse_model_config(j, "config.json");
  const ModelConfig s = tensor_parallel_shard(c, 2);
  EXPECT_EQ(s.expert_intermediate, 48);
  EXPECT_EQ(s.n_experts, 8);
  EXPECT_THROW(tensor_parallel_shard(c, 5), InputError);  // 4 heads
}

}  // namespace
}  // namespace strata
