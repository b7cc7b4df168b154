// The CUDA backend class. Compiled as C++20 by the host compiler (it implements backend.h,
// which needs <span>); the device kernels live in cuda_kernels.cu behind the C++17
// launcher header cuda_kernels.h. Built into strata_kernels in every configuration: without
// CUDA only the make_cuda_backend() stub that reports kUnimplemented is compiled.
#include "kernels/cuda/cuda_backend.h"

#include "kernels/error.h"
#include "kernels/tunables.h"

namespace strata {

// Each switch's choices (kernels/tunables.h) are in the order of its enum, first the default.
CudaOptions CudaOptions::from_env() {
  CudaOptions o;
  o.fused_gemv = tunable_choice(TunableId::kCudaGemv) == 0;
  o.fuse_epilogues = tunable_choice(TunableId::kCudaEpilogue) == 0;
  o.pdl = static_cast<Pdl>(tunable_choice(TunableId::kCudaPdl));
  o.fuse_norms = tunable_choice(TunableId::kCudaNorm) == 1;
  o.norm_warp_rows = 1 << tunable_choice(TunableId::kCudaNormRows);
  o.attention = static_cast<Attention>(tunable_choice(TunableId::kCudaAttention));
  o.fuse_decode_attention = tunable_choice(TunableId::kCudaDecode) == 1;
  return o;
}

std::unique_ptr<Backend> make_cuda_backend(int device_index) {
  return make_cuda_backend(device_index, CudaOptions::from_env());
}

void CudaOptions::check() const {
  if (norm_warp_rows != 1 && norm_warp_rows != 2 && norm_warp_rows != 4)
    fail_input("CudaOptions::norm_warp_rows {}: expected 1, 2 or 4", norm_warp_rows);
}

}  // namespace strata

#if STRATA_HAVE_CUDA

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/cuda/cuda_kernels.h"
#include "kernels/quant.h"

namespace strata {
namespace {

using cuda_kernels::KernelStatus;
using cuda_kernels::RowDesc;
// The engine's row tables (kernels/backend.h RowEntry) are read by the kernels as RowDesc.
static_assert(sizeof(RowDesc) == sizeof(RowEntry) &&
                  offsetof(RowDesc, row) == offsetof(RowEntry, row) &&
                  offsetof(RowDesc, slot) == offsetof(RowEntry, slot) &&
                  offsetof(RowDesc, pos) == offsetof(RowEntry, pos),
              "RowDesc and RowEntry must share one layout");

// ---- One status check for the CUDA runtime, cuBLAS and our kernel launches. ----

bool status_ok(cudaError_t s) {
  return s == cudaSuccess;
}
bool status_ok(cublasStatus_t s) {
  return s == CUBLAS_STATUS_SUCCESS;
}
bool status_ok(KernelStatus s) {
  return s.cuda_error == static_cast<int>(cudaSuccess);
}

std::string status_text(cudaError_t s) {
  return fmt::format("{} ({})", cudaGetErrorName(s), cudaGetErrorString(s));
}
std::string status_text(cublasStatus_t s) {
  return fmt::format("{} ({})", cublasGetStatusName(s), cublasGetStatusString(s));
}
std::string status_text(KernelStatus s) {
  return status_text(static_cast<cudaError_t>(s.cuda_error));
}

// Out of memory is worth retrying later; anything else is a failure.
ErrorKind status_kind(cudaError_t s) {
  return s == cudaErrorMemoryAllocation ? ErrorKind::kOverloaded : ErrorKind::kFailed;
}
ErrorKind status_kind(cublasStatus_t s) {
  return s == CUBLAS_STATUS_ALLOC_FAILED ? ErrorKind::kOverloaded : ErrorKind::kFailed;
}
ErrorKind status_kind(KernelStatus s) {
  return status_kind(static_cast<cudaError_t>(s.cuda_error));
}

template <typename Status>
void check_status(Status s, const char* file, int line, const char* call) {
  if (status_ok(s)) [[likely]]
    return;
  // A failed runtime call also sets the thread's last error; clear it so the next launch's
  // cudaGetLastError() does not report this failure a second time (sticky errors stay).
  if constexpr (!std::is_same_v<Status, cublasStatus_t>) cudaGetLastError();
  throw Error(status_kind(s),
              fmt::format("{}:{}: {} failed: {}", file, line, call, status_text(s)));
}

#define STRATA_CUDA_CHECK(call) check_status((call), __FILE__, __LINE__, #call)

// ---- RAII for CUDA handles. ----

struct StreamDeleter {
  void operator()(cudaStream_t s) const { cudaStreamDestroy(s); }
};
struct CublasDeleter {
  void operator()(cublasHandle_t h) const { cublasDestroy(h); }
};
struct EventDeleter {
  void operator()(cudaEvent_t e) const { cudaEventDestroy(e); }
};
struct DeviceFree {
  void operator()(void* p) const { cudaFree(p); }
};
struct PinnedFree {
  void operator()(void* p) const { cudaFreeHost(p); }
};
using StreamPtr = std::unique_ptr<std::remove_pointer_t<cudaStream_t>, StreamDeleter>;
using CublasPtr = std::unique_ptr<std::remove_pointer_t<cublasHandle_t>, CublasDeleter>;
using EventPtr = std::unique_ptr<std::remove_pointer_t<cudaEvent_t>, EventDeleter>;
using DevicePtr = std::unique_ptr<void, DeviceFree>;
using PinnedPtr = std::unique_ptr<void, PinnedFree>;

int checked_int(int64_t v, const char* what) {
  STRATA_CHECK(v >= 0 && v <= INT_MAX, "cuda backend: {} = {} does not fit a CUDA int", what, v);
  return static_cast<int>(v);
}

cuda_kernels::ElemType elem_type(DType t) {
  switch (t) {
    case DType::kF32:
      return cuda_kernels::ElemType::kF32;
    case DType::kF16:
      return cuda_kernels::ElemType::kF16;
    case DType::kBF16:
      return cuda_kernels::ElemType::kBF16;
    case DType::kI32:
    case DType::kQ4:
    case DType::kF32Panel:
    case DType::kQ4Panel:
      break;
  }
  STRATA_CHECK(false, "cuda backend: {} is not a float type", dtype_name(t));
  return cuda_kernels::ElemType::kF32;
}

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device_index, const CudaOptions& options);
  ~CudaBackend() override;

