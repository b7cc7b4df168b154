#include "kernels/cpu_backend.h"

#include <cblas.h>
#include <omp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>

#include "kernels/cpu_isa.h"
#include "kernels/decode_attention_simd.h"
#include "kernels/error.h"
#include "kernels/fast_exp.h"
#include "kernels/gemm_panel.h"
#include "kernels/gemv.h"
#include "kernels/quant.h"

namespace strata {
namespace {

// Below this many elements an OpenMP fork costs more than the loop.
constexpr int64_t kParallelElems = 1 << 15;

// What a row of scores keeps: the last `window` positions (0: all), soft-capped by `softcap`
// (0: none). AttentionDims says where each comes from.
struct ScoreMask {
  int32_t window = 0;
  float softcap = 0.0f;
};

// Softmax over the positions a query at valid - 1 sees, row[first, valid), in place; the
// rest of row[0, n) (outside the window, or in the future) becomes 0.
void causal_softmax_row(float* row, int32_t valid, int32_t n, const ScoreMask& mask) {
  const int32_t first = mask.window > 0 ? std::max(0, valid - mask.window) : 0;
  if (mask.softcap > 0.0f) {
    const float inv_cap = 1.0f / mask.softcap;
    for (int32_t p = first; p < valid; ++p) row[p] = mask.softcap * std::tanh(row[p] * inv_cap);
  }
  float mx = row[first];
  for (int32_t p = first + 1; p < valid; ++p) mx = std::max(mx, row[p]);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int32_t p = first; p < valid; ++p) {
    row[p] = fast_exp(row[p] - mx);
    sum += row[p];
  }
  const float inv = 1.0f / sum;
#pragma omp simd
  for (int32_t p = first; p < valid; ++p) row[p] *= inv;
  std::fill(row, row + first, 0.0f);
  std::fill(row + valid, row + n, 0.0f);
}

// K or V rows as f32 whatever the cache stores: an f32 cache's rows in place; an f16
// cache's `n` elements from `at` converted into `buf` (F16C where the build has it).
const float* rows_f32(const float* rows, int64_t at, int64_t, float*) {
  return rows + at;
}
const float* rows_f32(const uint16_t* rows, int64_t at, int64_t n, float* buf) {
  convert_to_f32(DType::kF16, rows + at, buf, static_cast<size_t>(n));
  return buf;
}

// Positions a decode row converts at a time from an f16 cache: an L1-sized f32 chunk.
constexpr int64_t kDecodeChunkElems = 2048;
int32_t decode_chunk(int32_t hd) {
  return static_cast<int32_t>(std::max<int64_t>(1, kDecodeChunkElems / hd));
}

// P V for a decode row's query heads of one kv group: out_h = sum_p p_h[p] v[p] for the
// `group` rows of probabilities (p: [group, ctx]) over the kv head's rows (v: [ctx, hd]).
// Each V row is read once for the group; an f16 cache's rows are converted a chunk at a time
// into `buf` (hd x decode_chunk(hd) floats).
template <class T>
void decode_weighted_values(const float* p, const T* v, int32_t group, int32_t ctx, int32_t hd,
                            float* buf, float* out, int64_t out_stride) {
  for (int32_t g = 0; g < group; ++g) {
    float* o = out + g * out_stride;
#pragma omp simd
    for (int32_t d = 0; d < hd; ++d) o[d] = 0.0f;
  }
  const int32_t chunk = decode_chunk(hd);
  for (int32_t p0 = 0; p0 < ctx; p0 += chunk) {
    const int32_t n = std::min(chunk, ctx - p0);
    const float* vc = rows_f32(v, int64_t{p0} * hd, int64_t{n} * hd, buf);
    for (int32_t g = 0; g < group; ++g) {
      const float* pg = p + static_cast<size_t>(g) * static_cast<size_t>(ctx) + p0;
      float* o = out + g * out_stride;
      for (int32_t i = 0; i < n; ++i) {
        const float w = pg[i];
        const float* vp = vc + static_cast<size_t>(i) * hd;
#pragma omp simd
        for (int32_t d = 0; d < hd; ++d) o[d] += w * vp[d];
      }
    }
  }
}

void check_linear_args(int64_t m, const Tensor& w) {
  STRATA_CHECK(w.shape.rank == 2, "linear weight must be 2-D, got {}", w.describe());
  STRATA_CHECK(m >= 0, "linear rows {}", m);
}

// MAX_THREADS=N from the OpenBLAS build configuration; 0 when it does not say.
int openblas_max_threads() {
  const char* config = openblas_get_config();
  const char* p = config != nullptr ? std::strstr(config, "MAX_THREADS=") : nullptr;
  return p != nullptr ? std::atoi(p + std::strlen("MAX_THREADS=")) : 0;
}

}  // namespace

int max_cpu_threads() {
  const int oversubscribed = 4 * std::max(1, omp_get_num_procs());
  const int blas = openblas_max_threads();
  return blas > 0 ? std::min(oversubscribed, blas) : oversubscribed;
}

int resolve_cpu_threads(int requested) {
  const int max = max_cpu_threads();
  if (requested == 0) return std::min(omp_get_num_procs(), max);
  if (requested < 0 || requested > max)
    fail_input(
        "{} CPU threads requested: the limit is {} (4 x {} hardware threads; OpenBLAS here is "
        "built for {})",
        requested, max, omp_get_num_procs(), openblas_max_threads());
  return requested;
}

