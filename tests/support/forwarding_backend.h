// Test support: a backend that hands every call to a CPU backend, for tests that change one
// operation (e.g. what kv_store writes) and keep the rest as the engine computes it.
#pragma once

#include <span>
#include <string>

#include "kernels/cpu_backend.h"

namespace strata::testing {

class ForwardingBackend : public Backend {
 public:
  explicit ForwardingBackend(CpuBackend& inner) : inner_(inner) {}
  Device device() const override { return Device::kHost; }
  void* allocate(size_t bytes) override { return inner_.allocate(bytes); }
  void deallocate(void* p) override { inner_.deallocate(p); }
  void copy(void* d, const void* s, size_t b, CopyKind k) override { inner_.copy(d, s, b, k); }
  void synchronize() override {}
  void linear(const float* x, int64_t m, const Tensor& w, const float* b, float* y) override {
    inner_.linear(x, m, w, b, y);
  }
  void embedding(const int32_t* ids, int64_t n, const Tensor& t, float* y) override {
    inner_.embedding(ids, n, t, y);
  }
  void rms_norm(const float* x, int64_t m, int64_t h, const float* w, float eps,
                float* y) override {
    inner_.rms_norm(x, m, h, w, eps, y);
  }
  void layer_norm(const float* x, int64_t m, int64_t h, const float* w, const float* b, float eps,
                  float* y) override {
    inner_.layer_norm(x, m, h, w, b, eps, y);
  }
  void rope(float* x, int64_t m, int32_t nh, int32_t hd, const int32_t* pos,
            const RopeTables& t) override {
    inner_.rope(x, m, nh, hd, pos, t);
  }
  void silu_mul(const float* g, const float* u, float* o, int64_t n) override {
    inner_.silu_mul(g, u, o, n);
  }
  void gelu_tanh_mul(const float* g, const float* u, float* o, int64_t n) override {
    inner_.gelu_tanh_mul(g, u, o, n);
  }
  void scale(float* x, int64_t n, float s) override { inner_.scale(x, n, s); }
  void softcap(float* x, int64_t n, float cap) override { inner_.softcap(x, n, cap); }
  void relu(float* x, int64_t n) override { inner_.relu(x, n); }
  void add(float* y, const float* x, int64_t n) override { inner_.add(y, x, n); }
  void gather_rows(const float* x, int64_t w, const int32_t* r, int64_t n, float* o) override {
    inner_.gather_rows(x, w, r, n, o);
  }
  void scatter_add_rows(const float* y, int64_t w, const int32_t* r, const float* g, int64_t n,
                        float* o) override {
    inner_.scatter_add_rows(y, w, r, g, n, o);
  }
  void softmax(float* x, int64_t m, int64_t n) override { inner_.softmax(x, m, n); }
  void attention(const float* q, const StepRows& rows, const KvLayerView& c, const AttentionDims& d,
                 float* out) override {
    inner_.attention(q, rows, c, d, out);
  }
  void kv_store(const float* k, const float* v, const StepRows& rows,
                const KvLayerView& c) override {
    inner_.kv_store(k, v, rows, c);
  }

 protected:
  CpuBackend& inner_;
};

}  // namespace strata::testing