  std::string name() const override { return name_; }
  Device device() const override { return Device::kCuda; }

  void* allocate(size_t bytes) override;
  void deallocate(void* p) override;
  void copy(void* dst, const void* src, size_t bytes, CopyKind kind) override;
  void synchronize() override;
  // The f16 copy of x for half-precision and 4-bit linears and the f16 dequantised 4-bit
  // matrix, at exactly accelerator_scratch_bytes(bounds).
  void reserve(const KernelBounds& bounds) override;
  size_t reserved_bytes() const override { return half_x_bytes_ + dequant_bytes_; }
  void bind_thread() override { activate(); }
  TransferTicket transfer(void* dst, const void* src, size_t bytes, CopyKind kind) override;
  void compute_waits(TransferTicket ticket) override;
  void host_waits(TransferTicket ticket) override;
  bool transfer_done(TransferTicket ticket) override;
  void* allocate_host(size_t bytes) override;
  void deallocate_host(void* p) override;

  void linear(const float* x, int64_t m, const Tensor& w, const float* bias, float* y) override;
  bool linear_then(const float* x, int64_t m, const Tensor& w, const float* bias, LinearThen then,
                   float* y) override;
  bool linears(const float* x, int64_t m, std::span<const LinearOut> outs,
               const LinearsFold& fold) override;
  void embedding(const int32_t* ids, int64_t n, const Tensor& table, float* y) override;
  void rms_norm(const float* x, int64_t m, int64_t h, const float* weight, float eps,
                float* y) override;
  void layer_norm(const float* x, int64_t m, int64_t h, const float* weight, const float* bias,
                  float eps, float* y) override;
  void rope(float* x, int64_t m, int32_t n_heads, int32_t head_dim, const int32_t* positions,
            const RopeTables& tables) override;
  void silu_mul(const float* gate, const float* up, float* out, int64_t n) override;
  void gelu_tanh_mul(const float* gate, const float* up, float* out, int64_t n) override;
  void scale(float* x, int64_t n, float s) override;
  void softcap(float* x, int64_t n, float cap) override;
  void relu(float* x, int64_t n) override;
  void add(float* y, const float* x, int64_t n) override;
  void gather_rows(const float* x, int64_t width, const int32_t* rows, int64_t n,
                   float* out) override;
  void scatter_add_rows(const float* y, int64_t width, const int32_t* rows, const float* weights,
                        int64_t n, float* out) override;
  void softmax(float* x, int64_t m, int64_t n) override;
  void kv_store(const float* k, const float* v, const StepRows& rows,
                const KvLayerView& cache) override;
  void attention(const float* q, const StepRows& rows, const KvLayerView& cache,
                 const AttentionDims& dims, float* out) override;
  bool store_and_attend(const float* q, const float* k, const float* v, const StepRows& rows,
                        const KvLayerView& cache, const AttentionDims& dims, float* out) override;
  void kv_store_q4(const float* k, const float* v, const StepRows& rows,
                   const KvQ4LayerView& cache) override;
  void kv_dequantize(const KvQ4LayerView& cache, const KvLayerView& out) override;
  void attention_q4(const float* q, const StepRows& rows, const KvQ4LayerView& cache,
                    const AttentionDims& dims, float* out) override;

 private:
  // Makes this backend's device current on the calling thread.
  void activate() const;
  cuda_kernels::StreamHandle stream() const { return stream_.get(); }
  // Grow-only device scratch; growing waits for the stream so no queued kernel still uses
  // the old allocation when it is freed.
  void* device_scratch(DevicePtr& buf, size_t& capacity, size_t bytes);
  // Flattens the slices into one RowDesc per new row (checked against the cache on the
  // host) and uploads them through pinned staging memory; returns the device table.
  const RowDesc* upload_rows(std::span<const SeqSlice> seqs, const KvLayerView& cache,
                             int64_t& n_rows);
  // The step's row table when the caller uploaded one (StepRows::table), else one built now.
  const RowDesc* rows_of(const StepRows& rows, const KvLayerView& cache, int64_t& n_rows);
  static cuda_kernels::KvCacheDesc cache_desc(const KvLayerView& cache);

  int device_;
  std::string name_;
  // Declaration order is creation order; members are destroyed in reverse, so scratch
  // memory goes first, then the event, the cuBLAS handle, its workspace and finally the
  // stream they use.
  StreamPtr stream_;
  DevicePtr cublas_workspace_;  // handed to cuBLAS so no GEMM allocates behind our back
  CublasPtr cublas_;
  EventPtr upload_done_;  // recorded after the last copy out of pinned_rows_
  PinnedPtr pinned_rows_;
  size_t pinned_rows_bytes_ = 0;
  DevicePtr rows_;
  size_t rows_bytes_ = 0;
  DevicePtr half_x_;  // x rounded to the weight's half type for linear
  size_t half_x_bytes_ = 0;
  DevicePtr dequant_;  // a q4 weight dequantised to f16 for linear
  size_t dequant_bytes_ = 0;
  // Rows [row_begin, row_begin + rows) of a kQ4 weight as f16 in the dequant scratch.
  const void* dequantize_q4(const Tensor& w, int64_t row_begin, int64_t rows);
  // The fused GEMV for a few rows of f16 / bf16 / 4-bit weights (cuda_kernels.h's row
  // limits); false (and nothing enqueued) when the rows, shapes or alignment do not suit it.
  bool gemv(const float* x, int m, const Tensor& w, const float* bias,
            cuda_kernels::GemvEpilogue epilogue, float* y);
  // w as a part of a fused GEMV over m rows (n, weights, 4-bit mins and scales); false where
  // the rows, dtype, shape or alignment do not suit the kernel.
  bool gemv_part(const Tensor& w, int m, cuda_kernels::GemvPart& part) const;
  // One fused GEMV launch over parts of one dtype and in-features k.
  void launch_gemv(const float* x, int m, DType dtype, int64_t k,
                   std::span<const cuda_kernels::GemvPart> parts,
                   cuda_kernels::GemvEpilogue epilogue, const cuda_kernels::GemvNorm& norm);
  // The kernel choices (CudaOptions). GEMVs overlap the kernel before them (PDL) only
  // from compute capability 9.0 on, and the fused decode attention needs the warps-over-keys
  // kernel.
  bool fused_gemv_ = true;
  bool fuse_epilogues_ = true;
  bool fuse_norms_ = false;
  int norm_warp_rows_ = 1;  // CudaOptions::norm_warp_rows
  bool gemv_overlap_ = false;
  bool gemv_early_weights_ = false;
  bool overlap_all_ = false;  // the norms, kv_store and attention with PDL too
  bool simple_attention_ = false;
  bool decode_warps_ = true;
  bool fuse_decode_attention_ = false;
  // store_and_attend's split counters (cuda_kernels::DecodeFusion::arrivals), zero between
  // launches; grown (and zeroed) as steps need more.
  DevicePtr arrivals_;
  size_t arrivals_bytes_ = 0;
  unsigned* arrivals(size_t count);
  int sm_count_ = 0;

