// ModelShape arithmetic against hand counts for a tiny Llama-style shape.
#include <gtest/gtest.h>

#include <cmath>

#include "placement/model_shape.h"
#include "support/moe_shapes.h"

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

namespace strata {
namespace {

// Mistral AI gives Mixtral 8x7B 46.7B parameters and 12.9B active per token; by hand: a
// layer's attention 2 x 4096^2 + 2 x 4096 x 1024, its experts 8 x 3 x 4096 x 14336, router
// 8 x 4096, two norms; embedding and head 32000 x 4096 each.
using testing::mixtral_8x7b;

TEST(ModelShape, MixtralParametersAsPublished) {
  const ModelShape s = mixtral_8x7b();
  EXPECT_EQ(s.params_per_layer(), 1'451'270'144);
  EXPECT_EQ(s.total_params(), 46'702'792'704);  // "46.7B"
  const int64_t active =
      s.n_layers * s.active_params_per_layer() + s.embedding_params() + s.head_params() + s.hidden;
  EXPECT_EQ(active, 12'879'925'248);  // "12.9B active"
}

TEST(ModelShape, ActiveExpertsOfABatch) {
  const ModelShape s = mixtral_8x7b();
  EXPECT_DOUBLE_EQ(s.expected_active_experts(1), 2.0);
  // 8 (1 - (6/8)^32): a batch of 32 touches nearly every expert.
  EXPECT_NEAR(s.expected_active_experts(32), 8.0 * (1.0 - std::pow(0.75, 32)), 1e-12);
  // Decode bytes at batch 1: every layer's attention, router, norms and two experts, the
  // embedding row and the whole head, 2 bytes each.
  const int64_t layer = s.params_per_layer() - 6 * s.expert_params();
  EXPECT_EQ(s.decode_weight_bytes(1), (32 * layer + 4096 + 32000 * 4096) * 2);
  // FLOPs per token count the two experts only.
  EXPECT_DOUBLE_EQ(s.layer_flops_per_token(0),
                   2.0 * 32 * (s.attention_params_per_layer() + 2 * s.expert_params() + 8 * 4096));
}

}  // namespace
}  // namespace strata
