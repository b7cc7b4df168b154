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

// ---- a 4-bit cache, straight from its codes ----
constexpr int kCodeChunk = 32;     // the elements of 16 code bytes: one vpmovzxbd each
constexpr int kMaxCodeChunks = 8;  // head_dim <= 256

// The 32 elements of a 16-byte code chunk as two vectors: the even elements (low nibbles)
// and the odd ones (high nibbles), each in byte order.
inline void codes32(const uint8_t* p, __m512& even, __m512& odd) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  even = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0x0F)));
  odd = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}

// x[0..32) split as codes32 splits a chunk: even = x[0], x[2], ..., odd = x[1], x[3], ...
inline void deinterleave32(const float* x, __m512& even, __m512& odd) {
  const __m512i ie = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i io = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + kLanes);
  even = _mm512_permutex2var_ps(a, ie, b);
  odd = _mm512_permutex2var_ps(a, io, b);
}

// Positions p .. p + N - 1's dot products with q (split by deinterleave32), before the
// scale: vectors whose lanes sum to sum_g scale_g (q_g . codes_g), and mterm[i] = sum_g
// min_g sum(q_g). Unrolled at compile time, with the even and odd halves in separate chains,
// so the positions' FMAs overlap rather than wait on each other.
template <int N, int Chunks, int PerGroup>
inline void q4_dot(const __m512* qe, const __m512* qo, const float* qsum, const Q4Rows& k,
                   int64_t p, __m512* acc, float* mterm) {
  constexpr int kGroups = Chunks / PerGroup;
  for (int i = 0; i < N; ++i) {
    const uint8_t* row = k.codes + (p + i) * Chunks * (kCodeChunk / 2);
    acc[i] = _mm512_setzero_ps();
    mterm[i] = 0.0f;
    for (int g = 0; g < kGroups; ++g) {
      __m512 ge = _mm512_setzero_ps(), go = _mm512_setzero_ps();
      for (int c = g * PerGroup; c < (g + 1) * PerGroup; ++c) {
        __m512 even, odd;
        codes32(row + c * (kCodeChunk / 2), even, odd);
        ge = _mm512_fmadd_ps(qe[c], even, ge);
        go = _mm512_fmadd_ps(qo[c], odd, go);
      }
      const int64_t gi = (p + i) * kGroups + g;
      acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(k.scales[gi]), _mm512_add_ps(ge, go), acc[i]);
      mterm[i] += k.mins[gi] * qsum[g];
    }
  }
}

template <int Chunks, int PerGroup>
void scores_q4(const float* q, const Q4Rows& k, int32_t ctx, float scale, float* out) {
  __m512 qe[Chunks], qo[Chunks];
  float qsum[Chunks / PerGroup] = {};
  for (int c = 0; c < Chunks; ++c) {
    deinterleave32(q + c * kCodeChunk, qe[c], qo[c]);
    qsum[c / PerGroup] += _mm512_reduce_add_ps(_mm512_add_ps(qe[c], qo[c]));
  }
  int32_t p = 0;
  for (; p + 4 <= ctx; p += 4) {
    __m512 acc[4];
    float mt[4];
    q4_dot<4, Chunks, PerGroup>(qe, qo, qsum, k, p, acc, mt);
    const __m128 dots = _mm_add_ps(sum4(acc[0], acc[1], acc[2], acc[3]), _mm_loadu_ps(mt));
    _mm_storeu_ps(out + p, _mm_mul_ps(dots, _mm_set1_ps(scale)));
  }
  for (; p < ctx; ++p) {
    __m512 acc;
    float mt;
    q4_dot<1, Chunks, PerGroup>(qe, qo, qsum, k, p, &acc, &mt);
    out[p] = (_mm512_reduce_add_ps(acc) + mt) * scale;
  }
}

// Position p's term of P V added into ae / ao (even / odd elements of each code chunk, as
// codes32 splits them), its groups' w_p min into mterm.
template <int Chunks, int PerGroup>
inline void q4_weigh(float wp, const Q4Rows& v, int64_t p, __m512* ae, __m512* ao, float* mterm) {
  constexpr int kGroups = Chunks / PerGroup;
  const uint8_t* row = v.codes + p * Chunks * (kCodeChunk / 2);
  for (int g = 0; g < kGroups; ++g) {
    const int64_t gi = p * kGroups + g;
    const __m512 ws = _mm512_set1_ps(wp * v.scales[gi]);
    mterm[g] += wp * v.mins[gi];
    for (int c = g * PerGroup; c < (g + 1) * PerGroup; ++c) {
      __m512 even, odd;
      codes32(row + c * (kCodeChunk / 2), even, odd);
      ae[c] = _mm512_fmadd_ps(ws, even, ae[c]);
      ao[c] = _mm512_fmadd_ps(ws, odd, ao[c]);
    }
  }
}

