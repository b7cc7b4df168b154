#include "kernels/quant.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define STRATA_QUANT_AVX2 1
#else
#define STRATA_QUANT_AVX2 0
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cpu_isa.h"
#include "kernels/error.h"
#include "kernels/gemv_q4_kernel.h"

namespace strata {
namespace {

// Below this many elements an OpenMP fork costs more than the loop.
constexpr int64_t kParallelElems = 1 << 15;
// Weight rows of linear_4bit a thread takes at a time, kept in cache while every tile of
// activation rows passes over them (16 rows of k = 4096 are 32 KiB of codes).
constexpr int64_t kRowBlock = 16;

struct GroupStats {
  float min = 0.0f;
  float scale = 0.0f;
  bool ok = true;  // finite values and a finite range
};

// min and scale of n values x[0], x[stride], ...
GroupStats group_stats(const float* x, int64_t n, int64_t stride) {
  float mn = x[0];
  float mx = x[0];
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i * stride];
    finite = finite && std::isfinite(v);  // std::min/max would silently skip a NaN
    mn = std::min(mn, v);
    mx = std::max(mx, v);
  }
  const float scale = (mx - mn) / static_cast<float>(kQuantLevels);
  if (!finite || !std::isfinite(scale)) return {0.0f, 0.0f, false};  // encodes as 0, then throws
  return {mn, scale, true};
}

inline uint8_t encode(float x, float mn, float scale) {
  if (scale == 0.0f) return 0;  // a constant group: min alone is exact
  const float q = std::nearbyint((x - mn) / scale);
  return static_cast<uint8_t>(std::clamp(q, 0.0f, static_cast<float>(kQuantLevels)));
}

// n (even) values sharing one (min, scale) into n / 2 bytes, even index in the low nibble.
void encode_run(const float* x, int64_t n, GroupStats s, uint8_t* out) {
  for (int64_t i = 0; i < n; i += 2)
    out[i / 2] = static_cast<uint8_t>(encode(x[i], s.min, s.scale) |
                                      (encode(x[i + 1], s.min, s.scale) << 4));
}

// Quantises whole rows of a row-grouped tensor; returns a bad group's index or -1.
int64_t quantize_along_rows(const float* x, int64_t row_begin, int64_t n_rows, QuantizedTensor& t) {
  const QuantLayout& l = t.layout;
  const int64_t g = l.group_size;
  const int64_t gpr = l.cols / g;
  auto* packed = t.packed.as<uint8_t>();
  auto* mins = t.mins.as<float>();
  auto* scales = t.scales.as<float>();
  int64_t bad = std::numeric_limits<int64_t>::max();
  // Errors are collected, not thrown: an exception must not leave an OpenMP region.
#pragma omp parallel for schedule(static) reduction(min : bad) if (n_rows * l.cols > kParallelElems)
  for (int64_t r = 0; r < n_rows; ++r) {
    const int64_t row = row_begin + r;
    for (int64_t j = 0; j < gpr; ++j) {
      const float* xg = x + r * l.cols + j * g;
      const GroupStats s = group_stats(xg, g, 1);
      if (!s.ok) bad = std::min(bad, row * gpr + j);
      mins[row * gpr + j] = s.min;
      scales[row * gpr + j] = s.scale;
      encode_run(xg, g, s, packed + (row * l.cols + j * g) / 2);
    }
  }
  return bad == std::numeric_limits<int64_t>::max() ? -1 : bad;
}

