#include "worker/config.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>

#include "kernels/error.h"

namespace strata {
namespace {

using json = nlohmann::json;

// Reads the fields of one JSON object, naming the file and the field's full path
// ("rope_scaling.factor") in every refusal. Wrong types are refused here rather than met as
// nlohmann's type_error, whose message names neither.
struct Fields {
  const json& j;
  const std::string& src;
  std::string prefix;  // "" or "rope_scaling."

  std::string name(const char* key) const { return prefix + key; }
  const json* find(const char* key) const {
    auto it = j.find(key);
    return it == j.end() || it->is_null() ? nullptr : &*it;
  }
  // An integer in [0, INT32_MAX]; required when there is no fallback.
  int32_t integer(const char* key, std::optional<int64_t> fallback = std::nullopt) const {
    const json* v = find(key);
    if (v == nullptr) {
      if (!fallback) fail_input("{}: missing required field '{}'", src, name(key));
      return static_cast<int32_t>(*fallback);
    }
    if (!v->is_number_integer())
      fail_input("{}: field '{}' must be an integer, got {}", src, name(key), v->dump());
    if (v->is_number_unsigned() ? v->get<uint64_t>() > INT32_MAX
                                : (v->get<int64_t>() < 0 || v->get<int64_t>() > INT32_MAX))
      fail_input("{}: field '{}' = {} is out of range [0, {}]", src, name(key), v->dump(),
                 INT32_MAX);
    return v->get<int32_t>();
  }
  // A finite number that a float holds (1e308 would become inf, and inf, NaN, garbage).
  float number(const char* key, float fallback) const {
    const json* v = find(key);
    if (v == nullptr) return fallback;
    if (!v->is_number())
      fail_input("{}: field '{}' must be a number, got {}", src, name(key), v->dump());
    const double x = v->get<double>();
    if (!std::isfinite(x) || std::fabs(x) > std::numeric_limits<float>::max())
      fail_input("{}: field '{}' = {} is not a finite 32-bit float", src, name(key), v->dump());
    return static_cast<float>(x);
  }
  bool boolean(const char* key, bool fallback) const {
    const json* v = find(key);
    if (v == nullptr) return fallback;
    if (!v->is_boolean())
      fail_input("{}: field '{}' must be true or false, got {}", src, name(key), v->dump());
    return v->get<bool>();
  }
  std::string string(const char* key, const std::string& fallback) const {
    const json* v = find(key);
    if (v == nullptr) return fallback;
    if (!v->is_string())
      fail_input("{}: field '{}' must be a string, got {}", src, name(key), v->dump());
    return v->get<std::string>();
  }
  // A token id: any integer here (validate() checks it against the vocabulary); -1 if absent.
  int32_t token_id(const char* key) const {
    const json* v = find(key);
    if (v == nullptr) return -1;
    return id_value(*v, name(key));
  }
  int32_t id_value(const json& v, const std::string& field) const {
    if (!v.is_number_integer() ||
        (v.is_number_unsigned() ? v.get<uint64_t>() > INT32_MAX
                                : v.get<int64_t>() < INT32_MIN || v.get<int64_t>() > INT32_MAX))
      fail_input("{}: field '{}' must be a token id (an integer), got {}", src, field, v.dump());
    return v.get<int32_t>();
  }
};

std::vector<int32_t> get_eos(const Fields& f) {
  std::vector<int32_t> ids;
  const json* v = f.find("eos_token_id");
  if (v == nullptr) return ids;
  if (v->is_array()) {
    for (size_t i = 0; i < v->size(); ++i)
      ids.push_back(f.id_value((*v)[i], fmt::format("eos_token_id[{}]", i)));
  } else {
    ids.push_back(f.id_value(*v, "eos_token_id"));
  }
  return ids;
}

// Each family as config.json names it: model_type and architectures[0].
struct FamilyName {
  ModelFamily family;
  const char* model_type;
  const char* architecture;
};
constexpr FamilyName kFamilies[] = {
    {ModelFamily::kLlama, "llama", "LlamaForCausalLM"},
    {ModelFamily::kMistral, "mistral", "MistralForCausalLM"},
    {ModelFamily::kQwen2, "qwen2", "Qwen2ForCausalLM"},
    {ModelFamily::kQwen3, "qwen3", "Qwen3ForCausalLM"},
    {ModelFamily::kPhi3, "phi3", "Phi3ForCausalLM"},
    {ModelFamily::kGemma2, "gemma2", "Gemma2ForCausalLM"},
    {ModelFamily::kOpt, "opt", "OPTForCausalLM"},
    {ModelFamily::kMixtral, "mixtral", "MixtralForCausalLM"},
    {ModelFamily::kQwen2Moe, "qwen2_moe", "Qwen2MoeForCausalLM"},
    {ModelFamily::kQwen3Moe, "qwen3_moe", "Qwen3MoeForCausalLM"},
    {ModelFamily::kOlmoe, "olmoe", "OlmoeForCausalLM"},
};

std::string supported_families() {
  std::string s;
  for (const FamilyName& f : kFamilies)
    s += fmt::format("{}{} ({})", s.empty() ? "" : ", ", f.model_type, f.architecture);
  return s;
}

// model_type decides; an architectures[0] of another family is refused rather than loaded as
// model_type says (a Qwen2 checkpoint relabelled llama would silently lose its biases).
ModelFamily detect_family(const Fields& f) {
  const std::string type = f.string("model_type", "");
  std::string arch;
  if (const json* a = f.find("architectures");
      a && a->is_array() && !a->empty() && (*a)[0].is_string())
    arch = (*a)[0].get<std::string>();
  const FamilyName* by_type = nullptr;
  const FamilyName* by_arch = nullptr;
  for (const FamilyName& n : kFamilies) {
    if (type == n.model_type) by_type = &n;
    if (arch == n.architecture) by_arch = &n;
  }
  if (by_type != nullptr && !arch.empty() && by_arch != by_type)
    fail_input("{}: architectures[0] '{}' is not model_type '{}''s ({})", f.src, arch, type,
               by_type->architecture);
  if (by_type != nullptr) return by_type->family;
  if (type.empty() && by_arch != nullptr) return by_arch->family;
  fail_input("{}: unsupported model (model_type '{}', architectures[0] '{}'); supported: {}", f.src,
             type, arch, supported_families());
}

// A list of head_dim / 2 finite positive numbers (longrope's short_factor / long_factor).
std::vector<float> factor_list(const Fields& rs, const char* key, int32_t half) {
  const json* v = rs.find(key);
  if (v == nullptr || !v->is_array())
    fail_input("{}: {} must be a list of head_dim / 2 = {} numbers", rs.src, rs.name(key), half);
  if (static_cast<int64_t>(v->size()) != half)
    fail_input("{}: {} has {} numbers; head_dim / 2 = {}", rs.src, rs.name(key), v->size(), half);
  std::vector<float> out;
  for (size_t i = 0; i < v->size(); ++i) {
    const json& x = (*v)[i];
    if (!x.is_number() || !std::isfinite(x.get<double>()) || !(x.get<double>() > 0))
      fail_input("{}: {}[{}] = {} is not a positive number", rs.src, rs.name(key), i, x.dump());
    out.push_back(x.get<float>());
  }
  return out;
}

// Phi-3's longrope ("su" in older configs), as Hugging Face's _compute_longrope_parameters.
void parse_longrope(const Fields& top, const Fields& rs, ModelConfig& c) {
  c.rope_original_max_positions =
      rs.integer("original_max_position_embeddings",
                 top.integer("original_max_position_embeddings", c.max_positions));
  if (c.rope_original_max_positions <= 1 || c.rope_original_max_positions > c.max_positions)
    fail_input("{}: original_max_position_embeddings = {} is outside [2, {}]", c.source,
               c.rope_original_max_positions, c.max_positions);
  const int32_t half = c.head_dim / 2;
  c.rope_short_factor = factor_list(rs, "short_factor", half);
  c.rope_long_factor = factor_list(rs, "long_factor", half);
  const float orig = static_cast<float>(c.rope_original_max_positions);
  c.rope_factor = rs.number("factor", static_cast<float>(c.max_positions) / orig);
  const float derived =
      c.rope_factor <= 1.0f ? 1.0f : std::sqrt(1.0f + std::log(c.rope_factor) / std::log(orig));
  c.rope_attention_factor = rs.number("attention_factor", derived);
}

void parse_rope_scaling(const json& j, ModelConfig& c) {
  auto it = j.find("rope_scaling");
  if (it == j.end() || it->is_null()) return;
  if (!it->is_object()) fail_input("{}: rope_scaling must be an object or null", c.source);
  const Fields rs{*it, c.source, "rope_scaling."};
  std::string type = rs.string("rope_type", rs.string("type", ""));
  if (type == "default") return;
  if (type == "su") type = "longrope";  // its name before transformers 4.42
  if (type == "longrope" && c.family == ModelFamily::kPhi3) {
    c.rope_scaling_type = type;
    parse_longrope(Fields{j, c.source, ""}, rs, c);
    return;
  }
  if (type != "linear" && type != "llama3")
    fail_input("{}: rope_scaling type '{}' is not supported for {} (supported: linear, llama3{})",
               c.source, type, family_name(c.family),
               c.family == ModelFamily::kPhi3 ? ", longrope, su" : "");
  c.rope_scaling_type = type;
  c.rope_factor = rs.number("factor", 1.0f);
  c.rope_low_freq_factor = rs.number("low_freq_factor", 1.0f);
  c.rope_high_freq_factor = rs.number("high_freq_factor", 4.0f);
  c.rope_original_max_positions = rs.integer("original_max_position_embeddings", c.max_positions);
}

// The window's layers: config.json's layer_types where it has them, else the family's rule
// (`sliding_of`), as Hugging Face's configuration_*.py derives layer_types.
void parse_sliding(const Fields& f, ModelConfig& c, int32_t window,
                   const std::function<bool(int32_t)>& sliding_of) {
  c.sliding.assign(static_cast<size_t>(c.n_layers), 0);
  if (const json* types = f.find("layer_types")) {
    if (!types->is_array() || static_cast<int64_t>(types->size()) != c.n_layers)
      fail_input("{}: layer_types must list num_hidden_layers = {} entries", f.src, c.n_layers);
    for (size_t i = 0; i < types->size(); ++i) {
      const json& t = (*types)[i];
      const std::string v = t.is_string() ? t.get<std::string>() : t.dump();
      if (v != "sliding_attention" && v != "full_attention")
        fail_input("{}: layer_types[{}] = '{}' (supported: sliding_attention, full_attention)",
                   f.src, i, v);
      c.sliding[i] = v == "sliding_attention" ? 1 : 0;
    }
  } else {
    for (int32_t i = 0; i < c.n_layers; ++i)
      c.sliding[static_cast<size_t>(i)] = sliding_of(i) ? 1 : 0;
  }
  const bool any = std::find(c.sliding.begin(), c.sliding.end(), 1) != c.sliding.end();
  if (any && window <= 0)
    fail_input("{}: sliding layers need a positive sliding_window, got {}", f.src, window);
  c.sliding_window = any ? window : 0;
  if (!any) c.sliding.clear();
}

// The fields every decoder family but OPT shares (Hugging Face's LlamaConfig and its kin).
void parse_decoder(const Fields& f, ModelConfig& c, const char* act_field, const char* act) {
  c.intermediate = f.integer("intermediate_size");
  c.n_kv_heads = f.integer("num_key_value_heads", c.n_heads);
  c.head_dim = f.integer("head_dim", c.n_heads > 0 ? c.hidden / c.n_heads : 0);
  c.norm_eps = f.number("rms_norm_eps", 1e-6f);
  c.rope_theta = f.number("rope_theta", 10000.0f);
  c.tie_word_embeddings = f.boolean("tie_word_embeddings", c.family == ModelFamily::kGemma2);
  const std::string a = f.string(act_field, act);
  if (a != act)
    fail_input("{}: {} '{}' is not supported for {} (supported: {})", c.source, act_field, a,
               family_name(c.family), act);
  if (const float p = f.number("partial_rotary_factor", 1.0f); p != 1.0f)
    fail_input("{}: partial_rotary_factor = {} is not supported (RoPE over the whole head only)",
               c.source, p);
  parse_rope_scaling(f.j, c);
}

// Qwen2 / Qwen3: a window only with use_sliding_window, on the layers from max_window_layers.
void parse_qwen_window(const Fields& f, ModelConfig& c) {
  const bool use = f.boolean("use_sliding_window", false);
  const int32_t window = use ? f.integer("sliding_window", 4096) : 0;
  const int32_t from = f.integer("max_window_layers", 28);
  parse_sliding(f, c, window, [&](int32_t i) { return use && i >= from; });
}

void parse_gemma2(const Fields& f, ModelConfig& c) {
  c.attention_bias = f.boolean("attention_bias", false);
  const float scalar = f.number("query_pre_attn_scalar", 256.0f);
  if (!(scalar > 0.0f))
    fail_input("{}: query_pre_attn_scalar must be positive, got {}", c.source, scalar);
  c.attention_scale = 1.0f / std::sqrt(scalar);
  c.attn_softcap = f.number("attn_logit_softcapping", 0.0f);
  c.final_softcap = f.number("final_logit_softcapping", 0.0f);
  if (c.attn_softcap < 0.0f || c.final_softcap < 0.0f)
    fail_input("{}: attn_logit_softcapping {} and final_logit_softcapping {} must be >= 0",
               c.source, c.attn_softcap, c.final_softcap);
  // Gemma2Config's layer_types: every other layer sliding, the first one included.
  parse_sliding(f, c, f.integer("sliding_window", 4096), [](int32_t i) { return i % 2 == 0; });
}

// Every layer a MoE layer: a checkpoint whose layers mix dense MLPs in (Qwen's
// mlp_only_layers, decoder_sparse_step > 1) would give layers of two shapes, which one stage's
// layer layout cannot hold, so it is refused by name.
void parse_moe(const Fields& f, ModelConfig& c, const char* experts_field, const char* width_field,
               bool norm_topk_default) {
  c.n_experts = f.integer(experts_field);
  c.experts_per_token = f.integer("num_experts_per_tok");
  c.expert_intermediate = f.integer(width_field);
  c.norm_topk_prob = f.boolean("norm_topk_prob", norm_topk_default);
  if (c.n_experts < 1 || c.experts_per_token < 1 || c.experts_per_token > c.n_experts)
    fail_input("{}: num_experts_per_tok = {} must be in [1, {} = {}]", c.source,
               c.experts_per_token, experts_field, c.n_experts);
  if (c.expert_intermediate < 1)
    fail_input("{}: {} must be positive, got {}", c.source, width_field, c.expert_intermediate);
  if (const int32_t step = f.integer("decoder_sparse_step", 1); step != 1)
    fail_input("{}: decoder_sparse_step = {} is not supported (every layer a MoE layer: 1)",
               c.source, step);
  if (const json* dense = f.find("mlp_only_layers"); dense != nullptr && !dense->empty())
    fail_input("{}: mlp_only_layers = {} is not supported (every layer a MoE layer: [])", c.source,
               dense->dump());
  if (const json* clip = f.find("clip_qkv"))
    fail_input("{}: clip_qkv = {} is not supported (null: no clipping)", c.source, clip->dump());
}

void parse_family(const json& j, ModelConfig& c) {
  const Fields f{j, c.source, ""};
  const bool gemma = c.family == ModelFamily::kGemma2;
  parse_decoder(f, c, gemma ? "hidden_activation" : "hidden_act",
                gemma ? "gelu_pytorch_tanh" : "silu");
  switch (c.family) {
    case ModelFamily::kLlama:
      c.attention_bias = f.boolean("attention_bias", false);
      c.mlp_bias = f.boolean("mlp_bias", false);
      break;
    case ModelFamily::kMistral:
    case ModelFamily::kPhi3:  // every layer windowed where the config gives a window
    {
      const int32_t window = f.integer("sliding_window", 0);
      parse_sliding(f, c, window, [&](int32_t) { return window > 0; });
      break;
    }
    case ModelFamily::kQwen2:
      c.attention_bias = true;  // Qwen2Attention: q/k/v with biases, o without
      c.qkv_bias_only = true;
      parse_qwen_window(f, c);
      break;
    case ModelFamily::kQwen3:
      c.attention_bias = f.boolean("attention_bias", false);
      parse_qwen_window(f, c);
      break;
    case ModelFamily::kGemma2:
      parse_gemma2(f, c);
      break;
    case ModelFamily::kMixtral:  // MixtralSparseMoeBlock renormalises its top-k always
    {
      parse_moe(f, c, "num_local_experts", "intermediate_size", true);
      c.norm_topk_prob = true;
      c.intermediate = 0;
      const int32_t window = f.integer("sliding_window", 0);
      parse_sliding(f, c, window, [&](int32_t) { return window > 0; });
      break;
    }
    case ModelFamily::kQwen2Moe:  // Qwen2 attention; a shared expert beside the experts
      c.attention_bias = true;
      c.qkv_bias_only = true;
      parse_moe(f, c, "num_experts", "moe_intermediate_size", false);
      c.intermediate = f.integer("shared_expert_intermediate_size");
      parse_qwen_window(f, c);
      break;
    case ModelFamily::kQwen3Moe:
      c.attention_bias = f.boolean("attention_bias", false);
      parse_moe(f, c, "num_experts", "moe_intermediate_size", false);
      c.intermediate = 0;
      parse_qwen_window(f, c);
      break;
    case ModelFamily::kOlmoe:
      c.attention_bias = f.boolean("attention_bias", false);
      parse_moe(f, c, "num_experts", "intermediate_size", false);
      c.intermediate = 0;
      break;
    case ModelFamily::kOpt:
      STRATA_CHECK(false, "OPT is parsed by parse_opt");
  }
}

void parse_opt(const json& j, ModelConfig& c) {
  const Fields f{j, c.source, ""};
  c.intermediate = f.integer("ffn_dim");
  c.n_kv_heads = c.n_heads;
  c.head_dim = c.n_heads > 0 ? c.hidden / c.n_heads : 0;
  c.norm_eps = 1e-5f;  // fixed in OPT's LayerNorm
  c.position_offset = 2;
  c.do_layer_norm_before = f.boolean("do_layer_norm_before", true);
  c.word_embed_proj_dim = f.integer("word_embed_proj_dim", c.hidden);
  const bool bias = f.boolean("enable_bias", true);
  c.attention_bias = bias;
  c.mlp_bias = bias;
  c.tie_word_embeddings = f.boolean("tie_word_embeddings", true);
  if (!f.boolean("layer_norm_elementwise_affine", true))
    fail_input("{}: layer_norm_elementwise_affine = false is not supported", c.source);
  const std::string act = f.string("activation_function", "relu");
  if (act != "relu")
    fail_input("{}: activation_function '{}' is not supported for opt (supported: relu)", c.source,
               act);
}

// Where each number came from in config.json, for messages.
struct Names {
  const char* intermediate;
  const char* eps;
};
Names field_names(const ModelConfig& c) {
  return c.family != ModelFamily::kOpt ? Names{"intermediate_size", "rms_norm_eps"}
                                       : Names{"ffn_dim", "layer_norm_eps (fixed at 1e-5 for OPT)"};
}

// Every size a config controls, against its limit, before anything of that size exists.
void check_sizes(const ModelConfig& c, const InputLimits& l) {
  const Names n = field_names(c);
  const std::string& s = c.source;
  auto positive = [&](const char* field, int64_t v) {
    if (v <= 0) fail_input("{}: {} must be positive, got {}", s, field, v);
  };
  struct Size {
    const char* field;
    int64_t value;
    InputLimits::Member limit;
  };
  const Size sizes[] = {
      {"hidden_size", c.hidden, &InputLimits::hidden},
      {n.intermediate, c.intermediate, &InputLimits::intermediate},
      {"num_hidden_layers", c.n_layers, &InputLimits::layers},
      {"num_attention_heads", c.n_heads, &InputLimits::heads},
      {"num_key_value_heads", c.n_kv_heads, &InputLimits::heads},
      {"head_dim", c.head_dim, &InputLimits::head_dim},
      {"vocab_size", c.vocab, &InputLimits::vocab},
      {"max_position_embeddings", c.max_positions, &InputLimits::context},
  };
  for (const Size& z : sizes) {
    // A MoE layer may have no dense MLP beside its experts (intermediate 0).
    if (!(c.moe() && z.limit == &InputLimits::intermediate && z.value == 0))
      positive(z.field, z.value);
    l.check(z.limit, z.value, s, z.field);
  }
  if (c.moe()) {
    l.check(&InputLimits::intermediate, c.expert_intermediate, s, "the experts' intermediate size");
    if (int64_t{c.n_experts} * c.hidden > INT32_MAX)
      fail_input("{}: {} experts x hidden_size {} is out of range", s, c.n_experts, c.hidden);
  }
  if (c.family == ModelFamily::kOpt) {
    positive("word_embed_proj_dim", c.word_embed_proj_dim);
    l.check(&InputLimits::hidden, c.word_embed_proj_dim, s, "word_embed_proj_dim");
  }
  // Products the layer code keeps in int32 (limits can be raised up to INT32_MAX each).
  const int64_t q_width = int64_t{c.n_heads} * c.head_dim;
  if (q_width > INT32_MAX)
    fail_input("{}: num_attention_heads {} x head_dim {} = {} is out of range", s, c.n_heads,
               c.head_dim, q_width);
  if (int64_t{c.max_positions} + c.position_offset > INT32_MAX)
    fail_input("{}: max_position_embeddings {} is out of range", s, c.max_positions);
}

void check_shape(const ModelConfig& c) {
  const std::string& s = c.source;
  // A head_dim of its own (Gemma-2, Qwen3) need not be hidden / heads; a derived one must.
  if (c.hidden % c.n_heads != 0 && c.head_dim == c.hidden / c.n_heads)
    fail_input("{}: num_attention_heads {} does not divide hidden_size {}", s, c.n_heads, c.hidden);
  if (c.n_heads % c.n_kv_heads != 0)
    fail_input("{}: num_key_value_heads {} does not divide num_attention_heads {}", s, c.n_kv_heads,
               c.n_heads);
  if (c.architecture().rotary() && c.head_dim % 2 != 0)
    fail_input("{}: head_dim {} must be even for rotary embeddings", s, c.head_dim);
}

// Epsilon is added to a mean of squares of order one: a value near that flattens every
// normalisation. Hugging Face models use 1e-12 to 1e-5.
constexpr float kMaxNormEps = 0.1f;

void check_numbers(const ModelConfig& c) {
  const std::string& s = c.source;
  if (!(c.norm_eps > 0.0f && c.norm_eps <= kMaxNormEps))
    fail_input("{}: {} = {} is outside (0, {}]", s, field_names(c).eps, c.norm_eps, kMaxNormEps);
  if (!c.architecture().rotary()) return;
  if (!(c.rope_theta > 0.0f))
    fail_input("{}: rope_theta must be positive, got {}", s, c.rope_theta);
  if (c.rope_scaling_type.empty()) return;
  if (!(c.rope_factor > 0.0f))
    fail_input("{}: rope_scaling.factor must be positive, got {}", s, c.rope_factor);
  if (c.rope_scaling_type == "longrope") return;  // parse_longrope checked its numbers
  if (c.rope_scaling_type != "llama3") return;
  // llama3 scaling blends between the two wavelengths 1/low and 1/high of the original
  // context, dividing by (high - low): both positive, high above low (as Hugging Face asks).
  if (!(c.rope_low_freq_factor > 0.0f))
    fail_input("{}: rope_scaling.low_freq_factor must be positive, got {}", s,
               c.rope_low_freq_factor);
  if (!(c.rope_high_freq_factor > c.rope_low_freq_factor))
    fail_input("{}: rope_scaling.high_freq_factor {} must be above low_freq_factor {}", s,
               c.rope_high_freq_factor, c.rope_low_freq_factor);
  if (c.rope_original_max_positions <= 0 || c.rope_original_max_positions > c.max_positions)
    fail_input(
        "{}: rope_scaling.original_max_position_embeddings = {} is outside [1, "
        "max_position_embeddings = {}]",
        s, c.rope_original_max_positions, c.max_positions);
}

void check_token_ids(const ModelConfig& c) {
  auto in_vocab = [&](const std::string& field, int32_t id) {
    if (id < 0 || id >= c.vocab)
      fail_input("{}: {} = {} is outside the vocabulary [0, {}) (vocab_size)", c.source, field, id,
                 c.vocab);
  };
  if (c.bos_token_id != -1) in_vocab("bos_token_id", c.bos_token_id);
  if (c.pad_token_id != -1) in_vocab("pad_token_id", c.pad_token_id);
  for (size_t i = 0; i < c.eos_token_ids.size(); ++i)
    in_vocab(c.eos_token_ids.size() == 1 ? std::string("eos_token_id")
                                         : fmt::format("eos_token_id[{}]", i),
             c.eos_token_ids[i]);
}

}  // namespace

ModelConfig parse_model_config(const json& j, const std::string& source,
                               const InputLimits& limits) {
  if (!j.is_object()) fail_input("{}: not a JSON object", source);
  const Fields f{j, source, ""};
  ModelConfig c;
  c.source = source;
  c.family = detect_family(f);
  c.hidden = f.integer("hidden_size");
  c.n_layers = f.integer("num_hidden_layers");
  c.n_heads = f.integer("num_attention_heads");
  c.vocab = f.integer("vocab_size");
  c.max_positions = f.integer("max_position_embeddings", 2048);
  c.bos_token_id = f.token_id("bos_token_id");
  c.pad_token_id = f.token_id("pad_token_id");
  c.eos_token_ids = get_eos(f);
  // Newer configs write `dtype`, older ones `torch_dtype`.
  const char* dtype_field = f.find("dtype") != nullptr ? "dtype" : "torch_dtype";
  if (const std::string dt = f.string(dtype_field, ""); !dt.empty()) {
    const auto parsed = parse_dtype(dt);
    if (!parsed || *parsed == DType::kI32)
      fail_input("{}: {} '{}' is not a weight dtype (float32, float16, bfloat16)", source,
                 dtype_field, dt);
    c.dtype = *parsed;
  }
  if (c.family == ModelFamily::kOpt) {
    parse_opt(j, c);
  } else {
    parse_family(j, c);
  }
  c.validate(limits);
  return c;
}

void ModelConfig::validate(const InputLimits& limits) const {
  check_sizes(*this, limits);
  check_shape(*this);
  check_numbers(*this);
  check_token_ids(*this);
}

const char* family_name(ModelFamily f) {
  for (const FamilyName& n : kFamilies)
    if (n.family == f) return n.model_type;
  return "?";
}

Architecture Architecture::of(const ModelConfig& c) {
  const bool opt = c.family == ModelFamily::kOpt;
  const bool gemma = c.family == ModelFamily::kGemma2;
  Architecture a;
  a.norm = opt ? NormKind::kLayer : NormKind::kRms;
  a.mlp = opt ? MlpKind::kRelu : gemma ? MlpKind::kGatedGeluTanh : MlpKind::kGatedSilu;
  a.positions = opt ? PositionKind::kLearned : PositionKind::kRotary;
  a.pre_norm = !opt || c.do_layer_norm_before;
  a.final_norm = a.pre_norm;
  a.position_offset = c.position_offset;
  a.embed_dim = opt ? c.word_embed_proj_dim : c.hidden;
  a.qk_norm = c.family == ModelFamily::kQwen3 || c.family == ModelFamily::kQwen3Moe;
  a.qk_norm_whole = c.family == ModelFamily::kOlmoe;
  a.moe = c.moe();
  a.post_norms = gemma;
  a.norm_offset = gemma ? 1.0f : 0.0f;
  // Gemma2Model multiplies by sqrt(hidden) cast to the weights' dtype first.
  a.embed_scale = gemma ? round_to_dtype(std::sqrt(static_cast<float>(c.hidden)), c.dtype) : 1.0f;
  return a;
}

float ModelConfig::score_scale() const {
  return attention_scale > 0.0f ? attention_scale : 1.0f / std::sqrt(static_cast<float>(head_dim));
}

int32_t ModelConfig::layer_window(int32_t layer) const {
  if (sliding.empty()) return 0;
  const auto i = static_cast<size_t>(first_layer + layer);
  STRATA_CHECK(layer >= 0 && i < sliding.size(), "layer {} (+{}) of {}", layer, first_layer,
               sliding.size());
  return sliding[i] != 0 ? sliding_window : 0;
}

int32_t ModelConfig::cache_window() const {
  const bool every = !sliding.empty() &&
                     std::all_of(sliding.begin(), sliding.end(), [](uint8_t w) { return w != 0; });
  return every ? sliding_window : 0;
}

ModelShape ModelConfig::shape() const {
  const Architecture a = architecture();
  ModelShape s;
  s.hidden = hidden;
  s.intermediate = intermediate;
  s.n_layers = n_layers;
  s.n_heads = n_heads;
  s.n_kv_heads = n_kv_heads;
  s.head_dim = head_dim;
  s.vocab = vocab;
  s.max_positions = max_positions;
  s.gated_mlp = a.gated_mlp();
  s.learned_positions = a.learned_positions();
  s.linear_bias = attention_bias || mlp_bias;
  s.norm_bias = a.norm_bias();
  s.tied_head = tie_word_embeddings;
  s.weight_bytes_per_elem = static_cast<int64_t>(dtype_size(dtype));
  s.dtype = dtype;
  s.embed_dim = a.embed_dim;
  s.position_offset = position_offset;
  s.final_norm = a.final_norm;
  s.attention_bias = attention_bias;
  s.qkv_bias_only = qkv_bias_only;
  s.mlp_bias = mlp_bias;
  s.qk_norm = a.qk_norm;
  s.qk_norm_whole = a.qk_norm_whole;
  s.post_norms = a.post_norms;
  s.longrope = rope_scaling_type == "longrope";
  s.cache_window = cache_window();
  s.n_experts = n_experts;
  s.experts_per_token = experts_per_token;
  s.expert_intermediate = expert_intermediate;
  s.shared_expert_gate = family == ModelFamily::kQwen2Moe;
  return s;
}

ModelConfig tensor_parallel_shard(const ModelConfig& full, int32_t degree) {
  if (degree < 1)
    fail_input("{}: tensor-parallel degree {} (must be 1 or more)", full.source, degree);
  for (const auto& [what, count] :
       {std::pair{"attention heads", full.n_heads}, std::pair{"KV heads", full.n_kv_heads},
        std::pair{"MLP intermediate columns", full.intermediate},
        std::pair{"experts' intermediate columns", full.expert_intermediate}})
    if (count % degree != 0)
      fail_input("{}: tensor-parallel degree {} does not divide its {} {}", full.source, degree,
                 count, what);
  ModelConfig shard = full;
  shard.n_heads /= degree;
  shard.n_kv_heads /= degree;
  shard.intermediate /= degree;
  shard.expert_intermediate /= degree;  // each expert split as a dense MLP; the router whole
  return shard;
}

std::string ModelConfig::str() const {
  std::string extra;
  if (!rope_scaling_type.empty()) extra += fmt::format(", rope_scaling={}", rope_scaling_type);
  if (sliding_window > 0)
    extra += fmt::format(", window={} on {} of {} layers", sliding_window,
                         std::count(sliding.begin(), sliding.end(), 1), sliding.size());
  if (attention_scale > 0.0f) extra += fmt::format(", score_scale={}", attention_scale);
  if (attn_softcap > 0.0f) extra += fmt::format(", attn_softcap={}", attn_softcap);
  if (final_softcap > 0.0f) extra += fmt::format(", final_softcap={}", final_softcap);
  if (moe())
    extra += fmt::format(", experts={} top-{} of {} columns{}", n_experts, experts_per_token,
                         expert_intermediate, norm_topk_prob ? " renormalised" : "");
  return fmt::format(
      "ModelConfig({}, {}, hidden={}, intermediate={}, layers={}, heads={}, kv_heads={}, "
      "head_dim={}, vocab={}, max_pos={}, eps={}, dtype={}, tied={}{})",
      source, family_name(family), hidden, intermediate, n_layers, n_heads, n_kv_heads, head_dim,
      vocab, max_positions, norm_eps, dtype_name(dtype), tie_word_embeddings, extra);
}

ModelConfig parse_model_config_text(std::string_view text, const std::string& source,
                                    const InputLimits& limits) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    fail_input("{}: not valid JSON: {}", source, e.what());
  }
  return parse_model_config(j, source, limits);
}

