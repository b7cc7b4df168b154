// Weights for an engine that computes on an accelerator: FlexGen's three weight tiers at
// layer granularity. GPU-tier layers live on the device for good; CPU-tier layers live in
// page-locked host memory and disk-tier layers in an O_DIRECT file (through LayerStreamer);
// both stream into one of two device slots. While layer i computes from one slot, the next
// streamed layer is copied into the other on the backend's transfer queue (Algorithm 1's
// "load weight of the next layer"), so transfers hide behind compute when they can.
//
// With HeteGen (LayerSplit) a CPU-tier layer is not streamed: its linears are split
// (worker/split_linear.h), the alpha share of each on the device for good and the rest in host
// memory for the CPU to compute, and only its norms are kept on the device beside them. The
// transformer runs those linears through splits(). Disk-tier layers still stream whole: a
// split would need their CPU share resident in host memory, which is what the disk tier is
// there to avoid.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "placement/tier.h"
#include "worker/layer_store.h"
#include "worker/prefetch.h"
#include "worker/split_linear.h"
#include "worker/weights.h"

namespace strata {

// The tiers (Tier, spread_tiers, tiers_from_shares) are placement/'s decision (tier.h).

// HeteGen's split of the CPU-tier layers (off while cpu is null): every linear at alpha.
struct LayerSplit {
  double alpha = 0;
  Backend* cpu = nullptr;  // computes the (1 - alpha) shares; outlives the feeder
  bool enabled() const { return cpu != nullptr; }
};

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
  LayerFeeder(Backend& device, std::vector<Tier> tiers, bool overlap, LayerSplit split = {});
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
  // Whether `layer` is split by HeteGen (a CPU-tier layer with a LayerSplit).
  bool split(int32_t layer) const { return split_.enabled() && tier(layer) == Tier::kCpu; }
  // The split linears of the split layers (nullptr without a LayerSplit); the model hands them
  // to its transformer and sizes their staging (SplitLinearTable::reserve).
  SplitLinearTable* splits() const { return splits_.get(); }
  FeedStats stats() const;
  size_t layer_bytes() const { return layout_.bytes(); }  // one packed layer
  const LayerLayout& layout() const { return layout_; }
  const LayerStreamer* disk() const { return disk_.get(); }
  // What the feeder holds: resident layers (device or page-locked host), its two device
  // slots, the split linears (their staging included); the disk streamer's staging and file.
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
  LayerSplit split_;
  LayerLayout layout_;
  LayerLayout norms_layout_;  // a split layer's norms, packed alone
  // per layer: device blob (GPU tier; a split layer's norms) or pinned blob (CPU tier)
  std::vector<DeviceBuffer> resident_;
  std::vector<LayerWeights> gpu_views_;
  std::unique_ptr<LayerStreamer> disk_;
  TransferTicket disk_ticket_;  // the last copy out of the streamer's host staging
  TwoSlotPrefetcher prefetch_;  // over the CPU- and disk-tier layers
  Slot slots_[2];
  FeedStats stats_;
  std::unique_ptr<SplitLinearTable> splits_;
};

// Moves the always-resident tensors (embeddings, positions, projections, final norm, head)
// to the device; a tied head stays one copy.
void upload_fixed_weights(Backend& device, ModelWeights& w);

}  // namespace strata
