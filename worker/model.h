// The transformer, written once against the backend interface for both families; the
// config says which norm, activation, positions and biases a layer uses.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kernels/backend.h"
#include "worker/config.h"
#include "worker/kv_cache.h"
#include "worker/layer_feeder.h"
#include "worker/layer_store.h"
#include "worker/weights.h"

namespace strata {

// The work of one forward step: rows (one per new token) of several sequences, packed
// without padding, and which rows need logits.
struct StepBatch {
  std::vector<int32_t> tokens;     // one per row
  std::vector<int32_t> positions;  // one per row
  std::vector<SeqSlice> seqs;
  std::vector<int32_t> logit_rows;  // rows whose next-token logits are wanted, in output order

  void clear();
  int32_t rows() const { return static_cast<int32_t>(tokens.size()); }
  // Appends `n` tokens of the sequence in `slot` that already has `n_past` cached; if
  // `want_logits`, its last row's logits are requested. Returns the slice index.
  size_t add(int32_t slot, int32_t n_past, std::span<const int32_t> new_tokens, bool want_logits);
};

// Where a step's input comes from and where its output goes. The whole model embeds the
// batch's tokens and writes logits; a pipeline stage (worker/stage.h) may take the previous
// stage's activations in and give its own out.
struct StepIo {
  const float* in = nullptr;  // activations [rows, hidden]; null: embed the batch's tokens
  float* out = nullptr;       // with head: logits [logit_rows, vocab] (host); else [rows, hidden]
  bool head = true;
  // Activations in / out are buffers of the compute backend (an NCCL link between GPU
  // stages) rather than host memory; out is complete when the step returns.
  bool in_device = false;
  bool out_device = false;
};

// Where the KV cache lives and who attends over the part kept off the device.
struct CacheOptions {
  CachePlacement placement;
  // Device compute with the cache in host memory or on disk: true runs decode attention on
  // the host (FlexGen's CPU delegation, §4.2: only q/k/v and the output cross the bus);
  // false copies the layer's cache to the device and back around each attention.
  bool cpu_attention = false;
  Backend* host = nullptr;  // the host backend for cpu_attention (required then)
};

class Model {
 public:
  // max_rows bounds the rows of one step; activation memory is allocated once for it.
  // `streamer` (optional, host compute) serves the layers the loader moved to disk;
  // `feeder` (device compute) serves every layer on the device.
  Model(const ModelConfig& config, ModelWeights weights, Backend& backend, int32_t max_rows,
        std::unique_ptr<LayerStreamer> streamer = nullptr,
        std::unique_ptr<LayerFeeder> feeder = nullptr);

  const ModelConfig& config() const { return config_; }
  const ModelWeights& weights() const { return weights_; }
  Backend& backend() { return backend_; }
  const LayerStreamer* streamer() const { return feeder_ ? feeder_->disk() : streamer_.get(); }
  const LayerFeeder* feeder() const { return feeder_.get(); }
  int32_t max_rows() const { return max_rows_; }

  void set_cache_options(const CacheOptions& options);
  const CacheOptions& cache_options() const { return cache_options_; }
  // A cache placed as the cache options say. Also allocates, once, the workspaces a cache
  // of that size needs (the GPU batches' states, a layer staged or dequantised for
  // attention, the host buffers of CPU attention), so a step allocates nothing.
  std::unique_ptr<KvCache> make_cache(int32_t n_slots, int32_t capacity);

  // What the model holds per tier: weights (fixed tensors, resident layers, the feeder's or
  // streamer's buffers and files), activations and workspaces. The KV cache is the cache's.
  TierBytes memory() const;

  // FlexGen's GPU batch size in sequences: a step with more sequences runs as a block of
  // several GPU batches (zig-zag schedule). 0: the whole step is one GPU batch.
  void set_gpu_batch_size(int32_t sequences);
  int32_t gpu_batch_size() const { return gpu_batch_size_; }

  // Runs one step. Writes logits [batch.logit_rows.size(), vocab] to host memory `logits`.
  void forward(const StepBatch& batch, KvCache& cache, float* logits);