CpuBackend::CpuBackend(int threads) {
  threads_ = resolve_cpu_threads(std::max(threads, 0));
  // Decided (and a bad STRATA_CPU_ISA refused) here, not inside a kernel's parallel region.
  isa_ = active_cpu_isa();
  bind_thread();
}

CpuBackend::CpuBackend(int threads, CpuIsa isa) : CpuBackend(threads) {
  if (isa > detected_cpu_isa())
    fail_input("cpu backend with {}: this CPU has {}", cpu_isa_name(isa),
               cpu_isa_name(detected_cpu_isa()));
  isa_ = isa;
}

// OpenMP's thread count is a per-thread setting: each thread that computes sets it.
void CpuBackend::bind_thread() {
  omp_set_num_threads(threads_);
  openblas_set_num_threads(threads_);
}

std::string CpuBackend::name() const {
  return fmt::format("cpu ({} threads, {})", threads_, cpu_isa_name(isa_));
}

void CpuBackend::reserve(const KernelBounds& b) {
  if (b.half_weights)
    dequant_scratch_.reserve(static_cast<size_t>((kPanelRows + 1) * b.max_in_features) *
                             static_cast<size_t>(std::max(threads_, omp_get_max_threads())));
  if (b.max_q4_elems > 0) {
    q4_scratch_.reserve(kGemvMaxRows, b.max_in_features, kQuantGroupSize);
    q4_panel_scratch_.reserve(kGemvMaxRows, b.max_in_features);
  }
  // attention(): one score block per task, at most (rows of one sequence) x (its positions).
  const int64_t per_task = std::min(b.max_rows, b.max_positions) * b.max_positions;
  const auto threads = static_cast<int64_t>(std::max(threads_, omp_get_max_threads()));
  attn_scratch_.reserve(static_cast<size_t>(per_task * threads));
}

size_t CpuBackend::reserved_bytes() const {
  return (dequant_scratch_.capacity() + attn_scratch_.capacity()) * sizeof(float) +
         q4_scratch_.bytes() + q4_panel_scratch_.bytes();
}

void* CpuBackend::allocate(size_t bytes) {
  const size_t rounded = (std::max<size_t>(bytes, 1) + 63) / 64 * 64;
  if (rounded >= kLazyBytes) {  // zero pages until written
    void* m = mmap(nullptr, rounded, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED)
      fail(ErrorKind::kOverloaded, "cpu backend: cannot map {} bytes: {}", bytes,
           std::strerror(errno));
    std::lock_guard lock(mapped_mutex_);
    mapped_[m] = rounded;
    return m;
  }
  void* p = std::aligned_alloc(64, rounded);
  if (p == nullptr)
    fail(ErrorKind::kOverloaded, "cpu backend: out of memory allocating {} bytes", bytes);
  std::memset(p, 0, rounded);
  return p;
}

void CpuBackend::deallocate(void* p) {
  {
    std::lock_guard lock(mapped_mutex_);
    if (auto it = mapped_.find(p); it != mapped_.end()) {
      munmap(p, it->second);
      mapped_.erase(it);
      return;
    }
  }
  std::free(p);
}