  // transfer(): its own stream, so copies run beside kernels. A ticket's event sits in a
  // ring; a ticket older than the ring waits on a newer event of the same in-order stream,
  // which is later, so still correct.
  void init_transfers();
  cudaEvent_t ticket_event(TransferTicket t) const {
    return ticket_events_[t.id % kTicketRing].get();
  }
  static constexpr size_t kTicketRing = 16;
  StreamPtr transfer_stream_;
  EventPtr compute_mark_;  // where compute stood when a transfer was issued
  EventPtr ticket_events_[kTicketRing];
  uint64_t next_ticket_ = 1;
};

CudaBackend::CudaBackend(int device_index, const CudaOptions& options) : device_(device_index) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    fail(ErrorKind::kFailed, "cuda:{}: the CUDA runtime cannot be used: cudaGetDeviceCount: {}",
         device_index, status_text(err));
  }
  if (device_index < 0 || device_index >= count)
    fail(ErrorKind::kFailed, "cuda:{}: no such device ({} CUDA device(s) present)", device_index,
         count);
  STRATA_CUDA_CHECK(cudaSetDevice(device_));
  cudaDeviceProp prop{};
  STRATA_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
  name_ = fmt::format("cuda:{} {} (sm_{}{})", device_, prop.name, prop.major, prop.minor);
  sm_count_ = prop.multiProcessorCount;
  fused_gemv_ = options.fused_gemv;
  fuse_epilogues_ = options.fuse_epilogues;
  gemv_overlap_ = options.pdl != CudaOptions::Pdl::kOff && prop.major >= 9 &&
                  cuda_kernels::kernels_wait_for_inputs();
  gemv_early_weights_ = options.pdl == CudaOptions::Pdl::kEarly;
  overlap_all_ = gemv_overlap_ && options.pdl == CudaOptions::Pdl::kAll;
  fuse_norms_ = options.fuse_norms;
  norm_warp_rows_ = options.norm_warp_rows;
  simple_attention_ = options.attention == CudaOptions::Attention::kSimple;
  decode_warps_ = options.attention == CudaOptions::Attention::kWarps;
  fuse_decode_attention_ = options.fuse_decode_attention && decode_warps_;

  cudaStream_t s = nullptr;
  STRATA_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  stream_.reset(s);
  // cuBLAS's workspace is ours, allocated once at the size its documentation recommends
  // (32 MiB from Hopper on, 4 MiB before) and zeroed, instead of its default pool that it
  // fills lazily with cudaMalloc on the first GEMM per stream.
  const size_t ws_bytes = prop.major >= 9 ? (size_t{32} << 20) : (size_t{4} << 20);
  void* ws = nullptr;
  STRATA_CUDA_CHECK(cudaMalloc(&ws, ws_bytes));
  cublas_workspace_.reset(ws);
  STRATA_CUDA_CHECK(cudaMemsetAsync(ws, 0, ws_bytes, s));
  cublasHandle_t h = nullptr;
  STRATA_CUDA_CHECK(cublasCreate(&h));
  cublas_.reset(h);
  STRATA_CUDA_CHECK(cublasSetStream(h, s));
  // After cublasSetStream, which puts the handle back on the default workspace pool.
  STRATA_CUDA_CHECK(cublasSetWorkspace(h, ws, ws_bytes));
  // Plain f32 GEMMs stay f32 (no TF32 unless NVIDIA_TF32_OVERRIDE says otherwise).
  STRATA_CUDA_CHECK(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH));
  cudaEvent_t e = nullptr;
  STRATA_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  upload_done_.reset(e);
  init_transfers();
}

void CudaBackend::init_transfers() {
  cudaStream_t s = nullptr;
  STRATA_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  transfer_stream_.reset(s);
  auto make_event = [](EventPtr& out) {
    cudaEvent_t e = nullptr;
    STRATA_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    out.reset(e);
  };
  make_event(compute_mark_);
  for (EventPtr& e : ticket_events_) make_event(e);
}

CudaBackend::~CudaBackend() {
  // Nothing may throw here: wait for queued work, then the members free themselves.
  int current = -1;
  if (cudaGetDevice(&current) == cudaSuccess && current != device_) cudaSetDevice(device_);
  if (stream_) cudaStreamSynchronize(stream_.get());
  if (transfer_stream_) cudaStreamSynchronize(transfer_stream_.get());
  cudaGetLastError();
}

void CudaBackend::activate() const {
  int current = -1;
  STRATA_CUDA_CHECK(cudaGetDevice(&current));
  if (current != device_) STRATA_CUDA_CHECK(cudaSetDevice(device_));
}

void* CudaBackend::device_scratch(DevicePtr& buf, size_t& capacity, size_t bytes) {
  if (bytes <= capacity && buf) return buf.get();
  const size_t want = std::max(bytes, capacity * 2);
  STRATA_CUDA_CHECK(cudaStreamSynchronize(stream_.get()));
  buf.reset();
  capacity = 0;
  void* p = nullptr;
  STRATA_CUDA_CHECK(cudaMalloc(&p, want));
  buf.reset(p);
  capacity = want;
  return p;
}

void* CudaBackend::allocate(size_t bytes) {
  activate();
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, std::max<size_t>(bytes, 1));
  if (err != cudaSuccess) {
    cudaGetLastError();
    fail(status_kind(err), "{}: out of device memory allocating {} bytes: {}", name_, bytes,
         status_text(err));
  }
  // Zeroed like the CPU backend's memory (stream-ordered before any later op or copy).
  const cudaError_t set = cudaMemsetAsync(p, 0, std::max<size_t>(bytes, 1), stream_.get());
  if (set != cudaSuccess) {
    cudaFree(p);
    STRATA_CUDA_CHECK(set);
  }
  return p;
}