  // One pipeline stage's part of a step (worker/stage.h; the model then holds the stage's
  // layers only): every layer of this model runs, in and out as `io` says, with the same
  // block schedule as forward().
  void forward_stage(const StepBatch& batch, KvCache& cache, const StepIo& io);

 private:
  const LayerWeights& layer_weights(int32_t i);
  void run_block(std::span<const StepBatch* const> block, std::span<const int32_t> first_rows,
                 KvCache& cache, const StepIo& io);
  void block_input(const StepBatch& batch, int32_t first_row, const StepIo& io);
  void split_gpu_batches(const StepBatch& batch);
  // One GPU batch's state that lives across the layers of a block.
  struct BatchState {
    DeviceBuffer x, tokens, positions;
  };
  BatchState make_batch_state();
  class BatchScope {
   public:
    BatchScope(Model& m, size_t b);
    ~BatchScope();
    BatchScope(const BatchScope&) = delete;
    BatchScope& operator=(const BatchScope&) = delete;

   private:
    void swap();
    Model& m_;
    size_t b_;
  };
  void embed(const StepBatch& batch, int32_t rows);
  void layer(const LayerWeights& L, int32_t i, const StepBatch& batch, KvCache& cache,
             int32_t rows);
  void attention_block(const LayerWeights& L, const StepBatch& batch, KvCache& cache, int32_t i,
                       int32_t rows);
  // One layer's cache as attention gets it: f32, or 4-bit (dequantised before use).
  struct LayerKv {
    bool q4 = false;
    KvLayerView f32;
    KvQ4LayerView packed;
  };
  void attend(const StepBatch& batch, KvCache& cache, int32_t i, const AttentionDims& dims,
              int32_t rows);
  KvLayerView store_kv(Backend& b, const float* k, const float* v, const StepBatch& batch,
                       const LayerKv& kv, const KvCache& cache, bool on_host);
  void delegated_attention(const StepBatch& batch, const LayerKv& kv, const KvCache& cache,
                           const AttentionDims& dims, int32_t rows);
  void staged_attention(const StepBatch& batch, const LayerKv& kv, const KvCache& cache,
                        const AttentionDims& dims);
  void mlp_block(const LayerWeights& L, int32_t rows);
  void norm(const Tensor& w, const Tensor& b, const float* x, int32_t rows, float* y);
  void head(const StepBatch& batch, float* logits);
  void head_chunk(std::span<const int32_t> rows, int32_t batch_rows, float* logits);

  static constexpr int32_t kLogitChunk = 64;
  void allocate_activations();
  void reserve_workspaces(const KvCache& cache);
  void build_rope_tables();

  ModelConfig config_;
  ModelWeights weights_;
  std::unique_ptr<LayerStreamer> streamer_;
  std::unique_ptr<LayerFeeder> feeder_;
  Backend& backend_;
  int32_t max_rows_;

  // Activations, [max_rows, width] each, on the backend's device.
  DeviceBuffer x_, h_, q_, k_, v_, attn_, f1_, f2_, sel_, logits_, tokens_, positions_;
  DeviceBuffer rope_cos_, rope_sin_;
  RopeTables rope_;
  std::vector<int32_t> scratch_ids_;

  CacheOptions cache_options_;
  int32_t gpu_batch_size_ = 0;
  std::vector<StepBatch> gpu_batches_;
  std::vector<int32_t> gpu_batch_rows_;  // each GPU batch's first row in the step
  std::vector<BatchState> block_state_;
  // Host copies of q, k, v and the attention output (delegated attention), and a device
  // copy of one layer's cache (staged attention); allocated on first use.
  DeviceBuffer host_q_, host_k_, host_v_, host_out_;
  DeviceBuffer staged_k_, staged_v_;
  // A 4-bit cache layer dequantised for attention: on the compute device, and on the host
  // for delegated attention.
  DeviceBuffer work_k_, work_v_, host_work_k_, host_work_v_;
};

}  // namespace strata
