// f32 weights repacked for the CPU's GEMM (DType::kF32Panel): one kernel for every number of
// activation rows, from a decode GEMV (m = 1) to a prefill of thousands of rows.
//
// A row-major weight [n, k] is read by a decode GEMV one output row at a time, but a GEMM
// wants a few output columns side by side for each k, so OpenBLAS packs every call's
// weights into panels before multiplying (at m = 32 that packing and its small-m kernels
// leave it at 60% of the machine's GEMM peak: docs/journal/benchmarks-history.md). Weights
// do not change, so Strata packs them once, at load: rows [32p, 32p + 32) of the matrix
// become panel p, stored k-major as [k][32]. A micro-kernel then keeps MR x 32 outputs in
// registers, and for each k loads 32 weights once and broadcasts one activation per row: no
// packing per call, no horizontal sums, and the weights still stream once per call at any m.
//
// Layout of a [n, k] kF32Panel tensor (n * k floats, as many bytes as f32):
//   panels:    floor(n / 32) blocks of k * 32 floats, element (32p + j, c) at (p * k + c) * 32 + j
//   tail rows: the last n % 32 rows, row-major after the panels
#pragma once

#include <cstdint>

#include "kernels/cpu_isa.h"
#include "kernels/tensor.h"

namespace strata {

constexpr int64_t kPanelRows = 32;
// Values of k one pass of the panel GEMM takes (128 KiB of a panel's weights, in L2 while
// every row tile of x passes over it); each further slice adds to the outputs stored by the
// one before. 1024 rather than 256: the outputs are stored once per slice, and at batch 32
// a 32000-row head's 4 MB of them no longer make three round trips through memory
// (docs/BENCHMARKS.md, "Panel GEMM").
constexpr int64_t kPanelKSlice = 1024;

// Whole panels of an [n, k] matrix, and the index of its first tail row.
constexpr int64_t panel_count(int64_t n) {
  return n / kPanelRows;
}
constexpr int64_t panel_tail_begin(int64_t n) {
  return panel_count(n) * kPanelRows;
}

// Repacks a row-major f32 [n, k] matrix into out (n * k floats, not overlapping w).
void pack_panels(const float* w, int64_t n, int64_t k, float* out);

// Row `row` of a packed [n, k] matrix as k contiguous floats (an embedding lookup of a tied
// head).
void panel_row(const float* packed, int64_t n, int64_t k, int64_t row, float* out);

// Output columns of y = x[m, k] * w^T (+ bias[n]) for w packed [n, k], column c of row i at
// y[i * ldy + c] (ldy >= n: w may be a block of a wider matrix's rows): the columns of panels
// [panel_begin, panel_end) and, when `tail` is set, the tail rows' columns. Callers split
// panels across threads. Any m >= 1.
void panel_linear(const float* x, int64_t m, const Tensor& w, const float* bias, float* y,
                  int64_t ldy, int64_t panel_begin, int64_t panel_end, bool tail);

// The same with a given instruction set (tests run every one the CPU has). Throws when the
// CPU or the build lacks it.
void panel_linear_with(CpuIsa isa, const float* x, int64_t m, const Tensor& w, const float* bias,
                       float* y, int64_t ldy, int64_t panel_begin, int64_t panel_end, bool tail);

}  // namespace strata
