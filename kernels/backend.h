// The backend seam: a short table of operations the layer code is written against once.
// The CPU backend is the reference and is always built; the CUDA backend (kernels/cuda/)
// implements the same calls on device memory. Kernels take raw pointers into the backend's
// own memory plus plain dimension structs; they know nothing of models or engines.
#pragma once

#include <concepts>
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
// head's keys are contiguous for the attention dot products. Elements are f32, or f16 (half
// the bytes attention reads, as FlexGen and llama.cpp keep their caches); strides count
// elements.
struct KvLayerView {
  void* k = nullptr;
  void* v = nullptr;
  int32_t n_slots = 0;
  int32_t capacity = 0;  // positions per slot
  int32_t n_kv_heads = 0;
  int32_t head_dim = 0;
  DType dtype = DType::kF32;  // kF32 or kF16

  size_t slot_stride() const { return static_cast<size_t>(n_kv_heads) * capacity * head_dim; }
  size_t head_stride() const { return static_cast<size_t>(capacity) * head_dim; }
  size_t elem_bytes() const { return dtype_size(dtype); }
  size_t tensor_bytes() const {
    return slot_stride() * static_cast<size_t>(n_slots) * elem_bytes();
  }
  // The f32 cache's arrays (checks that it is one: what f32-only kernels read).
  float* k_f32() const;
  float* v_f32() const;
};

// One layer's KV cache stored 4-bit (FlexGen §5, groups along the hidden dimension): each
// cached row (head_dim values: one position of one kv head, in KvLayerView's order) is
// head_dim / group groups with an f32 min and scale each. One blob per K and per V:
// codes [rows * head_dim / 2] bytes padded to a multiple of 4 (codes_bytes()), then mins,
// then scales [rows * head_dim / group] f32. The padding keeps the mins f32-aligned where
// head_dim is not a multiple of 8 (head_dim 12 over 5 rows: 30 bytes of codes, mins at 32).
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
  size_t codes_bytes() const {
    return (rows() * static_cast<size_t>(head_dim) / 2 + 3) & ~size_t{3};
  }
  size_t tensor_bytes() const { return codes_bytes() + 2 * sizeof(float) * groups(); }
  // Groups of 64 along head_dim where it is a multiple of 64, else the largest even divisor
  // of head_dim below 64 (40 for 80, 48 for 96), so every row is whole groups.
  static int32_t group_for(int32_t head_dim) {
    for (int32_t g = head_dim < 64 ? head_dim : 64; g >= 2; --g)
      if (head_dim % g == 0 && g % 2 == 0) return g;
    return head_dim;
  }
};

struct AttentionDims {
  int32_t n_heads = 0;
  int32_t n_kv_heads =
      0;  // grouped-query attention: query head h reads kv head h / (n_heads / n_kv_heads)
  int32_t head_dim = 0;
  float scale = 1.0f;  // usually 1 / sqrt(head_dim)
  // A query at position i sees keys i - window < j <= i (Mistral's, Gemma-2's local layers);
  // 0: every key up to i. Scores are soft-capped (cap * tanh(s / cap), Gemma-2) when
  // softcap > 0, after the scale and before the mask.
  int32_t window = 0;
  float softcap = 0.0f;
};

// Rotary embedding tables, [max_positions, head_dim / 2] each, on the backend's device.
struct RopeTables {
  const float* cos = nullptr;
  const float* sin = nullptr;
  int32_t max_positions = 0;
  int32_t half_dim = 0;
};

// The kernels' entry per new row of a ragged batch: its activation row, KV slot and
// position. Built from the slices once per step (fill_row_table) and read by kv_store and
// attention of every layer, so no layer rebuilds or uploads it.
struct RowEntry {
  int32_t row = 0;
  int32_t slot = 0;
  int32_t pos = 0;
};

// A cache whose every layer attends over a sliding window of W positions (Mistral's) keeps
// only what a query can still see: a slot of rows = W - 1 + C + S rows (C: the most rows
// one sequence adds in a step; S = ceil(W / 8), the slack) holds positions
// [first_held(p), p) at rows 0 .. p - first_held(p). When a step's new rows would run past
// the slot's last row, the positions still needed slide down to row 0 first (KvSlide), at
// most once every S positions. first_held depends on the positions alone, so every stage
// and both ends of a KV hand-over agree on it without exchanging it.
struct KvWindow {
  int32_t window = 0;  // W; 0: the slot holds every position (rows = the context)
  int32_t rows = 0;    // per slot
  int32_t slack = 0;   // S

  // The window for `window` (0: none) over a context of `positions`, with steps of at most
  // `max_step_rows` rows a sequence; none where the window would hold the whole context.
  static KvWindow of(int32_t window, int32_t positions, int32_t max_step_rows);
  bool active() const { return window > 0; }
  // The first position a slot holds once the sequence has `positions` positions.
  int32_t first_held(int32_t positions) const;
  std::string str() const;
};

// Before a step's rows are stored: rows [from, from + rows) of `slot` move down to row 0
// (the positions a sliding window still needs, KvWindow).
struct KvSlide {
  int32_t slot = 0;
  int32_t from = 0;
  int32_t rows = 0;
};

