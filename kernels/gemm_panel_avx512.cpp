// The panel GEMM for AVX-512F (this file is compiled for it whatever the build machine).
#include <immintrin.h>

#include "kernels/gemm_panel_kernel.h"

namespace strata::panel_detail {
namespace {

struct PanelAvx512 {
  using Vec = __m512;
  static constexpr int kWidth = 16;
  // Of 32 registers: 8 x 2 accumulators, a panel row's 2 weights and the broadcast x
  // (2 weight loads and 8 broadcasts feed 16 FMAs: the FMA units, not the loads, bind).
  static constexpr int kMr = 8;
  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static Vec load_once(const float* p) { return _mm512_loadu_ps(p); }  // GCC keeps it in one
  static Vec bcast(const float* p) { return _mm512_set1_ps(*p); }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
};

}  // namespace

void panel_gemm_avx512(const PanelArgs& a, int64_t p0, int64_t p1) {
  panel_gemm<PanelAvx512>(a, p0, p1);
}

}  // namespace strata::panel_detail
