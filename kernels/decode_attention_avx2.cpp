// Decode attention's two passes for AVX2 + FMA + F16C (decode_attention_simd.h). Sixteen
// ymm registers cannot hold a whole head of 128 as the AVX-512 passes do, so the scores
// pass reads q from L1 beside each key chunk, and the P·V pass runs over column blocks of
// 64 dims, each block's accumulators in registers.
#include <immintrin.h>

#include <algorithm>
#include <utility>

#include "kernels/avx2_sum.h"
#include "kernels/decode_attention_simd.h"

namespace strata::attention_detail {
namespace {

constexpr int kLanes = 8;
constexpr int kBlockChunks = 8;  // a P·V column block: 64 dims, 8 accumulators

template <DType DT>
__m256 load8(const void* rows, int64_t at) {
  if constexpr (DT == DType::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(rows) + at);
  } else {
    return _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(rows) + at)));
  }
}

// [sum a, sum b, sum c, sum d]: two rounds of horizontal adds within each 128-bit half, then
// the halves added.
__m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

template <DType DT>
void scores(const float* q, const void* k, int32_t ctx, int32_t hd, float scale, float* out) {
  const int chunks = hd / kLanes;
  const __m128 s4 = _mm_set1_ps(scale);
  int32_t p = 0;
  for (; p + 4 <= ctx; p += 4) {
    const int64_t row = int64_t{p} * hd;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int c = 0; c < chunks; ++c) {
      const int64_t at = row + c * kLanes;
      const __m256 qc = _mm256_loadu_ps(q + c * kLanes);
      a0 = _mm256_fmadd_ps(qc, load8<DT>(k, at), a0);
      a1 = _mm256_fmadd_ps(qc, load8<DT>(k, at + hd), a1);
      a2 = _mm256_fmadd_ps(qc, load8<DT>(k, at + 2 * int64_t{hd}), a2);
      a3 = _mm256_fmadd_ps(qc, load8<DT>(k, at + 3 * int64_t{hd}), a3);
    }
    _mm_storeu_ps(out + p, _mm_mul_ps(sum4(a0, a1, a2, a3), s4));
  }
  for (; p < ctx; ++p) {
    __m256 acc = _mm256_setzero_ps();
    for (int c = 0; c < chunks; ++c)
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + c * kLanes),
                            load8<DT>(k, int64_t{p} * hd + c * kLanes), acc);
    out[p] = gemv_detail::sum8(acc) * scale;
  }
}

// out[0, Chunks * 8) = sum_p w[p] v[p][0, Chunks * 8) for rows of `hd` elements.
template <DType DT, int Chunks>
void value_block(const float* w, const void* v, int32_t ctx, int32_t hd, float* out) {
  __m256 acc[Chunks];
  for (int c = 0; c < Chunks; ++c) acc[c] = _mm256_setzero_ps();
  for (int32_t p = 0; p < ctx; ++p) {
    const __m256 wp = _mm256_set1_ps(w[p]);
    for (int c = 0; c < Chunks; ++c)
      acc[c] = _mm256_fmadd_ps(wp, load8<DT>(v, int64_t{p} * hd + c * kLanes), acc[c]);
  }
  for (int c = 0; c < Chunks; ++c) _mm256_storeu_ps(out + c * kLanes, acc[c]);
}

// The block's accumulators as a compile-time count (1..kBlockChunks).
template <DType DT, int... N>
void value_block_of(int chunks, const float* w, const void* v, int32_t ctx, int32_t hd, float* out,
                    std::integer_sequence<int, N...>) {
  (void)((chunks == N + 1 && (value_block<DT, N + 1>(w, v, ctx, hd, out), true)) || ...);
}

template <DType DT>
void values(const float* w, const void* v, int32_t ctx, int32_t hd, float* out) {
  const int64_t elem = DT == DType::kF32 ? 4 : 2;
  for (int32_t c0 = 0; c0 < hd / kLanes; c0 += kBlockChunks) {
    const int chunks = std::min(kBlockChunks, hd / kLanes - c0);
    const void* block = static_cast<const char*>(v) + int64_t{c0} * kLanes * elem;
    value_block_of<DT>(chunks, w, block, ctx, hd, out + c0 * kLanes,
                       std::make_integer_sequence<int, kBlockChunks>{});
  }
}

}  // namespace

bool avx2_decode_fits(int32_t head_dim, DType dtype) {
  return head_dim > 0 && head_dim % kLanes == 0 && (dtype == DType::kF32 || dtype == DType::kF16);
}

void decode_scores_avx2(const float* q, const void* k, DType dtype, int32_t ctx, int32_t head_dim,
                        float scale, float* out) {
  if (dtype == DType::kF16) {
    scores<DType::kF16>(q, k, ctx, head_dim, scale, out);
  } else {
    scores<DType::kF32>(q, k, ctx, head_dim, scale, out);
  }
}

void decode_values_avx2(const float* w, const void* v, DType dtype, int32_t ctx, int32_t head_dim,
                        float* out) {
  if (dtype == DType::kF16) {
    values<DType::kF16>(w, v, ctx, head_dim, out);
  } else {
    values<DType::kF32>(w, v, ctx, head_dim, out);
  }
}

}  // namespace strata::attention_detail
