// Device kernels of the CUDA backend and their launchers (declared in cuda_kernels.h).
// Simple, correct kernels: grid-stride loops for elementwise work, one block per row for
// row reductions, one block per (row, head) for attention. Arithmetic is f32 throughout
// with IEEE division and square root (no fast-math), matching the CPU reference closely.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/cuda_kv_elems.cuh"
#include "kernels/cuda/cuda_launch.cuh"

namespace strata::cuda_kernels {
namespace {

constexpr int kThreads = 256;      // elementwise and row kernels
constexpr int kAttnThreads = 128;  // attention: keys scored per tile, one per thread
constexpr int kAttnPerThread = kMaxAttentionHeadDim / kAttnThreads;
constexpr int64_t kMaxBlocks = 1 << 20;  // grid-stride loops cover the rest

cudaStream_t as_stream(StreamHandle s) {
  return static_cast<cudaStream_t>(s);
}

KernelStatus last_status() {
  return KernelStatus{static_cast<int>(cudaGetLastError())};
}

unsigned elementwise_blocks(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

// Threads for a per-row kernel over `width` elements: a multiple of 32, at most kThreads.
unsigned row_threads(int64_t width) {
  const int64_t t = (width + 31) / 32 * 32;
  return static_cast<unsigned>(t < kThreads ? (t > 0 ? t : 32) : kThreads);
}

struct SumOp {
  __device__ float operator()(float a, float b) const { return a + b; }
  __device__ static float identity() { return 0.0f; }
};
struct MaxOp {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
  __device__ static float identity() { return -INFINITY; }
};

template <typename Op>
__device__ float warp_reduce(float v) {
  Op op;
  for (int offset = 16; offset > 0; offset >>= 1)
    v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Reduces one value per thread over the whole block and returns the result to every
// thread. blockDim.x must be a multiple of 32. Safe to call repeatedly in a kernel.
template <typename Op>
__device__ float block_reduce(float v) {
  __shared__ float partial[33];
  v = warp_reduce<Op>(v);
  const unsigned lane = threadIdx.x & 31u;
  const unsigned warp = threadIdx.x >> 5;
  __syncthreads();  // every thread has read the previous call's result
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  const unsigned n_warps = (blockDim.x + 31u) >> 5;
  v = threadIdx.x < n_warps ? partial[threadIdx.x] : Op::identity();
  if (warp == 0) v = warp_reduce<Op>(v);
  if (threadIdx.x == 0) partial[32] = v;
  __syncthreads();
  return partial[32];
}

__device__ float load_as_f32(const void* base, ElemType type, int64_t i) {
  switch (type) {
    case ElemType::kF16:
      return __half2float(__ushort_as_half(static_cast<const unsigned short*>(base)[i]));
    case ElemType::kBF16:
      return __uint_as_float(static_cast<unsigned>(static_cast<const unsigned short*>(base)[i])
                             << 16);
    case ElemType::kF32:
    default:
      return static_cast<const float*>(base)[i];
  }
}

__global__ void add_bias_kernel(float* y, const float* bias, int64_t m, int64_t n) {
  const int64_t total = m * n;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    y[i] += bias[i % n];
}

__global__ void f32_to_f16_kernel(const float* src, unsigned short* dst, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = __half_as_ushort(__float2half_rn(src[i]));
}

__global__ void dequantize_q4_kernel(const unsigned char* packed, const float* mins,
                                     const float* scales, unsigned short* dst, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const unsigned char byte = packed[i / 2];
    const int code = (i & 1) ? (byte >> 4) : (byte & 0xF);
    const int64_t g = i / 64;
    dst[i] = __half_as_ushort(__float2half_rn(static_cast<float>(code) * scales[g] + mins[g]));
  }
}

__global__ void f32_to_bf16_kernel(const float* src, unsigned short* dst, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = __bfloat16_as_ushort(__float2bfloat16_rn(src[i]));
}

// One block per output row.
__global__ void embedding_kernel(const int32_t* ids, const void* table, ElemType type,
                                 int64_t vocab, int64_t h, float* y) {
  const int64_t r = blockIdx.x;
  const int32_t id = ids[r];
  float* yr = y + r * h;
  if (id < 0 || id >= vocab) {
    for (int64_t i = threadIdx.x; i < h; i += blockDim.x) yr[i] = 0.0f;
    return;
  }
  const int64_t base = static_cast<int64_t>(id) * h;
  for (int64_t i = threadIdx.x; i < h; i += blockDim.x) yr[i] = load_as_f32(table, type, base + i);
}

// One block per output row of a kQ4 table; an id outside the vocabulary gives zeros, as
// embedding_kernel does (the host checked the ids).
__global__ void embedding_q4_kernel(const int32_t* ids, const unsigned char* packed,
                                    const float* mins, const float* scales, int64_t vocab,
                                    int64_t h, float* y) {
  const int64_t r = blockIdx.x;
  const int32_t id = ids[r];
  float* yr = y + r * h;
  const bool known = id >= 0 && id < vocab;
  const int64_t base = known ? static_cast<int64_t>(id) * h : 0;
  for (int64_t i = threadIdx.x; i < h; i += blockDim.x) {
    if (!known) {
      yr[i] = 0.0f;
      continue;
    }
    const int64_t e = base + i;
    const unsigned char byte = packed[e / 2];
    const int code = (e & 1) ? (byte >> 4) : (byte & 0xF);
    yr[i] = fmaf(static_cast<float>(code), scales[e / 64], mins[e / 64]);
  }
}

__global__ void rms_norm_kernel(const float* x, int64_t h, const float* weight, float eps,
                                float* y) {
  let_dependents_launch();
  wait_for_inputs();  // launched with PDL: nothing an earlier kernel wrote is read before
  const float* xr = x + blockIdx.x * h;
  float* yr = y + blockIdx.x * h;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < h; i += blockDim.x) ss += xr[i] * xr[i];
  ss = block_reduce<SumOp>(ss);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(h) + eps);
  for (int64_t i = threadIdx.x; i < h; i += blockDim.x) yr[i] = weight[i] * (inv * xr[i]);
}

__global__ void layer_norm_kernel(const float* x, int64_t h, const float* weight, const float* bias,
                                  float eps, float* y) {
  let_dependents_launch();
  wait_for_inputs();  // launched with PDL: nothing an earlier kernel wrote is read before
  const float* xr = x + blockIdx.x * h;
  float* yr = y + blockIdx.x * h;
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < h; i += blockDim.x) sum += xr[i];
  const float mean = block_reduce<SumOp>(sum) / static_cast<float>(h);
  float var = 0.0f;
  for (int64_t i = threadIdx.x; i < h; i += blockDim.x) var += (xr[i] - mean) * (xr[i] - mean);
  var = block_reduce<SumOp>(var) / static_cast<float>(h);
  const float inv = 1.0f / sqrtf(var + eps);
  for (int64_t i = threadIdx.x; i < h; i += blockDim.x)
    yr[i] = (xr[i] - mean) * inv * weight[i] + bias[i];
}

