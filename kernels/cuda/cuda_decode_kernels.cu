// The CUDA backend's decode-path kernels (declared in cuda_kernels.h): GEMVs that read each
// weight once straight from memory (f16 / bf16, and 4-bit codes dequantised in registers)
// with f32 activations, up to three matrices a launch and optionally the layer's norm first;
// a tiled attention that reads a sequence's keys and values once per block of query rows (a
// GQA group's heads together) in coalesced tiles through shared memory; and for decode rows
// an attention whose warps take chunks of keys with all their loads in flight. Both split
// the context when the batch alone cannot fill the GPU (flash-decoding), and both read an
// f32, f16 or 4-bit cache as stored (cuda_kv_elems.cuh), widening in registers. Arithmetic
// is f32 with IEEE exp, as in cuda_kernels.cu.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/cuda_kv_elems.cuh"
#include "kernels/cuda/cuda_launch.cuh"

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

// x as the dot products read it: norm(x) from this block's shared memory (kNorm), else x
// from global memory (load_x).
template <bool kOverlap, bool kNorm>
__device__ float4 x4(const float* x, int64_t i) {
  if constexpr (kNorm) {
    return *reinterpret_cast<const float4*>(x + i);
  } else {
    return load_x<kOverlap>(x, i);
  }
}

// Sum over the block's warps, returned to every thread (s_red: kGemvWarps floats).
__device__ float gemv_block_sum(float v, float* s_red) {
  v = warp_sum(v);
  if ((threadIdx.x & 31u) == 0) s_red[threadIdx.x >> 5] = v;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < kGemvWarps; ++w) total += s_red[w];
  __syncthreads();  // s_red is written again by the next sum
  return total;
}

// norm(x) of one row of k floats into s_x, by every thread of the block, with layer_norm's
// and rms_norm's formulas. x is read once (ordinary loads: launched with PDL, the kernel
// before wrote it); a thread reads back only the elements it wrote until the last barrier.
__device__ void norm_into_shared(const float* x, int64_t k, const GemvNorm& p, float* s_x) {
  __shared__ float s_red[kGemvWarps];
  constexpr int64_t kThreads = kGemvWarps * 32;
  const bool layer = p.kind == GemvNormKind::kLayer;
  float4* s4 = reinterpret_cast<float4*>(s_x);
  const int64_t n4 = k / 4;
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < n4; i += kThreads) {
    const float4 v = load_x<true>(x, 4 * i);
    s4[i] = v;
    sum += layer ? (v.x + v.y) + (v.z + v.w) : (v.x * v.x + v.y * v.y) + (v.z * v.z + v.w * v.w);
  }
  const float fk = static_cast<float>(k);
  float mean = 0.0f;
  float inv = 0.0f;
  if (layer) {
    mean = gemv_block_sum(sum, s_red) / fk;
    float var = 0.0f;
    for (int64_t i = threadIdx.x; i < n4; i += kThreads) {
      const float4 v = s4[i];
      const float a = v.x - mean, b = v.y - mean, c = v.z - mean, d = v.w - mean;
      var += (a * a + b * b) + (c * c + d * d);
    }
    inv = 1.0f / sqrtf(gemv_block_sum(var, s_red) / fk + p.eps);
  } else {
    inv = 1.0f / sqrtf(gemv_block_sum(sum, s_red) / fk + p.eps);
  }
  const float4* w4 = reinterpret_cast<const float4*>(p.weight);
  const float4* b4 = reinterpret_cast<const float4*>(p.bias);
  for (int64_t i = threadIdx.x; i < n4; i += kThreads) {
    const float4 v = s4[i];
    const float4 w = __ldg(w4 + i);
    if (layer) {
      const float4 b = b4 != nullptr ? __ldg(b4 + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      s4[i] = make_float4((v.x - mean) * inv * w.x + b.x, (v.y - mean) * inv * w.y + b.y,
                          (v.z - mean) * inv * w.z + b.z, (v.w - mean) * inv * w.w + b.w);
    } else {
      s4[i] =
          make_float4(w.x * (inv * v.x), w.y * (inv * v.y), w.z * (inv * v.z), w.w * (inv * v.w));
    }
  }
  __syncthreads();
}

// What the dot products read: x, or (kNorm) norm(x) made by the whole block in its dynamic
// shared memory (k floats).
template <bool kNorm>
__device__ const float* gemv_input(const float* x, int64_t k, const GemvNorm& norm) {
  if constexpr (kNorm) {
    extern __shared__ float4 gemv_shared_x[];
    float* s_x = reinterpret_cast<float*>(gemv_shared_x);
    norm_into_shared(x, k, norm, s_x);
    return s_x;
  } else {
    (void)k, (void)norm;
    return x;
  }
}

// Chunks of 16 bytes each lane loads before it reads x: with early_weights before waiting
// for the kernel before (the weights are no output of it), so they overlap its tail; with
// the norm, before the block's prologue.
constexpr int kGemvPrefetch = 4;

// The matrices one GEMV launch reads (gemv_*_parts), with the first block of each: a block's
// rows all lie in one of them.
struct GemvLaunch {
  GemvPart part[kMaxGemvParts];
  unsigned first_block[kMaxGemvParts];
  int count;
  bool early_weights;  // GemvMode::early_weights
  GemvNorm norm;       // GemvMode::norm
};

// The part this block's rows lie in, and the first of this warp's R rows of it. Selected
// rather than indexed, so the launch's parameters are read where they are and not copied to
// local memory.
template <int R>
__device__ GemvPart part_of(const GemvLaunch& l, int64_t& row) {
  const unsigned b = blockIdx.x;
  const int i = (l.count > 1 && b >= l.first_block[1] ? 1 : 0) +
                (l.count > 2 && b >= l.first_block[2] ? 1 : 0);
  const GemvPart p = i == 0 ? l.part[0] : i == 1 ? l.part[1] : l.part[2];
  const unsigned first = i == 0 ? l.first_block[0] : i == 1 ? l.first_block[1] : l.first_block[2];
  row = (static_cast<int64_t>(b - first) * kGemvWarps + (threadIdx.x >> 5)) * R;
  return p;
}

// Row j of a warp's R rows that start at `row`, clamped into the part: a row past n reads
// the part's last row (its loads hit what another warp reads) and stores nothing.
__device__ int64_t clamped_row(int64_t row, int j, int64_t n) {
  return row + j < n ? row + j : n - 1;
}

// The prologue of both GEMV kernels, then `body(part, row, xs)` for a warp with rows to
// compute: this warp's part and first of R rows, the kernel's weight addresses
// (`address(part, row, valid)`) and first loads (`load_first(valid)`) -- before waiting for the
// kernel before where early_weights says so, after it otherwise -- then x as the dot products
// read it. With kNorm every warp, rows past n included, joins the block's norm of x.
template <bool kNorm, int R, class Address, class LoadFirst, class Body>
__device__ void gemv_run(const float* x, const GemvLaunch& launch, int64_t k, Address&& address,
                         LoadFirst&& load_first, Body&& body) {
  static_assert(R == 1 || kNorm, "more rows a warp only where a norm prologue is shared");
  let_dependents_launch();
  int64_t row = 0;
  const GemvPart part = part_of<R>(launch, row);
  const bool valid = row < part.n;
  if (!kNorm && !valid) return;
  address(part, row, valid);
  if (!launch.early_weights) wait_for_inputs();
  load_first(valid);
  wait_for_inputs();
  const float* xs = gemv_input<kNorm>(x, k, launch.norm);
  if (!valid) return;
  body(part, row, xs);
}

