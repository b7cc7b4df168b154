// The horizontal sum of an AVX2 float vector, for the files compiled for AVX2 (internal
// linkage, as gemv_kernel.h explains).
#pragma once

#include <immintrin.h>

namespace strata::gemv_detail {
namespace {

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace
}  // namespace strata::gemv_detail
