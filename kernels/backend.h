// The backend seam: a short table of operations the layer code is written against once.
// The CPU backend is the reference and is always built; the CUDA backend (kernels/cuda/)
// implements the same calls on device memory. Kernels take raw pointers into the backend's
// own memory plus plain dimension structs; they know nothing of models or engines.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "kernels/tensor.h"

namespace strata {

// One sequence inside a ragged batch: its new tokens are rows
// [row_begin, row_begin + n_new) of the activation matrix, at positions
// n_past .. n_past + n_new - 1. Sequences of different lengths share one matrix with no
// padding; attention runs per sequence over exactly its own cache.
struct SeqSlice {
  int32_t row_begin = 0;
  int32_t n_new = 0;
  int32_t n_past = 0;
  int32_t slot = 0;  // KV cache slot that holds this sequence
};

// One layer's KV cache, laid out [slot][kv_head][capacity][head_dim] for K and for V so a
// head's keys are contiguous for the attention dot products.
struct KvLayerView {
  float* k = nullptr;
  float* v = nullptr;
  int32_t n_slots = 0;
  int32_t capacity = 0;  // positions per slot
  int32_t n_kv_heads = 0;
  int32_t head_dim = 0;

  size_t slot_stride() const { return static_cast<size_t>(n_kv_heads) * capacity * head_dim; }
  size_t head_stride() const { return static_cast<size_t>(capacity) * head_dim; }
};

// One layer's KV cache stored 4-bit (FlexGen §5, groups along the hidden dimension): each
// cached row (head_dim values: one position of one kv head, in KvLayerView's order) is
// head_dim / group groups with an f32 min and scale each. One blob per K and per V:
// codes [rows * head_dim / 2] bytes, then mins, then scales [rows * head_dim / group] f32.
struct KvQ4LayerView {
  void* k = nullptr;
  void* v = nullptr;
  int32_t n_slots = 0;
  int32_t capacity = 0;
  int32_t n_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t group = 0;

  size_t rows() const { return static_cast<size_t>(n_slots) * n_kv_heads * capacity; }
  size_t groups() const { return rows() * static_cast<size_t>(head_dim / group); }
  size_t tensor_bytes() const {
    return rows() * static_cast<size_t>(head_dim) / 2 + 2 * sizeof(float) * groups();
  }
  static int32_t group_for(int32_t head_dim) { return head_dim < 64 ? head_dim : 64; }
};

struct AttentionDims {
  int32_t n_heads = 0;
  int32_t n_kv_heads =
      0;  // grouped-query attention: query head h reads kv head h / (n_heads / n_kv_heads)
  int32_t head_dim = 0;
  float scale = 1.0f;  // usually 1 / sqrt(head_dim)
};

// Rotary embedding tables, [max_positions, head_dim / 2] each, on the backend's device.
struct RopeTables {
  const float* cos = nullptr;
  const float* sin = nullptr;
  int32_t max_positions = 0;
  int32_t half_dim = 0;
};

enum class CopyKind { kHostToDevice, kDeviceToHost, kDeviceToDevice };

// Names one transfer() so compute or the host can wait for it; id 0 is "nothing to wait for".
struct TransferTicket {
  uint64_t id = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual Device device() const = 0;

  // Memory on the backend's device (host memory for the CPU backend).
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* p) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes, CopyKind kind) = 0;
  virtual void synchronize() = 0;
  // Called on a thread before its first call into this backend (a pipeline stage's compute
  // thread): the CPU backend gives it its thread count, the CUDA backend its device.
  virtual void bind_thread() {}

  // Copies that overlap compute (FlexGen Algorithm 1's loads of the next layer). A transfer
  // runs after all compute enqueued before it (so it may overwrite memory that compute
  // read) and beside compute enqueued after it. Compute that reads `dst` must first call
  // compute_waits(); the host must call host_waits() before it reuses `src`. The defaults
  // copy at once, which is what a host backend needs.
  virtual TransferTicket transfer(void* dst, const void* src, size_t bytes, CopyKind kind);
  virtual void compute_waits(TransferTicket ticket);
  virtual void host_waits(TransferTicket ticket);
  // Host memory that transfer() can copy from without a bounce (page-locked on CUDA).
  virtual void* allocate_host(size_t bytes);
  virtual void deallocate_host(void* p);

  // y[m, n] = x[m, k] * w[n, k]^T (+ bias[n]). w is f32, f16 or bf16; x, y, bias f32.
  virtual void linear(const float* x, int64_t m, const Tensor& w, const float* bias, float* y) = 0;
  // y[i, :] = table[ids[i], :] (table [vocab, hidden], any float dtype).
  virtual void embedding(const int32_t* ids, int64_t n, const Tensor& table, float* y) = 0;
  virtual void rms_norm(const float* x, int64_t m, int64_t h, const float* weight, float eps,
                        float* y) = 0;
  virtual void layer_norm(const float* x, int64_t m, int64_t h, const float* weight,
                          const float* bias, float eps, float* y) = 0;
  // In place on x[m, n_heads * head_dim]; rotate-half convention (pairs j, j + head_dim/2).
  virtual void rope(float* x, int64_t m, int32_t n_heads, int32_t head_dim,
                    const int32_t* positions, const RopeTables& tables) = 0;
  virtual void silu_mul(const float* gate, const float* up, float* out, int64_t n) = 0;
  virtual void relu(float* x, int64_t n) = 0;
  virtual void add(float* y, const float* x, int64_t n) = 0;  // y += x
  // Row-wise softmax of x[m, n] in place.
  virtual void softmax(float* x, int64_t m, int64_t n) = 0;
  // Writes the new keys/values (rows of k, v: [rows, n_kv_heads * head_dim]) into the cache.
  virtual void kv_store(const float* k, const float* v, std::span<const SeqSlice> seqs,
                        const KvLayerView& cache) = 0;
  // The same into a 4-bit cache: each new row is quantised as it is stored.
  virtual void kv_store_q4(const float* k, const float* v, std::span<const SeqSlice> seqs,
                           const KvQ4LayerView& cache);
  // Every row of a 4-bit cache dequantised into `out` (same shape), just before attention.
  virtual void kv_dequantize(const KvQ4LayerView& cache, const KvLayerView& out);
  // Causal attention of q[rows, n_heads * head_dim] over each sequence's cache
  // (positions 0 .. n_past + i for its i-th new row) into out[rows, n_heads * head_dim].
  virtual void attention(const float* q, std::span<const SeqSlice> seqs, const KvLayerView& cache,
                         const AttentionDims& dims, float* out) = 0;
};

// Device memory owned by a backend, freed through it (RAII for backend allocations).
// host() makes one of the backend's transfer-ready host buffers instead.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Backend& backend, size_t bytes);
  static DeviceBuffer host(Backend& backend, size_t bytes);
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();

  void* data() const { return ptr_; }
  float* f32() const { return static_cast<float*>(ptr_); }
  size_t size() const { return bytes_; }

 private:
  void release();

  Backend* backend_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  bool host_ = false;
};

}  // namespace strata