// y = x w[n, k]^T for one activation row x: each lane reads 8 weights (16 bytes) of its
// warp's row per chunk, streamed past L1 (__ldcs) so x stays cached there. With kNorm every
// warp of the block, rows past n included, joins the prologue that normalises x, and a warp
// may take R rows at once (GemvMode::warp_rows) so that fewer blocks redo that prologue.
template <typename T, bool kOverlap, bool kNorm, int R>
__global__ void __launch_bounds__(kGemvWarps * 32)
    gemv_half_kernel(const float* x, GemvLaunch launch, int64_t k, GemvEpilogue epilogue) {
  const unsigned lane = threadIdx.x & 31u;
  const uint4* wr[R];
  int64_t chunks = 0;
  uint4 first[R][kGemvPrefetch];
  const auto address = [&](const GemvPart& part, int64_t row, bool valid) {
#pragma unroll
    for (int j = 0; j < R; ++j)
      wr[j] = reinterpret_cast<const uint4*>(static_cast<const T*>(part.w) +
                                             (valid ? clamped_row(row, j, part.n) : 0) * k);
    chunks = valid ? k / 8 : 0;
  };
  const auto load_first = [&](bool) {
#pragma unroll
    for (int d = 0; d < kGemvPrefetch; ++d)
#pragma unroll
      for (int j = 0; j < R; ++j)
        if (lane + 32 * d < chunks) first[j][d] = __ldcs(wr[j] + lane + 32 * d);
  };
  gemv_run<kNorm, R>(
      x, launch, k, address, load_first, [&](const GemvPart& part, int64_t row, const float* xs) {
        float acc[R] = {};
        const auto dot = [&](int64_t c, const uint4(&wv)[R]) {
          const float4 a = x4<kOverlap, kNorm>(xs, 8 * c);
          const float4 b = x4<kOverlap, kNorm>(xs, 8 * c + 4);
#pragma unroll
          for (int j = 0; j < R; ++j)
            acc[j] += dot8(a, b, halves_to_float2<T>(wv[j].x), halves_to_float2<T>(wv[j].y),
                           halves_to_float2<T>(wv[j].z), halves_to_float2<T>(wv[j].w));
        };
#pragma unroll
        for (int d = 0; d < kGemvPrefetch; ++d) {
          if (lane + 32 * d >= chunks) continue;
          uint4 wv[R];
#pragma unroll
          for (int j = 0; j < R; ++j) wv[j] = first[j][d];
          dot(lane + 32 * d, wv);
        }
        for (int64_t c = lane + 32 * kGemvPrefetch; c < chunks; c += 32) {
          uint4 wv[R];
#pragma unroll
          for (int j = 0; j < R; ++j) wv[j] = __ldcs(wr[j] + c);
          dot(c, wv);
        }
#pragma unroll
        for (int j = 0; j < R; ++j) {
          const float one[1] = {acc[j]};
          if (row + j < part.n) gemv_store<1>(one, row + j, part.n, part.bias, epilogue, part.y);
        }
      });
}

// Code j (0..7) of a 32-bit word of codes (even index in the low nibble) as a float, exactly:
// the code as the low mantissa bits of 2^23, minus 2^23 -- full-rate integer and float ops
// instead of the quarter-rate integer-to-float conversion.
__device__ float code_as_float(uint32_t word, int j) {
  return __uint_as_float(0x4B000000u | ((word >> (4 * j)) & 15u)) - 8388608.0f;
}

// A word of 8 codes with its group's min and scale.
struct Q4Word {
  uint32_t codes = 0;
  float mn = 0.0f;
  float sc = 0.0f;
};

// One row of a 4-bit matrix: its codes, and its groups' mins and scales.
struct Q4Row {
  const uint32_t* words;
  const float* mins;
  const float* scales;
  __device__ Q4Word at(int64_t e) const {
    return Q4Word{__ldcs(words + e / 8), __ldg(mins + e / 64), __ldg(scales + e / 64)};
  }
};

// One word of codes dotted with x[i, e .. e + 8) for each of the M rows into acc.
template <int M, bool kOverlap, bool kNorm>
__device__ void q4_word_dot(const float* x, int64_t k, int64_t e, const Q4Word& w,
                            float (&acc)[M]) {
  float wf[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) wf[j] = code_as_float(w.codes, j);
#pragma unroll
  for (int i = 0; i < M; ++i) {
    const float4 a = x4<kOverlap, kNorm>(x, static_cast<int64_t>(i) * k + e);
    const float4 b = x4<kOverlap, kNorm>(x, static_cast<int64_t>(i) * k + e + 4);
    const float d = a.x * wf[0] + a.y * wf[1] + a.z * wf[2] + a.w * wf[3] + b.x * wf[4] +
                    b.y * wf[5] + b.z * wf[6] + b.w * wf[7];
    const float sx = (a.x + a.y) + (a.z + a.w) + (b.x + b.y) + (b.z + b.w);
    acc[i] += w.sc * d + w.mn * sx;
  }
}

// The same GEMV over a 4-bit matrix grouped along rows by 64 (kernels/quant.h), never
// writing a dequantised weight anywhere. Lane c takes word c of each run of 32 words (256
// weights), so a warp's loads of codes (128 bytes) and of activations (two 512-byte runs per
// row) are contiguous; the codes are decoded once and serve every activation row. Two words
// a lane are in flight, the next pair loading while this one is dotted (the first pair as
// kGemvPrefetch). With kNorm a warp may take R weight rows at once, as the half kernel.
template <int M, bool kOverlap, bool kNorm, int R>
__global__ void __launch_bounds__(kGemvWarps * 32)
    gemv_q4_kernel(const float* x, GemvLaunch launch, int64_t k, GemvEpilogue epilogue) {
  constexpr int64_t kStride = 256;
  const int64_t e0 = 8 * static_cast<int64_t>(threadIdx.x & 31u);
  Q4Row w[R];
  Q4Word a[R], b[R];
  const auto address = [&](const GemvPart& part, int64_t row, bool valid) {
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const int64_t r = valid ? clamped_row(row, j, part.n) : 0;
      w[j] = Q4Row{reinterpret_cast<const uint32_t*>(static_cast<const unsigned char*>(part.w) +
                                                     r * (k / 2)),
                   part.mins + r * (k / 64), part.scales + r * (k / 64)};
    }
  };
  const auto load_first = [&](bool valid) {
    const int64_t end = valid ? k : 0;  // a row past n loads nothing
#pragma unroll
    for (int j = 0; j < R; ++j) {
      if (e0 < end) a[j] = w[j].at(e0);
      if (e0 + kStride < end) b[j] = w[j].at(e0 + kStride);
    }
  };
  gemv_run<kNorm, R>(x, launch, k, address, load_first,
                     [&](const GemvPart& part, int64_t row, const float* xs) {
                       float acc[R][M] = {};
                       for (int64_t e = e0; e < k; e += 2 * kStride) {
                         Q4Word next_a[R], next_b[R];
#pragma unroll
                         for (int j = 0; j < R; ++j) {
                           if (e + 2 * kStride < k) next_a[j] = w[j].at(e + 2 * kStride);
                           if (e + 3 * kStride < k) next_b[j] = w[j].at(e + 3 * kStride);
                         }
#pragma unroll
                         for (int j = 0; j < R; ++j) {
                           q4_word_dot<M, kOverlap, kNorm>(xs, k, e, a[j], acc[j]);
                           if (e + kStride < k)
                             q4_word_dot<M, kOverlap, kNorm>(xs, k, e + kStride, b[j], acc[j]);
                           a[j] = next_a[j];
                           b[j] = next_b[j];
                         }
                       }
#pragma unroll
                       for (int j = 0; j < R; ++j)
                         if (row + j < part.n)
                           gemv_store<M>(acc[j], row + j, part.n, part.bias, epilogue, part.y);
                     });
}

