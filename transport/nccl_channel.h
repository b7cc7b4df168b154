// The NCCL tensor channel: ncclSend / ncclRecv between GPU workers on one communicator
// over all of them, set up with ncclCommInitRankConfig (non-blocking, so the set-up too
// has a deadline) from a unique id broadcast over MPI (TensorLinks::create). Built when
// CUDA is (STRATA_HAVE_NCCL); without it these functions say so with kUnimplemented.
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <vector>

#include "transport/tensor_channel.h"

namespace strata {

inline constexpr size_t kNcclIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES, checked where built

bool nccl_built();
std::vector<std::byte> nccl_unique_id();

// members: the world ranks in the NCCL communicator, in NCCL rank order; my_rank is one of
// them. Peers passed to the channel's send/recv are world ranks.
std::unique_ptr<TensorChannel> make_nccl_channel(const std::vector<int>& members, int my_rank,
                                                 int device, std::span<const std::byte> id,
                                                 const Deadline& deadline);

}  // namespace strata
