// Tensors: a non-owning view (dtype, shape, pointer, device) and an owning aligned host
// buffer. Views are what kernels and layers pass around; ownership stays with whoever
// allocated (a backend, a weight loader, a KV cache).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>

#include "kernels/dtype.h"

namespace strata {

enum class Device : uint8_t { kHost = 0, kCuda = 1 };

constexpr int kMaxDims = 4;

struct Shape {
  std::array<int64_t, kMaxDims> dims{};
  int rank = 0;

  Shape() = default;
  Shape(std::initializer_list<int64_t> d);
  int64_t operator[](int i) const { return dims[static_cast<size_t>(i)]; }
  int64_t numel() const;
  bool operator==(const Shape& o) const;
  std::string str() const;  // "[4, 64]"
};

struct Tensor {
  void* data = nullptr;
  DType dtype = DType::kF32;
  Shape shape;
  Device device = Device::kHost;

  size_t bytes() const;  // kQ4: codes + mins + scales (quant.h)
  template <typename T>
  T* as() const {
    return static_cast<T*>(data);
  }
  float* f32() const;            // checks dtype
  std::string describe() const;  // "f32[4, 64]@host"
};

constexpr size_t kHugePageBytes = size_t{2} << 20;

// 64-byte aligned, zero-initialised host memory. From kHugePageBytes on it is mapped on its
// own, starting on a 2 MiB boundary and advised onto transparent huge pages: a decode step
// streams its weights from such buffers, faster than from 4 KiB pages (measured while the
// panel GEMM was built; docs/journal/benchmarks-history.md, "Panel GEMM, huge pages").
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(size_t bytes);
  void* data() const { return ptr_.get(); }
  size_t size() const { return size_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_.get());
  }

 private:
  struct Free {
    size_t mapped;  // bytes of an own mapping (munmap), else 0 (free); value-initialised
    void operator()(void* p) const;
  };
  std::unique_ptr<void, Free> ptr_;
  size_t size_ = 0;
};

// A host tensor together with its storage.
struct OwnedTensor {
  Buffer storage;
  Tensor view;

  OwnedTensor() = default;
  OwnedTensor(DType dtype, Shape shape);
};

}  // namespace strata