unsigned gemv_blocks(int64_t n, int warp_rows) {
  const int64_t rows = int64_t{kGemvWarps} * warp_rows;
  return static_cast<unsigned>((n + rows - 1) / rows);
}

// The launch's parts and the first block of each; false where one is empty, there are too
// many, the norm does not suit the kernel (one row of at most kMaxGemvNormWidth, aligned
// weight and bias), or warp_rows is not 1, or 2 or 4 with a norm.
bool gemv_launch(const GemvPart* parts, int count, int m, int64_t k, const GemvMode& mode,
                 GemvLaunch& l, unsigned& blocks) {
  if (count <= 0 || count > kMaxGemvParts) return false;
  const bool norm = mode.norm.kind != GemvNormKind::kNone;
  if (norm && !gemv_norm_fits(m, k, mode.norm)) return false;
  if (mode.warp_rows != 1 && !(norm && (mode.warp_rows == 2 || mode.warp_rows == 4))) return false;
  l = GemvLaunch{};
  l.count = count;
  l.early_weights = mode.early_weights;
  l.norm = mode.norm;
  blocks = 0;
  for (int i = 0; i < count; ++i) {
    if (parts[i].n <= 0 || parts[i].w == nullptr || parts[i].y == nullptr) return false;
    l.part[i] = parts[i];
    l.first_block[i] = blocks;
    blocks += gemv_blocks(parts[i].n, mode.warp_rows);
  }
  return true;
}

// A GEMV launch: kGemvWarps warps a block, one block per kGemvWarps × warp_rows output rows.
template <typename... Params, typename... Args>
void launch_gemv(void (*kernel)(Params...), unsigned blocks, size_t shared, bool overlap,
                 cudaStream_t s, Args... args) {
  launch(kernel, dim3(blocks), kGemvWarps * 32, shared, overlap, s, args...);
}

// Dynamic shared memory of a launch: x normalised, where it has a norm.
size_t gemv_shared_bytes(const GemvMode& mode, int64_t k) {
  return mode.norm.kind == GemvNormKind::kNone ? 0 : static_cast<size_t>(k) * sizeof(float);
}

// A GEMV launcher: the kernel instantiation for a launch's x, parts and mode.
using GemvLauncher = void (*)(const float*, const GemvLaunch&, unsigned, int64_t, const GemvMode&,
                              cudaStream_t);

template <int M, bool kNorm, int R = 1>
void launch_gemv_q4(const float* x, const GemvLaunch& l, unsigned blocks, int64_t k,
                    const GemvMode& mode, cudaStream_t s) {
  launch_gemv(mode.overlap ? gemv_q4_kernel<M, true, kNorm, R> : gemv_q4_kernel<M, false, kNorm, R>,
              blocks, gemv_shared_bytes(mode, k), mode.overlap, s, x, l, k, mode.epilogue);
}

template <typename T, bool kNorm, int R = 1>
void launch_gemv_half(const float* x, const GemvLaunch& l, unsigned blocks, int64_t k,
                      const GemvMode& mode, cudaStream_t s) {
  launch_gemv(
      mode.overlap ? gemv_half_kernel<T, true, kNorm, R> : gemv_half_kernel<T, false, kNorm, R>,
      blocks, gemv_shared_bytes(mode, k), mode.overlap, s, x, l, k, mode.epilogue);
}

// The half launcher for weights of type T, with or without the norm and its rows a warp
// (gemv_launch has checked them).
template <typename T>
GemvLauncher half_launcher(const GemvMode& mode) {
  if (mode.norm.kind == GemvNormKind::kNone) return launch_gemv_half<T, false>;
  return mode.warp_rows == 4   ? launch_gemv_half<T, true, 4>
         : mode.warp_rows == 2 ? launch_gemv_half<T, true, 2>
                               : launch_gemv_half<T, true, 1>;
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

// A K or V tile (key_tile * head_dim <= kTileElems elements) in flight in registers: every
// thread issues all its loads before any is needed, so a tile costs one memory latency, and
// the next tile loads while this one is computed on. kVec: head_dim % 4 == 0 and rows
// aligned for 4-element loads, each held as loaded (4 floats, or 4 halves of an f16 cache)
// and widened when the tile is stored to shared memory; else one element per lane of each
// float4, widened as it is loaded.
constexpr int kTileElems = 4096;
constexpr int kTileVecsPerThread = kTileElems / 4 / kTileThreads;
template <typename T, bool kVec>
struct TileRegs {
  std::conditional_t<kVec, Lane<T, 4>, float4> v[kTileVecsPerThread];
};

// Loads nk keys of one (slot, kv head) -- contiguous in the cache -- into registers.
template <typename T, bool kVec>
__device__ void fetch_tile(const T* __restrict__ src, int32_t nk, int32_t hd,
                           TileRegs<T, kVec>& r) {
  if constexpr (kVec) {
    const int32_t n4 = nk * hd / 4;
    const auto* s4 = reinterpret_cast<const Lane<T, 4>*>(src);
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
      if (e < n) r.v[u].x = widen(src[e]);
      if (e + kTileThreads < n) r.v[u].y = widen(src[e + kTileThreads]);
      if (e + 2 * kTileThreads < n) r.v[u].z = widen(src[e + 2 * kTileThreads]);
      if (e + 3 * kTileThreads < n) r.v[u].w = widen(src[e + 3 * kTileThreads]);
    }
  }
}

