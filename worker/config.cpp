#include "worker/config.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "kernels/error.h"

namespace strata {
namespace {

using json = nlohmann::json;

// Reads an integer field; `fallback` < 0 means required.
int32_t get_int(const json& j, const char* key, const std::string& src, int64_t fallback = -1) {
  if (!j.contains(key) || j[key].is_null()) {
    if (fallback < 0) fail_input("{}: missing required field '{}'", src, key);
    return static_cast<int32_t>(fallback);
  }
  const json& v = j[key];
  if (!v.is_number_integer())
    fail_input("{}: field '{}' must be an integer, got {}", src, key, v.dump());
  const int64_t x = v.get<int64_t>();
  if (x < 0 || x > INT32_MAX) fail_input("{}: field '{}' = {} is out of range", src, key, x);
  return static_cast<int32_t>(x);
}

float get_float(const json& j, const char* key, const std::string& src, float fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  if (!j[key].is_number())
    fail_input("{}: field '{}' must be a number, got {}", src, key, j[key].dump());
  return j[key].get<float>();
}

bool get_bool(const json& j, const char* key, const std::string& src, bool fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  if (!j[key].is_boolean())
    fail_input("{}: field '{}' must be true or false, got {}", src, key, j[key].dump());
  return j[key].get<bool>();
}

std::vector<int32_t> get_eos(const json& j, const std::string& src) {
  std::vector<int32_t> ids;
  if (!j.contains("eos_token_id") || j["eos_token_id"].is_null()) return ids;
  const json& v = j["eos_token_id"];
  if (v.is_number_integer()) {
    ids.push_back(v.get<int32_t>());
  } else if (v.is_array()) {
    for (const json& e : v) {
      if (!e.is_number_integer())
        fail_input("{}: eos_token_id entries must be integers, got {}", src, e.dump());
      ids.push_back(e.get<int32_t>());
    }
  } else {
    fail_input("{}: eos_token_id must be an integer or a list, got {}", src, v.dump());
  }
  return ids;
}

ModelFamily detect_family(const json& j, const std::string& src) {
  const std::string type = j.value("model_type", "");
  std::string arch;
  if (j.contains("architectures") && j["architectures"].is_array() && !j["architectures"].empty() &&
      j["architectures"][0].is_string())
    arch = j["architectures"][0].get<std::string>();
  if (type == "llama" || arch == "LlamaForCausalLM") return ModelFamily::kLlama;
  if (type == "opt" || arch == "OPTForCausalLM") return ModelFamily::kOpt;
  fail_input(
      "{}: unsupported model (model_type '{}', architectures[0] '{}'); supported: llama "
      "(LlamaForCausalLM), opt (OPTForCausalLM)",
      src, type, arch);
}

void parse_rope_scaling(const json& j, ModelConfig& c) {
  if (!j.contains("rope_scaling") || j["rope_scaling"].is_null()) return;
  const json& rs = j["rope_scaling"];
  if (!rs.is_object()) fail_input("{}: rope_scaling must be an object or null", c.source);
  std::string type = rs.value("rope_type", rs.value("type", ""));
  if (type == "default") return;
  if (type != "linear" && type != "llama3")
    fail_input("{}: rope_scaling type '{}' is not supported (supported: linear, llama3)", c.source,
               type);
  c.rope_scaling_type = type;
  c.rope_factor = get_float(rs, "factor", c.source, 1.0f);
  c.rope_low_freq_factor = get_float(rs, "low_freq_factor", c.source, 1.0f);
  c.rope_high_freq_factor = get_float(rs, "high_freq_factor", c.source, 4.0f);
  c.rope_original_max_positions =
      get_int(rs, "original_max_position_embeddings", c.source, c.max_positions);
}

void parse_llama(const json& j, ModelConfig& c) {
  const std::string& s = c.source;
  c.intermediate = get_int(j, "intermediate_size", s);
  c.n_kv_heads = get_int(j, "num_key_value_heads", s, c.n_heads);
  c.head_dim = get_int(j, "head_dim", s, c.n_heads > 0 ? c.hidden / c.n_heads : 0);
  c.norm_eps = get_float(j, "rms_norm_eps", s, 1e-6f);
  c.rope_theta = get_float(j, "rope_theta", s, 10000.0f);
  c.attention_bias = get_bool(j, "attention_bias", s, false);
  c.mlp_bias = get_bool(j, "mlp_bias", s, false);
  c.tie_word_embeddings = get_bool(j, "tie_word_embeddings", s, false);
  const std::string act = j.value("hidden_act", "silu");
  if (act != "silu")
    fail_input("{}: hidden_act '{}' is not supported for llama (supported: silu)", s, act);
  parse_rope_scaling(j, c);
}

void parse_opt(const json& j, ModelConfig& c) {
  const std::string& s = c.source;
  c.intermediate = get_int(j, "ffn_dim", s);
  c.n_kv_heads = c.n_heads;
  c.head_dim = c.n_heads > 0 ? c.hidden / c.n_heads : 0;
  c.norm_eps = 1e-5f;  // fixed in OPT's LayerNorm
  c.position_offset = 2;
  c.do_layer_norm_before = get_bool(j, "do_layer_norm_before", s, true);
  c.word_embed_proj_dim = get_int(j, "word_embed_proj_dim", s, c.hidden);
  const bool bias = get_bool(j, "enable_bias", s, true);
  c.attention_bias = bias;
  c.mlp_bias = bias;
  c.tie_word_embeddings = get_bool(j, "tie_word_embeddings", s, true);
  if (!get_bool(j, "layer_norm_elementwise_affine", s, true))
    fail_input("{}: layer_norm_elementwise_affine = false is not supported", s);
  const std::string act = j.value("activation_function", "relu");
  if (act != "relu")
    fail_input("{}: activation_function '{}' is not supported for opt (supported: relu)", s, act);
}

}  // namespace

ModelConfig parse_model_config(const json& j, const std::string& source) {
  if (!j.is_object()) fail_input("{}: not a JSON object", source);
  ModelConfig c;
  c.source = source;
  c.family = detect_family(j, source);
  c.hidden = get_int(j, "hidden_size", source);
  c.n_layers = get_int(j, "num_hidden_layers", source);
  c.n_heads = get_int(j, "num_attention_heads", source);
  c.vocab = get_int(j, "vocab_size", source);
  c.max_positions = get_int(j, "max_position_embeddings", source, 2048);
  c.bos_token_id = j.contains("bos_token_id") && j["bos_token_id"].is_number_integer()
                       ? j["bos_token_id"].get<int32_t>()
                       : -1;
  c.eos_token_ids = get_eos(j, source);
  if (j.contains("torch_dtype") && j["torch_dtype"].is_string()) {
    auto dt = parse_dtype(j["torch_dtype"].get<std::string>());
    if (dt && *dt != DType::kI32) c.dtype = *dt;
  }
  if (c.is_llama()) {
    parse_llama(j, c);
  } else {
    parse_opt(j, c);
  }
  c.validate();
  return c;
}

void ModelConfig::validate() const {
  auto positive = [&](const char* field, int64_t v) {
    if (v <= 0) fail_input("{}: {} must be positive, got {}", source, field, v);
  };
  positive("hidden_size", hidden);
  positive("intermediate_size", intermediate);
  positive("num_hidden_layers", n_layers);
  positive("num_attention_heads", n_heads);
  positive("num_key_value_heads", n_kv_heads);
  positive("vocab_size", vocab);
  positive("max_position_embeddings", max_positions);
  if (hidden % n_heads != 0)
    fail_input("{}: num_attention_heads {} does not divide hidden_size {}", source, n_heads,
               hidden);
  if (n_heads % n_kv_heads != 0)
    fail_input("{}: num_key_value_heads {} does not divide num_attention_heads {}", source,
               n_kv_heads, n_heads);
  positive("head_dim", head_dim);
  if (is_llama() && head_dim % 2 != 0)
    fail_input("{}: head_dim {} must be even for rotary embeddings", source, head_dim);
  if (!(norm_eps > 0.0f)) fail_input("{}: norm epsilon must be positive, got {}", source, norm_eps);
  if (is_llama() && !(rope_theta > 0.0f))
    fail_input("{}: rope_theta must be positive, got {}", source, rope_theta);
  if (is_opt() && word_embed_proj_dim <= 0)
    fail_input("{}: word_embed_proj_dim must be positive, got {}", source, word_embed_proj_dim);
  for (int32_t e : eos_token_ids)
    if (e < 0 || e >= vocab)
      fail_input("{}: eos_token_id {} outside vocabulary of {}", source, e, vocab);
}

ModelShape ModelConfig::shape() const {
  ModelShape s;
  s.hidden = hidden;
  s.intermediate = intermediate;
  s.n_layers = n_layers;
  s.n_heads = n_heads;
  s.n_kv_heads = n_kv_heads;
  s.head_dim = head_dim;
  s.vocab = vocab;
  s.max_positions = max_positions;
  s.gated_mlp = is_llama();
  s.learned_positions = is_opt();
  s.linear_bias = attention_bias || mlp_bias;
  s.norm_bias = is_opt();
  s.tied_head = tie_word_embeddings;
  s.weight_bytes_per_elem = static_cast<int64_t>(dtype_size(dtype));
  return s;
}

std::string ModelConfig::str() const {
  return fmt::format(
      "ModelConfig({}, {}, hidden={}, intermediate={}, layers={}, heads={}, kv_heads={}, "
      "head_dim={}, vocab={}, max_pos={}, eps={}, dtype={}, tied={})",
      source, is_llama() ? "llama" : "opt", hidden, intermediate, n_layers, n_heads, n_kv_heads,
      head_dim, vocab, max_positions, norm_eps, dtype_name(dtype), tie_word_embeddings);
}

ModelConfig load_model_config(const std::string& dir) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(dir)) fail_input("model directory '{}' does not exist", dir);
  const std::string path = (fs::path(dir) / "config.json").string();
  std::ifstream in(path);
  if (!in) fail_input("{}: cannot open (every model directory needs a config.json)", path);
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    fail_input("{}: not valid JSON: {}", path, e.what());
  }
  return parse_model_config(j, path);
}

}  // namespace strata
