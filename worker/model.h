// One model instance as a stage computes it: the transformer (transformer.h: embeddings,
// layers, head, written once for both families), the source of each layer's weights
// (resident, streamed from disk, or fed to a device) and FlexGen's block executor
// (block_executor.h) that runs a step's GPU batches over them. The three are separate;
// this class builds them, owns the weights, and sizes everything a cache needs up front.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "kernels/backend.h"
#include "worker/block_executor.h"
#include "worker/config.h"
#include "worker/kv_attention.h"
#include "worker/kv_cache.h"
#include "worker/layer_feeder.h"
#include "worker/layer_store.h"
#include "worker/transformer.h"
#include "worker/weights.h"

namespace strata {

// Weight bytes a model moved over its steps so far: brought to its compute device from the
// host (FlexGen's CPU tier), and read from disk (its disk tier, to the device or to host
// compute).
struct WeightTraffic {
  uint64_t from_cpu = 0;
  uint64_t from_disk = 0;
};

class Model {
 public:
  // max_rows bounds the rows of one step; activation memory is allocated once for it.
  // `streamer` (optional, host compute) serves the layers the loader moved to disk;
  // `feeder` (device compute) serves every layer on the device.
  Model(const ModelConfig& config, ModelWeights weights, Backend& backend, int32_t max_rows,
        std::unique_ptr<LayerStreamer> streamer = nullptr,
        std::unique_ptr<LayerFeeder> feeder = nullptr);
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return config_; }
  const ModelWeights& weights() const { return weights_; }
  Backend& backend() { return backend_; }
  const LayerStreamer* streamer() const { return layers_.streamer(); }
  const LayerFeeder* feeder() const { return layers_.feeder(); }
  int32_t max_rows() const { return transformer_.max_rows(); }

  void set_cache_options(const CacheOptions& options);
  const CacheOptions& cache_options() const { return transformer_.attention().options(); }
  // A cache placed as the cache options say. Also reserves, once, everything a step over a
  // cache of that size needs (the GPU batches' states, attention's workspaces, the
  // backends' kernel scratch), so a step allocates nothing.
  std::unique_ptr<KvCache> make_cache(int32_t n_slots, int32_t capacity);
  // Called by make_cache with the cache's slots and capacity before anything is allocated:
  // an engine's check of its memory budget, which refuses the cache by throwing. Empty: none.
  void set_cache_check(std::function<void(int32_t n_slots, int32_t capacity)> check) {
    cache_check_ = std::move(check);
  }

  // What the model holds per tier: weights (fixed tensors, resident layers, the feeder's or
  // streamer's buffers and files), activations and workspaces. The KV cache is the cache's;
  // the backends' kernel scratch is theirs (Backend::reserved_bytes).
  TierBytes memory() const;
  // Between steps only (the feeder counts on the compute thread).
  WeightTraffic weight_traffic() const;

  // FlexGen's GPU batch size in sequences: a step with more sequences runs as a block of
  // several GPU batches (zig-zag schedule). 0: the whole step is one GPU batch.
  void set_gpu_batch_size(int32_t sequences) { executor_.set_gpu_batch_size(sequences); }
  // A tensor-parallel shard's group sum (Transformer::set_block_reduce); outlives the model.
  void set_block_reduce(BlockReduce* reduce) { transformer_.set_block_reduce(reduce); }
  // HeteGen's split linears (Transformer::set_split_linears; nullptr: none); outlives the
  // model's steps. A feeder that splits its CPU-tier layers (layer_feeder.h LayerSplit) gives
  // the model its own at construction, and those layers cannot run without it.
  void set_split_linears(SplitLinearTable* splits);
  int32_t gpu_batch_size() const { return executor_.gpu_batch_size(); }
  // A MoE model's disk experts (expert_store.h; the loader's LoadedModel::experts, may be
  // null), owned from here on; the router's counts (expert_popularity) rank its cache.
  void set_experts(std::unique_ptr<ExpertStore> store);
  const ExpertStore* expert_store() const { return experts_.get(); }
  const ExpertPopularity* expert_popularity() const { return popularity_.get(); }

  // Runs one step. Writes logits [batch.logit_rows.size(), vocab] to host memory `logits`.
  void forward(const StepBatch& batch, KvCache& cache, float* logits);
  // One pipeline stage's part of a step (worker/stage.h; the model then holds the stage's
  // layers only): every layer of this model runs, in and out as `io` says.
  void forward_stage(const StepBatch& batch, KvCache& cache, const StepIo& io);

 private:
  TierBytes weight_memory() const;

  ModelConfig config_;
  ModelWeights weights_;
  Backend& backend_;
  SplitLinearTable* feeder_splits_;  // the feeder's (LayerFeeder::splits), taken before it moves
  LayerSource layers_;
  Transformer transformer_;
  BlockExecutor executor_;
  std::function<void(int32_t, int32_t)> cache_check_;
  std::unique_ptr<ExpertPopularity> popularity_;
  std::unique_ptr<ExpertStore> experts_;
};

}  // namespace strata
