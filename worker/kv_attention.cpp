#include "worker/kv_attention.h"

#include <cmath>

#include "kernels/error.h"

namespace strata {

KvAttention::KvAttention(const ModelConfig& config, Backend& backend, int32_t max_rows,
                         bool device_compute)
    : config_(config),
      dims_{config.n_heads,     config.n_kv_heads, config.head_dim, config.score_scale(), 0,
            config.attn_softcap},
      backend_(backend),
      max_rows_(max_rows),
      device_compute_(device_compute) {}

void KvAttention::set_options(const CacheOptions& options) {
  STRATA_CHECK(!options.cpu_attention || options.host != nullptr,
               "CPU attention needs a host backend");
  options_ = options;
}

DeviceBuffer& KvAttention::reserved(DeviceBuffer& b, size_t bytes, const char* what) {
  STRATA_CHECK(b.size() >= bytes, "attention workspace '{}' holds {} bytes, {} needed (reserve())",
               what, b.size(), bytes);
  return b;
}

void KvAttention::reserve(const KvCache& cache) {
  bool off_device = false;
  for (int32_t i = 0; i < config_.n_layers; ++i)
    off_device = off_device || cache.tier(i) != Tier::kGpu;
  off_device = off_device && device_compute_;
  const bool delegated = off_device && options_.cpu_attention;
  auto grow = [&](DeviceBuffer& b, size_t bytes, bool host) {
    if (b.size() < bytes)
      b = host ? DeviceBuffer::host(backend_, bytes) : DeviceBuffer(backend_, bytes);
  };
  if (off_device && !delegated) {
    grow(staged_k_, cache.layer_bytes(), false);
    grow(staged_v_, cache.layer_bytes(), false);
  }
  if (delegated) {
    const auto rows = static_cast<size_t>(max_rows_);
    grow(host_q_, rows * static_cast<size_t>(config_.q_width()) * sizeof(float), true);
    grow(host_out_, host_q_.size(), true);
    grow(host_k_, rows * static_cast<size_t>(config_.kv_width()) * sizeof(float), true);
    grow(host_v_, host_k_.size(), true);
  }
}

// The cache's tier decides where attention runs. On a host-compute engine every tier is
// host memory the backend reads directly; with device compute, a cache kept off the device
// is either attended on the host (delegation) or brought to the device for the layer.
void KvAttention::run(int32_t layer, const float* q, const float* k, const float* v,
                      const StepRows& rows, int32_t n_rows, KvCache& cache, float* out) {
  dims_.window = config_.layer_window(layer);  // Gemma-2 alternates local and global layers
  const Tier tier = cache.tier(layer);
  cache.load(layer);
  LayerKv kv{cache.compressed(), {}, {}};
  if (kv.q4) {
    kv.packed = cache.q4_layer(layer);
  } else {
    kv.elems = cache.layer(layer);
  }
  if (tier == Tier::kGpu || !device_compute_) {
    attend(backend_, q, k, v, rows, kv, cache, out);
  } else if (options_.cpu_attention) {
    delegated(q, k, v, rows, n_rows, kv, cache, out);
  } else {
    staged(q, k, v, rows, kv, cache, out);
  }
  cache.store(layer);
}

// A sliding window's slides first, where the layer lives (`b`'s memory). A 4-bit cache is
// quantised as it is stored and attended as stored; an f32 or f16 one in one pass where the
// backend has one (store_and_attend).
void KvAttention::attend(Backend& b, const float* q, const float* k, const float* v,
                         const StepRows& rows, const LayerKv& kv, const KvCache& cache,
                         float* out) {
  if (!rows.slides.empty())
    cache.slide(b, kv.q4 ? kv.packed.k : kv.elems.k, kv.q4 ? kv.packed.v : kv.elems.v, rows.slides);
  if (kv.q4) {
    b.kv_store_q4(k, v, rows, kv.packed);
    b.attention_q4(q, rows, kv.packed, dims_, out);
  } else if (!b.store_and_attend(q, k, v, rows, kv.elems, dims_, out)) {
    b.kv_store(k, v, rows, kv.elems);
    b.attention(q, rows, kv.elems, dims_, out);
  }
}

void KvAttention::delegated(const float* q, const float* k, const float* v, const StepRows& rows,
                            int32_t n_rows, const LayerKv& kv, const KvCache& cache, float* out) {
  Backend& host = *options_.host;
  const auto n = static_cast<size_t>(n_rows);
  const size_t q_bytes = n * static_cast<size_t>(config_.q_width()) * sizeof(float);
  const size_t kv_bytes = n * static_cast<size_t>(config_.kv_width()) * sizeof(float);
  float* hq = reserved(host_q_, q_bytes, "host q").f32();
  float* hk = reserved(host_k_, kv_bytes, "host k").f32();
  float* hv = reserved(host_v_, kv_bytes, "host v").f32();
  float* ho = reserved(host_out_, q_bytes, "host out").f32();
  backend_.copy(hq, q, q_bytes, CopyKind::kDeviceToHost);
  backend_.copy(hk, k, kv_bytes, CopyKind::kDeviceToHost);
  backend_.copy(hv, v, kv_bytes, CopyKind::kDeviceToHost);
  StepRows host_rows(rows.seqs);  // the row table lives on the device
  host_rows.slides = rows.slides;
  attend(host, hq, hk, hv, host_rows, kv, cache, ho);
  backend_.copy(out, ho, q_bytes, CopyKind::kHostToDevice);
}

// The layer's cache (as stored: f32, f16 or 4-bit) copied to the device and back around the
// attention.
void KvAttention::staged(const float* q, const float* k, const float* v, const StepRows& rows,
                         const LayerKv& kv, const KvCache& cache, float* out) {
  const size_t bytes = cache.layer_bytes();
  void* dk = reserved(staged_k_, bytes, "staged k").data();
  void* dv = reserved(staged_v_, bytes, "staged v").data();
  void* host_k = kv.q4 ? kv.packed.k : kv.elems.k;
  void* host_v = kv.q4 ? kv.packed.v : kv.elems.v;
  LayerKv dev = kv;
  dev.elems.k = dk;
  dev.elems.v = dv;
  dev.packed.k = dk;
  dev.packed.v = dv;
  backend_.copy(dk, host_k, bytes, CopyKind::kHostToDevice);
  backend_.copy(dv, host_v, bytes, CopyKind::kHostToDevice);
  attend(backend_, q, k, v, rows, dev, cache, out);
  backend_.copy(host_k, dk, bytes, CopyKind::kDeviceToHost);
  backend_.copy(host_v, dv, bytes, CopyKind::kDeviceToHost);
}

TierBytes KvAttention::memory() const {
  TierBytes m;
  int64_t& compute = device_compute_ || backend_.device() != Device::kHost ? m.gpu : m.cpu;
  for (const DeviceBuffer* b : {&staged_k_, &staged_v_}) compute += static_cast<int64_t>(b->size());
  for (const DeviceBuffer* b : {&host_q_, &host_k_, &host_v_, &host_out_})
    m.cpu += static_cast<int64_t>(b->size());
  return m;
}

}  // namespace strata
