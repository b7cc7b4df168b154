// The KV cache of one model instance: every layer's K and V for a fixed number of slots
// (one sequence each) of a fixed capacity (positions), allocated once up front. A finished
// sequence gives its slot back at once for the next one.
//
// Each layer's cache has a home tier (FlexGen's cg/cc/cd at layer granularity): the compute
// device, host memory (page-locked where the device is a GPU) or disk. A disk layer is
// read into one host staging pair before its attention and written back after it
// (O_DIRECT, so the host budget is real). With Pie (kv_swap.h) the GPU-tier layers share
// fewer device buffers than layers and swap through host memory as the mapping table says.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "placement/tier.h"
#include "worker/config.h"
#include "worker/direct_file.h"
#include "worker/kv_swap.h"

namespace strata {

// Where the cache goes: shares of layers on the device and in host memory, the disk the rest.
struct CachePlacement {
  int gpu_percent = 100;
  int cpu_percent = 0;
  std::string disk_dir = "/tmp";
  // FlexGen's cache compression: stored 4-bit in every tier (KvQ4LayerView), dequantised
  // just before attention.
  bool compress = false;
  // The elements of an uncompressed cache: kF32, or kF16 (half the bytes to hold and for
  // attention to read; what FlexGen and llama.cpp keep), in any tier: every backend's
  // kv_store and attention take both.
  DType dtype = DType::kF32;
  // Per-layer tiers decided elsewhere (a cluster plan's placement); empty: from the shares.
  std::vector<Tier> tiers;
  // The GPU tier is an accelerator's memory (device compute) even where the backend driving
  // it is the host's (tests run the device path on the CPU backend).
  bool device_tier = false;
  // Pie's swapping of the (all GPU-tier) layers through host memory; device compute only.
  PieOptions pie;
  // The most rows one sequence adds in a step (the model's max_rows): with a model whose
  // every layer has a sliding window, a slot then holds KvWindow::of(window, capacity,
  // max_step_rows).rows positions, not the whole context. 0: every slot holds the context.
  int32_t max_step_rows = 0;
  std::string str() const;
};

class KvCache {
 public:
  KvCache(Backend& backend, const ModelConfig& config, int32_t n_slots, int32_t capacity,
          const CachePlacement& placement = {});

  Tier tier(int32_t layer) const { return tiers_[static_cast<size_t>(layer)]; }
  // The layer's cache where it lives: device memory (GPU tier) or host memory (CPU tier;
  // disk tier: the staging pair, valid between load() and store()).
  KvLayerView layer(int32_t i) const;
  bool compressed() const { return compress_; }
  DType dtype() const { return dtype_; }    // elements of an uncompressed cache
  KvQ4LayerView q4_layer(int32_t i) const;  // the same, for a compressed cache
  void load(int32_t i);                     // disk tier: file -> staging
  void store(int32_t i);                    // disk tier: staging -> file
  // The block executor's hooks around a step's layers: before layer i is computed (Pie
  // starts its swaps and waits for layer i's swap-in), and after the last one.
  void before_layer(int32_t i) {
    if (swap_) swap_->begin_layer(i);
  }
  void after_step() {
    if (swap_) swap_->end_step();
  }
  const KvSwap* swap() const { return swap_.get(); }  // null without Pie

  int32_t n_slots() const { return n_slots_; }
  int32_t capacity() const { return capacity_; }    // rows a slot holds
  int32_t positions() const { return positions_; }  // the context a sequence may reach
  const KvWindow& window() const { return window_; }
  // The rows a slot holds once its sequence has `positions` positions.
  int32_t held_rows(int32_t positions) const { return positions - window_.first_held(positions); }
  // A sliding window's slides (StepRows::slides) on one layer's K and V at k and v, laid
  // out as this cache's layers are, in memory `backend` owns.
  void slide(Backend& backend, void* k, void* v, std::span<const KvSlide> slides) const;
  size_t bytes() const { return 2 * layer_bytes() * tiers_.size(); }
  size_t layer_bytes() const;  // K or V of one layer as stored
  int64_t disk_bytes_moved() const { return disk_bytes_moved_; }
  // What the cache holds per tier: layers (the GPU tier is host memory when the host
  // computes), the disk staging pair and the disk file.
  TierBytes memory() const;

  // One slot's first `positions` positions of layer i as stored (a sliding window's: the
  // rows it holds of them) -- K then V, each as f32 or
  // f16 rows or as the 4-bit codes, mins and scales of those rows -- in a flat buffer of
  // slot_bytes(positions): what WAA's KV hand-over moves between stages, bit for bit. Both
  // caches must share the format (compression, dtype, KV heads, head size; capacity may
  // differ).
  // Between steps only: a disk layer goes through the staging pair.
  size_t slot_bytes(int32_t positions) const;
  void read_slot(Backend& backend, int32_t layer, int32_t slot, int32_t positions, std::byte* out);
  void write_slot(Backend& backend, int32_t layer, int32_t slot, int32_t positions,
                  const std::byte* in);

  // A new sequence takes `slot`: what the last one left there is given back to the host
  // (Backend::discard) where the cache is the host backend's memory, so a cache of many
  // slots holds the positions in use, not slots x capacity (S3's packing).
  void discard_slot(Backend& backend, int32_t slot);

  // A free slot, or -1 when all are taken.
  int32_t acquire();
  void release(int32_t slot);
  int32_t free_slots() const { return static_cast<int32_t>(free_.size()); }

 private:
  struct Layer {
    DeviceBuffer k, v;
  };
  size_t file_offset(int32_t layer) const;
  KvQ4LayerView q4_layer_shape() const;
  void store_zero(int32_t i);  // staging is still all zeros
  // The byte ranges [offset, offset + bytes) of one K or V tensor that hold a slot's rows
  // [first, first + n), in the order slot_bytes() packs them; f(offset, bytes, row_bytes).
  template <class F>
  void for_each_slot_range(int32_t slot, int32_t first, int32_t n, F&& f) const;
  void copy_slot(Backend& backend, int32_t layer, int32_t slot, int32_t positions, std::byte* out,
                 const std::byte* in);

  int32_t n_slots_;
  int32_t positions_;
  KvWindow window_;
  int32_t capacity_;
  int32_t n_kv_heads_;
  int32_t head_dim_;
  size_t layer_elems_;
  bool compress_ = false;
  DType dtype_ = DType::kF32;
  bool on_device_ = false;  // the backend's memory is an accelerator's
  std::vector<Tier> tiers_;
  std::vector<Layer> layers_;  // empty buffers for disk-tier layers, and for all with Pie
  Layer staging_;              // host pair the disk-tier layer in use is read into
  int32_t staged_ = -1;        // which disk layer the staging holds
  DirectFile file_;
  int64_t disk_bytes_moved_ = 0;
  std::unique_ptr<KvSwap> swap_;  // Pie: the mapping table and its buffers
  std::vector<int32_t> free_;     // stack of free slots, lowest on top
};

}  // namespace strata