void CpuBackend::discard(void* p, size_t offset, size_t bytes) {
  static const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t from = reinterpret_cast<uintptr_t>(p) + offset;
  const uintptr_t begin = (from + page - 1) / page * page;
  const uintptr_t end = (from + bytes) / page * page;
  // Private anonymous pages (mapped or from the heap): they read back as zeros.
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

void CpuBackend::copy(void* dst, const void* src, size_t bytes, CopyKind) {
  std::memcpy(dst, src, bytes);
}

void CpuBackend::linear(const float* x, int64_t m, const Tensor& w, const float* bias, float* y) {
  check_linear_args(m, w);
  if (m == 0) return;
  if (w.dtype == DType::kF32Panel) {
    linear_panel(x, m, w, bias, y);
  } else if (w.dtype == DType::kQ4Panel) {
    q4_panel_linear(x, m, w, bias, y, q4_panel_scratch_, isa_);  // any m, codes as bytes
  } else if (w.dtype == DType::kQ4 && m <= kGemvMaxRows) {
    linear_4bit(x, m, q4_view(w), bias, y, q4_scratch_, isa_);  // codes read once, as bytes
  } else if (m <= kGemvMaxRows) {
    // Decode: stream each weight row once for all m rows, at memory bandwidth.
    const int64_t n = w.shape[0];
#pragma omp parallel if (n * w.shape[1] > kParallelElems)
    {
      const int64_t nt = omp_get_num_threads();
      const int64_t t = omp_get_thread_num();
      const int64_t chunk = (n + nt * kGemvRowAlign - 1) / (nt * kGemvRowAlign) * kGemvRowAlign;
      const int64_t begin = std::min(n, t * chunk);
      gemv_rows_with(isa_, x, m, w, bias, y, begin, std::min(n, begin + chunk));
    }
  } else if (w.dtype == DType::kF32) {
    linear_f32(x, m, w, bias, y);
  } else {
    linear_half(x, m, w, bias, y);
  }
}

// Weights packed at load (gemm_panel.h): one kernel for every m, threads split the panels.
void CpuBackend::linear_panel(const float* x, int64_t m, const Tensor& w, const float* bias,
                              float* y) {
  const int64_t n = w.shape[0];
  const int64_t panels = panel_count(n);
  const bool tail = panel_tail_begin(n) < n;
  const CpuIsa isa = isa_;
#pragma omp parallel if (m * n * w.shape[1] > kParallelElems)
  {
    const int64_t nt = omp_get_num_threads();
    const int64_t t = omp_get_thread_num();
    panel_linear_with(isa, x, m, w, bias, y, n, panels * t / nt, panels * (t + 1) / nt,
                      tail && t == nt - 1);
  }
}

void CpuBackend::linear_f32(const float* x, int64_t m, const Tensor& w, const float* bias,
                            float* y) {
  const auto n = static_cast<blasint>(w.shape[0]);
  const auto k = static_cast<blasint>(w.shape[1]);
  const float beta = bias != nullptr ? 1.0f : 0.0f;
  if (bias != nullptr) {
    for (int64_t r = 0; r < m; ++r) std::memcpy(y + r * n, bias, static_cast<size_t>(n) * 4);
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(m), n, k, 1.0f, x, k,
              w.as<const float>(), k, beta, y, n);
}

// f16 / bf16 / q4 weights at more rows than a GEMV takes (prefill, large decode batches):
// each thread converts 32 weight rows at a time into an f32 panel of its own (gemm_panel.h's
// layout) and multiplies it with every activation row, so each weight is converted once a
// call and the panel kernel's speed is what the rows get (OpenBLAS's sgemm on dequantised
// blocks reached 60-80% of it).
void CpuBackend::linear_half(const float* x, int64_t m, const Tensor& w, const float* bias,
                             float* y) {
  const int64_t n = w.shape[0];
  const int64_t k = w.shape[1];
  const int64_t tail_begin = panel_tail_begin(n);
  const int64_t units = panel_count(n) + (tail_begin < n ? 1 : 0);
  const QuantView q4 = w.dtype == DType::kQ4 ? q4_view(w) : QuantView{};
  const size_t per_thread = static_cast<size_t>((kPanelRows + 1) * k);
  const auto nthreads = static_cast<size_t>(omp_get_max_threads());
  if (dequant_scratch_.size() < per_thread * nthreads)
    dequant_scratch_.resize(per_thread * nthreads);
  const size_t elem = dtype_size(w.dtype);
  const CpuIsa isa = isa_;
#pragma omp parallel for schedule(static) if (m * n * k > kParallelElems)
  for (int64_t u = 0; u < units; ++u) {
    float* panel = dequant_scratch_.data() + per_thread * static_cast<size_t>(omp_get_thread_num());
    float* row = panel + kPanelRows * k;
    const int64_t r0 = u * kPanelRows;
    const int64_t rows = std::min(kPanelRows, n - r0);
    for (int64_t j = 0; j < rows; ++j) {
      // A whole panel is stored k-major; the tail's rows (fewer than 32) row-major.
      float* out = rows == kPanelRows ? row : panel + j * k;
      if (w.dtype == DType::kQ4) {
        dequantize_one_row(q4, r0 + j, out);
      } else {
        convert_to_f32(w.dtype,
                       static_cast<const char*>(w.data) + static_cast<size_t>((r0 + j) * k) * elem,
                       out, static_cast<size_t>(k));
      }
      if (rows == kPanelRows)
        for (int64_t c = 0; c < k; ++c) panel[c * kPanelRows + j] = out[c];
    }
    Tensor block;
    block.data = panel;
    block.dtype = DType::kF32Panel;
    block.shape = Shape{rows, k};
    panel_linear_with(isa, x, m, block, bias != nullptr ? bias + r0 : nullptr, y + r0, n, 0,
                      panel_count(rows), r0 >= tail_begin);
  }
}

void CpuBackend::embedding(const int32_t* ids, int64_t n, const Tensor& table, float* y) {
  STRATA_CHECK(table.shape.rank == 2, "embedding table {}", table.describe());
  const int64_t vocab = table.shape[0];
  const int64_t h = table.shape[1];
  const QuantView q4 = table.dtype == DType::kQ4 ? q4_view(table) : QuantView{};
  for (int64_t i = 0; i < n; ++i) {
    STRATA_CHECK(ids[i] >= 0 && ids[i] < vocab, "token id {} outside vocabulary of {}", ids[i],
                 vocab);
    float* out = y + i * h;
    if (table.dtype == DType::kQ4) {  // compress_weight: rows decoded as read
      dequantize_one_row(q4, ids[i], out);
    } else if (table.dtype == DType::kF32Panel) {  // a tied head packed for the GEMM
      panel_row(table.as<const float>(), vocab, h, ids[i], out);
    } else if (table.dtype == DType::kQ4Panel) {  // a tied 4-bit head packed for the CPU
      q4_panel_row(table.as<const uint8_t>(), vocab, h, ids[i], out);
    } else {
      const auto* row = static_cast<const char*>(table.data) +
                        static_cast<size_t>(ids[i] * h) * dtype_size(table.dtype);
      convert_to_f32(table.dtype, row, out, static_cast<size_t>(h));
    }
  }
}

void CpuBackend::rms_norm(const float* x, int64_t m, int64_t h, const float* weight, float eps,
                          float* y) {
#pragma omp parallel for schedule(static) if (m * h > kParallelElems)
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * h;
    float* yr = y + r * h;
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < h; ++i) ss += xr[i] * xr[i];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) yr[i] = weight[i] * (inv * xr[i]);
  }
}

