// The weights of one model, as views the layer code reads: matrices keep their storage
// dtype (f32/f16/bf16), small vectors (norms, biases) are converted to f32 once at load.
// Tensors come from a safetensors checkpoint (memory-mapped) or from the dummy generator;
// both go through the same table of names and the same shape checks against the config.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/tensor.h"
#include "placement/layer_linears.h"
#include "worker/config.h"

namespace strata {

class SafetensorsArchive;

// One expert of a MoE layer: a gated SwiGLU MLP, gate and up [expert_intermediate, hidden],
// down [hidden, expert_intermediate].
struct ExpertWeights {
  Tensor gate, up, down;
};
using ExpertMember = Tensor ExpertWeights::*;
inline constexpr ExpertMember kExpertMembers[] = {&ExpertWeights::gate, &ExpertWeights::up,
                                                  &ExpertWeights::down};

struct LayerWeights {
  Tensor attn_norm, attn_norm_bias;  // bias: LayerNorm only
  Tensor q, k, v, o;                 // Phi-3's fused qkv_proj: views of its row blocks
  Tensor q_bias, k_bias, v_bias, o_bias;
  Tensor q_norm, k_norm;  // Qwen3: [head_dim] RMSNorms of each head before RoPE
  Tensor post_attn_norm;  // Gemma-2: on the attention's output before the residual add
  Tensor mlp_norm, mlp_norm_bias;
  Tensor gate;  // gated MLP only (Llama SwiGLU, Gemma-2 GeGLU)
  Tensor up;    // Llama up_proj / OPT fc1 (Phi-3's fused gate_up_proj: its halves)
  Tensor down;  // Llama down_proj / OPT fc2
  Tensor gate_bias, up_bias, down_bias;
  Tensor post_mlp_norm;  // Gemma-2: on the MLP's output before the residual add
  // A MoE layer (config.h n_experts): gate/up/down above are the dense MLP beside the experts
  // (Qwen2-MoE's shared expert, rank 0 where there is none).
  Tensor router;              // [n_experts, hidden], as stored (never compressed)
  Tensor shared_expert_gate;  // Qwen2-MoE: [1, hidden] f32, sigmoid(x . g) scales the shared
  // One per expert; an expert that lives elsewhere (on disk: worker/expert_store.h) has rank
  // 0 tensors here.
  std::vector<ExpertWeights> experts;
};

// Every tensor of a layer, in the order LayerLayout packs them (worker/layer_store.cpp) and
// placement's memory model counts them (placement/stage_placement.cpp, layer_tensors): the
// attention block's norm, weights, biases and q/k/post norms, then the MLP block's.
using LayerMember = Tensor LayerWeights::*;
inline constexpr LayerMember kLayerMembers[] = {&LayerWeights::attn_norm,
                                                &LayerWeights::attn_norm_bias,
                                                &LayerWeights::q,
                                                &LayerWeights::k,
                                                &LayerWeights::v,
                                                &LayerWeights::o,
                                                &LayerWeights::q_bias,
                                                &LayerWeights::k_bias,
                                                &LayerWeights::v_bias,
                                                &LayerWeights::o_bias,
                                                &LayerWeights::q_norm,
                                                &LayerWeights::k_norm,
                                                &LayerWeights::post_attn_norm,
                                                &LayerWeights::mlp_norm,
                                                &LayerWeights::mlp_norm_bias,
                                                &LayerWeights::gate,
                                                &LayerWeights::up,
                                                &LayerWeights::down,
                                                &LayerWeights::gate_bias,
                                                &LayerWeights::up_bias,
                                                &LayerWeights::down_bias,
                                                &LayerWeights::post_mlp_norm,
                                                &LayerWeights::router,
                                                &LayerWeights::shared_expert_gate};

// Every tensor of a layer: kLayerMembers' in order, then each expert's gate, up and down (the
// order LayerLayout packs them in and placement's memory model counts them).
template <class Layer, class F>
void for_each_tensor(Layer& L, F&& f) {
  for (const LayerMember m : kLayerMembers) f(L.*m);
  for (auto& e : L.experts)
    for (const ExpertMember m : kExpertMembers) f(e.*m);
}

// The members of `slot`'s weight and bias in LayerWeights.
LayerMember slot_weight_member(LinearSlot slot);
LayerMember slot_bias_member(LinearSlot slot);

// The weight and bias of `slot` in L (rank 0 / null data where the family has none).
const Tensor& slot_weight(const LayerWeights& L, LinearSlot slot);
const Tensor& slot_bias(const LayerWeights& L, LinearSlot slot);

struct ModelWeights {
  Tensor embed;                    // [vocab, word_embed_proj_dim]
  Tensor positions;                // OPT: [max_positions + 2, hidden]
  Tensor project_in, project_out;  // OPT when word_embed_proj_dim != hidden
  Tensor final_norm, final_norm_bias;
  Tensor lm_head;  // == embed when tied
  std::vector<LayerWeights> layers;

