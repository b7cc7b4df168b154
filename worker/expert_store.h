// A MoE layer's experts over the tiers. The attention, the router and the hottest experts of
// every layer stay with the layer; the others live on disk, one page-aligned blob each, and
// are read (O_DIRECT, around the page cache) when the router picks them, into a cache of
// host slots that keeps the most popular of them between steps. Each token reads only its
// top-k experts, which is why such a model is the best case for offloading (MoE-Lightning,
// Fiddler): a disk expert costs its bytes only when some row of the step routes to it.
//
// The reads of a layer's disk experts run on an I/O thread in the order compute will use
// them, behind the experts the layer already holds, so compute of one expert overlaps the
// read of the next. Popularity is the router's counts over a sliding window of steps
// (ExpertPopularity), which the cache's eviction reads.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "kernels/moe_route.h"
#include "placement/tier.h"
#include "worker/direct_file.h"
#include "worker/layer_store.h"
#include "worker/weights.h"

namespace strata {

// How often each expert of each layer was picked over the last `window` routings of that
// layer (a routing: one step of one layer): the online measure Fiddler and MoE-Lightning
// place by. Rows count once per expert they pick.
class ExpertPopularity {
 public:
  ExpertPopularity(int32_t n_layers, int32_t n_experts, int32_t window = 64);
  void record(int32_t layer, const ExpertRouting& routing);
  // Expert e's picks in layer `layer` over the window, and all of that layer's picks.
  int64_t count(int32_t layer, int32_t expert) const;
  int64_t total(int32_t layer) const;
  // The layer's experts, most picked first (ties: lower index first).
  std::vector<int32_t> ranked(int32_t layer) const;
  int32_t n_experts() const { return n_experts_; }
  int32_t window() const { return window_; }

 private:
  int32_t n_layers_, n_experts_, window_;
  // Per layer: `window` routings' counts (a ring) and their sums.
  std::vector<int32_t> ring_;
  std::vector<int64_t> sums_;
  std::vector<int32_t> next_;  // per layer, the ring slot the next routing overwrites
};

// Where a layer's experts that its LayerWeights does not hold are (the transformer asks
// before computing them).
class ExpertSource {
 public:
  virtual ~ExpertSource() = default;
  virtual bool holds(int32_t layer, int32_t expert) const = 0;
  // Starts making the listed experts of `layer` (all held here) readable and returns them
  // in the order compute must take them: wait() each in this order, and release() it once
  // computed, before waiting for the next.
  virtual std::span<const int32_t> request(int32_t layer, std::span<const int32_t> experts) = 0;
  virtual const ExpertWeights& wait(int32_t layer, int32_t expert) = 0;
  virtual void release(int32_t layer, int32_t expert) = 0;
};

struct ExpertStreamStats {
  int64_t requested = 0;  // disk experts the steps needed
  int64_t hits = 0;       // of them, already in a cache slot
  int64_t reads = 0;
  int64_t bytes_read = 0;
  double read_seconds = 0;  // on the I/O thread
  double wait_seconds = 0;  // compute waiting for an expert
  double read_rate() const { return read_seconds > 0 ? double(bytes_read) / read_seconds : 0; }
  std::string str() const;
};

class ExpertStore final : public ExpertSource {
 public:
  // disk[layer] lists that layer's disk experts (ascending); they were written to `file` in
  // (layer, expert) order at index * layout.bytes(). `popularity` (may be null) ranks the
  // cache's entries for eviction; otherwise least recently used goes first.
  ExpertStore(DirectFile file, LayerLayout layout, std::vector<std::vector<int32_t>> disk,
              int32_t cache_slots, const ExpertPopularity* popularity = nullptr);
  void set_popularity(const ExpertPopularity* popularity) {
    std::lock_guard lock(mu_);
    popularity_ = popularity;
  }
  ~ExpertStore() override;
  ExpertStore(const ExpertStore&) = delete;
  ExpertStore& operator=(const ExpertStore&) = delete;

  bool holds(int32_t layer, int32_t expert) const override;
  std::span<const int32_t> request(int32_t layer, std::span<const int32_t> experts) override;
  const ExpertWeights& wait(int32_t layer, int32_t expert) override;
  void release(int32_t layer, int32_t expert) override;

  ExpertStreamStats stats() const;
  // The cache slots (cpu) and the experts' file (disk).
  TierBytes memory() const;
  int64_t disk_experts() const { return static_cast<int64_t>(index_.size()); }
  int32_t cache_slots() const { return static_cast<int32_t>(slots_.size()); }
  size_t expert_bytes() const { return layout_.bytes(); }  // one expert's blob on disk

 private:
  struct Slot {
    Buffer storage;
    void* blob = nullptr;
    LayerWeights view;  // experts[0]: the expert this slot holds
    int32_t layer = -1, expert = -1;
    bool ready = false;
    bool pinned = false;  // requested by the current layer and not yet released
    uint64_t used = 0;    // last request, for least-recently-used eviction
  };
  int64_t index_of(int32_t layer, int32_t expert) const;  // -1: not on disk
  Slot* find(int32_t layer, int32_t expert);
  Slot* victim();  // an unpinned slot to read into, nullptr when all are pinned
  void io_loop();

  DirectFile file_;
  LayerLayout layout_;
  std::vector<std::vector<int32_t>> disk_;
  std::vector<int64_t> first_;  // per layer: index of its first disk expert
  std::vector<int64_t> index_;  // flattened, for disk_experts()
  const ExpertPopularity* popularity_;
  std::vector<Slot> slots_;
  std::vector<int32_t> order_;  // the last request's compute order

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<int32_t, int32_t>> queue_;  // (layer, expert) reads, in compute order
  std::string io_error_;
  bool stop_ = false;
  uint64_t clock_ = 0;
  ExpertStreamStats stats_;
  std::thread io_;
};

// Moves each layer's experts that `resident` (a count per layer: the first ones of
// `ranking`, or the lowest indices) does not keep to a scratch file in `dir` as the loader
// builds the layer, so a model larger than memory is never whole in memory.
class ExpertOffloader {
 public:
  ExpertOffloader(int32_t n_layers, int32_t n_experts, int32_t resident, const std::string& dir);
  void operator()(int32_t layer, LayerWeights& weights);
  bool active() const { return resident_ < n_experts_; }
  // The store over what was written (nullptr when every expert stayed resident).
  std::unique_ptr<ExpertStore> finish(int32_t cache_slots);

 private:
  int32_t n_experts_, resident_;
  std::vector<std::vector<int32_t>> disk_;
  DirectFile file_;
  LayerLayout layout_;
  Buffer staging_;
  int64_t written_ = 0;
};

}  // namespace strata
