// Test buffers with guard bytes (ggml's test-backend-ops habit): n elements between two
// runs of canary bytes, so a kernel that writes out of bounds fails its test.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/tensor.h"

namespace strata::testing {

constexpr size_t kGuardBytes = 64;  // keeps the payload as aligned as the allocation

inline uint8_t canary(size_t i) {
  return static_cast<uint8_t>(0xA5u + 37u * i);
}

// n elements of T between two runs of canary bytes; payload 64-byte aligned.
template <typename T>
class Guarded {
 public:
  explicit Guarded(size_t n, T fill = T{})
      : n_(n), buf_(2 * kGuardBytes + std::max<size_t>(n, 1) * sizeof(T)) {
    auto* b = static_cast<uint8_t*>(buf_.data());
    for (size_t i = 0; i < kGuardBytes; ++i) {
      b[i] = canary(i);
      b[kGuardBytes + n_ * sizeof(T) + i] = canary(i + kGuardBytes);
    }
    std::fill(data(), data() + n_, fill);
  }
  T* data() const { return reinterpret_cast<T*>(static_cast<uint8_t*>(buf_.data()) + kGuardBytes); }
  size_t size() const { return n_; }
  T& operator[](size_t i) const { return data()[i]; }
  std::vector<T> vec() const { return std::vector<T>(data(), data() + n_); }
  void assign(const std::vector<T>& v) {
    ASSERT_EQ(v.size(), n_);
    std::copy(v.begin(), v.end(), data());
  }

  ::testing::AssertionResult guards_intact() const {
    const auto* b = static_cast<const uint8_t*>(buf_.data());
    for (size_t i = 0; i < kGuardBytes; ++i) {
      if (b[i] != canary(i))
        return ::testing::AssertionFailure()
               << "guard byte " << (kGuardBytes - i) << " before the buffer was overwritten";
      if (b[kGuardBytes + n_ * sizeof(T) + i] != canary(i + kGuardBytes))
        return ::testing::AssertionFailure() << "guard byte " << i << " after the buffer (of " << n_
                                             << " elements) was overwritten";
    }
    return ::testing::AssertionSuccess();
  }

 private:
  size_t n_;
  Buffer buf_;
};

inline std::vector<float> random_floats(size_t n, uint32_t seed, float lo = -1.0f,
                                        float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

}  // namespace strata::testing
