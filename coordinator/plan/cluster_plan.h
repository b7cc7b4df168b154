// The cluster plan: which rank runs which layers, and where each stage's weights and KV
// cache live. The layers are split over ranks 1..N-1 in order -- evenly, or as a schedule's
// allocation balances them (schedule_choice.h); the first stage embeds, the last holds the
// final norm, head and sampler.
// Each stage's placement is placement/'s decision (stage_placement.h) with the engine's
// memory model; the plan carries it to the worker, which executes it. A plan that cannot
// run is refused here, naming the stage, the tier and the shortfall, before any worker
// loads anything.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "placement/node.h"
#include "placement/stage_placement.h"
#include "transport/messages.h"
#include "worker/config.h"

namespace strata {

// How the workers run their stages: the policy (--policy) and whether they compute on an
// accelerator. The per-stage budgets are PlanOptions::stage_mem or `budgets`.
struct StagePlacementOptions {
  std::optional<Policy> policy;
  bool device_compute = false;
  // Per-stage budgets per tier for everything a stage allocates; unset tiers (< 0) take
  // stage_mem on the compute tier.
  TierBudgets budgets;
  // A MoE model's experts per layer kept with it, the rest on disk (serve's
  // --resident-experts, which every worker loads with too); < 0: all of them. The plan
  // carries no count of its own to the workers, so it never chooses fewer by budget.
  int32_t resident_experts = -1;
  int32_t expert_cache_slots = 0;
};

struct PlanOptions {
  std::string model_spec;
  int32_t workers = 1;  // ranks 1..workers
  int32_t micro_batches = 1;
  int32_t kv_slots = 32;
  int32_t kv_capacity = 0;
  int32_t max_batch_rows = 512;
  // Bytes each stage may use on its compute tier (the host, or the accelerator) for weights,
  // KV cache and buffers (< 0: no limit); weights that do not fit stream from the next tier.
  int64_t stage_mem = -1;
  StagePlacementOptions placement;
  // WAA (ClusterPlan::encoder_stages): the first `encoder_stages` workers are the prefill
  // pipeline with `encoder_kv_slots` KV slots each, the rest the decode pipeline; 0: RRA.
  int32_t encoder_stages = 0;
  int32_t encoder_kv_slots = 0;
  // ExeGPT's partial tensor parallelism: the degree of each pipeline stage, in order (the
  // stage's layers split over that many consecutive worker ranks; their sum is `workers`).
  // Empty: every stage on one rank.
  std::vector<int32_t> tp_degrees;
  // Each worker rank's own hardware and budgets (rank i + 1: nodes[i]; node.h): its stage is
  // placed for its compute tier under its budgets, and without an allocation the layers are
  // split by what each node holds and how fast it reads them (balanced_layers). Empty: every
  // stage alike, under `placement` and `stage_mem`.
  std::vector<StageNode> nodes;

  int32_t stages() const;  // pipeline stages: tp_degrees' count, or one per worker
  const StageNode* node(int32_t rank) const;  // nullptr: no nodes given
};

// --tensor-parallel's text: per-stage degrees "1,2,1", or one degree "2" for every stage of
// `workers` ranks. Throws InputError naming the text and what is wrong (a degree below 1,
// a sum that is not the worker count).
std::vector<int32_t> parse_tp_degrees(const std::string& text, int32_t workers);

// What placement/ is asked for stage `stage` of `plan` (the memory model's inputs).
StageRequest stage_request(const StagePlan& stage, const ClusterPlan& plan,
                           const StagePlacementOptions& options, int64_t stage_mem);
// The placement options of the stage on `rank`: `options.placement` with the rank's node's
// compute tier and budgets, where nodes are given.
StagePlacementOptions placement_of(const PlanOptions& options, int32_t rank);

// A stage as the planner placed it: its FlexGen policy (the operator's --policy, or the one
// chosen to fit: the KV cache moved off the compute tier layer by layer until weights, cache
// and buffers fit, the weights streaming from the next tiers) and its placement, the
// worker's link buffers included; `shortfalls` empty when it fits its budgets.
struct ChosenStage {
  Policy policy;
  StagePlacement placed;      // as placement/ placed it
  StagePlacement with_links;  // what the worker allocates
  std::vector<std::string> shortfalls;
};
ChosenStage choose_stage(const ModelConfig& config, const ClusterPlan& plan, const StagePlan& stage,
                         const PlanOptions& options);

// Layer counts per stage for unequal nodes (options.nodes): every stage one layer, then each
// further layer to the stage whose estimated decode step (node.h decode_step_seconds, under
// the placement choose_stage makes for it) stays the shortest with it. RRA, one rank a stage.
// Where some stage cannot fit even one more layer, the layer goes to one that fits; where
// none fits at all, the uniform split (make_plan then names the shortfalls).
std::vector<int32_t> balanced_layers(const ModelConfig& config, const PlanOptions& options);
// The bytes of the activation buffers a stage's worker keeps for its links (stage_worker.cpp):
// one in (not the first stage) and two out (not the last), each max_batch_rows x hidden f32.
TierBytes link_buffer_bytes(const StagePlan& stage, const ClusterPlan& plan);

// Throws InputError: more stages than layers, or a stage over a budget ("stage 2 (layers
// [8, 16)): cpu needs 3.2 MiB, budget 2.0 MiB: short by 1.2 MiB").
ClusterPlan make_uniform_plan(const ModelConfig& config, const PlanOptions& options);
// The same with `layers[i]` layers on worker rank i + 1, in order (a schedule's allocation,
// coordinator/exegpt/allocator.h; with WAA the prefill pipeline's counts, then the decode one's);
// plan.validate() refuses a count that leaves a stage empty or does not sum to the model's
// layers on each pipeline.
ClusterPlan make_plan(const ModelConfig& config, const PlanOptions& options,
                      const std::vector<int32_t>& layers);
// Layers split as evenly as possible, earlier stages taking the remainder.
std::vector<int32_t> uniform_layers(int32_t layers, int32_t stages);

}  // namespace strata
