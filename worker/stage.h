// One pipeline stage of a cluster (docs/CLUSTER.md): the layers [begin, end) of a model that
// the coordinator's plan gives this rank, with the embedding on the first stage and the final
// norm, head and sampler on the last. No MPI here: the stage turns a step command and its
// input (token ids or activations) into its output (activations or sampled tokens);
// stage_worker.h moves those between ranks.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "kernels/sampling.h"
#include "transport/messages.h"
#include "worker/kv_cache.h"
#include "worker/loader.h"
#include "worker/model.h"
#include "worker/tensor_parallel.h"

namespace strata {

// How a stage computes its share: the offloading engine's choices for its layers alone.
struct StageOptions {
  LoadOptions load;    // dummy dtype and seed, budgets, weight tiers; the plan sets the range
  CacheOptions cache;  // where the stage's KV cache lives, who attends over it
  int32_t gpu_batch_size = 0;  // block schedule: sequences per GPU batch (0: one GPU batch)
  // A tensor-parallel stage (StagePlan::tp_ranks): this rank's shard and its group's sum,
  // which outlives the stage. Shards other than 0 hold no head and sample nothing.
  int32_t tp_index = 0;
  BlockReduce* tp_reduce = nullptr;
};

// The plan's placement for `stage` against what its worker allocated: Error(kFailed) naming
// the stage, the tier and both numbers when they differ; nothing for a stage the plan did
// not place.
void check_allocation(const StagePlan& stage, const TierBytes& allocated);

class PipelineStage {
 public:
  // A stage the plan placed (stage.placed()) executes that placement: its weight and cache
  // tiers, compression, CPU attention and GPU batch come from the plan, not from `options`
  // (whose budgets and shares then go unused). Loads the stage's share of plan.model_spec and
  // allocates its KV cache (plan.kv_slots x plan.kv_capacity, the stage's layers only) and step
  // buffers (plan.max_batch_rows) once. `backend` computes (with a device, options.load.device is
  // the same backend).
  PipelineStage(const ClusterPlan& plan, const StagePlan& stage, Backend& backend,
                StageOptions options);
  // A stage over a model already loaded (its layers are the stage's, its workspace holds
  // plan.max_batch_rows rows; its cache options are kept): a one-stage cluster in one
  // process (coordinator/run/local_stages.h). `model` outlives the stage.
  PipelineStage(const ClusterPlan& plan, const StagePlan& stage, Model& model);

  // The plan's stage as this rank runs it (a tensor-parallel shard other than 0: no head).
  const StagePlan& stage() const { return stage_; }
  bool first() const { return stage_.has_embedding; }
  bool last() const { return stage_.has_head; }
  int32_t hidden() const { return model_->config().hidden; }
  size_t kv_cache_bytes() const { return cache_->bytes(); }
  const KvCache& kv_cache() const { return *cache_; }
  int32_t max_rows() const { return model_->max_rows(); }
  const ModelConfig& config() const { return model_->config(); }
  // What the stage allocated per tier: the model's weights and buffers, its KV cache, and
  // the logits and token ids it keeps (not the worker's link buffers).
  TierBytes memory() const;
  WeightTraffic weight_traffic() const { return model_->weight_traffic(); }

  // Sampling state of a sequence (the last stage samples): its params and its RNG, seeded
  // from the request's seed alone, so seeded sampling gives the same tokens whatever the
  // cluster's shape or the rest of the batch.
  void join(const SeqJoin& seq);
  void leave(uint64_t seq_id);
  // WAA's decode side: a sequence whose first token the prefill side sampled joins with
  // its RNG one draw on, so seeded sampling gives what one pipeline would.
  void join_after_prefill(const SeqJoin& seq);
  size_t sequences() const { return sampling_.size(); }

  // WAA's KV hand-over: the KV cache of `moves` for the model layers [begin, end) (within
  // this stage's), packed move by move and layer by layer as KvCache::read_slot packs a slot;
  // a prefill stage exports from each move's from_slot, a decode stage imports into its
  // to_slot. Between steps only. Error(kFailed) naming the move that does not fit.
  size_t kv_bytes(std::span<const KvMove> moves, int32_t begin, int32_t end) const;
  void export_kv(std::span<const KvMove> moves, int32_t begin, int32_t end, std::byte* out);
  void import_kv(std::span<const KvMove> moves, int32_t begin, int32_t end, const std::byte* in);

  // Runs one step. `in`: the previous stage's activations [rows, hidden] (empty on the
  // first stage, which reads the command's token ids). Not the last stage: writes its
  // activations to `out` [rows, hidden]. The last stage: returns one sampled token per
  // sequence of the command, in its order. in_device / out_device: that buffer is the
  // compute backend's memory (an NCCL link), not host memory. A command that does not fit
  // the plan (slot, positions, rows) is Error(kFailed) naming the step.
  std::vector<SeqToken> run(const StepCommand& command, std::span<const float> in,
                            std::span<float> out, bool in_device = false, bool out_device = false);

  // The profiler's measurement (coordinator/exegpt/profiler.h): the median of `repeats` runs of
  // this stage's layers on a synthetic step of `seqs` sequences, each `n_new` new rows
  // after `n_past` cached positions (KV slots 0..seqs-1, as they are), under the stage's
  // real placement. `embed` (the first stage) takes token ids instead of activations in,
  // `head` (the last) computes the logits of every sequence's last row. Error(kFailed)
  // when the step does not fit the plan's slots, context or rows.
  double time_step(int32_t seqs, int32_t n_new, int32_t n_past, bool embed, bool head,
                   int32_t repeats);
  // Answers a ProfileRequest's timings (not its transfers): seconds per layer at every
  // prefill and decode point, the embedding and head where the stage holds them.
  ProfileReport profile(const ProfileRequest& request);

 private:
  void allocate(const ClusterPlan& plan);
  void check_kv_range(std::span<const KvMove> moves, int32_t begin, int32_t end,
                      bool to_slots) const;
  void build_batch(const StepCommand& command);
  std::vector<SeqToken> sample(const StepCommand& command);
  struct SeqSampling;
  SeqToken sample_one(float* logits, uint64_t seq_id, SeqSampling& s);

  struct SeqSampling {
    SamplingParams params;
    Rng rng;
    std::optional<TokenHistory> history;  // when its penalties need the tokens
  };
  StagePlan stage_;
  int32_t kv_slots_;
  bool encoder_ = false;  // a WAA prefill stage: a sequence samples here once, then moves on
  std::unique_ptr<Model> owned_;  // the model this stage loaded, if it did
  Model* model_ = nullptr;
  std::unique_ptr<KvCache> cache_;
  StepBatch batch_;
  std::vector<int32_t> zeros_;  // token ids a stage without the embedding does not read
  std::vector<float> logits_;
  std::vector<float> raw_logits_;  // a row's logits before its penalties (for logprobs)
  Sampler sampler_;
  std::unordered_map<uint64_t, SeqSampling> sampling_;
};

}  // namespace strata