template <typename T, bool kVec>
__device__ void store_tile(const TileRegs<T, kVec>& r, int32_t nk, int32_t hd, float* tile) {
  const int32_t n = nk * hd;
#pragma unroll
  for (int u = 0; u < kTileVecsPerThread; ++u) {
    if constexpr (kVec) {
      const int32_t i = 4 * (static_cast<int32_t>(threadIdx.x) + u * kTileThreads);
      if (i < n) {
        const int32_t j = i / hd;  // the 4 values stay in one key's row (hd % 4 == 0)
        float* t = tile + j * (hd + 1) + (i - j * hd);
        float f[4];
        widen_lane<T, 4>(r.v[u], f);
        t[0] = f[0];
        t[1] = f[1];
        t[2] = f[2];
        t[3] = f[3];
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

// Where the tiled kernel's tiles come from: one (slot, kv head) of the cache. fetch_keys /
// fetch_values load nk positions from key0 on into a thread's registers (Regs) as stored;
// store() widens them into a shared-memory tile [nk][hd + 1].
// An f32 or f16 cache (T = float or __half).
template <typename T, bool kVec>
struct ElemTiles : ElemHead<T> {
  using Desc = KvCacheDesc;
  using Regs = TileRegs<T, kVec>;
  using ElemHead<T>::ElemHead;
  __device__ void fetch_keys(int32_t key0, int32_t nk, Regs& r) const {
    fetch_tile<T, kVec>(this->k + static_cast<int64_t>(key0) * this->hd, nk, this->hd, r);
  }
  __device__ void fetch_values(int32_t key0, int32_t nk, Regs& r) const {
    fetch_tile<T, kVec>(this->v + static_cast<int64_t>(key0) * this->hd, nk, this->hd, r);
  }
  __device__ void store(const Regs& r, int32_t nk, float* tile) const {
    store_tile<T, kVec>(r, nk, this->hd, tile);
  }
};

// A 4-bit cache (policy cc), read as stored: each 4 elements of a tile are 2 bytes of codes
// and their group's min and scale (head_dim and the group multiples of 4), decoded with one
// rounding (fmaf) as the CPU decodes them.
struct Q4Quad {
  unsigned short codes;
  float mn, sc;
};
struct Q4TileRegs {
  Q4Quad v[kTileVecsPerThread];
};
struct Q4Tiles : Q4Head {
  using Desc = KvQ4Desc;
  using Regs = Q4TileRegs;
  using Q4Head::Q4Head;
  __device__ void fetch(const Q4Ptrs& b, int32_t key0, int32_t nk, Regs& r) const {
    const int32_t n4 = nk * hd / 4;
    const int64_t e0 = (first + key0) * hd;  // the tile's first element in the blob
    const auto* quads = reinterpret_cast<const unsigned short*>(b.codes);
#pragma unroll
    for (int u = 0; u < kTileVecsPerThread; ++u) {
      const int32_t e = static_cast<int32_t>(threadIdx.x) + u * kTileThreads;
      if (e < n4) {
        const int64_t at = e0 + 4 * static_cast<int64_t>(e);
        r.v[u] = {quads[at / 4], b.mins[at / group], b.scales[at / group]};
      }
    }
  }
  __device__ void fetch_keys(int32_t key0, int32_t nk, Regs& r) const {
    fetch(kb, key0, nk, r);
  }
  __device__ void fetch_values(int32_t key0, int32_t nk, Regs& r) const {
    fetch(vb, key0, nk, r);
  }
  __device__ void store(const Regs& r, int32_t nk, float* tile) const {
    const int32_t n = nk * hd;
#pragma unroll
    for (int u = 0; u < kTileVecsPerThread; ++u) {
      const int32_t i = 4 * (static_cast<int32_t>(threadIdx.x) + u * kTileThreads);
      if (i < n) {
        const int32_t j = i / hd;  // the 4 values stay in one key's row (hd % 4 == 0)
        float* t = tile + j * (hd + 1) + (i - j * hd);
#pragma unroll
        for (int q = 0; q < 4; ++q)
          t[q] = fmaf(static_cast<float>((r.v[u].codes >> (4 * q)) & 0xF), r.v[u].sc, r.v[u].mn);
      }
    }
  }
};

// One block: up to rows_per_tile consecutive token rows, heads_per_block query heads of one
// kv head, keys of one split. Consecutive rows of the same KV slot (a prefill chunk) share
// every K/V tile; rows of different slots are taken one slot-run after another. Tiles: where
// the tiles come from (ElemTiles, Q4Tiles).
template <class Tiles>
__global__ void __launch_bounds__(kTileThreads)
    attention_tiled_kernel(const float* q, const RowDesc* rows, int64_t n_rows,
                           typename Tiles::Desc c, TileArgs a, float* __restrict__ out,
                           float* __restrict__ partial) {
  extern __shared__ float smem[];
  __shared__ RowDesc s_rows[kMaxQueryRows];
  let_dependents_launch();
  wait_for_inputs();  // q and the row table (no __restrict__: loads stay after this)
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
  typename Tiles::Regs kr, vr;

  for (int32_t g0 = 0; g0 < nr;) {
    const int32_t slot = s_rows[g0].slot;
    int32_t g1 = g0 + 1;
    int32_t max_pos = s_rows[g0].pos;
    while (g1 < nr && s_rows[g1].slot == slot) max_pos = max(max_pos, s_rows[g1++].pos);
    const int32_t nq = (g1 - g0) * gb;
    const int32_t key_begin = static_cast<int32_t>(blockIdx.z) * a.keys_per_split;
    const int32_t key_end = min(max_pos + 1, key_begin + a.keys_per_split);
    const Tiles src(c, slot, kvh);
    if (key_begin < key_end) src.fetch_keys(key_begin, min(tk, key_end - key_begin), kr);

    for (int32_t e = threadIdx.x; e < nq * hd; e += blockDim.x) {
      const int32_t qi = e / hd;
      const RowDesc& d = s_rows[g0 + qi / gb];
      s_q[e] = q[static_cast<int64_t>(d.row) * width + static_cast<int64_t>(h0 + qi % gb) * hd +
                 (e - qi * hd)];
    }
    // Read after the key loop's barriers. A split past a slot-run's last key runs no loop,
    // and its result is written from key_begin < key_end below, never from these.
    for (int32_t qi = threadIdx.x; qi < nq; qi += blockDim.x) {
      s_m[qi] = -INFINITY;
      s_l[qi] = 0.0f;
    }
    float o[kMaxOutPerThread];
#pragma unroll
    for (int i = 0; i < kMaxOutPerThread; ++i) o[i] = 0.0f;

    for (int32_t t0 = key_begin; t0 < key_end; t0 += tk) {
      const int32_t nk = min(tk, key_end - t0);
      src.store(kr, nk, s_k);
      src.fetch_values(t0, nk, vr);
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
      src.store(vr, nk, s_v);
      if (t0 + tk < key_end) src.fetch_keys(t0 + tk, min(tk, key_end - t0 - tk), kr);
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
          const bool any_key = key_begin < key_end;
          pr[dd] = o[i];
          if (dd == 0) {
            pr[hd] = any_key ? s_m[qi] : -INFINITY;
            pr[hd + 1] = any_key ? s_l[qi] : 0.0f;
          }
        }
      }
    }
    __syncthreads();  // s_q, s_m, s_l are rewritten by the next slot-run
    g0 = g1;
  }
}

// Joining the splits of one (row entry, head): out = sum_z O_z e^(m_z - M) / sum_z l_z e^(m_z - M).
// The split results are another block's (or kernel's) writes: read through L2 (ld.cg).
constexpr int kMaxSplits = 64;

// One warp weighs the splits of one (row entry, head), `p` its first split's result: the
// weights e^(m_z - M) into s_w (lane z takes splits z and z + 32), and the joined
// denominator into *s_l. A split with no key in range (m_z = -inf) weighs 0.
__device__ void weigh_splits(const float* p, int32_t splits, int32_t hd, float* s_w, float* s_l) {
  const int32_t z0 = static_cast<int32_t>(threadIdx.x & 31u), z1 = z0 + 32;
  const float m0 = z0 < splits ? __ldcg(p + z0 * (hd + 2) + hd) : -INFINITY;
  const float m1 = z1 < splits ? __ldcg(p + z1 * (hd + 2) + hd) : -INFINITY;
  const float mx = warp_max(fmaxf(m0, m1));
  const float w0 = m0 == -INFINITY ? 0.0f : expf(m0 - mx);
  const float w1 = m1 == -INFINITY ? 0.0f : expf(m1 - mx);
  const float l = warp_sum((w0 > 0.0f ? __ldcg(p + z0 * (hd + 2) + hd + 1) * w0 : 0.0f) +
                           (w1 > 0.0f ? __ldcg(p + z1 * (hd + 2) + hd + 1) * w1 : 0.0f));
  if (z0 < splits) s_w[z0] = w0;
  if (z1 < splits) s_w[z1] = w1;
  if (z0 == 0) *s_l = l;
}

// Dimension dd of the joined output, from the weights weigh_splits made: the loads of the
// splits are independent, so none waits on another.
__device__ float joined(const float* p, int32_t splits, int32_t hd, const float* s_w, float l,
                        int32_t dd) {
  float acc = 0.0f;
#pragma unroll 8
  for (int32_t z = 0; z < splits; ++z)
    acc += s_w[z] == 0.0f ? 0.0f : __ldcg(p + z * (hd + 2) + dd) * s_w[z];
  return l > 0.0f ? acc / l : 0.0f;
}

// The split combine as a kernel of its own: one block per (row entry, head).
__global__ void attention_combine_kernel(const float* partial, const RowDesc* rows, int32_t n_heads,
                                         int32_t hd, int32_t splits, float* __restrict__ out) {
  __shared__ float s_w[kMaxSplits];
  __shared__ float s_l;
  let_dependents_launch();
  wait_for_inputs();
  const int64_t eh = blockIdx.x;  // table entry * n_heads + head
  const float* p = partial + eh * splits * (hd + 2);
  if (threadIdx.x < 32) weigh_splits(p, splits, hd, s_w, &s_l);
  __syncthreads();
  float* o =
      out + static_cast<int64_t>(rows[eh / n_heads].row) * n_heads * hd + (eh % n_heads) * hd;
  for (int32_t dd = threadIdx.x; dd < hd; dd += blockDim.x)
    o[dd] = joined(p, splits, hd, s_w, s_l, dd);
}

// ---- Decode attention: warps over keys ----------------------------------------------------

// One decode row's attention over one kv head, every query head of its group together: the
// block's warps take chunks of consecutive keys, a lane holding V of head_dim = 32 * V
// dimensions. A warp issues the loads of a whole chunk's keys and values before it needs
// any (values do not wait for the scores), so a lane has 2 * kChunk * 16 bytes in flight
// (half that of an f16 cache, whose chunk is then half the bytes too) and the step's cache
// reads are in flight together rather than tile after tile. Warps
// keep their own online softmax; the block joins them in shared memory at the end.
constexpr int kDecodeWarps = 4;
constexpr int kDecodeThreads = kDecodeWarps * 32;

template <int V>
__device__ void load_lane(const float* p, float (&r)[V]) {
  if constexpr (V == 4) {
    const float4 t = *reinterpret_cast<const float4*>(p);
    r[0] = t.x, r[1] = t.y, r[2] = t.z, r[3] = t.w;
  } else {
    static_assert(V == 2);
    const float2 t = *reinterpret_cast<const float2*>(p);
    r[0] = t.x, r[1] = t.y;
  }
}

// Online softmax of one query head over a chunk's scores s (-inf where masked): rescales
// the running o and l to the new maximum and adds the chunk's weighted values.
template <int V, int kChunk>
__device__ void softmax_chunk(const float (&s)[kChunk], const float (&vr)[kChunk][V], float& m,
                              float& l, float (&o)[V]) {
  float mx = s[0];
#pragma unroll
  for (int j = 1; j < kChunk; ++j) mx = fmaxf(mx, s[j]);
  const float m_new = fmaxf(m, mx);  // finite: a chunk's first key is always in range
  const float corr = m == -INFINITY ? 0.0f : expf(m - m_new);
  l *= corr;
#pragma unroll
  for (int v = 0; v < V; ++v) o[v] *= corr;
#pragma unroll
  for (int j = 0; j < kChunk; ++j) {
    const float p = s[j] == -INFINITY ? 0.0f : expf(s[j] - m_new);
    l += p;
#pragma unroll
    for (int v = 0; v < V; ++v) o[v] += p * vr[j][v];
  }
  m = m_new;
}

// A row of the step's table, read after wait_for_inputs() through L2 (ld.cg, not the
// read-only path, since an earlier kernel may have written it): every other address the
// kernel reads depends on it, so no load moves ahead of the wait.
__device__ RowDesc load_row(const RowDesc* rows, int64_t i) {
  const int32_t* r = reinterpret_cast<const int32_t*>(rows + i);
  return RowDesc{__ldcg(r), __ldcg(r + 1), __ldcg(r + 2)};
}

// The block's join of its warps' online softmaxes for G query heads of kHd dimensions each:
// element e of [G][kHd] as this thread's share (o = sum_w O_w e^(m_w - M), with the
// block's max M and denominator l).
struct WarpJoin {
  float o, m, l;
};
template <int G, int kHd>
__device__ WarpJoin join_warps(const float* s_o, const float* s_m, const float* s_l, int32_t e) {
  const int32_t g = e / kHd;
  const int32_t dd = e - g * kHd;
  WarpJoin j{0.0f, -INFINITY, 0.0f};
#pragma unroll
  for (int w = 0; w < kDecodeWarps; ++w) j.m = fmaxf(j.m, s_m[w * G + g]);
#pragma unroll
  for (int w = 0; w < kDecodeWarps; ++w) {
    const float mw = s_m[w * G + g];
    if (mw == -INFINITY) continue;  // a warp with no key in range
    const float f = expf(mw - j.m);
    j.o += s_o[(w * G + g) * kHd + dd] * f;
    j.l += s_l[w * G + g] * f;
  }
  return j;
}

// With DecodeFusion::arrivals: this block's split result is written; the last block of its
// (row entry, kv head) to get here joins every split of the group's G heads into out and
// sets the counter back to zero. The others return. Each thread fences its own writes
// before the barrier, so they are visible device-wide before thread 0 counts the block in.
template <int G, int kHd>
__device__ void join_if_last(unsigned* arrivals, const float* partial, int64_t entry, int32_t kvh,
                             const TileArgs& a, float* out_row) {
  __shared__ float s_w[G * kMaxSplits];
  __shared__ float s_lj[G];
  __shared__ bool s_last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned* counter = arrivals + entry * gridDim.y + kvh;
    const bool last = atomicAdd(counter, 1u) + 1u == static_cast<unsigned>(a.splits);
    if (last) {
      __threadfence();  // acquire: the splits counted in before are seen from here on
      *counter = 0u;    // every split is in: nothing else reads it in this launch
    }
    s_last = last;
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();  // the other splits' writes, counted in before ours, are read after this
  const int32_t warp = static_cast<int32_t>(threadIdx.x >> 5);
  const auto first = [&](int32_t g) {
    return partial +
           ((entry * a.n_heads + static_cast<int64_t>(kvh) * G + g) * a.splits) * (kHd + 2);
  };
  for (int32_t g = warp; g < G; g += kDecodeWarps)
    weigh_splits(first(g), a.splits, kHd, s_w + g * kMaxSplits, s_lj + g);
  __syncthreads();
  for (int32_t e = static_cast<int32_t>(threadIdx.x); e < G * kHd; e += kDecodeThreads) {
    const int32_t g = e / kHd;
    const int32_t dd = e - g * kHd;
    out_row[(static_cast<int64_t>(kvh) * G + g) * kHd + dd] =
        joined(first(g), a.splits, kHd, s_w + g * kMaxSplits, s_lj[g], dd);
  }
}

// How the decode kernel reads one (slot, kv head)'s keys and values, a lane's V elements of
// position t at a time: key(t) / value(t) load them as stored (Bits), widen() makes them f32
// once a chunk's loads are all out. Position t's elements are 32 Bits on from t - 1's.
// An f32 or f16 cache (T = float or __half).
template <typename T, int V>
struct ElemRows {
  using Desc = KvCacheDesc;
  using Bits = Lane<T, V>;
  static constexpr bool kStores = true;  // takes kv_store folded in (DecodeFusion)
  const Bits* k;
  const Bits* v;
  int64_t at;  // the lane's first Bits of position 0, from the cache's start
  __device__ ElemRows(const KvCacheDesc& c, int32_t slot, int32_t kvh, int32_t lane)
      : at(head_offset(c, slot, kvh) / V + lane) {
    k = static_cast<const Bits*>(c.k) + at;
    v = static_cast<const Bits*>(c.v) + at;
  }
  __device__ Bits key(int32_t t) const { return k[static_cast<int64_t>(t) * 32]; }
  __device__ Bits value(int32_t t) const { return v[static_cast<int64_t>(t) * 32]; }
  __device__ static void widen(const Bits& b, float (&r)[V]) { widen_lane<T, V>(b, r); }
  // New rows as the cache stores them (rounded to its element), and stored at position t.
  __device__ static Bits narrow(const float (&r)[V]) { return narrow_lane<T, V>(r); }
  __device__ void put(const KvCacheDesc& c, int32_t t, const Bits& kb, const Bits& vb) const {
    static_cast<Bits*>(c.k)[at + static_cast<int64_t>(t) * 32] = kb;
    static_cast<Bits*>(c.v)[at + static_cast<int64_t>(t) * 32] = vb;
  }
};
template <int V>
using F32Rows = ElemRows<float, V>;
template <int V>
using F16Rows = ElemRows<__half, V>;

// A 4-bit cache read as stored (policy cc): a lane's V codes (V / 2 bytes) and its group's
// min and scale; widen() decodes each element as code * scale + min with one rounding
// (fmaf), as the CPU does. The lane's elements lie in one group (group % V == 0).
template <int V>
struct Q4Rows {
  using Desc = KvQ4Desc;
  using Codes = std::conditional_t<V == 4, unsigned short, unsigned char>;
  struct Bits {
    Codes codes;
    float mn, sc;
  };
  static constexpr bool kStores = false;
  const Codes* kc;
  const Codes* vc;
  const float *kmin, *kscale, *vmin, *vscale;
  int32_t gpr;  // groups a row
  __device__ Q4Rows(const KvQ4Desc& c, int32_t slot, int32_t kvh, int32_t lane)
      : gpr(c.head_dim / c.group) {
    const Q4Head h(c, slot, kvh);
    kc = reinterpret_cast<const Codes*>(h.kb.codes + h.first * h.hd / 2) + lane;
    vc = reinterpret_cast<const Codes*>(h.vb.codes + h.first * h.hd / 2) + lane;
    const int64_t g = h.first * gpr + lane * V / h.group;
    kmin = h.kb.mins + g, kscale = h.kb.scales + g;
    vmin = h.vb.mins + g, vscale = h.vb.scales + g;
  }
  __device__ Bits key(int32_t t) const {
    const int64_t g = static_cast<int64_t>(t) * gpr;
    return {kc[static_cast<int64_t>(t) * 32], kmin[g], kscale[g]};
  }
  __device__ Bits value(int32_t t) const {
    const int64_t g = static_cast<int64_t>(t) * gpr;
    return {vc[static_cast<int64_t>(t) * 32], vmin[g], vscale[g]};
  }
  __device__ static void widen(const Bits& b, float (&r)[V]) {
#pragma unroll
    for (int i = 0; i < V; ++i)
      r[i] = fmaf(static_cast<float>((b.codes >> (4 * i)) & 0xF), b.sc, b.mn);
  }
};

// Rows: how the cache is read (F32Rows, F16Rows, Q4Rows).
template <template <int> class RowsOf, int V, int G>
__global__ void __launch_bounds__(kDecodeThreads)
    attention_decode_kernel(const float* q, const RowDesc* rows, typename RowsOf<V>::Desc c,
                            TileArgs a, DecodeFusion f, float* __restrict__ out,
                            float* __restrict__ partial) {
  using Rows = RowsOf<V>;
  using Bits = typename Rows::Bits;
  constexpr int kHd = 32 * V;
  constexpr int kChunk = G <= 2 ? 8 : 4;  // keys a warp has in flight (registers: G x kChunk)
  __shared__ float s_o[kDecodeWarps * G * kHd];
  __shared__ float s_m[kDecodeWarps * G], s_l[kDecodeWarps * G];
  let_dependents_launch();
  wait_for_inputs();
  const RowDesc d = load_row(rows, blockIdx.x);
  const int32_t kvh = static_cast<int32_t>(blockIdx.y);
  const int32_t key_begin = static_cast<int32_t>(blockIdx.z) * a.keys_per_split;
  const int32_t key_end = min(d.pos + 1, key_begin + a.keys_per_split);
  const int32_t lane = static_cast<int32_t>(threadIdx.x & 31u);
  const int32_t warp = static_cast<int32_t>(threadIdx.x >> 5);
  const int64_t width = static_cast<int64_t>(a.n_heads) * kHd;

  float qv[G][V], o[G][V], m[G], l[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    load_lane<V>(q + d.row * width + static_cast<int64_t>(kvh * G + g) * kHd + lane * V, qv[g]);
#pragma unroll
    for (int v = 0; v < V; ++v) qv[g][v] *= a.scale, o[g][v] = 0.0f;
    m[g] = -INFINITY;
    l[g] = 0.0f;
  }
  const Rows kv(c, d.slot, kvh, lane);
  // kv_store folded in (an f32 or f16 cache): the new key and value come from the step's
  // rows, rounded as the cache stores them, and the split that holds position pos writes
  // them to the cache (no block reads them from there).
  int32_t new_pos = -1;
  Bits k_new{}, v_new{};
  if constexpr (Rows::kStores) {
    new_pos = f.k_new != nullptr ? d.pos : -1;
    if (new_pos >= key_begin && new_pos < key_end) {
      const int64_t at = static_cast<int64_t>(d.row) * c.n_kv_heads * kHd + kvh * kHd + lane * V;
      float kr[V], vr[V];
      load_lane<V>(f.k_new + at, kr);
      load_lane<V>(f.v_new + at, vr);
      k_new = Rows::narrow(kr);
      v_new = Rows::narrow(vr);
      if (warp == 0) kv.put(c, new_pos, k_new, v_new);
    }
  }
  for (int32_t t0 = key_begin + warp * kChunk; t0 < key_end; t0 += kDecodeWarps * kChunk) {
    Bits kl[kChunk], vl[kChunk];  // loaded as stored; widened below, once all are out
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      const int32_t t = t0 + j;
      if (t == new_pos) {
        kl[j] = k_new;
        vl[j] = v_new;
      } else if (t < key_end) {
        kl[j] = kv.key(t);
        vl[j] = kv.value(t);
      } else {
        kl[j] = Bits{};  // all-zero bits: 0.0 in f32, f16 and 4-bit
        vl[j] = Bits{};
      }
    }
    float kr[kChunk][V], vr[kChunk][V];
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      Rows::widen(kl[j], kr[j]);
      Rows::widen(vl[j], vr[j]);
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float s[kChunk];
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
        float dot = 0.0f;
#pragma unroll
        for (int v = 0; v < V; ++v) dot += qv[g][v] * kr[j][v];
        s[j] = warp_sum(dot);  // the same bits in every lane (xor butterfly)
        if (t0 + j >= key_end) s[j] = -INFINITY;
      }
      softmax_chunk<V, kChunk>(s, vr, m[g], l[g], o[g]);
    }
  }

