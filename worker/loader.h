// From a model spec on the command line to config, weights and tokenizer:
//   a directory with config.json + safetensors (+ tokenizer.model), a Hugging Face hub
//   cache model (ORG/NAME, a repo or snapshot folder: model_path.h, resolved by load_model
//   on this process's host), or "dummy:NAME" for a generated shape (see dummy.h).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "placement/stage_placement.h"
#include "worker/config.h"
#include "worker/expert_store.h"
#include "worker/layer_feeder.h"
#include "worker/layer_store.h"
#include "worker/tokenizer.h"
#include "worker/weights.h"

namespace strata {

struct LoadOptions {
  DType dummy_dtype = DType::kF32;  // storage dtype of dummy weights
  uint64_t dummy_seed = 0;
  // Host memory for weights, bytes (< 0: no limit). Layers that do not fit live in a
  // scratch file under disk_dir and stream back through two staging buffers.
  int64_t cpu_mem = -1;
  std::string disk_dir = "/tmp";
  bool overlap = true;  // prefetch the next disk layer while computing
  // The accelerator the model computes on (nullptr: the host computes). Then the fixed
  // tensors and GPU-tier layers live on it and the rest stream to it (layer_feeder.h).
  Backend* device = nullptr;
  int64_t gpu_mem = -1;   // accelerator memory for weights, bytes (< 0: no limit)
  int64_t disk_mem = -1;  // disk space for weights under disk_dir, bytes (< 0: no limit)
  // Weight shares from a policy (wg, wc; the disk gets the rest). < 0: fill the GPU, then
  // the host, then the disk, as the budgets allow.
  int w_gpu_percent = -1;
  int w_cpu_percent = -1;
  // HeteGen (layer_feeder.h LayerSplit), with `device` only; 0: off. Each CPU-tier layer is
  // split at this alpha (0 < alpha <= 1) instead of streamed whole: the alpha share of every
  // linear streamed to the device each pass, the rest in host memory computed by
  // `hetegen_cpu` (which outlives the model). Per module slot alphas (the alpha benchmark's)
  // and the module scheduler's whole modules: placement/hetegen.h check_split. Disk-tier
  // layers still stream whole. placement/ counts the split (StageRequest).
  double hetegen_alpha = 0;
  std::vector<double> hetegen_slot_alpha;
  std::vector<uint8_t> hetegen_whole;
  Backend* hetegen_cpu = nullptr;
  // FlexGen's weight compression: every layer matrix whose rows are whole groups of 64 is
  // stored 4-bit group-wise (kQ4) in every tier and dequantised just before use.
  bool compress_weight = false;
  // When the host computes (no `device`): f32 matrices repacked into panels for the CPU's
  // GEMM (kernels/gemm_panel.h), and 4-bit ones for its 4-bit kernel where the CPU has
  // AVX-512 VNNI (kernels/gemm_q4_panel.h), in every tier, unless STRATA_CPU_WEIGHTS=rows.
  // Off for a caller that reads the weights row-major itself.
  bool cpu_panels = true;
  // The weight tiers decided elsewhere (a cluster plan's placement, one per loaded layer);
  // empty: placement/ decides from the budgets and shares above (place_weights).
  std::vector<Tier> weight_tiers;
  // A pipeline stage (worker/stage.h) loads only its part: layers [layer_begin, layer_end)
  // (layer_end < 0: to the last) and the embedding / head only where it has them. The loaded
  // config then counts only those layers (n_layers = layer_end - layer_begin), so the model,
  // its KV cache and the weight placement cover the stage alone.
  int32_t layer_begin = 0;
  int32_t layer_end = -1;
  bool embedding = true;
  bool head = true;
  // A tensor-parallel stage's shard (weights.h's WeightParts): the loaded config is the
  // shard's (config.h's tensor_parallel_shard), and so are its placement and KV cache.
  int32_t tp_index = 0;
  int32_t tp_degree = 1;
  // A MoE model's experts (placement/stage_placement.h StageRequest): how many of each
  // layer's stay with it (< 0: all where cpu_mem holds them, else as many as it holds), the
  // rest on disk under disk_dir read through `expert_cache_slots` host slots (0: 2 x top-k).
  // Host compute only.
  int32_t resident_experts = -1;
  int32_t expert_cache_slots = 0;
  // Bounds on what the model files may ask for (input_limits.h), and whether to scan every
  // weight for NaN / infinity at load (--check-weights).
  InputLimits limits;
  bool check_weights = false;
  // Called after each layer is loaded and placed (a progress display; may be empty).
  std::function<void(int32_t loaded, int32_t total)> on_layer;
};

// Quantises a layer's matrices to kQ4 (those with columns a multiple of 64); the new
// storage is appended to `store`. Returns how many matrices were compressed.
int compress_layer(LayerWeights& w, std::vector<std::unique_ptr<OwnedTensor>>& store);
// The same for the matrices outside the layers (embedding, projections, head; a tied head
// stays the embedding), as FlexGen compresses every weight: at batch 1 a 32000-word f32
// head would otherwise be most of a 4-bit step's bytes. Their storage goes to w.owned.
int compress_fixed(ModelWeights& w);
// The same two for the host's panel layouts (kF32Panel, kQ4Panel: pack_matrix in
// loader.cpp says which): every matrix the layer multiplies, and the projections and head
// (a tied head takes the embedding with it).
int pack_layer(LayerWeights& w, std::vector<std::unique_ptr<OwnedTensor>>& store);
int pack_fixed(ModelWeights& w);
// STRATA_CPU_WEIGHTS=panels (the default) or rows (measure the row-major path in the same
// build); another value is refused, naming it.
bool cpu_panels_enabled();

// The weight placement these options ask placement/ for (place_weights): the budgets
// bound the weights alone; shares when the options name them.
StageRequest weight_request(const LoadOptions& options);

struct LoadedModel {
  ModelConfig config;       // n_layers: the layers loaded (a stage's share; see LoadOptions)
  int32_t layer_begin = 0;  // the first loaded layer's index in the whole model
  ModelWeights weights;
  std::unique_ptr<Tokenizer> tokenizer;
  WeightPlacement placement;
  std::unique_ptr<LayerStreamer> streamer;  // host compute: nullptr when every layer is resident
  std::unique_ptr<LayerFeeder> feeder;      // device compute: serves every layer
  std::unique_ptr<ExpertStore> experts;     // a MoE model's disk experts (Model::set_experts)
};

LoadedModel load_model(const std::string& spec, const LoadOptions& options = {});

}  // namespace strata
