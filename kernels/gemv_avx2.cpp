// The decode GEMV for AVX2 + FMA + F16C (this file is compiled for exactly that).
#include <immintrin.h>

#include "kernels/avx2_sum.h"
#include "kernels/gemv_kernel.h"

namespace strata::gemv_detail {
namespace {

struct Avx2 {
  using Vec = __m256;
  static constexpr int kWidth = 8;
  static constexpr int kRowsOne = 8;   // 8 accumulators + x + a weight of 16 registers
  static constexpr int kRowsMany = 3;  // 4 x 3 accumulators + 3 weights + x
  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec loadx(const float* p) { return _mm256_loadu_ps(p); }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  template <DType DT>
  static Vec loadw(const char* row, int64_t k) {
    if constexpr (DT == DType::kF32) {
      return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + k);
    } else {
      const __m128i h = _mm_loadu_si128(
          reinterpret_cast<const __m128i*>(reinterpret_cast<const uint16_t*>(row) + k));
      if constexpr (DT == DType::kF16) return _mm256_cvtph_ps(h);
      // bf16 is the top half of an f32
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
  }
  static float sum(Vec v) { return sum8(v); }
};

}  // namespace

void gemv_avx2(DType dt, const GemvArgs& a, int64_t m, int64_t n0, int64_t n1) {
  gemv_any<Avx2>(dt, a, m, n0, n1);
}

}  // namespace strata::gemv_detail
