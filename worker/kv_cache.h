// The KV cache of one model instance: every layer's K and V for a fixed number of slots
// (one sequence each) of a fixed capacity (positions), allocated once up front on the
// backend's device. A finished sequence gives its slot back at once for the next one.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/backend.h"
#include "worker/config.h"

namespace strata {

class KvCache {
 public:
  KvCache(Backend& backend, const ModelConfig& config, int32_t n_slots, int32_t capacity);

  KvLayerView layer(int32_t i) const;
  int32_t n_slots() const { return n_slots_; }
  int32_t capacity() const { return capacity_; }
  size_t bytes() const { return 2 * layer_elems_ * sizeof(float) * layers_.size(); }

  // A free slot, or -1 when all are taken.
  int32_t acquire();
  void release(int32_t slot);
  int32_t free_slots() const { return static_cast<int32_t>(free_.size()); }

 private:
  struct Layer {
    DeviceBuffer k, v;
  };
  int32_t n_slots_;
  int32_t capacity_;
  int32_t n_kv_heads_;
  int32_t head_dim_;
  size_t layer_elems_;
  std::vector<Layer> layers_;
  std::vector<int32_t> free_;  // stack of free slots, lowest on top
};

}  // namespace strata