// The same norms with the row held in registers, kVec float4s a thread: x is read once, with
// all of a thread's loads in flight together, then both reductions and the write work from
// registers. The loops above wait on each load in turn, three passes over x: 15.7 us for one
// 4096-wide row on an H200, where the row's bytes take well under a microsecond
// (docs/journal/gpu-history.md).
// In place (x == y) is fine: a thread writes only what it read, after the reductions.
constexpr int kNormThreads = 256;
constexpr int kMaxNormVec = 8;  // rows up to 4 * 8 * 256 = 8192 wide

__device__ float4 load4(const float* p, int64_t i, int64_t n4) {
  return i < n4 ? reinterpret_cast<const float4*>(p)[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

template <int kVec, bool kLayer>
__global__ void __launch_bounds__(kNormThreads)
    norm_rows_kernel(const float* x, int64_t h, const float* weight, const float* bias, float eps,
                     float* y) {
  let_dependents_launch();
  wait_for_inputs();  // launched with PDL: nothing an earlier kernel wrote is read before
  const int64_t n4 = h / 4;
  const float* xr = x + blockIdx.x * h;
  float4 v[kVec];
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    v[j] = load4(xr, threadIdx.x + j * kNormThreads, n4);
    sum += kLayer ? (v[j].x + v[j].y) + (v[j].z + v[j].w)
                  : (v[j].x * v[j].x + v[j].y * v[j].y) + (v[j].z * v[j].z + v[j].w * v[j].w);
  }
  const float fh = static_cast<float>(h);
  float mean = 0.0f;
  float inv = 0.0f;
  if (kLayer) {
    mean = block_reduce<SumOp>(sum) / fh;
    float var = 0.0f;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      if (threadIdx.x + j * kNormThreads >= n4) continue;
      const float a = v[j].x - mean, b = v[j].y - mean, c = v[j].z - mean, d = v[j].w - mean;
      var += (a * a + b * b) + (c * c + d * d);
    }
    inv = 1.0f / sqrtf(block_reduce<SumOp>(var) / fh + eps);
  } else {
    inv = 1.0f / sqrtf(block_reduce<SumOp>(sum) / fh + eps);
  }
  float4* yr = reinterpret_cast<float4*>(y + blockIdx.x * h);
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    const int64_t i = threadIdx.x + j * kNormThreads;
    if (i >= n4) continue;
    const float4 w = reinterpret_cast<const float4*>(weight)[i];
    float4 o;
    if (kLayer) {
      const float4 b = reinterpret_cast<const float4*>(bias)[i];
      o = make_float4((v[j].x - mean) * inv * w.x + b.x, (v[j].y - mean) * inv * w.y + b.y,
                      (v[j].z - mean) * inv * w.z + b.z, (v[j].w - mean) * inv * w.w + b.w);
    } else {
      o = make_float4(w.x * (inv * v[j].x), w.y * (inv * v[j].y), w.z * (inv * v[j].z),
                      w.w * (inv * v[j].w));
    }
    yr[i] = o;
  }
}

