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

// ---- a 4-bit cache, straight from its codes (as the AVX-512 passes) ----
constexpr int kCodeChunk = 16;     // the elements of 8 code bytes: one vpmovzxbd each
constexpr int kMaxCodeChunks = 8;  // head_dim <= 128

// The 16 elements of an 8-byte code chunk: the even ones (low nibbles) and the odd ones.
inline void codes16(const uint8_t* p, __m256& even, __m256& odd) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  even = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(0x0F)));
  odd = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}

// x[0..16) split as codes16 splits a chunk.
inline void deinterleave16(const float* x, __m256& even, __m256& odd) {
  const __m256 a = _mm256_loadu_ps(x), b = _mm256_loadu_ps(x + kLanes);
  auto in_order = [](__m256 v) {  // [x0 x2 x8 x10 | x4 x6 x12 x14] -> x0 x2 x4 ... x14
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(v), _MM_SHUFFLE(3, 1, 2, 0)));
  };
  even = in_order(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)));
  odd = in_order(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Positions p .. p + N - 1 as the AVX-512 q4_dot: vectors whose lanes sum to
// sum_g scale_g (q_g . codes_g), and mterm[i] = sum_g min_g sum(q_g).
template <int N, int Chunks, int PerGroup>
inline void q4_dot(const __m256* qe, const __m256* qo, const float* qsum, const Q4Rows& k,
                   int64_t p, __m256* acc, float* mterm) {
  constexpr int kGroups = Chunks / PerGroup;
  for (int i = 0; i < N; ++i) {
    const uint8_t* row = k.codes + (p + i) * Chunks * (kCodeChunk / 2);
    acc[i] = _mm256_setzero_ps();
    mterm[i] = 0.0f;
    for (int g = 0; g < kGroups; ++g) {
      __m256 ge = _mm256_setzero_ps(), go = _mm256_setzero_ps();
      for (int c = g * PerGroup; c < (g + 1) * PerGroup; ++c) {
        __m256 even, odd;
        codes16(row + c * (kCodeChunk / 2), even, odd);
        ge = _mm256_fmadd_ps(qe[c], even, ge);
        go = _mm256_fmadd_ps(qo[c], odd, go);
      }
      const int64_t gi = (p + i) * kGroups + g;
      acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(k.scales[gi]), _mm256_add_ps(ge, go), acc[i]);
      mterm[i] += k.mins[gi] * qsum[g];
    }
  }
}

template <int Chunks, int PerGroup>
void scores_q4(const float* q, const Q4Rows& k, int32_t ctx, float scale, float* out) {
  __m256 qe[Chunks], qo[Chunks];
  float qsum[Chunks / PerGroup] = {};
  for (int c = 0; c < Chunks; ++c) {
    deinterleave16(q + c * kCodeChunk, qe[c], qo[c]);
    qsum[c / PerGroup] += gemv_detail::sum8(_mm256_add_ps(qe[c], qo[c]));
  }
  int32_t p = 0;
  for (; p + 4 <= ctx; p += 4) {
    __m256 acc[4];
    float mt[4];
    q4_dot<4, Chunks, PerGroup>(qe, qo, qsum, k, p, acc, mt);
    const __m128 dots = _mm_add_ps(sum4(acc[0], acc[1], acc[2], acc[3]), _mm_loadu_ps(mt));
    _mm_storeu_ps(out + p, _mm_mul_ps(dots, _mm_set1_ps(scale)));
  }
  for (; p < ctx; ++p) {
    __m256 acc;
    float mt;
    q4_dot<1, Chunks, PerGroup>(qe, qo, qsum, k, p, &acc, &mt);
    out[p] = (gemv_detail::sum8(acc) + mt) * scale;
  }
}

