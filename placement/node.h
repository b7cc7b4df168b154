// A cluster's nodes as the planner sees them (docs/CLUSTER.md, "Unequal nodes"): what each
// worker rank has and measured (NodeInventory), what the operator lets it use (NodeBudget:
// the command line's flags, overridden by the allocation's Slurm limits and by a node file
// entry), and the two together as one stage's hardware (StageNode). The planner
// (coordinator/plan/cluster_plan.h) places every stage under its own StageNode; nothing is
// assumed from rank 0's machine.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

#include "placement/stage_placement.h"

namespace strata {

// What the operator gives one node. Sizes in bytes, < 0: not given (the node's own).
struct NodeBudget {
  std::string device;  // auto, cpu, host, cuda, cuda:N (empty: not given)
  int64_t gpu_mem = -1;
  int64_t cpu_mem = -1;
  int64_t disk_mem = -1;
  std::string disk_dir;  // empty: not given
  int threads = 0;       // 0: not given
  // Rates the operator pins instead of the node's measured ones (GB/s; 0: measured).
  double memory_read_gbs = 0;
  double disk_read_gbs = 0;
  double host_to_device_gbs = 0;
  double device_memory_gbs = 0;

  // `over`'s given fields replace these.
  NodeBudget overridden_by(const NodeBudget& over) const;
  nlohmann::json to_json() const;
  std::string str() const;
  bool operator==(const NodeBudget&) const = default;
};

// A node file (--nodes FILE): one entry per rank ("rank": N) or per host ("host": NAME, every
// rank on it), each with device, gpu-mem, cpu-mem, disk-mem, disk-dir, threads and optionally
// pinned rates (memory-read-gbs, disk-read-gbs, host-to-device-gbs, device-memory-gbs). JSON
// (an array, or {"nodes": [...]}) or the same as YAML's block list of flat maps. Sizes are
// numbers of bytes or strings as the flags take them ("2GiB").
struct NodeEntry {
  int rank = -1;     // -1: by host
  std::string host;  // empty: by rank
  NodeBudget budget;
};

struct NodeFile {
  std::string path;
  std::vector<NodeEntry> entries;

  // Throws InputError naming the file, the entry and the field: an unknown key, a size that
  // does not parse, a rank below 1 (rank 0 coordinates), an entry naming neither or both a
  // rank and a host, two entries for one rank or host.
  static NodeFile load(const std::string& path);
  static NodeFile parse(const std::string& text, const std::string& source);
  // The entry for `rank` on `host`: by rank first, then by host; nullptr: none.
  const NodeEntry* find(int rank, const std::string& host) const;
  // The highest rank an entry names (0: none names one).
  int max_rank() const;
};

// What a rank has, as it measured itself before any plan (worker/node_probe.h).
struct NodeInventory {
  int rank = 0;
  std::string host;
  bool device_compute = false;  // what this rank computes on: a device (or its stand-in)
  std::string compute;          // "cuda:0 NVIDIA H200 (132 SMs)", "cpu (avx512, 2 threads)"
  int threads = 0;
  std::string isa;
  int ranks_on_host = 1;             // worker ranks sharing this host's memory and disk
  int nccl_key = 0;                  // transport/tensor_channel.h device_key: 0 for no CUDA device
  int64_t device_free_bytes = -1;    // < 0: no device (a stand-in has none of its own)
  int64_t host_available_bytes = 0;  // MemAvailable
  std::string disk_dir;
  int64_t disk_free_bytes = 0;  // statvfs of disk_dir, for unprivileged users
  bool o_direct = false;        // the disk_dir's filesystem takes O_DIRECT
  // Measured: host memory read with `threads` threads, O_DIRECT disk read, host -> device
  // over page-locked memory and device memory (0: not measured / no device).
  double memory_read_gbs = 0;
  double disk_read_gbs = 0;
  double host_to_device_gbs = 0;
  double device_memory_gbs = 0;
  NodeBudget budget;  // what the operator gave this rank (flags, Slurm, node file)

  nlohmann::json to_json() const;
  // Every field required; errors name `source` and the field.
  static NodeInventory from_json(const nlohmann::json& j, const std::string& source);
  std::string str() const;
};

// One stage's hardware as the planner uses it: the compute tier, the whole-stage budget of
// each tier (< 0: no limit) and the rates its cost is estimated with.
struct StageNode {
  int rank = 0;
  std::string name;  // "rank 2 on node-b (cpu (avx2, 1 threads))"
  bool device_compute = false;
  int nccl_key = 0;  // its CUDA device for NCCL (0: none; a key two ranks share: none)
  TierBudgets budgets{-1, -1, -1, true};
  std::string disk_dir;
  double compute_read_gbs = 0;  // the compute tier's memory read rate: a decode's bound
  double disk_read_gbs = 0;
  double host_to_device_gbs = 0;

  std::string str() const;
};

// A decode step's seconds for a stage placed as `p` on `node` (the planner's balance, not a
// prediction of the run): the compute tier reads every weight and the whole KV cache once
// (bytes / compute_read_gbs), while disk-tier weights and cache come from the disk
// (disk_read_gbs) and, on a device, every layer off it crosses to it (host_to_device_gbs); the
// reads overlap the compute (FlexGen's prefetch), so the step takes the longer of the two.
// A rate of 0 (unknown) counts as 1 GB/s.
double decode_step_seconds(const StagePlacement& p, const StageNode& node);

// The stage node of an inventory: the budgets given, or where none is, the node's share of
// what it has (its available host memory, free device memory and disk space divided among
// the worker ranks on its host). Throws InputError naming the node when a budget given is
// larger than what the node has, or the device is asked for on a node without one.
StageNode stage_node(const NodeInventory& inventory);

}  // namespace strata
