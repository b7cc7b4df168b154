// A cluster rank's node before any plan (docs/CLUSTER.md, "Unequal nodes"): its budget --
// the command line's flags, over the Slurm allocation's limits as defaults, under a node
// file's entry for the rank or its host -- the engine options it computes with under that
// budget, and every worker's inventory gathered to rank 0, which plans each stage for it.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "coordinator/run/coordinator.h"
#include "launch/commands.h"
#include "placement/node.h"
#include "transport/mpi_session.h"
#include "worker/node_probe.h"

namespace strata::cli {

// The budget the flags give every rank (--device, --gpu-mem, --cpu-mem, --disk-mem,
// --disk-dir, --threads); under a cluster the memory budgets bound a stage's weights, KV
// cache and buffers together.
NodeBudget flag_budget(const EngineOptions& o);
// Slurm's limits for one of `ranks_on_host` ranks on this node: SLURM_MEM_PER_NODE, or
// SLURM_MEM_PER_CPU x SLURM_CPUS_ON_NODE (MiB), at most the node's MemAvailable, shared by
// the ranks; nothing outside Slurm.
// (CUDA_VISIBLE_DEVICES needs no reading: the CUDA runtime shows this rank those devices
// alone, so --device auto finds what the allocation gave.)
NodeBudget slurm_budget(int ranks_on_host);
// Slurm's defaults, the flags over them, the node file's entry (if any) over both.
NodeBudget resolve_budget(const EngineOptions& o, const std::optional<NodeFile>& nodes, int rank,
                          const std::string& host, int ranks_on_host);
// The engine options a worker computes with under `b`: its device, threads and disk folder.
EngineOptions engine_for(const EngineOptions& o, const NodeBudget& b);

// Every worker's inventory, in rank order (ranks 1..N-1), at every rank: rank 0 passes
// none of its own. Collective over `world`, within the deadline.
std::vector<NodeInventory> exchange_inventories(const Communicator& world,
                                                const std::optional<NodeInventory>& mine,
                                                const Deadline& deadline);
// The stage nodes the planner places for; InputError naming the node whose budget is more
// than it has.
std::vector<StageNode> stage_nodes(const std::vector<NodeInventory>& workers);

// What a rank computing as `engine` says measures of itself: `cuda_device` its CUDA index
// (-1: none; --device host stands in for one), `device` that device's backend to measure
// (nullptr: not measured), its device key for NCCL from `host`.
NodeProbeRequest probe_request(const EngineOptions& engine, int rank, const std::string& host,
                               int ranks_on_host, const NodeBudget& budget, int cuda_device,
                               Backend* device, bool remeasure);

// The inventories of ranks 1..workers as if each ran on this machine under its entry of
// `file` (by rank, or by this host's name) over the flags: `strata plan --nodes` plans from
// them without a cluster. Free memory and disk are this machine's; the rates are read from
// this machine's cache (measured there when absent), as its workers would read them.
std::vector<NodeInventory> local_inventories(const EngineOptions& e, const NodeFile& file,
                                             int workers, bool remeasure);

// What a cluster run's first plan depends on, from the engine's options and the cluster's:
// the model, the KV slots (a policy's block, or --max-batch), the step rows, the context,
// --stage-mem, the policy, S3's packing and the nodes. `serve` adds its run's own options;
// `strata plan --nodes` prints the plan these give (run_plan_options), the same one.
CoordinatorOptions planned_run(const EngineOptions& e, int micro_batches, int max_context,
                               const std::string& stage_mem, std::vector<StageNode> nodes);

// Where the nodes' measured rates are kept: beside the layer profiles.
std::string node_cache_dir();

}  // namespace strata::cli
