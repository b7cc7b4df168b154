// The CUDA backend's decode-path kernels (declared in cuda_kernels.h): GEMVs that read each
// weight once straight from memory (f16 / bf16, and 4-bit codes dequantised in registers)
// with f32 activations, and a tiled attention that reads a sequence's keys and values once
// per block of query rows (a GQA group's heads together) in coalesced tiles through shared
// memory, split over the context when the batch alone cannot fill the GPU (flash-decoding).
// Arithmetic is f32 with IEEE exp, as in cuda_kernels.cu.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "kernels/cuda/cuda_kernels.h"

namespace strata::cuda_kernels {
namespace {

cudaStream_t as_stream(StreamHandle s) {
  return static_cast<cudaStream_t>(s);
}

KernelStatus last_status() {
  return KernelStatus{static_cast<int>(cudaGetLastError())};
}

KernelStatus invalid() {
  return KernelStatus{static_cast<int>(cudaErrorInvalidValue)};
}

__device__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ float warp_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// ---- GEMV --------------------------------------------------------------------------------

constexpr int kGemvWarps = 4;  // warps per block; each warp owns one output row

// Two packed half-precision values as f32.
template <typename T>
__device__ float2 halves_to_float2(uint32_t bits);
template <>
__device__ float2 halves_to_float2<__half>(uint32_t bits) {
  return __half22float2(*reinterpret_cast<const __half2*>(&bits));
}
template <>
__device__ float2 halves_to_float2<__nv_bfloat16>(uint32_t bits) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
}

__device__ float dot8(const float4& a, const float4& b, float2 w01, float2 w23, float2 w45,
                      float2 w67) {
  return a.x * w01.x + a.y * w01.y + a.z * w23.x + a.w * w23.y + b.x * w45.x + b.y * w45.y +
         b.z * w67.x + b.w * w67.y;
}

// Warp-reduces acc[i] and writes y[i, row] = epilogue(acc + bias); row < n. The epilogue
// (GemvEpilogue) folds the op that follows a linear into its store: OPT's ReLU after fc1,
// or the residual add after the output and down projections (y += product).
template <int M>
__device__ void gemv_store(const float (&acc)[M], int64_t row, int64_t n, const float* bias,
                           GemvEpilogue epilogue, float* y) {
  const unsigned lane = threadIdx.x & 31u;
#pragma unroll
  for (int i = 0; i < M; ++i) {
    const float v = warp_sum(acc[i]) + (bias != nullptr ? bias[row] : 0.0f);
    if (lane != 0) continue;
    float& out = y[static_cast<int64_t>(i) * n + row];
    if (epilogue == GemvEpilogue::kRelu) {
      out = fmaxf(v, 0.0f);
    } else if (epilogue == GemvEpilogue::kAccumulate) {
      out += v;
    } else {
      out = v;
    }
  }
}

// Programmatic dependent launch (Hopper on): a GEMV launched with it may start while the
// kernel before it in the stream is still finishing. It reads no input of that kernel before
// wait_for_inputs(), which returns once that kernel has completed and its writes are
// visible; a launch without it returns at once. let_dependents_launch() lets the next such
// launch begin once every block of this one is running.
__device__ void wait_for_inputs() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaGridDependencySynchronize();
#endif
}
__device__ void let_dependents_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaTriggerProgrammaticLaunchCompletion();
#endif
}

// x as a GEMV reads it. Launched plainly, x is read-only for the kernel's whole life and
// goes through the read-only path (.nc). Launched to overlap the kernel before it, x may be
// written while this kernel is already running, which .nc loads do not allow (the
// compiler may move them ahead of wait_for_inputs()), so x takes ordinary loads.
template <bool kOverlap>
__device__ float4 load_x(const float* x, int64_t i) {
  const float4* p = reinterpret_cast<const float4*>(x + i);
  if constexpr (kOverlap) {
    return __ldca(p);
  } else {
    return __ldg(p);
  }
}

