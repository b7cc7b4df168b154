// FlexGen's 4-bit group-wise weights (quant.h) repacked for the CPU (DType::kQ4Panel): one
// kernel for every number of activation rows, from a decode GEMV to a long prefill, that
// multiplies the codes as bytes and never converts a weight to a float.
//
// A kQ4 matrix stores each row's codes together and its f32 mins and scales in two other
// arrays, so a kernel reading it keeps one row in a vector's lanes and pays, per row and
// group, for a horizontal reduction and a scale (docs/journal/benchmarks-history.md: 8
// products an instruction at decode, and prefill had to dequantise into f32 panels).
// Repacked, a vector's 16 lanes are 16 output rows: lane r of one 64-byte load holds 8
// consecutive codes of row r, and one VNNI byte dot product multiplies them with 4
// activation bytes broadcast to every lane. Scales and mins then apply once per group to 16
// rows at once, and each activation row reuses every load of codes (MR rows a tile).
//
// Layout of an [n, k] kQ4Panel tensor (k a multiple of 64), as many bytes as kQ4 (40 a row
// and group: 5 bits a weight), in one stream a panel: panel p holds rows [16p, 16p + R),
// R = min(16, n - 16p) (only the last panel is short), and starts at byte 16p * (k / 64) * 40.
// It is k / 64 group blocks of R * 40 bytes, one a group g of 64 columns:
//   codes:  8 steps x R rows x 4 bytes: step s, row r holds the row's codes of columns
//           [64g + 8s, 64g + 8s + 8), two a byte as in kQ4 (the even column in the low nibble)
//   scales: R f32, one a row
//   mins:   R f32, one a row
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/cpu_isa.h"
#include "kernels/quant.h"
#include "kernels/tensor.h"

namespace strata {

constexpr int64_t kQ4PanelRows = 16;
constexpr int64_t kQ4RowGroupBytes = kQuantGroupSize / 2 + 2 * 4;  // a row's codes, scale, min

constexpr int64_t q4_panel_count(int64_t n) {
  return (n + kQ4PanelRows - 1) / kQ4PanelRows;
}

// Whether the loader should repack 4-bit weights for the CPU with this instruction set: the
// vector kernel needs AVX-512 with VNNI (byte dot products); elsewhere the kQ4 kernels run.
bool q4_panels_pay(CpuIsa isa);

// Repacks a kQ4 matrix (grouped along rows by 64) into out (its Tensor::bytes()).
void pack_q4_panels(const QuantView& q, uint8_t* out);

// Row `row` of a packed [n, k] matrix dequantised into k floats (an embedding lookup of a
// tied 4-bit head): the same values as dequantize_one_row of the matrix before packing.
void q4_panel_row(const uint8_t* packed, int64_t n, int64_t k, int64_t row, float* out);

// The activations as the vector kernel reads them: per row and group of 64, x split into
// two int8 parts (x = d * (hi + lo / 256) within d / 512, d = max|x| / 127: the kQ4 GEMV's
// split, quant.h) with d / 256 and the group's sum. Grows to the largest call, never shrinks.
struct Q4PanelScratch {
  std::vector<int8_t>
      xq;  // [m, 2k]: per 8 columns, 4 even-column hi, 4 odd hi, 4 even lo, 4 odd lo
  std::vector<float> xscale;  // [m, k / 64]
  std::vector<float> xsum;    // [m, k / 64]
  void reserve(int64_t m, int64_t k);
  size_t bytes() const {
    return xq.capacity() + (xscale.capacity() + xsum.capacity()) * sizeof(float);
  }
};

// y[m, n] = x[m, k] * dequant(w)^T (+ bias[n]) for w a kQ4Panel tensor, threads (OpenMP)
// splitting the panels. `isa` below AVX-512 with VNNI runs a plain loop on f32 x (tests
// compare the two; the loader packs only where the vector kernel runs).
void q4_panel_linear(const float* x, int64_t m, const Tensor& w, const float* bias, float* y,
                     Q4PanelScratch& scratch, CpuIsa isa);

}  // namespace strata
