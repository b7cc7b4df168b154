// Weights that do not fit the host budget live on disk, a layer at a time (FlexGen's layer
// granularity), and stream back through two staging buffers: while layer i computes from
// one, an I/O thread reads the next disk layer into the other (FlexGen Alg. 1's weight
// prefetch; on a CPU-only node the host is the compute tier). Disk I/O bypasses the page
// cache, so the budget is real.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "kernels/tensor.h"
#include "placement/tier.h"
#include "worker/direct_file.h"
#include "worker/prefetch.h"
#include "worker/weights.h"

namespace strata {

// Where each tensor of a layer sits inside one contiguous, page-aligned blob.
class LayerLayout {
 public:
  static LayerLayout of(const LayerWeights& example);
  size_t bytes() const { return bytes_; }  // a multiple of kDirectAlignment
  void pack(const LayerWeights& src, void* blob) const;
  LayerWeights bind(void* blob) const;  // views into `blob`

 private:
  // A layer member, or (expert >= 0) a member of one of its experts.
  struct Field {
    Tensor LayerWeights::*member;
    ExpertMember expert_member;
    int32_t expert;
    DType dtype;
    Shape shape;
    size_t offset;
  };
  static Tensor& at(LayerWeights& w, const Field& f);
  static const Tensor& at(const LayerWeights& w, const Field& f);

  std::vector<Field> fields_;
  size_t n_experts_ = 0;
  size_t bytes_ = 0;
};

struct StreamStats {
  int64_t layers_read = 0;  // reads issued (each finishes before the layer is used)
  int64_t bytes_read = 0;
  double read_seconds = 0;  // on the I/O thread
  double wait_seconds = 0;  // compute waiting for a layer that was not there yet
};

class LayerStreamer : private SlotIo {
 public:
  // `disk_layers` (ascending) have been written to `file` at index * layout.bytes().
  // `overlap` false reads each layer only when it is needed (the ablation).
  LayerStreamer(DirectFile file, LayerLayout layout, std::vector<int32_t> disk_layers,
                bool overlap);
  ~LayerStreamer() override;
  LayerStreamer(const LayerStreamer&) = delete;
  LayerStreamer& operator=(const LayerStreamer&) = delete;

  bool on_disk(int32_t layer) const { return prefetch_.streams(layer); }
  // Weights of disk layer `layer`, valid until the next acquire(); starts the read of the
  // disk layer that follows it (wrapping to the first one for the next token).
  const LayerWeights& acquire(int32_t layer);
  // The same, as the layer's packed blob (layout().bytes() long).
  const void* acquire_blob(int32_t layer);
  const LayerLayout& layout() const { return layout_; }
  StreamStats stats() const;
  size_t staging_bytes() const { return 2 * layout_.bytes(); }
  // What the streamer holds: its two host staging buffers (cpu) and the layers' file (disk).
  TierBytes memory() const;

 private:
  struct Slot {
    Buffer storage;
    void* blob = nullptr;
    LayerWeights view;
    int32_t layer = -1;  // what the slot holds (or is loading)
    bool ready = false;
  };
  // SlotIo: a read on the I/O thread (one at a time), and the wait for it.
  void start(int slot, int32_t layer) override;
  void finish(int slot, int32_t layer) override;
  void io_loop();
  size_t index_of(int32_t layer) const;

  DirectFile file_;
  LayerLayout layout_;
  TwoSlotPrefetcher prefetch_;
  Slot slots_[2];

  mutable std::mutex mu_;
  std::condition_variable cv_;
  Slot* pending_ = nullptr;  // read queued for the I/O thread
  std::string io_error_;
  bool stop_ = false;
  StreamStats stats_;
  std::thread io_;
};

// Moves the chosen layers to a scratch file in `dir` as the loader builds them (so a model
// larger than memory is never whole in memory): called once per layer, it packs a disk
// layer into a page-aligned blob, writes it, gives its memory back and empties it.
class LayerOffloader {
 public:
  LayerOffloader(std::vector<int32_t> disk_layers, const std::string& dir);
  void operator()(int32_t layer, LayerWeights& weights);
  // The streamer over what was written (nullptr when no layer is on disk).
  std::unique_ptr<LayerStreamer> finish(size_t n_layers, bool overlap);

 private:
  std::vector<int32_t> disk_layers_;
  DirectFile file_;
  LayerLayout layout_;
  Buffer staging_;
};

// Empties a layer that was copied elsewhere, giving back the pages of mapped checkpoint
// tensors (the loader frees what it allocated once the layer is empty).
void release_layer(LayerWeights& w);

}  // namespace strata
