#include "kernels/backend.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "kernels/error.h"

namespace strata {

TransferTicket Backend::transfer(void* dst, const void* src, size_t bytes, CopyKind kind) {
  copy(dst, src, bytes, kind);
  return {};
}

void Backend::compute_waits(TransferTicket) {}

int64_t fill_row_table(std::span<const SeqSlice> seqs, int32_t n_slots, int32_t capacity,
                       RowEntry* out, int64_t max_rows) {
  int64_t n = 0;
  for (const SeqSlice& s : seqs) {
    STRATA_CHECK(s.slot >= 0 && s.slot < n_slots, "kv slot {} of {}", s.slot, n_slots);
    STRATA_CHECK(s.n_new >= 0 && s.n_past >= 0 && s.row_begin >= 0,
                 "bad sequence slice: rows {}+{} past {}", s.row_begin, s.n_new, s.n_past);
    STRATA_CHECK(s.n_past + s.n_new <= capacity, "kv cache overflow: {} + {} > capacity {}",
                 s.n_past, s.n_new, capacity);
    STRATA_CHECK(n + s.n_new <= max_rows, "row table of {} rows overflows at slot {}", max_rows,
                 s.slot);
    for (int32_t t = 0; t < s.n_new; ++t)
      out[n++] = RowEntry{s.row_begin + t, s.slot, s.n_past + t};
  }
  return n;
}

KvWindow KvWindow::of(int32_t window, int32_t positions, int32_t max_step_rows) {
  STRATA_CHECK(window >= 0 && positions > 0 && max_step_rows > 0,
               "KV window {} over {} positions, steps of {} rows", window, positions,
               max_step_rows);
  if (window == 0) return {};
  const int32_t slack = (window + 7) / 8;
  const int64_t rows = int64_t{window} - 1 + max_step_rows + slack;
  if (rows >= positions) return {};
  return {window, static_cast<int32_t>(rows), slack};
}

int32_t KvWindow::first_held(int32_t positions) const {
  if (!active() || positions <= rows) return 0;
  return (positions - rows + slack - 1) / slack * slack;
}

std::string KvWindow::str() const {
  return active()
             ? fmt::format("KvWindow(window {}, {} rows a slot, slack {})", window, rows, slack)
             : "KvWindow(none)";
}

void KernelBounds::add_weight(int64_t rows, int64_t cols, DType dtype, bool in_layer) {
  max_in_features = std::max(max_in_features, cols);
  half_weights = half_weights || (dtype != DType::kF32 && dtype != DType::kF32Panel);
  if (dtype == DType::kQ4) max_q4_elems = std::max(max_q4_elems, in_layer ? rows * cols : cols);
}

int64_t accelerator_scratch_bytes(const KernelBounds& b) {
  int64_t bytes = 0;
  if (b.half_weights) bytes += b.max_rows * b.max_in_features * 2;  // x in f16 / bf16
  bytes += b.max_q4_elems * 2;                                      // a 4-bit matrix in f16
  return bytes;
}

float* KvLayerView::k_f32() const {
  STRATA_CHECK(dtype == DType::kF32, "KV cache view: {} elements where f32 is read",
               dtype_name(dtype));
  return static_cast<float*>(k);
}

float* KvLayerView::v_f32() const {
  STRATA_CHECK(dtype == DType::kF32, "KV cache view: {} elements where f32 is read",
               dtype_name(dtype));
  return static_cast<float*>(v);
}

void Backend::kv_store_q4(const float*, const float*, const StepRows&, const KvQ4LayerView&) {
  fail(ErrorKind::kUnimplemented, "{}: no 4-bit KV cache", name());
}

void Backend::kv_dequantize(const KvQ4LayerView&, const KvLayerView&) {
  fail(ErrorKind::kUnimplemented, "{}: no 4-bit KV cache", name());
}

void Backend::attention_q4(const float*, const StepRows&, const KvQ4LayerView&,
                           const AttentionDims&, float*) {
  fail(ErrorKind::kUnimplemented, "{}: no 4-bit KV cache", name());
}
void Backend::host_waits(TransferTicket) {}

void* Backend::allocate_host(size_t bytes) {
  // Page alignment so O_DIRECT reads can land in it too.
  const size_t rounded = (std::max<size_t>(bytes, 1) + 4095) / 4096 * 4096;
  void* p = std::aligned_alloc(4096, rounded);
  if (p == nullptr) fail(ErrorKind::kOverloaded, "out of host memory allocating {} bytes", bytes);
  std::memset(p, 0, rounded);
  return p;
}

void Backend::deallocate_host(void* p) {
  std::free(p);
}

DeviceBuffer::DeviceBuffer(Backend& backend, size_t bytes)
    : backend_(&backend), ptr_(bytes ? backend.allocate(bytes) : nullptr), bytes_(bytes) {}

DeviceBuffer DeviceBuffer::host(Backend& backend, size_t bytes) {
  DeviceBuffer b;
  b.backend_ = &backend;
  b.ptr_ = bytes ? backend.allocate_host(bytes) : nullptr;
  b.bytes_ = bytes;
  b.host_ = true;
  return b;
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept
    : backend_(std::exchange(o.backend_, nullptr)),
      ptr_(std::exchange(o.ptr_, nullptr)),
      bytes_(std::exchange(o.bytes_, 0)),
      host_(std::exchange(o.host_, false)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    release();
    backend_ = std::exchange(o.backend_, nullptr);
    ptr_ = std::exchange(o.ptr_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    host_ = std::exchange(o.host_, false);
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() {
  release();
}

void DeviceBuffer::release() {
  if (ptr_ == nullptr) return;
  if (host_) {
    backend_->deallocate_host(ptr_);
  } else {
    backend_->deallocate(ptr_);
  }
  ptr_ = nullptr;
}

}  // namespace strata
