// Weight-streaming GEMV for decode: y[m, n] = x[m, k] * w[n, k]^T for m <= kGemvMaxRows.
// Each weight row is read from memory once for all m activation rows (a few weight rows stay
// in L1 while 4-row tiles of x pass over them) and converted from f16/bf16 in registers, so
// small decode batches run at memory bandwidth whatever the storage dtype. Measured on the
// 2-core dev machine: 4x OpenBLAS's sgemm at m = 12, on par at m = 32 (docs/BENCHMARKS.md).
#pragma once

#include <cstdint>

#include "kernels/tensor.h"

namespace strata {

constexpr int64_t kGemvMaxRows = 16;

// Rows [n_begin, n_end) of the output; callers split n across threads.
void gemv_rows(const float* x, int64_t m, const Tensor& w, const float* bias, float* y,
               int64_t n_begin, int64_t n_end);

}  // namespace strata
