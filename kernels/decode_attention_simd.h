// The two passes of a decode row's attention over one kv head's rows, written for AVX-512F
// (decode_attention_avx512.cpp) and for AVX2 + FMA + F16C (decode_attention_avx2.cpp), each
// file compiled for its instruction set whatever the build machine; the CPU backend calls
// the widest that active_cpu_isa() allows. Rows are read in position order, the way the
// hardware prefetcher streams them, and an f16 cache's rows are converted in registers.
// Internal to kernels/.
#pragma once

#include <cstdint>

#include "kernels/dtype.h"

namespace strata::attention_detail {

// The shapes the kernels take: head_dim a multiple of 16, at most 256 (its accumulators
// stay in registers). Elements kF32 or kF16.
bool avx512_decode_fits(int32_t head_dim, DType dtype);

// scores[p] = scale * (q . k[p]) for p in [0, ctx); k: [ctx, head_dim] elements of `dtype`.
void decode_scores_avx512(const float* q, const void* k, DType dtype, int32_t ctx, int32_t head_dim,
                          float scale, float* scores);

// out = sum_p w[p] v[p] over p in [0, ctx); v: [ctx, head_dim] elements of `dtype`.
void decode_values_avx512(const float* w, const void* v, DType dtype, int32_t ctx, int32_t head_dim,
                          float* out);

// One kv head's rows of a 4-bit cache as stored (KvQ4LayerView): position p's codes at
// codes + p * head_dim / 2 (two a byte, the even element in the low nibble), its groups'
// mins and scales at mins / scales + p * head_dim / group; element = code * scale + min.
struct Q4Rows {
  const uint8_t* codes;
  const float* mins;
  const float* scales;
  int32_t group;
};

// The passes straight from the codes, never writing a decoded row: per group,
// q . k = scale (q . codes) + min sum(q), and sum_p w_p v_p = sum_p (w_p scale) codes_p +
// sum_p w_p min. head_dim a multiple of 32, at most 256; groups of whole 32s that divide it.
bool avx512_q4_decode_fits(int32_t head_dim, int32_t group);
void decode_scores_q4_avx512(const float* q, const Q4Rows& k, int32_t ctx, int32_t head_dim,
                             float scale, float* scores);
void decode_values_q4_avx512(const float* w, const Q4Rows& v, int32_t ctx, int32_t head_dim,
                             float* out);
// The same for AVX2: head_dim a multiple of 16, at most 128; groups of 16, 32 or 64.
bool avx2_q4_decode_fits(int32_t head_dim, int32_t group);
void decode_scores_q4_avx2(const float* q, const Q4Rows& k, int32_t ctx, int32_t head_dim,
                           float scale, float* scores);
void decode_values_q4_avx2(const float* w, const Q4Rows& v, int32_t ctx, int32_t head_dim,
                           float* out);

// AVX2: head_dim a multiple of 8, any size (P·V runs over column blocks). Elements kF32 or
// kF16.
bool avx2_decode_fits(int32_t head_dim, DType dtype);
void decode_scores_avx2(const float* q, const void* k, DType dtype, int32_t ctx, int32_t head_dim,
                        float scale, float* scores);
void decode_values_avx2(const float* w, const void* v, DType dtype, int32_t ctx, int32_t head_dim,
                        float* out);

}  // namespace strata::attention_detail
