// The cluster's nodes as the planner sees them (placement/node.h): the node file in JSON and
// YAML and its refusals, the stage node an inventory gives (budgets given or the node's share,
// refused beyond what it has) and the decode step the planner balances, by hand.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "kernels/error.h"
#include "placement/node.h"

namespace strata {
namespace {

std::string refusal(const std::string& text) {
  try {
    NodeFile::parse(text, "nodes.json");
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

TEST(NodeFile, JsonAndYamlSayTheSame) {
  const NodeFile j = NodeFile::parse(R"({"nodes": [
      {"rank": 1, "device": "host", "gpu-mem": "1GiB", "cpu_mem": 2147483648, "threads": 2},
      {"host": "node-b", "disk-dir": "/nvme", "disk-mem": "300MiB", "disk-read-gbs": 3.5}]})",
                                     "nodes.json");
  const NodeFile y = NodeFile::parse(
      "# two nodes\nnodes:\n  - rank: 1\n    device: host\n    gpu-mem: 1GiB\n"
      "    cpu-mem: 2147483648\n    threads: 2\n  - host: \"node-b\"\n    disk-dir: /nvme\n"
      "    disk-mem: 300MiB   # the NVMe's share\n    disk-read-gbs: 3.5\n",
      "nodes.yaml");
  for (const NodeFile* f : {&j, &y}) {
    ASSERT_EQ(f->entries.size(), 2u);
    const NodeBudget& a = f->entries[0].budget;
    EXPECT_EQ(f->entries[0].rank, 1);
    EXPECT_EQ(a.device, "host");
    EXPECT_EQ(a.gpu_mem, int64_t{1} << 30);
    EXPECT_EQ(a.cpu_mem, int64_t{2} << 30);
    EXPECT_EQ(a.threads, 2);
    const NodeBudget& b = f->entries[1].budget;
    EXPECT_EQ(f->entries[1].host, "node-b");
    EXPECT_EQ(b.disk_dir, "/nvme");
    EXPECT_EQ(b.disk_mem, int64_t{300} << 20);
    EXPECT_DOUBLE_EQ(b.disk_read_gbs, 3.5);
    EXPECT_EQ(b.cpu_mem, -1);  // not given
  }
  EXPECT_EQ(j.max_rank(), 1);
  // By rank first, then by host; nothing for another.
  EXPECT_EQ(j.find(1, "node-b"), &j.entries[0]);
  EXPECT_EQ(j.find(2, "node-b"), &j.entries[1]);
  EXPECT_EQ(j.find(2, "node-c"), nullptr);
}

TEST(NodeFile, BadEntriesAreRefusedNamingTheEntryAndField) {
  EXPECT_NE(refusal(R"([{"rank": 1, "cpu-mem": "lots"}])").find("entry 1, cpu-mem"),
            std::string::npos);
  EXPECT_NE(refusal(R"([{"rank": 0}])").find("rank 0 coordinates"), std::string::npos);
  EXPECT_NE(refusal(R"([{"rank": 1, "host": "a"}])").find("either \"rank\""), std::string::npos);
  EXPECT_NE(refusal(R"([{"cpu-mem": "1GiB"}])").find("either \"rank\""), std::string::npos);
  EXPECT_NE(refusal(R"([{"rank": 1}, {"rank": 1}])").find("entry 2: rank 1 has an entry"),
            std::string::npos);
  EXPECT_NE(refusal(R"([{"rank": 1, "gpu_memory": 1}])").find("unknown key 'gpu_memory'"),
            std::string::npos);
  EXPECT_NE(refusal(R"([{"rank": 1, "device": "tpu"}])").find("device 'tpu'"), std::string::npos);
  EXPECT_NE(refusal(R"([{"rank": 1, "threads": 0}])").find("thread count"), std::string::npos);
  EXPECT_NE(refusal(R"([{"rank": 1, "disk-read-gbs": -2}])").find("positive"), std::string::npos);
  EXPECT_NE(refusal("[{\"rank\": 1,").find("not valid JSON"), std::string::npos);
  EXPECT_NE(refusal("[]").find("no node entries"), std::string::npos);
  EXPECT_NE(refusal("rank: 1\n").find("nodes.json:1"), std::string::npos);  // YAML, no '- '
}

NodeInventory inventory() {
  NodeInventory n;
  n.rank = 2;
  n.host = "node-b";
  n.compute = "cpu (avx2, 4 threads)";
  n.ranks_on_host = 2;
  n.host_available_bytes = int64_t{8} << 30;
  n.disk_dir = "/nvme";
  n.disk_free_bytes = int64_t{100} << 30;
  n.memory_read_gbs = 20;
  n.disk_read_gbs = 2;
  return n;
}

TEST(StageNode, BudgetsAreTheGivenOnesOrTheNodesShare) {
  NodeInventory n = inventory();
  StageNode s = stage_node(n);
  EXPECT_FALSE(s.device_compute);
  EXPECT_EQ(s.budgets.gpu, -1);                // no device
  EXPECT_EQ(s.budgets.cpu, int64_t{4} << 30);  // 8 GiB over two ranks
  EXPECT_EQ(s.budgets.disk, int64_t{50} << 30);
  EXPECT_TRUE(s.budgets.whole_stage);
  EXPECT_DOUBLE_EQ(s.compute_read_gbs, 20);
  n.budget.cpu_mem = int64_t{1} << 30;
  n.budget.memory_read_gbs = 5;  // pinned over the measured rate
  s = stage_node(n);
  EXPECT_EQ(s.budgets.cpu, int64_t{1} << 30);
  EXPECT_DOUBLE_EQ(s.compute_read_gbs, 5);
  // A real device: its free memory unless given, its memory rate for compute.
  n.device_compute = true;
  n.device_free_bytes = int64_t{24} << 30;
  n.device_memory_gbs = 900;
  n.host_to_device_gbs = 25;
  s = stage_node(n);
  EXPECT_EQ(s.budgets.gpu, int64_t{24} << 30);
  EXPECT_DOUBLE_EQ(s.compute_read_gbs, 900);
  EXPECT_DOUBLE_EQ(s.host_to_device_gbs, 25);
}

TEST(StageNode, ABudgetBeyondWhatTheNodeHasIsRefusedNamingIt) {
  NodeInventory n = inventory();
  n.budget.cpu_mem = int64_t{9} << 30;
  try {
    stage_node(n);
    FAIL() << "9 GiB on a node with 8 accepted";
  } catch (const InputError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("rank 2 on node-b: cpu-mem 9.00 GiB is more than its 8.00 GiB"),
              std::string::npos)
        << m;
  }
  n.budget.cpu_mem = -1;
  n.budget.disk_mem = int64_t{101} << 30;
  EXPECT_THROW(stage_node(n), InputError);
  // A CPU node ignores a --gpu-mem meant for the GPU nodes beside it.
  n.budget.disk_mem = -1;
  n.budget.gpu_mem = int64_t{80} << 30;
  EXPECT_NO_THROW(stage_node(n));
}

