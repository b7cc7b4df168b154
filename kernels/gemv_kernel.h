// The decode GEMV written once over a vector traits type V (gemv_avx2.cpp, gemv_avx512.cpp
// instantiate it, each compiled for its own instruction set). Internal to kernels/.
//
// V provides: Vec, kWidth (floats a vector), kRowsOne (weight rows streamed together for
// one activation row), kRowsMany (for 2..16 rows), zero(), loadx(p), loadw<DT>(row, k),
// fma(a, b, c), sum(v).
//
// One activation row: kRowsOne weight rows stream side by side, one accumulator each. On
// the 2-core EPYC, 16 rows of AVX-512 stream a decode step's matrices faster than 4 rows
// (docs/journal/benchmarks-history.md, "CPU GEMV: rows in flight ..."): more rows in flight
// keep more cache-line misses outstanding. Several activation rows: kRowsMany weight rows stay in
// L1 while each 4-row tile of x passes over them, so each weight byte is read once for all rows.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/dtype.h"

namespace strata::gemv_detail {

struct GemvArgs {
  const float* x;  // [m, k]
  int64_t k;
  const char* w;  // [n, k] rows of row_bytes
  size_t row_bytes;
  const float* bias;  // [n] or null
  float* y;           // [m, ldy]
  int64_t ldy;
};

// Everything below is compiled into each instruction set's file: internal linkage, so the
// linker never merges an AVX-512 copy of an inline function into the AVX2 path.
namespace {

// One element of a k tail. f16_to_f32 is an out-of-line function of dtype.cpp.
template <DType DT>
float load1(const void* row, int64_t k) {
  if constexpr (DT == DType::kF32) {
    return static_cast<const float*>(row)[k];
  } else if constexpr (DT == DType::kF16) {
    return f16_to_f32(static_cast<const uint16_t*>(row)[k]);
  } else {  // bf16: the top half of an f32
    const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(row)[k]) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
}

// R weight rows from n against M activation rows: R * M accumulators stay in registers.
template <class V, DType DT, int M, int R>
void tile(const GemvArgs& a, const float* x, float* y, int64_t n) {
  typename V::Vec acc[M][R];
  for (int i = 0; i < M; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = V::zero();
  const char* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = a.w + static_cast<size_t>(n + r) * a.row_bytes;
  const int64_t kv = a.k - a.k % V::kWidth;
  for (int64_t kk = 0; kk < kv; kk += V::kWidth) {
    typename V::Vec wv[R];
    for (int r = 0; r < R; ++r) wv[r] = V::template loadw<DT>(rows[r], kk);
    for (int i = 0; i < M; ++i) {
      const typename V::Vec xv = V::loadx(x + i * a.k + kk);
      for (int r = 0; r < R; ++r) acc[i][r] = V::fma(wv[r], xv, acc[i][r]);
    }
  }
  for (int i = 0; i < M; ++i)
    for (int r = 0; r < R; ++r) {
      float s = V::sum(acc[i][r]);
      for (int64_t kk = kv; kk < a.k; ++kk) s += load1<DT>(rows[r], kk) * x[i * a.k + kk];
      y[i * a.ldy + n + r] = s + (a.bias != nullptr ? a.bias[n + r] : 0.0f);
    }
}

// R weight rows from n against all m activation rows, 4 at a time.
template <class V, DType DT, int R>
void rows_many(const GemvArgs& a, int64_t m, int64_t n) {
  int64_t i = 0;
  for (; i + 4 <= m; i += 4) tile<V, DT, 4, R>(a, a.x + i * a.k, a.y + i * a.ldy, n);
  const float* x = a.x + i * a.k;
  float* y = a.y + i * a.ldy;
  switch (m - i) {
    case 1:
      tile<V, DT, 1, R>(a, x, y, n);
      break;
    case 2:
      tile<V, DT, 2, R>(a, x, y, n);
      break;
    case 3:
      tile<V, DT, 3, R>(a, x, y, n);
      break;
    default:
      break;
  }
}

// Output rows [n0, n1) of y[m, ldy] = x[m, k] * w^T (+ bias).
template <class V, DType DT>
void gemv(const GemvArgs& a, int64_t m, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (m == 1) {
    for (; n + V::kRowsOne <= n1; n += V::kRowsOne) tile<V, DT, 1, V::kRowsOne>(a, a.x, a.y, n);
    for (; n + 4 <= n1; n += 4) tile<V, DT, 1, 4>(a, a.x, a.y, n);
  } else {
    for (; n + V::kRowsMany <= n1; n += V::kRowsMany) rows_many<V, DT, V::kRowsMany>(a, m, n);
  }
  for (; n < n1; ++n) rows_many<V, DT, 1>(a, m, n);
}

template <class V>
void gemv_any(DType dt, const GemvArgs& a, int64_t m, int64_t n0, int64_t n1) {
  switch (dt) {
    case DType::kF16:
      gemv<V, DType::kF16>(a, m, n0, n1);
      return;
    case DType::kBF16:
      gemv<V, DType::kBF16>(a, m, n0, n1);
      return;
    default:
      gemv<V, DType::kF32>(a, m, n0, n1);
      return;
  }
}

}  // namespace

// The instruction-set entry points (absent ones are never called: see active_cpu_isa()).
void gemv_avx2(DType dt, const GemvArgs& a, int64_t m, int64_t n0, int64_t n1);
void gemv_avx512(DType dt, const GemvArgs& a, int64_t m, int64_t n0, int64_t n1);

}  // namespace strata::gemv_detail
