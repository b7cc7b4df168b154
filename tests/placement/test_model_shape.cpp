// ModelShape arithmetic against hand counts for a tiny Llama-style shape.
#include <gtest/gtest.h>

#include "placement/model_shape.h"

namespace strata {
namespace {

// hidden 8, intermediate 16, 2 layers, 2 heads of 4 (1 KV head), vocab 10, gated MLP, no biases.
ModelShape tiny() {
  ModelShape s;
  s.hidden = 8;
  s.intermediate = 16;
  s.n_layers = 2;
  s.n_heads = 2;
  s.n_kv_heads = 1;
  s.head_dim = 4;
  s.vocab = 10;
  s.max_positions = 32;
  s.gated_mlp = true;
  s.tied_head = false;
  s.weight_bytes_per_elem = 4;
  return s;
}

TEST(ModelShape, ParameterCountsByHand) {
  const ModelShape s = tiny();
  // q 8x8 + k 8x4 + v 8x4 + o 8x8 = 64 + 32 + 32 + 64
  EXPECT_EQ(s.attention_params_per_layer(), 192);
  EXPECT_EQ(s.mlp_params_per_layer(), 3 * 8 * 16);
  EXPECT_EQ(s.params_per_layer(), 192 + 384 + 2 * 8);
  EXPECT_EQ(s.total_params(), 2 * 592 + 80 + 80 + 8);  // layers, embedding, head, final norm
  // A decode step reads every layer, one embedding row and the whole head.
  EXPECT_EQ(s.decode_weight_bytes(), (2 * 592 + 8 + 80) * 4);
}

TEST(ModelShape, FlopsByHand) {
  const ModelShape s = tiny();
  // 2 FLOPs per matmul parameter in each layer, plus QK^T and PV over 5 cached tokens:
  // 4 * n_heads * head_dim * context per layer.
  EXPECT_DOUBLE_EQ(s.layer_flops_per_token(5), 2.0 * 2 * (192 + 384) + 4.0 * 2 * 2 * 4 * 5);
  EXPECT_DOUBLE_EQ(s.head_flops(), 2.0 * 10 * 8);
}

TEST(ModelShape, SequenceFlopsByHand) {
  const ModelShape s = tiny();
  // A token through the layers at context c: 2 * 2 * 576 = 2304 + 64 c; the head: 160.
  // Prompt 3: rows at contexts 1, 2, 3 (7296) and the head once for the first token; the
  // second token's row at context 4 (2560) and the head again. The last token is not fed.
  EXPECT_DOUBLE_EQ(s.sequence_flops(3, 0), 0.0);
  EXPECT_DOUBLE_EQ(s.sequence_flops(3, 1), 7296.0 + 160);
  EXPECT_DOUBLE_EQ(s.sequence_flops(3, 2), 7296.0 + 160 + 2560 + 160);
}

}  // namespace
}  // namespace strata
