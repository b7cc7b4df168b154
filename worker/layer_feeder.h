// Weights for an engine that computes on an accelerator: FlexGen's three weight tiers at
// layer granularity. GPU-tier layers live on the device for good; CPU-tier layers live in
// page-locked host memory and disk-tier layers in an O_DIRECT file (through LayerStreamer);
// both stream into one of two device slots. While layer i computes from one slot, the next
// streamed layer is copied into the other on the backend's transfer queue (Algorithm 1's
// "load weight of the next layer"), so transfers hide behind compute when they can.
//
// With HeteGen (LayerSplit) a CPU-tier layer's linears are split (worker/split_linear.h): the
// (1 - alpha) share of each stays in host memory for the CPU to compute, and the alpha shares,
// packed in page-locked host memory, stream through the same two device slots in the same
// order as whole layers do (the paper's §4.2-4.3: the host holds all weights and each pass
// moves alpha x W across the link, overlapped with the CPU computing its share), so layer
// i + 1's shares copy while layer i computes. The layer's norms, and any module the module
// scheduler keeps whole (LayerSplit::whole), stay on the device. The transformer runs the split
// linears through splits(), handing them the shares in the slot. Disk-tier layers still stream
// whole: a split would need their CPU share resident in host memory, which is what the disk
// tier is there to avoid.
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

// HeteGen's split of the CPU-tier layers (off while cpu is null): every linear at alpha, or
// at its module slot's (slot_alpha), except the modules `whole` keeps on the device whole
// (placement/hetegen.h check_split: kModuleSlots flags per layer).
struct LayerSplit {
  double alpha = 0;
  Backend* cpu = nullptr;  // computes the (1 - alpha) shares; outlives the feeder
  std::vector<double> slot_alpha;
  std::vector<uint8_t> whole;
  bool enabled() const { return cpu != nullptr; }
  // The module's alpha; -1 for a module kept whole (it then runs unsplit).
  double alpha_of(int32_t layer, LinearSlot slot) const;
};

struct FeedStats {
  int64_t layers_from_cpu = 0;
  int64_t layers_from_disk = 0;
  int64_t bytes_from_cpu = 0;   // host -> device
  int64_t bytes_from_disk = 0;  // disk -> host staging -> device
  int64_t shares_streamed = 0;  // HeteGen: split layers whose alpha shares were copied
  int64_t bytes_of_shares = 0;  // their bytes, host -> device
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
  // slots, the split layers' pinned alpha shares and their CPU shares (the staging
  // included); the disk streamer's staging and file.
  TierBytes memory() const;
  // A split layer's alpha shares as packed and streamed (0 for other layers).
  size_t share_bytes(int32_t layer) const;

 private:
  struct Slot {
    DeviceBuffer blob;
    LayerWeights view;
    TransferTicket ticket;
  };
  // The first one wins; all layers share it. `example`: a layer taken (null: from disk),
  // whose shapes size the split layers' shares and so the device slots.
  void set_layout(const LayerLayout& layout, const LayerWeights* example);
  // A split layer's parts: the alpha shares (views into `w`, or copies into `storage` for
  // 4-bit) and what stays on the device (norms, whole modules).
  LayerWeights shares_of(int32_t layer, const LayerWeights& w,
                         std::vector<std::vector<std::byte>>* storage) const;
  LayerWeights kept_of(int32_t layer, const LayerWeights& w) const;
  // SlotIo: a copy on the transfer queue (from pinned host memory, or from the disk
  // streamer's staging), and compute ordered after it.
  void start(int slot, int32_t layer) override;
  void finish(int slot, int32_t layer) override;

  Backend& device_;
  std::vector<Tier> tiers_;
  LayerSplit split_;
  LayerLayout layout_;
  // per layer: device blob (GPU tier; a split layer's norms and whole modules) or pinned
  // blob (CPU tier, not split)
  std::vector<DeviceBuffer> resident_;
  std::vector<LayerWeights> gpu_views_;
  // per split layer: its alpha shares packed, in pinned host memory
  std::vector<LayerLayout> share_layouts_;
  std::vector<DeviceBuffer> shares_;
  size_t slot_bytes_ = 0;
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