// Launches norm_rows_kernel where the row fits its registers and every pointer takes
// float4 accesses; false (nothing launched) otherwise.
template <bool kLayer>
bool launch_norm_rows(const float* x, int64_t m, int64_t h, const float* weight, const float* bias,
                      float eps, float* y, bool overlap, cudaStream_t s) {
  const int64_t per_thread = (h / 4 + kNormThreads - 1) / kNormThreads;
  if (h % 4 != 0 || per_thread > kMaxNormVec || !aligned16(x) || !aligned16(y) ||
      !aligned16(weight) || (kLayer && !aligned16(bias)))
    return false;
  const auto kernel = per_thread <= 1   ? norm_rows_kernel<1, kLayer>
                      : per_thread <= 2 ? norm_rows_kernel<2, kLayer>
                      : per_thread <= 4 ? norm_rows_kernel<4, kLayer>
                                        : norm_rows_kernel<8, kLayer>;
  launch(kernel, dim3(static_cast<unsigned>(m)), kNormThreads, 0, overlap, s, x, h, weight, bias,
         eps, y);
  return true;
}

// Grid (row, head); threads over the half_dim rotation pairs (j, j + half).
__global__ void rope_kernel(float* x, int32_t n_heads, int32_t head_dim, const int32_t* positions,
                            const float* cos_table, const float* sin_table, int32_t max_positions) {
  const int64_t r = blockIdx.x;
  const int32_t pos = positions[r];
  if (pos < 0 || pos >= max_positions) return;
  const int32_t half = head_dim / 2;
  float* v = x + r * static_cast<int64_t>(n_heads) * head_dim +
             static_cast<int64_t>(blockIdx.y) * head_dim;
  const float* c = cos_table + static_cast<int64_t>(pos) * half;
  const float* s = sin_table + static_cast<int64_t>(pos) * half;
  for (int32_t j = threadIdx.x; j < half; j += blockDim.x) {
    const float a = v[j];
    const float b = v[j + half];
    v[j] = a * c[j] - b * s[j];
    v[j + half] = b * c[j] + a * s[j];
  }
}

__global__ void silu_mul_kernel(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = gate[i];
    out[i] = g / (1.0f + expf(-g)) * up[i];
  }
}

// One block per row of an expert's gathered rows (a MoE layer's expert GEMM input/output).
__global__ void gather_rows_kernel(const float* x, int64_t width, const int32_t* rows, float* out) {
  const float* in = x + static_cast<int64_t>(rows[blockIdx.x]) * width;
  float* o = out + static_cast<int64_t>(blockIdx.x) * width;
  for (int64_t j = threadIdx.x; j < width; j += blockDim.x) o[j] = in[j];
}