void CudaBackend::deallocate(void* p) {
  // Called from destructors (DeviceBuffer): never throws. Queued work that may still read
  // p finishes first; a failure here resurfaces at the next checked call if it is sticky.
  if (p == nullptr) return;
  int current = -1;
  if (cudaGetDevice(&current) == cudaSuccess && current != device_) cudaSetDevice(device_);
  cudaStreamSynchronize(stream_.get());
  cudaFree(p);
  cudaGetLastError();
}

void CudaBackend::copy(void* dst, const void* src, size_t bytes, CopyKind kind) {
  if (bytes == 0) return;
  activate();
  cudaMemcpyKind k = cudaMemcpyDeviceToDevice;
  switch (kind) {
    case CopyKind::kHostToDevice:
      k = cudaMemcpyHostToDevice;
      break;
    case CopyKind::kDeviceToHost:
      k = cudaMemcpyDeviceToHost;
      break;
    case CopyKind::kDeviceToDevice:
      k = cudaMemcpyDeviceToDevice;
      break;
  }
  STRATA_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, k, stream_.get()));
  // Host memory is the caller's again when copy() returns (as on the CPU backend): the
  // source may be reused, the destination read. Device-to-device stays stream-ordered.
  if (kind != CopyKind::kDeviceToDevice) STRATA_CUDA_CHECK(cudaStreamSynchronize(stream_.get()));
}

void CudaBackend::synchronize() {
  activate();
  STRATA_CUDA_CHECK(cudaStreamSynchronize(stream_.get()));
}

TransferTicket CudaBackend::transfer(void* dst, const void* src, size_t bytes, CopyKind kind) {
  if (bytes == 0) return {};
  activate();
  const cudaMemcpyKind k = kind == CopyKind::kHostToDevice   ? cudaMemcpyHostToDevice
                           : kind == CopyKind::kDeviceToHost ? cudaMemcpyDeviceToHost
                                                             : cudaMemcpyDeviceToDevice;
  STRATA_CUDA_CHECK(cudaEventRecord(compute_mark_.get(), stream_.get()));
  STRATA_CUDA_CHECK(cudaStreamWaitEvent(transfer_stream_.get(), compute_mark_.get(), 0));
  STRATA_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, k, transfer_stream_.get()));
  const TransferTicket t{next_ticket_++};
  STRATA_CUDA_CHECK(cudaEventRecord(ticket_event(t), transfer_stream_.get()));
  return t;
}

void CudaBackend::compute_waits(TransferTicket ticket) {
  if (ticket.id == 0) return;
  activate();
  STRATA_CUDA_CHECK(cudaStreamWaitEvent(stream_.get(), ticket_event(ticket), 0));
}

void CudaBackend::host_waits(TransferTicket ticket) {
  if (ticket.id == 0) return;
  activate();
  STRATA_CUDA_CHECK(cudaEventSynchronize(ticket_event(ticket)));
}

// A ticket older than the ring asks a newer event of the same in-order stream: done there
// means done here, and not done only makes the caller wait a little longer.
bool CudaBackend::transfer_done(TransferTicket ticket) {
  if (ticket.id == 0) return true;
  activate();
  const cudaError_t s = cudaEventQuery(ticket_event(ticket));
  if (s == cudaErrorNotReady) {
    // Not an error; kept out of the next launch's cudaGetLastError() status all the same.
    cudaGetLastError();
    return false;
  }
  STRATA_CUDA_CHECK(s);
  return true;
}

// Page-aligned (O_DIRECT reads land in it: the KV cache's disk tier) and page-locked
// (transfers need no bounce buffer). cudaMallocHost only promises 256-byte alignment, so
// the memory is allocated aligned and registered with the driver instead.
void* CudaBackend::allocate_host(size_t bytes) {
  activate();
  const size_t rounded = (std::max<size_t>(bytes, 1) + 4095) / 4096 * 4096;
  void* p = std::aligned_alloc(4096, rounded);
  if (p == nullptr) fail(ErrorKind::kOverloaded, "out of host memory allocating {} bytes", bytes);
  std::memset(p, 0, rounded);
  const cudaError_t err = cudaHostRegister(p, rounded, cudaHostRegisterDefault);
  if (err != cudaSuccess) {
    std::free(p);
    check_status(err, __FILE__, __LINE__, "cudaHostRegister");
  }
  return p;
}

void CudaBackend::deallocate_host(void* p) {
  if (p == nullptr) return;
  cudaHostUnregister(p);
  std::free(p);
}

