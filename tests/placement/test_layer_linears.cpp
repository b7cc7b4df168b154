// A layer's linears (placement/layer_linears.h) against shapes worked by hand: OPT-125m
// (hidden 768, 12 heads of 64, fc1/fc2 3072, every projection biased, no gate) and a
// Llama-3-8B layer (hidden 4096, 32 query heads and 8 KV heads of 128 -- grouped-query
// attention -- a SwiGLU MLP of 14336, no biases).
#include <gtest/gtest.h>

#include "placement/hetegen.h"
#include "placement/layer_linears.h"

namespace strata {
namespace {

ModelShape opt125m() {
  ModelShape s;
  s.hidden = 768;
  s.intermediate = 3072;
  s.n_layers = 12;
  s.n_heads = s.n_kv_heads = 12;
  s.head_dim = 64;
  s.attention_bias = s.mlp_bias = true;
  s.dtype = DType::kF16;
  return s;
}

ModelShape llama3_8b() {
  ModelShape s;
  s.hidden = 4096;
  s.intermediate = 14336;
  s.n_layers = 32;
  s.n_heads = 32;
  s.n_kv_heads = 8;
  s.head_dim = 128;
  s.gated_mlp = true;
  s.dtype = DType::kBF16;
  return s;
}

struct Expected {
  const char* name;
  bool present;
  int64_t out, in;
  bool bias;
  LinearBlock block;
};

void expect_linears(const ModelShape& s, const Expected (&want)[kLinearSlots]) {
  const LayerLinears got = layer_linears(s);
  for (int i = 0; i < kLinearSlots; ++i) {
    const LayerLinear& l = got[static_cast<size_t>(i)];
    SCOPED_TRACE(want[i].name);
    EXPECT_EQ(static_cast<int>(l.slot), i);
    EXPECT_STREQ(linear_slot_name(l.slot), want[i].name);
    EXPECT_EQ(l.present, want[i].present);
    EXPECT_EQ(l.out, want[i].out);
    EXPECT_EQ(l.in, want[i].in);
    EXPECT_EQ(l.bias, want[i].bias);
    EXPECT_EQ(linear_block(l.slot), want[i].block);
  }
}

constexpr LinearBlock kAttn = LinearBlock::kAttention;
constexpr LinearBlock kMlp = LinearBlock::kMlp;

TEST(LayerLinears, Opt125mByHand) {
  expect_linears(opt125m(), {{"q", true, 768, 768, true, kAttn},
                             {"k", true, 768, 768, true, kAttn},
                             {"v", true, 768, 768, true, kAttn},
                             {"o", true, 768, 768, true, kAttn},
                             {"gate", false, 3072, 768, false, kMlp},
                             {"up", true, 3072, 768, true, kMlp},  // fc1
                             {"down", true, 768, 3072, true, kMlp}});
}

TEST(LayerLinears, Llama3GroupedQueryByHand) {
  // k and v: 8 KV heads x 128 = 1024 rows; q and o: 32 x 128 = 4096.
  expect_linears(llama3_8b(), {{"q", true, 4096, 4096, false, kAttn},
                               {"k", true, 1024, 4096, false, kAttn},
                               {"v", true, 1024, 4096, false, kAttn},
                               {"o", true, 4096, 4096, false, kAttn},
                               {"gate", true, 14336, 4096, false, kMlp},
                               {"up", true, 14336, 4096, false, kMlp},
                               {"down", true, 4096, 14336, false, kMlp}});
}

TEST(LayerLinears, StoredBytesByHand) {
  const ModelShape s = opt125m();
  const LayerLinear q = linear_of(layer_linears(s), LinearSlot::kQ);
  const LayerLinear down = linear_of(layer_linears(s), LinearSlot::kDown);
  // f16: 2 bytes an element.
  EXPECT_EQ(stored_weight_bytes(s, q, false), 768 * 768 * 2);
  EXPECT_EQ(stored_weight_bytes(s, down, false), 768 * 3072 * 2);
  // 4-bit: half a byte an element, plus a float min and scale per group of 64 along a row.
  EXPECT_EQ(stored_weight_bytes(s, q, true), 768 * 768 / 2 + 2 * 768 * (768 / 64) * 4);
  EXPECT_EQ(stored_weight_bytes(s, down, true), 768 * 3072 / 2 + 2 * 768 * (3072 / 64) * 4);
  // A row that is not whole groups stays as it is.
  EXPECT_TRUE(compressible(768));
  EXPECT_FALSE(compressible(100));
  EXPECT_EQ(stored_dtype(DType::kF16, 100, true), DType::kF16);
  EXPECT_EQ(stored_dtype(DType::kF16, 128, true), DType::kQ4);
  EXPECT_EQ(stored_matrix_bytes(DType::kF32, 3, 100, true), 3 * 100 * 4);
}

TEST(LayerLinears, HeteGenModulesFollowTheTable) {
  // The alpha benchmark's keys and the scheduler's Mem: weight as stored plus an f32 bias.
  const hetegen::SlotModules m = hetegen::slot_modules(opt125m(), false);
  EXPECT_FALSE(m[static_cast<size_t>(LinearSlot::kGate)].present);
  const hetegen::SlotModule& up = m[static_cast<size_t>(LinearSlot::kUp)];
  EXPECT_TRUE(up.present);
  EXPECT_EQ(up.key.str(), "[3072, 768] f16 +bias");
  EXPECT_EQ(up.bytes, 3072 * 768 * 2 + 3072 * 4);
  const hetegen::SlotModules q4 = hetegen::slot_modules(llama3_8b(), true);
  const hetegen::SlotModule& k = q4[static_cast<size_t>(LinearSlot::kK)];
  EXPECT_EQ(k.key.dtype, DType::kQ4);
  EXPECT_EQ(k.bytes, 1024 * 4096 / 2 + 2 * 1024 * (4096 / 64) * 4);
  EXPECT_EQ(hetegen_module_name(3, LinearSlot::kDown), "layer.3.down");
}

}  // namespace
}  // namespace strata
