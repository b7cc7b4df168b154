// The 4-bit decode GEMV for AVX2 (this file is compiled for exactly that): 64 codes a load,
// one group; bytes multiplied by vpmaddubsw, pairs summed by vpmaddwd.
#include <immintrin.h>

#include "kernels/avx2_sum.h"
#include "kernels/gemv_q4_kernel.h"

namespace strata::gemv_detail {
namespace {

struct Q4Avx2 {
  using IVec = __m256i;
  using FVec = __m256;
  static constexpr int64_t kBlock = kQ4BlockAvx2;
  static void load_codes(const uint8_t* p, IVec& lo, IVec& hi) {
    const IVec v = _mm256_loadu_si256(reinterpret_cast<const IVec*>(p));
    const IVec mask = _mm256_set1_epi8(0x0f);
    lo = _mm256_and_si256(v, mask);
    hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
  }
  static IVec loadx(const int8_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const IVec*>(p));
  }
  static IVec izero() { return _mm256_setzero_si256(); }
  static FVec fzero() { return _mm256_setzero_ps(); }
  // u8 codes (<= 15) times s8 activations: a pair sums to at most 2 * 15 * 128, and two
  // pairs' sums fit int16 too, so one vpmaddwd widens both.
  static IVec dot2(IVec acc, IVec lo, IVec xlo, IVec hi, IVec xhi) {
    const IVec pairs =
        _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  static FVec combine(IVec hi, IVec lo) {
    return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(hi, 8), lo));
  }
  static FVec group_scales(const float* ws, const float* xs) {
    return _mm256_set1_ps(ws[0] * xs[0]);
  }
  static FVec fma(FVec a, FVec b, FVec c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(FVec v) { return sum8(v); }
};

}  // namespace

void gemv_q4_avx2(const Q4Args& a, int64_t n0, int64_t n1) {
  gemv_q4<Q4Avx2>(a, n0, n1);
}

}  // namespace strata::gemv_detail