// f16 / bf16 weights: x (m x k, small) is rounded to the weight's type in scratch and one
// cublasGemmEx multiplies the half inputs with f32 accumulation (CUBLAS_COMPUTE_32F) into
// f32 y. We round x rather than dequantise w: w is the big operand (n x k, read once per
// call at memory bandwidth in decode), and dequantising it would need a weight-sized f32
// scratch and triple the bytes moved, while x is m x k and converts in microseconds. The
// price is x's rounding (2^-11 relative for f16, 2^-8 for bf16) and, for f16, activations
// beyond +-65504 saturating to infinity; the tensor cores run at full rate either way.
void CudaBackend::linear(const float* x, int64_t m, const Tensor& w, const float* bias, float* y) {
  STRATA_CHECK(w.shape.rank == 2, "linear weight must be 2-D, got {}", w.describe());
  STRATA_CHECK(m >= 0, "linear rows {}", m);
  if (m == 0) return;
  activate();
  const int mi = checked_int(m, "linear rows");
  const int n = checked_int(w.shape[0], "linear out features");
  const int k = checked_int(w.shape[1], "linear in features");
  if (fused_gemv_ && gemv(x, mi, w, bias, cuda_kernels::GemvEpilogue::kStore, y)) return;
  const float one = 1.0f;
  const float zero = 0.0f;
  cublasHandle_t h = cublas_.get();
  if (w.dtype == DType::kF32) {
    // Row-major y[m,n] = x[m,k] w[n,k]^T is column-major y^T[n,m] = (w^T)^T[n,k] x^T[k,m],
    // where the row-major w and x read as column-major w^T (k x n) and x^T (k x m).
    const auto* wf = w.as<const float>();
    if (m == 1) {
      STRATA_CUDA_CHECK(cublasSgemv(h, CUBLAS_OP_T, k, n, &one, wf, k, x, 1, &zero, y, 1));
    } else {
      STRATA_CUDA_CHECK(
          cublasSgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, n, mi, k, &one, wf, k, x, k, &zero, y, n));
    }
  } else {
    STRATA_CHECK(w.dtype == DType::kF16 || w.dtype == DType::kBF16 || w.dtype == DType::kQ4,
                 "linear weight {} is not f32/f16/bf16/q4", w.describe());
    const DType wtype = w.dtype == DType::kQ4 ? DType::kF16 : w.dtype;
    const cudaDataType_t type = wtype == DType::kF16 ? CUDA_R_16F : CUDA_R_16BF;
    const int64_t elems = m * static_cast<int64_t>(k);
    void* xh = device_scratch(half_x_, half_x_bytes_, static_cast<size_t>(elems) * 2);
    STRATA_CUDA_CHECK(cuda_kernels::f32_to_half(x, xh, elem_type(wtype), elems, stream()));
    // q4 (FlexGen's compressed weights) dequantises to f16 scratch just before the GEMM; a
    // matrix larger than the reserved scratch (a compressed head, KernelBounds) in blocks of
    // rows that each write their columns of y^T. Unreserved scratch grows to the matrix.
    const int64_t fits = static_cast<int64_t>(dequant_bytes_ / 2) / k;
    const int block = w.dtype == DType::kQ4 && dequant_bytes_ > 0
                          ? static_cast<int>(std::clamp<int64_t>(fits, 1, n))
                          : n;
    for (int r0 = 0; r0 < n; r0 += block) {
      const int rows = std::min(block, n - r0);
      const void* wdata = w.dtype == DType::kQ4 ? dequantize_q4(w, r0, rows) : w.data;
      STRATA_CUDA_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, rows, mi, k, &one, wdata, type, k,
                                     xh, type, k, &zero, y + r0, CUDA_R_32F, n, CUBLAS_COMPUTE_32F,
                                     CUBLAS_GEMM_DEFAULT));
    }
  }
  if (bias != nullptr) STRATA_CUDA_CHECK(cuda_kernels::add_bias(y, bias, m, n, stream()));
}

// Decode rows: each weight read once, x used as f32 (cuBLAS's half GEMM would need x rounded
// first, a second kernel, and for small m splits k with a reduction kernel of its own).
bool CudaBackend::gemv_part(const Tensor& w, int m, cuda_kernels::GemvPart& part) const {
  const int64_t k = w.shape[1];
  part.n = w.shape[0];
  if (w.dtype == DType::kF16 || w.dtype == DType::kBF16) {
    part.w = w.data;
    return m <= cuda_kernels::kMaxGemvRowsHalf && k % 8 == 0 && cuda_kernels::aligned16(w.data);
  }
  if (w.dtype == DType::kQ4) {
    const QuantView q = q4_view(w);
    part.w = q.packed;
    part.mins = q.mins;
    part.scales = q.scales;
    return m <= cuda_kernels::kMaxGemvRowsQ4 && q.layout.axis == QuantAxis::kAlongRow &&
           q.layout.group_size == 64 && k % 64 == 0 && cuda_kernels::aligned16(q.packed);
  }
  return false;  // f32: cuBLAS's GEMV reads it at bandwidth already
}

void CudaBackend::launch_gemv(const float* x, int m, DType dtype, int64_t k,
                              std::span<const cuda_kernels::GemvPart> parts,
                              cuda_kernels::GemvEpilogue epilogue,
                              const cuda_kernels::GemvNorm& norm) {
  const int count = static_cast<int>(parts.size());
  const int warp_rows = norm.kind == cuda_kernels::GemvNormKind::kNone ? 1 : norm_warp_rows_;
  const cuda_kernels::GemvMode mode{epilogue, gemv_overlap_, gemv_early_weights_, norm, warp_rows};
  if (dtype == DType::kQ4) {
    STRATA_CUDA_CHECK(cuda_kernels::gemv_q4_parts(x, m, parts.data(), count, k, mode, stream()));
  } else {
    STRATA_CUDA_CHECK(cuda_kernels::gemv_half_parts(x, m, parts.data(), count, elem_type(dtype), k,
                                                    mode, stream()));
  }
}

bool CudaBackend::gemv(const float* x, int m, const Tensor& w, const float* bias,
                       cuda_kernels::GemvEpilogue epilogue, float* y) {
  cuda_kernels::GemvPart part;
  if (!cuda_kernels::aligned16(x) || !gemv_part(w, m, part)) return false;
  part.bias = bias;
  part.y = y;
  launch_gemv(x, m, w.dtype, w.shape[1], std::span(&part, 1), epilogue, {});
  return true;
}

// The fused GEMV's store does the ReLU or the residual add; other shapes decline.
bool CudaBackend::linear_then(const float* x, int64_t m, const Tensor& w, const float* bias,
                              LinearThen then, float* y) {
  STRATA_CHECK(w.shape.rank == 2, "linear weight must be 2-D, got {}", w.describe());
  if (!fused_gemv_ || !fuse_epilogues_ || m <= 0 || m > cuda_kernels::kMaxGemvRowsQ4) return false;
  activate();
  const auto epilogue = then == LinearThen::kRelu ? cuda_kernels::GemvEpilogue::kRelu
                                                  : cuda_kernels::GemvEpilogue::kAccumulate;
  return gemv(x, static_cast<int>(m), w, bias, epilogue, y);
}

// The norm as a GEMV launch folds it in (an RMS norm has no bias).
cuda_kernels::GemvNorm gemv_norm(const NormSpec& n) {
  return {n.layer ? cuda_kernels::GemvNormKind::kLayer : cuda_kernels::GemvNormKind::kRms, n.weight,
          n.layer ? n.bias : nullptr, n.eps};
}