  // Storage behind generated or converted tensors, and the mapping behind checkpoint views.
  std::vector<std::unique_ptr<OwnedTensor>> owned;
  std::shared_ptr<const SafetensorsArchive> archive;
  // Device copies when the model computes on an accelerator (see layer_feeder.h).
  std::vector<DeviceBuffer> device_owned;

  int64_t matrix_bytes() const;  // bytes of all weights as stored
};

// Removes the entries of store[mark, end) that no tensor of L points into any more (storage a
// sink replaced or moved elsewhere).
void drop_unreferenced(const LayerWeights& L, std::vector<std::unique_ptr<OwnedTensor>>& store,
                       size_t mark);

// Gives the pages behind a tensor back to the kernel once nothing reads it: a mapped
// checkpoint view's are read from the file again if touched, owned memory reads as zeros.
// Only whole pages inside the tensor (a page it shares with a neighbour is kept).
void drop_mapped_pages(const Tensor& t);

// Called after each layer is built and before the next, e.g. to move it to disk; a sink
// that empties the layer also frees the memory the loader allocated for it.
using LayerSink = std::function<void(int32_t layer, LayerWeights& weights)>;

// Which part of a model to build: a pipeline stage needs only its layers, and the embedding
// or the head only on the first or last stage. Layer `layer_begin + i` of the checkpoint
// becomes weights.layers[i] (and the sink's layer i); n_layers < 0 means to the last layer.
struct WeightParts {
  int32_t layer_begin = 0;
  int32_t n_layers = -1;
  bool embedding = true;  // token (and OPT position) embeddings, project_in
  bool head = true;       // final norm, project_out, lm_head (the embedding too when tied)
  // A tensor-parallel shard (config.h's tensor_parallel_shard): shard `tp_index` of
  // `tp_degree` keeps its heads' rows of q / k / v, its intermediate rows of gate / up, the
  // matching columns of o / down, and the biases of what it keeps; the biases added after
  // the all-reduce (o, down) only on shard 0, so the sum counts them once.
  int32_t tp_index = 0;
  int32_t tp_degree = 1;
};

// Cuts layer `L` (built for the whole model) down to its shard as WeightParts says
// (the degree checked by tensor_parallel_shard); the shards are new tensors appended to
// `owned`.
void shard_layer(const WeightParts& parts, LayerWeights& L,
                 std::vector<std::unique_ptr<OwnedTensor>>& owned);

struct CheckpointOptions {
  InputLimits limits;
  // Scan every weight loaded for NaN and infinity (a pass over all the bytes): a corrupt or
  // badly converted checkpoint is refused at load instead of producing garbage.
  bool check_weights = false;
};

// Loads <dir>/model.safetensors (or the sharded index). Throws InputError naming the file
// and tensor for a missing tensor, a shape that disagrees with the config, a non-float
// dtype, or (check_weights) a NaN or infinite value, with its index.
ModelWeights load_checkpoint_weights(const ModelConfig& config, const std::string& dir,
                                     const LayerSink& sink = {}, const WeightParts& parts = {},
                                     const CheckpointOptions& options = {});

// The flat index of the first NaN or infinite element of a host f32/f16/bf16 tensor; -1 if
// every element is finite.
int64_t first_non_finite(const Tensor& t);

// Generates the weights of a dummy shape deterministically from `seed`. `host_resident`:
// every layer stays in host memory at its generated size (no sink, or one that only
// repacks it), so a shape the host cannot hold is refused before anything is allocated.
ModelWeights make_dummy_weights(const ModelConfig& config, uint64_t seed,
                                const LayerSink& sink = {}, const WeightParts& parts = {},
                                bool host_resident = false);

}  // namespace strata
