// A decorator that times every operation of another backend (synchronising after each, so
// the numbers are per-op wall time). Used by `strata bench --profile` to show where a step
// goes; it is never on the default path.
#pragma once

#include <array>
#include <string>

#include "kernels/backend.h"

namespace strata {

class ProfilingBackend final : public Backend {
 public:
  explicit ProfilingBackend(Backend& inner) : inner_(inner) {}

  std::string name() const override { return inner_.name() + " (profiled)"; }
  Device device() const override { return inner_.device(); }
  void* allocate(size_t bytes) override { return inner_.allocate(bytes); }
  void deallocate(void* p) override { inner_.deallocate(p); }
  void discard(void* p, size_t offset, size_t bytes) override { inner_.discard(p, offset, bytes); }
  void copy(void* dst, const void* src, size_t bytes, CopyKind kind) override;
  void synchronize() override { inner_.synchronize(); }
  void bind_thread() override { inner_.bind_thread(); }
  void reserve(const KernelBounds& bounds) override { inner_.reserve(bounds); }
  size_t reserved_bytes() const override { return inner_.reserved_bytes(); }
  // Transfers are what the profile must not serialise: passed through untimed.
  TransferTicket transfer(void* dst, const void* src, size_t bytes, CopyKind kind) override {
    return inner_.transfer(dst, src, bytes, kind);
  }
  void compute_waits(TransferTicket t) override { inner_.compute_waits(t); }
  void host_waits(TransferTicket t) override { inner_.host_waits(t); }
  bool transfer_done(TransferTicket t) override { return inner_.transfer_done(t); }
  void* allocate_host(size_t bytes) override { return inner_.allocate_host(bytes); }
  void kv_store_q4(const float* k, const float* v, const StepRows& rows,
                   const KvQ4LayerView& cache) override;
  void kv_dequantize(const KvQ4LayerView& cache, const KvLayerView& out) override;
  void deallocate_host(void* p) override { inner_.deallocate_host(p); }
  void linear(const float* x, int64_t m, const Tensor& w, const float* bias, float* y) override;
  bool linear_then(const float* x, int64_t m, const Tensor& w, const float* bias, LinearThen then,
                   float* y) override;
  bool linears(const float* x, int64_t m, std::span<const LinearOut> outs,
               const LinearsFold& fold) override;
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
  void attention(const float* q, const StepRows& rows, const KvLayerView& cache,
                 const AttentionDims& dims, float* out) override;
  void attention_q4(const float* q, const StepRows& rows, const KvQ4LayerView& cache,
                    const AttentionDims& dims, float* out) override;
  // Counted as attention (the store it takes in is no kv_store call).
  bool store_and_attend(const float* q, const float* k, const float* v, const StepRows& rows,
                        const KvLayerView& cache, const AttentionDims& dims, float* out) override;

  // {"linear": {"calls": n, "seconds": s}, ...}
  std::string json() const;

 private:
  enum Op {
    kCopy,
    kLinear,
    kEmbedding,
    kRmsNorm,
    kLayerNorm,
    kRope,
    kSiluMul,
    kGeluTanhMul,
    kScale,
    kSoftcap,
    kRelu,
    kAdd,
    kSoftmax,
    kKvStore,
    kAttention,
    kExpertRows,
    kNumOps
  };
  template <typename Fn>
  void timed(Op op, Fn&& fn);
  template <typename Fn>
  bool timed_if(Op op, long calls, Fn&& fn);

  Backend& inner_;
  std::array<double, kNumOps> seconds_{};
  std::array<long, kNumOps> calls_{};
};

}  // namespace strata
