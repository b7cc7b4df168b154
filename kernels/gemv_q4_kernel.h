// The 4-bit decode GEMV (quant.h linear_4bit) written once over an integer vector traits
// type V; gemv_q4_avx2.cpp and gemv_q4_avx512.cpp instantiate it, each compiled for its own
// instruction set. Internal to kernels/.
//
// Per group j of a weight row: sum_c x[c] * (q[c] * scale_j + min_j)
//   = scale_j * sum_c q[c] * x[c] + min_j * sum_c x[c].
// The min term is a dot of the row's mins with per-group sums of x (exact, in f32). The
// code term multiplies the 4-bit codes as bytes, without converting them to floats: x is
// written per group as two int8 parts, x ~ d * (hi + lo / 256) with d = max|x_group| / 127,
// so sum q * x = d / 256 * (256 * sum q * hi + sum q * lo), two integer dot products of
// bytes (u8 codes times s8 activations, four products a 32-bit lane: vpdpbusd, or
// vpmaddubsw + vpmaddwd). The error of x is at most d / 512 = max|x_group| / 65024 (about
// 16 bits), far below the f16 rounding FlexGen computes with. Per 8 codes this costs a
// quarter of an instruction instead of the three of a float convert-and-FMA.
//
// V provides: IVec, FVec, kBlock (codes one load of codes covers: 2 * vector bytes),
// load_codes(p, lo, hi) (even-index codes of the block in lo, odd in hi, one byte each),
// loadx(p) (kBlock / 2 int8), dot2(acc, lo, xlo, hi, xhi) (acc + lo . xlo + hi . xhi in
// 32-bit lanes, each lane inside one group), izero(), fzero(), combine(acc_hi, acc_lo)
// (256 * acc_hi + acc_lo as floats), group_scales(ws, xs) (per lane: the weight scale times
// d / 256 of its lane's group; ws, xs point at the block's first group), fma(a, b, c),
// sum(v).
#pragma once

#include <cstdint>

