// Compiled only with CUDA (see CMakeLists.txt). Not exercised on machines without a GPU:
// TensorLinks selects it only for ranks whose device the CUDA runtime can see.
#include "transport/nccl_channel.h"

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nccl.h>

#include <algorithm>
#include <cstring>

#include "kernels/error.h"
#include "transport/all_reduce.h"

namespace strata {

static_assert(kNcclIdBytes == NCCL_UNIQUE_ID_BYTES);
static_assert(sizeof(ncclUniqueId) == NCCL_UNIQUE_ID_BYTES);

namespace {

// How long an operation may stay "in progress" on a non-blocking communicator before it
// is enqueued; NCCL needs this only for connection set-up on first use of a peer.
constexpr double kEnqueueSeconds = 60.0;

// NCCL's own classes, mapped to what the caller can do (docs/CONVENTIONS.md, "Errors").
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

// One NCCL communicator with its own stream, set up non-blocking from a unique id so that
// the set-up, like every operation after it, has a deadline. Shared by the point-to-point
// channel and the tensor-parallel all-reduce.
class NcclComm {
 public:
  NcclComm(int n_ranks, int nccl_rank, int device, std::span<const std::byte> id,
           const Deadline& deadline, const std::string& what)
      : device_(device) {
    STRATA_CHECK(id.size() == kNcclIdBytes, "NCCL id of {} bytes", id.size());
    check_cuda(cudaSetDevice(device_), fmt::format("cudaSetDevice({})", device_));
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    ncclUniqueId unique{};
    std::memcpy(unique.internal, id.data(), sizeof(unique.internal));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // init returns at once; we poll it to the deadline below
    check_nccl(ncclCommInitRankConfig(&comm_, n_ranks, unique, nccl_rank, &config),
               "ncclCommInitRankConfig");
    await_ready(deadline, what);
  }
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;
  ~NcclComm() {
    if (comm_ != nullptr) ncclCommAbort(comm_);  // never blocks, unlike ncclCommDestroy
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  ncclComm_t comm() const { return comm_; }
  cudaStream_t stream() const { return stream_; }
  int device() const { return device_; }

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

  // An error the communicator reported since the last call: it is aborted, and the error
  // thrown naming `what`.
  void check_async(const std::string& what) {
    ncclResult_t async = ncclSuccess;
    ncclCommGetAsyncError(comm_, &async);
    if (async == ncclSuccess || async == ncclInProgress) return;
    break_comm();
    check_nccl(async, what);
  }

  void fail_if_broken() const {
    if (broken_)
      fail(ErrorKind::kDisconnected, "NCCL communicator aborted after an earlier failure");
  }

  // An operation that missed its deadline cannot be withdrawn from NCCL: abort the
  // communicator (as nccl-tests does), so nothing waits on it any more.
  void break_comm() noexcept {
    if (comm_ != nullptr) ncclCommAbort(comm_);
    comm_ = nullptr;
    broken_ = true;
  }

 private:
  int device_;
  cudaStream_t stream_ = nullptr;
  ncclComm_t comm_ = nullptr;
  bool broken_ = false;
};

class NcclTensorChannel final : public TensorChannel {
 public:
  NcclTensorChannel(const std::vector<int>& members, int my_rank, int device,
                    std::span<const std::byte> id, const Deadline& deadline)
      : members_(members),
        comm_(static_cast<int>(members.size()), nccl_rank(members, my_rank), device, id, deadline,
              "NCCL communicator set-up with all GPU ranks") {}

  ~NcclTensorChannel() override {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
  }

  const char* name() const override { return "nccl"; }
  bool device_buffers() const override { return true; }

 protected:
  uintptr_t post(const Op& op) override {
    comm_.fail_if_broken();
    check_cuda(cudaSetDevice(comm_.device()), "cudaSetDevice");
    const int peer = nccl_rank(members_, op.peer);
    const std::string what = fmt::format("ncclSend/Recv with rank {}", op.peer);
    if (op.is_send) {
      check_nccl(
          ncclSend(op.data, op.count, nccl_type(op.dtype), peer, comm_.comm(), comm_.stream()),
          what, comm_.comm());
    } else {
      check_nccl(
          ncclRecv(op.data, op.count, nccl_type(op.dtype), peer, comm_.comm(), comm_.stream()),
          what, comm_.comm());
    }
    comm_.await_ready(Deadline::after_seconds(kEnqueueSeconds), what);
    const size_t slot = take_event();
    check_cuda(cudaEventRecord(events_[slot], comm_.stream()), "cudaEventRecord");
    return slot;
  }