// A ragged batch as kv_store and attention take it: the slices (host memory, what the CPU
// kernels read) and, where the caller built one, the row table in the backend's memory
// (`n_rows` entries, already checked against the cache). An accelerator given no table
// builds and uploads one for the call.
struct StepRows {
  std::span<const SeqSlice> seqs;
  const RowEntry* table = nullptr;
  int64_t n_rows = 0;
  // A sliding-window cache: the slices' positions are rows of the held window, and these
  // slides run before the rows are stored (the caller's, worker/kv_attention.h; the
  // kernels read only the slices and the table).
  std::span<const KvSlide> slides;

  StepRows() = default;
  // From the slices alone (a span, or a vector of them): no table.
  template <class Slices>
  requires std::convertible_to<const Slices&, std::span<const SeqSlice>> StepRows(const Slices& s)
      : seqs(s) {}  // NOLINT(google-explicit-constructor)
};

// Checks every slice against a cache of n_slots x capacity positions (Error naming the
// slice) and writes one entry per new row into out[0, max_rows). Returns the rows written.
int64_t fill_row_table(std::span<const SeqSlice> seqs, int32_t n_slots, int32_t capacity,
                       RowEntry* out, int64_t max_rows);

// The largest calls a model makes, known when it is built: a backend reserves its kernels'
// scratch for them once (Backend::reserve), so no op allocates on the token path.
struct KernelBounds {
  int64_t max_rows = 0;         // rows of x in any linear
  int64_t max_in_features = 0;  // k of any linear
  // Elements of the largest 4-bit layer matrix, and at least one row of any other 4-bit
  // matrix (0: none). An accelerator dequantises a larger one (a compressed head: 50k rows)
  // in blocks of rows that fit, so the head costs no scratch of its own.
  int64_t max_q4_elems = 0;
  bool half_weights = false;  // some matrix is stored f16, bf16 or 4-bit
  int64_t max_positions = 0;  // positions one sequence attends over (the KV capacity)

  // Counts a linear's weight [rows, cols] stored as `dtype`; `in_layer`: one of a layer's
  // matrices (else the head or a projection, which count one row when 4-bit).
  void add_weight(int64_t rows, int64_t cols, DType dtype, bool in_layer);
};

// The scratch an accelerator backend (kernels/cuda) reserves for `b`: x rounded to f16 for
// half-precision and 4-bit linears, and the largest 4-bit matrix dequantised to f16.
// placement/ counts it on the device; the CUDA backend allocates exactly this.
int64_t accelerator_scratch_bytes(const KernelBounds& b);

// The op linear_then folds into a linear's output.
enum class LinearThen { kRelu, kAccumulate };

// One of several linears over the same x (Backend::linears): y = x w^T + bias.
struct LinearOut {
  const Tensor* w = nullptr;
  const float* bias = nullptr;  // or none
  float* y = nullptr;
};

// A pre-norm layer's norm over rows of width h: layer norm (weight and bias) or RMS norm
// (weight only), y = (x - mean) / sqrt(var + eps) * weight + bias or x / sqrt(mean(x^2) +
// eps) * weight.
struct NormSpec {
  bool layer = true;
  const float* weight = nullptr;
  const float* bias = nullptr;
  float eps = 0.0f;
};

// What Backend::linears folds into its one pass besides the products.
struct LinearsFold {
  const NormSpec* norm = nullptr;  // the linears read norm(x), which is never written
  bool relu = false;               // every y = relu(x w^T + bias) (OPT's fc1)
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
  // [p + offset, p + offset + bytes) of allocate()'s memory holds nothing needed any more:
  // a backend whose large allocations are committed page by page as they are written (the
  // CPU backend) gives the pages wholly inside it back, and they read as zeros again.
  // Elsewhere (device memory) nothing happens.
  virtual void discard(void* p, size_t offset, size_t bytes) { (void)p, (void)offset, (void)bytes; }
  virtual void copy(void* dst, const void* src, size_t bytes, CopyKind kind) = 0;
  virtual void synchronize() = 0;
  // Called on a thread before its first call into this backend (a pipeline stage's compute
  // thread): the CPU backend gives it its thread count, the CUDA backend its device.
  virtual void bind_thread() {}
  // Reserves the kernels' scratch for calls within `bounds` (grow-only; a later call with
  // larger bounds grows it). reserved_bytes(): what that scratch holds now.
  virtual void reserve(const KernelBounds& bounds) { (void)bounds; }
  virtual size_t reserved_bytes() const { return 0; }