// Chunks of 16 bytes each lane loads before waiting for x: the weights are no output of the
// kernel before, so their first loads overlap its tail.
constexpr int kGemvPrefetch = 4;

// y = x w[n, k]^T for one activation row x: each lane reads 8 weights (16 bytes) of its
// warp's row per chunk, streamed past L1 (__ldcs) so x stays cached there.
template <typename T, bool kOverlap>
__global__ void __launch_bounds__(kGemvWarps * 32)
    gemv_half_kernel(const float* x, const T* __restrict__ w, int64_t n, int64_t k,
                     const float* __restrict__ bias, GemvEpilogue epilogue, float* __restrict__ y) {
  let_dependents_launch();
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kGemvWarps + (threadIdx.x >> 5);
  if (row >= n) return;
  const unsigned lane = threadIdx.x & 31u;
  const uint4* wr = reinterpret_cast<const uint4*>(w + row * k);
  const int64_t chunks = k / 8;
  uint4 first[kGemvPrefetch];
#pragma unroll
  for (int d = 0; d < kGemvPrefetch; ++d)
    if (lane + 32 * d < chunks) first[d] = __ldcs(wr + lane + 32 * d);
  wait_for_inputs();
  float acc[1] = {0.0f};
  const auto dot = [&](int64_t c, const uint4& wv) {
    acc[0] +=
        dot8(load_x<kOverlap>(x, 8 * c), load_x<kOverlap>(x, 8 * c + 4), halves_to_float2<T>(wv.x),
             halves_to_float2<T>(wv.y), halves_to_float2<T>(wv.z), halves_to_float2<T>(wv.w));
  };
#pragma unroll
  for (int d = 0; d < kGemvPrefetch; ++d)
    if (lane + 32 * d < chunks) dot(lane + 32 * d, first[d]);
  for (int64_t c = lane + 32 * kGemvPrefetch; c < chunks; c += 32) dot(c, __ldcs(wr + c));
  gemv_store<1>(acc, row, n, bias, epilogue, y);
}

// Code j (0..7) of a 32-bit word of codes (even index in the low nibble) as a float, exactly:
// the code as the low mantissa bits of 2^23, minus 2^23 -- full-rate integer and float ops
// instead of the quarter-rate integer-to-float conversion.
__device__ float code_as_float(uint32_t word, int j) {
  return __uint_as_float(0x4B000000u | ((word >> (4 * j)) & 15u)) - 8388608.0f;
}

// One word of 8 codes with its group's min and scale, dotted with x[i, e .. e + 8) for each
// of the M rows into acc.
template <int M, bool kOverlap>
__device__ void q4_word_dot(const float* x, int64_t k, int64_t e, uint32_t word, float mn, float sc,
                            float (&acc)[M]) {
  float wf[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) wf[j] = code_as_float(word, j);
#pragma unroll
  for (int i = 0; i < M; ++i) {
    const float4 a = load_x<kOverlap>(x, static_cast<int64_t>(i) * k + e);
    const float4 b = load_x<kOverlap>(x, static_cast<int64_t>(i) * k + e + 4);
    const float d = a.x * wf[0] + a.y * wf[1] + a.z * wf[2] + a.w * wf[3] + b.x * wf[4] +
                    b.y * wf[5] + b.z * wf[6] + b.w * wf[7];
    const float sx = (a.x + a.y) + (a.z + a.w) + (b.x + b.y) + (b.z + b.w);
    acc[i] += sc * d + mn * sx;
  }
}

