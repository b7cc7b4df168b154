// A cluster rank's node before any plan (docs/CLUSTER.md, "Unequal nodes"): its budget --
// the command line's flags, over the Slurm allocation's limits as defaults, under a node
// file's entry for the rank or its host -- the engine options it computes with under that
// budget, and every worker's inventory gathered to rank 0, which plans each stage for it.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "launch/commands.h"
#include "placement/node.h"
#include "transport/mpi_session.h"

namespace strata::cli {

// The budget the flags give every rank (--device, --gpu-mem, --cpu-mem, --disk-mem,
// --disk-dir, --threads); under a cluster the memory budgets bound a stage's weights, KV
// cache and buffers together.
NodeBudget flag_budget(const EngineOptions& o);
// Slurm's limits for one of `ranks_on_host` ranks on this node: SLURM_MEM_PER_NODE, or
// SLURM_MEM_PER_CPU x SLURM_CPUS_ON_NODE (MiB), shared by the ranks; nothing outside Slurm.
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

// Where the nodes' measured rates are kept: beside the layer profiles.
std::string node_cache_dir();

}  // namespace strata::cli