// Quantises whole row groups of a column-grouped tensor; returns a bad group's index or -1.
int64_t quantize_along_columns(const float* x, int64_t row_begin, int64_t n_rows,
                               QuantizedTensor& t) {
  const QuantLayout& l = t.layout;
  const int64_t g = l.group_size;
  auto* packed = t.packed.as<uint8_t>();
  auto* mins = t.mins.as<float>();
  auto* scales = t.scales.as<float>();
  int64_t bad = std::numeric_limits<int64_t>::max();
#pragma omp parallel for schedule(static) reduction(min : bad) if (n_rows * l.cols > kParallelElems)
  for (int64_t rg = 0; rg < n_rows / g; ++rg) {
    const float* xb = x + rg * g * l.cols;
    const int64_t meta = (row_begin / g + rg) * l.cols;  // this row group's [cols] of metadata
    for (int64_t c = 0; c < l.cols; ++c) {
      const GroupStats s = group_stats(xb + c, g, l.cols);
      if (!s.ok) bad = std::min(bad, meta + c);
      mins[meta + c] = s.min;
      scales[meta + c] = s.scale;
    }
    for (int64_t i = 0; i < g; ++i) {
      const float* xr = xb + i * l.cols;
      uint8_t* out = packed + (row_begin + rg * g + i) * l.cols / 2;
      for (int64_t c = 0; c < l.cols; c += 2)
        out[c / 2] = static_cast<uint8_t>(
            encode(xr[c], mins[meta + c], scales[meta + c]) |
            (encode(xr[c + 1], mins[meta + c + 1], scales[meta + c + 1]) << 4));
    }
  }
  return bad == std::numeric_limits<int64_t>::max() ? -1 : bad;
}

[[noreturn]] void fail_group(const QuantLayout& l, int64_t group) {
  const bool along_row = l.axis == QuantAxis::kAlongRow;
  const int64_t per = along_row ? l.cols / l.group_size : l.cols;
  const int64_t row = along_row ? group / per : group / per * l.group_size;
  const int64_t col = along_row ? group % per * l.group_size : group % per;
  fail_input(
      "4-bit quantization of {}: group {} (from row {}, column {}) holds a non-finite value "
      "or a range beyond f32",
      l.str(), group, row, col);
}

inline float decode(uint8_t byte, int64_t index, float mn, float scale) {
  const int q = (index & 1) != 0 ? byte >> 4 : byte & 0x0f;
  return std::fma(static_cast<float>(q), scale, mn);  // one rounding, as the AVX2 paths do
}

#if STRATA_QUANT_AVX2
// 16 codes from 8 bytes as two vectors of floats: elements 0-7 and 8-15.
inline void unpack16(const uint8_t* p, __m256& lo, __m256& hi) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0f);
  const __m128i even = _mm_and_si128(bytes, mask);
  const __m128i odd = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  const __m128i q = _mm_unpacklo_epi8(even, odd);  // back to element order
  lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
  hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)));
}
#endif

// n (even) values sharing one (min, scale) from n / 2 bytes.
void decode_run(const uint8_t* p, int64_t n, float mn, float scale, float* out) {
  int64_t i = 0;
#if STRATA_QUANT_AVX2
  const __m256 vs = _mm256_set1_ps(scale);
  const __m256 vm = _mm256_set1_ps(mn);
  for (; i + 16 <= n; i += 16) {
    __m256 lo, hi;
    unpack16(p + i / 2, lo, hi);
    _mm256_storeu_ps(out + i, _mm256_fmadd_ps(lo, vs, vm));
    _mm256_storeu_ps(out + i + 8, _mm256_fmadd_ps(hi, vs, vm));
  }
#endif
  for (; i < n; ++i) out[i] = decode(p[i / 2], i, mn, scale);
}

void dequantize_row(const QuantView& t, int64_t row, float* out) {
  const QuantLayout& l = t.layout;
  const auto* p = t.packed + row * l.cols / 2;
  const auto* mins = t.mins;
  const auto* scales = t.scales;
  if (l.axis == QuantAxis::kAlongRow) {
    const int64_t gpr = l.cols / l.group_size;
    for (int64_t j = 0; j < gpr; ++j)
      decode_run(p + j * l.group_size / 2, l.group_size, mins[row * gpr + j], scales[row * gpr + j],
                 out + j * l.group_size);
  } else {
    const int64_t meta = row / l.group_size * l.cols;
    for (int64_t c = 0; c < l.cols; ++c)
      out[c] = decode(p[c / 2], c, mins[meta + c], scales[meta + c]);
  }
}

