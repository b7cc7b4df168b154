// Model configuration from a Hugging Face config.json (Llama, Mistral, Qwen2, Qwen3, Phi-3,
// Gemma-2, OPT, and the mixture-of-experts Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE), or from a
// named dummy shape. One struct for every family: the layer code
// reads the differences (norm kind, activation, positions, biases, windows, soft-caps) from
// it instead of forking per architecture.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/dtype.h"
#include "placement/model_shape.h"
#include "worker/input_limits.h"

namespace strata {

enum class ModelFamily {
  kLlama,
  kMistral,
  kQwen2,
  kQwen3,
  kPhi3,
  kGemma2,
  kOpt,
  kMixtral,
  kQwen2Moe,
  kQwen3Moe,
  kOlmoe
};
const char* family_name(ModelFamily f);

struct ModelConfig;

// How the two families differ, as data (FasterTransformer's lesson: one layer builder with a
// table of differences, not a copy per architecture). Derived once from the config
// (Architecture::of, the one place the family becomes behaviour); the layer code, the weight
// table and the memory model read these fields, never the family.
enum class NormKind : uint8_t { kRms, kLayer };  // RMSNorm / LayerNorm (+ bias)
// SwiGLU silu(gate)*up / GeGLU gelu_tanh(gate)*up (Gemma-2) / fc1-ReLU-fc2 (OPT).
enum class MlpKind : uint8_t { kGatedSilu, kGatedGeluTanh, kRelu };
enum class PositionKind : uint8_t { kRotary, kLearned };  // RoPE / a learned table
struct Architecture {
  NormKind norm = NormKind::kRms;
  MlpKind mlp = MlpKind::kGatedSilu;
  PositionKind positions = PositionKind::kRotary;
  bool pre_norm = true;         // norm on the way into attention / MLP; else after the residual
  bool final_norm = true;       // a norm before the head (post-norm OPT has none)
  int32_t position_offset = 0;  // learned positions: the table row of position 0
  int32_t embed_dim = 0;        // token embedding width (OPT's word_embed_proj_dim)
  bool qk_norm = false;         // Qwen3: RMSNorm over each head of q and k before RoPE
  bool qk_norm_whole = false;   // OLMoE: the same over the whole q and k projections
  bool moe = false;             // the MLP is a router and experts (config's n_experts)
  bool post_norms = false;      // Gemma-2: a norm on each block's output before its residual add
  float norm_offset = 0.0f;     // Gemma: RMSNorm scales by (offset + w), folded into w at load
  float embed_scale = 1.0f;     // Gemma: the token embedding times sqrt(hidden)

  bool norm_bias() const { return norm == NormKind::kLayer; }
  bool gated_mlp() const { return mlp != MlpKind::kRelu; }
  bool rotary() const { return positions == PositionKind::kRotary; }
  bool learned_positions() const { return positions == PositionKind::kLearned; }
  static Architecture of(const ModelConfig& c);
};

// A model folder's generation_config.json: the sampling a request gets for the fields it does
// not set (vLLM's rule, whatever do_sample says). Its eos ids join ModelConfig::eos_token_ids.
struct GenerationDefaults {
  std::optional<float> temperature, top_p, min_p, repetition_penalty;
  std::optional<int32_t> top_k, max_new_tokens;
  std::string source;  // the file, empty when the model has none
  std::string str() const;
};

struct ModelConfig {
  ModelFamily family = ModelFamily::kLlama;
  std::string source;  // file or dummy name, for messages
  int32_t hidden = 0;
  int32_t intermediate = 0;
  int32_t n_layers = 0;
  int32_t n_heads = 0;
  int32_t n_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t vocab = 0;
  int32_t max_positions = 0;
  float norm_eps = 1e-5f;
  DType dtype = DType::kF32;  // torch_dtype: how weights are stored

  // Llama: RoPE (rotate-half), RMSNorm, SwiGLU.
  float rope_theta = 10000.0f;
  std::string rope_scaling_type;  // "", "linear", "llama3" or "longrope" (Phi-3's "su" too)
  float rope_factor = 1.0f;
  float rope_low_freq_factor = 1.0f;
  float rope_high_freq_factor = 4.0f;
  int32_t rope_original_max_positions = 0;
  // longrope: per-frequency divisors of the inverse frequencies (head_dim / 2 each), the long
  // ones past the original context; and the factor on cos/sin (config's attention_factor, else
  // sqrt(1 + ln(max / original) / ln(original)), as Hugging Face's rope utilities derive it).
  std::vector<float> rope_short_factor, rope_long_factor;
  float rope_attention_factor = 1.0f;

