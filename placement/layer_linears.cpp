#include "placement/layer_linears.h"

#include "kernels/error.h"
#include "kernels/quant.h"

namespace strata {

const char* linear_slot_name(LinearSlot slot) {
  switch (slot) {
    case LinearSlot::kQ:
      return "q";
    case LinearSlot::kK:
      return "k";
    case LinearSlot::kV:
      return "v";
    case LinearSlot::kO:
      return "o";
    case LinearSlot::kGate:
      return "gate";
    case LinearSlot::kUp:
      return "up";
    case LinearSlot::kDown:
      return "down";
  }
  return "?";
}

LinearBlock linear_block(LinearSlot slot) {
  return slot <= LinearSlot::kO ? LinearBlock::kAttention : LinearBlock::kMlp;
}

LayerLinears layer_linears(const ModelShape& s) {
  const int64_t h = s.hidden, qw = s.q_width(), kvw = s.kv_width(), f = s.intermediate;
  const bool ab = s.attention_bias, mb = s.mlp_bias;
  return {{{LinearSlot::kQ, true, qw, h, ab},
           {LinearSlot::kK, true, kvw, h, ab},
           {LinearSlot::kV, true, kvw, h, ab},
           {LinearSlot::kO, true, h, qw, ab && !s.qkv_bias_only},
           // Llama's mlp_bias biases gate_proj too. A MoE layer without a shared expert
           // (intermediate 0) has no dense MLP; its experts are not layer linears.
           {LinearSlot::kGate, s.gated_mlp && f > 0, f, h, s.gated_mlp && mb},
           {LinearSlot::kUp, f > 0, f, h, mb},
           {LinearSlot::kDown, f > 0, h, f, mb}}};
}

bool compressible(int64_t in) {
  return in % kQuantGroupSize == 0;
}

DType stored_dtype(DType dtype, int64_t in, bool compress) {
  return compress && compressible(in) ? DType::kQ4 : dtype;
}

int64_t stored_matrix_bytes(DType dtype, int64_t out, int64_t in, bool compress) {
  return static_cast<int64_t>(
      Tensor{nullptr, stored_dtype(dtype, in, compress), {out, in}}.bytes());
}

int64_t stored_weight_bytes(const ModelShape& s, const LayerLinear& l, bool compress) {
  return stored_matrix_bytes(s.dtype, l.out, l.in, compress);
}

}  // namespace strata
