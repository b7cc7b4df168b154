// The decode GEMV for AVX-512F (this file is compiled for it whatever the build machine).
#include <immintrin.h>

#include "kernels/gemv_kernel.h"

namespace strata::gemv_detail {
namespace {

struct Avx512 {
  using Vec = __m512;
  static constexpr int kWidth = 16;
  static constexpr int kRowsOne = 16;  // of 32 registers: 16 accumulators, x, weights
  static constexpr int kRowsMany = 4;  // 4 x 4 accumulators + 4 weights + x
  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec loadx(const float* p) { return _mm512_loadu_ps(p); }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  template <DType DT>
  static Vec loadw(const char* row, int64_t k) {
    if constexpr (DT == DType::kF32) {
      return _mm512_loadu_ps(reinterpret_cast<const float*>(row) + k);
    } else {
      const __m256i h = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(reinterpret_cast<const uint16_t*>(row) + k));
      if constexpr (DT == DType::kF16) return _mm512_cvtph_ps(h);
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
  }
  static float sum(Vec v) { return _mm512_reduce_add_ps(v); }
};

}  // namespace

void gemv_avx512(DType dt, const GemvArgs& a, int64_t m, int64_t n0, int64_t n1) {
  gemv_any<Avx512>(dt, a, m, n0, n1);
}

}  // namespace strata::gemv_detail