__global__ void scatter_add_rows_kernel(const float* y, int64_t width, const int32_t* rows,
                                        const float* weights, float* out) {
  const float* in = y + static_cast<int64_t>(blockIdx.x) * width;
  float* o = out + static_cast<int64_t>(rows[blockIdx.x]) * width;
  const float g = weights[blockIdx.x];
  for (int64_t j = threadIdx.x; j < width; j += blockDim.x) o[j] += g * in[j];
}

__global__ void gelu_tanh_mul_kernel(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = gate[i];
    out[i] = 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g))) * up[i];
  }
}

__global__ void scale_softcap_kernel(float* x, int64_t n, float s, float cap) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = x[i] * s;
    x[i] = cap > 0.0f ? cap * tanhf(v / cap) : v;
  }
}

__global__ void relu_kernel(float* x, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

__global__ void add_kernel(float* y, const float* x, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    y[i] += x[i];
}

__global__ void softmax_kernel(float* x, int64_t n) {
  float* xr = x + blockIdx.x * n;
  float mx = -INFINITY;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) mx = fmaxf(mx, xr[i]);
  mx = block_reduce<MaxOp>(mx);
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float e = expf(xr[i] - mx);
    xr[i] = e;
    sum += e;
  }
  const float inv = 1.0f / block_reduce<SumOp>(sum);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) xr[i] *= inv;
}

// Grid (flat row, kv head); threads over head_dim. T: the cache's element (float or __half).
template <typename T>
__global__ void kv_store_kernel(const float* k, const float* v, const RowDesc* rows,
                                KvCacheDesc c) {
  let_dependents_launch();
  wait_for_inputs();  // launched with PDL: nothing an earlier kernel wrote is read before
  const RowDesc d = rows[blockIdx.x];
  const int32_t h = static_cast<int32_t>(blockIdx.y);
  const int64_t width = static_cast<int64_t>(c.n_kv_heads) * c.head_dim;
  const int64_t src = static_cast<int64_t>(d.row) * width + static_cast<int64_t>(h) * c.head_dim;
  const int64_t dst = static_cast<int64_t>(d.slot) * c.slot_stride +
                      static_cast<int64_t>(h) * c.head_stride +
                      static_cast<int64_t>(d.pos) * c.head_dim;
  T* kc = static_cast<T*>(c.k) + dst;
  T* vc = static_cast<T*>(c.v) + dst;
  for (int32_t i = threadIdx.x; i < c.head_dim; i += blockDim.x) {
    kc[i] = narrow<T>(k[src + i]);
    vc[i] = narrow<T>(v[src + i]);
  }
}

// The key and value rows of one (slot, kv head) of an f32 or f16 cache, [capacity, head_dim].
template <typename T>
struct HeadRows : ElemHead<T> {
  using ElemHead<T>::ElemHead;
  __device__ float key(int32_t p, int32_t i) const {
    return widen(this->k[static_cast<int64_t>(p) * this->hd + i]);
  }
  __device__ float value(int32_t p, int32_t i) const {
    return widen(this->v[static_cast<int64_t>(p) * this->hd + i]);
  }
};

