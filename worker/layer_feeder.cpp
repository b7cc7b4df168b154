#include "worker/layer_feeder.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "kernels/error.h"

namespace strata {
namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// A device view of a host tensor's bytes, copied now (load time, not the hot path).
Tensor upload(Backend& device, const Tensor& t, std::vector<DeviceBuffer>& owned) {
  if (t.data == nullptr) return t;
  owned.emplace_back(device, t.bytes());
  device.copy(owned.back().data(), t.data, t.bytes(), CopyKind::kHostToDevice);
  Tensor d = t;
  d.data = owned.back().data();
  d.device = device.device();
  return d;
}

}  // namespace

namespace {

// The layers that stream into the device slots: all but the GPU tier's, and with a split
// all but the CPU tier's too.
std::vector<int32_t> streamed_layers(const std::vector<Tier>& tiers, const LayerSplit& split) {
  std::vector<int32_t> out;
  for (size_t i = 0; i < tiers.size(); ++i)
    if (tiers[i] != Tier::kGpu && !(split.enabled() && tiers[i] == Tier::kCpu))
      out.push_back(static_cast<int32_t>(i));
  return out;
}

// What a split layer keeps beside its split linears: the norms. The biases go with their
// linears' shares (SplitLinearWeights), so nothing is held twice.
LayerWeights norms_of(const LayerWeights& w) {
  LayerWeights n;
  n.attn_norm = w.attn_norm;
  n.attn_norm_bias = w.attn_norm_bias;
  n.mlp_norm = w.mlp_norm;
  n.mlp_norm_bias = w.mlp_norm_bias;
  return n;
}

}  // namespace

LayerFeeder::LayerFeeder(Backend& device, std::vector<Tier> tiers, bool overlap, LayerSplit split)
    : device_(device),
      tiers_(std::move(tiers)),
      split_(split),
      prefetch_(streamed_layers(tiers_, split_), overlap) {
  if (split_.enabled()) {
    if (!(split_.alpha > 0 && split_.alpha <= 1))
      fail_input("HeteGen: alpha must be in (0, 1], got {}", split_.alpha);
    splits_ = std::make_unique<SplitLinearTable>(device_, *split_.cpu,
                                                 static_cast<int32_t>(tiers_.size()));
  }
  resident_.resize(tiers_.size());
  gpu_views_.resize(tiers_.size());
}

void LayerFeeder::set_layout(const LayerLayout& layout) {
  if (layout_.bytes() > 0) return;
  layout_ = layout;
  if (prefetch_.streamed().empty()) return;
  for (Slot& s : slots_) {
    s.blob = DeviceBuffer(device_, layout_.bytes());
    s.view = layout_.bind(s.blob.data());
  }
}

void LayerFeeder::take(int32_t layer, LayerWeights& w) {
  STRATA_CHECK(layer >= 0 && static_cast<size_t>(layer) < tiers_.size(), "layer {} of {}", layer,
               tiers_.size());
  const Tier t = tier(layer);
  if (t == Tier::kDisk) return;
  set_layout(LayerLayout::of(w));
  const auto i = static_cast<size_t>(layer);
  if (split(layer)) {
    const double alpha = split_.alpha;
    splits_->add(layer, w, [alpha](int32_t, LinearSlot) { return alpha; });
    const LayerWeights norms = norms_of(w);
    if (norms_layout_.bytes() == 0) norms_layout_ = LayerLayout::of(norms);
    std::vector<std::byte> host(norms_layout_.bytes());
    norms_layout_.pack(norms, host.data());
    resident_[i] = DeviceBuffer(device_, host.size());
    device_.copy(resident_[i].data(), host.data(), host.size(), CopyKind::kHostToDevice);
    gpu_views_[i] = norms_layout_.bind(resident_[i].data());
    release_layer(w);
    return;
  }
  // Pack on the host (page-locked, so the copy to the device needs no bounce buffer).
  DeviceBuffer host = DeviceBuffer::host(device_, layout_.bytes());
  layout_.pack(w, host.data());
  if (t == Tier::kGpu) {
    resident_[i] = DeviceBuffer(device_, layout_.bytes());
    device_.copy(resident_[i].data(), host.data(), layout_.bytes(), CopyKind::kHostToDevice);
    gpu_views_[i] = layout_.bind(resident_[i].data());
  } else {
    resident_[i] = std::move(host);
  }
  release_layer(w);
}

