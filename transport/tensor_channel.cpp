#include "transport/tensor_channel.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <utility>

#include "kernels/accelerator.h"
#include "kernels/error.h"
#include "kernels/log.h"
#include "transport/control_channel.h"
#include "transport/nccl_channel.h"

namespace strata {

// ---- Transfer ----

Transfer::Transfer(Transfer&& other) noexcept
    : channel_(std::exchange(other.channel_, nullptr)), op_(other.op_), handle_(other.handle_) {}

Transfer& Transfer::operator=(Transfer&& other) noexcept {
  if (this != &other) {
    cancel();
    channel_ = std::exchange(other.channel_, nullptr);
    op_ = other.op_;
    handle_ = other.handle_;
  }
  return *this;
}

Transfer::~Transfer() {
  cancel();
}

void Transfer::cancel() noexcept {
  if (channel_ != nullptr) channel_->cancel(handle_, op_);
  channel_ = nullptr;
}

bool Transfer::test() {
  if (channel_ == nullptr) return true;
  bool done = false;
  try {
    done = channel_->poll(handle_, op_);
  } catch (...) {
    channel_ = nullptr;  // the implementation released the request when it threw
    throw;
  }
  if (done) channel_ = nullptr;
  return done;
}

void Transfer::wait(const Deadline& deadline) {
  if (poll_until(deadline, [&] { return test(); })) return;
  const std::string what = str();
  cancel();
  fail_timeout(deadline, rank_name(op_.peer), what);
}

std::string Transfer::str() const {
  return fmt::format("{} of {} {} {} rank {}", op_.is_send ? "send" : "receive", op_.count,
                     dtype_name(op_.dtype), op_.is_send ? "to" : "from", op_.peer);
}

// ---- TensorChannel ----

Transfer TensorChannel::start_send(int peer, std::span<const float> data) {
  return start(Op{true, peer, const_cast<float*>(data.data()), data.size(), DType::kF32});
}
Transfer TensorChannel::start_send(int peer, std::span<const int32_t> data) {
  return start(Op{true, peer, const_cast<int32_t*>(data.data()), data.size(), DType::kI32});
}
Transfer TensorChannel::start_recv(int peer, std::span<float> data) {
  return start(Op{false, peer, data.data(), data.size(), DType::kF32});
}
Transfer TensorChannel::start_recv(int peer, std::span<int32_t> data) {
  return start(Op{false, peer, data.data(), data.size(), DType::kI32});
}
void TensorChannel::send(int peer, std::span<const float> data, const Deadline& deadline) {
  start_send(peer, data).wait(deadline);
}
void TensorChannel::send(int peer, std::span<const int32_t> data, const Deadline& deadline) {
  start_send(peer, data).wait(deadline);
}
void TensorChannel::recv(int peer, std::span<float> data, const Deadline& deadline) {
  start_recv(peer, data).wait(deadline);
}
void TensorChannel::recv(int peer, std::span<int32_t> data, const Deadline& deadline) {
  start_recv(peer, data).wait(deadline);
}

// ---- MpiTensorChannel ----

namespace {

// MPI_Request is a handle type (a pointer in Open MPI, an int in MPICH); it is kept in the
// Transfer's integer slot so Transfer needs no allocation and no MPI type in its layout.
static_assert(sizeof(MPI_Request) <= sizeof(uintptr_t));

MPI_Request to_request(uintptr_t handle) {
  MPI_Request r;
  std::memcpy(&r, &handle, sizeof(r));
  return r;
}

uintptr_t to_handle(MPI_Request r) {
  uintptr_t handle = 0;
  std::memcpy(&handle, &r, sizeof(r));
  return handle;
}

MPI_Datatype mpi_type(DType dtype) {
  return dtype == DType::kI32 ? MPI_INT32_T : MPI_FLOAT;
}

}  // namespace

MpiTensorChannel::MpiTensorChannel(const Communicator& comm, int tag) : comm_(comm), tag_(tag) {
  STRATA_CHECK(comm.valid(), "tensor channel on a null communicator");
}

uintptr_t MpiTensorChannel::post(const Op& op) {
  STRATA_CHECK(op.dtype == DType::kF32 || op.dtype == DType::kI32, "{}", dtype_name(op.dtype));
  // MPI counts are int; an activation buffer of 2^31 elements would be 8 GiB per step.
  STRATA_CHECK(op.count <= static_cast<size_t>(INT_MAX), "{} elements", op.count);
  const int count = static_cast<int>(op.count);
  MPI_Request request = MPI_REQUEST_NULL;
  if (op.is_send) {
    check_mpi(
        MPI_Isend(op.data, count, mpi_type(op.dtype), op.peer, tag_, comm_.native(), &request),
        fmt::format("MPI_Isend to rank {}", op.peer));
  } else {
    check_mpi(
        MPI_Irecv(op.data, count, mpi_type(op.dtype), op.peer, tag_, comm_.native(), &request),
        fmt::format("MPI_Irecv from rank {}", op.peer));
  }
  return to_handle(request);
}

bool MpiTensorChannel::poll(uintptr_t& handle, const Op& op) {
  MPI_Request request = to_request(handle);
  MPI_Status status{};
  int flag = 0;
  const int rc = MPI_Test(&request, &flag, &status);
  handle = to_handle(request);
  if (rc != MPI_SUCCESS) {
    abandon_request(request);
    handle = to_handle(request);
    check_mpi(rc, fmt::format("{} {} rank {}", op.is_send ? "send to" : "receive from", op.count,
                              op.peer));
  }
  if (!flag || op.is_send) return flag != 0;
  int got = 0;
  check_mpi(MPI_Get_count(&status, mpi_type(op.dtype), &got), "MPI_Get_count");
  if (static_cast<size_t>(got) != op.count) {
    fail(ErrorKind::kFailed, "rank {} sent {} {} where {} were expected", op.peer, got,
         dtype_name(op.dtype), op.count);
  }
  return true;
}

void MpiTensorChannel::cancel(uintptr_t& handle, const Op&) noexcept {
  MPI_Request request = to_request(handle);
  abandon_request(request);
  handle = to_handle(request);
}

// ---- TensorLinks ----

// A rank takes part in NCCL when it computes on a device the runtime can see and NCCL is
// in this binary; anything else (no driver, no device, CPU build) falls back to MPI. The
// key names the GPU: its host and PCI bus id.
int device_key(int local_device, const std::string& host) {
  if (local_device < 0 || !nccl_built()) return 0;
  const AcceleratorInfo info = probe_accelerators();
  if (local_device < static_cast<int>(info.devices.size()))
    return name_key(host + "/" + info.devices[static_cast<size_t>(local_device)].pci_bus_id);
  log::get("transport")
      ->warn("device {} requested but not usable ({}); activations go over MPI", local_device,
             info.reason.empty() ? "no such device" : info.reason);
  return 0;
}

std::vector<int> nccl_members(std::span<const int> device_keys) {
  std::vector<int> members;
  for (size_t r = 0; r < device_keys.size(); ++r) {
    const int key = device_keys[r];
    if (key != 0 && std::count(device_keys.begin(), device_keys.end(), key) == 1)
      members.push_back(static_cast<int>(r));
  }
  if (members.size() < 2) members.clear();  // NCCL needs two ends
  return members;
}

TensorLinks TensorLinks::create(const Communicator& comm, int local_device,
                                const Deadline& deadline) {
  TensorLinks links;
  links.rank_ = comm.rank();
  links.mpi_ = std::make_unique<MpiTensorChannel>(comm);
  const int key = device_key(local_device, processor_name());
  const std::vector<int> keys = comm.allgather(key, deadline, "which ranks have GPUs");
  const std::vector<int> members = nccl_members(keys);
  links.gpu_.assign(keys.size(), 0);
  for (int r : members) links.gpu_[static_cast<size_t>(r)] = 1;
  if (key != 0 && std::count(keys.begin(), keys.end(), key) > 1)
    log::get("transport")
        ->warn(
            "rank {} shares its GPU (cuda:{}) with another rank; NCCL needs one GPU per "
            "rank, so its activations go over MPI",
            links.rank_, local_device);
  if (members.empty()) return links;
  // Every rank takes part in the broadcast of the unique id (a collective on comm); only
  // the GPU ranks use it.
  std::vector<std::byte> id(kNcclIdBytes);
  if (links.rank_ == members.front()) id = nccl_unique_id();
  comm.broadcast(id, members.front(), deadline, "the NCCL unique id");
  if (links.gpu(links.rank_)) {
    links.nccl_ = make_nccl_channel(members, links.rank_, local_device, id, deadline);
  }
  return links;
}

TensorChannel& TensorLinks::to(int peer) {
  STRATA_CHECK(peer >= 0 && peer < static_cast<int>(gpu_.size()), "peer {} of {}", peer,
               gpu_.size());
  if (nccl_ && gpu(peer) && gpu(rank_)) return *nccl_;
  return *mpi_;
}

std::string TensorLinks::str() const {
  std::vector<int> members;
  for (size_t r = 0; r < gpu_.size(); ++r) {
    if (gpu_[r]) members.push_back(static_cast<int>(r));
  }
  if (members.empty()) return "all links over MPI";
  return fmt::format("NCCL between ranks {}; MPI otherwise", members);
}

}  // namespace strata
