// Attention over a tiered KV cache for one GPU batch (FlexGen §4.2). It stores the step's new
// k/v rows into the layer's cache and attends where the cache's tier says: on the compute
// backend, on the host (CPU delegation: only q/k/v and the output cross the bus), or on the
// device with the layer staged there and back. A 4-bit cache is read as stored: attention
// dequantises the positions it attends over as it goes (Backend::attention_q4).
// Every workspace is reserved by reserve() for the cache it serves; run() allocates nothing.
#pragma once

#include <cstdint>

#include "kernels/backend.h"
#include "worker/config.h"
#include "worker/kv_cache.h"

namespace strata {

// Where the KV cache lives and who attends over the part kept off the device.
struct CacheOptions {
  CachePlacement placement;
  // Device compute with the cache in host memory or on disk: true runs decode attention on
  // the host (FlexGen's CPU delegation, §4.2: only q/k/v and the output cross the bus);
  // false copies the layer's cache to the device and back around each attention.
  bool cpu_attention = false;
  Backend* host = nullptr;  // the host backend for cpu_attention (required then)
};

class KvAttention {
 public:
  // `device_compute`: the backend is an accelerator's (or stands in for one), so cache
  // layers off its tier are delegated or staged; otherwise every tier is memory the backend
  // reads directly.
  KvAttention(const ModelConfig& config, Backend& backend, int32_t max_rows, bool device_compute);

  void set_options(const CacheOptions& options);
  const CacheOptions& options() const { return options_; }
  bool device_compute() const { return device_compute_; }
  // Reserves the workspaces attention over `cache` needs (grow-only).
  void reserve(const KvCache& cache);

  // q [rows, q_width], k and v [rows, kv_width] of one GPU batch on the compute backend;
  // stores k, v into layer `layer` of `cache` and writes the attention output to `out`.
  void run(int32_t layer, const float* q, const float* k, const float* v, const StepRows& rows,
           int32_t n_rows, KvCache& cache, float* out);

  // The workspaces: compute tier (a staged layer) and host (delegation).
  TierBytes memory() const;

 private:
  // One layer's cache as attention gets it: f32 or f16 elements, or 4-bit.
  struct LayerKv {
    bool q4 = false;
    KvLayerView elems;  // f32 or f16
    KvQ4LayerView packed;
  };
  // Stores the new rows into `kv` with backend `b` and attends over it.
  void attend(Backend& b, const float* q, const float* k, const float* v, const StepRows& rows,
              const LayerKv& kv, const KvCache& cache, float* out);
  void delegated(const float* q, const float* k, const float* v, const StepRows& rows,
                 int32_t n_rows, const LayerKv& kv, const KvCache& cache, float* out);
  void staged(const float* q, const float* k, const float* v, const StepRows& rows,
              const LayerKv& kv, const KvCache& cache, float* out);
  static DeviceBuffer& reserved(DeviceBuffer& b, size_t bytes, const char* what);

  ModelConfig config_;
  AttentionDims dims_;
  Backend& backend_;
  int32_t max_rows_;
  bool device_compute_;
  CacheOptions options_;
  // A device copy of one layer's cache (staged attention); host copies of q, k, v and the
  // output (delegated attention).
  DeviceBuffer staged_k_, staged_v_;
  DeviceBuffer host_q_, host_k_, host_v_, host_out_;
};

}  // namespace strata