void CpuBackend::layer_norm(const float* x, int64_t m, int64_t h, const float* weight,
                            const float* bias, float eps, float* y) {
#pragma omp parallel for schedule(static) if (m * h > kParallelElems)
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * h;
    float* yr = y + r * h;
    float mean = 0.0f;
#pragma omp simd reduction(+ : mean)
    for (int64_t i = 0; i < h; ++i) mean += xr[i];
    mean /= static_cast<float>(h);
    float var = 0.0f;
#pragma omp simd reduction(+ : var)
    for (int64_t i = 0; i < h; ++i) var += (xr[i] - mean) * (xr[i] - mean);
    var /= static_cast<float>(h);
    const float inv = 1.0f / std::sqrt(var + eps);
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) yr[i] = (xr[i] - mean) * inv * weight[i] + bias[i];
  }
}

void CpuBackend::rope(float* x, int64_t m, int32_t n_heads, int32_t head_dim,
                      const int32_t* positions, const RopeTables& tables) {
  const int32_t half = head_dim / 2;
  STRATA_CHECK(half == tables.half_dim, "rope: head_dim {} vs table half {}", head_dim,
               tables.half_dim);
  const int64_t width = static_cast<int64_t>(n_heads) * head_dim;
  for (int64_t r = 0; r < m; ++r) {
    const int32_t pos = positions[r];
    STRATA_CHECK(pos >= 0 && pos < tables.max_positions, "rope: position {} outside [0, {})", pos,
                 tables.max_positions);
    const float* c = tables.cos + static_cast<int64_t>(pos) * half;
    const float* s = tables.sin + static_cast<int64_t>(pos) * half;
    for (int32_t hd = 0; hd < n_heads; ++hd) {
      float* v = x + r * width + static_cast<int64_t>(hd) * head_dim;
      for (int32_t j = 0; j < half; ++j) {
        const float a = v[j];
        const float b = v[j + half];
        v[j] = a * c[j] - b * s[j];
        v[j + half] = b * c[j] + a * s[j];
      }
    }
  }
}

void CpuBackend::silu_mul(const float* gate, const float* up, float* out, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > kParallelElems)
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + fast_exp(-g)) * up[i];
  }
}

// 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), PyTorch's gelu(approximate="tanh").
void CpuBackend::gelu_tanh_mul(const float* gate, const float* up, float* out, int64_t n) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
#pragma omp parallel for simd schedule(static) if (n > kParallelElems)
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = 0.5f * g * (1.0f + std::tanh(kSqrt2OverPi * (g + 0.044715f * g * g * g))) * up[i];
  }
}

void CpuBackend::gather_rows(const float* x, int64_t width, const int32_t* rows, int64_t n,
                             float* out) {
  const auto w = static_cast<size_t>(width);
#pragma omp parallel for schedule(static) if (n * width > kParallelElems)
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(out + static_cast<size_t>(i) * w, x + static_cast<size_t>(rows[i]) * w,
                w * sizeof(float));
}

void CpuBackend::scatter_add_rows(const float* y, int64_t width, const int32_t* rows,
                                  const float* weights, int64_t n, float* out) {
#pragma omp parallel for schedule(static) if (n * width > kParallelElems)
  for (int64_t i = 0; i < n; ++i) {
    float* o = out + static_cast<int64_t>(rows[i]) * width;
    const float* in = y + i * width;
    const float g = weights[i];
#pragma omp simd
    for (int64_t j = 0; j < width; ++j) o[j] += g * in[j];
  }
}

