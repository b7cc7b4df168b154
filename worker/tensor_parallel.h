// A tensor-parallel stage's sum of partial block outputs (ExeGPT's partial tensor
// parallelism; the split is Megatron's): each member of the group computes its heads' share
// of attention and its columns' share of the MLP, and after each block half the group adds
// the shares up, so every member's residual stream stays the whole model's. The transformer
// calls BlockReduce::sum; this file binds it to a transport group (transport/all_reduce.h)
// and the compute backend's memory.
#pragma once

#include <cstdint>

#include "kernels/backend.h"
#include "transport/all_reduce.h"

namespace strata {

class BlockReduce {
 public:
  virtual ~BlockReduce() = default;
  // Sums `data` [count] (the compute backend's memory, written by its last kernels) over
  // the group, in place.
  virtual void sum(float* data, int64_t count) = 0;
};

// Over `group`: in place on the device for NCCL (after the compute stream is drained), and
// through page-locked host memory when the group is MPI but the backend computes on a
// device. Each sum is bounded by `timeout_s`.
class GroupBlockReduce final : public BlockReduce {
 public:
  GroupBlockReduce(Backend& backend, AllReduceGroup& group, double timeout_s);
  void sum(float* data, int64_t count) override;

 private:
  Backend& backend_;
  AllReduceGroup& group_;
  double timeout_s_;
  DeviceBuffer staging_;  // host memory of a device backend's sums over MPI
};

}  // namespace strata