  bool poll(uintptr_t& handle, const Op& op) override {
    comm_.fail_if_broken();
    try {
      comm_.check_async(fmt::format("NCCL transfer with rank {}", op.peer));
    } catch (...) {
      release_event(handle);
      throw;
    }
    const cudaError_t rc = cudaEventQuery(events_[handle]);
    if (rc == cudaErrorNotReady) return false;
    release_event(handle);
    check_cuda(rc, fmt::format("NCCL transfer with rank {}", op.peer));
    return true;
  }

  void cancel(uintptr_t& handle, const Op&) noexcept override {
    release_event(handle);
    comm_.break_comm();
  }

 private:
  static int nccl_rank(const std::vector<int>& members, int world_rank) {
    auto it = std::find(members.begin(), members.end(), world_rank);
    STRATA_CHECK(it != members.end(), "rank {} is not a GPU rank", world_rank);
    return static_cast<int>(it - members.begin());
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

  std::vector<int> members_;
  NcclComm comm_;
  std::vector<cudaEvent_t> events_;
  std::vector<size_t> free_;
};

// ncclAllReduce (sum, in place) on the group's own communicator and stream. The caller has
// synchronised the stream that wrote `data` (the compute backend's); the call returns once
// the sum is in `data`, or at the deadline with the communicator aborted.
class NcclAllReduce final : public AllReduceGroup {
 public:
  NcclAllReduce(std::vector<int> members, int my_rank, int device, std::span<const std::byte> id,
                const Deadline& deadline)
      : AllReduceGroup(std::move(members), my_rank),
        comm_(static_cast<int>(members_.size()), index_, device, id, deadline,
              fmt::format("NCCL set-up of the tensor-parallel group [{}]",
                          fmt::join(members_, ", "))) {
    check_cuda(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "cudaEventCreate");
  }
  ~NcclAllReduce() override {
    if (done_ != nullptr) cudaEventDestroy(done_);
  }

  const char* name() const override { return "nccl"; }
  bool device_buffers() const override { return true; }

  void all_reduce(float* data, size_t count, const Deadline& deadline) override {
    comm_.fail_if_broken();
    check_cuda(cudaSetDevice(comm_.device()), "cudaSetDevice");
    const std::string what =
        fmt::format("ncclAllReduce of {} f32 over ranks [{}]", count, fmt::join(members_, ", "));
    check_nccl(ncclAllReduce(data, data, count, ncclFloat32, ncclSum, comm_.comm(), comm_.stream()),
               what, comm_.comm());
    comm_.await_ready(deadline, what);
    check_cuda(cudaEventRecord(done_, comm_.stream()), "cudaEventRecord");
    cudaError_t rc = cudaErrorNotReady;
    const bool done = poll_until(deadline, [&] {
      comm_.check_async(what);
      rc = cudaEventQuery(done_);
      return rc != cudaErrorNotReady;
    });
    if (!done) {
      comm_.break_comm();
      fail_timeout(deadline,
                   fmt::format("the tensor-parallel ranks [{}]", fmt::join(members_, ", ")), what);
    }
    check_cuda(rc, what);
  }

 private:
  NcclComm comm_;
  cudaEvent_t done_ = nullptr;
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
  return std::make_unique<NcclTensorChannel>(members, my_rank, device, id, deadline);
}

std::unique_ptr<AllReduceGroup> make_nccl_all_reduce(const Communicator& comm,
                                                     std::vector<int> members, int device,
                                                     const Deadline& deadline) {
  std::vector<int32_t> id(kNcclIdBytes / sizeof(int32_t));
  MpiTensorChannel setup(comm, kGroupSetupTag);
  if (members.at(0) == comm.rank()) {
    const std::vector<std::byte> made = nccl_unique_id();
    std::memcpy(id.data(), made.data(), kNcclIdBytes);
    for (size_t k = 1; k < members.size(); ++k)
      setup.send(members[k], std::span<const int32_t>(id), deadline);
  } else {
    setup.recv(members[0], std::span<int32_t>(id), deadline);
  }
  return std::make_unique<NcclAllReduce>(
      std::move(members), comm.rank(), device,
      std::span<const std::byte>(reinterpret_cast<const std::byte*>(id.data()), kNcclIdBytes),
      deadline);
}

}  // namespace strata
