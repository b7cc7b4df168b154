// Where a pipeline stage's memory goes: every weight layer and every KV-cache layer gets a
// tier (FlexGen's wg/wc/wd and cg/cc/cd at layer granularity, §4.2), and each tier's bytes
// are summed with the memory model the engine allocates by: weights in their dtype or 4-bit
// (kernels/quant.h), vectors in f32, layers packed as they stream (64-byte aligned tensors,
// page-aligned blobs), the KV cache in f32 or 4-bit, the head's logits buffer, the step's
// activations, rotary tables, GPU-batch states and attention workspaces.
//
// This is the one placement decision: the planner checks it against the budgets, the plan
// carries it (transport/messages.h StagePlan), the worker executes it (worker/loader.h,
// worker/kv_cache.h) and reports what it allocated, which must equal total().
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "placement/model_shape.h"
#include "placement/pie.h"
#include "placement/policy.h"
#include "placement/tier.h"

namespace strata {

// Rows of logits the LM head computes at a time (worker/transformer.cpp), so that its buffer
// (and the step's memory planned here) is this many rows of the vocabulary, not max_rows.
inline constexpr int32_t kLogitChunk = 64;

// Memory per tier in bytes (< 0: no limit).
struct TierBudgets {
  int64_t gpu = -1;
  int64_t cpu = -1;
  int64_t disk = -1;
  // false: the budgets bound the weights alone (the engine's --gpu-mem / --cpu-mem /
  // --disk-mem); true: everything the stage allocates (the planner's --stage-mem).
  bool whole_stage = false;

  int64_t operator[](Tier t) const { return t == Tier::kGpu ? gpu : t == Tier::kCpu ? cpu : disk; }
};

// Pie's range of host layers m (worker/kv_swap.h PieOptions): fixed m, both are m; adaptive,
// the controller's bounds (lowest sizes the device's buffers, highest the host's).
struct PieHostLayers {
  int32_t lowest = 0;
  int32_t highest = 0;
};

// A stage and how the engine runs it: the memory model's inputs besides the model's shape.
struct StageRequest {
  // A MoE model's experts over the tiers (worker/expert_store.h): each layer holds
  // `resident_experts` of its experts with its attention and router, the others live on
  // disk and are read when the router picks them, through `expert_cache_slots` host buffers
  // of one expert each. < 0: chosen here, all of them where the host budget holds them, else
  // as many as it holds (before any whole layer goes to disk).
  int32_t resident_experts = -1;
  int32_t expert_cache_slots = 0;  // 0: 2 x experts_per_token
  // false: resident_experts < 0 keeps every expert whatever the budget (a cluster plan,
  // whose workers load with the operator's count, not one chosen here).
  bool experts_follow_budget = true;
  // Layers [layer_begin, layer_end) (layer_end < 0: to the last); the embedding and the
  // head (final norm, projection, lm_head) only where the stage has them.
  int32_t layer_begin = 0;
  int32_t layer_end = -1;
  bool embedding = true;
  bool head = true;
  bool device_compute = false;  // an accelerator computes; otherwise the host does
  // The engine's fixed buffers: rows of one step's activations (0: none counted), the KV
  // cache (0 slots: none counted), and what a pipeline stage keeps on the host besides:
  // logits for `host_logit_rows` sequences (the last stage) and `host_token_rows` token ids.
  int32_t max_rows = 0;
  int32_t kv_slots = 0;
  int32_t kv_capacity = 0;
  // The positions the cache commits over all slots, when fewer than kv_slots x kv_capacity
  // (0: all of them): S3's packing on a host-compute stage, whose cache is committed page by
  // page as positions are written (kernels/cpu_backend.h) -- a budget of positions, not
  // slots, is what it holds. Refused with device compute (its cache is allocated whole).
  int64_t kv_positions = 0;
  int32_t host_logit_rows = 0;
  int32_t host_token_rows = 0;
  // The policy. Unset: weights fill the compute tier, then the host, then the disk as the
  // budgets allow; the cache lives on the compute tier; nothing is compressed.
  std::optional<Policy> policy;
  bool weight_shares = true;  // with a policy: its w= shares place the weights (else budgets)
  TierBudgets budgets;
  // HeteGen (placement/hetegen.h; worker/split_linear.h), device compute only; 0: off. A
  // CPU-tier layer is then split instead of streamed whole: the first ceil(alpha x rows) rows
  // of each linear and their biases packed in pinned host memory and streamed through the
  // device slots each pass, the other rows in host memory for the CPU, the layer's norms on
  // the device. Disk-tier layers still stream whole. Per module slot alphas and the module
  // scheduler's whole modules: hetegen::check_split.
  double hetegen_alpha = 0;
  std::vector<double> hetegen_slot_alpha;
  std::vector<uint8_t> hetegen_whole;
  // Pie on the KV cache (device compute, the cache wholly on the GPU tier): its layers share
  // PieBuffers instead of one pair each. Unset: off.
  std::optional<PieHostLayers> pie;
};

struct WeightPlacement {
  bool device_compute = false;
  // A MoE model: experts each layer holds (the rest on disk, read through the cache), one
  // expert's packed bytes, and what the disk experts and the cache take. n_experts == 0:
  // a dense model, or every expert with its layer.
  int32_t n_experts = 0;
  int32_t resident_experts = 0;
  int32_t expert_cache_slots = 0;
  int64_t expert_bytes = 0;
  int64_t expert_disk_bytes = 0;   // every layer's disk experts
  int64_t expert_cache_bytes = 0;  // the host slots
  bool experts_on_disk() const { return n_experts > resident_experts; }
  int64_t fixed_bytes = 0;           // embeddings, positions, projections, final norm, head present
  int64_t layer_bytes = 0;           // one layer packed: a GPU-tier, streamed or disk layer
  int64_t host_layer_bytes = 0;      // a CPU-tier layer as held (packed when pinned for a device)
  int64_t device_staging_bytes = 0;  // two device slots, when some layer streams to the device
  int64_t staging_bytes = 0;         // two host buffers, when some layer is on disk
  std::vector<Tier> tiers;           // per layer (host compute: no GPU tier)
  std::vector<int32_t> disk_layers;  // the layers whose tier is disk, ascending
  // HeteGen (StageRequest::hetegen_alpha > 0): every CPU-tier layer is split. Without whole
  // modules, its device part (its norms packed) is split_gpu_bytes, its alpha shares packed
  // (pinned in host memory, streamed through the device slots) split_stream_bytes, and
  // host_layer_bytes its host part (the other rows and their biases, and the pinned shares).
  // `split` has each layer's own (whole modules on the device; zeros where not split).
  struct SplitBytes {
    int64_t gpu = 0, host = 0, stream = 0;
  };
  double hetegen_alpha = 0;
  int64_t split_gpu_bytes = 0;
  int64_t split_stream_bytes = 0;
  std::vector<SplitBytes> split;
  // The split linears' staging for one call (worker/split_linear.h SplitLinearScratch), per
  // row of a step: x and the CPU share's output in host memory, both shares on the device.
  int64_t split_host_row_bytes = 0;
  int64_t split_device_row_bytes = 0;

