// Which ranks exchange activations over NCCL: only GPU ranks on distinct GPUs, and only when
// at least two remain (NCCL rejects two ranks of one communicator on the same device).
#include <gtest/gtest.h>

#include "transport/mpi_session.h"
#include "transport/tensor_channel.h"

namespace strata {
namespace {

TEST(NcclMembers, GpuRanksOnDistinctDevicesTakePart) {
  EXPECT_EQ(nccl_members(std::vector<int>{0, 11, 12, 13}), (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(nccl_members(std::vector<int>{0, 11, 0, 13}), (std::vector<int>{1, 3}));
}

TEST(NcclMembers, RanksSharingAGpuStayOnMpi) {
  // Ranks 1 and 2 on one GPU, rank 3 on another: NCCL would refuse 1 and 2, and 3 alone
  // has nobody to talk to.
  EXPECT_TRUE(nccl_members(std::vector<int>{0, 11, 11, 13}).empty());
  EXPECT_EQ(nccl_members(std::vector<int>{0, 11, 11, 13, 14}), (std::vector<int>{3, 4}));
}

TEST(NcclMembers, FewerThanTwoGpuRanksMeansNone) {
  EXPECT_TRUE(nccl_members(std::vector<int>{}).empty());
  EXPECT_TRUE(nccl_members(std::vector<int>{0, 0, 0}).empty());
  EXPECT_TRUE(nccl_members(std::vector<int>{0, 7}).empty());
}

TEST(NameKey, IsNonZeroStableAndTellsNamesApart) {
  // Ranks on different hosts compare keys, so the key must not depend on the process: it
  // is 32-bit FNV-1a with the sign bit cleared. The expected values are the FNV reference
  // test vectors (draft-eastlake-fnv, "FNV-1a 32": "" 0x811c9dc5, "a" 0xe40c292c,
  // "foobar" 0xbf9cf968), not this function's output.
  EXPECT_EQ(name_key(""), static_cast<int>(0x811c9dc5u & 0x7fffffffu));
  EXPECT_EQ(name_key("a"), static_cast<int>(0xe40c292cu & 0x7fffffffu));
  EXPECT_EQ(name_key("foobar"), static_cast<int>(0xbf9cf968u & 0x7fffffffu));
  EXPECT_NE(name_key("node7/0000:3b:00.0"), name_key("node7/0000:3c:00.0"));
  EXPECT_NE(name_key("node7/0000:3b:00.0"), name_key("node8/0000:3b:00.0"));
  for (const char* s : {"", "a", "node1", "0000:00:00.0"}) {
    EXPECT_GT(name_key(s), 0) << s;
  }
}

}  // namespace
}  // namespace strata