void LayerFeeder::finish(std::unique_ptr<LayerStreamer> disk) {
  disk_ = std::move(disk);
  if (disk_ != nullptr) set_layout(disk_->layout());
  for (size_t i = 0; i < tiers_.size(); ++i) {
    const bool held = tiers_[i] == Tier::kDisk
                          ? disk_ != nullptr && disk_->on_disk(static_cast<int32_t>(i))
                          : resident_[i].data() != nullptr;
    STRATA_CHECK(held, "layer {} ({} tier) was never placed", i, tier_name(tiers_[i]));
  }
}

void LayerFeeder::start(int slot_index, int32_t layer) {
  Slot& slot = slots_[slot_index];
  const void* src = nullptr;
  if (tier(layer) == Tier::kCpu) {
    src = resident_[static_cast<size_t>(layer)].data();
    stats_.layers_from_cpu += 1;
    stats_.bytes_from_cpu += static_cast<int64_t>(layout_.bytes());
  } else {
    // The streamer refills the staging buffer the last disk copy came from once we ask it
    // for this layer, so that copy must be over first.
    device_.host_waits(disk_ticket_);
    const double t0 = now_s();
    src = disk_->acquire_blob(layer);
    stats_.wait_seconds += now_s() - t0;
    stats_.layers_from_disk += 1;
    stats_.bytes_from_disk += static_cast<int64_t>(layout_.bytes());
  }
  // The transfer queue runs after the compute already issued, which is the last to read
  // this slot's previous layer, so overwriting it is safe.
  slot.ticket = device_.transfer(slot.blob.data(), src, layout_.bytes(), CopyKind::kHostToDevice);
  if (tier(layer) == Tier::kDisk) disk_ticket_ = slot.ticket;
}

void LayerFeeder::finish(int slot, int32_t) {
  device_.compute_waits(slots_[slot].ticket);
}

const LayerWeights& LayerFeeder::acquire(int32_t layer) {
  STRATA_CHECK(layer >= 0 && static_cast<size_t>(layer) < tiers_.size(), "layer {} of {}", layer,
               tiers_.size());
  if (tier(layer) == Tier::kGpu || split(layer)) return gpu_views_[static_cast<size_t>(layer)];
  return slots_[prefetch_.acquire(layer, *this)].view;
}

TierBytes LayerFeeder::memory() const {
  TierBytes m;
  for (size_t i = 0; i < tiers_.size(); ++i) {
    const bool on_device = tiers_[i] == Tier::kGpu || split(static_cast<int32_t>(i));
    (on_device ? m.gpu : m.cpu) += static_cast<int64_t>(resident_[i].size());
  }
  for (const Slot& s : slots_) m.gpu += static_cast<int64_t>(s.blob.size());
  if (splits_ != nullptr) m += splits_->memory();
  if (disk_ != nullptr) m += disk_->memory();
  return m;
}

FeedStats LayerFeeder::stats() const {
  return stats_;
}

void upload_fixed_weights(Backend& device, ModelWeights& w) {
  const bool tied = w.lm_head.data == w.embed.data;
  for (Tensor* t :
       {&w.embed, &w.positions, &w.project_in, &w.project_out, &w.final_norm, &w.final_norm_bias})
    *t = upload(device, *t, w.device_owned);
  w.lm_head = tied ? w.embed : upload(device, w.lm_head, w.device_owned);
  // Every layer lives in the feeder or on disk and the fixed tensors on the device now: the
  // host copies go (placement/ counts the fixed weights on the device alone).
  w.owned.clear();
  w.archive.reset();
}

}  // namespace strata