// ---------------------------------------------------------------------------------------
// linear_4bit. Per group j of a row: sum_c x[c] * (q[c] * scale + min)
//   = scale * sum_c x[c] * q[c] + min * sum_c x[c],
// so the min term is a dot of the row's mins with per-group sums of x computed once per
// call (xsum). The code term runs in the vector kernels of gemv_q4_kernel.h where the
// instruction set and the shape allow (groups of 64, k a multiple of the kernel's block),
// else in the scalar loop below on f32 x.
// ---------------------------------------------------------------------------------------

enum class Q4Kernel { kScalar, kAvx2, kAvx512 };

Q4Kernel q4_kernel(CpuIsa isa, int64_t k, int64_t group_size) {
#if STRATA_X86_KERNELS
  if (group_size == gemv_detail::kQ4Group) {
    if (isa >= CpuIsa::kAvx512 && cpu_has_avx512_vnni() && k % gemv_detail::kQ4BlockAvx512 == 0)
      return Q4Kernel::kAvx512;
    if (isa >= CpuIsa::kAvx2 && k % gemv_detail::kQ4BlockAvx2 == 0) return Q4Kernel::kAvx2;
  }
#else
  (void)isa, (void)k, (void)group_size;
#endif
  return Q4Kernel::kScalar;
}

int64_t q4_block(Q4Kernel kernel) {
  return kernel == Q4Kernel::kAvx512 ? gemv_detail::kQ4BlockAvx512 : gemv_detail::kQ4BlockAvx2;
}

// Sized for a call of m rows of k columns in groups of g (grows, never shrinks).
void fit(Linear4bitScratch& s, int64_t m, int64_t k, int64_t g) {
  const auto groups = static_cast<size_t>(m * (k / g));
  if (s.xsum.size() < groups) s.xsum.resize(groups);
  if (g != gemv_detail::kQ4Group) return;  // the vector kernels' operands are not needed
  if (s.xscale.size() < groups) s.xscale.resize(groups);
  if (s.xq.size() < static_cast<size_t>(2 * m * k)) s.xq.resize(static_cast<size_t>(2 * m * k));
}

// Sums of x over each group, [m, k / g]: groups tile each row of x exactly.
void group_sums(const float* x, int64_t m, int64_t k, int64_t g, float* sums) {
  for (int64_t i = 0; i < m * (k / g); ++i) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t c = 0; c < g; ++c) s += x[i * g + c];
    sums[i] = s;
  }
}

// Writes one group of 64 values, split by gemv_detail::split_x_group, at the group's place in
// its block of the kQ4 kernels' layout (even indices, then odd, of hi, then of lo; each part
// block / 2 bytes) and returns d / 256.
float split_group(const float* x, int64_t block, int64_t offset, int8_t* out) {
  int8_t hi[gemv_detail::kQ4Group], lo[gemv_detail::kQ4Group];
  const float scale = gemv_detail::split_x_group(x, hi, lo);
  int8_t* hi_even = out + offset / 2;
  int8_t* hi_odd = hi_even + block / 2;
  int8_t* lo_even = hi_even + block;
  int8_t* lo_odd = hi_odd + block;
#pragma omp simd
  for (int64_t p = 0; p < gemv_detail::kQ4Group / 2; ++p) {
    hi_even[p] = hi[2 * p];
    hi_odd[p] = hi[2 * p + 1];
    lo_even[p] = lo[2 * p];
    lo_odd[p] = lo[2 * p + 1];
  }
  return scale;
}

// x[m, k] split group by group into `xq` ([m, 2k] bytes) and `xscale` ([m, k / 64]).
void prepare_q4_x(const float* x, int64_t m, int64_t k, int64_t block, int8_t* xq, float* xscale) {
  const int64_t gpr = k / gemv_detail::kQ4Group;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < gpr; ++j) {
      const int64_t c = j * gemv_detail::kQ4Group;
      xscale[i * gpr + j] =
          split_group(x + i * k + c, block, c % block, xq + i * 2 * k + c / block * 2 * block);
    }
}