void CpuBackend::scale(float* x, int64_t n, float s) {
#pragma omp parallel for simd schedule(static) if (n > kParallelElems)
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

void CpuBackend::softcap(float* x, int64_t n, float cap) {
  const float inv = 1.0f / cap;
#pragma omp parallel for simd schedule(static) if (n > kParallelElems)
  for (int64_t i = 0; i < n; ++i) x[i] = cap * std::tanh(x[i] * inv);
}

void CpuBackend::relu(float* x, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > kParallelElems)
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

void CpuBackend::add(float* y, const float* x, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > kParallelElems)
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

void CpuBackend::softmax(float* x, int64_t m, int64_t n) {
#pragma omp parallel for schedule(static) if (m * n > kParallelElems)
  for (int64_t r = 0; r < m; ++r)
    causal_softmax_row(x + r * n, static_cast<int32_t>(n), static_cast<int32_t>(n), ScoreMask{});
}

namespace {

void store_row(const float* src, float* dst, int32_t n) {
  std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
}
void store_row(const float* src, uint16_t* dst, int32_t n) {
  convert_from_f32(DType::kF16, src, dst, static_cast<size_t>(n));
}

template <class T>
void kv_store_rows(const float* k, const float* v, std::span<const SeqSlice> seqs,
                   const KvLayerView& cache) {
  const int32_t hd = cache.head_dim;
  const int64_t width = static_cast<int64_t>(cache.n_kv_heads) * hd;
  for (const SeqSlice& s : seqs) {
    STRATA_CHECK(s.slot >= 0 && s.slot < cache.n_slots, "kv slot {} of {}", s.slot, cache.n_slots);
    STRATA_CHECK(s.n_past + s.n_new <= cache.capacity, "kv cache overflow: {} + {} > capacity {}",
                 s.n_past, s.n_new, cache.capacity);
    T* kslot = static_cast<T*>(cache.k) + static_cast<size_t>(s.slot) * cache.slot_stride();
    T* vslot = static_cast<T*>(cache.v) + static_cast<size_t>(s.slot) * cache.slot_stride();
    for (int32_t t = 0; t < s.n_new; ++t) {
      const int64_t row = s.row_begin + t;
      const size_t pos_off = static_cast<size_t>(s.n_past + t) * hd;
      for (int32_t h = 0; h < cache.n_kv_heads; ++h) {
        const size_t dst = static_cast<size_t>(h) * cache.head_stride() + pos_off;
        store_row(k + row * width + h * hd, kslot + dst, hd);
        store_row(v + row * width + h * hd, vslot + dst, hd);
      }
    }
  }
}

void check_kv_dtype(const KvLayerView& cache, const char* op) {
  if (cache.dtype != DType::kF32 && cache.dtype != DType::kF16)
    fail_input("{}: a KV cache of {} elements; the cache holds f32 or f16", op,
               dtype_name(cache.dtype));
}

}  // namespace

void CpuBackend::kv_store(const float* k, const float* v, const StepRows& rows,
                          const KvLayerView& cache) {
  check_kv_dtype(cache, "kv_store");
  if (cache.dtype == DType::kF16) {
    kv_store_rows<uint16_t>(k, v, rows.seqs, cache);
  } else {
    kv_store_rows<float>(k, v, rows.seqs, cache);
  }
}

namespace {

// Pointers into one 4-bit cache blob (KvQ4LayerView's layout).
struct Q4Blob {
  uint8_t* codes;
  float* mins;
  float* scales;
};
Q4Blob q4_blob(void* blob, const KvQ4LayerView& c) {
  auto* codes = static_cast<uint8_t*>(blob);
  auto* mins = reinterpret_cast<float*>(codes + c.codes_bytes());
  return {codes, mins, mins + c.groups()};
}

void store_q4_row(const float* x, const KvQ4LayerView& c, Q4Blob b, size_t row) {
  const int32_t gpr = c.head_dim / c.group;
  for (int32_t j = 0; j < gpr; ++j) {
    const size_t g = row * static_cast<size_t>(gpr) + static_cast<size_t>(j);
    quantize_group(x + j * c.group, c.group, b.codes + g * static_cast<size_t>(c.group) / 2,
                   b.mins + g, b.scales + g);
  }
}

}  // namespace

void CpuBackend::kv_store_q4(const float* k, const float* v, const StepRows& rows,
                             const KvQ4LayerView& cache) {
  const std::span<const SeqSlice> seqs = rows.seqs;
  const int32_t hd = cache.head_dim;
  const int64_t width = static_cast<int64_t>(cache.n_kv_heads) * hd;
  const Q4Blob kb = q4_blob(cache.k, cache), vb = q4_blob(cache.v, cache);
  for (const SeqSlice& s : seqs) {
    STRATA_CHECK(s.slot >= 0 && s.slot < cache.n_slots, "kv slot {} of {}", s.slot, cache.n_slots);
    STRATA_CHECK(s.n_past + s.n_new <= cache.capacity, "kv cache overflow: {} + {} > capacity {}",
                 s.n_past, s.n_new, cache.capacity);
    for (int32_t t = 0; t < s.n_new; ++t) {
      const int64_t row = s.row_begin + t;
      for (int32_t h = 0; h < cache.n_kv_heads; ++h) {
        const size_t dst =
            (static_cast<size_t>(s.slot) * cache.n_kv_heads + h) * cache.capacity + s.n_past + t;
        store_q4_row(k + row * width + h * hd, cache, kb, dst);
        store_q4_row(v + row * width + h * hd, cache, vb, dst);
      }
    }
  }
}

void CpuBackend::kv_dequantize(const KvQ4LayerView& cache, const KvLayerView& out) {
  const auto rows = static_cast<int64_t>(cache.rows());
  const int32_t gpr = cache.head_dim / cache.group;
  const Q4Blob kb = q4_blob(cache.k, cache), vb = q4_blob(cache.v, cache);
  float* ok = out.k_f32();
  float* ov = out.v_f32();
#pragma omp parallel for schedule(static) if (rows * cache.head_dim > kParallelElems)
  for (int64_t r = 0; r < rows; ++r) {
    for (int32_t j = 0; j < gpr; ++j) {
      const size_t g = static_cast<size_t>(r) * gpr + static_cast<size_t>(j);
      const size_t at =
          static_cast<size_t>(r) * cache.head_dim + static_cast<size_t>(j) * cache.group;
      dequantize_group(kb.codes + at / 2, cache.group, kb.mins[g], kb.scales[g], ok + at);
      dequantize_group(vb.codes + at / 2, cache.group, vb.mins[g], vb.scales[g], ov + at);
    }
  }
}

namespace {

// The f32 scratch one attention task (a sequence's kv head) needs: its score block and, for
// an f16 cache, the rows it converts (a chunk at a time for a decode row, the head's K and V
// for a chunk).
size_t attention_scratch(const SeqSlice& s, int32_t hd, int32_t group, DType dtype) {
  const auto ctx = static_cast<size_t>(s.n_past + s.n_new);
  const bool decode = s.n_new == 1;
  size_t floats = (decode ? static_cast<size_t>(group) : static_cast<size_t>(s.n_new)) * ctx;
  if (decode) {
    floats += static_cast<size_t>(hd) * static_cast<size_t>(decode_chunk(hd));
  } else if (dtype == DType::kF16) {
    floats += 2 * ctx * static_cast<size_t>(hd);
  }
  return floats;
}

// One task: a sequence's kv head and the `group` query heads that read it. q and out are
// the first of those heads' columns of the step's rows (row stride `width`), k and v the kv
// head's [ctx, hd] rows in the cache.
struct HeadTask {
  const float* q;
  float* out;
  const void* k;
  const void* v;
  DType dtype;
  const SeqSlice* seq;
  int32_t group;
  int32_t hd;
  int64_t width;
  float scale;
  ScoreMask mask;
};

// scores[p] = scale * q . k[p] over the kv head's rows, an f16 cache's converted a chunk at
// a time into `buf` (the kernel any CPU runs).
template <class T>
void decode_scores(const float* q, const T* k, int32_t ctx, int32_t hd, float scale, float* scores,
                   float* buf) {
  const int32_t chunk = decode_chunk(hd);
  for (int32_t p0 = 0; p0 < ctx; p0 += chunk) {
    const int32_t n = std::min(chunk, ctx - p0);
    const float* kc = rows_f32(k, int64_t{p0} * hd, int64_t{n} * hd, buf);
    for (int32_t p = 0; p < n; ++p) {
      const float* kp = kc + static_cast<size_t>(p) * hd;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int32_t d = 0; d < hd; ++d) dot += q[d] * kp[d];
      scores[p0 + p] = dot * scale;
    }
  }
}

// A decode row of the group's query heads: scores, softmax and P V, each pass over the kv
// head's rows in position order (the second head on reads them from cache); an f16 cache's
// rows are converted a chunk at a time into the scratch after the scores.
template <class T>
void attend_decode(const HeadTask& t, float* scratch) {
  const int32_t ctx = t.seq->n_past + 1;
  float* buf = scratch + static_cast<size_t>(t.group) * static_cast<size_t>(ctx);
  for (int32_t g = 0; g < t.group; ++g) {
    float* row = scratch + static_cast<size_t>(g) * static_cast<size_t>(ctx);
    decode_scores(t.q + g * t.hd, static_cast<const T*>(t.k), ctx, t.hd, t.scale, row, buf);
    causal_softmax_row(row, ctx, ctx, t.mask);
  }
  decode_weighted_values(scratch, static_cast<const T*>(t.v), t.group, ctx, t.hd, buf, t.out, t.hd);
}

#if STRATA_X86_KERNELS
// decode_attention_simd.h's passes for one instruction set, which convert f16 in registers.
struct SimdDecodePasses {
  void (*scores)(const float*, const void*, DType, int32_t, int32_t, float, float*);
  void (*values)(const float*, const void*, DType, int32_t, int32_t, float*);
};

// The widest passes `isa` allows that take this head size and cache element; none: the
// portable loops.
std::optional<SimdDecodePasses> simd_decode_passes(CpuIsa isa, int32_t hd, DType dtype) {
  using namespace attention_detail;
  if (isa == CpuIsa::kAvx512 && avx512_decode_fits(hd, dtype))
    return SimdDecodePasses{decode_scores_avx512, decode_values_avx512};
  if (isa >= CpuIsa::kAvx2 && avx2_decode_fits(hd, dtype))
    return SimdDecodePasses{decode_scores_avx2, decode_values_avx2};
  return std::nullopt;
}

// attend_decode with those passes: each query head's scores, softmax and P V in turn.
void attend_decode_simd(const HeadTask& t, const SimdDecodePasses& passes, float* scores) {
  const int32_t ctx = t.seq->n_past + 1;
  for (int32_t g = 0; g < t.group; ++g) {
    float* row = scores + static_cast<size_t>(g) * static_cast<size_t>(ctx);
    passes.scores(t.q + g * t.hd, t.k, t.dtype, ctx, t.hd, t.scale, row);
    causal_softmax_row(row, ctx, ctx, t.mask);
    passes.values(row, t.v, t.dtype, ctx, t.hd, t.out + g * t.hd);
  }
}
#endif

// A prefill chunk: per query head, S = scale Q K^T and O = P V as BLAS GEMMs over the kv
// head's rows (an f16 cache's converted once for the group).
template <class T>
void attend_chunk(const HeadTask& t, float* scratch) {
  const SeqSlice& s = *t.seq;
  const int32_t ctx = s.n_past + s.n_new;
  const int32_t hd = t.hd;
  float* scores = scratch;
  float* buf = scratch + static_cast<size_t>(s.n_new) * static_cast<size_t>(ctx);
  const int64_t n = int64_t{ctx} * hd;
  const float* kf = rows_f32(static_cast<const T*>(t.k), 0, n, buf);
  const float* vf = rows_f32(static_cast<const T*>(t.v), 0, n, buf + n);
  for (int32_t g = 0; g < t.group; ++g) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, s.n_new, ctx, hd, t.scale, t.q + g * hd,
                static_cast<blasint>(t.width), kf, hd, 0.0f, scores, ctx);
    for (int32_t r = 0; r < s.n_new; ++r)
      causal_softmax_row(scores + static_cast<size_t>(r) * ctx, s.n_past + r + 1, ctx, t.mask);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, s.n_new, hd, ctx, 1.0f, scores, ctx, vf,
                hd, 0.0f, t.out + g * hd, static_cast<blasint>(t.width));
  }
}

