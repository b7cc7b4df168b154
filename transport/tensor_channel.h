// The data plane: contiguous f32 / i32 buffers between two ranks (activations [rows,
// hidden] from stage to stage; token ids). The receiver knows the size in advance (the
// step command says how many rows), so buffers are fixed and nothing is framed or
// allocated per transfer. Two implementations: MPI (host buffers, always built) and NCCL
// (device buffers, built with CUDA, used only when both ends are GPU workers).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kernels/dtype.h"
#include "transport/mpi_session.h"

namespace strata {

inline constexpr int kTensorTag = 0x5c02;

class TensorChannel;

// One posted send or receive. Move-only; destroying a pending one cancels it (the buffer
// must stay valid until it completes or is destroyed).
class Transfer {
 public:
  Transfer() = default;
  Transfer(Transfer&& other) noexcept;
  Transfer& operator=(Transfer&& other) noexcept;
  Transfer(const Transfer&) = delete;
  Transfer& operator=(const Transfer&) = delete;
  ~Transfer();

  bool pending() const { return channel_ != nullptr; }
  // True once complete; throws on a transport error or a size mismatch.
  bool test();
  // Waits for completion; at the deadline cancels and throws Error(kDisconnected) naming
  // the peer and the buffer ("receive of 4096 f32 from rank 2").
  void wait(const Deadline& deadline);
  std::string str() const;

  struct Op {
    bool is_send = false;
    int peer = -1;
    void* data = nullptr;
    size_t count = 0;  // elements
    DType dtype = DType::kF32;
  };

 private:
  friend class TensorChannel;
  Transfer(TensorChannel* channel, const Op& op, uintptr_t handle)
      : channel_(channel), op_(op), handle_(handle) {}
  void cancel() noexcept;

  TensorChannel* channel_ = nullptr;  // null when complete or empty
  Op op_;
  uintptr_t handle_ = 0;  // the implementation's request (an MPI_Request, an event slot)
};

class TensorChannel {
 public:
  virtual ~TensorChannel() = default;
  virtual const char* name() const = 0;  // "mpi", "nccl"
  // Whether buffers must be in accelerator memory (NCCL) rather than host memory (MPI).
  virtual bool device_buffers() const = 0;

  Transfer start_send(int peer, std::span<const float> data);
  Transfer start_send(int peer, std::span<const int32_t> data);
  Transfer start_recv(int peer, std::span<float> data);
  Transfer start_recv(int peer, std::span<int32_t> data);

  void send(int peer, std::span<const float> data, const Deadline& deadline);
  void send(int peer, std::span<const int32_t> data, const Deadline& deadline);
  // The sender must send exactly data.size() elements; any other count is an Error.
  void recv(int peer, std::span<float> data, const Deadline& deadline);
  void recv(int peer, std::span<int32_t> data, const Deadline& deadline);

 protected:
  friend class Transfer;
  using Op = Transfer::Op;
  Transfer start(const Op& op) { return Transfer(this, op, post(op)); }
  virtual uintptr_t post(const Op& op) = 0;
  // True once the operation is complete; throws on failure.
  virtual bool poll(uintptr_t& handle, const Op& op) = 0;
  virtual void cancel(uintptr_t& handle, const Op& op) noexcept = 0;
};

// MPI point-to-point on its own tag. `comm` must outlive the channel.
class MpiTensorChannel final : public TensorChannel {
 public:
  explicit MpiTensorChannel(const Communicator& comm, int tag = kTensorTag);
  const char* name() const override { return "mpi"; }
  bool device_buffers() const override { return false; }

 protected:
  uintptr_t post(const Op& op) override;
  bool poll(uintptr_t& handle, const Op& op) override;
  void cancel(uintptr_t& handle, const Op& op) noexcept override;

 private:
  const Communicator& comm_;
  int tag_;
};

// Which ranks form the NCCL communicator, from each rank's device key (0: no usable GPU;
// otherwise name_key of its host and GPU bus id). NCCL refuses two ranks on one GPU, so a
// key held by several ranks leaves all of them on MPI; fewer than two members: none.
std::vector<int> nccl_members(std::span<const int> device_keys);
// A rank's device key: 0 where it computes on no CUDA device (local_device < 0) or NCCL is
// not in this binary; otherwise name_key of `host` and the device's PCI bus id.
int device_key(int local_device, const std::string& host);

// The channel to use for each peer: NCCL when both ends are GPU workers on distinct GPUs
// and NCCL is built, MPI otherwise.
class TensorLinks {
 public:
  // Collective over `comm`. local_device: the CUDA device this rank computes on, or -1 for
  // a CPU rank; a device that the runtime cannot see counts as CPU (gated at run time), and
  // so does one that another rank computes on too.
  static TensorLinks create(const Communicator& comm, int local_device, const Deadline& deadline);

  TensorChannel& to(int peer);
  bool gpu(int rank) const { return gpu_[static_cast<size_t>(rank)] != 0; }
  std::string str() const;  // "ranks with NCCL: [1, 2]; MPI otherwise"

 private:
  TensorLinks() = default;
  int rank_ = -1;
  std::vector<int> gpu_;  // per rank: 1 when it takes part in NCCL
  std::unique_ptr<TensorChannel> mpi_;
  std::unique_ptr<TensorChannel> nccl_;
};

}  // namespace strata
