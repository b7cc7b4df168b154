#include "worker/kv_cache.h"

#include <algorithm>

#include "kernels/error.h"

namespace strata {

KvCache::KvCache(Backend& backend, const ModelConfig& c, int32_t n_slots, int32_t capacity)
    : n_slots_(n_slots),
      capacity_(capacity),
      n_kv_heads_(c.n_kv_heads),
      head_dim_(c.head_dim),
      layer_elems_(static_cast<size_t>(n_slots) * static_cast<size_t>(capacity) *
                   static_cast<size_t>(c.kv_width())) {
  STRATA_CHECK(n_slots > 0 && capacity > 0, "kv cache slots {} capacity {}", n_slots, capacity);
  layers_.reserve(static_cast<size_t>(c.n_layers));
  for (int32_t i = 0; i < c.n_layers; ++i) {
    layers_.push_back({DeviceBuffer(backend, layer_elems_ * sizeof(float)),
                       DeviceBuffer(backend, layer_elems_ * sizeof(float))});
  }
  for (int32_t s = n_slots - 1; s >= 0; --s) free_.push_back(s);
}

KvLayerView KvCache::layer(int32_t i) const {
  const Layer& L = layers_[static_cast<size_t>(i)];
  return {L.k.f32(), L.v.f32(), n_slots_, capacity_, n_kv_heads_, head_dim_};
}

int32_t KvCache::acquire() {
  if (free_.empty()) return -1;
  const int32_t s = free_.back();
  free_.pop_back();
  return s;
}

void KvCache::release(int32_t slot) {
  STRATA_CHECK(slot >= 0 && slot < n_slots_, "release of slot {} of {}", slot, n_slots_);
  STRATA_CHECK(std::find(free_.begin(), free_.end(), slot) == free_.end(), "slot {} released twice", slot);
  free_.push_back(slot);
}

}  // namespace strata