template <class T>
void attend(const HeadTask& t, CpuIsa isa, float* scratch) {
  if (t.seq->n_new != 1) {
    attend_chunk<T>(t, scratch);
    return;
  }
#if STRATA_X86_KERNELS
  if (const auto passes = simd_decode_passes(isa, t.hd, t.dtype)) {
    attend_decode_simd(t, *passes, scratch);
    return;
  }
#endif
  (void)isa;
  attend_decode<T>(t, scratch);
}

}  // namespace

namespace {

// The loop both attention entries share: checks every sequence against the cache's slots
// and capacity, gives each thread `scratch_for(seq)` floats (the most any task needs), and
// runs `run(seq, kv_head, scratch)` once per (sequence, kv head) with new rows, in parallel
// where the step is big enough.
template <class ScratchFor, class Run>
void each_head_task(std::span<const SeqSlice> seqs, const AttentionDims& dims, int32_t n_slots,
                    int32_t capacity, std::vector<float>& scratch, ScratchFor scratch_for,
                    Run run) {
  const int64_t width = static_cast<int64_t>(dims.n_heads) * dims.head_dim;
  size_t per_task = 0;
  int64_t work = 0;
  for (const SeqSlice& s : seqs) {
    STRATA_CHECK(s.slot >= 0 && s.slot < n_slots, "attention: slot {} of {}", s.slot, n_slots);
    STRATA_CHECK(s.n_past + s.n_new <= capacity, "attention: {} + {} positions > capacity {}",
                 s.n_past, s.n_new, capacity);
    per_task = std::max(per_task, scratch_for(s));
    work += static_cast<int64_t>(s.n_new) * (s.n_past + s.n_new) * width;
  }
  const auto nthreads = static_cast<size_t>(omp_get_max_threads());
  if (scratch.size() < per_task * nthreads) scratch.resize(per_task * nthreads);
  const auto tasks = static_cast<int64_t>(seqs.size()) * dims.n_kv_heads;

#pragma omp parallel for schedule(dynamic, 1) if (work > kParallelElems)
  for (int64_t task = 0; task < tasks; ++task) {
    const SeqSlice& s = seqs[static_cast<size_t>(task / dims.n_kv_heads)];
    if (s.n_new == 0) continue;
    run(s, static_cast<int32_t>(task % dims.n_kv_heads),
        scratch.data() + per_task * static_cast<size_t>(omp_get_thread_num()));
  }
}

// The task of (sequence `s`, kv head `kvh`) over k and v rows at `k`, `v` ([ctx, hd] each).
HeadTask head_task(const float* q, float* out, const SeqSlice& s, int32_t kvh, const void* k,
                   const void* v, DType dtype, const AttentionDims& dims) {
  const int32_t group = dims.n_heads / dims.n_kv_heads;
  const int64_t width = static_cast<int64_t>(dims.n_heads) * dims.head_dim;
  const int64_t at = s.row_begin * width + static_cast<int64_t>(kvh) * group * dims.head_dim;
  return HeadTask{q + at,
                  out + at,
                  k,
                  v,
                  dtype,
                  &s,
                  group,
                  dims.head_dim,
                  width,
                  dims.scale,
                  ScoreMask{dims.window, dims.softcap}};
}

#if STRATA_X86_KERNELS
// One kv head of a 4-bit cache from its first blob row, as the AVX-512 passes read it.
attention_detail::Q4Rows q4_rows(const KvQ4LayerView& c, Q4Blob b, size_t first) {
  const size_t gpr = static_cast<size_t>(c.head_dim / c.group);
  return {b.codes + first * static_cast<size_t>(c.head_dim) / 2, b.mins + first * gpr,
          b.scales + first * gpr, c.group};
}

// decode_attention_simd.h's passes straight from a 4-bit cache's codes.
struct Q4DecodePasses {
  void (*scores)(const float*, const attention_detail::Q4Rows&, int32_t, int32_t, float, float*);
  void (*values)(const float*, const attention_detail::Q4Rows&, int32_t, int32_t, float*);
};

// The widest such passes `isa` allows for this head size and group; none: the scratch path.
std::optional<Q4DecodePasses> q4_decode_passes(CpuIsa isa, int32_t hd, int32_t group) {
  using namespace attention_detail;
  if (isa == CpuIsa::kAvx512 && avx512_q4_decode_fits(hd, group))
    return Q4DecodePasses{decode_scores_q4_avx512, decode_values_q4_avx512};
  if (isa >= CpuIsa::kAvx2 && avx2_q4_decode_fits(hd, group))
    return Q4DecodePasses{decode_scores_q4_avx2, decode_values_q4_avx2};
  return std::nullopt;
}

// A decode row of the group's query heads over a 4-bit cache, scored and weighted straight
// from the codes.
void attend_decode_q4(const HeadTask& t, const Q4DecodePasses& passes,
                      const attention_detail::Q4Rows& k, const attention_detail::Q4Rows& v,
                      float* scores) {
  const int32_t ctx = t.seq->n_past + 1;
  for (int32_t g = 0; g < t.group; ++g) {
    float* row = scores + static_cast<size_t>(g) * static_cast<size_t>(ctx);
    passes.scores(t.q + g * t.hd, k, ctx, t.hd, t.scale, row);
    causal_softmax_row(row, ctx, ctx, t.mask);
    passes.values(row, v, ctx, t.hd, t.out + g * t.hd);
  }
}
#endif

// Rows [row, row + n) of one blob of a 4-bit cache, dequantised into out[n, head_dim].
void dequantize_q4_rows(const KvQ4LayerView& c, Q4Blob b, size_t row, int32_t n, float* out) {
  const auto gpr = static_cast<size_t>(c.head_dim / c.group);
  const size_t groups = static_cast<size_t>(n) * gpr;
  for (size_t g = 0; g < groups; ++g) {
    const size_t at = row * static_cast<size_t>(c.head_dim) + g * static_cast<size_t>(c.group);
    dequantize_group(b.codes + at / 2, c.group, b.mins[row * gpr + g], b.scales[row * gpr + g],
                     out + g * static_cast<size_t>(c.group));
  }
}

}  // namespace

