#include "kernels/backend.h"

#include <utility>

namespace strata {

DeviceBuffer::DeviceBuffer(Backend& backend, size_t bytes)
    : backend_(&backend), ptr_(bytes ? backend.allocate(bytes) : nullptr), bytes_(bytes) {}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept
    : backend_(std::exchange(o.backend_, nullptr)),
      ptr_(std::exchange(o.ptr_, nullptr)),
      bytes_(std::exchange(o.bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_ != nullptr) backend_->deallocate(ptr_);
    backend_ = std::exchange(o.backend_, nullptr);
    ptr_ = std::exchange(o.ptr_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != nullptr) backend_->deallocate(ptr_);
}

}  // namespace strata
