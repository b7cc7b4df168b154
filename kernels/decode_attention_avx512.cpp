// Decode attention's two passes for AVX-512F (decode_attention_simd.h).
#include <immintrin.h>

#include <utility>

#include "kernels/decode_attention_simd.h"

namespace strata::attention_detail {
namespace {

constexpr int kLanes = 16;
constexpr int kMaxChunks = 16;  // head_dim <= 256

template <DType DT>
__m512 load16(const void* rows, int64_t at) {
  if constexpr (DT == DType::kF32) {
    return _mm512_loadu_ps(static_cast<const float*>(rows) + at);
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(rows) + at)));
  }
}

// The four lane sums of a..d as one vector [sum a, sum b, sum c, sum d]: the halves folded
// once each, then three horizontal adds for all four rather than a full reduction each.
__m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  auto fold = [](__m512 x) {
    const __m256 lo = _mm512_castps512_ps256(x);
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
    return _mm256_add_ps(lo, hi);
  };
  const __m256 ab = _mm256_hadd_ps(fold(a), fold(b));
  const __m256 cd = _mm256_hadd_ps(fold(c), fold(d));
  const __m256 abcd = _mm256_hadd_ps(ab, cd);  // [a b c d | a b c d] halves of each sum
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

template <DType DT>
void scores(const float* q, const void* k, int32_t ctx, int32_t hd, float scale, float* out) {
  const int chunks = hd / kLanes;
  __m512 qv[kMaxChunks];
  for (int c = 0; c < chunks; ++c) qv[c] = _mm512_loadu_ps(q + c * kLanes);
  const __m128 s4 = _mm_set1_ps(scale);
  int32_t p = 0;
  for (; p + 4 <= ctx; p += 4) {
    __m512 acc[4];
    for (int i = 0; i < 4; ++i) {
      acc[i] = _mm512_setzero_ps();
      const int64_t row = int64_t{p + i} * hd;
      for (int c = 0; c < chunks; ++c)
        acc[i] = _mm512_fmadd_ps(qv[c], load16<DT>(k, row + c * kLanes), acc[i]);
    }
    _mm_storeu_ps(out + p, _mm_mul_ps(sum4(acc[0], acc[1], acc[2], acc[3]), s4));
  }
  for (; p < ctx; ++p) {
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < chunks; ++c)
      acc = _mm512_fmadd_ps(qv[c], load16<DT>(k, int64_t{p} * hd + c * kLanes), acc);
    out[p] = _mm512_reduce_add_ps(acc) * scale;
  }
}

template <DType DT, int Chunks>
void values(const float* w, const void* v, int32_t ctx, float* out) {
  constexpr int hd = Chunks * kLanes;
  __m512 acc[Chunks];
  for (int c = 0; c < Chunks; ++c) acc[c] = _mm512_setzero_ps();
  for (int32_t p = 0; p < ctx; ++p) {
    const __m512 wp = _mm512_set1_ps(w[p]);
    for (int c = 0; c < Chunks; ++c)
      acc[c] = _mm512_fmadd_ps(wp, load16<DT>(v, int64_t{p} * hd + c * kLanes), acc[c]);
  }
  for (int c = 0; c < Chunks; ++c) _mm512_storeu_ps(out + c * kLanes, acc[c]);
}

// The accumulators as a compile-time count (1..kMaxChunks), so they stay in registers.
template <DType DT, int... N>
void values_of(int chunks, const float* w, const void* v, int32_t ctx, float* out,
               std::integer_sequence<int, N...>) {
  (void)((chunks == N + 1 && (values<DT, N + 1>(w, v, ctx, out), true)) || ...);
}

template <DType DT>
void values_any(const float* w, const void* v, int32_t ctx, int32_t hd, float* out) {
  values_of<DT>(hd / kLanes, w, v, ctx, out, std::make_integer_sequence<int, kMaxChunks>{});
}

}  // namespace

bool avx512_decode_fits(int32_t head_dim, DType dtype) {
  return head_dim > 0 && head_dim % kLanes == 0 && head_dim <= kLanes * kMaxChunks &&
         (dtype == DType::kF32 || dtype == DType::kF16);
}

void decode_scores_avx512(const float* q, const void* k, DType dtype, int32_t ctx, int32_t head_dim,
                          float scale, float* out) {
  if (dtype == DType::kF16) {
    scores<DType::kF16>(q, k, ctx, head_dim, scale, out);
  } else {
    scores<DType::kF32>(q, k, ctx, head_dim, scale, out);
  }
}

void decode_values_avx512(const float* w, const void* v, DType dtype, int32_t ctx, int32_t head_dim,
                          float* out) {
  if (dtype == DType::kF16) {
    values_any<DType::kF16>(w, v, ctx, head_dim, out);
  } else {
    values_any<DType::kF32>(w, v, ctx, head_dim, out);
  }
}

}  // namespace strata::attention_detail