// One task per (sequence, kv head) and the query heads that share it: S = scale * Q K^T over
// the sequence's cache, causal softmax per row, O = P V. Decode rows run attend_decode; a
// prefill chunk's products are BLAS GEMMs (inside the parallel region OpenBLAS runs
// single-threaded).
void CpuBackend::attention(const float* q, const StepRows& rows, const KvLayerView& cache,
                           const AttentionDims& dims, float* out) {
  check_kv_dtype(cache, "attention");
  const int32_t group = dims.n_heads / dims.n_kv_heads;
  const bool half = cache.dtype == DType::kF16;
  const CpuIsa isa = isa_;
  each_head_task(
      rows.seqs, dims, cache.n_slots, cache.capacity, attn_scratch_,
      [&](const SeqSlice& s) { return attention_scratch(s, dims.head_dim, group, cache.dtype); },
      [&](const SeqSlice& s, int32_t kvh, float* scratch) {
        const size_t base = (static_cast<size_t>(s.slot) * cache.slot_stride() +
                             static_cast<size_t>(kvh) * cache.head_stride()) *
                            cache.elem_bytes();
        const HeadTask t =
            head_task(q, out, s, kvh, static_cast<const std::byte*>(cache.k) + base,
                      static_cast<const std::byte*>(cache.v) + base, cache.dtype, dims);
        if (half) {
          attend<uint16_t>(t, isa, scratch);
        } else {
          attend<float>(t, isa, scratch);
        }
      });
}

