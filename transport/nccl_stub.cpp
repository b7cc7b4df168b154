// Without CUDA there is no NCCL: TensorLinks never asks for it (nccl_built() is false).
#include "kernels/error.h"
#include "transport/all_reduce.h"
#include "transport/nccl_channel.h"

namespace strata {

bool nccl_built() {
  return false;
}

std::vector<std::byte> nccl_unique_id() {
  fail(ErrorKind::kUnimplemented, "this binary was built without NCCL");
}

std::unique_ptr<TensorChannel> make_nccl_channel(const std::vector<int>&, int, int,
                                                 std::span<const std::byte>, const Deadline&) {
  fail(ErrorKind::kUnimplemented, "this binary was built without NCCL");
}

std::unique_ptr<AllReduceGroup> make_nccl_all_reduce(const Communicator&, std::vector<int>, int,
                                                     const Deadline&) {
  fail(ErrorKind::kUnimplemented, "this binary was built without NCCL");
}

}  // namespace strata