// Grid (flat row, query head), kAttnThreads threads. The keys 0 .. pos are visited in tiles
// of kAttnThreads (one score per thread) with an online softmax: the running maximum m,
// the running denominator l and the output accumulators are rescaled by exp(m_old - m_new)
// whenever a tile raises the maximum, so any context length fits in fixed shared memory.
// Each thread owns output dimensions tid, tid + kAttnThreads, ... (< head_dim). HeadRows
// reads one (slot, kv head)'s keys and values from a Cache (HeadRows<T>, Q4HeadRows).
template <class Cache, class HeadRows>
__global__ void __launch_bounds__(kAttnThreads)
    attention_kernel(const float* q, const RowDesc* rows, Cache c, int32_t n_heads, int32_t group,
                     float scale, float* out) {
  extern __shared__ float smem[];
  const int32_t hd = c.head_dim;
  float* s_q = smem;       // [head_dim]
  float* s_p = smem + hd;  // [kAttnThreads] exp(score - m) of the current tile
  const RowDesc d = rows[blockIdx.x];
  const int32_t h = static_cast<int32_t>(blockIdx.y);
  const int64_t width = static_cast<int64_t>(n_heads) * hd;
  const float* qr = q + static_cast<int64_t>(d.row) * width + static_cast<int64_t>(h) * hd;
  for (int32_t i = threadIdx.x; i < hd; i += blockDim.x) s_q[i] = qr[i];
  __syncthreads();

  const HeadRows kv(c, d.slot, h / group);
  const int32_t n_ctx = d.pos + 1;

  float m = -INFINITY;
  float l = 0.0f;
  float acc[kAttnPerThread];
#pragma unroll
  for (int i = 0; i < kAttnPerThread; ++i) acc[i] = 0.0f;

  for (int32_t t0 = 0; t0 < n_ctx; t0 += kAttnThreads) {
    const int32_t p = t0 + static_cast<int32_t>(threadIdx.x);
    float s = -INFINITY;
    if (p < n_ctx) {
      float dot = 0.0f;
      for (int32_t i = 0; i < hd; ++i) dot += s_q[i] * kv.key(p, i);
      s = dot * scale;
    }
    const float m_new = fmaxf(m, block_reduce<MaxOp>(s));
    const float e = p < n_ctx ? expf(s - m_new) : 0.0f;
    s_p[threadIdx.x] = e;
    const float tile_sum = block_reduce<SumOp>(e);  // its barriers also publish s_p
    const float corr = expf(m - m_new);             // 0 on the first tile (m = -inf)
    l = l * corr + tile_sum;
    const int32_t count = n_ctx - t0 < kAttnThreads ? n_ctx - t0 : kAttnThreads;
#pragma unroll
    for (int i = 0; i < kAttnPerThread; ++i) {
      const int32_t dd = static_cast<int32_t>(threadIdx.x) + i * kAttnThreads;
      if (dd < hd) {
        float a = acc[i] * corr;
        for (int32_t j = 0; j < count; ++j) a += s_p[j] * kv.value(t0 + j, dd);
        acc[i] = a;
      }
    }
    m = m_new;
    __syncthreads();  // s_p is rewritten by the next tile
  }
  float* o = out + static_cast<int64_t>(d.row) * width + static_cast<int64_t>(h) * hd;
  const float inv = 1.0f / l;
#pragma unroll
  for (int i = 0; i < kAttnPerThread; ++i) {
    const int32_t dd = static_cast<int32_t>(threadIdx.x) + i * kAttnThreads;
    if (dd < hd) o[dd] = acc[i] * inv;
  }
}

}  // namespace

KernelStatus add_bias(float* y, const float* bias, int64_t m, int64_t n, StreamHandle stream) {
  if (m <= 0 || n <= 0) return {};
  add_bias_kernel<<<elementwise_blocks(m * n), kThreads, 0, as_stream(stream)>>>(y, bias, m, n);
  return last_status();
}

KernelStatus f32_to_half(const float* src, void* dst, ElemType dst_type, int64_t n,
                         StreamHandle stream) {
  if (n <= 0) return {};
  auto* d = static_cast<unsigned short*>(dst);
  if (dst_type == ElemType::kBF16) {
    f32_to_bf16_kernel<<<elementwise_blocks(n), kThreads, 0, as_stream(stream)>>>(src, d, n);
  } else {
    f32_to_f16_kernel<<<elementwise_blocks(n), kThreads, 0, as_stream(stream)>>>(src, d, n);
  }
  return last_status();
}

