// A layer's linear modules, said once: each one's slot, name, shape [out, in] from the model's
// shape, bias, and the dtype it is stored in. Placement's memory model
// (placement/stage_placement.cpp), HeteGen's split and module scheduler (placement/hetegen.h,
// worker/split_linear.h), the loader (worker/weights.cpp, worker/loader.cpp) and the
// transformer all walk this table, so they agree on which linears a layer has and what each
// weighs.
#pragma once

#include <array>
#include <cstdint>

#include "kernels/tensor.h"
#include "placement/model_shape.h"

namespace strata {

// The order the layer computes them in and LayerLayout packs them in (worker/layer_store.cpp):
// q, k, v, o, gate, up, down. OPT's fc1 and fc2 are up and down; gate is in gated (SwiGLU)
// MLPs only. Per-module decisions (HeteGen's alphas and whole modules) are indexed by slot.
enum class LinearSlot : uint8_t { kQ = 0, kK, kV, kO, kGate, kUp, kDown };
inline constexpr int kLinearSlots = 7;
inline constexpr std::array<LinearSlot, kLinearSlots> kAllLinearSlots = {
    LinearSlot::kQ,    LinearSlot::kK,  LinearSlot::kV,   LinearSlot::kO,
    LinearSlot::kGate, LinearSlot::kUp, LinearSlot::kDown};
const char* linear_slot_name(LinearSlot slot);  // "q", ..., "down"

// The block a linear belongs to: attention (q, k, v, o) or the MLP (gate, up, down). Each
// block has its norm before it, and a layer stores a block's weights, then their biases.
enum class LinearBlock : uint8_t { kAttention = 0, kMlp = 1 };
LinearBlock linear_block(LinearSlot slot);

struct LayerLinear {
  LinearSlot slot = LinearSlot::kQ;
  bool present = false;     // false: the family has no such linear (gate outside SwiGLU)
  int64_t out = 0, in = 0;  // W is [out, in]: y = x W^T + b
  bool bias = false;        // a bias of `out` f32 values
};
using LayerLinears = std::array<LayerLinear, kLinearSlots>;

// The linears of one layer of `s`, indexed by slot (absent ones too, with present false).
LayerLinears layer_linears(const ModelShape& s);
// By value: safe on the table a call to layer_linears returns.
inline LayerLinear linear_of(const LayerLinears& l, LinearSlot slot) {
  return l[static_cast<size_t>(slot)];
}

// FlexGen's 4-bit weights (kernels/quant.h) group a matrix's rows along its input width, so
// a matrix is compressed only when `in` is whole groups; otherwise it keeps its dtype. The
// loader converts by this rule and placement counts by it.
bool compressible(int64_t in);
// The dtype a [out, in] matrix of a `dtype` model is stored in (compress: 4-bit weights).
DType stored_dtype(DType dtype, int64_t in, bool compress);
// Its bytes as stored (a weight; its bias, if any, is out x 4 bytes more).
int64_t stored_matrix_bytes(DType dtype, int64_t out, int64_t in, bool compress);
int64_t stored_weight_bytes(const ModelShape& s, const LayerLinear& l, bool compress);

}  // namespace strata
