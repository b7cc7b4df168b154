#include "placement/model_shape.h"

#include <fmt/format.h>

#include <cmath>

#include "kernels/error.h"

namespace strata {

bool ModelShape::tp_divides(int64_t degree) const {
  return degree >= 1 && n_heads % degree == 0 && n_kv_heads % degree == 0 &&
         intermediate % degree == 0 && expert_intermediate % degree == 0;
}

ModelShape ModelShape::tp_shard(int64_t degree) const {
  STRATA_CHECK(tp_divides(degree), "tensor-parallel degree {} of {}", degree, str());
  ModelShape shard = *this;
  shard.n_heads /= degree;
  shard.n_kv_heads /= degree;
  shard.intermediate /= degree;
  shard.expert_intermediate /= degree;  // each expert split as a dense MLP; the router whole
  return shard;
}

int64_t ModelShape::attention_params_per_layer() const {
  const int64_t q_out = n_heads * head_dim;
  const int64_t kv_out = n_kv_heads * head_dim;
  int64_t p = hidden * q_out + 2 * hidden * kv_out + q_out * hidden;
  if (linear_bias) p += q_out + 2 * kv_out + hidden;
  return p;
}

int64_t ModelShape::mlp_params_per_layer() const {
  int64_t p = (gated_mlp ? 3 : 2) * hidden * intermediate;
  if (linear_bias && intermediate > 0) p += intermediate + hidden;
  return p + n_experts * expert_params() + router_params_per_layer();
}

int64_t ModelShape::router_params_per_layer() const {
  return moe() ? n_experts * hidden + (shared_expert_gate ? hidden : 0) : 0;
}

double ModelShape::expected_active_experts(int64_t rows) const {
  if (!moe() || rows <= 0) return 0.0;
  const double e = static_cast<double>(n_experts);
  const double miss = 1.0 - static_cast<double>(experts_per_token) / e;
  return e * (1.0 - std::pow(miss, static_cast<double>(rows)));
}

int64_t ModelShape::active_params_per_layer() const {
  return params_per_layer() - (n_experts - experts_per_token) * expert_params();
}

int64_t ModelShape::params_per_layer() const {
  const int64_t norms = (2 + (post_norms ? 2 : 0)) * hidden * (norm_bias ? 2 : 1) + qk_norm_elems();
  return attention_params_per_layer() + mlp_params_per_layer() + norms;
}

int64_t ModelShape::embedding_params() const {
  return vocab * hidden + (learned_positions ? (max_positions + 2) * hidden : 0);
}

int64_t ModelShape::head_params() const {
  return tied_head ? 0 : vocab * hidden;
}

int64_t ModelShape::total_params() const {
  return n_layers * params_per_layer() + embedding_params() + head_params() +
         hidden * (norm_bias ? 2 : 1);
}

int64_t ModelShape::decode_weight_bytes(int64_t rows) const {
  const int64_t per_token_rows = hidden * (learned_positions ? 2 : 1) * rows;
  const int64_t head = vocab * hidden;  // read in full whether tied or not
  const double idle_experts =
      moe() ? static_cast<double>(n_experts) - expected_active_experts(rows) : 0.0;
  const auto layer = static_cast<int64_t>(static_cast<double>(params_per_layer()) -
                                          idle_experts * static_cast<double>(expert_params()));
  return (n_layers * layer + per_token_rows + head) * weight_bytes_per_elem;
}

double ModelShape::layer_flops_per_token(int64_t context) const {
  const int64_t idle_experts = n_experts - experts_per_token;
  const double matmul =
      2.0 * static_cast<double>(n_layers * (attention_params_per_layer() + mlp_params_per_layer() -
                                            idle_experts * expert_params()));
  // QK^T and PV: 2 * n_heads * head_dim * context multiply-adds per layer.
  const double attn = 4.0 * static_cast<double>(n_layers * n_heads * head_dim * context);
  return matmul + attn;
}

double ModelShape::head_flops() const {
  return 2.0 * static_cast<double>(vocab * hidden);
}

double ModelShape::sequence_flops(int64_t prompt_len, int64_t generated) const {
  if (generated <= 0) return 0;
  double flops = head_flops();
  for (int64_t p = 1; p <= prompt_len; ++p) flops += layer_flops_per_token(p);
  for (int64_t g = 1; g < generated; ++g)
    flops += layer_flops_per_token(prompt_len + g) + head_flops();
  return flops;
}

std::string ModelShape::str() const {
  return fmt::format(
             "ModelShape(h1={}, h2={}, layers={}, heads={}, kv_heads={}, head_dim={}, vocab={}, "
             "max_pos={}, {}, {}{}, params={:.3f}M)",
             hidden, intermediate, n_layers, n_heads, n_kv_heads, head_dim, vocab, max_positions,
             gated_mlp ? "gated MLP" : "plain MLP", tied_head ? "tied head" : "untied head",
             cache_window > 0 ? fmt::format(", KV window {}", cache_window) : "",
             static_cast<double>(total_params()) / 1e6) +
         (moe() ? fmt::format(" + MoE({} experts of {}, top-{}{}, active {:.3f}M/layer)", n_experts,
                              expert_intermediate, experts_per_token,
                              shared_expert_gate ? ", shared expert" : "",
                              static_cast<double>(active_params_per_layer()) / 1e6)
                : "");
}

}  // namespace strata
