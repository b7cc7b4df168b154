// The 4-bit decode GEMV for AVX-512 with BW and VNNI (this file is compiled for that): 128
// codes a load, two groups; bytes multiplied and summed four a lane by vpdpbusd.
#include <immintrin.h>

#include "kernels/gemv_q4_kernel.h"

namespace strata::gemv_detail {
namespace {

struct Q4Avx512 {
  using IVec = __m512i;
  using FVec = __m512;
  static constexpr int64_t kBlock = kQ4BlockAvx512;
  static void load_codes(const uint8_t* p, IVec& lo, IVec& hi) {
    const IVec v = _mm512_loadu_si512(p);
    const IVec mask = _mm512_set1_epi8(0x0f);
    lo = _mm512_and_si512(v, mask);
    hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
  }
  static IVec loadx(const int8_t* p) { return _mm512_loadu_si512(p); }
  static IVec izero() { return _mm512_setzero_si512(); }
  static FVec fzero() { return _mm512_setzero_ps(); }
  static IVec dot2(IVec acc, IVec lo, IVec xlo, IVec hi, IVec xhi) {
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, lo, xlo), hi, xhi);
  }
  static FVec combine(IVec hi, IVec lo) {
    return _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo));
  }
  // Lanes 0-7 hold the block's first group, 8-15 its second.
  static FVec group_scales(const float* ws, const float* xs) {
    const __m128 w = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(ws)));
    const __m128 x = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(xs)));
    const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(_mm_mul_ps(w, x)));
  }
  static FVec fma(FVec a, FVec b, FVec c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(FVec v) { return _mm512_reduce_add_ps(v); }
};

}  // namespace

void gemv_q4_avx512(const Q4Args& a, int64_t n0, int64_t n1) {
  gemv_q4<Q4Avx512>(a, n0, n1);
}

}  // namespace strata::gemv_detail