namespace {

// One group of `n` values: min/scale as kernels/quant.cpp computes them (non-finite: zeros).
__device__ void quantize_group_dev(const float* x, int n, unsigned char* codes, float* min_out,
                                   float* scale_out) {
  float mn = x[0], mx = x[0];
  bool finite = true;
  for (int i = 0; i < n; ++i) {
    finite = finite && isfinite(x[i]);
    mn = fminf(mn, x[i]);
    mx = fmaxf(mx, x[i]);
  }
  float scale = (mx - mn) / 15.0f;
  if (!finite || !isfinite(scale)) {
    mn = 0.0f;
    scale = 0.0f;
  }
  *min_out = mn;
  *scale_out = scale;
  for (int i = 0; i < n; i += 2) {
    int q0 = 0, q1 = 0;
    if (scale != 0.0f) {
      q0 = min(15, max(0, __float2int_rn((x[i] - mn) / scale)));
      q1 = min(15, max(0, __float2int_rn((x[i + 1] - mn) / scale)));
    }
    codes[i / 2] = static_cast<unsigned char>(q0 | (q1 << 4));
  }
}

__global__ void kv_store_q4_kernel(const float* k, const float* v, const RowDesc* rows,
                                   int64_t n_rows, KvQ4Desc c) {
  const int gpr = c.head_dim / c.group;
  const int64_t total = n_rows * c.n_kv_heads * gpr;
  const Q4Ptrs kb = q4_ptrs(c.k, c), vb = q4_ptrs(c.v, c);
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int j = static_cast<int>(t % gpr);
    const int h = static_cast<int>((t / gpr) % c.n_kv_heads);
    const RowDesc d = rows[t / gpr / c.n_kv_heads];
    const int64_t width = static_cast<int64_t>(c.n_kv_heads) * c.head_dim;
    const int64_t src =
        d.row * width + static_cast<int64_t>(h) * c.head_dim + static_cast<int64_t>(j) * c.group;
    const int64_t row = (static_cast<int64_t>(d.slot) * c.n_kv_heads + h) * c.capacity + d.pos;
    const int64_t g = row * gpr + j;
    quantize_group_dev(k + src, c.group, kb.codes + g * c.group / 2, kb.mins + g, kb.scales + g);
    quantize_group_dev(v + src, c.group, vb.codes + g * c.group / 2, vb.mins + g, vb.scales + g);
  }
}

__global__ void kv_dequantize_kernel(KvQ4Desc c, float* k_out, float* v_out) {
  const int64_t n = c.rows * c.head_dim;
  const Q4Ptrs kb = q4_ptrs(c.k, c), vb = q4_ptrs(c.v, c);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t g = i / c.group;
    const int kq = (i & 1) ? (kb.codes[i / 2] >> 4) : (kb.codes[i / 2] & 0xF);
    const int vq = (i & 1) ? (vb.codes[i / 2] >> 4) : (vb.codes[i / 2] & 0xF);
    k_out[i] = fmaf(static_cast<float>(kq), kb.scales[g], kb.mins[g]);
    v_out[i] = fmaf(static_cast<float>(vq), vb.scales[g], vb.mins[g]);
  }
}

// The key and value rows of one (slot, kv head) of a 4-bit cache, read as stored: each
// element is code * scale + min of its group, one rounding (fmaf) as the CPU decodes it.
struct Q4HeadRows : Q4Head {
  using Q4Head::Q4Head;
  __device__ float at(const Q4Ptrs& b, int32_t p, int32_t i) const {
    const int64_t e = (first + p) * hd + i;
    const unsigned char byte = b.codes[e / 2];
    const int code = (e & 1) ? (byte >> 4) : (byte & 0xF);
    return fmaf(static_cast<float>(code), b.scales[e / group], b.mins[e / group]);
  }
  __device__ float key(int32_t p, int32_t i) const { return at(kb, p, i); }
  __device__ float value(int32_t p, int32_t i) const { return at(vb, p, i); }
};

}  // namespace

KernelStatus kv_store_q4(const float* k, const float* v, const RowDesc* rows, int64_t n_rows,
                         const KvQ4Desc& cache, StreamHandle stream) {
  const int64_t total = n_rows * cache.n_kv_heads * (cache.head_dim / cache.group);
  if (total <= 0) return {};
  kv_store_q4_kernel<<<elementwise_blocks(total), kThreads, 0, as_stream(stream)>>>(k, v, rows,
                                                                                    n_rows, cache);
  return last_status();
}

KernelStatus kv_dequantize(const KvQ4Desc& cache, float* k_out, float* v_out, StreamHandle stream) {
  const int64_t n = cache.rows * cache.head_dim;
  if (n <= 0) return {};
  kv_dequantize_kernel<<<elementwise_blocks(n), kThreads, 0, as_stream(stream)>>>(cache, k_out,
                                                                                  v_out);
  return last_status();
}

KernelStatus dequantize_q4_to_f16(const unsigned char* packed, const float* mins,
                                  const float* scales, unsigned short* dst, int64_t n,
                                  StreamHandle stream) {
  if (n <= 0) return {};
  dequantize_q4_kernel<<<elementwise_blocks(n), kThreads, 0, as_stream(stream)>>>(packed, mins,
                                                                                  scales, dst, n);
  return last_status();
}