ModelConfig load_model_config(const std::string& dir, const InputLimits& limits) {
  namespace fs = std::filesystem;
  std::error_code ec;  // a name too long or unreadable is "does not exist", not a throw
  if (!fs::is_directory(dir, ec)) fail_input("model directory '{}' does not exist", dir);
  const std::string path = (fs::path(dir) / "config.json").string();
  if (!fs::exists(path, ec))
    fail_input("{}: cannot open (every model directory needs a config.json)", path);
  const std::string text =
      read_file_bounded(path, limits, &InputLimits::json_file_bytes, "config.json");
  ModelConfig c = parse_model_config_text(text, path, limits);
  const std::string gen = (fs::path(dir) / "generation_config.json").string();
  if (fs::exists(gen, ec)) {
    read_generation_config(
        read_file_bounded(gen, limits, &InputLimits::json_file_bytes, "generation_config.json"),
        gen, c);
    c.validate(limits);  // its eos ids, against the vocabulary
  }
  return c;
}

std::string GenerationDefaults::str() const {
  std::string s;
  const auto add = [&](const char* name, const auto& v) {
    if (v) s += fmt::format("{}{}={}", s.empty() ? "" : " ", name, *v);
  };
  add("temperature", temperature);
  add("top_k", top_k);
  add("top_p", top_p);
  add("min_p", min_p);
  add("repetition_penalty", repetition_penalty);
  add("max_new_tokens", max_new_tokens);
  return s.empty() ? "none" : s;
}

void read_generation_config(const std::string& text, const std::string& source, ModelConfig& c) {
  const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) fail_input("{}: not valid JSON", source);
  if (!j.is_object()) fail_input("{}: not a JSON object", source);
  const Fields f{j, source, ""};
  GenerationDefaults& g = c.generation;
  g.source = source;
  const auto number = [&](const char* key, std::optional<float>& out) {
    const json* v = f.find(key);
    if (v == nullptr) return;
    if (!v->is_number() || !std::isfinite(v->get<double>()))
      fail_input("{}: field '{}' must be a number, got {}", source, key, v->dump());
    out = v->get<float>();
  };
  number("temperature", g.temperature);
  number("top_p", g.top_p);
  number("min_p", g.min_p);
  number("repetition_penalty", g.repetition_penalty);
  if (const json* v = f.find("top_k")) g.top_k = f.id_value(*v, "top_k");
  if (const json* v = f.find("max_new_tokens")) g.max_new_tokens = f.id_value(*v, "max_new_tokens");
  for (int32_t id : get_eos(f))
    if (std::find(c.eos_token_ids.begin(), c.eos_token_ids.end(), id) == c.eos_token_ids.end())
      c.eos_token_ids.push_back(id);
}

}  // namespace strata