#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int v = 0; v < V; ++v) s_o[(warp * G + g) * kHd + lane * V + v] = o[g][v];
    if (lane == 0) {
      s_m[warp * G + g] = m[g];
      s_l[warp * G + g] = l[g];
    }
  }
  __syncthreads();
  const int64_t entry = blockIdx.x;
  for (int32_t e = static_cast<int32_t>(threadIdx.x); e < G * kHd; e += kDecodeThreads) {
    const WarpJoin j = join_warps<G, kHd>(s_o, s_m, s_l, e);
    const int64_t h = static_cast<int64_t>(kvh) * G + e / kHd;
    const int32_t dd = e % kHd;
    if (a.splits == 1) {
      out[d.row * width + h * kHd + dd] = j.l > 0.0f ? j.o / j.l : 0.0f;
    } else {
      float* pr = partial + ((entry * a.n_heads + h) * a.splits + blockIdx.z) * (kHd + 2);
      pr[dd] = j.o;
      if (dd == 0) {
        pr[kHd] = j.m;
        pr[kHd + 1] = j.l;
      }
    }
  }
  // Every block gets here, an empty split too (it writes m = -inf, l = 0): the counter
  // reaches a.splits only so, and only then goes back to zero for the next launch. Hence no
  // early return anywhere above.
  if (a.splits > 1 && f.arrivals != nullptr)
    join_if_last<G, kHd>(f.arrivals, partial, entry, kvh, a, out + d.row * width);
}

