#include "kernels/tensor.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "kernels/error.h"

namespace strata {

Shape::Shape(std::initializer_list<int64_t> d) {
  STRATA_CHECK(d.size() <= kMaxDims, "rank {} > {}", d.size(), kMaxDims);
  for (int64_t v : d) dims[static_cast<size_t>(rank++)] = v;
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < rank; ++i) n *= dims[static_cast<size_t>(i)];
  return n;
}

bool Shape::operator==(const Shape& o) const {
  if (rank != o.rank) return false;
  for (int i = 0; i < rank; ++i)
    if (dims[static_cast<size_t>(i)] != o.dims[static_cast<size_t>(i)]) return false;
  return true;
}

std::string Shape::str() const {
  std::string s = "[";
  for (int i = 0; i < rank; ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[static_cast<size_t>(i)]);
  }
  return s + "]";
}

size_t Tensor::bytes() const {
  const auto n = static_cast<size_t>(shape.numel());
  if (dtype != DType::kQ4 && dtype != DType::kQ4Panel) return n * dtype_size(dtype);
  // Codes (two per byte) and an f32 min and scale per group of 64 (quant.h's layout; the
  // panels of gemm_q4_panel.h reorder the same bytes).
  return n / 2 + 2 * sizeof(float) * (n / 64);
}

float* Tensor::f32() const {
  STRATA_CHECK(dtype == DType::kF32, "tensor {} is not f32", describe());
  return static_cast<float*>(data);
}

std::string Tensor::describe() const {
  return fmt::format("{}{}@{}", dtype_name(dtype), shape.str(),
                     device == Device::kHost ? "host" : "cuda");
}

void Buffer::Free::operator()(void* p) const {
  if (mapped > 0) {
    munmap(p, mapped);
  } else {
    std::free(p);
  }
}

namespace {

// `bytes` of zeroed memory on a 2 MiB boundary: a mapping one huge page larger, with the
// pages before the boundary and after the end unmapped again. Returns the length kept.
void* map_huge_aligned(size_t bytes, size_t& mapped) {
  const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  mapped = (bytes + page - 1) / page * page;
  const size_t over = mapped + kHugePageBytes;
  void* m = mmap(nullptr, over, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED)
    fail(ErrorKind::kOverloaded, "cannot map {} bytes of host memory: {}", bytes,
         std::strerror(errno));
  const auto base = reinterpret_cast<uintptr_t>(m);
  const uintptr_t start = (base + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  if (start > base) munmap(m, start - base);
  if (base + over > start + mapped)
    munmap(reinterpret_cast<void*>(start + mapped), base + over - (start + mapped));
  void* p = reinterpret_cast<void*>(start);
  madvise(p, mapped, MADV_HUGEPAGE);  // advice only: 4 KiB pages where THP is off
  return p;
}

}  // namespace

Buffer::Buffer(size_t bytes) : size_(bytes) {
  if (bytes == 0) return;
  if (bytes >= kHugePageBytes) {
    size_t mapped = 0;
    void* p = map_huge_aligned(bytes, mapped);
    ptr_ = std::unique_ptr<void, Free>(p, Free{mapped});
    return;
  }
  const size_t rounded = (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded);
  if (p == nullptr) fail(ErrorKind::kOverloaded, "out of host memory allocating {} bytes", bytes);
  std::memset(p, 0, rounded);
  ptr_.reset(p);
}

OwnedTensor::OwnedTensor(DType dtype, Shape shape) {
  view.dtype = dtype;
  view.shape = shape;
  storage = Buffer(view.bytes());
  view.data = storage.data();
}

}  // namespace strata