TEST(StageNode, InventoryRoundTripsThroughJson) {
  NodeInventory n = inventory();
  n.nccl_key = 77;
  n.budget.cpu_mem = 123;
  n.budget.device = "cpu";
  const NodeInventory back = NodeInventory::from_json(n.to_json(), "test");
  EXPECT_EQ(back.to_json(), n.to_json());
  nlohmann::json j = n.to_json();
  j.erase("disk_free_bytes");
  EXPECT_THROW(NodeInventory::from_json(j, "test"), InputError);
}

// Two host-compute layers of 1 MB with a KV cache of 0.5 MB a layer (K and V 0.25 MB each),
// 0.2 MB fixed, one layer on disk.
StagePlacement placed(bool device) {
  StagePlacement p;
  p.device_compute = device;
  p.weights.device_compute = device;
  p.weights.fixed_bytes = 200'000;
  p.weights.layer_bytes = 1'000'000;
  p.weights.tiers = {device ? Tier::kGpu : Tier::kCpu, Tier::kDisk};
  p.cache.layer_bytes = 250'000;
  p.cache.tiers = {Tier::kGpu, Tier::kGpu};
  return p;
}

TEST(StageNode, DecodeStepIsTheLongerOfComputeAndDiskReads) {
  StageNode n;
  n.compute_read_gbs = 10;
  n.disk_read_gbs = 0.5;
  // Compute reads 0.2 + 2 x 1 + 2 x 0.5 = 3.2 MB at 10 GB/s: 320 us; the disk 1 MB at
  // 0.5 GB/s: 2 ms, the longer.
  EXPECT_NEAR(decode_step_seconds(placed(false), n), 2e-3, 1e-12);
  n.disk_read_gbs = 5;  // 200 us: compute is the longer
  EXPECT_NEAR(decode_step_seconds(placed(false), n), 320e-6, 1e-12);
  // On a device the disk layer also crosses to it: 1 MB at 1 GB/s more.
  n.host_to_device_gbs = 1;
  EXPECT_NEAR(decode_step_seconds(placed(true), n), 200e-6 + 1e-3, 1e-12);
}

}  // namespace
}  // namespace strata