namespace strata::gemv_detail {

struct Q4Args {
  // x per activation row, in blocks of `block` values (quant.cpp prepare_q4_x): even
  // indices' hi parts, odd indices' hi parts, even lo, odd lo (block / 2 bytes each).
  const int8_t* xq;
  const float* xscale;  // [m, gpr]: d / 256 of each group of x
  const float* xsum;    // [m, gpr]: sum of each group of x
  int64_t m;
  int64_t k;
  int64_t gpr;  // groups a row (k / 64)
  const uint8_t* packed;
  const float* mins;
  const float* scales;
  const float* bias;  // [n] or null
  float* y;           // [m, n]
  int64_t n;
};

constexpr int64_t kQ4Group = 64;
// How far ahead of a row's codes the kernel asks for them: the byte products keep too few
// loads in flight for the hardware prefetcher alone (a decode step's 4-bit GEMVs streamed
// measurably faster with it when the kernel was written; `strata bench` with
// STRATA_CPU_ISA shows the kernel's rate).
constexpr int64_t kQ4PrefetchBytes = 2048;
// Codes one load covers (V::kBlock): k must be a multiple of the kernel's.
constexpr int64_t kQ4BlockAvx2 = 64;
constexpr int64_t kQ4BlockAvx512 = 128;

// The entry points, rows [n0, n1) of y for every activation row. The AVX-512 one needs a
// CPU with AVX-512 BW and VNNI.
void gemv_q4_avx2(const Q4Args& a, int64_t n0, int64_t n1);
void gemv_q4_avx512(const Q4Args& a, int64_t n0, int64_t n1);

// One group of 64 activations x as two int8 parts in element order, x = d * (hi + lo / 256)
// within d / 512 for d = max|x| / 127; returns d / 256 (NaN for a non-finite group, whose
// parts are zero). quant.cpp; the kQ4 and the panel kernels' layouts are made from it.
float split_x_group(const float* x, int8_t* hi, int8_t* lo);

// Compiled into each instruction set's file: internal linkage (see gemv_kernel.h).
namespace {

// y[i, row] from the scaled code dot product: adds the min term and the bias.
inline void finish_q4_row(const Q4Args& a, int64_t i, int64_t row, float code_dot) {
  const float* mins = a.mins + row * a.gpr;
  const float* xs = a.xsum + i * a.gpr;
  float s = code_dot;
  for (int64_t j = 0; j < a.gpr; ++j) s += mins[j] * xs[j];
  a.y[i * a.n + row] = s + (a.bias != nullptr ? a.bias[row] : 0.0f);
}

// R weight rows from `row` against M activation rows from i0.
template <class V, int M, int R>
void q4_tile(const Q4Args& a, int64_t i0, int64_t row) {
  static_assert(V::kBlock % kQ4Group == 0, "a block covers whole groups");
  typename V::FVec total[M][R];
  for (int i = 0; i < M; ++i)
    for (int r = 0; r < R; ++r) total[i][r] = V::fzero();
  const uint8_t* codes[R];
  const float* wscales[R];
  for (int r = 0; r < R; ++r) {
    codes[r] = a.packed + (row + r) * a.k / 2;
    wscales[r] = a.scales + (row + r) * a.gpr;
  }
  const int64_t xrow = 2 * a.k;  // bytes of one prepared activation row
  for (int64_t c = 0; c < a.k; c += V::kBlock) {
    const int64_t g = c / kQ4Group;
    typename V::IVec lo[R], hi[R];
    for (int r = 0; r < R; ++r) __builtin_prefetch(codes[r] + c / 2 + kQ4PrefetchBytes, 0, 3);
    for (int r = 0; r < R; ++r) V::load_codes(codes[r] + c / 2, lo[r], hi[r]);
    for (int i = 0; i < M; ++i) {
      const int8_t* xb = a.xq + (i0 + i) * xrow + 2 * c;
      const typename V::IVec xe_hi = V::loadx(xb);
      const typename V::IVec xo_hi = V::loadx(xb + V::kBlock / 2);
      const typename V::IVec xe_lo = V::loadx(xb + V::kBlock);
      const typename V::IVec xo_lo = V::loadx(xb + 3 * V::kBlock / 2);
      const float* xs = a.xscale + (i0 + i) * a.gpr + g;
      for (int r = 0; r < R; ++r) {
        const typename V::IVec acc_hi = V::dot2(V::izero(), lo[r], xe_hi, hi[r], xo_hi);
        const typename V::IVec acc_lo = V::dot2(V::izero(), lo[r], xe_lo, hi[r], xo_lo);
        total[i][r] =
            V::fma(V::combine(acc_hi, acc_lo), V::group_scales(wscales[r] + g, xs), total[i][r]);
      }
    }
  }
  for (int i = 0; i < M; ++i)
    for (int r = 0; r < R; ++r) finish_q4_row(a, i0 + i, row + r, V::sum(total[i][r]));
}

// Rows [n0, n1) for every activation row: one activation row against 4 weight rows at a
// time, more rows two at a time against 2 weight rows (what fits the registers).
template <class V>
void gemv_q4(const Q4Args& a, int64_t n0, int64_t n1) {
  int64_t i = 0;
  for (; i + 2 <= a.m; i += 2) {
    int64_t row = n0;
    for (; row + 2 <= n1; row += 2) q4_tile<V, 2, 2>(a, i, row);
    for (; row < n1; ++row) q4_tile<V, 2, 1>(a, i, row);
  }
  if (i < a.m) {
    int64_t row = n0;
    for (; row + 4 <= n1; row += 4) q4_tile<V, 1, 4>(a, i, row);
    for (; row < n1; ++row) q4_tile<V, 1, 1>(a, i, row);
  }
}

}  // namespace
}  // namespace strata::gemv_detail
