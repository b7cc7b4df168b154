// Mixtral-8x7B-v0.1's shape as its config.json gives it (f16), for the placement tests:
// hidden 4096, 32 layers, 32 heads, 8 KV heads, vocab 32000, 8 experts of 14336, top-2,
// untied head. placement/ cannot read worker/'s configs.
#pragma once

#include "placement/model_shape.h"

namespace strata::testing {

inline ModelShape mixtral_8x7b() {
  ModelShape s;
  s.hidden = 4096;
  s.intermediate = 0;  // no dense MLP beside the experts
  s.n_layers = 32;
  s.n_heads = 32;
  s.n_kv_heads = 8;
  s.head_dim = 128;
  s.vocab = 32000;
  s.max_positions = 32768;
  s.gated_mlp = true;
  s.tied_head = false;
  s.weight_bytes_per_elem = 2;
  s.dtype = DType::kF16;
  s.n_experts = 8;
  s.experts_per_token = 2;
  s.expert_intermediate = 14336;
  return s;
}

}  // namespace strata::testing