// The same GEMV over a 4-bit matrix grouped along rows by 64 (kernels/quant.h), never
// writing a dequantised weight anywhere. Lane c takes the 8 codes of word c of each run of
// 32 words (256 weights), so a warp's loads of codes (128 bytes) and of activations (two
// 512-byte runs per row) are contiguous; the codes are decoded once and serve every row.
template <int M, bool kOverlap>
__global__ void __launch_bounds__(kGemvWarps * 32)
    gemv_q4_kernel(const float* x, const unsigned char* __restrict__ packed,
                   const float* __restrict__ mins, const float* __restrict__ scales, int64_t n,
                   int64_t k, const float* __restrict__ bias, GemvEpilogue epilogue,
                   float* __restrict__ y) {
  let_dependents_launch();
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kGemvWarps + (threadIdx.x >> 5);
  if (row >= n) return;
  const unsigned lane = threadIdx.x & 31u;
  float acc[M] = {};
  const uint32_t* words = reinterpret_cast<const uint32_t*>(packed + row * (k / 2));
  const float* row_mins = mins + row * (k / 64);
  const float* row_scales = scales + row * (k / 64);
  // The first word and its group's min and scale before waiting for x (see kGemvPrefetch).
  const int64_t e0 = 8 * static_cast<int64_t>(lane);
  uint32_t word = 0;
  float mn = 0.0f, sc = 0.0f;
  if (e0 < k) {
    word = __ldcs(words + e0 / 8);
    mn = __ldg(row_mins + e0 / 64);
    sc = __ldg(row_scales + e0 / 64);
  }
  wait_for_inputs();
  for (int64_t e = e0; e < k; e += 256) {
    if (e != e0) {
      word = __ldcs(words + e / 8);
      mn = __ldg(row_mins + e / 64);
      sc = __ldg(row_scales + e / 64);
    }
    q4_word_dot<M, kOverlap>(x, k, e, word, mn, sc, acc);
  }
  gemv_store<M>(acc, row, n, bias, epilogue, y);
}

unsigned gemv_blocks(int64_t n) {
  return static_cast<unsigned>((n + kGemvWarps - 1) / kGemvWarps);
}

// Launches a GEMV kernel, with programmatic dependent launch where `overlap` asks for it.
template <typename... Params, typename... Args>
void launch_gemv(void (*kernel)(Params...), int64_t n, bool overlap, cudaStream_t s, Args... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(gemv_blocks(n));
  config.blockDim = dim3(kGemvWarps * 32);
  config.stream = s;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attr;
  config.numAttrs = overlap ? 1 : 0;
  cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
}

template <int M>
void launch_gemv_q4(const float* x, const unsigned char* packed, const float* mins,
                    const float* scales, int64_t n, int64_t k, const GemvOut& o, float* y,
                    cudaStream_t s) {
  launch_gemv(o.overlap ? gemv_q4_kernel<M, true> : gemv_q4_kernel<M, false>, n, o.overlap, s, x,
              packed, mins, scales, n, k, o.bias, o.epilogue, y);
}

// Keys of one split of a context into `splits`: the even share rounded up to whole tiles.
int32_t split_keys(int32_t ctx, int32_t splits, int32_t key_tile) {
  const int32_t even = (ctx + splits - 1) / splits;
  return (even + key_tile - 1) / key_tile * key_tile;
}

// ---- Tiled attention ---------------------------------------------------------------------

constexpr int kTileThreads = 128;
constexpr int kTileWarps = kTileThreads / 32;
constexpr int kMaxQueryRows = 16;  // query rows (token rows x heads) per block
constexpr int kMaxOutPerThread = 16;
constexpr int kMaxOutputs = kMaxOutPerThread * kTileThreads;  // query rows x head_dim

// What one launch does, fixed on the host (plan_attention).
struct TileArgs {
  int32_t n_heads;
  int32_t group;            // query heads per kv head
  int32_t heads_per_block;  // of one group
  int32_t blocks_per_kv;    // ceil(group / heads_per_block)
  int32_t rows_per_tile;    // token rows a block takes
  int32_t key_tile;         // keys per shared-memory tile (<= 32)
  int32_t splits;           // blocks over one context (1: write out directly)
  int32_t keys_per_split;
  float scale;
};

// Shared memory of one block: Q [qr][hd], a K and a V tile [key_tile][hd + 1] (padded so a
// warp reading one dimension of 32 keys hits 32 banks), scores [qr][key_tile], and per query
// row the running max, the running sum and this tile's rescale factor.
size_t tile_shared_bytes(int qr, int key_tile, int hd) {
  return sizeof(float) *
         (static_cast<size_t>(qr) * hd + 2 * static_cast<size_t>(key_tile) * (hd + 1) +
          static_cast<size_t>(qr) * key_tile + 3 * static_cast<size_t>(qr));
}

