#include "worker/layer_feeder.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "kernels/clock.h"
#include "kernels/error.h"

namespace strata {
namespace {

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

// The layers that stream into the device slots: all but the GPU tier's (a split layer streams
// its alpha shares).
std::vector<int32_t> streamed_layers(const std::vector<Tier>& tiers) {
  std::vector<int32_t> out;
  for (size_t i = 0; i < tiers.size(); ++i)
    if (tiers[i] != Tier::kGpu) out.push_back(static_cast<int32_t>(i));
  return out;
}

}  // namespace

double LayerSplit::alpha_of(int32_t layer, LinearSlot slot) const {
  const int i = static_cast<int>(slot);
  if (hetegen::module_whole(whole, layer, i)) return -1;
  return hetegen::module_alpha(alpha, slot_alpha, i);
}

LayerFeeder::LayerFeeder(Backend& device, std::vector<Tier> tiers, bool overlap, LayerSplit split)
    : device_(device),
      tiers_(std::move(tiers)),
      split_(std::move(split)),
      prefetch_(streamed_layers(tiers_), overlap) {
  if (split_.enabled()) {
    hetegen::check_split(split_.alpha, split_.slot_alpha, split_.whole,
                         static_cast<int32_t>(tiers_.size()));
    splits_ = std::make_unique<SplitLinearTable>(device_, *split_.cpu,
                                                 static_cast<int32_t>(tiers_.size()));
  }
  resident_.resize(tiers_.size());
  gpu_views_.resize(tiers_.size());
  shares_.resize(tiers_.size());
  share_layouts_.resize(tiers_.size());
}

LayerWeights LayerFeeder::shares_of(int32_t layer, const LayerWeights& w,
                                    std::vector<std::vector<std::byte>>* storage) const {
  LayerWeights out;
  for (LinearSlot slot : kAllLinearSlots) {
    const Tensor& t = slot_weight(w, slot);
    if (t.shape.rank != 2) continue;  // not in this family
    const double alpha = split_.alpha_of(layer, slot);
    if (alpha < 0) continue;  // kept whole
    const int64_t g = split_gpu_rows(alpha, t.shape[0]);
    if (g == 0) continue;
    // Without storage only the layout is wanted (LayerLayout::of reads shapes, not data).
    Tensor share{t.data, t.dtype, Shape{g, t.shape[1]}, Device::kHost};
    if (storage != nullptr) share = leading_rows(t, g, storage->emplace_back());
    out.*slot_weight_member(slot) = share;
    const Tensor& b = slot_bias(w, slot);
    if (b.data != nullptr)
      out.*slot_bias_member(slot) = Tensor{b.data, b.dtype, Shape{g}, b.device};
  }
  return out;
}

LayerWeights LayerFeeder::kept_of(int32_t layer, const LayerWeights& w) const {
  LayerWeights n;
  n.attn_norm = w.attn_norm;
  n.attn_norm_bias = w.attn_norm_bias;
  n.mlp_norm = w.mlp_norm;
  n.mlp_norm_bias = w.mlp_norm_bias;
  for (LinearSlot slot : kAllLinearSlots) {
    if (slot_weight(w, slot).shape.rank != 2 || split_.alpha_of(layer, slot) >= 0) continue;
    n.*slot_weight_member(slot) = slot_weight(w, slot);
    if (const LayerMember b = slot_bias_member(slot); b != nullptr) n.*b = w.*b;
  }
  return n;
}

void LayerFeeder::set_layout(const LayerLayout& layout, const LayerWeights* example) {
  if (layout_.bytes() > 0) return;
  layout_ = layout;
  if (prefetch_.streamed().empty()) return;
  // The slots hold the largest thing streamed: a whole layer, or a split layer's shares.
  for (int32_t i : prefetch_.streamed()) {
    if (!split(i)) {
      slot_bytes_ = std::max(slot_bytes_, layout_.bytes());
      continue;
    }
    STRATA_CHECK(example != nullptr, "split layer {} before any layer was taken", i);
    share_layouts_[static_cast<size_t>(i)] = LayerLayout::of(shares_of(i, *example, nullptr));
    slot_bytes_ = std::max(slot_bytes_, share_layouts_[static_cast<size_t>(i)].bytes());
  }
  for (Slot& s : slots_)
    if (slot_bytes_ > 0) s.blob = DeviceBuffer(device_, slot_bytes_);
}

void LayerFeeder::take(int32_t layer, LayerWeights& w) {
  STRATA_CHECK(layer >= 0 && static_cast<size_t>(layer) < tiers_.size(), "layer {} of {}", layer,
               tiers_.size());
  const Tier t = tier(layer);
  if (t == Tier::kDisk) return;
  set_layout(LayerLayout::of(w), &w);
  const auto i = static_cast<size_t>(layer);
  if (split(layer)) {
    splits_->add(
        layer, w, [this](int32_t l, LinearSlot s) { return split_.alpha_of(l, s); },
        SplitShare::kStreamed);
    // The norms and whole modules on the device for good.
    const LayerWeights kept = kept_of(layer, w);
    const LayerLayout kept_layout = LayerLayout::of(kept);
    std::vector<std::byte> host(kept_layout.bytes());
    kept_layout.pack(kept, host.data());
    resident_[i] = DeviceBuffer(device_, host.size());
    device_.copy(resident_[i].data(), host.data(), host.size(), CopyKind::kHostToDevice);
    gpu_views_[i] = kept_layout.bind(resident_[i].data());
    // The alpha shares packed in page-locked host memory, streamed each pass.
    const LayerLayout& shares = share_layouts_[i];
    if (shares.bytes() > 0) {
      std::vector<std::vector<std::byte>> storage;
      shares_[i] = DeviceBuffer::host(device_, shares.bytes());
      std::memset(shares_[i].data(), 0, shares.bytes());
      shares.pack(shares_of(layer, w, &storage), shares_[i].data());
    }
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
  if (disk_ != nullptr) set_layout(disk_->layout(), nullptr);
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
  size_t bytes = layout_.bytes();
  if (split(layer)) {
    // The alpha shares into the slot; the view is the layer's device part with the slot's
    // shares in place of its split linears.
    const auto i = static_cast<size_t>(layer);
    src = shares_[i].data();
    bytes = share_layouts_[i].bytes();
    stats_.shares_streamed += 1;
    stats_.bytes_of_shares += static_cast<int64_t>(bytes);
    slot.view = gpu_views_[i];
    const LayerWeights streamed = share_layouts_[i].bind(slot.blob.data());
    for (LinearSlot s : kAllLinearSlots) {
      if (const Tensor& t = streamed.*slot_weight_member(s); t.data != nullptr)
        slot.view.*slot_weight_member(s) = t;
      if (const LayerMember b = slot_bias_member(s); b != nullptr && (streamed.*b).data != nullptr)
        slot.view.*b = streamed.*b;
    }
  } else if (tier(layer) == Tier::kCpu) {
    slot.view = layout_.bind(slot.blob.data());
    src = resident_[static_cast<size_t>(layer)].data();
    stats_.layers_from_cpu += 1;
    stats_.bytes_from_cpu += static_cast<int64_t>(layout_.bytes());
  } else {
    slot.view = layout_.bind(slot.blob.data());
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
  slot.ticket = bytes > 0 ? device_.transfer(slot.blob.data(), src, bytes, CopyKind::kHostToDevice)
                          : TransferTicket{};
  if (tier(layer) == Tier::kDisk) disk_ticket_ = slot.ticket;
}

void LayerFeeder::finish(int slot, int32_t) {
  device_.compute_waits(slots_[slot].ticket);
}

const LayerWeights& LayerFeeder::acquire(int32_t layer) {
  STRATA_CHECK(layer >= 0 && static_cast<size_t>(layer) < tiers_.size(), "layer {} of {}", layer,
               tiers_.size());
  if (tier(layer) == Tier::kGpu) return gpu_views_[static_cast<size_t>(layer)];
  return slots_[prefetch_.acquire(layer, *this)].view;
}

TierBytes LayerFeeder::memory() const {
  TierBytes m;
  for (size_t i = 0; i < tiers_.size(); ++i) {
    const bool on_device = tiers_[i] == Tier::kGpu || split(static_cast<int32_t>(i));
    (on_device ? m.gpu : m.cpu) += static_cast<int64_t>(resident_[i].size());
  }
  for (const DeviceBuffer& b : shares_) m.cpu += static_cast<int64_t>(b.size());
  for (const Slot& s : slots_) m.gpu += static_cast<int64_t>(s.blob.size());
  if (splits_ != nullptr) m += splits_->memory();
  if (disk_ != nullptr) m += disk_->memory();
  return m;
}

size_t LayerFeeder::share_bytes(int32_t layer) const {
  return split(layer) ? share_layouts_[static_cast<size_t>(layer)].bytes() : 0;
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
