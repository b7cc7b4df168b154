#include "worker/tensor_parallel.h"

#include "kernels/error.h"

namespace strata {

GroupBlockReduce::GroupBlockReduce(Backend& backend, AllReduceGroup& group, double timeout_s)
    : backend_(backend), group_(group), timeout_s_(timeout_s) {}

void GroupBlockReduce::sum(float* data, int64_t count) {
  STRATA_CHECK(count >= 0, "sum of {} floats", count);
  const auto n = static_cast<size_t>(count);
  const Deadline deadline = Deadline::after_seconds(timeout_s_);
  const bool host_data = backend_.device() == Device::kHost;
  if (group_.device_buffers() || host_data) {
    backend_.synchronize();  // the group's stream (or MPI) reads what the kernels wrote
    group_.all_reduce(data, n, deadline);
    return;
  }
  if (staging_.size() < n * sizeof(float))
    staging_ = DeviceBuffer::host(backend_, n * sizeof(float));
  backend_.copy(staging_.data(), data, n * sizeof(float), CopyKind::kDeviceToHost);
  group_.all_reduce(staging_.f32(), n, deadline);
  backend_.copy(data, staging_.data(), n * sizeof(float), CopyKind::kHostToDevice);
}

}  // namespace strata