// A K or V tile (key_tile * head_dim <= kTileElems floats) in flight in registers: every
// thread issues all its loads before any is needed, so a tile costs one memory latency, and
// the next tile loads while this one is computed on.
constexpr int kTileElems = 4096;
constexpr int kTileVecsPerThread = kTileElems / 4 / kTileThreads;  // float4 each
struct TileRegs {
  float4 v[kTileVecsPerThread];
};

// Loads nk keys of one (slot, kv head) -- contiguous in the cache -- into registers. kVec:
// head_dim % 4 == 0 and 16-byte aligned rows; else one float per lane of each float4.
template <bool kVec>
__device__ void fetch_tile(const float* __restrict__ src, int32_t nk, int32_t hd, TileRegs& r) {
  if constexpr (kVec) {
    const int32_t n4 = nk * hd / 4;
    const float4* s4 = reinterpret_cast<const float4*>(src);
#pragma unroll
    for (int u = 0; u < kTileVecsPerThread; ++u) {
      const int32_t e = static_cast<int32_t>(threadIdx.x) + u * kTileThreads;
      if (e < n4) r.v[u] = s4[e];
    }
  } else {
    const int32_t n = nk * hd;
#pragma unroll
    for (int u = 0; u < kTileVecsPerThread; ++u) {
      const int32_t e = static_cast<int32_t>(threadIdx.x) + 4 * u * kTileThreads;
      if (e < n) r.v[u].x = src[e];
      if (e + kTileThreads < n) r.v[u].y = src[e + kTileThreads];
      if (e + 2 * kTileThreads < n) r.v[u].z = src[e + 2 * kTileThreads];
      if (e + 3 * kTileThreads < n) r.v[u].w = src[e + 3 * kTileThreads];
    }
  }
}

template <bool kVec>
__device__ void store_tile(const TileRegs& r, int32_t nk, int32_t hd, float* tile) {
  const int32_t n = nk * hd;
#pragma unroll
  for (int u = 0; u < kTileVecsPerThread; ++u) {
    if constexpr (kVec) {
      const int32_t i = 4 * (static_cast<int32_t>(threadIdx.x) + u * kTileThreads);
      if (i < n) {
        const int32_t j = i / hd;  // the 4 values stay in one key's row (hd % 4 == 0)
        float* t = tile + j * (hd + 1) + (i - j * hd);
        t[0] = r.v[u].x;
        t[1] = r.v[u].y;
        t[2] = r.v[u].z;
        t[3] = r.v[u].w;
      }
    } else {
      const float vals[4] = {r.v[u].x, r.v[u].y, r.v[u].z, r.v[u].w};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int32_t e = static_cast<int32_t>(threadIdx.x) + (4 * u + q) * kTileThreads;
        if (e < n) {
          const int32_t j = e / hd;
          tile[j * (hd + 1) + (e - j * hd)] = vals[q];
        }
      }
    }
  }
}