KernelStatus embedding(const int32_t* ids, int64_t n, const void* table, ElemType type,
                       int64_t vocab, int64_t h, float* y, StreamHandle stream) {
  if (n <= 0 || h <= 0) return {};
  embedding_kernel<<<static_cast<unsigned>(n), row_threads(h), 0, as_stream(stream)>>>(
      ids, table, type, vocab, h, y);
  return last_status();
}

KernelStatus embedding_q4(const int32_t* ids, int64_t n, const unsigned char* packed,
                          const float* mins, const float* scales, int64_t vocab, int64_t h,
                          float* y, StreamHandle stream) {
  if (n <= 0 || h <= 0) return {};
  embedding_q4_kernel<<<static_cast<unsigned>(n), row_threads(h), 0, as_stream(stream)>>>(
      ids, packed, mins, scales, vocab, h, y);
  return last_status();
}

KernelStatus rms_norm(const float* x, int64_t m, int64_t h, const float* weight, float eps,
                      float* y, StreamHandle stream, bool overlap) {
  if (m <= 0 || h <= 0) return {};
  const cudaStream_t s = as_stream(stream);
  if (!launch_norm_rows<false>(x, m, h, weight, nullptr, eps, y, overlap, s))
    launch(rms_norm_kernel, dim3(static_cast<unsigned>(m)), row_threads(h), 0, overlap, s, x, h,
           weight, eps, y);
  return last_status();
}

KernelStatus layer_norm(const float* x, int64_t m, int64_t h, const float* weight,
                        const float* bias, float eps, float* y, StreamHandle stream, bool overlap) {
  if (m <= 0 || h <= 0) return {};
  const cudaStream_t s = as_stream(stream);
  if (!launch_norm_rows<true>(x, m, h, weight, bias, eps, y, overlap, s))
    launch(layer_norm_kernel, dim3(static_cast<unsigned>(m)), row_threads(h), 0, overlap, s, x, h,
           weight, bias, eps, y);
  return last_status();
}

KernelStatus rope(float* x, int64_t m, int32_t n_heads, int32_t head_dim, const int32_t* positions,
                  const float* cos_table, const float* sin_table, int32_t max_positions,
                  StreamHandle stream) {
  if (m <= 0 || n_heads <= 0 || head_dim < 2) return {};
  const dim3 grid(static_cast<unsigned>(m), static_cast<unsigned>(n_heads));
  rope_kernel<<<grid, row_threads(head_dim / 2), 0, as_stream(stream)>>>(
      x, n_heads, head_dim, positions, cos_table, sin_table, max_positions);
  return last_status();
}

KernelStatus gather_rows(const float* x, int64_t width, const int32_t* rows, int64_t n, float* out,
                         StreamHandle stream) {
  if (n <= 0 || width <= 0) return {};
  gather_rows_kernel<<<static_cast<unsigned>(n), kThreads, 0, as_stream(stream)>>>(x, width, rows,
                                                                                   out);
  return last_status();
}

KernelStatus scatter_add_rows(const float* y, int64_t width, const int32_t* rows,
                              const float* weights, int64_t n, float* out, StreamHandle stream) {
  if (n <= 0 || width <= 0) return {};
  scatter_add_rows_kernel<<<static_cast<unsigned>(n), kThreads, 0, as_stream(stream)>>>(
      y, width, rows, weights, out);
  return last_status();
}

KernelStatus silu_mul(const float* gate, const float* up, float* out, int64_t n,
                      StreamHandle stream) {
  if (n <= 0) return {};
  silu_mul_kernel<<<elementwise_blocks(n), kThreads, 0, as_stream(stream)>>>(gate, up, out, n);
  return last_status();
}

KernelStatus gelu_tanh_mul(const float* gate, const float* up, float* out, int64_t n,
                           StreamHandle stream) {
  if (n <= 0) return {};
  gelu_tanh_mul_kernel<<<elementwise_blocks(n), kThreads, 0, as_stream(stream)>>>(gate, up, out, n);
  return last_status();
}

KernelStatus scale_softcap(float* x, int64_t n, float s, float cap, StreamHandle stream) {
  if (n <= 0) return {};
  scale_softcap_kernel<<<elementwise_blocks(n), kThreads, 0, as_stream(stream)>>>(x, n, s, cap);
  return last_status();
}

