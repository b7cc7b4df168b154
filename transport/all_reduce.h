// The all-reduce of a tensor-parallel group (ExeGPT's partial tensor parallelism, split as
// Megatron splits a layer): after each block half every member holds a partial sum of the
// block's output, and the group adds them up. Two implementations: MPI (host buffers,
// always built, between CPU workers or GPUs without NCCL) and NCCL (device buffers, built
// with CUDA, between members on distinct GPUs).
//
// Every member must end with the same bits, or the members' residual streams would drift
// apart: the MPI group gathers every partial and adds them in shard order on each member,
// and NCCL's all-reduce gives every rank the one reduced result.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "transport/tensor_channel.h"

namespace strata {

inline constexpr int kAllReduceTag = kTensorTag + 2;   // the group's partial sums
inline constexpr int kGroupSetupTag = kTensorTag + 3;  // the leader's NCCL id to its members

class AllReduceGroup {
 public:
  virtual ~AllReduceGroup() = default;
  virtual const char* name() const = 0;  // "mpi", "nccl"
  // Whether `data` must be in accelerator memory (NCCL) rather than host memory (MPI).
  virtual bool device_buffers() const = 0;
  // Sums `data` [count] over the group in place. A member that has not taken part by the
  // deadline: Error(kDisconnected) naming its rank.
  virtual void all_reduce(float* data, size_t count, const Deadline& deadline) = 0;
  std::string str() const;  // "mpi all-reduce over ranks [2, 3], shard 0"

  const std::vector<int>& members() const { return members_; }
  int index() const { return index_; }

 protected:
  AllReduceGroup(std::vector<int> members, int my_rank);
  std::vector<int> members_;  // world ranks in shard order
  int index_ = -1;            // this rank's place among them
};

// MPI point-to-point on its own tag over `comm` (which must outlive the group; it may be
// used from another thread at the same time: MPI_THREAD_MULTIPLE).
std::unique_ptr<AllReduceGroup> make_mpi_all_reduce(const Communicator& comm,
                                                    std::vector<int> members);

// NCCL over the members' GPUs: the first member makes the NCCL id and sends it to the
// others over MPI (kGroupSetupTag), then all of them join, bounded by the deadline.
// kUnimplemented in a build without NCCL.
std::unique_ptr<AllReduceGroup> make_nccl_all_reduce(const Communicator& comm,
                                                     std::vector<int> members, int device,
                                                     const Deadline& deadline);

}  // namespace strata