// P V with the accumulators split even / odd as the codes are, interleaved back at the end,
// each group's sum_p w_p min added to all its elements.
template <int Chunks, int PerGroup>
void values_q4(const float* w, const Q4Rows& v, int32_t ctx, float* out) {
  constexpr int kGroups = Chunks / PerGroup;
  __m256 ae[Chunks], ao[Chunks];
  for (int c = 0; c < Chunks; ++c) ae[c] = ao[c] = _mm256_setzero_ps();
  float mterm[kGroups] = {};
  for (int32_t p = 0; p < ctx; ++p) {
    const uint8_t* row = v.codes + int64_t{p} * Chunks * (kCodeChunk / 2);
    for (int g = 0; g < kGroups; ++g) {
      const int64_t gi = int64_t{p} * kGroups + g;
      const __m256 ws = _mm256_set1_ps(w[p] * v.scales[gi]);
      mterm[g] += w[p] * v.mins[gi];
      for (int c = g * PerGroup; c < (g + 1) * PerGroup; ++c) {
        __m256 even, odd;
        codes16(row + c * (kCodeChunk / 2), even, odd);
        ae[c] = _mm256_fmadd_ps(ws, even, ae[c]);
        ao[c] = _mm256_fmadd_ps(ws, odd, ao[c]);
      }
    }
  }
  for (int c = 0; c < Chunks; ++c) {
    const __m256 m = _mm256_set1_ps(mterm[c / PerGroup]);
    const __m256 lo = _mm256_unpacklo_ps(ae[c], ao[c]);  // e0 o0 e1 o1 | e4 o4 e5 o5
    const __m256 hi = _mm256_unpackhi_ps(ae[c], ao[c]);  // e2 o2 e3 o3 | e6 o6 e7 o7
    _mm256_storeu_ps(out + c * kCodeChunk, _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), m));
    _mm256_storeu_ps(out + c * kCodeChunk + kLanes,
                     _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x31), m));
  }
}

template <int Chunks, int PerGroup>
struct Q4Passes {
  static void scores(const float* q, const Q4Rows& k, int32_t ctx, float scale, float* out) {
    scores_q4<Chunks, PerGroup>(q, k, ctx, scale, out);
  }
  static void values(const float* w, const Q4Rows& v, int32_t ctx, float* out) {
    values_q4<Chunks, PerGroup>(w, v, ctx, out);
  }
};

// Calls `call` with the Q4Passes of the head's shape (groups of 16, 32 or 64 elements:
// PerGroup 1, 2 or 4 code chunks), as avx2_q4_decode_fits checks it.
template <int PerGroup, class Call, int... N>
bool with_q4_group(int chunks, Call call, std::integer_sequence<int, N...>) {
  return (
      (chunks == (N + 1) * PerGroup && (call(Q4Passes<(N + 1) * PerGroup, PerGroup>{}), true)) ||
      ...);
}
template <class Call>
void with_q4_shape(int chunks, int per_group, Call call) {
  if (per_group == 1) with_q4_group<1>(chunks, call, std::make_integer_sequence<int, 8>{});
  if (per_group == 2) with_q4_group<2>(chunks, call, std::make_integer_sequence<int, 4>{});
  if (per_group == 4) with_q4_group<4>(chunks, call, std::make_integer_sequence<int, 2>{});
}

}  // namespace

bool avx2_q4_decode_fits(int32_t head_dim, int32_t group) {
  return head_dim > 0 && head_dim % kCodeChunk == 0 && head_dim <= kCodeChunk * kMaxCodeChunks &&
         (group == kCodeChunk || group == 2 * kCodeChunk || group == 4 * kCodeChunk) &&
         head_dim % group == 0;
}

void decode_scores_q4_avx2(const float* q, const Q4Rows& k, int32_t ctx, int32_t head_dim,
                           float scale, float* out) {
  with_q4_shape(head_dim / kCodeChunk, k.group / kCodeChunk,
                [&](auto passes) { passes.scores(q, k, ctx, scale, out); });
}

void decode_values_q4_avx2(const float* w, const Q4Rows& v, int32_t ctx, int32_t head_dim,
                           float* out) {
  with_q4_shape(head_dim / kCodeChunk, v.group / kCodeChunk,
                [&](auto passes) { passes.values(w, v, ctx, out); });
}

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
