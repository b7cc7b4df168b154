// Weight-streaming GEMV for decode: y[m, n] = x[m, k] * w[n, k]^T for m <= kGemvMaxRows.
// Each weight row is read from memory once for all m activation rows and converted from
// f16/bf16 in registers, so small decode batches run at memory bandwidth whatever the
// storage dtype. The kernel is written once (gemv_kernel.h) and built for AVX2 and AVX-512;
// the widest the CPU has is chosen at run time (cpu_isa.h).
#pragma once

#include <cstdint>

#include "kernels/cpu_isa.h"
#include "kernels/tensor.h"

namespace strata {

constexpr int64_t kGemvMaxRows = 16;

// Rows [n_begin, n_end) of the output; callers split n across threads (in multiples of
// kGemvRowAlign where they can: the kernels stream that many weight rows together).
void gemv_rows(const float* x, int64_t m, const Tensor& w, const float* bias, float* y,
               int64_t n_begin, int64_t n_end);
constexpr int64_t kGemvRowAlign = 16;

// The same with a given instruction set (tests run every one the CPU has). Throws when
// the CPU or the build lacks it.
void gemv_rows_with(CpuIsa isa, const float* x, int64_t m, const Tensor& w, const float* bias,
                    float* y, int64_t n_begin, int64_t n_end);

}  // namespace strata
