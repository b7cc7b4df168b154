#include "kernels/gemm_panel.h"

#include <algorithm>
#include <cstring>

#include "kernels/error.h"
#include "kernels/gemm_panel_kernel.h"

namespace strata {
namespace {

// Values of k a packing pass transposes at a time: 32 rows x 64 values, 8 KiB, in L1.
constexpr int64_t kPackCols = 64;

// Any machine: the same loops in plain C++, each panel's 32 outputs in an array.
void panel_gemm_portable(const panel_detail::PanelArgs& a, int64_t p0, int64_t p1) {
  for (int64_t i = 0; i < a.m; ++i) {
    const float* x = a.x + i * a.k;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t col = p * kPanelRows;
      float acc[kPanelRows];
      for (int64_t j = 0; j < kPanelRows; ++j) acc[j] = a.bias != nullptr ? a.bias[col + j] : 0.0f;
      const float* panel = a.w + p * a.k * kPanelRows;
      for (int64_t c = 0; c < a.k; ++c) {
        const float* w = panel + c * kPanelRows;
        for (int64_t j = 0; j < kPanelRows; ++j) acc[j] += x[c] * w[j];
      }
      std::memcpy(a.y + i * a.ldy + col, acc, sizeof(acc));
    }
  }
}

// The last n % 32 rows of w, stored row-major after the panels: one dot product each.
void tail_rows(const panel_detail::PanelArgs& a) {
  const int64_t begin = panel_tail_begin(a.n);
  for (int64_t r = begin; r < a.n; ++r) {
    const float* w = a.w + r * a.k;
    for (int64_t i = 0; i < a.m; ++i) {
      const float* x = a.x + i * a.k;
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int64_t c = 0; c < a.k; ++c) s += x[c] * w[c];
      a.y[i * a.ldy + r] = s + (a.bias != nullptr ? a.bias[r] : 0.0f);
    }
  }
}

}  // namespace

void pack_panels(const float* w, int64_t n, int64_t k, float* out) {
  const int64_t panels = panel_count(n);
#pragma omp parallel for schedule(static) if (n * k > (int64_t{1} << 20))
  for (int64_t p = 0; p < panels; ++p) {
    float* panel = out + p * k * kPanelRows;
    const float* rows = w + p * kPanelRows * k;
    for (int64_t c0 = 0; c0 < k; c0 += kPackCols) {
      const int64_t c1 = std::min(k, c0 + kPackCols);
      for (int64_t j = 0; j < kPanelRows; ++j)
        for (int64_t c = c0; c < c1; ++c) panel[c * kPanelRows + j] = rows[j * k + c];
    }
  }
  const int64_t tail = panel_tail_begin(n);
  std::memcpy(out + tail * k, w + tail * k, static_cast<size_t>((n - tail) * k) * sizeof(float));
}

void panel_row(const float* packed, int64_t n, int64_t k, int64_t row, float* out) {
  STRATA_CHECK(row >= 0 && row < n, "panel row {} of {}", row, n);
  if (row >= panel_tail_begin(n)) {
    std::memcpy(out, packed + row * k, static_cast<size_t>(k) * sizeof(float));
    return;
  }
  const float* panel = packed + row / kPanelRows * k * kPanelRows + row % kPanelRows;
  for (int64_t c = 0; c < k; ++c) out[c] = panel[c * kPanelRows];
}

void panel_linear_with(CpuIsa isa, const float* x, int64_t m, const Tensor& w, const float* bias,
                       float* y, int64_t ldy, int64_t panel_begin, int64_t panel_end, bool tail) {
  STRATA_CHECK(w.dtype == DType::kF32Panel && w.shape.rank == 2, "panel linear weight {}",
               w.describe());
  STRATA_CHECK(m >= 1 && ldy >= w.shape[0], "panel linear with {} rows into a row of {} for {}", m,
               ldy, w.describe());
  STRATA_CHECK(panel_begin >= 0 && panel_begin <= panel_end && panel_end <= panel_count(w.shape[0]),
               "panels [{}, {}) of {}", panel_begin, panel_end, panel_count(w.shape[0]));
  STRATA_CHECK(isa <= detected_cpu_isa(), "panel linear with {}: this CPU has {}",
               cpu_isa_name(isa), cpu_isa_name(detected_cpu_isa()));
  const panel_detail::PanelArgs a{x, m, w.shape[1], w.as<const float>(), w.shape[0], bias, y, ldy};
  if (panel_end > panel_begin) {
    switch (isa) {
#if STRATA_X86_KERNELS
      case CpuIsa::kAvx512:
        panel_detail::panel_gemm_avx512(a, panel_begin, panel_end);
        break;
      case CpuIsa::kAvx2:
        panel_detail::panel_gemm_avx2(a, panel_begin, panel_end);
        break;
#endif
      default:
        panel_gemm_portable(a, panel_begin, panel_end);
        break;
    }
  }
  if (tail) tail_rows(a);
}

void panel_linear(const float* x, int64_t m, const Tensor& w, const float* bias, float* y,
                  int64_t ldy, int64_t panel_begin, int64_t panel_end, bool tail) {
  panel_linear_with(active_cpu_isa(), x, m, w, bias, y, ldy, panel_begin, panel_end, tail);
}

}  // namespace strata
