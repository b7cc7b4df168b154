// The numbers of a transformer that decide memory and cost: what FlexGen's cost model
// (appendix A.3) calls h1 (hidden), h2 (MLP intermediate), l (layers), s, n, b.
// Everything here is arithmetic on the shape; it never touches weights.
#pragma once

#include <cstdint>
#include <string>

#include "kernels/tensor.h"

namespace strata {

struct ModelShape {
  int64_t hidden = 0;        // h1
  int64_t intermediate = 0;  // h2
  int64_t n_layers = 0;      // l
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t vocab = 0;
  int64_t max_positions = 0;
  bool gated_mlp = false;          // SwiGLU: gate + up + down; else fc1 + fc2
  bool learned_positions = false;  // OPT: a [max_positions + 2, hidden] table
  bool linear_bias = false;        // q/k/v/o and MLP projections carry a bias
  bool norm_bias = false;          // LayerNorm (weight + bias) vs RMSNorm (weight)
  bool tied_head = true;           // lm_head shares the token embedding
  int64_t weight_bytes_per_elem = 4;
  // What the engine's memory model (stage_placement.h) needs beyond the cost model's counts:
  // the matrices' dtype as stored (vectors are f32), OPT's embedding width and position
  // offset, the final norm, and which projections carry biases.
  DType dtype = DType::kF32;
  int64_t embed_dim = 0;  // token embedding width (OPT word_embed_proj_dim); 0: hidden
  int64_t position_offset = 0;
  bool final_norm = true;
  bool attention_bias = false;  // q/k/v/o
  bool qkv_bias_only = false;   // Qwen2: no bias on o
  bool mlp_bias = false;        // up/down, and gate where gated
  bool qk_norm = false;         // Qwen3: [head_dim] norms of q and k per layer
  bool qk_norm_whole = false;   // OLMoE: [q_width] and [kv_width] norms of q and k instead
  bool post_norms = false;      // Gemma-2: a [hidden] norm after each block
  bool longrope = false;        // Phi-3: two rotary tables (short and long factors)
  // Every layer's sliding window (Mistral's): a KV slot holds KvWindow's rows, not the
  // context (kernels/backend.h). 0: none, or only some layers have one.
  int64_t cache_window = 0;
  // Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE; n_experts 0: a dense MLP): each
  // layer's MLP is n_experts gated experts of expert_intermediate columns and a router
  // [n_experts, hidden], and a row runs experts_per_token of them. `intermediate` is then the
  // dense MLP beside the experts (Qwen2-MoE's shared expert, with its [1, hidden] sigmoid
  // gate), 0 where there is none.
  int64_t n_experts = 0;
  int64_t experts_per_token = 0;
  int64_t expert_intermediate = 0;
  bool shared_expert_gate = false;

  bool moe() const { return n_experts > 0; }
  int64_t expert_params() const { return 3 * hidden * expert_intermediate; }  // gate, up, down
  // The router (and the shared expert's gate) of one layer.
  int64_t router_params_per_layer() const;
  // The experts a step of `rows` rows runs in one layer on average when the router spreads
  // rows evenly: n_experts (1 - (1 - k / n_experts)^rows) (each row picks k of them).
  double expected_active_experts(int64_t rows) const;
  // What one row reads of a layer: attention, norms, router, the dense MLP and k experts
  // (params_per_layer for a dense model).
  int64_t active_params_per_layer() const;

  int64_t q_width() const { return n_heads * head_dim; }
  int64_t kv_width() const { return n_kv_heads * head_dim; }
  int64_t embed_width() const { return embed_dim > 0 ? embed_dim : hidden; }
  // The elements of a layer's q and k norms (Qwen3's per head, OLMoE's over the projection).
  int64_t qk_norm_elems() const {
    return qk_norm ? 2 * head_dim : qk_norm_whole ? q_width() + kv_width() : 0;
  }

  // Parameter counts.
  int64_t attention_params_per_layer() const;
  int64_t mlp_params_per_layer() const;  // a MoE layer's: every expert, router, dense MLP
  int64_t params_per_layer() const;      // incl. norms and biases
  int64_t embedding_params() const;      // token (+ position) tables
  int64_t head_params() const;           // 0 when tied
  int64_t total_params() const;

  // Bytes read from weights for one decode step of `rows` rows of the whole model (every
  // matrix once, the embedding only as rows, the head in full; of a MoE layer's experts the
  // expected_active_experts(rows)).
  int64_t decode_weight_bytes(int64_t rows = 1) const;
  // FLOPs (2 per multiply-add) of one token through every layer (a MoE layer's k experts),
  // attention over `context` cached tokens included; and of one row through the LM head.
  double layer_flops_per_token(int64_t context) const;
  double head_flops() const;
  // FLOPs one sequence executes when it has produced `generated` tokens: every prompt row
  // goes through the layers, but only the last prompt row and each decode row (the last
  // generated token is never fed back) go through the LM head. 0 before the first token.
  double sequence_flops(int64_t prompt_len, int64_t generated) const;

  std::string str() const;
  // One shard of a tensor-parallel group of `degree` (worker/config.h's
  // tensor_parallel_shard, the same split): heads, KV heads and intermediate columns divided.
  // The caller has checked tp_divides(degree).
  bool tp_divides(int64_t degree) const;
  ModelShape tp_shard(int64_t degree) const;
};

}  // namespace strata
