// exp(x) in plain float arithmetic that the compiler vectorises inside `omp simd` loops
// (std::exp stays a scalar libm call there): softmax and SiLU evaluate one per score or
// activation, which at batch 32 is most of decode attention's arithmetic. Relative error
// below 1e-7 (measured against double over [-87, 88]: 8.2e-8), exp(x < -87) = exp(-87),
// exp(x > 88) = exp(88), NaN stays NaN. Internal to kernels/.
#pragma once

#include <bit>
#include <cstdint>

namespace strata {

inline float fast_exp(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  // x = n ln2 + r with n = round(x / ln2) (adding and removing 1.5 * 2^23 rounds to nearest),
  // ln2 split in two so n * ln2 is exact to float precision, |r| <= ln2 / 2.
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
  // exp(r) by Cephes' expf polynomial, then 2^n through the exponent bits.
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

}  // namespace strata
