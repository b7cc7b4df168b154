// Weights for an engine that computes on an accelerator: FlexGen's three weight tiers at
// layer granularity. GPU-tier layers live on the device for good; CPU-tier layers live in
// page-locked host memory and disk-tier layers in an O_DIRECT file (through LayerStreamer);
// both stream into one of two device slots. While layer i computes from one slot, the next
// streamed layer is copied into the other on the backend's transfer queue (Algorithm 1's
// "load weight of the next layer"), so transfers hide behind compute when they can.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "placement/tier.h"
#include "worker/layer_store.h"
#include "worker/prefetch.h"
#include "worker/weights.h"

namespace strata {

// The tiers (Tier, spread_tiers, tiers_from_shares) are placement/'s decision (tier.h).

struct FeedStats {
  int64_t layers_from_cpu = 0;
  int64_t layers_from_disk = 0;
  int64_t bytes_from_cpu = 0;   // host -> device
  int64_t bytes_from_disk = 0;  // disk -> host staging -> device
  double wait_seconds = 0;      // host waiting for a disk layer before it could be sent on
};

class LayerFeeder : private SlotIo {
 public:
  // `tiers` has one entry per layer; `overlap` false loads a streamed layer only when it is
  // needed (the ablation).
  LayerFeeder(Backend& device, std::vector<Tier> tiers, bool overlap);
  ~LayerFeeder() override = default;
  LayerFeeder(const LayerFeeder&) = delete;
  LayerFeeder& operator=(const LayerFeeder&) = delete;

  // The loader's sink for GPU- and CPU-tier layers: copies the layer to its tier and
  // empties `w` (giving the loader's memory back). Disk-tier layers are not taken.
  void take(int32_t layer, LayerWeights& w);
  // Disk-tier layers, once written. Then the feeder is ready.
  void finish(std::unique_ptr<LayerStreamer> disk);

  // Layer `layer`'s weights on the device, valid until the next acquire(); compute
  // enqueued after this call sees them.
  const LayerWeights& acquire(int32_t layer);

  Tier tier(int32_t layer) const { return tiers_[static_cast<size_t>(layer)]; }
  FeedStats stats() const;
  size_t layer_bytes() const { return layout_.bytes(); }  // one packed layer
  const LayerLayout& layout() const { return layout_; }
  const LayerStreamer* disk() const { return disk_.get(); }
  // What the feeder holds: resident layers (device or page-locked host) and its two device
  // slots; the disk streamer's staging and file included.
  TierBytes memory() const;

 private:
  struct Slot {
    DeviceBuffer blob;
    LayerWeights view;
    TransferTicket ticket;
  };
  void set_layout(const LayerLayout& layout);  // the first one wins; all layers share it
  // SlotIo: a copy on the transfer queue (from pinned host memory, or from the disk
  // streamer's staging), and compute ordered after it.
  void start(int slot, int32_t layer) override;
  void finish(int slot, int32_t layer) override;

  Backend& device_;
  std::vector<Tier> tiers_;
  LayerLayout layout_;
  std::vector<DeviceBuffer>
      resident_;  // per layer: device blob (GPU tier) or pinned blob (CPU tier)
  std::vector<LayerWeights> gpu_views_;
  std::unique_ptr<LayerStreamer> disk_;
  TransferTicket disk_ticket_;  // the last copy out of the streamer's host staging
  TwoSlotPrefetcher prefetch_;  // over the CPU- and disk-tier layers
  Slot slots_[2];
  FeedStats stats_;
};

// Moves the always-resident tensors (embeddings, positions, projections, final norm, head)
// to the device; a tied head stays one copy.
void upload_fixed_weights(Backend& device, ModelWeights& w);

}  // namespace strata
