#include "kernels/gemm_q4_panel.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/error.h"
#include "kernels/gemm_q4_panel_kernel.h"
#include "kernels/gemv_q4_kernel.h"

namespace strata {
namespace {

constexpr int64_t kG = kQuantGroupSize;
// Below this many multiply-adds an OpenMP fork costs more than the loop.
constexpr int64_t kParallelMacs = 1 << 15;

// Row `row`'s place in the layout (gemm_q4_panel.h): its panel's rows, its lane, and where
// its group g's block starts, its 4 code bytes of step s, its scale and its min sit.
struct RowPlace {
  int64_t rows;  // R of its panel
  int64_t lane;
  int64_t panel_start;  // byte offset
  RowPlace(int64_t n, int64_t k, int64_t row)
      : rows(std::min(kQ4PanelRows, n - row / kQ4PanelRows * kQ4PanelRows)),
        lane(row % kQ4PanelRows),
        panel_start(row / kQ4PanelRows * kQ4PanelRows * (k / kG) * kQ4RowGroupBytes) {}
  int64_t block(int64_t g) const { return panel_start + g * rows * kQ4RowGroupBytes; }
  int64_t code(int64_t g, int64_t step) const { return block(g) + (step * rows + lane) * 4; }
  int64_t scale(int64_t g) const { return block(g) + rows * kG / 2 + lane * 4; }
  int64_t min(int64_t g) const { return scale(g) + rows * 4; }
};

float read_f32(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}

// Code c (0-63) of group g of the row.
int code_at(const uint8_t* packed, const RowPlace& at, int64_t g, int64_t c) {
  const uint8_t byte = packed[at.code(g, c / 8) + c % 8 / 2];
  return c % 2 == 0 ? byte & 0x0f : byte >> 4;
}

// x[m, k] into the kernel's operands: per row and group the split parts (per 8 columns: 4
// even-column hi, 4 odd hi, 4 even lo, 4 odd lo), d / 256 and the sum.
void prepare_x(const float* x, int64_t m, int64_t k, Q4PanelScratch& s) {
  const int64_t gpr = k / kG;
#pragma omp parallel for schedule(static) if (m * k > kParallelMacs)
  for (int64_t j = 0; j < m * gpr; ++j) {
    const float* xg = x + j * kG;  // groups tile each row exactly
    int8_t hi[kG], lo[kG];
    s.xscale[static_cast<size_t>(j)] = gemv_detail::split_x_group(xg, hi, lo);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < kG; ++c) sum += xg[c];
    s.xsum[static_cast<size_t>(j)] = sum;
    int8_t* out = s.xq.data() + j * 2 * kG;
    for (int64_t step = 0; step < kG / 8; ++step)
      for (int64_t b = 0; b < 4; ++b) {
        const int64_t c = 8 * step + 2 * b;
        out[16 * step + b] = hi[c];
        out[16 * step + 4 + b] = hi[c + 1];
        out[16 * step + 8 + b] = lo[c];
        out[16 * step + 12 + b] = lo[c + 1];
      }
  }
}

// Any machine: the codes against f32 x, one output at a time.
void q4_panel_portable(const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t n,
                       const float* bias, float* y, int64_t row0, int64_t row1) {
  for (int64_t row = row0; row < row1; ++row) {
    const RowPlace at(n, k, row);
    for (int64_t i = 0; i < m; ++i) {
      float total = bias != nullptr ? bias[row] : 0.0f;
      for (int64_t g = 0; g < k / kG; ++g) {
        const float* xg = x + i * k + g * kG;
        float dot = 0.0f, sum = 0.0f;
        for (int64_t c = 0; c < kG; ++c) {
          dot += static_cast<float>(code_at(w, at, g, c)) * xg[c];
          sum += xg[c];
        }
        total += dot * read_f32(w + at.scale(g)) + sum * read_f32(w + at.min(g));
      }
      y[i * n + row] = total;
    }
  }
}

}  // namespace

bool q4_panels_pay(CpuIsa isa) {
  return isa >= CpuIsa::kAvx512 && cpu_has_avx512_vnni();
}

void pack_q4_panels(const QuantView& q, uint8_t* out) {
  const QuantLayout& l = q.layout;
  STRATA_CHECK(l.axis == QuantAxis::kAlongRow && l.group_size == kG,
               "4-bit panels need rows grouped by {}, got {}", kG, l.str());
  const int64_t gpr = l.cols / kG;
#pragma omp parallel for schedule(static) if (l.rows * l.cols > (int64_t{1} << 20))
  for (int64_t row = 0; row < l.rows; ++row) {
    const RowPlace at(l.rows, l.cols, row);
    const uint8_t* codes = q.packed + row * l.cols / 2;
    for (int64_t g = 0; g < gpr; ++g) {
      for (int64_t step = 0; step < kG / 8; ++step)
        std::memcpy(out + at.code(g, step), codes + (g * kG + 8 * step) / 2, 4);
      std::memcpy(out + at.scale(g), &q.scales[row * gpr + g], 4);
      std::memcpy(out + at.min(g), &q.mins[row * gpr + g], 4);
    }
  }
}

void q4_panel_row(const uint8_t* packed, int64_t n, int64_t k, int64_t row, float* out) {
  STRATA_CHECK(row >= 0 && row < n, "4-bit panel row {} of {}", row, n);
  const RowPlace at(n, k, row);
  for (int64_t g = 0; g < k / kG; ++g) {
    const float scale = read_f32(packed + at.scale(g)), mn = read_f32(packed + at.min(g));
    for (int64_t c = 0; c < kG; ++c)  // one rounding, as dequantize_one_row
      out[g * kG + c] = std::fma(static_cast<float>(code_at(packed, at, g, c)), scale, mn);
  }
}

void Q4PanelScratch::reserve(int64_t m, int64_t k) {
  if (m <= 0 || k <= 0) return;
  const auto groups = static_cast<size_t>(m * (k / kG));
  if (xscale.size() < groups) xscale.resize(groups);
  if (xsum.size() < groups) xsum.resize(groups);
  if (xq.size() < static_cast<size_t>(2 * m * k)) xq.resize(static_cast<size_t>(2 * m * k));
}

void q4_panel_linear(const float* x, int64_t m, const Tensor& w, const float* bias, float* y,
                     Q4PanelScratch& scratch, CpuIsa isa) {
  STRATA_CHECK(w.dtype == DType::kQ4Panel && w.shape.rank == 2 && w.shape[1] % kG == 0,
               "4-bit panel linear weight {}", w.describe());
  STRATA_CHECK(m >= 0, "4-bit panel linear rows {}", m);
  const int64_t n = w.shape[0], k = w.shape[1];
  if (m == 0 || n == 0) return;
  const auto* packed = w.as<const uint8_t>();
  const bool parallel = m * n * k > kParallelMacs;
  if (!q4_panels_pay(isa)) {
#pragma omp parallel if (parallel)
    {
      const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
      q4_panel_portable(x, m, k, packed, n, bias, y, n * t / nt, n * (t + 1) / nt);
    }
    return;
  }
#if STRATA_X86_KERNELS
  scratch.reserve(m, k);
  prepare_x(x, m, k, scratch);
  const q4_panel_detail::Q4PanelArgs a{
      scratch.xq.data(), scratch.xscale.data(), scratch.xsum.data(), m, k, packed, n, bias, y};
  const int64_t panels = q4_panel_count(n);
#pragma omp parallel if (parallel)
  {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    q4_panel_detail::q4_panel_gemm_avx512(a, panels * t / nt, panels * (t + 1) / nt);
  }
#else
  (void)scratch;
#endif
}

}  // namespace strata