// Up to three GEMVs of one weight type and in-features over the same x as one launch, with
// the norm before and the ReLU after where asked; any other set declines.
bool CudaBackend::linears(const float* x, int64_t m, std::span<const LinearOut> outs,
                          const LinearsFold& fold) {
  if (!fused_gemv_ || !fuse_epilogues_ || m <= 0 || m > cuda_kernels::kMaxGemvRowsQ4 ||
      outs.empty() || outs.size() > static_cast<size_t>(cuda_kernels::kMaxGemvParts) ||
      !cuda_kernels::aligned16(x) || (fold.norm != nullptr && !fuse_norms_))
    return false;
  std::array<cuda_kernels::GemvPart, cuda_kernels::kMaxGemvParts> parts{};
  const Tensor& first = *outs[0].w;
  for (size_t i = 0; i < outs.size(); ++i) {
    const Tensor& w = *outs[i].w;
    STRATA_CHECK(w.shape.rank == 2, "linear weight must be 2-D, got {}", w.describe());
    if (w.dtype != first.dtype || w.shape[1] != first.shape[1] ||
        !gemv_part(w, static_cast<int>(m), parts[i]))
      return false;
    parts[i].bias = outs[i].bias;
    parts[i].y = outs[i].y;
  }
  cuda_kernels::GemvNorm norm;
  if (fold.norm != nullptr) {
    norm = gemv_norm(*fold.norm);
    if (!cuda_kernels::gemv_norm_fits(static_cast<int>(m), first.shape[1], norm)) return false;
  }
  activate();
  launch_gemv(
      x, static_cast<int>(m), first.dtype, first.shape[1], std::span(parts.data(), outs.size()),
      fold.relu ? cuda_kernels::GemvEpilogue::kRelu : cuda_kernels::GemvEpilogue::kStore, norm);
  return true;
}

const void* CudaBackend::dequantize_q4(const Tensor& w, int64_t row_begin, int64_t rows) {
  const QuantView q = q4_view(w);  // device pointers: only their arithmetic happens here
  const int64_t k = q.layout.cols;
  const int64_t n = rows * k;
  void* out = device_scratch(dequant_, dequant_bytes_, static_cast<size_t>(n) * 2);
  const int64_t first = row_begin * k;  // rows are whole groups
  const int64_t group = first / q.layout.group_size;
  STRATA_CUDA_CHECK(
      cuda_kernels::dequantize_q4_to_f16(q.packed + first / 2, q.mins + group, q.scales + group,
                                         static_cast<unsigned short*>(out), n, stream()));
  return out;
}

void CudaBackend::embedding(const int32_t* ids, int64_t n, const Tensor& table, float* y) {
  STRATA_CHECK(table.shape.rank == 2, "embedding table {}", table.describe());
  if (n == 0) return;
  activate();
  checked_int(n, "embedding rows");
  if (table.dtype == DType::kQ4) {  // a compressed table (compress_weight): rows decoded
    const QuantView q = q4_view(table);
    STRATA_CUDA_CHECK(cuda_kernels::embedding_q4(ids, n, q.packed, q.mins, q.scales, table.shape[0],
                                                 table.shape[1], y, stream()));
    return;
  }
  STRATA_CUDA_CHECK(cuda_kernels::embedding(ids, n, table.data, elem_type(table.dtype),
                                            table.shape[0], table.shape[1], y, stream()));
}

void CudaBackend::rms_norm(const float* x, int64_t m, int64_t h, const float* weight, float eps,
                           float* y) {
  activate();
  checked_int(m, "rms_norm rows");
  STRATA_CUDA_CHECK(cuda_kernels::rms_norm(x, m, h, weight, eps, y, stream(), overlap_all_));
}

void CudaBackend::layer_norm(const float* x, int64_t m, int64_t h, const float* weight,
                             const float* bias, float eps, float* y) {
  activate();
  checked_int(m, "layer_norm rows");
  STRATA_CUDA_CHECK(
      cuda_kernels::layer_norm(x, m, h, weight, bias, eps, y, stream(), overlap_all_));
}

void CudaBackend::rope(float* x, int64_t m, int32_t n_heads, int32_t head_dim,
                       const int32_t* positions, const RopeTables& tables) {
  STRATA_CHECK(head_dim / 2 == tables.half_dim, "rope: head_dim {} vs table half {}", head_dim,
               tables.half_dim);
  activate();
  checked_int(m, "rope rows");
  STRATA_CUDA_CHECK(cuda_kernels::rope(x, m, n_heads, head_dim, positions, tables.cos, tables.sin,
                                       tables.max_positions, stream()));
}

void CudaBackend::gather_rows(const float* x, int64_t width, const int32_t* rows, int64_t n,
                              float* out) {
  activate();
  checked_int(n, "gathered rows");
  STRATA_CUDA_CHECK(cuda_kernels::gather_rows(x, width, rows, n, out, stream()));
}

void CudaBackend::scatter_add_rows(const float* y, int64_t width, const int32_t* rows,
                                   const float* weights, int64_t n, float* out) {
  activate();
  checked_int(n, "scattered rows");
  STRATA_CUDA_CHECK(cuda_kernels::scatter_add_rows(y, width, rows, weights, n, out, stream()));
}

void CudaBackend::silu_mul(const float* gate, const float* up, float* out, int64_t n) {
  activate();
  STRATA_CUDA_CHECK(cuda_kernels::silu_mul(gate, up, out, n, stream()));
}

void CudaBackend::gelu_tanh_mul(const float* gate, const float* up, float* out, int64_t n) {
  activate();
  STRATA_CUDA_CHECK(cuda_kernels::gelu_tanh_mul(gate, up, out, n, stream()));
}

void CudaBackend::scale(float* x, int64_t n, float s) {
  activate();
  STRATA_CUDA_CHECK(cuda_kernels::scale_softcap(x, n, s, 0.0f, stream()));
}

void CudaBackend::softcap(float* x, int64_t n, float cap) {
  activate();
  STRATA_CUDA_CHECK(cuda_kernels::scale_softcap(x, n, 1.0f, cap, stream()));
}

void CudaBackend::relu(float* x, int64_t n) {
  activate();
  STRATA_CUDA_CHECK(cuda_kernels::relu(x, n, stream()));
}

void CudaBackend::add(float* y, const float* x, int64_t n) {
  activate();
  STRATA_CUDA_CHECK(cuda_kernels::add(y, x, n, stream()));
}

void CudaBackend::softmax(float* x, int64_t m, int64_t n) {
  activate();
  checked_int(m, "softmax rows");
  STRATA_CUDA_CHECK(cuda_kernels::softmax(x, m, n, stream()));
}