// One block: up to rows_per_tile consecutive token rows, heads_per_block query heads of one
// kv head, keys of one split. Consecutive rows of the same KV slot (a prefill chunk) share
// every K/V tile; rows of different slots are taken one slot-run after another.
template <bool kVec>
__global__ void __launch_bounds__(kTileThreads)
    attention_tiled_kernel(const float* __restrict__ q, const RowDesc* __restrict__ rows,
                           int64_t n_rows, KvCacheDesc c, TileArgs a, float* __restrict__ out,
                           float* __restrict__ partial) {
  extern __shared__ float smem[];
  __shared__ RowDesc s_rows[kMaxQueryRows];
  const int32_t hd = c.head_dim;
  const int32_t qr_max = a.rows_per_tile * a.heads_per_block;
  const int32_t tk = a.key_tile;
  float* s_q = smem;
  float* s_k = s_q + qr_max * hd;
  float* s_v = s_k + tk * (hd + 1);
  float* s_s = s_v + tk * (hd + 1);
  float* s_m = s_s + qr_max * tk;
  float* s_l = s_m + qr_max;
  float* s_a = s_l + qr_max;

  const int32_t kvh = static_cast<int32_t>(blockIdx.y) / a.blocks_per_kv;
  const int32_t h0 =
      kvh * a.group + (static_cast<int32_t>(blockIdx.y) % a.blocks_per_kv) * a.heads_per_block;
  const int32_t gb = min(a.heads_per_block, kvh * a.group + a.group - h0);
  const int64_t r_begin = static_cast<int64_t>(blockIdx.x) * a.rows_per_tile;
  const int32_t nr =
      static_cast<int32_t>(min(static_cast<int64_t>(a.rows_per_tile), n_rows - r_begin));
  if (static_cast<int32_t>(threadIdx.x) < nr) s_rows[threadIdx.x] = rows[r_begin + threadIdx.x];
  __syncthreads();
  const int64_t width = static_cast<int64_t>(a.n_heads) * hd;
  const unsigned lane = threadIdx.x & 31u;
  const int32_t warp = static_cast<int32_t>(threadIdx.x >> 5);
  TileRegs kr, vr;

  for (int32_t g0 = 0; g0 < nr;) {
    const int32_t slot = s_rows[g0].slot;
    int32_t g1 = g0 + 1;
    int32_t max_pos = s_rows[g0].pos;
    while (g1 < nr && s_rows[g1].slot == slot) max_pos = max(max_pos, s_rows[g1++].pos);
    const int32_t nq = (g1 - g0) * gb;
    const int32_t key_begin = static_cast<int32_t>(blockIdx.z) * a.keys_per_split;
    const int32_t key_end = min(max_pos + 1, key_begin + a.keys_per_split);
    const int64_t base =
        static_cast<int64_t>(slot) * c.slot_stride + static_cast<int64_t>(kvh) * c.head_stride;
    if (key_begin < key_end)
      fetch_tile<kVec>(c.k + base + static_cast<int64_t>(key_begin) * hd,
                       min(tk, key_end - key_begin), hd, kr);

    for (int32_t e = threadIdx.x; e < nq * hd; e += blockDim.x) {
      const int32_t qi = e / hd;
      const RowDesc& d = s_rows[g0 + qi / gb];
      s_q[e] = q[static_cast<int64_t>(d.row) * width + static_cast<int64_t>(h0 + qi % gb) * hd +
                 (e - qi * hd)];
    }
    for (int32_t qi = threadIdx.x; qi < nq; qi += blockDim.x) {
      s_m[qi] = -INFINITY;
      s_l[qi] = 0.0f;
    }
    float o[kMaxOutPerThread];
#pragma unroll
    for (int i = 0; i < kMaxOutPerThread; ++i) o[i] = 0.0f;

    for (int32_t t0 = key_begin; t0 < key_end; t0 += tk) {
      const int32_t nk = min(tk, key_end - t0);
      store_tile<kVec>(kr, nk, hd, s_k);
      fetch_tile<kVec>(c.v + base + static_cast<int64_t>(t0) * hd, nk, hd, vr);
      __syncthreads();
      // Scores: thread (j, qg) takes key j against query rows qg, qg + stride, ...
      const int32_t stride = kTileThreads / tk;
      const int32_t j = static_cast<int32_t>(threadIdx.x) % tk;
      for (int32_t qi = static_cast<int32_t>(threadIdx.x) / tk; qi < nq; qi += stride) {
        float s = -INFINITY;
        if (j < nk && t0 + j <= s_rows[g0 + qi / gb].pos) {
          const float* qv = s_q + qi * hd;
          const float* kv = s_k + j * (hd + 1);
          float dot = 0.0f;
          for (int32_t dd = 0; dd < hd; ++dd) dot += qv[dd] * kv[dd];
          s = dot * a.scale;
        }
        s_s[qi * tk + j] = s;
      }
      __syncthreads();
      // Online softmax, one warp per query row.
      for (int32_t qi = warp; qi < nq; qi += kTileWarps) {
        const float s = static_cast<int32_t>(lane) < tk ? s_s[qi * tk + lane] : -INFINITY;
        const float m_old = s_m[qi];
        const float m_new = fmaxf(m_old, warp_max(s));
        const float p = s == -INFINITY ? 0.0f : expf(s - m_new);
        const float sum = warp_sum(p);
        if (static_cast<int32_t>(lane) < tk) s_s[qi * tk + lane] = p;
        if (lane == 0) {
          const float corr = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
          s_a[qi] = corr;
          s_l[qi] = s_l[qi] * corr + sum;
          s_m[qi] = m_new;
        }
      }
      store_tile<kVec>(vr, nk, hd, s_v);
      if (t0 + tk < key_end)
        fetch_tile<kVec>(c.k + base + static_cast<int64_t>(t0 + tk) * hd,
                         min(tk, key_end - t0 - tk), hd, kr);
      __syncthreads();
#pragma unroll
      for (int i = 0; i < kMaxOutPerThread; ++i) {
        const int32_t e = static_cast<int32_t>(threadIdx.x) + i * kTileThreads;
        if (e < nq * hd) {
          const int32_t qi = e / hd;
          const int32_t dd = e - qi * hd;
          const float* p = s_s + qi * tk;
          float acc = o[i] * s_a[qi];
          for (int32_t jj = 0; jj < nk; ++jj) acc += p[jj] * s_v[jj * (hd + 1) + dd];
          o[i] = acc;
        }
      }
      __syncthreads();
    }

#pragma unroll
    for (int i = 0; i < kMaxOutPerThread; ++i) {
      const int32_t e = static_cast<int32_t>(threadIdx.x) + i * kTileThreads;
      if (e < nq * hd) {
        const int32_t qi = e / hd;
        const int32_t dd = e - qi * hd;
        const int64_t row = s_rows[g0 + qi / gb].row;
        const int64_t h = h0 + qi % gb;
        if (a.splits == 1) {
          const float l = s_l[qi];
          out[row * width + h * hd + dd] = l > 0.0f ? o[i] / l : 0.0f;
        } else {
          // Indexed by the row's entry in the table (activation rows may have gaps).
          const int64_t entry = r_begin + g0 + qi / gb;
          float* pr = partial + ((entry * a.n_heads + h) * a.splits + blockIdx.z) * (hd + 2);
          pr[dd] = o[i];
          if (dd == 0) {
            pr[hd] = s_m[qi];
            pr[hd + 1] = s_l[qi];
          }
        }
      }
    }
    __syncthreads();  // s_q, s_m, s_l are rewritten by the next slot-run
    g0 = g1;
  }
}