  bool hetegen() const { return hetegen_alpha > 0; }
  // The layers HeteGen splits (its CPU-tier layers) and those that stream to the device.
  int32_t split_layers() const { return hetegen() ? count(Tier::kCpu) : 0; }
  int32_t streamed_layers() const {
    return device_compute ? static_cast<int32_t>(tiers.size()) - count(Tier::kGpu) - split_layers()
                          : 0;
  }
  // The split layers' alpha shares as streamed, summed: what one pass copies for them.
  int64_t split_stream_total() const;

  int32_t count(Tier t) const { return count_tier(tiers, t); }
  int64_t gpu_bytes() const;  // on the accelerator
  int64_t cpu_bytes() const;  // in host memory
  int64_t disk_bytes() const;
  std::string str() const;
};

struct KvPlacement {
  bool compress = false;
  bool f16 = false;           // elements f16 rather than f32 (policy cf16)
  int64_t layer_bytes = 0;    // K or V of one layer as stored (f32, f16 or 4-bit)
  int64_t slot_rows = 0;      // positions a slot holds: the context, or a sliding window's
  int64_t staging_bytes = 0;  // two host buffers (page-aligned), when some layer is on disk
  std::vector<Tier> tiers;    // per layer; host compute: GPU tier means the host's memory
  // Pie (StageRequest::pie): the GPU-tier layers live in these device and host buffers.
  std::optional<PieHostLayers> pie_host_layers;
  PieBuffers pie;

  int32_t count(Tier t) const { return count_tier(tiers, t); }
  int64_t file_bytes() const;  // the disk tier's file (K and V page-aligned)
  std::string str() const;
};

struct StagePlacement {
  int32_t layer_begin = 0;
  int32_t layer_end = 0;
  bool embedding = false;
  bool head = false;
  bool device_compute = false;
  int32_t gpu_batch_size = 0;  // the block schedule's GPU batch (0: one GPU batch a step)
  bool cpu_attention = false;
  WeightPlacement weights;
  KvPlacement cache;
  int64_t activation_bytes = 0;         // compute tier: step buffers, rotary tables, batch states
  int64_t compute_workspace_bytes = 0;  // compute tier: a cache layer staged around attention
  int64_t host_workspace_bytes = 0;     // host: delegated attention, the stage's logits and ids
  // The accelerator backend's own scratch (kernels/backend.h accelerator_scratch_bytes): held
  // by the backend, not the engine, so outside total() (what the worker's engine reports),
  // but counted against the device budget.
  int64_t kernel_scratch_bytes = 0;

  TierBytes weight_bytes() const;
  TierBytes cache_bytes() const;
  TierBytes buffer_bytes() const;  // activations and workspaces
  TierBytes total() const;
  std::string str() const;
};

// Throws InputError for a layer range outside the model, bad shares, or (budgets bounding
// the weights alone) a weight placement over a budget, naming the option and the shortfall.
// With whole-stage budgets it never refuses: shortfalls() says what does not fit.
StagePlacement place_stage(const ModelShape& model, const StageRequest& request);

// What a KV slot of the stage holds where every layer has a sliding window (kernels/backend.h
// KvWindow, with the request's max_rows as the rows a sequence adds in a step): the worker's
// KvCache makes the same choice from the same numbers. Inactive otherwise.
KvWindow kv_window(const ModelShape& model, const StageRequest& request);

// One line per tier over its budget (the GPU's need includes the kernel scratch): "cpu needs 1.1
// MiB (1143456 bytes), budget 1.0 MiB (1048576 bytes): short by 0.1 MiB (94880 bytes)".
std::vector<std::string> shortfalls(const StagePlacement& placement, const TierBudgets& budgets);

// The weights alone (the loader's part of place_stage), with budgets bounding the weights.
WeightPlacement place_weights(const ModelShape& model, const StageRequest& request);

}  // namespace strata
