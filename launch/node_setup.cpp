#include "launch/node_setup.h"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <nlohmann/json.hpp>

#include "kernels/accelerator.h"
#include "kernels/cpu_backend.h"
#include "kernels/error.h"
#include "kernels/tunables.h"
#include "launch/engine.h"
#include "transport/tensor_channel.h"
#include "worker/node_probe.h"

namespace strata::cli {
namespace {

std::optional<int64_t> slurm_mib(const char* name) {
  const auto v = foreign_variable(name);
  if (!v || v->empty()) return std::nullopt;
  int64_t n = 0;
  const auto [end, ec] = std::from_chars(v->data(), v->data() + v->size(), n);
  if (ec != std::errc() || end != v->data() + v->size() || n <= 0)
    fail_input("{}='{}' is not a size in MiB", name, *v);
  return n;
}

}  // namespace

NodeBudget flag_budget(const EngineOptions& o) {
  NodeBudget b;
  b.device = o.device;
  b.gpu_mem = o.gpu_mem.empty() ? -1 : parse_size(o.gpu_mem, "--gpu-mem");
  b.cpu_mem = o.cpu_mem.empty() ? -1 : parse_size(o.cpu_mem, "--cpu-mem");
  b.disk_mem = o.disk_mem.empty() ? -1 : parse_size(o.disk_mem, "--disk-mem");
  b.disk_dir = o.disk_dir;
  b.threads = o.threads;
  return b;
}

NodeBudget slurm_budget(int ranks_on_host) {
  NodeBudget b;
  std::optional<int64_t> node = slurm_mib("SLURM_MEM_PER_NODE");
  if (!node) {
    const auto per_cpu = slurm_mib("SLURM_MEM_PER_CPU");
    const auto cpus = slurm_mib("SLURM_CPUS_ON_NODE");
    if (per_cpu && cpus) node = *per_cpu * *cpus;
  }
  // A default, not the operator's budget: never more than the node has (a slurm.conf's
  // RealMemory may say more than is free), so it is never refused as too large.
  if (node) b.cpu_mem = std::min(*node << 20, host_available_bytes()) / std::max(ranks_on_host, 1);
  return b;
}

NodeBudget resolve_budget(const EngineOptions& o, const std::optional<NodeFile>& nodes, int rank,
                          const std::string& host, int ranks_on_host) {
  // A flag the operator left at its default does not hide Slurm's limit.
  NodeBudget flags = flag_budget(o);
  NodeBudget b = slurm_budget(ranks_on_host).overridden_by(flags);
  if (nodes)
    if (const NodeEntry* e = nodes->find(rank, host)) b = b.overridden_by(e->budget);
  return b;
}

EngineOptions engine_for(const EngineOptions& o, const NodeBudget& b) {
  EngineOptions e = o;
  if (!b.device.empty()) e.device = b.device;
  if (b.threads > 0) e.threads = b.threads;
  if (!b.disk_dir.empty()) e.disk_dir = b.disk_dir;
  // The plan places the stage under the budgets; the engine's own reading of them (weights
  // alone) does not apply to a planned stage.
  e.gpu_mem.clear();
  e.cpu_mem.clear();
  e.disk_mem.clear();
  return e;
}

std::vector<NodeInventory> exchange_inventories(const Communicator& world,
                                                const std::optional<NodeInventory>& mine,
                                                const Deadline& deadline) {
  const std::string text = mine ? mine->to_json().dump() : std::string();
  const std::vector<std::string> all =
      allgather_text(world, text, deadline, "the workers' node inventories");
  std::vector<NodeInventory> out;
  for (size_t r = 1; r < all.size(); ++r) {
    const std::string source = fmt::format("rank {}'s node inventory", r);
    const auto j = nlohmann::json::parse(all[r], nullptr, false);
    if (j.is_discarded()) fail(ErrorKind::kFailed, "{}: not JSON", source);
    out.push_back(NodeInventory::from_json(j, source));
  }
  return out;
}

std::vector<StageNode> stage_nodes(const std::vector<NodeInventory>& workers) {
  std::vector<StageNode> out;
  for (const NodeInventory& n : workers) out.push_back(stage_node(n));
  return out;
}

NodeProbeRequest probe_request(const EngineOptions& engine, int rank, const std::string& host,
                               int ranks_on_host, const NodeBudget& budget, int cuda_device,
                               Backend* device, bool remeasure) {
  NodeProbeRequest r;
  r.rank = rank;
  r.host = host;
  r.ranks_on_host = ranks_on_host;
  r.nccl_key = device_key(cuda_device, host);
  r.budget = budget;
  r.device_compute = cuda_device >= 0 || engine.device == "host";
  r.cuda_device = cuda_device;
  if (cuda_device >= 0) r.device_name = cuda_device_name(cuda_device);
  r.device = device;
  r.threads = resolve_cpu_threads(engine.threads);
  r.disk_dir = engine.disk_dir;
  r.cache_dir = node_cache_dir();
  r.remeasure = remeasure;
  return r;
}

std::vector<NodeInventory> local_inventories(const EngineOptions& e, const NodeFile& file,
                                             int workers, bool remeasure) {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  const AcceleratorInfo acc = probe_accelerators();
  std::vector<NodeInventory> out;
  for (int rank = 1; rank <= workers; ++rank) {
    const NodeBudget b = resolve_budget(e, file, rank, name, 1);
    const EngineOptions ne = engine_for(e, b);
    out.push_back(probe_node(probe_request(
        ne, rank, name, 1, b, pick_device(ne.device, acc, rank - 1), nullptr, remeasure)));
  }
  return out;
}

CoordinatorOptions planned_run(const EngineOptions& e, int micro_batches, int max_context,
                               const std::string& stage_mem, std::vector<StageNode> nodes) {
  CoordinatorOptions c;
  c.model_spec = e.model;
  c.micro_batches = micro_batches;
  // A policy's block (gbs x ngb) is the batch, as in the single-process engine.
  const int block =
      e.policy && e.policy->names_block() ? static_cast<int>(e.policy->block_size()) : 0;
  c.kv_slots = block > 0 ? block : e.max_batch;
  c.max_step_tokens = e.max_step_tokens;
  c.max_context = max_context;
  c.stage_mem = stage_mem.empty() ? -1 : parse_size(stage_mem, "--stage-mem");
  c.placement.policy = e.policy;
  c.placement.resident_experts = e.resident_experts;
  c.placement.expert_cache_slots = e.expert_cache;
  // Without nodes (one process): the compute tier as this process finds it (--device auto:
  // a GPU when present).
  c.placement.device_compute =
      e.device != "cpu" && (e.device != "auto" || probe_accelerators().available());
  c.packing = packing_options(e);
  c.nodes = std::move(nodes);
  return c;
}

std::string node_cache_dir() {
  return profile_dir() + "/../nodes";
}

}  // namespace strata::cli