// Joins the splits of one (row entry, head): out = sum_z O_z e^(m_z - M) / sum_z l_z e^(m_z - M).
__global__ void attention_combine_kernel(const float* __restrict__ partial,
                                         const RowDesc* __restrict__ rows, int32_t n_heads,
                                         int32_t hd, int32_t splits, float* __restrict__ out) {
  const int64_t eh = blockIdx.x;  // table entry * n_heads + head
  const float* p = partial + eh * splits * (hd + 2);
  float* o =
      out + static_cast<int64_t>(rows[eh / n_heads].row) * n_heads * hd + (eh % n_heads) * hd;
  float m = -INFINITY;
  for (int32_t z = 0; z < splits; ++z) m = fmaxf(m, p[z * (hd + 2) + hd]);
  float l = 0.0f;
  for (int32_t z = 0; z < splits; ++z) {
    const float mz = p[z * (hd + 2) + hd];
    if (mz != -INFINITY) l += p[z * (hd + 2) + hd + 1] * expf(mz - m);
  }
  for (int32_t dd = threadIdx.x; dd < hd; dd += blockDim.x) {
    float acc = 0.0f;
    for (int32_t z = 0; z < splits; ++z) {
      const float mz = p[z * (hd + 2) + hd];
      if (mz != -INFINITY) acc += p[z * (hd + 2) + dd] * expf(mz - m);
    }
    o[dd] = l > 0.0f ? acc / l : 0.0f;
  }
}

}  // namespace