template <class Desc>
using DecodeKernel = void (*)(const float*, const RowDesc*, Desc, TileArgs, DecodeFusion, float*,
                              float*);

template <template <int> class RowsOf, int V>
DecodeKernel<typename RowsOf<V>::Desc> decode_kernel_for_group(int32_t group) {
  switch (group) {
    case 1:
      return attention_decode_kernel<RowsOf, V, 1>;
    case 2:
      return attention_decode_kernel<RowsOf, V, 2>;
    case 4:
      return attention_decode_kernel<RowsOf, V, 4>;
    case 8:
      return attention_decode_kernel<RowsOf, V, 8>;
    default:
      return nullptr;
  }
}

template <template <int> class RowsOf>
DecodeKernel<typename RowsOf<2>::Desc> decode_kernel_for_head_dim(int32_t head_dim, int32_t group) {
  if (head_dim == 64) return decode_kernel_for_group<RowsOf, 2>(group);
  if (head_dim == 128) return decode_kernel_for_group<RowsOf, 4>(group);
  return nullptr;
}

// The warps-over-keys kernel for this cache element, head_dim and group, or null where it
// has none.
DecodeKernel<KvCacheDesc> decode_kernel_for(ElemType elem, int32_t head_dim, int32_t group) {
  if (elem == ElemType::kF32) return decode_kernel_for_head_dim<F32Rows>(head_dim, group);
  if (elem == ElemType::kF16) return decode_kernel_for_head_dim<F16Rows>(head_dim, group);
  return nullptr;
}

