// The cluster plan: which rank runs which layers. Uniform for now (the scheduling issue
// brings ExeGPT's WAA allocation): the layers are split as evenly as possible over ranks
// 1..N-1 in order, earlier stages taking the remainder; the first stage embeds, the last
// holds the final norm, head and sampler. A plan that cannot run is refused here, with a
// message that says why and what to change, before any worker loads anything.
#pragma once

#include <cstdint>
#include <string>

#include "transport/messages.h"
#include "worker/config.h"

namespace strata {

struct PlanOptions {
  std::string model_spec;
  int32_t workers = 1;  // ranks 1..workers
  int32_t micro_batches = 1;
  int32_t kv_slots = 32;
  int32_t kv_capacity = 0;
  int32_t max_batch_rows = 512;
  int64_t stage_mem =
      -1;  // bytes each stage may use for weights + KV cache + activations (< 0: no limit)
};

// A stage's memory: its weights as stored, its share of the KV cache, its step buffers.
struct StageMemory {
  int64_t weights = 0;
  int64_t kv_cache = 0;
  int64_t activations = 0;
  int64_t total() const { return weights + kv_cache + activations; }
  std::string str() const;
};

StageMemory stage_memory(const ModelConfig& config, const StagePlan& stage,
                         const ClusterPlan& plan);

// Throws InputError: more stages than layers, or a stage over PlanOptions::stage_mem.
ClusterPlan make_uniform_plan(const ModelConfig& config, const PlanOptions& options);

}  // namespace strata
