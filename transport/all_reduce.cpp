#include "transport/all_reduce.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "kernels/error.h"

namespace strata {

AllReduceGroup::AllReduceGroup(std::vector<int> members, int my_rank)
    : members_(std::move(members)) {
  const auto it = std::find(members_.begin(), members_.end(), my_rank);
  STRATA_CHECK(members_.size() >= 2 && it != members_.end(),
               "rank {} in a tensor-parallel group [{}]", my_rank, fmt::join(members_, ", "));
  index_ = static_cast<int>(it - members_.begin());
}

std::string AllReduceGroup::str() const {
  return fmt::format("{} all-reduce over ranks [{}], shard {}", name(), fmt::join(members_, ", "),
                     index_);
}

namespace {

// Each member sends its partial to every other and receives theirs, then adds all of them
// in shard order, so every member computes the same sum bit for bit. For the small groups
// of partial tensor parallelism (degree 2 to 4) one exchange beats a ring's 2(d-1) steps.
class MpiAllReduce final : public AllReduceGroup {
 public:
  MpiAllReduce(const Communicator& comm, std::vector<int> members)
      : AllReduceGroup(std::move(members), comm.rank()), channel_(comm, kAllReduceTag) {}

  const char* name() const override { return "mpi"; }
  bool device_buffers() const override { return false; }

  void all_reduce(float* data, size_t count, const Deadline& deadline) override {
    const size_t d = members_.size();
    if (gathered_.size() < d * count) gathered_.resize(d * count);
    std::vector<Transfer> transfers;
    transfers.reserve(2 * (d - 1));
    for (size_t k = 0; k < d; ++k) {
      if (static_cast<int>(k) == index_) continue;
      transfers.push_back(
          channel_.start_recv(members_[k], std::span<float>(gathered_.data() + k * count, count)));
    }
    for (size_t k = 0; k < d; ++k) {
      if (static_cast<int>(k) == index_) continue;
      transfers.push_back(channel_.start_send(members_[k], std::span<const float>(data, count)));
    }
    for (Transfer& t : transfers) t.wait(deadline);
    const auto part = [&](size_t k) {
      return static_cast<int>(k) == index_ ? data : gathered_.data() + k * count;
    };
    for (size_t j = 0; j < count; ++j) {
      float sum = part(0)[j];
      for (size_t k = 1; k < d; ++k) sum += part(k)[j];
      data[j] = sum;
    }
  }

 private:
  MpiTensorChannel channel_;
  std::vector<float> gathered_;  // every member's partial, in shard order (ours unused)
};

}  // namespace

std::unique_ptr<AllReduceGroup> make_mpi_all_reduce(const Communicator& comm,
                                                    std::vector<int> members) {
  return std::make_unique<MpiAllReduce>(comm, std::move(members));
}

}  // namespace strata