// Any even group size, any machine: one weight row against activation row i.
void row_scalar(const float* x, const QuantView& w, const float* xsum, int64_t i, int64_t row,
                const float* bias, float* y) {
  const QuantLayout& l = w.layout;
  const int64_t g = l.group_size, gpr = l.cols / g;
  const float* xi = x + i * l.cols;
  const uint8_t* p = w.packed + row * l.cols / 2;
  float total = 0.0f;
  for (int64_t j = 0; j < gpr; ++j) {
    float dot = 0.0f;
    for (int64_t c = j * g; c < (j + 1) * g; c += 2)
      dot += static_cast<float>(p[c / 2] & 0x0f) * xi[c] +
             static_cast<float>(p[c / 2] >> 4) * xi[c + 1];
    total += dot * w.scales[row * gpr + j] + w.mins[row * gpr + j] * xsum[i * gpr + j];
  }
  y[i * l.rows + row] = total + (bias != nullptr ? bias[row] : 0.0f);
}

}  // namespace

namespace gemv_detail {

// With d = max|x| / 127: hi = round(x / d) and lo = round((x - d * hi) * 256 / d), so
// x = d * (hi + lo / 256) within d / 512. A non-finite group gives zero parts and NaN, which
// the products carry into y.
float split_x_group(const float* x, int8_t* hi, int8_t* lo) {
  // Written so the compiler vectorises every loop: a decode step splits x before each of its
  // ~85 4-bit GEMVs, and scalar rounding cost as much as a small matrix's products.
  float amax = 0.0f;
  int bad = 0;  // x - x is NaN exactly for an infinite or NaN x
#pragma omp simd reduction(max : amax) reduction(| : bad)
  for (int64_t c = 0; c < kQ4Group; ++c) {
    amax = std::max(amax, std::fabs(x[c]));
    bad |= (x[c] - x[c] == 0.0f) ? 0 : 1;
  }
  const bool finite = bad == 0;
  const float d = finite ? amax / 127.0f : 0.0f;  // zero parts then, never a NaN cast
  const float inv = d > 0.0f ? 1.0f / d : 0.0f;
#pragma omp simd
  for (int64_t c = 0; c < kQ4Group; ++c) {
    const float h = std::clamp(std::nearbyint(x[c] * inv), -127.0f, 127.0f);
    hi[c] = static_cast<int8_t>(h);
    lo[c] = static_cast<int8_t>(
        std::clamp(std::nearbyint((x[c] - d * h) * 256.0f * inv), -128.0f, 127.0f));
  }
  return finite ? d / 256.0f : std::numeric_limits<float>::quiet_NaN();
}

}  // namespace gemv_detail

void quantize_group(const float* x, int64_t n, uint8_t* codes, float* min, float* scale) {
  GroupStats s = group_stats(x, n, 1);
  if (!s.ok) s = {0.0f, 0.0f, true};
  *min = s.min;
  *scale = s.scale;
  encode_run(x, n, s, codes);
  if (s.scale == 0.0f && !std::isfinite(x[0])) std::memset(codes, 0, static_cast<size_t>(n / 2));
}

void dequantize_group(const uint8_t* codes, int64_t n, float min, float scale, float* out) {
  decode_run(codes, n, min, scale, out);
}

const char* quant_axis_name(QuantAxis axis) {
  return axis == QuantAxis::kAlongRow ? "along rows" : "along columns";
}

std::string QuantLayout::str() const {
  return fmt::format("q4[{}, {}] g{} {}", rows, cols, group_size, quant_axis_name(axis));
}

void check_quant_layout(const QuantLayout& l) {
  if (l.rows < 0 || l.cols < 0)
    fail_input("4-bit quantization: negative shape [{}, {}]", l.rows, l.cols);
  if (l.group_size <= 0 || l.group_size % 2 != 0)
    fail_input("4-bit quantization: group size {} must be even and positive (two codes a byte)",
               l.group_size);
  if (l.cols % 2 != 0)
    fail_input(
        "4-bit quantization: {} columns of a [{}, {}] tensor must be even so rows are whole bytes",
        l.cols, l.rows, l.cols);
  const bool along_row = l.axis == QuantAxis::kAlongRow;
  const int64_t dim = along_row ? l.cols : l.rows;
  if (dim % l.group_size != 0)
    fail_input(
        "4-bit quantization: group size {} does not divide the {} {} of a [{}, {}] tensor "
        "(groups {})",
        l.group_size, dim, along_row ? "columns" : "rows", l.rows, l.cols, quant_axis_name(l.axis));
}

