// Element types. Storage may be f32, f16 or bf16; arithmetic always accumulates in f32.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace strata {

// kQ4: FlexGen's 4-bit group-wise weights (kernels/quant.h), a [rows, cols] matrix stored
// as one blob: the packed codes, then the f32 mins, then the f32 scales, grouped along rows
// by kQuantGroupSize. It has no per-element size: Tensor::bytes() knows its layout.
// kF32Panel: an f32 [rows, cols] matrix repacked for the CPU's GEMM (kernels/gemm_panel.h):
// the same values and bytes as f32 in another order, made at load for CPU compute only.
// kQ4Panel: a kQ4 matrix repacked for the CPU's 4-bit kernel (kernels/gemm_q4_panel.h), the
// same bytes a weight, made at load for CPU compute only; Tensor::bytes() knows its layout.
enum class DType : uint8_t {
  kF32 = 0,
  kF16 = 1,
  kBF16 = 2,
  kI32 = 3,
  kQ4 = 4,
  kF32Panel = 5,
  kQ4Panel = 6
};

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF32:
      return 4;
    case DType::kF16:
      return 2;
    case DType::kBF16:
      return 2;
    case DType::kI32:
      return 4;
    case DType::kQ4:
      return 0;
    case DType::kF32Panel:
      return 4;
    case DType::kQ4Panel:
      return 0;
  }
  return 0;
}

const char* dtype_name(DType t);
// Accepts "f32"/"float32", "f16"/"float16", "bf16"/"bfloat16", "i32".
std::optional<DType> parse_dtype(std::string_view name);

// Scalar conversions (reference; the kernels use F16C / AVX-512 where available).
inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN kept quiet
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

// x rounded to `t` (f16 or bf16) and back; x itself for any other type.
inline float round_to_dtype(float x, DType t) {
  if (t == DType::kBF16) return bf16_to_f32(f32_to_bf16(x));
  if (t == DType::kF16) return f16_to_f32(f32_to_f16(x));
  return x;
}

// Converts n elements of type `src_type` (f32, f16 or bf16) to f32, vectorised where the CPU
// allows: the tree's one to-f32 conversion.
void convert_to_f32(DType src_type, const void* src, float* dst, size_t n);
// Converts n f32 elements to `dst_type`.
void convert_from_f32(DType dst_type, const float* src, void* dst, size_t n);

}  // namespace strata