// The same over a 4-bit cache, whose bytes are read once, as 4-bit. A decode row on AVX-512
// (head_dim a multiple of 32 up to 256) or AVX2 (of 16 up to 128) is scored and weighted
// straight from the codes.
// Otherwise each task dequantises only its own kv head's positions 0 .. ctx into its
// scratch (a few hundred KiB at most, so they stay in the core's cache) and attends over
// them as over an f32 cache.
void CpuBackend::attention_q4(const float* q, const StepRows& rows, const KvQ4LayerView& cache,
                              const AttentionDims& dims, float* out) {
  STRATA_CHECK(dims.n_kv_heads == cache.n_kv_heads && dims.head_dim == cache.head_dim,
               "attention: dims (kv heads {}, head_dim {}) vs 4-bit cache (kv heads {}, "
               "head_dim {})",
               dims.n_kv_heads, dims.head_dim, cache.n_kv_heads, cache.head_dim);
  STRATA_CHECK(cache.group > 0 && cache.group % 2 == 0 && cache.head_dim % cache.group == 0,
               "attention: a 4-bit cache's groups of {} do not divide head_dim {} into whole bytes",
               cache.group, cache.head_dim);
  const int32_t hd = dims.head_dim;
  const int32_t group = dims.n_heads / dims.n_kv_heads;
  const Q4Blob kb = q4_blob(cache.k, cache), vb = q4_blob(cache.v, cache);
  const CpuIsa isa = isa_;
  bool from_codes = false;  // decode rows: the passes straight from the codes
#if STRATA_X86_KERNELS
  const std::optional<Q4DecodePasses> passes = q4_decode_passes(isa, hd, cache.group);
  from_codes = passes.has_value();
#endif
  auto rows_of = [hd](const SeqSlice& s) {
    return static_cast<size_t>(s.n_past + s.n_new) * static_cast<size_t>(hd);
  };
  // The decoded K and V rows only where the task dequantises them.
  auto decoded = [&](const SeqSlice& s) { return from_codes && s.n_new == 1 ? 0 : 2 * rows_of(s); };
  each_head_task(
      rows.seqs, dims, cache.n_slots, cache.capacity, attn_scratch_,
      [&](const SeqSlice& s) { return attention_scratch(s, hd, group, DType::kF32) + decoded(s); },
      [&](const SeqSlice& s, int32_t kvh, float* scratch) {
        const size_t first =
            (static_cast<size_t>(s.slot) * cache.n_kv_heads + static_cast<size_t>(kvh)) *
            static_cast<size_t>(cache.capacity);
#if STRATA_X86_KERNELS
        if (decoded(s) == 0) {
          attend_decode_q4(head_task(q, out, s, kvh, nullptr, nullptr, DType::kQ4, dims), *passes,
                           q4_rows(cache, kb, first), q4_rows(cache, vb, first), scratch);
          return;
        }
#endif
        float* k = scratch;
        float* v = scratch + rows_of(s);
        dequantize_q4_rows(cache, kb, first, s.n_past + s.n_new, k);
        dequantize_q4_rows(cache, vb, first, s.n_past + s.n_new, v);
        attend<float>(head_task(q, out, s, kvh, k, v, DType::kF32, dims), isa,
                      scratch + 2 * rows_of(s));
      });
}

}  // namespace strata
