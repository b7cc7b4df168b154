// The KV cache's element types on the device, shared by the CUDA backend's kernel files:
// f32 as it is, or f16 (policy cf16, half the bytes attention reads) rounded to nearest even
// as it is stored, as the CPU's f32_to_f16 rounds, and widened to f32 where it is read; and
// the 4-bit cache's blob (policy cc). Arithmetic stays f32 either way.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "kernels/cuda/cuda_kernels.h"

namespace strata::cuda_kernels {
namespace {

// Where one (slot, kv head) of an f32 or f16 cache starts, in elements.
__device__ int64_t head_offset(const KvCacheDesc& c, int32_t slot, int32_t kvh) {
  return static_cast<int64_t>(slot) * c.slot_stride + static_cast<int64_t>(kvh) * c.head_stride;
}

// The keys and values of one (slot, kv head) of an f32 or f16 cache, [capacity, head_dim].
template <typename T>
struct ElemHead {
  const T* k;
  const T* v;
  int32_t hd;
  __device__ ElemHead(const KvCacheDesc& c, int32_t slot, int32_t kvh)
      : k(static_cast<const T*>(c.k) + head_offset(c, slot, kvh)),
        v(static_cast<const T*>(c.v) + head_offset(c, slot, kvh)),
        hd(c.head_dim) {}
};

// One blob of a 4-bit cache (KvQ4Desc): codes [rows * head_dim / 2] bytes, two a byte (even
// index in the low nibble), padded to a multiple of 4, then mins, then scales
// [rows * head_dim / group] f32 (KvQ4Desc::codes_bytes, from KvQ4LayerView's).
struct Q4Ptrs {
  unsigned char* codes;
  float* mins;
  float* scales;
};

__device__ Q4Ptrs q4_ptrs(void* blob, const KvQ4Desc& c) {
  auto* codes = static_cast<unsigned char*>(blob);
  auto* mins = reinterpret_cast<float*>(codes + c.codes_bytes);
  return {codes, mins, mins + c.rows * (c.head_dim / c.group)};
}

// One (slot, kv head) of a 4-bit cache: both blobs, and the blob row of its position 0.
struct Q4Head {
  Q4Ptrs kb, vb;
  int64_t first;
  int32_t hd, group;
  __device__ Q4Head(const KvQ4Desc& c, int32_t slot, int32_t kvh)
      : kb(q4_ptrs(c.k, c)),
        vb(q4_ptrs(c.v, c)),
        first((static_cast<int64_t>(slot) * c.n_kv_heads + kvh) * c.capacity),
        hd(c.head_dim),
        group(c.group) {}
};

__device__ float widen(float x) {
  return x;
}
__device__ float widen(__half x) {
  return __half2float(x);
}

template <typename T>
__device__ T narrow(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    static_assert(std::is_same_v<T, __half>);
    return __float2half_rn(x);
  }
}

// V consecutive cache elements (V = 2 or 4) as one load: what a lane of the decode kernels
// holds while its loads are in flight, widened only where the values are used, so that a
// warp's loads of a whole chunk go out before any of them is waited on.
template <typename T, int V>
struct LaneBits;
template <>
struct LaneBits<float, 4> {
  using type = float4;
};
template <>
struct LaneBits<float, 2> {
  using type = float2;
};
template <>
struct LaneBits<__half, 4> {
  using type = uint2;
};
template <>
struct LaneBits<__half, 2> {
  using type = unsigned;
};
template <typename T, int V>
using Lane = typename LaneBits<T, V>::type;

template <typename T, int V>
__device__ void widen_lane(const Lane<T, V>& b, float (&r)[V]) {
  if constexpr (std::is_same_v<T, float>) {
    if constexpr (V == 4) {
      r[0] = b.x, r[1] = b.y, r[2] = b.z, r[3] = b.w;
    } else {
      r[0] = b.x, r[1] = b.y;
    }
  } else {
    const auto* pairs = reinterpret_cast<const __half2*>(&b);
#pragma unroll
    for (int i = 0; i < V / 2; ++i) {
      const float2 f = __half22float2(pairs[i]);
      r[2 * i] = f.x;
      r[2 * i + 1] = f.y;
    }
  }
}

template <typename T, int V>
__device__ Lane<T, V> narrow_lane(const float (&r)[V]) {
  Lane<T, V> b;
  if constexpr (std::is_same_v<T, float>) {
    if constexpr (V == 4) {
      b = make_float4(r[0], r[1], r[2], r[3]);
    } else {
      b = make_float2(r[0], r[1]);
    }
  } else {
    auto* pairs = reinterpret_cast<__half2*>(&b);
#pragma unroll
    for (int i = 0; i < V / 2; ++i) pairs[i] = __floats2half2_rn(r[2 * i], r[2 * i + 1]);
  }
  return b;
}

}  // namespace
}  // namespace strata::cuda_kernels
