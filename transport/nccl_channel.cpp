// Compiled only with CUDA (see CMakeLists.txt). Not exercised on machines without a GPU:
// TensorLinks selects it only for ranks whose device the CUDA runtime can see.
#include "transport/nccl_channel.h"

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>

#include <algorithm>
#include <cstring>

#include "kernels/error.h"

namespace strata {

static_assert(kNcclIdBytes == NCCL_UNIQUE_ID_BYTES);
static_assert(sizeof(ncclUniqueId) == NCCL_UNIQUE_ID_BYTES);

namespace {

// How long an operation may stay "in progress" on a non-blocking communicator before it
// is enqueued; NCCL needs this only for connection set-up on first use of a peer.
constexpr double kEnqueueSeconds = 60.0;

// NCCL's own classes, mapped to what the caller can do (STYLE.md 6).
ErrorKind kind_of_nccl(ncclResult_t rc) {
  switch (rc) {
    case ncclSystemError:
    case ncclRemoteError:
      return ErrorKind::kDisconnected;  // a peer or the network went away
    default:
      return ErrorKind::kFailed;
  }
}

void check_nccl(ncclResult_t rc, const std::string& what, ncclComm_t comm = nullptr) {
  if (rc == ncclSuccess || rc == ncclInProgress) return;
  const char* last = ncclGetLastError(comm);
  fail(kind_of_nccl(rc), "{} failed: {}{}{}", what, ncclGetErrorString(rc),
       last && *last ? ": " : "", last ? last : "");
}

void check_cuda(cudaError_t rc, const std::string& what) {
  if (rc == cudaSuccess) return;
  fail(ErrorKind::kFailed, "{} failed: {}", what, cudaGetErrorString(rc));
}

ncclDataType_t nccl_type(DType dtype) {
  return dtype == DType::kI32 ? ncclInt32 : ncclFloat32;
}

class NcclTensorChannel final : public TensorChannel {
 public:
  NcclTensorChannel(const std::vector<int>& members, int my_rank, int device,
                    std::span<const std::byte> id, const Deadline& deadline)
      : members_(members), device_(device) {
    check_cuda(cudaSetDevice(device_), fmt::format("cudaSetDevice({})", device_));
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    ncclUniqueId unique{};
    std::memcpy(unique.internal, id.data(), sizeof(unique.internal));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // init returns at once; we poll it to the deadline below
    check_nccl(ncclCommInitRankConfig(&comm_, static_cast<int>(members_.size()), unique,
                                      nccl_rank(my_rank), &config),
               "ncclCommInitRankConfig");
    await_ready(deadline, "NCCL communicator set-up with all GPU ranks");
  }

  ~NcclTensorChannel() override {
    if (comm_ != nullptr) ncclCommAbort(comm_);  // never blocks, unlike ncclCommDestroy
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  const char* name() const override { return "nccl"; }
  bool device_buffers() const override { return true; }

 protected:
  uintptr_t post(const Op& op) override {
    fail_if_broken();
    check_cuda(cudaSetDevice(device_), "cudaSetDevice");
    const int peer = nccl_rank(op.peer);
    const std::string what = fmt::format("ncclSend/Recv with rank {}", op.peer);
    if (op.is_send) {
      check_nccl(ncclSend(op.data, op.count, nccl_type(op.dtype), peer, comm_, stream_), what,
                 comm_);
    } else {
      check_nccl(ncclRecv(op.data, op.count, nccl_type(op.dtype), peer, comm_, stream_), what,
                 comm_);
    }
    await_ready(Deadline::after_seconds(kEnqueueSeconds), what);
    const size_t slot = take_event();
    check_cuda(cudaEventRecord(events_[slot], stream_), "cudaEventRecord");
    return slot;
  }

  bool poll(uintptr_t& handle, const Op& op) override {
    fail_if_broken();
    ncclResult_t async = ncclSuccess;
    ncclCommGetAsyncError(comm_, &async);
    if (async != ncclSuccess && async != ncclInProgress) {
      release_event(handle);
      break_comm();
      check_nccl(async, fmt::format("NCCL transfer with rank {}", op.peer));
    }
    const cudaError_t rc = cudaEventQuery(events_[handle]);
    if (rc == cudaErrorNotReady) return false;
    release_event(handle);
    check_cuda(rc, fmt::format("NCCL transfer with rank {}", op.peer));
    return true;
  }

  // A transfer that missed its deadline cannot be withdrawn from NCCL: abort the
  // communicator (as nccl-tests does), so nothing waits on it any more.
  void cancel(uintptr_t& handle, const Op&) noexcept override {
    release_event(handle);
    break_comm();
  }

 private:
  int nccl_rank(int world_rank) const {
    auto it = std::find(members_.begin(), members_.end(), world_rank);
    STRATA_CHECK(it != members_.end(), "rank {} is not a GPU rank", world_rank);
    return static_cast<int>(it - members_.begin());
  }

  void await_ready(const Deadline& deadline, const std::string& what) {
    ncclResult_t state = ncclInProgress;
    const bool done = poll_until(deadline, [&] {
      ncclCommGetAsyncError(comm_, &state);
      return state != ncclInProgress;
    });
    if (!done) {
      break_comm();
      fail_timeout(deadline, "the GPU ranks", what);
    }
    if (state != ncclSuccess) break_comm();
    check_nccl(state, what);
  }

  size_t take_event() {
    if (free_.empty()) {  // grows only while warming up: one event per transfer in flight
      cudaEvent_t e = nullptr;
      check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
      events_.push_back(e);
      free_.push_back(events_.size() - 1);
    }
    const size_t slot = free_.back();
    free_.pop_back();
    return slot;
  }

  void release_event(uintptr_t slot) noexcept { free_.push_back(slot); }

  void fail_if_broken() const {
    if (broken_) fail(ErrorKind::kDisconnected, "NCCL channel aborted after an earlier failure");
  }

  void break_comm() noexcept {
    if (comm_ != nullptr) ncclCommAbort(comm_);
    comm_ = nullptr;
    broken_ = true;
  }

  std::vector<int> members_;
  int device_;
  cudaStream_t stream_ = nullptr;
  ncclComm_t comm_ = nullptr;
  bool broken_ = false;
  std::vector<cudaEvent_t> events_;
  std::vector<size_t> free_;
};

}  // namespace

bool nccl_built() {
  return true;
}

std::vector<std::byte> nccl_unique_id() {
  ncclUniqueId id{};
  check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
  std::vector<std::byte> bytes(sizeof(id.internal));
  std::memcpy(bytes.data(), id.internal, bytes.size());
  return bytes;
}

std::unique_ptr<TensorChannel> make_nccl_channel(const std::vector<int>& members, int my_rank,
                                                 int device, std::span<const std::byte> id,
                                                 const Deadline& deadline) {
  STRATA_CHECK(id.size() == kNcclIdBytes, "NCCL id of {} bytes", id.size());
  return std::make_unique<NcclTensorChannel>(members, my_rank, device, id, deadline);
}

}  // namespace strata
