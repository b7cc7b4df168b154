#include "kernels/profiling_backend.h"

#include <fmt/format.h>

#include <chrono>

#include "kernels/clock.h"

namespace strata {

// Counted only where fn did the work (a fused op the inner backend may decline; the
// caller's plain ops are counted instead).
template <typename Fn>
bool ProfilingBackend::timed_if(Op op, long calls, Fn&& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  if (!fn()) return false;
  inner_.synchronize();
  seconds_[op] += seconds_since(t0);
  calls_[op] += calls;
  return true;
}

template <typename Fn>
void ProfilingBackend::timed(Op op, Fn&& fn) {
  timed_if(op, 1, [&] {
    fn();
    return true;
  });
}

void ProfilingBackend::copy(void* dst, const void* src, size_t bytes, CopyKind kind) {
  timed(kCopy, [&] { inner_.copy(dst, src, bytes, kind); });
}
void ProfilingBackend::kv_store_q4(const float* k, const float* v, const StepRows& rows,
                                   const KvQ4LayerView& cache) {
  timed(kKvStore, [&] { inner_.kv_store_q4(k, v, rows, cache); });
}
void ProfilingBackend::kv_dequantize(const KvQ4LayerView& cache, const KvLayerView& out) {
  timed(kKvStore, [&] { inner_.kv_dequantize(cache, out); });
}
void ProfilingBackend::linear(const float* x, int64_t m, const Tensor& w, const float* bias,
                              float* y) {
  timed(kLinear, [&] { inner_.linear(x, m, w, bias, y); });
}
bool ProfilingBackend::linear_then(const float* x, int64_t m, const Tensor& w, const float* bias,
                                   LinearThen then, float* y) {
  return timed_if(kLinear, 1, [&] { return inner_.linear_then(x, m, w, bias, then, y); });
}
bool ProfilingBackend::linears(const float* x, int64_t m, std::span<const LinearOut> outs,
                               const LinearsFold& fold) {
  return timed_if(kLinear, static_cast<long>(outs.size()),
                  [&] { return inner_.linears(x, m, outs, fold); });
}
void ProfilingBackend::embedding(const int32_t* ids, int64_t n, const Tensor& table, float* y) {
  timed(kEmbedding, [&] { inner_.embedding(ids, n, table, y); });
}
void ProfilingBackend::rms_norm(const float* x, int64_t m, int64_t h, const float* weight,
                                float eps, float* y) {
  timed(kRmsNorm, [&] { inner_.rms_norm(x, m, h, weight, eps, y); });
}
void ProfilingBackend::layer_norm(const float* x, int64_t m, int64_t h, const float* weight,
                                  const float* bias, float eps, float* y) {
  timed(kLayerNorm, [&] { inner_.layer_norm(x, m, h, weight, bias, eps, y); });
}
void ProfilingBackend::rope(float* x, int64_t m, int32_t n_heads, int32_t head_dim,
                            const int32_t* positions, const RopeTables& tables) {
  timed(kRope, [&] { inner_.rope(x, m, n_heads, head_dim, positions, tables); });
}
void ProfilingBackend::silu_mul(const float* gate, const float* up, float* out, int64_t n) {
  timed(kSiluMul, [&] { inner_.silu_mul(gate, up, out, n); });
}
void ProfilingBackend::gelu_tanh_mul(const float* gate, const float* up, float* out, int64_t n) {
  timed(kGeluTanhMul, [&] { inner_.gelu_tanh_mul(gate, up, out, n); });
}
void ProfilingBackend::scale(float* x, int64_t n, float s) {
  timed(kScale, [&] { inner_.scale(x, n, s); });
}
void ProfilingBackend::softcap(float* x, int64_t n, float cap) {
  timed(kSoftcap, [&] { inner_.softcap(x, n, cap); });
}
void ProfilingBackend::relu(float* x, int64_t n) {
  timed(kRelu, [&] { inner_.relu(x, n); });
}
void ProfilingBackend::add(float* y, const float* x, int64_t n) {
  timed(kAdd, [&] { inner_.add(y, x, n); });
}
void ProfilingBackend::gather_rows(const float* x, int64_t width, const int32_t* rows, int64_t n,
                                   float* out) {
  timed(kExpertRows, [&] { inner_.gather_rows(x, width, rows, n, out); });
}
void ProfilingBackend::scatter_add_rows(const float* y, int64_t width, const int32_t* rows,
                                        const float* weights, int64_t n, float* out) {
  timed(kExpertRows, [&] { inner_.scatter_add_rows(y, width, rows, weights, n, out); });
}
void ProfilingBackend::softmax(float* x, int64_t m, int64_t n) {
  timed(kSoftmax, [&] { inner_.softmax(x, m, n); });
}
void ProfilingBackend::kv_store(const float* k, const float* v, const StepRows& rows,
                                const KvLayerView& cache) {
  timed(kKvStore, [&] { inner_.kv_store(k, v, rows, cache); });
}
void ProfilingBackend::attention(const float* q, const StepRows& rows, const KvLayerView& cache,
                                 const AttentionDims& dims, float* out) {
  timed(kAttention, [&] { inner_.attention(q, rows, cache, dims, out); });
}
void ProfilingBackend::attention_q4(const float* q, const StepRows& rows,
                                    const KvQ4LayerView& cache, const AttentionDims& dims,
                                    float* out) {
  timed(kAttention, [&] { inner_.attention_q4(q, rows, cache, dims, out); });
}
bool ProfilingBackend::store_and_attend(const float* q, const float* k, const float* v,
                                        const StepRows& rows, const KvLayerView& cache,
                                        const AttentionDims& dims, float* out) {
  return timed_if(kAttention, 1,
                  [&] { return inner_.store_and_attend(q, k, v, rows, cache, dims, out); });
}

std::string ProfilingBackend::json() const {
  static constexpr const char* kNames[kNumOps] = {
      "copy",     "linear",        "embedding", "rms_norm",   "layer_norm", "rope",
      "silu_mul", "gelu_tanh_mul", "scale",     "softcap",    "relu",       "add",
      "softmax",  "kv_store",      "attention", "expert_rows"};
  std::string s = "{";
  for (int i = 0; i < kNumOps; ++i) {
    if (calls_[static_cast<size_t>(i)] == 0) continue;
    if (s.size() > 1) s += ", ";
    s += fmt::format(R"("{}": {{"calls": {}, "seconds": {:.6f}}})", kNames[i],
                     calls_[static_cast<size_t>(i)], seconds_[static_cast<size_t>(i)]);
  }
  return s + "}";
}

}  // namespace strata