// Whether the warps-over-keys kernel takes a step tiled by `t` (else the tiled kernel does):
// one row a block and a whole group, a head_dim and group it has a kernel for, q and the
// cache 16-byte aligned.
bool takes_decode_kernel(const AttentionTiling& t, const float* q, const KvCacheDesc& c,
                         int32_t n_heads) {
  return t.decode_warps && t.rows_per_tile == 1 && c.n_kv_heads > 0 &&
         n_heads % c.n_kv_heads == 0 && t.heads_per_block == n_heads / c.n_kv_heads &&
         decode_kernel_for(c.elem, c.head_dim, t.heads_per_block) != nullptr && aligned16(q) &&
         aligned16(c.k) && aligned16(c.v);
}

// What one launch does under the tiling `t`.
TileArgs tile_args(const AttentionTiling& t, int32_t n_heads, int32_t n_kv_heads, float scale,
                   int32_t max_context) {
  TileArgs a;
  a.n_heads = n_heads;
  a.group = n_heads / n_kv_heads;
  a.heads_per_block = t.heads_per_block;
  a.blocks_per_kv = (a.group + t.heads_per_block - 1) / t.heads_per_block;
  a.rows_per_tile = t.rows_per_tile;
  a.key_tile = t.key_tile;
  a.splits = t.splits;
  const int32_t ctx = max_context > 0 ? max_context : 1;
  a.keys_per_split = t.splits == 1 ? INT32_MAX : split_keys(ctx, t.splits, t.key_tile);
  a.scale = scale;
  return a;
}

// Whether `t` is a tiling both attention entries can launch over head_dim hd, n_kv kv heads
// and n_heads query heads, with `partial` for its splits.
bool tiling_fits(const AttentionTiling& t, int32_t hd, int32_t n_kv, int32_t n_heads,
                 const float* partial) {
  return hd > 0 && hd <= kMaxAttentionHeadDim && n_kv > 0 && n_heads % n_kv == 0 &&
         t.key_tile > 0 && t.key_tile <= 32 && t.key_tile * hd <= kTileElems &&
         t.heads_per_block > 0 && t.rows_per_tile > 0 &&
         t.rows_per_tile * t.heads_per_block <= kMaxQueryRows &&
         t.rows_per_tile * t.heads_per_block * hd <= kMaxOutputs &&
         kTileThreads % t.key_tile == 0 && t.splits > 0 && t.splits <= kMaxSplits &&
         !(t.splits > 1 && (partial == nullptr || t.rows_per_tile != 1)) &&
         !(t.decode_warps && t.rows_per_tile != 1);
}

// The tiled kernel's grid under `t`.
dim3 tiled_grid(const AttentionTiling& t, const TileArgs& a, int64_t n_rows, int32_t n_kv) {
  return dim3(static_cast<unsigned>((n_rows + t.rows_per_tile - 1) / t.rows_per_tile),
              static_cast<unsigned>(n_kv * a.blocks_per_kv), static_cast<unsigned>(t.splits));
}

// The split combine after a launch of `splits` blocks over each context.
void combine_splits(const float* partial, const RowDesc* rows, int64_t n_rows, int32_t n_heads,
                    int32_t hd, int32_t splits, bool overlap, cudaStream_t s, float* out) {
  launch(attention_combine_kernel, dim3(static_cast<unsigned>(n_rows * n_heads)), 128, 0, overlap,
         s, partial, rows, n_heads, hd, splits, out);
}

}  // namespace

bool takes_q4_decode_kernel(const AttentionTiling& t, const float* q, const KvQ4Desc& c,
                            int32_t n_heads) {
  const int32_t lane_elems = c.head_dim / 32;
  return t.decode_warps && t.rows_per_tile == 1 && t.splits >= 1 && t.splits <= kMaxSplits &&
         c.n_kv_heads > 0 && n_heads % c.n_kv_heads == 0 &&
         t.heads_per_block == n_heads / c.n_kv_heads &&
         decode_kernel_for_head_dim<Q4Rows>(c.head_dim, t.heads_per_block) != nullptr &&
         c.group > 0 && c.head_dim % c.group == 0 && c.group % lane_elems == 0 && aligned16(q) &&
         aligned16(c.k) && aligned16(c.v);
}

bool q4_tiles_fit(const KvQ4Desc& c) {
  return c.head_dim % 4 == 0 && c.group > 0 && c.group % 4 == 0 && c.head_dim % c.group == 0 &&
         aligned16(c.k) && aligned16(c.v);
}

KernelStatus attention_q4_tiled(const float* q, const RowDesc* rows, int64_t n_rows,
                                const KvQ4Desc& cache, int32_t n_heads, float scale,
                                int32_t max_context, const AttentionTiling& t, float* partial,
                                float* out, StreamHandle stream, bool overlap) {
  if (n_rows <= 0 || n_heads <= 0) return {};
  const int32_t hd = cache.head_dim;
  const bool warps = takes_q4_decode_kernel(t, q, cache, n_heads);
  if (!tiling_fits(t, hd, cache.n_kv_heads, n_heads, partial) || (!warps && !q4_tiles_fit(cache)))
    return invalid();
  const TileArgs a = tile_args(t, n_heads, cache.n_kv_heads, scale, max_context);
  const cudaStream_t s = as_stream(stream);
  if (warps) {
    const dim3 grid(static_cast<unsigned>(n_rows), static_cast<unsigned>(cache.n_kv_heads),
                    static_cast<unsigned>(t.splits));
    launch(decode_kernel_for_head_dim<Q4Rows>(hd, a.group), grid, kDecodeThreads, 0, overlap, s, q,
           rows, cache, a, DecodeFusion{}, out, partial);
  } else {
    launch(attention_tiled_kernel<Q4Tiles>, tiled_grid(t, a, n_rows, cache.n_kv_heads),
           kTileThreads, attention_tiled_shared_bytes(t, hd), overlap, s, q, rows, n_rows, cache, a,
           out, partial);
  }
  if (t.splits > 1) combine_splits(partial, rows, n_rows, n_heads, hd, t.splits, overlap, s, out);
  return last_status();
}