KernelStatus gemv_half(const float* x, int m, const void* w, ElemType type, int64_t n, int64_t k,
                       const GemvOut& out, float* y, StreamHandle stream) {
  if (m <= 0 || n <= 0) return {};
  if (m > kMaxGemvRowsHalf || k <= 0 || k % 8 != 0 || type == ElemType::kF32 || !aligned16(w) ||
      !aligned16(x))
    return invalid();
  const cudaStream_t s = as_stream(stream);
  if (type == ElemType::kF16) {
    launch_gemv(out.overlap ? gemv_half_kernel<__half, true> : gemv_half_kernel<__half, false>, n,
                out.overlap, s, x, static_cast<const __half*>(w), n, k, out.bias, out.epilogue, y);
  } else {
    launch_gemv(out.overlap ? gemv_half_kernel<__nv_bfloat16, true>
                            : gemv_half_kernel<__nv_bfloat16, false>,
                n, out.overlap, s, x, static_cast<const __nv_bfloat16*>(w), n, k, out.bias,
                out.epilogue, y);
  }
  return last_status();
}

KernelStatus gemv_q4(const float* x, int m, const unsigned char* packed, const float* mins,
                     const float* scales, int64_t n, int64_t k, const GemvOut& out, float* y,
                     StreamHandle stream) {
  if (m <= 0 || n <= 0) return {};
  if (m > kMaxGemvRowsQ4 || k <= 0 || k % 64 != 0 || !aligned16(packed) || !aligned16(x))
    return invalid();
  const cudaStream_t s = as_stream(stream);
  // One instantiation per row count, so each keeps its accumulators in registers.
  using Launcher = void (*)(const float*, const unsigned char*, const float*, const float*, int64_t,
                            int64_t, const GemvOut&, float*, cudaStream_t);
  constexpr Launcher kLaunchers[kMaxGemvRowsQ4] = {
      launch_gemv_q4<1>, launch_gemv_q4<2>, launch_gemv_q4<3>, launch_gemv_q4<4>,
      launch_gemv_q4<5>, launch_gemv_q4<6>, launch_gemv_q4<7>, launch_gemv_q4<8>};
  kLaunchers[m - 1](x, packed, mins, scales, n, k, out, y, s);
  return last_status();
}

AttentionTiling plan_attention(int64_t n_rows, int64_t n_seqs, int32_t max_context, int32_t n_heads,
                               int32_t n_kv_heads, int32_t head_dim, int32_t sm_count,
                               size_t partial_bytes) {
  AttentionTiling t;
  if (n_rows <= 0 || n_kv_heads <= 0 || head_dim <= 0) return t;
  const int32_t group = n_heads / n_kv_heads;
  const int32_t qr_max =
      head_dim >= kMaxOutputs ? 1 : std::min(kMaxQueryRows, kMaxOutputs / head_dim);
  t.key_tile = head_dim <= 128 ? 32 : head_dim <= 256 ? 16 : 8;  // key_tile * hd <= kTileElems
  t.heads_per_block = std::min(group, qr_max);
  // Decode rows (one per sequence) each read their own slot: one row per block. Rows of a
  // prefill chunk share their slot's tiles, so a block takes as many as fit.
  const bool decode = n_rows <= 2 * n_seqs;
  t.rows_per_tile = decode ? 1 : std::max(1, qr_max / t.heads_per_block);
  const int64_t blocks = (n_rows + t.rows_per_tile - 1) / t.rows_per_tile * n_kv_heads *
                         ((group + t.heads_per_block - 1) / t.heads_per_block);
  t.splits = 1;
  if (decode && sm_count > 0) {
    // Enough blocks for four per SM, each split at least one key tile long, within the
    // partial-result scratch. A block's tiles run one after another, so at a short context
    // (one decode row of a 7B model at 500 positions) more, shorter splits are what fills
    // the GPU. A split is whole key tiles, and the count follows from that length.
    const int64_t want = (int64_t{4} * sm_count + blocks - 1) / blocks;
    const int64_t by_keys = std::max<int64_t>(1, max_context / t.key_tile);
    int64_t splits = std::min<int64_t>({want, by_keys, 64});
    const int64_t per_split = n_rows * n_heads * (head_dim + 2) * int64_t{sizeof(float)};
    while (splits > 1 && splits * per_split > static_cast<int64_t>(partial_bytes)) --splits;
    const int32_t ctx = std::max(max_context, 1);
    const int32_t keys = split_keys(ctx, static_cast<int32_t>(splits), t.key_tile);
    t.splits = (ctx + keys - 1) / keys;
  }
  return t;
}

