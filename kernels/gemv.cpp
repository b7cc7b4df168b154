#include "kernels/gemv.h"

#include <immintrin.h>

#include <vector>

#include "kernels/error.h"

namespace strata {
namespace {

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

template <DType DT>
inline __m256 load8(const void* row, int64_t k) {
  if constexpr (DT == DType::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(row) + k);
  } else {
    const __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(row) + k));
    if constexpr (DT == DType::kF16) {
      return _mm256_cvtph_ps(h);
    } else {  // bf16 is the top half of an f32
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float load1(DType dt, const void* row, int64_t k) {
  switch (dt) {
    case DType::kF16:
      return f16_to_f32(static_cast<const uint16_t*>(row)[k]);
    case DType::kBF16:
      return bf16_to_f32(static_cast<const uint16_t*>(row)[k]);
    default:
      return static_cast<const float*>(row)[k];
  }
}

// R weight rows against M activation rows: R * M accumulators stay in registers.
template <DType DT, int M, int R>
void gemv_tile(const float* x, int64_t k, const char* w, size_t row_bytes, const float* bias,
               float* y, int64_t ldy, int64_t n) {
  __m256 acc[M][R];
  for (int i = 0; i < M; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_ps();
  const void* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = w + static_cast<size_t>(n + r) * row_bytes;
  const int64_t k8 = k & ~int64_t{7};
  for (int64_t kk = 0; kk < k8; kk += 8) {
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load8<DT>(rows[r], kk);
    for (int i = 0; i < M; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * k + kk);
      for (int r = 0; r < R; ++r) acc[i][r] = _mm256_fmadd_ps(wv[r], xv, acc[i][r]);
    }
  }
  for (int i = 0; i < M; ++i) {
    for (int r = 0; r < R; ++r) {
      float s = hsum(acc[i][r]);
      for (int64_t kk = k8; kk < k; ++kk) s += load1(DT, rows[r], kk) * x[i * k + kk];
      y[i * ldy + n + r] = s + (bias != nullptr ? bias[n + r] : 0.0f);
    }
  }
}

// Output rows [n0, n1) for activation rows [0, M): R weight rows at a time; the R rows stay
// in L1 while every 4-row tile of x passes over them.
template <DType DT, int R>
void gemv_block(const float* x, int64_t m, int64_t k, const char* base, size_t row_bytes,
                const float* bias, float* y, int64_t ldy, int64_t n) {
  int64_t i = 0;
  for (; i + 4 <= m; i += 4)
    gemv_tile<DT, 4, R>(x + i * k, k, base, row_bytes, bias, y + i * ldy, ldy, n);
  switch (m - i) {
    case 1:
      gemv_tile<DT, 1, R>(x + i * k, k, base, row_bytes, bias, y + i * ldy, ldy, n);
      break;
    case 2:
      gemv_tile<DT, 2, R>(x + i * k, k, base, row_bytes, bias, y + i * ldy, ldy, n);
      break;
    case 3:
      gemv_tile<DT, 3, R>(x + i * k, k, base, row_bytes, bias, y + i * ldy, ldy, n);
      break;
    default:
      break;
  }
}

template <DType DT>
void gemv_m(const float* x, int64_t m, int64_t k, const Tensor& w, const float* bias, float* y,
            int64_t ldy, int64_t n0, int64_t n1) {
  // One activation row leaves registers for four weight rows; more rows share three.
  const auto* base = static_cast<const char*>(w.data);
  const size_t row_bytes = static_cast<size_t>(k) * dtype_size(DT);
  int64_t n = n0;
  if (m == 1) {
    for (; n + 4 <= n1; n += 4) gemv_tile<DT, 1, 4>(x, k, base, row_bytes, bias, y, ldy, n);
  } else {
    for (; n + 3 <= n1; n += 3) gemv_block<DT, 3>(x, m, k, base, row_bytes, bias, y, ldy, n);
  }
  for (; n < n1; ++n) gemv_block<DT, 1>(x, m, k, base, row_bytes, bias, y, ldy, n);
}

#else  // portable fallback

template <DType DT>
void gemv_m(const float* x, int64_t m, int64_t k, const Tensor& w, const float* bias, float* y,
            int64_t ldy, int64_t n0, int64_t n1) {
  const size_t row_bytes = static_cast<size_t>(k) * dtype_size(DT);
  std::vector<float> row(static_cast<size_t>(k));
  for (int64_t n = n0; n < n1; ++n) {
    convert_to_f32(DT, static_cast<const char*>(w.data) + static_cast<size_t>(n) * row_bytes,
                   row.data(), static_cast<size_t>(k));
    for (int64_t i = 0; i < m; ++i) {
      float s = 0.0f;
      for (int64_t kk = 0; kk < k; ++kk) s += row[static_cast<size_t>(kk)] * x[i * k + kk];
      y[i * ldy + n] = s + (bias != nullptr ? bias[n] : 0.0f);
    }
  }
}

#endif

}  // namespace

void gemv_rows(const float* x, int64_t m, const Tensor& w, const float* bias, float* y,
               int64_t n_begin, int64_t n_end) {
  STRATA_CHECK(m >= 1 && m <= kGemvMaxRows, "gemv with {} rows (max {})", m, kGemvMaxRows);
  const int64_t k = w.shape[1];
  const int64_t ldy = w.shape[0];
  switch (w.dtype) {
    case DType::kF32:
      gemv_m<DType::kF32>(x, m, k, w, bias, y, ldy, n_begin, n_end);
      return;
    case DType::kF16:
      gemv_m<DType::kF16>(x, m, k, w, bias, y, ldy, n_begin, n_end);
      return;
    case DType::kBF16:
      gemv_m<DType::kBF16>(x, m, k, w, bias, y, ldy, n_begin, n_end);
      return;
    case DType::kI32:
    case DType::kQ4:
      break;
  }
  STRATA_CHECK(false, "gemv weight dtype {}", dtype_name(w.dtype));
}

}  // namespace strata
