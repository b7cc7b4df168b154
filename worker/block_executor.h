// FlexGen's zig-zag block schedule (Algorithm 1) over the transformer. A step with more
// sequences than the GPU batch size runs as a block of GPU batches with the layer loop
// outside and the GPU batches inside, so each layer's weights are fetched once per block and
// every GPU batch reuses them. Layers come from a LayerSource (resident, streamed from disk,
// or fed to the device with the next one prefetched); each GPU batch keeps its own state
// (transformer.h BatchState), whose ids and row table are uploaded once per step.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/backend.h"
#include "worker/kv_cache.h"
#include "worker/layer_feeder.h"
#include "worker/layer_store.h"
#include "worker/transformer.h"
#include "worker/weights.h"

namespace strata {

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

// Where each layer's weights come from: resident in the model's weights, the disk streamer
// (host compute) or the feeder (device compute: it serves every layer).
class LayerSource {
 public:
  LayerSource(std::vector<LayerWeights>& resident, std::unique_ptr<LayerStreamer> streamer,
              std::unique_ptr<LayerFeeder> feeder);

  // Layer `i`'s weights, valid until the next acquire().
  const LayerWeights& acquire(int32_t i);
  // Any layer's tensors as shapes and dtypes (their data may be null): all layers share them.
  LayerWeights example() const;
  bool device_compute() const { return feeder_ != nullptr; }
  const LayerStreamer* streamer() const { return feeder_ ? feeder_->disk() : streamer_.get(); }
  const LayerFeeder* feeder() const { return feeder_.get(); }
  // The streamer's or feeder's layers, buffers and file (not the resident layers).
  TierBytes memory() const;

 private:
  std::vector<LayerWeights>& resident_;
  std::unique_ptr<LayerStreamer> streamer_;
  std::unique_ptr<LayerFeeder> feeder_;
};

class BlockExecutor {
 public:
  BlockExecutor(Transformer& transformer, LayerSource& layers, Backend& backend);

  // FlexGen's GPU batch size in sequences (0: the whole step is one GPU batch).
  void set_gpu_batch_size(int32_t sequences);
  int32_t gpu_batch_size() const { return gpu_batch_size_; }
  // The states of the largest block a step over `n_slots` sequences makes (grow-only).
  void reserve(int32_t n_slots);

  // Runs one step: every layer of the source, in and out as `io` says.
  void run(const StepBatch& batch, KvCache& cache, const StepIo& io);

  TierBytes memory() const;  // the GPU batches' states

 private:
  void split(const StepBatch& batch);
  void input(const StepBatch& batch, int32_t first_row, BatchState& s, const StepIo& io);
  void output(const StepBatch& batch, int32_t first_row, const BatchState& s, const StepIo& io,
              float*& logits);

  Transformer& transformer_;
  LayerSource& layers_;
  Backend& backend_;
  int32_t gpu_batch_size_ = 0;
  // This step's GPU batches (their vectors reused step to step), each one's first row in the
  // step, and the block as the layer loop walks it.
  std::vector<StepBatch> parts_;
  std::vector<const StepBatch*> block_;
  std::vector<int32_t> first_rows_;
  std::vector<BatchState> states_;
};

}  // namespace strata
