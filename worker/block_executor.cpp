#include "worker/block_executor.h"

#include <algorithm>

#include "kernels/error.h"

namespace strata {

LayerSource::LayerSource(std::vector<LayerWeights>& resident,
                         std::unique_ptr<LayerStreamer> streamer,
                         std::unique_ptr<LayerFeeder> feeder)
    : resident_(resident), streamer_(std::move(streamer)), feeder_(std::move(feeder)) {}

const LayerWeights& LayerSource::acquire(int32_t i) {
  if (feeder_ != nullptr) return feeder_->acquire(i);
  if (streamer_ != nullptr && streamer_->on_disk(i)) return streamer_->acquire(i);
  STRATA_CHECK(i >= 0 && static_cast<size_t>(i) < resident_.size(), "layer {} of {}", i,
               resident_.size());
  return resident_[static_cast<size_t>(i)];
}

LayerWeights LayerSource::example() const {
  for (const LayerWeights& w : resident_)
    if (w.q.data != nullptr) return w;
  if (feeder_ != nullptr && feeder_->layer_bytes() > 0) return feeder_->layout().bind(nullptr);
  if (const LayerStreamer* s = streamer(); s != nullptr) return s->layout().bind(nullptr);
  return {};
}

TierBytes LayerSource::memory() const {
  if (feeder_ != nullptr) return feeder_->memory();
  return streamer_ != nullptr ? streamer_->memory() : TierBytes{};
}

BlockExecutor::BlockExecutor(Transformer& transformer, LayerSource& layers, Backend& backend)
    : transformer_(transformer), layers_(layers), backend_(backend) {}

void BlockExecutor::set_gpu_batch_size(int32_t sequences) {
  STRATA_CHECK(sequences >= 0, "GPU batch size {}", sequences);
  gpu_batch_size_ = sequences;
}

void BlockExecutor::reserve(int32_t n_slots) {
  const int32_t g = gpu_batch_size_;
  const auto batches = static_cast<size_t>(g > 0 && n_slots > g ? (n_slots + g - 1) / g : 1);
  while (states_.size() < batches) states_.push_back(transformer_.make_batch_state());
  if (parts_.size() < batches) parts_.resize(batches);
  block_.reserve(batches);
  first_rows_.reserve(batches);
}

// Splits a step into GPU batches of at most gpu_batch_size sequences, rows rebased to 0.
// The scheduler lists logit rows in sequence order, which the split keeps; any other order,
// or a logit row other than a sequence's last, runs as one GPU batch.
void BlockExecutor::split(const StepBatch& batch) {
  block_.clear();
  first_rows_.clear();
  const auto n = static_cast<int32_t>(batch.seqs.size());
  const int32_t g = gpu_batch_size_;
  const bool one =
      g <= 0 || n <= g || !std::is_sorted(batch.logit_rows.begin(), batch.logit_rows.end());
  if (!one) {
    size_t wanted = 0;
    for (int32_t s0 = 0, b = 0; s0 < n; s0 += g, ++b) {
      STRATA_CHECK(static_cast<size_t>(b) < parts_.size(),
                   "a block of more GPU batches than reserved ({}): {} sequences", parts_.size(),
                   n);
      StepBatch& part = parts_[static_cast<size_t>(b)];
      part.clear();
      first_rows_.push_back(batch.seqs[static_cast<size_t>(s0)].row_begin);
      for (int32_t s = s0; s < std::min(n, s0 + g); ++s) {
        const SeqSlice& q = batch.seqs[static_cast<size_t>(s)];
        const auto first = static_cast<size_t>(q.row_begin);
        const bool wants = std::binary_search(batch.logit_rows.begin(), batch.logit_rows.end(),
                                              q.row_begin + q.n_new - 1);
        part.add(q.slot, q.n_past,
                 std::span(batch.tokens).subspan(first, static_cast<size_t>(q.n_new)), wants);
      }
      wanted += part.logit_rows.size();
      block_.push_back(&part);
    }
    if (wanted == batch.logit_rows.size()) return;
    block_.clear();
    first_rows_.clear();
  }
  block_.push_back(&batch);
  first_rows_.push_back(0);
}

// The layer loop outside, the GPU batches inside (Algorithm 1): each layer's weights are
// acquired once per block. Each GPU batch keeps its own residual stream across layers.
void BlockExecutor::run(const StepBatch& batch, KvCache& cache, const StepIo& io) {
  const int32_t rows = batch.rows();
  const ModelConfig& c = transformer_.config();
  STRATA_CHECK(rows > 0 && rows <= transformer_.max_rows(), "step of {} rows (max {})", rows,
               transformer_.max_rows());
  STRATA_CHECK(io.out != nullptr, "step of {} rows without an output buffer", rows);
  for (int32_t p : batch.positions)
    STRATA_CHECK(p >= 0 && p < c.max_positions, "position {} outside the model's {} positions", p,
                 c.max_positions);
  split(batch);
  STRATA_CHECK(block_.size() <= states_.size(),
               "a block of {} GPU batches but {} states reserved (make the cache first)",
               block_.size(), states_.size());
  for (size_t b = 0; b < block_.size(); ++b) {
    transformer_.upload_batch(*block_[b], cache, states_[b]);
    input(*block_[b], first_rows_[b], states_[b], io);
  }
  for (int32_t i = 0; i < c.n_layers; ++i) {
    cache.before_layer(i);  // Pie: swaps start, and layer i's KV cache is on the device
    const LayerWeights& w = layers_.acquire(i);
    for (size_t b = 0; b < block_.size(); ++b)
      transformer_.layer(w, i, states_[b], block_[b]->rows(), cache);
  }
  cache.after_step();
  float* logits = io.out;
  for (size_t b = 0; b < block_.size(); ++b)
    output(*block_[b], first_rows_[b], states_[b], io, logits);
  // Another stream (NCCL's) sends the activations next.
  if (io.out_device && !io.head) backend_.synchronize();
}

// A GPU batch's residual stream: the tokens' embeddings, or the previous stage's activations
// of its rows.
void BlockExecutor::input(const StepBatch& batch, int32_t first_row, BatchState& s,
                          const StepIo& io) {
  if (io.in == nullptr) {
    transformer_.embed(batch, s);
    return;
  }
  const auto width = static_cast<size_t>(transformer_.config().hidden);
  backend_.copy(s.x.data(), io.in + static_cast<size_t>(first_row) * width,
                static_cast<size_t>(batch.rows()) * width * sizeof(float),
                io.in_device ? CopyKind::kDeviceToDevice : CopyKind::kHostToDevice);
}

void BlockExecutor::output(const StepBatch& batch, int32_t first_row, const BatchState& s,
                           const StepIo& io, float*& logits) {
  const ModelConfig& c = transformer_.config();
  if (io.head) {
    transformer_.head(batch, s, logits);
    logits += batch.logit_rows.size() * static_cast<size_t>(c.vocab);
    return;
  }
  const auto width = static_cast<size_t>(c.hidden);
  backend_.copy(io.out + static_cast<size_t>(first_row) * width, s.x.data(),
                static_cast<size_t>(batch.rows()) * width * sizeof(float),
                io.out_device ? CopyKind::kDeviceToDevice : CopyKind::kDeviceToHost);
}

TierBytes BlockExecutor::memory() const {
  TierBytes m;
  int64_t& compute = layers_.device_compute() || backend_.device() != Device::kHost ? m.gpu : m.cpu;
  for (const BatchState& s : states_) compute += static_cast<int64_t>(s.x.size() + s.ids.size());
  return m;
}

}  // namespace strata
