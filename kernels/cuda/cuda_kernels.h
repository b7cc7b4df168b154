// Launchers for the CUDA backend's device kernels (cuda_kernels.cu). Plain C++17 with no
// CUDA includes, so the C++20 backend class (cuda_backend.cpp) can call into nvcc-compiled
// code without nvcc ever seeing a C++20 header: pointers are device pointers, a stream is
// a cudaStream_t passed as void*, and every launcher returns the cudaError_t of its
// launch (as an int inside KernelStatus) for the caller's status check. Launchers never
// synchronise, log or throw.
#pragma once

#include <cstdint>

namespace strata::cuda_kernels {

using StreamHandle = void*;  // a cudaStream_t

// cudaError_t of a launch (cudaGetLastError() right after it); 0 is cudaSuccess.
struct KernelStatus {
  int cuda_error = 0;
};

enum class ElemType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

// Whether a pointer takes 16-byte (float4 / uint4) accesses.
inline bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// One new row of a ragged batch, flattened on the host from the SeqSlices: activation row
// `row` is the token at position `pos` of the sequence in KV cache slot `slot`.
struct RowDesc {
  int32_t row;
  int32_t slot;
  int32_t pos;
};

// Whether the kernels the current device runs were built with programmatic dependent launch's
// waits (wait_for_inputs(), PTX for compute capability 9.0 on). A build for sm_80 only runs on
// an H100 from compute_80 PTX, whose kernels do not wait: launched with PDL they would read
// what the kernel before them is still writing. False where the runtime cannot say.
bool kernels_wait_for_inputs();

// Largest head_dim the attention kernel accepts (its per-thread accumulators are fixed).
constexpr int kMaxAttentionHeadDim = 512;

// y[r, c] += bias[c] for r < m, c < n.
KernelStatus add_bias(float* y, const float* bias, int64_t m, int64_t n, StreamHandle stream);
// dst[i] = round_to_nearest_even(src[i]) as f16 or bf16 (dst_type != kF32).
KernelStatus f32_to_half(const float* src, void* dst, ElemType dst_type, int64_t n,
                         StreamHandle stream);
// dst[i] = f16(code(i) * scales[i / 64] + mins[i / 64]) over a kQ4 matrix of n elements
// (kernels/quant.h: codes two per byte, even index in the low nibble; groups of 64 along rows).
KernelStatus dequantize_q4_to_f16(const unsigned char* packed, const float* mins,
                                  const float* scales, unsigned short* dst, int64_t n,
                                  StreamHandle stream);
// y[i, :] = table[ids[i], :]; rows with an id outside [0, vocab) are written as zeros.
KernelStatus embedding(const int32_t* ids, int64_t n, const void* table, ElemType type,
                       int64_t vocab, int64_t h, float* y, StreamHandle stream);
// The same from a kQ4 table [vocab, h] (h a multiple of 64; codes, mins, scales as quant.h).
KernelStatus embedding_q4(const int32_t* ids, int64_t n, const unsigned char* packed,
                          const float* mins, const float* scales, int64_t vocab, int64_t h,
                          float* y, StreamHandle stream);
// With `overlap`, the norms and kv_store are launched with programmatic dependent launch
// (as GemvMode::overlap).
KernelStatus rms_norm(const float* x, int64_t m, int64_t h, const float* weight, float eps,
                      float* y, StreamHandle stream, bool overlap = false);
KernelStatus layer_norm(const float* x, int64_t m, int64_t h, const float* weight,
                        const float* bias, float eps, float* y, StreamHandle stream,
                        bool overlap = false);
// Rotate-half rope in place on x[m, n_heads * head_dim]; rows whose position lies outside
// [0, max_positions) are left untouched.
KernelStatus rope(float* x, int64_t m, int32_t n_heads, int32_t head_dim, const int32_t* positions,
                  const float* cos_table, const float* sin_table, int32_t max_positions,
                  StreamHandle stream);
KernelStatus silu_mul(const float* gate, const float* up, float* out, int64_t n,
                      StreamHandle stream);
KernelStatus gelu_tanh_mul(const float* gate, const float* up, float* out, int64_t n,
                           StreamHandle stream);
// x = s x, then (cap > 0) x = cap tanh(x / cap).
KernelStatus scale_softcap(float* x, int64_t n, float s, float cap, StreamHandle stream);
KernelStatus relu(float* x, int64_t n, StreamHandle stream);
KernelStatus add(float* y, const float* x, int64_t n, StreamHandle stream);
// out[i, :] = x[rows[i], :]; and out[rows[i], :] += weights[i] * y[i, :] (rows distinct).
KernelStatus gather_rows(const float* x, int64_t width, const int32_t* rows, int64_t n, float* out,
                         StreamHandle stream);
KernelStatus scatter_add_rows(const float* y, int64_t width, const int32_t* rows,
                              const float* weights, int64_t n, float* out, StreamHandle stream);
KernelStatus softmax(float* x, int64_t m, int64_t n, StreamHandle stream);

// Cache layout as KvLayerView: [slot][kv_head][capacity][head_dim], elements f32 or f16
// (policy cf16: stored rounded to nearest even, read widened to f32).
struct KvCacheDesc {
  void* k;
  void* v;
  int32_t n_kv_heads;
  int32_t head_dim;
  int64_t slot_stride;             // elements
  int64_t head_stride;             // elements
  ElemType elem = ElemType::kF32;  // kF32 or kF16
};

// Writes k/v rows ([*, n_kv_heads * head_dim]) of every RowDesc into the cache.
KernelStatus kv_store(const float* k, const float* v, const RowDesc* rows, int64_t n_rows,
                      const KvCacheDesc& cache, StreamHandle stream, bool overlap = false);
// A 4-bit KV cache blob pair (backend.h's KvQ4LayerView).
struct KvQ4Desc {
  void* k;
  void* v;
  int64_t rows;  // n_slots * n_kv_heads * capacity
  int32_t n_kv_heads;
  int32_t capacity;
  int32_t head_dim;
  int32_t group;
  int64_t codes_bytes;  // KvQ4LayerView::codes_bytes(): where the mins begin
};
// Quantises the k/v rows of every RowDesc into the 4-bit cache (one thread per group).
KernelStatus kv_store_q4(const float* k, const float* v, const RowDesc* rows, int64_t n_rows,
                         const KvQ4Desc& cache, StreamHandle stream);
// Every row of the 4-bit cache into f32 k_out / v_out ([rows, head_dim] each).
KernelStatus kv_dequantize(const KvQ4Desc& cache, float* k_out, float* v_out, StreamHandle stream);
// Causal attention: row d attends over cache positions 0 .. d.pos of its slot. One block
// per (row, head); head_dim <= kMaxAttentionHeadDim.
KernelStatus attention(const float* q, const RowDesc* rows, int64_t n_rows,
                       const KvCacheDesc& cache, int32_t n_heads, float scale, float* out,
                       StreamHandle stream);
// The same over a 4-bit cache, each key and value element decoded from its code as it is
// read: only the positions a row attends over are touched, never an f32 copy of the layer.
KernelStatus attention_q4(const float* q, const RowDesc* rows, int64_t n_rows,
                          const KvQ4Desc& cache, int32_t n_heads, float scale, float* out,
                          StreamHandle stream);

// ---- Decode-path kernels (cuda_decode_kernels.cu) ----

// Most activation rows the fused GEMVs take; more rows go to cuBLAS's tensor-core GEMM (for
// half weights cuBLAS was as fast or faster from 4 rows on: docs/journal/gpu-history.md).
constexpr int kMaxGemvRowsHalf = 1;
constexpr int kMaxGemvRowsQ4 = 8;
// What a fused GEMV does with x w^T + bias: store it, store its ReLU (OPT's fc1), or add it
// to what y holds (the residual after the output and down projections), so the op that
// follows a linear costs no kernel of its own.
enum class GemvEpilogue : int { kStore = 0, kRelu = 1, kAccumulate = 2 };
// One matrix of a GEMV launch, which reads up to kMaxGemvParts with the same x, k and type
// (q, k and v; gate and up) so they cost one launch and one kernel tail: y = epilogue(x w^T +
// bias), [m, n]. mins and scales only for 4-bit weights.
struct GemvPart {
  const void* w = nullptr;
  const float* mins = nullptr;
  const float* scales = nullptr;
  const float* bias = nullptr;  // [n], or none
  float* y = nullptr;
  int64_t n = 0;
};
constexpr int kMaxGemvParts = 3;
// The norm a fused GEMV applies to its one row of x first: each block reads x once,
// normalises it into shared memory (k floats) and takes its dot products from there, so a
// pre-norm layer's norm costs no kernel of its own and norm(x) is never written. Formulas as
// layer_norm / rms_norm; weight (and bias, or none) 16-byte aligned.
enum class GemvNormKind : int { kNone = 0, kLayer = 1, kRms = 2 };
struct GemvNorm {
  GemvNormKind kind = GemvNormKind::kNone;
  const float* weight = nullptr;
  const float* bias = nullptr;
  float eps = 0.0f;
};
constexpr int64_t kMaxGemvNormWidth = 8192;  // x in shared memory: 32 KiB a block
// Whether a launch over m rows of width k takes `norm`: one row, k <= kMaxGemvNormWidth and
// a multiple of 4, weight and bias (or none) 16-byte aligned.
bool gemv_norm_fits(int m, int64_t k, const GemvNorm& norm);
// How a fused GEMV launch runs.
struct GemvMode {
  GemvEpilogue epilogue = GemvEpilogue::kStore;
  // Programmatic dependent launch (compute capability 9.0 on): the GEMV may start while the
  // kernel before it finishes; it reads x and writes y only once that kernel is done.
  bool overlap = false;
  // With overlap, the first weight loads also go out before that wait, overlapping the
  // kernel before's tail (STRATA_CUDA_PDL=early); otherwise the GEMV waits first and only
  // its launch overlaps.
  bool early_weights = false;
  GemvNorm norm;  // m == 1 and k <= kMaxGemvNormWidth where kind is not kNone
  // Weight rows each warp takes at once: 1, or with a norm 2 or 4, so that a launch has
  // that many times fewer blocks to redo the norm's prologue (STRATA_CUDA_NORM_ROWS).
  int warp_rows = 1;
};
// y = epilogue(x w^T + bias) for each part, over one row x (m <= kMaxGemvRowsHalf): w [n, k]
// f16 or bf16, read once from memory; x f32 as it is (not rounded to w's type). k % 8 == 0;
// every w and x 16-byte aligned; every part has n > 0, w and y; count <= kMaxGemvParts; the
// norm and warp_rows as GemvMode says (else cudaErrorInvalidValue and nothing is launched).
KernelStatus gemv_half_parts(const float* x, int m, const GemvPart* parts, int count, ElemType type,
                             int64_t k, const GemvMode& mode, StreamHandle stream);
// The same for y[i, :] with i < m <= kMaxGemvRowsQ4 over kQ4 matrices [n, k] grouped along
// rows by 64 (kernels/quant.h), each code dequantised in registers: k % 64 == 0; packed and x
// 16-byte aligned.
KernelStatus gemv_q4_parts(const float* x, int m, const GemvPart* parts, int count, int64_t k,
                           const GemvMode& mode, StreamHandle stream);

// How attention_tiled covers a step: a block takes rows_per_tile token rows and
// heads_per_block query heads of one kv head (a GQA group together), reading the keys and
// values of its slot in tiles of key_tile; `splits` blocks share one context (decode rows
// only), their partial results joined by a second kernel.
struct AttentionTiling {
  int32_t rows_per_tile = 1;
  int32_t heads_per_block = 1;
  int32_t key_tile = 32;
  int32_t splits = 1;
  // Decode rows with head_dim 64 or 128 and a group of 1, 2, 4 or 8 query heads: a block
  // takes one row and a whole group, its warps taking chunks of keys with all their loads
  // in flight (no shared-memory tiles); splits are then whole multiples of key_tile keys.
  bool decode_warps = false;
};
// The tiling for a step of n_rows rows over n_seqs sequences whose longest context is
// max_context, on sm_count SMs, with partial_bytes of scratch for split results; with
// allow_decode_warps false, never the warps-over-keys kernel (a benchmark switch).
AttentionTiling plan_attention(int64_t n_rows, int64_t n_seqs, int32_t max_context, int32_t n_heads,
                               int32_t n_kv_heads, int32_t head_dim, int32_t sm_count,
                               size_t partial_bytes, bool allow_decode_warps = true);
// Dynamic shared memory one block of attention_tiled takes under `t` (at most 48 KiB, the
// launch limit without an opt-in, for every head_dim plan_attention accepts).
size_t attention_tiled_shared_bytes(const AttentionTiling& t, int32_t head_dim);
// What the warps-over-keys decode kernel does besides attending, so that a decode step's
// attention is one kernel rather than three (kv_store, attention, the split combine).
struct DecodeFusion {
  // The step's new k and v rows ([rows, n_kv_heads * head_dim], 16-byte aligned), every
  // sequence's only new row: the kernel stores them into the cache and attends to them from
  // here. Null: the cache already holds them (kv_store ran).
  const float* k_new = nullptr;
  const float* v_new = nullptr;
  // n_rows * n_kv_heads counters, zero: the last split of a (row, kv head) to finish joins
  // the splits, and sets its counter back to zero. Null: a combine kernel joins them.
  unsigned* arrivals = nullptr;
  bool any() const { return k_new != nullptr || v_new != nullptr || arrivals != nullptr; }
};
// Whether attention_tiled takes `f` for a step of n_heads query heads tiled by `t`: the
// warps-over-keys kernel runs it (t.decode_warps, a whole group a block, q and the cache
// 16-byte aligned), and k_new and v_new are both given or neither, 16-byte aligned. It
// cannot see whether each sequence has one new row: the caller checks that.
bool decode_fusion_fits(const AttentionTiling& t, const float* q, const KvCacheDesc& cache,
                        int32_t n_heads, const DecodeFusion& f);
// The attention above (same contract) by the tiling `t`; max_context bounds every row's
// pos + 1; `partial` holds n_rows * n_heads * splits * (head_dim + 2) floats when splits > 1.
// With `overlap` its kernels are launched with programmatic dependent launch (as
// GemvMode::overlap). With `fusion` (decode_fusion_fits, else cudaErrorInvalidValue), the
// one decode kernel also stores the new rows and joins its splits.
KernelStatus attention_tiled(const float* q, const RowDesc* rows, int64_t n_rows,
                             const KvCacheDesc& cache, int32_t n_heads, float scale,
                             int32_t max_context, const AttentionTiling& t, float* partial,
                             float* out, StreamHandle stream, bool overlap = false,
                             const DecodeFusion& fusion = {});
// Whether the warps-over-keys kernel takes a step over a 4-bit cache tiled by `t`
// (t.decode_warps, head_dim 64 or 128, a whole group of 1, 2, 4 or 8 query heads a block, a
// lane's head_dim / 32 elements within one of the cache's groups, q and the blobs 16-byte
// aligned). Else attention_q4's kernel takes it.
bool takes_q4_decode_kernel(const AttentionTiling& t, const float* q, const KvQ4Desc& cache,
                            int32_t n_heads);
// Whether the tiled kernel reads a 4-bit cache: head_dim and the group multiples of 4 (each
// 4 elements of a tile one 2-byte load and one group), the blobs 16-byte aligned.
bool q4_tiles_fit(const KvQ4Desc& cache);
// attention_q4 (same contract) by the tiling `t`: decode rows by warps over keys where
// takes_q4_decode_kernel holds, else the tiled kernel (q4_tiles_fit), each key and value
// decoded in registers from its codes and its group's min and scale; splits joined by the
// combine kernel (`partial` as attention_tiled's). cudaErrorInvalidValue, nothing launched,
// where neither takes the step: attention_q4's kernel then does.
KernelStatus attention_q4_tiled(const float* q, const RowDesc* rows, int64_t n_rows,
                                const KvQ4Desc& cache, int32_t n_heads, float scale,
                                int32_t max_context, const AttentionTiling& t, float* partial,
                                float* out, StreamHandle stream, bool overlap = false);

}  // namespace strata::cuda_kernels