size_t attention_tiled_shared_bytes(const AttentionTiling& t, int32_t head_dim) {
  return tile_shared_bytes(t.rows_per_tile * t.heads_per_block, t.key_tile, head_dim);
}

KernelStatus attention_tiled(const float* q, const RowDesc* rows, int64_t n_rows,
                             const KvCacheDesc& cache, int32_t n_heads, float scale,
                             int32_t max_context, const AttentionTiling& t, float* partial,
                             float* out, StreamHandle stream) {
  if (n_rows <= 0 || n_heads <= 0) return {};
  const int32_t hd = cache.head_dim;
  if (hd <= 0 || hd > kMaxAttentionHeadDim || cache.n_kv_heads <= 0 ||
      n_heads % cache.n_kv_heads != 0 || t.key_tile <= 0 || t.key_tile > 32 ||
      t.key_tile * hd > kTileElems || t.heads_per_block <= 0 || t.rows_per_tile <= 0 ||
      t.rows_per_tile * t.heads_per_block > kMaxQueryRows ||
      t.rows_per_tile * t.heads_per_block * hd > kMaxOutputs || kTileThreads % t.key_tile != 0 ||
      t.splits <= 0 || (t.splits > 1 && (partial == nullptr || t.rows_per_tile != 1)))
    return invalid();
  TileArgs a;
  a.n_heads = n_heads;
  a.group = n_heads / cache.n_kv_heads;
  a.heads_per_block = t.heads_per_block;
  a.blocks_per_kv = (a.group + t.heads_per_block - 1) / t.heads_per_block;
  a.rows_per_tile = t.rows_per_tile;
  a.key_tile = t.key_tile;
  a.splits = t.splits;
  const int32_t ctx = max_context > 0 ? max_context : 1;
  a.keys_per_split = t.splits == 1 ? INT32_MAX : split_keys(ctx, t.splits, t.key_tile);
  a.scale = scale;
  const dim3 grid(static_cast<unsigned>((n_rows + t.rows_per_tile - 1) / t.rows_per_tile),
                  static_cast<unsigned>(cache.n_kv_heads * a.blocks_per_kv),
                  static_cast<unsigned>(t.splits));
  const size_t shared = attention_tiled_shared_bytes(t, hd);
  const cudaStream_t s = as_stream(stream);
  const bool vec = hd % 4 == 0 && reinterpret_cast<uintptr_t>(cache.k) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(cache.v) % 16 == 0;
  if (vec) {
    attention_tiled_kernel<true>
        <<<grid, kTileThreads, shared, s>>>(q, rows, n_rows, cache, a, out, partial);
  } else {
    attention_tiled_kernel<false>
        <<<grid, kTileThreads, shared, s>>>(q, rows, n_rows, cache, a, out, partial);
  }
  if (t.splits > 1) {
    attention_combine_kernel<<<static_cast<unsigned>(n_rows * n_heads), 128, 0, s>>>(
        partial, rows, n_heads, hd, t.splits, out);
  }
  return last_status();
}

}  // namespace strata::cuda_kernels
