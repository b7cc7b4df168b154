// OPT shapes as FlexGen's cost model sees them (fp16 weights, biases, LayerNorm, learned
// positions, tied head), for the placement tests. placement/ cannot read worker/'s configs.
#pragma once

#include <cstdint>

#include "placement/model_shape.h"

namespace strata::testing {

inline ModelShape opt_shape(int64_t hidden, int64_t ffn, int64_t layers, int64_t heads) {
  ModelShape m;
  m.hidden = hidden;
  m.intermediate = ffn;
  m.n_layers = layers;
  m.n_heads = heads;
  m.n_kv_heads = heads;
  m.head_dim = hidden / heads;
  m.vocab = 50272;
  m.max_positions = 2048;
  m.learned_positions = true;
  m.linear_bias = true;
  m.norm_bias = true;
  m.tied_head = true;
  m.weight_bytes_per_elem = 2;  // fp16, FlexGen's assumption
  return m;
}

// OPT-30B, FlexGen's ablation model: h1 7168, h2 28672, 48 layers, 56 heads.
inline ModelShape opt_30b() {
  return opt_shape(7168, 28672, 48, 56);
}

}  // namespace strata::testing