KernelStatus relu(float* x, int64_t n, StreamHandle stream) {
  if (n <= 0) return {};
  relu_kernel<<<elementwise_blocks(n), kThreads, 0, as_stream(stream)>>>(x, n);
  return last_status();
}

KernelStatus add(float* y, const float* x, int64_t n, StreamHandle stream) {
  if (n <= 0) return {};
  add_kernel<<<elementwise_blocks(n), kThreads, 0, as_stream(stream)>>>(y, x, n);
  return last_status();
}

KernelStatus softmax(float* x, int64_t m, int64_t n, StreamHandle stream) {
  if (m <= 0 || n <= 0) return {};
  softmax_kernel<<<static_cast<unsigned>(m), row_threads(n), 0, as_stream(stream)>>>(x, n);
  return last_status();
}

KernelStatus kv_store(const float* k, const float* v, const RowDesc* rows, int64_t n_rows,
                      const KvCacheDesc& cache, StreamHandle stream, bool overlap) {
  if (n_rows <= 0 || cache.n_kv_heads <= 0 || cache.head_dim <= 0) return {};
  if (cache.elem != ElemType::kF32 && cache.elem != ElemType::kF16)
    return KernelStatus{static_cast<int>(cudaErrorInvalidValue)};
  const dim3 grid(static_cast<unsigned>(n_rows), static_cast<unsigned>(cache.n_kv_heads));
  launch(cache.elem == ElemType::kF16 ? kv_store_kernel<__half> : kv_store_kernel<float>, grid,
         row_threads(cache.head_dim), 0, overlap, as_stream(stream), k, v, rows, cache);
  return last_status();
}

KernelStatus attention(const float* q, const RowDesc* rows, int64_t n_rows,
                       const KvCacheDesc& cache, int32_t n_heads, float scale, float* out,
                       StreamHandle stream) {
  if (n_rows <= 0 || n_heads <= 0) return {};
  if (cache.head_dim <= 0 || cache.head_dim > kMaxAttentionHeadDim || cache.n_kv_heads <= 0 ||
      n_heads % cache.n_kv_heads != 0 ||
      (cache.elem != ElemType::kF32 && cache.elem != ElemType::kF16))
    return KernelStatus{static_cast<int>(cudaErrorInvalidValue)};
  const dim3 grid(static_cast<unsigned>(n_rows), static_cast<unsigned>(n_heads));
  const size_t shared = static_cast<size_t>(cache.head_dim + kAttnThreads) * sizeof(float);
  const auto kernel = cache.elem == ElemType::kF16 ? attention_kernel<KvCacheDesc, HeadRows<__half>>
                                                   : attention_kernel<KvCacheDesc, HeadRows<float>>;
  kernel<<<grid, kAttnThreads, shared, as_stream(stream)>>>(q, rows, cache, n_heads,
                                                            n_heads / cache.n_kv_heads, scale, out);
  return last_status();
}

KernelStatus attention_q4(const float* q, const RowDesc* rows, int64_t n_rows,
                          const KvQ4Desc& cache, int32_t n_heads, float scale, float* out,
                          StreamHandle stream) {
  if (n_rows <= 0 || n_heads <= 0) return {};
  if (cache.head_dim <= 0 || cache.head_dim > kMaxAttentionHeadDim || cache.n_kv_heads <= 0 ||
      n_heads % cache.n_kv_heads != 0 || cache.group <= 0 || cache.head_dim % cache.group != 0)
    return KernelStatus{static_cast<int>(cudaErrorInvalidValue)};
  const dim3 grid(static_cast<unsigned>(n_rows), static_cast<unsigned>(n_heads));
  const size_t shared = static_cast<size_t>(cache.head_dim + kAttnThreads) * sizeof(float);
  attention_kernel<KvQ4Desc, Q4HeadRows><<<grid, kAttnThreads, shared, as_stream(stream)>>>(
      q, rows, cache, n_heads, n_heads / cache.n_kv_heads, scale, out);
  return last_status();
}

bool kernels_wait_for_inputs() {
  cudaFuncAttributes a{};
  if (cudaFuncGetAttributes(&a, rms_norm_kernel) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return a.ptxVersion >= 90;  // every kernel file is built for the same architectures
}

}  // namespace strata::cuda_kernels