size_t quantized_bytes(const QuantLayout& l) {
  check_quant_layout(l);
  return static_cast<size_t>(l.numel() / 2) + 2 * sizeof(float) * static_cast<size_t>(l.n_groups());
}

double quantized_bytes_per_element(int64_t group_size) {
  const QuantLayout one_group{1, group_size, group_size, QuantAxis::kAlongRow};
  return static_cast<double>(quantized_bytes(one_group)) / static_cast<double>(group_size);
}

QuantizedTensor allocate_quantized(const QuantLayout& l) {
  check_quant_layout(l);
  QuantizedTensor t;
  t.layout = l;
  t.packed = Buffer(static_cast<size_t>(l.numel() / 2));
  t.mins = Buffer(sizeof(float) * static_cast<size_t>(l.n_groups()));
  t.scales = Buffer(sizeof(float) * static_cast<size_t>(l.n_groups()));
  return t;
}

QuantizedTensor quantize_4bit(const float* x, const QuantLayout& layout) {
  QuantizedTensor t = allocate_quantized(layout);
  quantize_rows(x, 0, layout.rows, t);
  return t;
}

void quantize_rows(const float* x, int64_t row_begin, int64_t n_rows, QuantizedTensor& t) {
  const QuantLayout& l = t.layout;
  STRATA_CHECK(row_begin >= 0 && n_rows >= 0 && row_begin + n_rows <= l.rows,
               "quantize rows [{}, {}) of {}", row_begin, row_begin + n_rows, l.str());
  STRATA_CHECK(x != nullptr || n_rows * l.cols == 0, "quantize {}: null input", l.str());
  const bool along_row = l.axis == QuantAxis::kAlongRow;
  STRATA_CHECK(along_row || (row_begin % l.group_size == 0 && n_rows % l.group_size == 0),
               "quantize rows [{}, {}) of {}: not whole groups", row_begin, row_begin + n_rows,
               l.str());
  const int64_t bad = along_row ? quantize_along_rows(x, row_begin, n_rows, t)
                                : quantize_along_columns(x, row_begin, n_rows, t);
  if (bad >= 0) fail_group(l, bad);
}

void dequantize_4bit(const QuantizedTensor& t, float* out) {
  dequantize_rows(t, 0, t.layout.rows, out);
}

void dequantize_rows(const QuantizedTensor& t, int64_t row_begin, int64_t n_rows, float* out) {
  dequantize_rows(t.view(), row_begin, n_rows, out);
}

void dequantize_one_row(const QuantView& t, int64_t row, float* out) {
  STRATA_CHECK(row >= 0 && row < t.layout.rows, "dequantize row {} of {}", row, t.layout.str());
  dequantize_row(t, row, out);
}

void dequantize_rows(const QuantView& t, int64_t row_begin, int64_t n_rows, float* out) {
  const QuantLayout& l = t.layout;
  STRATA_CHECK(row_begin >= 0 && n_rows >= 0 && row_begin + n_rows <= l.rows,
               "dequantize rows [{}, {}) of {}", row_begin, row_begin + n_rows, l.str());
#pragma omp parallel for schedule(static) if (n_rows * l.cols > kParallelElems)
  for (int64_t r = 0; r < n_rows; ++r) dequantize_row(t, row_begin + r, out + r * l.cols);
}

void linear_4bit(const float* x, int64_t m, const QuantizedTensor& w, const float* bias, float* y) {
  linear_4bit(x, m, w.view(), bias, y);
}