  // Attention as the family computes it: scores scaled by attention_scale (1/sqrt(head_dim);
  // Gemma-2: query_pre_attn_scalar^-1/2), soft-capped (cap * tanh(s / cap)) when the cap is
  // positive, and limited on sliding layers to the last `sliding_window` positions.
  float attention_scale = 0.0f;  // 0: 1 / sqrt(head_dim)
  float attn_softcap = 0.0f;     // Gemma-2 attn_logit_softcapping
  float final_softcap = 0.0f;    // Gemma-2 final_logit_softcapping, on the logits
  int32_t sliding_window = 0;    // 0: none
  std::vector<uint8_t> sliding;  // per layer of the whole model: 1 where the window applies
  int32_t first_layer = 0;       // the whole model's index of this config's layer 0 (a stage)

  // OPT: learned positions (offset 2), LayerNorm, ReLU, optional project in/out.
  int32_t position_offset = 0;
  bool do_layer_norm_before = true;
  int32_t word_embed_proj_dim = 0;  // == hidden unless OPT-350m style

  bool attention_bias = false;  // q/k/v/o biases
  bool qkv_bias_only = false;   // Qwen2: the biases on q/k/v, none on o
  bool mlp_bias = false;        // MLP biases (gate's too, where the MLP is gated)
  bool tie_word_embeddings = false;

  // Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE; n_experts 0: a dense MLP). A
  // router [n_experts, hidden] scores each row; softmax over all experts, the
  // experts_per_token best taken (their probabilities renormalised to sum 1 when
  // norm_topk_prob: Mixtral always, Qwen3-MoE by its config), and the row's MLP output is
  // their weighted sum, each a gated SwiGLU of expert_intermediate columns. `intermediate`
  // is then the dense MLP beside the experts: Qwen2-MoE's shared expert, whose output is
  // scaled by sigmoid(x . shared_expert_gate); 0 where there is none.
  int32_t n_experts = 0;
  int32_t experts_per_token = 0;
  int32_t expert_intermediate = 0;
  bool norm_topk_prob = false;
  bool moe() const { return n_experts > 0; }

  int32_t bos_token_id = -1;  // -1: none given
  int32_t pad_token_id = -1;  // -1: none given
  std::vector<int32_t> eos_token_ids;
  GenerationDefaults generation;

  Architecture architecture() const { return Architecture::of(*this); }
  int32_t q_width() const { return n_heads * head_dim; }
  int32_t kv_width() const { return n_kv_heads * head_dim; }
  float score_scale() const;
  // The sliding window of this config's layer `layer` (0: attends over every position).
  int32_t layer_window(int32_t layer) const;
  // The window every layer of the whole model has (Mistral's), which bounds what a KV slot
  // holds (kernels/backend.h KvWindow); 0 where some layer attends over every position.
  int32_t cache_window() const;
  ModelShape shape() const;
  std::string str() const;

  // Throws InputError naming `source`, the field and the value when the numbers cannot
  // describe a model: a size not positive or above its limit, heads not dividing the hidden
  // size, an epsilon outside (0, 0.1], a rope factor not positive (llama3: high_freq_factor
  // not above low_freq_factor, original_max_position_embeddings outside [1, context]), a
  // bos/pad/eos id outside the vocabulary.
  void validate(const InputLimits& limits = {}) const;
};

// One shard of a tensor-parallel group of `degree` ranks (Megatron's split, which ExeGPT's
// partial tensor parallelism applies to some stages): the attention heads, the KV heads and
// the MLP's intermediate columns divided by the degree, the hidden size (the residual stream
// every member keeps whole) unchanged. Throws InputError naming the model and the count the
// degree does not divide. Degree 1: the config itself.
ModelConfig tensor_parallel_shard(const ModelConfig& full, int32_t degree);

// Parses a config.json object. `source` names the file in error messages.
ModelConfig parse_model_config(const nlohmann::json& j, const std::string& source,
                               const InputLimits& limits = {});
// Parses config.json's text.
ModelConfig parse_model_config_text(std::string_view text, const std::string& source,
                                    const InputLimits& limits = {});
// Reads (at most limits.json_file_bytes) and parses <dir>/config.json.
// <dir>/config.json, and <dir>/generation_config.json when there is one (its defaults and eos
// ids; a field of the wrong type or out of range is an InputError naming the file and field).
ModelConfig load_model_config(const std::string& dir, const InputLimits& limits = {});
// A generation_config.json's text into `config` (tests; load_model_config).
void read_generation_config(const std::string& text, const std::string& source,
                            ModelConfig& config);

}  // namespace strata
