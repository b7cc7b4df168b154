// The 4-bit panel kernel (gemm_q4_panel.h) for AVX-512 with BW and VNNI (this file is
// compiled for that). Per group of 64 columns and 16 weight rows, for each activation row:
//   sum_c x[c] * (q[c] * scale + min) = scale * d / 256 * (256 * sum q * hi + sum q * lo)
//                                     + min * sum x,
// the two code sums in int32 lanes by vpdpbusd (u8 codes times s8 parts, four a lane: the
// even columns' codes in the low nibbles against the even parts, then the odd ones), the
// rest once per group in f32. A group's combined sum is at most 64 * 15 * (127 * 256 + 128),
// far inside int32.
#include <immintrin.h>

#include "kernels/gemm_q4_panel.h"
#include "kernels/gemm_q4_panel_kernel.h"

namespace strata::q4_panel_detail {
namespace {

constexpr int kSteps = kQuantGroupSize / 8;  // 8 codes a lane a step
constexpr int kMr = 8;  // 8 x (2 int32 + 1 f32) accumulators, codes and scales: 29 registers

inline __m512i bcast(const int8_t* p) {  // 4 bytes to every lane (an embedded broadcast)
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// A panel's 16 lanes of 32 bits at p: all of them, or a short panel's first `rows` (the
// rest zero).
template <bool kFull>
inline __m512i load_lanes(const uint8_t* p, __mmask16 mask) {
  if constexpr (kFull) return _mm512_loadu_si512(p);
  return _mm512_maskz_loadu_epi32(mask, p);
}

// MR activation rows from i0 against panel p of `rows` rows (16 when kFull), over all of k.
template <int MR, bool kFull>
void tile(const Q4PanelArgs& a, int64_t i0, int64_t p, int64_t rows) {
  const int64_t gpr = a.k / kQuantGroupSize;
  const int64_t xrow = 2 * a.k;
  const int64_t lanes = kFull ? kQ4PanelRows : rows;
  const auto mask = static_cast<__mmask16>((1u << lanes) - 1u);
  const int64_t step_bytes = lanes * 4, block_bytes = lanes * kQ4RowGroupBytes;
  const uint8_t* w = a.w + p * kQ4PanelRows * gpr * kQ4RowGroupBytes;
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  __m512 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < gpr; ++g, w += block_bytes) {
    __m512i hi[MR], lo[MR];
    for (int i = 0; i < MR; ++i) hi[i] = lo[i] = _mm512_setzero_si512();
    const int8_t* xg = a.xq + i0 * xrow + g * 2 * kQuantGroupSize;
#pragma GCC unroll 8
    for (int s = 0; s < kSteps; ++s) {
      const __m512i v = load_lanes<kFull>(w + s * step_bytes, mask);
      const __m512i even = _mm512_and_si512(v, nibble);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      for (int i = 0; i < MR; ++i) {
        const int8_t* xs = xg + i * xrow + s * 16;
        hi[i] = _mm512_dpbusd_epi32(hi[i], even, bcast(xs));
        hi[i] = _mm512_dpbusd_epi32(hi[i], odd, bcast(xs + 4));
        lo[i] = _mm512_dpbusd_epi32(lo[i], even, bcast(xs + 8));
        lo[i] = _mm512_dpbusd_epi32(lo[i], odd, bcast(xs + 12));
      }
    }
    const __m512 scales = _mm512_castsi512_ps(load_lanes<kFull>(w + kSteps * step_bytes, mask));
    const __m512 mins = _mm512_castsi512_ps(load_lanes<kFull>(w + (kSteps + 1) * step_bytes, mask));
    for (int i = 0; i < MR; ++i) {
      const int64_t j = (i0 + i) * gpr + g;
      const __m512 codes = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(hi[i], 8), lo[i]));
      acc[i] = _mm512_fmadd_ps(codes, _mm512_mul_ps(scales, _mm512_set1_ps(a.xscale[j])), acc[i]);
      acc[i] = _mm512_fmadd_ps(mins, _mm512_set1_ps(a.xsum[j]), acc[i]);
    }
  }
  const int64_t col = p * kQ4PanelRows;
  const __m512 bias =
      a.bias != nullptr ? _mm512_maskz_loadu_ps(mask, a.bias + col) : _mm512_setzero_ps();
  for (int i = 0; i < MR; ++i)
    _mm512_mask_storeu_ps(a.y + (i0 + i) * a.n + col, mask, _mm512_add_ps(acc[i], bias));
}

// `count` (< R + 1) activation rows from i: the tile of exactly that many.
template <int R, bool kFull>
void tile_rows(const Q4PanelArgs& a, int64_t i, int64_t count, int64_t p, int64_t rows) {
  if constexpr (R > 0) {
    if (count == R) {
      tile<R, kFull>(a, i, p, rows);
    } else {
      tile_rows<R - 1, kFull>(a, i, count, p, rows);
    }
  }
}

// Activation rows [i0, i1) against panel p: MR = 8 at a time, then one tile for the rest.
template <bool kFull>
void panel_rows(const Q4PanelArgs& a, int64_t i0, int64_t i1, int64_t p, int64_t rows) {
  int64_t i = i0;
  for (; i + kMr <= i1; i += kMr) tile<kMr, kFull>(a, i, p, rows);
  tile_rows<kMr - 1, kFull>(a, i, i1 - i, p, rows);
}

}  // namespace

void q4_panel_gemm_avx512(const Q4PanelArgs& a, int64_t p0, int64_t p1) {
  for (int64_t i0 = 0; i0 < a.m; i0 += kQ4PanelMc) {
    const int64_t i1 = i0 + kQ4PanelMc < a.m ? i0 + kQ4PanelMc : a.m;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t rows = a.n - p * kQ4PanelRows;
      if (rows >= kQ4PanelRows) {
        panel_rows<true>(a, i0, i1, p, kQ4PanelRows);
      } else {
        panel_rows<false>(a, i0, i1, p, rows);
      }
    }
  }
}

}  // namespace strata::q4_panel_detail