bool decode_fusion_fits(const AttentionTiling& t, const float* q, const KvCacheDesc& cache,
                        int32_t n_heads, const DecodeFusion& f) {
  return takes_decode_kernel(t, q, cache, n_heads) &&
         (f.k_new == nullptr) == (f.v_new == nullptr) && aligned16(f.k_new) && aligned16(f.v_new);
}

bool gemv_norm_fits(int m, int64_t k, const GemvNorm& norm) {
  return m == 1 && k <= kMaxGemvNormWidth && k % 4 == 0 && aligned16(norm.weight) &&
         (norm.bias == nullptr || aligned16(norm.bias));
}

KernelStatus gemv_half_parts(const float* x, int m, const GemvPart* parts, int count, ElemType type,
                             int64_t k, const GemvMode& mode, StreamHandle stream) {
  if (m <= 0) return {};
  GemvLaunch l;
  unsigned blocks = 0;
  if (m > kMaxGemvRowsHalf || k <= 0 || k % 8 != 0 || type == ElemType::kF32 || !aligned16(x) ||
      !gemv_launch(parts, count, m, k, mode, l, blocks))
    return invalid();
  for (int i = 0; i < count; ++i)
    if (!aligned16(parts[i].w)) return invalid();
  const GemvLauncher launch =
      type == ElemType::kF16 ? half_launcher<__half>(mode) : half_launcher<__nv_bfloat16>(mode);
  launch(x, l, blocks, k, mode, as_stream(stream));
  return last_status();
}

KernelStatus gemv_q4_parts(const float* x, int m, const GemvPart* parts, int count, int64_t k,
                           const GemvMode& mode, StreamHandle stream) {
  if (m <= 0) return {};
  GemvLaunch l;
  unsigned blocks = 0;
  if (m > kMaxGemvRowsQ4 || k <= 0 || k % 64 != 0 || !aligned16(x) ||
      !gemv_launch(parts, count, m, k, mode, l, blocks))
    return invalid();
  for (int i = 0; i < count; ++i)
    if (!aligned16(parts[i].w) || parts[i].mins == nullptr || parts[i].scales == nullptr)
      return invalid();
  // One instantiation per row count, so each keeps its accumulators in registers; the norm
  // takes one row (gemv_launch), and its warps 1, 2 or 4 weight rows.
  constexpr GemvLauncher kLaunchers[kMaxGemvRowsQ4] = {
      launch_gemv_q4<1, false>, launch_gemv_q4<2, false>, launch_gemv_q4<3, false>,
      launch_gemv_q4<4, false>, launch_gemv_q4<5, false>, launch_gemv_q4<6, false>,
      launch_gemv_q4<7, false>, launch_gemv_q4<8, false>};
  const GemvLauncher launch = mode.norm.kind == GemvNormKind::kNone ? kLaunchers[m - 1]
                              : mode.warp_rows == 4                 ? launch_gemv_q4<1, true, 4>
                              : mode.warp_rows == 2                 ? launch_gemv_q4<1, true, 2>
                                                                    : launch_gemv_q4<1, true, 1>;
  launch(x, l, blocks, k, mode, as_stream(stream));
  return last_status();
}

AttentionTiling plan_attention(int64_t n_rows, int64_t n_seqs, int32_t max_context, int32_t n_heads,
                               int32_t n_kv_heads, int32_t head_dim, int32_t sm_count,
                               size_t partial_bytes, bool allow_decode_warps) {
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
  // Both cache elements have the same kernels (decode_kernel_for).
  t.decode_warps =
      allow_decode_warps && decode && decode_kernel_for(ElemType::kF32, head_dim, group) != nullptr;
  if (t.decode_warps) t.heads_per_block = group;
  const int64_t blocks = (n_rows + t.rows_per_tile - 1) / t.rows_per_tile * n_kv_heads *
                         ((group + t.heads_per_block - 1) / t.heads_per_block);
  t.splits = 1;
  if (decode && sm_count > 0) {
    // Enough blocks to fill the GPU, each split whole key tiles, within the partial-result
    // scratch. The tiled kernel runs a block's tiles one after another, so at a short
    // context (one decode row of a 7B model at 500 positions) more, shorter splits are what
    // fills the GPU: four blocks an SM, a split at least one tile (floor). The warps-over-keys
    // kernel has a block's keys in flight at once and wants more, smaller blocks: eight an
    // SM, down to one tile of 32 keys per split (ceil), one chunk per warp.
    const int64_t per_sm = t.decode_warps ? 8 : 4;
    const int64_t want = (per_sm * sm_count + blocks - 1) / blocks;
    const int64_t by_keys = std::max<int64_t>(
        1, t.decode_warps ? (max_context + t.key_tile - 1) / t.key_tile : max_context / t.key_tile);
    int64_t splits = std::min<int64_t>({want, by_keys, kMaxSplits});
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
                             float* out, StreamHandle stream, bool overlap,
                             const DecodeFusion& fusion) {
  if (n_rows <= 0 || n_heads <= 0) return {};
  const int32_t hd = cache.head_dim;
  if (!tiling_fits(t, hd, cache.n_kv_heads, n_heads, partial) ||
      (cache.elem != ElemType::kF32 && cache.elem != ElemType::kF16))
    return invalid();
  const TileArgs a = tile_args(t, n_heads, cache.n_kv_heads, scale, max_context);
  const cudaStream_t s = as_stream(stream);
  const bool vec = hd % 4 == 0 && aligned16(cache.k) && aligned16(cache.v);
  const bool half = cache.elem == ElemType::kF16;
  if (fusion.any() && !decode_fusion_fits(t, q, cache, n_heads, fusion)) return invalid();
  if (takes_decode_kernel(t, q, cache, n_heads)) {
    const DecodeKernel<KvCacheDesc> decode = decode_kernel_for(cache.elem, hd, a.group);
    const dim3 grid(static_cast<unsigned>(n_rows), static_cast<unsigned>(cache.n_kv_heads),
                    static_cast<unsigned>(t.splits));
    launch(decode, grid, kDecodeThreads, 0, overlap, s, q, rows, cache, a, fusion, out, partial);
    if (t.splits > 1 && fusion.arrivals != nullptr) return last_status();
  } else {
    const auto tiled = half ? (vec ? attention_tiled_kernel<ElemTiles<__half, true>>
                                   : attention_tiled_kernel<ElemTiles<__half, false>>)
                            : (vec ? attention_tiled_kernel<ElemTiles<float, true>>
                                   : attention_tiled_kernel<ElemTiles<float, false>>);
    launch(tiled, tiled_grid(t, a, n_rows, cache.n_kv_heads), kTileThreads,
           attention_tiled_shared_bytes(t, hd), overlap, s, q, rows, n_rows, cache, a, out,
           partial);
  }
  if (t.splits > 1) combine_splits(partial, rows, n_rows, n_heads, hd, t.splits, overlap, s, out);
  return last_status();
}

}  // namespace strata::cuda_kernels
