// FlexGen's group-wise asymmetric 4-bit quantization (paper section 5; Shen et al. 2020):
// `group_size` consecutive elements along one axis share a min and a scale,
//   scale = (max - min) / 15,   q = clamp(round((x - min) / scale), 0, 15),   x' = q * scale + min,
// so every value comes back within scale / 2 (a group of equal values: scale 0, q 0, exact).
// The goal, as in FlexGen, is compression and less I/O, not integer arithmetic: tensors are
// stored packed and dequantised to f32 right before use (linear_4bit does it in registers).
//
// Storage (what differs from FlexGen's compression.py, and why):
//  - Codes: two per byte over the row-major element order, the even index in the LOW nibble
//    (FlexGen puts it in the high one). Columns must be even so every row is a whole byte
//    range [row * cols / 2, (row + 1) * cols / 2): a slice of rows streams as one memcpy.
//  - min and scale: f32 (FlexGen: f16, storing 15 / (max - min) and dividing). 8 bytes per
//    group, 5 bits per value at group 64 instead of 4.5, bought for an exact bound: an f16 min
//    is off by up to half an f16 ulp of the group's values (and would have to be rounded
//    downwards to keep the bound), constant groups would not be exact, and values beyond
//    65504 would overflow. Rows keep the same byte addressing either way.
//  - The group size must divide the grouped dimension (FlexGen pads a ragged last group).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cpu_isa.h"
#include "kernels/tensor.h"

namespace strata {

constexpr int64_t kQuantGroupSize = 64;  // FlexGen's choice for both weights and KV cache
constexpr int kQuantLevels = 15;         // 2^4 - 1

// Which way a group runs through a row-major [rows, cols] matrix.
//
// FlexGen groups weights "along the output channel" (group_dim=0 of a PyTorch [out, in]
// weight: 64 output channels sharing one input index, a strided group) and the KV cache
// "along the hidden dimension" (group_dim=2 of [seq, batch*heads, head_dim]: contiguous).
// For a decode GEMV over a row-major weight [n_out, k_in], the efficient grouping is the
// contiguous one, kAlongRow: each output channel's row carries its own groups of 64 input
// weights, so one row dequantises alone from its bytes and its k_in / 64 (min, scale) pairs
// while it is multiplied, and threads split output channels with no shared state. This is
// "per output channel" statistics (as GPTQ/AWQ/llama.cpp do) rather than FlexGen's literal
// strided group; kAlongColumn keeps the literal FlexGen layout for comparison and for
// tensors that are consumed column-wise. KV cache [positions, head_dim]: kAlongRow.
enum class QuantAxis : uint8_t {
  kAlongRow = 0,     // group = group_size consecutive elements of one row; cols % group_size == 0
  kAlongColumn = 1,  // group = group_size consecutive rows of one column; rows % group_size == 0
};

const char* quant_axis_name(QuantAxis axis);

struct QuantLayout {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t group_size = kQuantGroupSize;
  QuantAxis axis = QuantAxis::kAlongRow;

  int64_t numel() const { return rows * cols; }
  int64_t n_groups() const { return group_size > 0 ? numel() / group_size : 0; }
  std::string str() const;  // "q4[4096, 4096] g64 along rows"
};

// Throws InputError naming the sizes unless: rows, cols >= 0; cols even; group_size even and
// positive; group_size divides the grouped dimension (cols along rows, rows along columns).
void check_quant_layout(const QuantLayout& layout);

// One group of n (even) contiguous values: codes (n / 2 bytes), its min and scale. A
// non-finite value encodes the group as zeros with a zero scale (the KV cache must not throw
// mid-step; the attention that follows then sees the zeros).
void quantize_group(const float* x, int64_t n, uint8_t* codes, float* min, float* scale);
void dequantize_group(const uint8_t* codes, int64_t n, float min, float scale, float* out);

// Bytes a tensor of this layout occupies: numel / 2 codes + 8 per group. For the planner.
size_t quantized_bytes(const QuantLayout& layout);
// The bytes of one element on average, codes and its share of its group's min and scale
// (0.625 for groups of 64): a matrix of whole groups takes numel times this.
double quantized_bytes_per_element(int64_t group_size = kQuantGroupSize);

// A non-owning view of quantised storage (e.g. a kQ4 tensor inside a packed layer).
struct QuantView {
  QuantLayout layout;
  const uint8_t* packed = nullptr;
  const float* mins = nullptr;
  const float* scales = nullptr;
};

struct QuantizedTensor {
  QuantLayout layout;
  Buffer packed;  // numel / 2 bytes, row-major, even index in the low nibble
  Buffer mins;    // f32[n_groups]: along rows [rows, cols / g]; along columns [rows / g, cols]
  Buffer scales;  // f32[n_groups], same order

