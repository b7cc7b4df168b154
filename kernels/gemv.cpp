#include "kernels/gemv.h"

#include <vector>

#include "kernels/error.h"
#include "kernels/gemv_kernel.h"

namespace strata {
namespace {

// Any machine: one weight row converted to f32, then dotted with each activation row.
void gemv_portable(DType dt, const gemv_detail::GemvArgs& a, int64_t m, int64_t n0, int64_t n1) {
  std::vector<float> row(static_cast<size_t>(a.k));
  for (int64_t n = n0; n < n1; ++n) {
    convert_to_f32(dt, a.w + static_cast<size_t>(n) * a.row_bytes, row.data(),
                   static_cast<size_t>(a.k));
    for (int64_t i = 0; i < m; ++i) {
      float s = 0.0f;
      for (int64_t kk = 0; kk < a.k; ++kk) s += row[static_cast<size_t>(kk)] * a.x[i * a.k + kk];
      a.y[i * a.ldy + n] = s + (a.bias != nullptr ? a.bias[n] : 0.0f);
    }
  }
}

}  // namespace

void gemv_rows_with(CpuIsa isa, const float* x, int64_t m, const Tensor& w, const float* bias,
                    float* y, int64_t n_begin, int64_t n_end) {
  STRATA_CHECK(m >= 1 && m <= kGemvMaxRows, "gemv with {} rows (max {})", m, kGemvMaxRows);
  STRATA_CHECK(w.dtype == DType::kF32 || w.dtype == DType::kF16 || w.dtype == DType::kBF16,
               "gemv weight dtype {}", dtype_name(w.dtype));
  STRATA_CHECK(isa <= detected_cpu_isa(), "gemv with {}: this CPU has {}", cpu_isa_name(isa),
               cpu_isa_name(detected_cpu_isa()));
  const gemv_detail::GemvArgs a{x,
                                w.shape[1],
                                static_cast<const char*>(w.data),
                                static_cast<size_t>(w.shape[1]) * dtype_size(w.dtype),
                                bias,
                                y,
                                w.shape[0]};
  switch (isa) {
#if STRATA_X86_KERNELS
    case CpuIsa::kAvx512:
      gemv_detail::gemv_avx512(w.dtype, a, m, n_begin, n_end);
      return;
    case CpuIsa::kAvx2:
      gemv_detail::gemv_avx2(w.dtype, a, m, n_begin, n_end);
      return;
#endif
    default:
      gemv_portable(w.dtype, a, m, n_begin, n_end);
      return;
  }
}

void gemv_rows(const float* x, int64_t m, const Tensor& w, const float* bias, float* y,
               int64_t n_begin, int64_t n_end) {
  gemv_rows_with(active_cpu_isa(), x, m, w, bias, y, n_begin, n_end);
}

}  // namespace strata
