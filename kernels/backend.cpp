#include "kernels/backend.h"

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

void Backend::kv_store_q4(const float*, const float*, std::span<const SeqSlice>,
                          const KvQ4LayerView&) {
  fail(ErrorKind::kUnimplemented, "{}: no 4-bit KV cache", name());
}

void Backend::kv_dequantize(const KvQ4LayerView&, const KvLayerView&) {
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
