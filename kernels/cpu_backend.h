// The reference backend: host memory, OpenBLAS for GEMM/GEMV, OpenMP loops elsewhere.
#pragma once

#include <mutex>
#include <unordered_map>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu_isa.h"
#include "kernels/gemm_q4_panel.h"
#include "kernels/quant.h"

namespace strata {

class CpuBackend final : public Backend {
 public:
  // threads <= 0: all cores. Sets both OpenMP's and OpenBLAS's thread count. Throws
  // InputError above max_cpu_threads().
  explicit CpuBackend(int threads = 0);
  // The same with the kernels' instruction set given (tests compare every one the CPU has);
  // InputError where this CPU or build lacks it.
  CpuBackend(int threads, CpuIsa isa);

  std::string name() const override;
  Device device() const override { return Device::kHost; }
  int threads() const { return threads_; }

  // Allocations of kLazyBytes and more are mapped, not written: the kernel commits their
  // pages as they are first written, so a KV cache of many slots of the whole context costs
  // the positions filled (S3's packing; discard() gives a finished slot's pages back). Small
  // pages on purpose: on huge pages the first writes of a prefill cost 3-4x the faults'
  // time (2 MiB zeroed and compacted per fault) and decode attention gained nothing
  // measurable (docs/journal/benchmarks-history.md, "Panel GEMM, huge pages").
  void* allocate(size_t bytes) override;
  void deallocate(void* p) override;
  void discard(void* p, size_t offset, size_t bytes) override;
  static constexpr size_t kLazyBytes = size_t{1} << 20;
  void copy(void* dst, const void* src, size_t bytes, CopyKind kind) override;
  void synchronize() override {}
  void bind_thread() override;
  // Reserves the f32 rows a half-precision GEMM dequantises into and attention's score
  // blocks (one per thread), so a step allocates nothing.
  void reserve(const KernelBounds& bounds) override;
  size_t reserved_bytes() const override;

  void linear(const float* x, int64_t m, const Tensor& w, const float* bias, float* y) override;
  void embedding(const int32_t* ids, int64_t n, const Tensor& table, float* y) override;
  void rms_norm(const float* x, int64_t m, int64_t h, const float* weight, float eps,
                float* y) override;
  void layer_norm(const float* x, int64_t m, int64_t h, const float* weight, const float* bias,
                  float eps, float* y) override;
  void rope(float* x, int64_t m, int32_t n_heads, int32_t head_dim, const int32_t* positions,
            const RopeTables& tables) override;
  void silu_mul(const float* gate, const float* up, float* out, int64_t n) override;
  void gelu_tanh_mul(const float* gate, const float* up, float* out, int64_t n) override;
  void scale(float* x, int64_t n, float s) override;
  void softcap(float* x, int64_t n, float cap) override;
  void relu(float* x, int64_t n) override;
  void add(float* y, const float* x, int64_t n) override;
  void gather_rows(const float* x, int64_t width, const int32_t* rows, int64_t n,
                   float* out) override;
  void scatter_add_rows(const float* y, int64_t width, const int32_t* rows, const float* weights,
                        int64_t n, float* out) override;
  void softmax(float* x, int64_t m, int64_t n) override;
  void kv_store(const float* k, const float* v, const StepRows& rows,
                const KvLayerView& cache) override;
  void kv_store_q4(const float* k, const float* v, const StepRows& rows,
                   const KvQ4LayerView& cache) override;
  void kv_dequantize(const KvQ4LayerView& cache, const KvLayerView& out) override;
  void attention(const float* q, const StepRows& rows, const KvLayerView& cache,
                 const AttentionDims& dims, float* out) override;
  void attention_q4(const float* q, const StepRows& rows, const KvQ4LayerView& cache,
                    const AttentionDims& dims, float* out) override;

 private:
  void linear_f32(const float* x, int64_t m, const Tensor& w, const float* bias, float* y);
  void linear_half(const float* x, int64_t m, const Tensor& w, const float* bias, float* y);
  void linear_panel(const float* x, int64_t m, const Tensor& w, const float* bias, float* y);

  int threads_;
  std::mutex mapped_mutex_;                   // allocate() may run on any stage's thread
  std::unordered_map<void*, size_t> mapped_;  // lazy allocations and their mapped bytes
  CpuIsa isa_ = CpuIsa::kPortable;            // the kernels' instruction set, shown in name()
  // Scratch reserved by reserve() and reused across calls.
  std::vector<float> attn_scratch_;
  std::vector<float> dequant_scratch_;
  Linear4bitScratch q4_scratch_;
  Q4PanelScratch q4_panel_scratch_;  // grows to the longest prefill step
};

// The most threads a CPU backend takes: 4 x the hardware threads (more only oversubscribes
// the cores, and spinning OpenMP barriers then crawl), and no more than the OpenBLAS library
// was built for (its MAX_THREADS, read from openblas_get_config(); the OpenMP build sizes
// per-thread buffers by it).
int max_cpu_threads();
// `requested` threads, or all cores (capped by max_cpu_threads()) for 0. Throws InputError
// saying both limits when `requested` is negative or above max_cpu_threads().
int resolve_cpu_threads(int requested);

}  // namespace strata
