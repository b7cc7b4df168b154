#include "worker/model.h"

#include <utility>

#include "kernels/error.h"

namespace strata {

Model::Model(const ModelConfig& config, ModelWeights weights, Backend& backend, int32_t max_rows,
             std::unique_ptr<LayerStreamer> streamer, std::unique_ptr<LayerFeeder> feeder)
    : config_(config),
      weights_(std::move(weights)),
      backend_(backend),
      feeder_splits_(feeder != nullptr ? feeder->splits() : nullptr),
      layers_(weights_.layers, std::move(streamer), std::move(feeder)),
      transformer_(config_, weights_, backend, max_rows, layers_.device_compute()),
      executor_(transformer_, layers_, backend) {
  executor_.reserve(1);  // a step of one GPU batch runs without more
  if (config_.moe()) {
    popularity_ = std::make_unique<ExpertPopularity>(config_.n_layers, config_.n_experts);
    transformer_.set_experts(nullptr, popularity_.get());
  }
  if (feeder_splits_ != nullptr) {
    feeder_splits_->reserve(max_rows);  // the split linears' staging, once
    transformer_.set_split_linears(feeder_splits_);
  }
}

void Model::set_experts(std::unique_ptr<ExpertStore> store) {
  experts_ = std::move(store);
  if (experts_ != nullptr) {
    STRATA_CHECK(config_.moe() && !layers_.device_compute(),
                 "disk experts for a {} model computed on {}", family_name(config_.family),
                 backend_.name());
    experts_->set_popularity(popularity_.get());
  }
  transformer_.set_experts(experts_.get(), popularity_.get());
}

void Model::set_split_linears(SplitLinearTable* splits) {
  STRATA_CHECK(feeder_splits_ == nullptr || splits == feeder_splits_,
               "the feeder's HeteGen splits hold layers that cannot run without them");
  transformer_.set_split_linears(splits);
}

void Model::set_cache_options(const CacheOptions& options) {
  transformer_.attention().set_options(options);
}

std::unique_ptr<KvCache> Model::make_cache(int32_t n_slots, int32_t capacity) {
  if (cache_check_) cache_check_(n_slots, capacity);
  const double bytes = 2.0 * n_slots * capacity * config_.kv_width() * sizeof(float) *
                       static_cast<double>(config_.n_layers);
  return with_oom_context(
      fmt::format("allocating the KV cache of {} sequences x {} positions x {} layers ({:.1f} MiB "
                  "in f32)",
                  n_slots, capacity, config_.n_layers, bytes / (1 << 20)),
      [&] {
        const CacheOptions& options = cache_options();
        CachePlacement placement = options.placement;
        placement.device_tier = layers_.device_compute();
        placement.max_step_rows = max_rows();
        auto cache = std::make_unique<KvCache>(backend_, config_, n_slots, capacity, placement);
        transformer_.attention().reserve(*cache);
        executor_.reserve(n_slots);
        const KernelBounds bounds =
            transformer_.kernel_bounds(layers_.example(), cache->capacity());
        backend_.reserve(bounds);
        if (options.cpu_attention && options.host != nullptr) options.host->reserve(bounds);
        return cache;
      });
}

void Model::forward(const StepBatch& batch, KvCache& cache, float* logits) {
  executor_.run(batch, cache, StepIo{nullptr, logits, true, false, false});
}

void Model::forward_stage(const StepBatch& batch, KvCache& cache, const StepIo& io) {
  executor_.run(batch, cache, io);
}

// The weights as they are held: with a feeder, the fixed tensors on the device and every
// layer in the feeder; otherwise fixed tensors and resident layers in host memory, the rest
// in the disk streamer.
TierBytes Model::weight_memory() const {
  TierBytes m = layers_.memory();
  if (layers_.device_compute()) {
    for (const DeviceBuffer& b : weights_.device_owned) m.gpu += static_cast<int64_t>(b.size());
    return m;
  }
  const ModelWeights& w = weights_;
  auto bytes = [](const Tensor& t) {
    return t.data == nullptr ? 0 : static_cast<int64_t>(t.bytes());
  };
  for (const Tensor* t :
       {&w.embed, &w.positions, &w.project_in, &w.project_out, &w.final_norm, &w.final_norm_bias})
    m.cpu += bytes(*t);
  if (w.lm_head.data != w.embed.data) m.cpu += bytes(w.lm_head);
  for (const LayerWeights& L : w.layers)
    for_each_tensor(L, [&](const Tensor& t) { m.cpu += bytes(t); });
  return m;
}

WeightTraffic Model::weight_traffic() const {
  if (const LayerFeeder* f = feeder()) {
    const FeedStats s = f->stats();
    return {static_cast<uint64_t>(s.bytes_from_cpu), static_cast<uint64_t>(s.bytes_from_disk)};
  }
  const uint64_t experts =
      experts_ != nullptr ? static_cast<uint64_t>(experts_->stats().bytes_read) : 0;
  if (const LayerStreamer* s = streamer())
    return {0, static_cast<uint64_t>(s->stats().bytes_read) + experts};
  if (experts > 0) return {0, experts};
  return {};
}

TierBytes Model::memory() const {
  TierBytes m = weight_memory();
  m += transformer_.memory();
  m += executor_.memory();
  if (experts_ != nullptr) m += experts_->memory();
  return m;
}

}  // namespace strata