QuantView q4_view(const Tensor& t) {
  STRATA_CHECK(t.dtype == DType::kQ4 && t.shape.rank == 2, "q4_view of {}", t.describe());
  QuantView v;
  v.layout = {t.shape[0], t.shape[1], kQuantGroupSize, QuantAxis::kAlongRow};
  check_quant_layout(v.layout);
  const auto* base = static_cast<const uint8_t*>(t.data);
  v.packed = base;
  v.mins = reinterpret_cast<const float*>(base + v.layout.numel() / 2);
  v.scales = v.mins + v.layout.n_groups();
  return v;
}

void write_q4_blob(const QuantizedTensor& q, void* blob) {
  STRATA_CHECK(q.layout.axis == QuantAxis::kAlongRow && q.layout.group_size == kQuantGroupSize,
               "a kQ4 blob holds rows grouped by {}, got {}", kQuantGroupSize, q.layout.str());
  auto* out = static_cast<uint8_t*>(blob);
  std::memcpy(out, q.packed.data(), q.packed.size());
  std::memcpy(out + q.packed.size(), q.mins.data(), q.mins.size());
  std::memcpy(out + q.packed.size() + q.mins.size(), q.scales.data(), q.scales.size());
}

void Linear4bitScratch::reserve(int64_t m, int64_t k, int64_t group_size) {
  if (m > 0 && k > 0 && group_size > 0) fit(*this, m, k, group_size);
}

void linear_4bit(const float* x, int64_t m, const QuantView& w, const float* bias, float* y) {
  thread_local Linear4bitScratch scratch;  // the caller brought none: this thread's
  linear_4bit(x, m, w, bias, y, scratch);
}

void linear_4bit(const float* x, int64_t m, const QuantView& w, const float* bias, float* y,
                 Linear4bitScratch& scratch) {
  linear_4bit(x, m, w, bias, y, scratch, active_cpu_isa());
}

void linear_4bit(const float* x, int64_t m, const QuantView& w, const float* bias, float* y,
                 Linear4bitScratch& scratch, CpuIsa isa) {
  const QuantLayout& l = w.layout;
  STRATA_CHECK(l.axis == QuantAxis::kAlongRow,
               "linear_4bit needs a weight grouped along rows, got {}", l.str());
  STRATA_CHECK(m >= 0, "linear_4bit rows {}", m);
  if (m == 0 || l.rows == 0) return;
  fit(scratch, m, l.cols, l.group_size);
  group_sums(x, m, l.cols, l.group_size, scratch.xsum.data());
  const Q4Kernel kernel = q4_kernel(isa, l.cols, l.group_size);
  if (kernel != Q4Kernel::kScalar)
    prepare_q4_x(x, m, l.cols, q4_block(kernel), scratch.xq.data(), scratch.xscale.data());
  const gemv_detail::Q4Args a{.xq = scratch.xq.data(),
                              .xscale = scratch.xscale.data(),
                              .xsum = scratch.xsum.data(),
                              .m = m,
                              .k = l.cols,
                              .gpr = l.cols / l.group_size,
                              .packed = w.packed,
                              .mins = w.mins,
                              .scales = w.scales,
                              .bias = bias,
                              .y = y,
                              .n = l.rows};
  const int64_t n_blocks = (l.rows + kRowBlock - 1) / kRowBlock;
#pragma omp parallel for schedule(static) if (l.rows * l.cols > kParallelElems)
  for (int64_t b = 0; b < n_blocks; ++b) {
    const int64_t n0 = b * kRowBlock, n1 = std::min(l.rows, n0 + kRowBlock);
    switch (kernel) {
#if STRATA_X86_KERNELS
      case Q4Kernel::kAvx512:
        gemv_detail::gemv_q4_avx512(a, n0, n1);
        break;
      case Q4Kernel::kAvx2:
        gemv_detail::gemv_q4_avx2(a, n0, n1);
        break;
#endif
      default:
        for (int64_t i = 0; i < m; ++i)
          for (int64_t row = n0; row < n1; ++row)
            row_scalar(x, w, scratch.xsum.data(), i, row, bias, y);
        break;
    }
  }
}

}  // namespace strata