  // Copies that overlap compute (FlexGen Algorithm 1's loads of the next layer). A transfer
  // runs after all compute enqueued before it (so it may overwrite memory that compute
  // read) and beside compute enqueued after it. Compute that reads `dst` must first call
  // compute_waits(); the host must call host_waits() before it reuses `src`. The defaults
  // copy at once, which is what a host backend needs.
  virtual TransferTicket transfer(void* dst, const void* src, size_t bytes, CopyKind kind);
  virtual void compute_waits(TransferTicket ticket);
  virtual void host_waits(TransferTicket ticket);
  // Whether the transfer has completed (its src may be reused; compute enqueued from now
  // on sees dst), without blocking. The default knows only id 0, "nothing to wait for",
  // which its transfer() returns: a backend whose transfers run asynchronously says when
  // they are done, and otherwise callers learn it by waiting (host_waits).
  virtual bool transfer_done(TransferTicket ticket) { return ticket.id == 0; }
  // Host memory that transfer() can copy from without a bounce (page-locked on CUDA).
  virtual void* allocate_host(size_t bytes);
  virtual void deallocate_host(void* p);

  // y[m, n] = x[m, k] * w[n, k]^T (+ bias[n]). w is f32, f16 or bf16; x, y, bias f32.
  virtual void linear(const float* x, int64_t m, const Tensor& w, const float* bias, float* y) = 0;
  // y = relu(x w^T + bias), or y += x w^T + bias, in one pass where this backend has such a
  // kernel for these shapes (decode on an accelerator, where the op after a linear would
  // cost a launch of its own). Returns false, having done nothing, otherwise: the caller
  // then runs linear and relu / add.
  virtual bool linear_then(const float* x, int64_t m, const Tensor& w, const float* bias,
                           LinearThen then, float* y) {
    (void)x, (void)m, (void)w, (void)bias, (void)then, (void)y;
    return false;
  }
  // Every out.y = x out.w^T + out.bias, with `fold` applied (the norm before, the ReLU after),
  // in one pass where this backend has such a kernel for these weights (decode on an
  // accelerator: q, k and v, or gate and up, in one launch and one kernel tail, the layer's
  // norm in it too). Returns false, having done nothing, otherwise: the caller then runs the
  // norm and each linear.
  virtual bool linears(const float* x, int64_t m, std::span<const LinearOut> outs,
                       const LinearsFold& fold) {
    (void)x, (void)m, (void)outs, (void)fold;
    return false;
  }
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
  // GeGLU's gelu(gate) * up, gelu with the tanh approximation (Gemma-2's gelu_pytorch_tanh).
  virtual void gelu_tanh_mul(const float* gate, const float* up, float* out, int64_t n) = 0;
  virtual void scale(float* x, int64_t n, float s) = 0;  // x *= s
  // Soft-capping in place: x = cap * tanh(x / cap) (Gemma-2's logits).
  virtual void softcap(float* x, int64_t n, float cap) = 0;
  virtual void relu(float* x, int64_t n) = 0;
  virtual void add(float* y, const float* x, int64_t n) = 0;  // y += x
  // Mixture of experts (worker/transformer.cpp): out[i, :] = x[rows[i], :] for i < n, an
  // expert's rows gathered so it multiplies them as one GEMM; and out[rows[i], :] +=
  // weights[i] * y[i, :], its output added back to each row with the router's weight. rows and
  // weights lie in the backend's memory; within one call the rows are distinct.
  virtual void gather_rows(const float* x, int64_t width, const int32_t* rows, int64_t n,
                           float* out) = 0;
  virtual void scatter_add_rows(const float* y, int64_t width, const int32_t* rows,
                                const float* weights, int64_t n, float* out) = 0;
  // Row-wise softmax of x[m, n] in place.
  virtual void softmax(float* x, int64_t m, int64_t n) = 0;
  // Writes the new keys/values (rows of k, v: [rows, n_kv_heads * head_dim]) into the cache.
  virtual void kv_store(const float* k, const float* v, const StepRows& rows,
                        const KvLayerView& cache) = 0;
  // The same into a 4-bit cache: each new row is quantised as it is stored.
  virtual void kv_store_q4(const float* k, const float* v, const StepRows& rows,
                           const KvQ4LayerView& cache);
  // Every row of a 4-bit cache dequantised into `out` (same shape): the whole cache as f32,
  // for a caller that wants it so (attention reads the 4-bit rows itself, attention_q4).
  virtual void kv_dequantize(const KvQ4LayerView& cache, const KvLayerView& out);
  // Causal attention of q[rows, n_heads * head_dim] over each sequence's cache
  // (positions 0 .. n_past + i for its i-th new row) into out[rows, n_heads * head_dim].
  virtual void attention(const float* q, const StepRows& rows, const KvLayerView& cache,
                         const AttentionDims& dims, float* out) = 0;
  // The same over a 4-bit cache, reading only the positions each row attends over and
  // dequantising them as it goes (no f32 copy of the layer).
  virtual void attention_q4(const float* q, const StepRows& rows, const KvQ4LayerView& cache,
                            const AttentionDims& dims, float* out);
  // kv_store then attention in one pass where this backend has such a kernel (decode on an
  // accelerator, every sequence one new row: the step's attention costs one launch instead
  // of three). Returns false, having done nothing, otherwise: the caller then runs both.
  virtual bool store_and_attend(const float* q, const float* k, const float* v,
                                const StepRows& rows, const KvLayerView& cache,
                                const AttentionDims& dims, float* out) {
    (void)q, (void)k, (void)v, (void)rows, (void)cache, (void)dims, (void)out;
    return false;
  }
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
