#include "worker/dummy.h"

#include <cmath>
#include <cstring>

#include "kernels/error.h"
#include "worker/model_path.h"

namespace strata {
namespace {

constexpr std::string_view kDummyPrefix = "dummy:";

struct DummyShape {
  const char* name;
  ModelFamily family;
  int32_t hidden, intermediate, layers, heads, kv_heads, vocab, max_positions;
  bool tied;
  // MoE shapes: experts, experts per token, each expert's intermediate size, and a head_dim
  // of its own (0: hidden / heads).
  int32_t experts = 0, top_k = 0, expert_intermediate = 0, head_dim = 0;
};

// OPT shapes as FlexGen's opt_config.py lists them; Llama shapes from the published configs
// (llama-110m is llama2.c's stories110M: 768 / 2048 / 12 layers / 12 heads / 32000;
// llama-12m keeps Llama 2's 32000-piece vocabulary on a body small enough to serve real
// request sets on a 2-core machine: S3's packing benchmark, docs/S3.md).
constexpr DummyShape kShapes[] = {
    {"opt-125m", ModelFamily::kOpt, 768, 3072, 12, 12, 12, 50272, 2048, true},
    {"opt-350m", ModelFamily::kOpt, 1024, 4096, 24, 16, 16, 50272, 2048, true},
    {"opt-1.3b", ModelFamily::kOpt, 2048, 8192, 24, 32, 32, 50272, 2048, true},
    {"opt-2.7b", ModelFamily::kOpt, 2560, 10240, 32, 32, 32, 50272, 2048, true},
    {"opt-6.7b", ModelFamily::kOpt, 4096, 16384, 32, 32, 32, 50272, 2048, true},
    {"opt-13b", ModelFamily::kOpt, 5120, 20480, 40, 40, 40, 50272, 2048, true},
    {"opt-30b", ModelFamily::kOpt, 7168, 28672, 48, 56, 56, 50272, 2048, true},
    {"opt-66b", ModelFamily::kOpt, 9216, 36864, 64, 72, 72, 50272, 2048, true},
    {"opt-175b", ModelFamily::kOpt, 12288, 49152, 96, 96, 96, 50272, 2048, true},
    // GPT-3 shapes of ExeGPT's Table 1 (layers, hidden, heads; MLP 4x hidden), built as
    // OPT-family models: the same weights and FLOPs per token.
    {"gpt3-39b", ModelFamily::kOpt, 8192, 32768, 48, 64, 64, 50272, 2048, true},
    {"gpt3-101b", ModelFamily::kOpt, 10240, 40960, 80, 80, 80, 50272, 2048, true},
    {"llama-12m", ModelFamily::kLlama, 256, 768, 4, 4, 4, 32000, 1024, true},
    {"llama-110m", ModelFamily::kLlama, 768, 2048, 12, 12, 12, 32000, 1024, true},
    {"llama-7b", ModelFamily::kLlama, 4096, 11008, 32, 32, 32, 32000, 4096, false},
    {"llama-13b", ModelFamily::kLlama, 5120, 13824, 40, 40, 40, 32000, 4096, false},
    {"llama-30b", ModelFamily::kLlama, 6656, 17920, 60, 52, 52, 32000, 2048, false},
    {"llama-65b", ModelFamily::kLlama, 8192, 22016, 80, 64, 64, 32000, 2048, false},
    {"llama-70b", ModelFamily::kLlama, 8192, 28672, 80, 64, 8, 32000, 4096, false},
    // Mixture-of-experts shapes from the published configs (Mixtral-8x7B-v0.1,
    // OLMoE-1B-7B-0924, Qwen3-30B-A3B), and a Mixtral-shaped model small enough for a 2-core
    // machine's benchmarks (8 experts, top-2, expert width 3.5 x hidden as Mixtral's).
    {"mixtral-8x7b", ModelFamily::kMixtral, 4096, 0, 32, 32, 8, 32000, 32768, false, 8, 2, 14336},
    {"olmoe-1b-7b", ModelFamily::kOlmoe, 2048, 0, 16, 16, 16, 50304, 4096, false, 64, 8, 1024},
    {"qwen3-30b-a3b", ModelFamily::kQwen3Moe, 2048, 0, 48, 32, 4, 151936, 40960, false, 128, 8, 768,
     128},
    {"mixtral-mini", ModelFamily::kMixtral, 1024, 0, 8, 16, 4, 32000, 4096, false, 8, 2, 3584},
};

uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t hash_name(const std::string& s) {  // FNV-1a
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : s) h = (h ^ ch) * 1099511628211ull;
  return h;
}

// Uniform in [-1, 1) from a counter: independent of thread count and evaluation order.
float unit(uint64_t key, int64_t i) {
  const uint64_t r = mix64(key + 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(i + 1));
  return static_cast<float>(r >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

}  // namespace

bool is_dummy_model(const std::string& spec) {
  return spec.starts_with(kDummyPrefix);
}

ModelConfig load_spec_config(const std::string& spec, DType dummy_dtype,
                             const InputLimits& limits) {
  if (spec.empty()) fail_input("no model given: pass a model directory, ORG/NAME or dummy:NAME");
  return is_dummy_model(spec) ? dummy_model_config(spec.substr(kDummyPrefix.size()), dummy_dtype)
                              : load_model_config(resolve_model_path(spec), limits);
}

std::vector<std::string> dummy_model_names() {
  std::vector<std::string> names;
  for (const auto& s : kShapes) names.emplace_back(s.name);
  return names;
}

ModelConfig dummy_model_config(const std::string& name, DType dtype) {
  for (const DummyShape& s : kShapes) {
    if (name != s.name) continue;
    ModelConfig c;
    c.family = s.family;
    c.source = std::string(kDummyPrefix) + name;
    c.hidden = s.hidden;
    c.intermediate = s.intermediate;
    c.n_layers = s.layers;
    c.n_heads = s.heads;
    c.n_kv_heads = s.kv_heads;
    c.head_dim = s.head_dim > 0 ? s.head_dim : s.hidden / s.heads;
    c.n_experts = s.experts;
    c.experts_per_token = s.top_k;
    c.expert_intermediate = s.expert_intermediate;
    c.norm_topk_prob = s.family == ModelFamily::kMixtral || s.family == ModelFamily::kQwen3Moe;
    c.vocab = s.vocab;
    c.max_positions = s.max_positions;
    c.dtype = dtype;
    c.tie_word_embeddings = s.tied;
    if (s.family == ModelFamily::kOpt) {
      c.norm_eps = 1e-5f;
      c.position_offset = 2;
      c.word_embed_proj_dim = s.hidden;
      c.attention_bias = c.mlp_bias = true;
      c.bos_token_id = 2;
      c.eos_token_ids = {2};
    } else {
      c.norm_eps = 1e-5f;
      c.rope_theta = 10000.0f;
      c.bos_token_id = 1;
      c.eos_token_ids = {2};
    }
    c.validate();
    return c;
  }
  std::string known;
  for (const auto& n : dummy_model_names()) known += (known.empty() ? "" : ", ") + n;
  fail_input("unknown dummy model '{}' (known: {})", name, known);
}

void fill_dummy_tensor(uint64_t seed, const std::string& name, int64_t fan_in, const Tensor& out) {
  const uint64_t key = mix64(seed ^ hash_name(name));
  const int64_t n = out.shape.numel();
  const float scale = fan_in > 0 ? 1.0f / std::sqrt(static_cast<float>(fan_in)) : 0.05f;
  const float base = fan_in == 0 ? 1.0f : 0.0f;
  const float jitter = fan_in == 0 ? 0.05f : scale;
  const DType dt = out.dtype;
#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) {
    const float v = base + jitter * unit(key, i);
    switch (dt) {
      case DType::kF32:
        out.as<float>()[i] = v;
        break;
      case DType::kF16:
        out.as<uint16_t>()[i] = f32_to_f16(v);
        break;
      case DType::kBF16:
        out.as<uint16_t>()[i] = f32_to_bf16(v);
        break;
      case DType::kI32:
        out.as<int32_t>()[i] = 0;
        break;
      case DType::kQ4:
      case DType::kF32Panel:
      case DType::kQ4Panel:
        break;  // made from f32 by the loader, never generated
    }
  }
}

}  // namespace strata
