// The panel GEMM for AVX2 + FMA (this file is compiled for exactly that).
#include <immintrin.h>

#include "kernels/gemm_panel_kernel.h"

namespace strata::panel_detail {
namespace {

struct PanelAvx2 {
  using Vec = __m256;
  static constexpr int kWidth = 8;
  // Of 16 registers: 2 x 4 accumulators, a panel row's 4 weights and the broadcast x.
  static constexpr int kMr = 2;
  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  // Without the empty asm GCC folds the load into each row's FMA: MR x 4 loads and MR
  // broadcasts for MR x 4 FMAs, and Zen 3's two vector loads a cycle bind before its two
  // FMAs do (113 against 157 GFLOP/s at m = 128).
  static Vec load_once(const float* p) {
    Vec v = _mm256_loadu_ps(p);
    asm("" : "+x"(v));
    return v;
  }
  static Vec bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
};

}  // namespace

void panel_gemm_avx2(const PanelArgs& a, int64_t p0, int64_t p1) {
  panel_gemm<PanelAvx2>(a, p0, p1);
}

}  // namespace strata::panel_detail