  size_t bytes() const { return packed.size() + mins.size() + scales.size(); }
  QuantView view() const {
    return {layout, packed.as<const uint8_t>(), mins.as<const float>(), scales.as<const float>()};
  }
};

// A kQ4 tensor [rows, cols] (dtype.h) seen as quantised storage grouped along rows, and the
// reverse: a quantised tensor written into such a blob (`blob` holds Tensor::bytes()).
QuantView q4_view(const Tensor& t);
void write_q4_blob(const QuantizedTensor& q, void* blob);

// Zeroed storage for `layout` (checked); fill it with quantize_rows.
QuantizedTensor allocate_quantized(const QuantLayout& layout);

// Quantises x[rows, cols] (row-major) into a new tensor. Non-finite values, or a group whose
// range overflows f32, throw InputError naming the group.
QuantizedTensor quantize_4bit(const float* x, const QuantLayout& layout);

// Quantises x[n_rows, cols] into rows [row_begin, row_begin + n_rows) of t, overwriting them;
// for appending to a preallocated quantized KV cache. Along columns, the range must cover
// whole groups (row_begin and n_rows multiples of group_size).
void quantize_rows(const float* x, int64_t row_begin, int64_t n_rows, QuantizedTensor& t);

// out[rows, cols] = dequantised t.
void dequantize_4bit(const QuantizedTensor& t, float* out);
// out[n_rows, cols] = rows [row_begin, row_begin + n_rows) of the dequantised t (streaming).
void dequantize_rows(const QuantizedTensor& t, int64_t row_begin, int64_t n_rows, float* out);
void dequantize_rows(const QuantView& t, int64_t row_begin, int64_t n_rows, float* out);
// One row on the calling thread: no parallel region of its own, for a caller inside one.
void dequantize_one_row(const QuantView& t, int64_t row, float* out);

// y[m, n] = x[m, k] * dequant(w)^T (+ bias[n]) for w [n, k] grouped along rows, reading
// each code once from memory and never converting it to a float: for groups of 64 the
// AVX-512 VNNI or AVX2 kernel of gemv_q4_kernel.h multiplies the codes as bytes with x
// split into two int8 parts (x exact to max|x_group| / 65024), other group sizes run a
// scalar loop. OpenMP splits the output rows. Meant for decode (small m); for a long
// prefill, dequantize_rows a block into f32 and use the GEMM.
void linear_4bit(const float* x, int64_t m, const QuantizedTensor& w, const float* bias, float* y);
void linear_4bit(const float* x, int64_t m, const QuantView& w, const float* bias, float* y);

// linear_4bit's per-call scratch (x's group sums, x split for the vector kernels). A
// caller that owns one reserves it for its largest call and passes it, so no call allocates;
// the overloads above use one per thread that grows on demand.
struct Linear4bitScratch {
  std::vector<float> xsum;    // [m, k / g]
  std::vector<float> xscale;  // [m, k / 64]
  std::vector<int8_t> xq;     // [m, 2k]: x's two int8 parts
  void reserve(int64_t m, int64_t k, int64_t group_size);
  size_t bytes() const {
    return (xsum.capacity() + xscale.capacity()) * sizeof(float) + xq.capacity();
  }
};
void linear_4bit(const float* x, int64_t m, const QuantView& w, const float* bias, float* y,
                 Linear4bitScratch& scratch);
// The same with a given instruction set (the CPU backend's choice; tests run each). One
// the CPU lacks must not be asked for (cpu_isa.h says what it has).
void linear_4bit(const float* x, int64_t m, const QuantView& w, const float* bias, float* y,
                 Linear4bitScratch& scratch, CpuIsa isa);

}  // namespace strata
