#include "worker/kv_cache.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "kernels/error.h"

namespace strata {

std::string CachePlacement::str() const {
  const std::string shares =
      fmt::format("c={}/{}/{}", gpu_percent, cpu_percent, 100 - gpu_percent - cpu_percent);
  std::string out = shares;
  if (compress) out += " 4-bit";
  if (dtype != DType::kF32) out += fmt::format(" {}", dtype_name(dtype));
  return pie.enabled() ? fmt::format("{} {}", out, pie.str()) : out;
}

KvCache::KvCache(Backend& backend, const ModelConfig& c, int32_t n_slots, int32_t capacity,
                 const CachePlacement& placement)
    : n_slots_(n_slots),
      positions_(capacity),
      window_(placement.max_step_rows > 0 && capacity > 0
                  ? KvWindow::of(c.cache_window(), capacity, placement.max_step_rows)
                  : KvWindow{}),
      capacity_(window_.active() ? window_.rows : capacity),
      n_kv_heads_(c.n_kv_heads),
      head_dim_(c.head_dim),
      layer_elems_(static_cast<size_t>(n_slots) * static_cast<size_t>(capacity_) *
                   static_cast<size_t>(c.kv_width())) {
  STRATA_CHECK(n_slots > 0 && capacity > 0, "kv cache slots {} capacity {}", n_slots, capacity);
  compress_ = placement.compress;
  if (compress_ && c.head_dim % 2 != 0)
    fail_input("{}: head_dim {} is odd; the 4-bit KV cache packs two values per byte", c.source,
               c.head_dim);
  dtype_ = placement.dtype;
  if (dtype_ != DType::kF32 && dtype_ != DType::kF16)
    fail_input("{}: a KV cache of {} elements; it holds f32 or f16", c.source, dtype_name(dtype_));
  if (compress_ && dtype_ != DType::kF32)
    fail_input("{}: the KV cache is either 4-bit or {}, not both", c.source, dtype_name(dtype_));
  on_device_ = placement.device_tier || backend.device() != Device::kHost;
  tiers_ = placement.tiers.empty() ? tiers_from_shares(c.n_layers, placement.gpu_percent,
                                                       placement.cpu_percent, "cache")
                                   : placement.tiers;
  if (tiers_.size() != static_cast<size_t>(c.n_layers))
    fail_input("the plan places {} KV-cache layers but the model has {}", tiers_.size(),
               c.n_layers);
  const size_t bytes = layer_bytes();
  layers_.resize(tiers_.size());
  if (placement.pie.enabled()) {
    if (!on_device_)
      fail_input(
          "Pie swaps the KV cache between an accelerator and the host: {} computes on "
          "the host",
          c.source);
    if (count_tier(tiers_, Tier::kGpu) != static_cast<int32_t>(tiers_.size()))
      fail_input(
          "Pie swaps GPU-tier KV-cache layers; the cache placement {} puts {} of {} "
          "layers elsewhere",
          placement.str(), static_cast<int32_t>(tiers_.size()) - count_tier(tiers_, Tier::kGpu),
          tiers_.size());
    swap_ = std::make_unique<KvSwap>(backend, c.n_layers, bytes, placement.pie);
  }
  for (size_t i = 0; i < tiers_.size() && !swap_; ++i) {
    if (tiers_[i] == Tier::kGpu) {
      layers_[i] = {DeviceBuffer(backend, bytes), DeviceBuffer(backend, bytes)};
    } else if (tiers_[i] == Tier::kCpu) {
      layers_[i] = {DeviceBuffer::host(backend, bytes), DeviceBuffer::host(backend, bytes)};
    }
  }
  if (std::count(tiers_.begin(), tiers_.end(), Tier::kDisk) > 0) {
    namespace fs = std::filesystem;
    if (!fs::is_directory(placement.disk_dir))
      fail_input("--disk-dir '{}' is not a directory (the KV cache's disk tier)",
                 placement.disk_dir);
    // Rounded up so every transfer is O_DIRECT-aligned; the tail past layer_bytes() is unused.
    const size_t padded = align_up(bytes);
    staging_ = {DeviceBuffer::host(backend, padded), DeviceBuffer::host(backend, padded)};
    file_ = DirectFile::create(
        (fs::path(placement.disk_dir) /
         fmt::format("strata-kv-{}-{}.bin", getpid(), static_cast<const void*>(this)))
            .string());
    file_.unlink_on_close();
    // Zeroed like device memory, so a layer read before its first write holds zeros.
    for (size_t i = 0; i < tiers_.size(); ++i)
      if (tiers_[i] == Tier::kDisk) store_zero(static_cast<int32_t>(i));
  }
  for (int32_t s = n_slots - 1; s >= 0; --s) free_.push_back(s);
}

TierBytes KvCache::memory() const {
  TierBytes m = swap_ ? swap_->memory() : TierBytes{};
  for (size_t i = 0; i < layers_.size(); ++i) {
    const auto b = static_cast<int64_t>(layers_[i].k.size() + layers_[i].v.size());
    (tiers_[i] == Tier::kGpu && on_device_ ? m.gpu : m.cpu) += b;
  }
  m.cpu += static_cast<int64_t>(staging_.k.size() + staging_.v.size());
  const auto disk = std::count(tiers_.begin(), tiers_.end(), Tier::kDisk);
  m.disk = static_cast<int64_t>(disk) * 2 * static_cast<int64_t>(align_up(layer_bytes()));
  return m;
}

size_t KvCache::file_offset(int32_t layer) const {
  return 2 * align_up(layer_bytes()) * static_cast<size_t>(layer);
}

void KvCache::store_zero(int32_t i) {
  staged_ = i;
  store(i);
  staged_ = -1;
}

size_t KvCache::layer_bytes() const {
  if (!compress_) return layer_elems_ * dtype_size(dtype_);
  KvQ4LayerView v = q4_layer_shape();
  return v.tensor_bytes();
}

KvQ4LayerView KvCache::q4_layer_shape() const {
  KvQ4LayerView v;
  v.n_slots = n_slots_;
  v.capacity = capacity_;
  v.n_kv_heads = n_kv_heads_;
  v.head_dim = head_dim_;
  v.group = KvQ4LayerView::group_for(head_dim_);
  return v;
}

KvQ4LayerView KvCache::q4_layer(int32_t i) const {
  STRATA_CHECK(compress_, "q4_layer of an uncompressed cache");
  const Layer& L = tier(i) == Tier::kDisk ? staging_ : layers_[static_cast<size_t>(i)];
  STRATA_CHECK(tier(i) != Tier::kDisk || staged_ == i, "disk layer {} used without load()", i);
  KvQ4LayerView v = q4_layer_shape();
  v.k = swap_ ? swap_->k(i) : L.k.data();
  v.v = swap_ ? swap_->v(i) : L.v.data();
  return v;
}

KvLayerView KvCache::layer(int32_t i) const {
  STRATA_CHECK(!compress_, "element view of a compressed cache");
  const Layer& L = tier(i) == Tier::kDisk ? staging_ : layers_[static_cast<size_t>(i)];
  STRATA_CHECK(tier(i) != Tier::kDisk || staged_ == i, "disk layer {} used without load()", i);
  void* k = swap_ ? swap_->k(i) : L.k.data();
  void* v = swap_ ? swap_->v(i) : L.v.data();
  return {k, v, n_slots_, capacity_, n_kv_heads_, head_dim_, dtype_};
}

void KvCache::load(int32_t i) {
  if (tier(i) != Tier::kDisk || staged_ == i) return;
  const size_t padded = align_up(layer_bytes());
  file_.read(staging_.k.data(), padded, file_offset(i));
  file_.read(staging_.v.data(), padded, file_offset(i) + padded);
  disk_bytes_moved_ += static_cast<int64_t>(2 * padded);
  staged_ = i;
}

void KvCache::store(int32_t i) {
  if (tier(i) != Tier::kDisk) return;
  STRATA_CHECK(staged_ == i, "store of disk layer {} while layer {} is staged", i, staged_);
  const size_t padded = align_up(layer_bytes());
  file_.write(staging_.k.data(), padded, file_offset(i));
  file_.write(staging_.v.data(), padded, file_offset(i) + padded);
  disk_bytes_moved_ += static_cast<int64_t>(2 * padded);
}

template <class F>
void KvCache::for_each_slot_range(int32_t slot, int32_t first, int32_t n_rows, F&& f) const {
  const auto hd = static_cast<size_t>(head_dim_);
  const auto n = static_cast<size_t>(n_rows);
  for (int32_t h = 0; h < n_kv_heads_; ++h) {
    // The slot's rows of kv head h: [r0, r0 + n) in the (slot, head, row) order.
    const size_t r0 =
        (static_cast<size_t>(slot) * static_cast<size_t>(n_kv_heads_) + static_cast<size_t>(h)) *
            static_cast<size_t>(capacity_) +
        static_cast<size_t>(first);
    if (!compress_) {
      const size_t row = hd * dtype_size(dtype_);
      f(r0 * row, n * row, row);
      continue;
    }
    const KvQ4LayerView q = q4_layer_shape();
    const size_t per_row = hd / static_cast<size_t>(q.group) * sizeof(float);
    const size_t codes = q.codes_bytes();
    f(r0 * hd / 2, n * hd / 2, hd / 2);
    f(codes + r0 * per_row, n * per_row, per_row);
    f(codes + q.groups() * sizeof(float) + r0 * per_row, n * per_row, per_row);
  }
}

// Each slide moves rows [from, from + rows) to [0, rows) in pieces of at most `from` rows,
// front to back, so no piece's source overlaps its destination or a later piece's source
// (device copies need not be memmove-safe).
void KvCache::slide(Backend& backend, void* k, void* v, std::span<const KvSlide> slides) const {
  const bool device = backend.device() != Device::kHost;
  for (const KvSlide& s : slides) {
    STRATA_CHECK(s.slot >= 0 && s.slot < n_slots_ && s.from > 0 && s.rows > 0 &&
                     s.from + s.rows <= capacity_,
                 "KV window slide of slot {} rows [{}, {}) of {} slots x {} rows", s.slot, s.from,
                 s.from + s.rows, n_slots_, capacity_);
    for (void* tensor : {k, v}) {
      auto* base = static_cast<std::byte*>(tensor);
      for_each_slot_range(s.slot, 0, s.rows, [&](size_t dst, size_t bytes, size_t row) {
        const size_t distance = static_cast<size_t>(s.from) * row;
        for (size_t done = 0; done < bytes; done += distance) {
          const size_t n = std::min(distance, bytes - done);
          if (device) {
            backend.copy(base + dst + done, base + dst + done + distance, n,
                         CopyKind::kDeviceToDevice);
          } else {
            std::memcpy(base + dst + done, base + dst + done + distance, n);
          }
        }
      });
    }
  }
}

void KvCache::discard_slot(Backend& backend, int32_t slot) {
  // Only memory the host backend allocated: pinned host memory of a device backend must stay.
  if (on_device_ || slot < 0 || slot >= n_slots_) return;
  for (size_t i = 0; i < tiers_.size(); ++i) {
    if (tiers_[i] == Tier::kDisk) continue;
    for (DeviceBuffer* t : {&layers_[i].k, &layers_[i].v})
      for_each_slot_range(slot, 0, capacity_, [&](size_t offset, size_t bytes, size_t) {
        backend.discard(t->data(), offset, bytes);
      });
  }
}

size_t KvCache::slot_bytes(int32_t positions) const {
  size_t total = 0;
  for_each_slot_range(0, 0, held_rows(positions),
                      [&](size_t, size_t bytes, size_t) { total += bytes; });
  return 2 * total;
}

// Out of the cache into `out`, or (out null) from `in` into the cache.
void KvCache::copy_slot(Backend& backend, int32_t layer, int32_t slot, int32_t positions,
                        std::byte* out, const std::byte* in) {
  const bool to_cache = out == nullptr;
  if (layer < 0 || layer >= static_cast<int32_t>(tiers_.size()) || slot < 0 || slot >= n_slots_ ||
      positions <= 0 || positions > positions_)
    fail(ErrorKind::kFailed,
         "KV cache copy of layer {} slot {} positions {}: outside {} layers x {} slots x {} "
         "positions",
         layer, slot, positions, tiers_.size(), n_slots_, positions_);
  load(layer);
  const Layer& L = tier(layer) == Tier::kDisk ? staging_ : layers_[static_cast<size_t>(layer)];
  bool device = tier(layer) == Tier::kGpu && on_device_;
  std::byte* bases[2] = {static_cast<std::byte*>(L.k.data()), static_cast<std::byte*>(L.v.data())};
  if (swap_) {  // wherever the mapping table has the layer now
    const KvSwap::Location where = swap_->settle(layer);
    bases[0] = where.k;
    bases[1] = where.v;
    device = where.device;
  }
  for (std::byte* base : bases) {
    for_each_slot_range(slot, 0, held_rows(positions), [&](size_t offset, size_t bytes, size_t) {
      std::byte* dst = to_cache ? base + offset : out;
      const std::byte* src = to_cache ? in : base + offset;
      if (device) {
        backend.copy(dst, src, bytes, to_cache ? CopyKind::kHostToDevice : CopyKind::kDeviceToHost);
      } else {
        std::memcpy(dst, src, bytes);
      }
      if (to_cache) {
        in += bytes;
      } else {
        out += bytes;
      }
    });
  }
  if (to_cache) store(layer);
}

void KvCache::read_slot(Backend& backend, int32_t layer, int32_t slot, int32_t positions,
                        std::byte* out) {
  copy_slot(backend, layer, slot, positions, out, nullptr);
}

void KvCache::write_slot(Backend& backend, int32_t layer, int32_t slot, int32_t positions,
                         const std::byte* in) {
  copy_slot(backend, layer, slot, positions, nullptr, in);
}

int32_t KvCache::acquire() {
  if (free_.empty()) return -1;
  const int32_t s = free_.back();
  free_.pop_back();
  return s;
}

void KvCache::release(int32_t slot) {
  STRATA_CHECK(slot >= 0 && slot < n_slots_, "release of slot {} of {}", slot, n_slots_);
  STRATA_CHECK(std::find(free_.begin(), free_.end(), slot) == free_.end(), "slot {} released twice",
               slot);
  free_.push_back(slot);
}

}  // namespace strata