cuda_kernels::KvCacheDesc CudaBackend::cache_desc(const KvLayerView& cache) {
  STRATA_CHECK(cache.dtype == DType::kF32 || cache.dtype == DType::kF16,
               "the CUDA kernels read an f32 or f16 KV cache, not {}", dtype_name(cache.dtype));
  return cuda_kernels::KvCacheDesc{cache.k,
                                   cache.v,
                                   cache.n_kv_heads,
                                   cache.head_dim,
                                   static_cast<int64_t>(cache.slot_stride()),
                                   static_cast<int64_t>(cache.head_stride()),
                                   elem_type(cache.dtype)};
}

// A table for one call whose caller brought none (a test calling the op directly); the
// engine uploads one table per GPU batch per step instead (StepRows::table).
const RowDesc* CudaBackend::upload_rows(std::span<const SeqSlice> seqs, const KvLayerView& cache,
                                        int64_t& n_rows) {
  int64_t total = 0;
  for (const SeqSlice& s : seqs) total += std::max(s.n_new, 0);
  n_rows = 0;
  if (total == 0) return nullptr;
  checked_int(total, "batch rows");
  const size_t bytes = static_cast<size_t>(total) * sizeof(RowDesc);
  // The pinned staging buffer may still be the source of the previous upload.
  STRATA_CUDA_CHECK(cudaEventSynchronize(upload_done_.get()));
  if (bytes > pinned_rows_bytes_) {
    pinned_rows_.reset();
    pinned_rows_bytes_ = 0;
    const size_t want = std::max(bytes, size_t{4096});
    void* p = nullptr;
    STRATA_CUDA_CHECK(cudaMallocHost(&p, want));
    pinned_rows_.reset(p);
    pinned_rows_bytes_ = want;
  }
  auto* host = static_cast<RowEntry*>(pinned_rows_.get());
  n_rows = fill_row_table(seqs, cache.n_slots, cache.capacity, host, total);
  void* dev = device_scratch(rows_, rows_bytes_, bytes);
  STRATA_CUDA_CHECK(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, stream_.get()));
  STRATA_CUDA_CHECK(cudaEventRecord(upload_done_.get(), stream_.get()));
  return static_cast<const RowDesc*>(dev);
}

const RowDesc* CudaBackend::rows_of(const StepRows& rows, const KvLayerView& cache,
                                    int64_t& n_rows) {
  if (rows.table == nullptr) return upload_rows(rows.seqs, cache, n_rows);
  n_rows = rows.n_rows;
  return reinterpret_cast<const RowDesc*>(rows.table);
}

void CudaBackend::reserve(const KernelBounds& bounds) {
  activate();
  auto exactly = [&](DevicePtr& buf, size_t& capacity, int64_t bytes) {
    if (bytes <= 0 || static_cast<size_t>(bytes) <= capacity) return;
    STRATA_CUDA_CHECK(cudaStreamSynchronize(stream_.get()));
    buf.reset();
    capacity = 0;
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, static_cast<size_t>(bytes));
    if (err != cudaSuccess) {
      cudaGetLastError();
      fail(status_kind(err), "{}: out of device memory reserving {} bytes of kernel scratch: {}",
           name_, bytes, status_text(err));
    }
    buf.reset(p);
    capacity = static_cast<size_t>(bytes);
  };
  if (bounds.half_weights)
    exactly(half_x_, half_x_bytes_, bounds.max_rows * bounds.max_in_features * 2);
  exactly(dequant_, dequant_bytes_, bounds.max_q4_elems * 2);
}

void CudaBackend::kv_store(const float* k, const float* v, const StepRows& step,
                           const KvLayerView& cache) {
  activate();
  int64_t n_rows = 0;
  const RowDesc* rows = rows_of(step, cache, n_rows);
  if (n_rows == 0) return;
  STRATA_CUDA_CHECK(
      cuda_kernels::kv_store(k, v, rows, n_rows, cache_desc(cache), stream(), overlap_all_));
}

namespace {
cuda_kernels::KvQ4Desc q4_desc(const KvQ4LayerView& c) {
  return {c.k,        c.v,     static_cast<int64_t>(c.rows()),       c.n_kv_heads, c.capacity,
          c.head_dim, c.group, static_cast<int64_t>(c.codes_bytes())};
}
// The attention kernels' limits, against the cache's kv heads and head_dim.
void check_attention_dims(const AttentionDims& dims, int32_t n_kv_heads, int32_t head_dim) {
  STRATA_CHECK(dims.n_kv_heads == n_kv_heads && dims.head_dim == head_dim,
               "attention dims (kv heads {}, head_dim {}) vs cache (kv heads {}, head_dim {})",
               dims.n_kv_heads, dims.head_dim, n_kv_heads, head_dim);
  STRATA_CHECK(dims.n_kv_heads > 0 && dims.n_heads % dims.n_kv_heads == 0,
               "attention: {} query heads do not group over {} kv heads", dims.n_heads,
               dims.n_kv_heads);
  STRATA_CHECK(dims.head_dim > 0 && dims.head_dim <= cuda_kernels::kMaxAttentionHeadDim,
               "attention: head_dim {} outside (0, {}]", dims.head_dim,
               cuda_kernels::kMaxAttentionHeadDim);
  // The CUDA kernels attend causally over every position, uncapped: a model that needs more
  // is refused here rather than computed wrong (the CPU backend has both).
  if (dims.window > 0 || dims.softcap > 0.0f)
    fail(ErrorKind::kUnimplemented,
         "attention with a sliding window ({}) or soft-capped scores ({}) is not implemented "
         "on the CUDA backend yet; run this model with --device cpu",
         dims.window, dims.softcap);
}
// A 4-bit cache's slots and positions, for the row table's slot and capacity checks.
KvLayerView shape_of(const KvQ4LayerView& c) {
  KvLayerView shape;
  shape.n_slots = c.n_slots;
  shape.capacity = c.capacity;
  shape.n_kv_heads = c.n_kv_heads;
  shape.head_dim = c.head_dim;
  return shape;
}
}  // namespace

void CudaBackend::kv_store_q4(const float* k, const float* v, const StepRows& step,
                              const KvQ4LayerView& cache) {
  activate();
  int64_t n_rows = 0;
  const RowDesc* rows = rows_of(step, shape_of(cache), n_rows);
  if (n_rows == 0) return;
  STRATA_CUDA_CHECK(cuda_kernels::kv_store_q4(k, v, rows, n_rows, q4_desc(cache), stream()));
}