// P V with the accumulators split even / odd as the codes are, interleaved back once at the
// end, each group's sum_p w_p min added to all its elements. Heads of up to 4 chunks take
// even and odd positions into two sets of accumulators: one set's FMA chains alone would
// wait on their latency.
template <int Chunks, int PerGroup>
void values_q4(const float* w, const Q4Rows& v, int32_t ctx, float* out) {
  constexpr int kSets = Chunks <= 4 ? 2 : 1;
  constexpr int kGroups = Chunks / PerGroup;
  __m512 ae[kSets][Chunks], ao[kSets][Chunks];
  for (int s = 0; s < kSets; ++s)
    for (int c = 0; c < Chunks; ++c) ae[s][c] = ao[s][c] = _mm512_setzero_ps();
  float mterm[kGroups] = {};
  int32_t p = 0;
  for (; p + kSets <= ctx; p += kSets)
    for (int s = 0; s < kSets; ++s)
      q4_weigh<Chunks, PerGroup>(w[p + s], v, p + s, ae[s], ao[s], mterm);
  for (; p < ctx; ++p) q4_weigh<Chunks, PerGroup>(w[p], v, p, ae[0], ao[0], mterm);
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  for (int c = 0; c < Chunks; ++c) {
    __m512 e = ae[0][c], o = ao[0][c];
    if constexpr (kSets == 2) {
      e = _mm512_add_ps(e, ae[1][c]);
      o = _mm512_add_ps(o, ao[1][c]);
    }
    const __m512 m = _mm512_set1_ps(mterm[c / PerGroup]);
    _mm512_storeu_ps(out + c * kCodeChunk, _mm512_add_ps(_mm512_permutex2var_ps(e, lo, o), m));
    _mm512_storeu_ps(out + c * kCodeChunk + kLanes,
                     _mm512_add_ps(_mm512_permutex2var_ps(e, hi, o), m));
  }
}

// Both passes for a head of Chunks code chunks in groups of PerGroup (1: groups of 32, 2:
// of 64), their loops unrolled at compile time.
template <int Chunks, int PerGroup>
struct Q4Passes {
  static void scores(const float* q, const Q4Rows& k, int32_t ctx, float scale, float* out) {
    scores_q4<Chunks, PerGroup>(q, k, ctx, scale, out);
  }
  static void values(const float* w, const Q4Rows& v, int32_t ctx, float* out) {
    values_q4<Chunks, PerGroup>(w, v, ctx, out);
  }
};

// Calls F<Chunks, PerGroup>::run-like `call` for the head's shape (checked by
// avx512_q4_decode_fits).
template <class Call, int... N>
void with_q4_shape(int chunks, int per_group, Call call, std::integer_sequence<int, N...>) {
  const bool done =
      ((chunks == N + 1 && per_group == 1 && (call(Q4Passes<N + 1, 1>{}), true)) || ...) ||
      ((chunks == N + 1 && per_group == 2 && (N + 1) % 2 == 0 &&
        (call(Q4Passes < (N + 1) % 2 == 0 ? N + 1 : 2, 2 > {}), true)) ||
       ...);
  (void)done;
}

}  // namespace

bool avx512_q4_decode_fits(int32_t head_dim, int32_t group) {
  return head_dim > 0 && head_dim % kCodeChunk == 0 && head_dim <= kCodeChunk * kMaxCodeChunks &&
         (group == kCodeChunk || group == 2 * kCodeChunk) && head_dim % group == 0;
}

void decode_scores_q4_avx512(const float* q, const Q4Rows& k, int32_t ctx, int32_t head_dim,
                             float scale, float* out) {
  with_q4_shape(
      head_dim / kCodeChunk, k.group / kCodeChunk,
      [&](auto passes) { passes.scores(q, k, ctx, scale, out); },
      std::make_integer_sequence<int, kMaxCodeChunks>{});
}

void decode_values_q4_avx512(const float* w, const Q4Rows& v, int32_t ctx, int32_t head_dim,
                             float* out) {
  with_q4_shape(
      head_dim / kCodeChunk, v.group / kCodeChunk,
      [&](auto passes) { passes.values(w, v, ctx, out); },
      std::make_integer_sequence<int, kMaxCodeChunks>{});
}

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