void CudaBackend::kv_dequantize(const KvQ4LayerView& cache, const KvLayerView& out) {
  activate();
  STRATA_CUDA_CHECK(
      cuda_kernels::kv_dequantize(q4_desc(cache), out.k_f32(), out.v_f32(), stream()));
}

unsigned* CudaBackend::arrivals(size_t count) {
  const size_t had = arrivals_bytes_;
  void* p = device_scratch(arrivals_, arrivals_bytes_, count * sizeof(unsigned));
  if (arrivals_bytes_ != had)
    STRATA_CUDA_CHECK(cudaMemsetAsync(p, 0, arrivals_bytes_, stream_.get()));
  return static_cast<unsigned*>(p);
}

namespace {
int32_t longest_context(const StepRows& step) {
  int32_t max_context = 0;
  for (const SeqSlice& sl : step.seqs) max_context = std::max(max_context, sl.n_past + sl.n_new);
  return max_context;
}
}  // namespace

// One kernel where every sequence has one new row and the warps-over-keys kernel takes the
// step; the split results reuse linear's x scratch as attention's do.
bool CudaBackend::store_and_attend(const float* q, const float* k, const float* v,
                                   const StepRows& step, const KvLayerView& cache,
                                   const AttentionDims& dims, float* out) {
  if (!fuse_decode_attention_ || step.seqs.empty() || dims.n_kv_heads != cache.n_kv_heads ||
      dims.head_dim != cache.head_dim || dims.n_kv_heads <= 0 ||
      dims.n_heads % dims.n_kv_heads != 0 || dims.window > 0 || dims.softcap > 0.0f)
    return false;  // attention() says which of these it cannot do
  for (const SeqSlice& sl : step.seqs)
    if (sl.n_new != 1) return false;
  const auto n_seqs = static_cast<int64_t>(step.seqs.size());
  const int32_t max_context = longest_context(step);
  const cuda_kernels::AttentionTiling t =
      cuda_kernels::plan_attention(n_seqs, n_seqs, max_context, dims.n_heads, dims.n_kv_heads,
                                   dims.head_dim, sm_count_, half_x_bytes_, decode_warps_);
  cuda_kernels::DecodeFusion fusion;
  fusion.k_new = k;
  fusion.v_new = v;
  const cuda_kernels::KvCacheDesc desc = cache_desc(cache);
  if (!cuda_kernels::decode_fusion_fits(t, q, desc, dims.n_heads, fusion)) return false;
  activate();
  int64_t n_rows = 0;
  const RowDesc* rows = rows_of(step, cache, n_rows);
  if (t.splits > 1) fusion.arrivals = arrivals(static_cast<size_t>(n_rows * dims.n_kv_heads));
  STRATA_CUDA_CHECK(cuda_kernels::attention_tiled(
      q, rows, n_rows, desc, dims.n_heads, dims.scale, max_context, t,
      static_cast<float*>(half_x_.get()), out, stream(), gemv_overlap_, fusion));
  return true;
}

void CudaBackend::attention_q4(const float* q, const StepRows& step, const KvQ4LayerView& cache,
                               const AttentionDims& dims, float* out) {
  check_attention_dims(dims, cache.n_kv_heads, cache.head_dim);
  activate();
  int64_t n_rows = 0;
  const RowDesc* rows = rows_of(step, shape_of(cache), n_rows);
  if (n_rows == 0) return;
  const cuda_kernels::KvQ4Desc desc = q4_desc(cache);
  // As attention's kernels: decode rows by warps over keys where that kernel has the shape,
  // the rest tiled, split results in linear's x scratch; one block per (row, head) where
  // neither reads this cache's groups (or STRATA_CUDA_ATTENTION=simple).
  if (!simple_attention_) {
    const int32_t max_context = longest_context(step);
    const cuda_kernels::AttentionTiling t = cuda_kernels::plan_attention(
        n_rows, static_cast<int64_t>(step.seqs.size()), max_context, dims.n_heads, dims.n_kv_heads,
        dims.head_dim, sm_count_, half_x_bytes_, decode_warps_);
    if (cuda_kernels::takes_q4_decode_kernel(t, q, desc, dims.n_heads) ||
        cuda_kernels::q4_tiles_fit(desc)) {
      STRATA_CUDA_CHECK(cuda_kernels::attention_q4_tiled(
          q, rows, n_rows, desc, dims.n_heads, dims.scale, max_context, t,
          static_cast<float*>(half_x_.get()), out, stream(), overlap_all_));
      return;
    }
  }
  STRATA_CUDA_CHECK(
      cuda_kernels::attention_q4(q, rows, n_rows, desc, dims.n_heads, dims.scale, out, stream()));
}

void CudaBackend::attention(const float* q, const StepRows& step, const KvLayerView& cache,
                            const AttentionDims& dims, float* out) {
  check_attention_dims(dims, cache.n_kv_heads, cache.head_dim);
  activate();
  int64_t n_rows = 0;
  const RowDesc* rows = rows_of(step, cache, n_rows);
  if (n_rows == 0) return;
  if (simple_attention_) {
    STRATA_CUDA_CHECK(cuda_kernels::attention(q, rows, n_rows, cache_desc(cache), dims.n_heads,
                                              dims.scale, out, stream()));
    return;
  }
  const int32_t max_context = longest_context(step);
  // Split results reuse linear's x scratch: both run on this stream, one after the other,
  // so the scratch is never in use by both (and placement counts it once).
  const cuda_kernels::AttentionTiling t = cuda_kernels::plan_attention(
      n_rows, static_cast<int64_t>(step.seqs.size()), max_context, dims.n_heads, dims.n_kv_heads,
      dims.head_dim, sm_count_, half_x_bytes_, decode_warps_);
  STRATA_CUDA_CHECK(cuda_kernels::attention_tiled(
      q, rows, n_rows, cache_desc(cache), dims.n_heads, dims.scale, max_context, t,
      static_cast<float*>(half_x_.get()), out, stream(), overlap_all_));
}

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(int device_index, const CudaOptions& options) {
  options.check();
  return std::make_unique<CudaBackend>(device_index, options);
}

}  // namespace strata

#else  // !STRATA_HAVE_CUDA

namespace strata {

std::unique_ptr<Backend> make_cuda_backend(int device_index, const CudaOptions& options) {
  options.check();
  fail(ErrorKind::kUnimplemented, "cuda:{}: this binary was built without the CUDA backend",
       device_index);
}

}  // namespace strata

#endif
