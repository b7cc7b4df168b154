#include "coordinator/plan/cluster_plan.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <numeric>
#include <sstream>

#include "kernels/error.h"
#include "placement/tier.h"
#include "transport/tensor_channel.h"

namespace strata {

StageRequest stage_request(const StagePlan& stage, const ClusterPlan& plan,
                           const StagePlacementOptions& o, int64_t stage_mem) {
  StageRequest r;
  r.layer_begin = stage.layer_begin;
  r.layer_end = stage.layer_end;
  r.embedding = stage.has_embedding;
  r.head = stage.has_head;
  r.device_compute = o.device_compute;
  r.max_rows = plan.max_batch_rows;
  r.kv_slots = plan.kv_slots_of(stage);
  r.kv_capacity = plan.kv_capacity;
  r.host_logit_rows = stage.has_head ? r.kv_slots : 0;  // PipelineStage's logits
  r.host_token_rows = plan.max_batch_rows;              // its token ids of a middle stage
  r.policy = o.policy;
  // Pie and HeteGen as the policy names them (pie=, hetegen=), where a device computes: each
  // stage keeps m of its own KV-cache layers in host memory (one at least stays on the
  // device), and splits its CPU-tier layers at alpha.
  if (o.policy && o.device_compute) {
    const int32_t m = std::min(o.policy->pie_host_layers, stage.n_layers() - 1);
    if (m > 0) r.pie = PieHostLayers{m, m};
    r.hetegen_alpha = o.policy->hetegen_alpha_percent / 100.0;
  }
  r.budgets = o.budgets;
  r.budgets.whole_stage = true;
  r.resident_experts = o.resident_experts;
  r.expert_cache_slots = o.expert_cache_slots;
  r.experts_follow_budget = false;
  // --stage-mem bounds the compute tier, under the node's own budget there.
  int64_t& compute = o.device_compute ? r.budgets.gpu : r.budgets.cpu;
  if (stage_mem >= 0) compute = compute < 0 ? stage_mem : std::min(compute, stage_mem);
  // The link buffers are the worker's, counted against the same budgets.
  const TierBytes links = link_buffer_bytes(stage, plan);
  for (Tier t : kTiers) {
    int64_t& b = t == Tier::kGpu ? r.budgets.gpu : t == Tier::kCpu ? r.budgets.cpu : r.budgets.disk;
    if (b >= 0) b = std::max<int64_t>(b - links[t], 0);
  }
  return r;
}

TierBytes link_buffer_bytes(const StagePlan& stage, const ClusterPlan& plan) {
  const int64_t one = int64_t{plan.max_batch_rows} * plan.hidden_size * 4;
  // A link is NCCL's (its buffers on the device) where both ends are; the neighbours are
  // the stage's pipeline's (laid out in order: a tensor-parallel group by its leader).
  const std::span<const StagePlan> pipeline = plan.pipeline_of(stage);
  bool prev_nccl = false, next_nccl = false;
  for (size_t i = 0; i < pipeline.size(); ++i) {
    if (pipeline[i].rank != stage.rank) continue;
    if (i > 0) prev_nccl = pipeline[i - 1].nccl;
    if (i + 1 < pipeline.size()) next_nccl = pipeline[i + 1].nccl;
  }
  TierBytes b;
  if (!stage.has_embedding) (stage.nccl && prev_nccl ? b.gpu : b.cpu) += one;
  if (!stage.has_head) (stage.nccl && next_nccl ? b.gpu : b.cpu) += 2 * one;
  return b;
}

const StageNode* PlanOptions::node(int32_t rank) const {
  if (nodes.empty()) return nullptr;
  if (rank < 1 || rank > static_cast<int32_t>(nodes.size()))
    fail_input("rank {} has no node: {} nodes for {} worker ranks", rank, nodes.size(), workers);
  return &nodes[static_cast<size_t>(rank - 1)];
}

StagePlacementOptions placement_of(const PlanOptions& o, int32_t rank) {
  StagePlacementOptions p = o.placement;
  if (const StageNode* n = o.node(rank)) {
    p.device_compute = n->device_compute;
    p.budgets = n->budgets;
  }
  return p;
}

int32_t PlanOptions::stages() const {
  return tp_degrees.empty() ? workers : static_cast<int32_t>(tp_degrees.size());
}

std::vector<int32_t> parse_tp_degrees(const std::string& text, int32_t workers) {
  std::vector<int32_t> degrees;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    int32_t d = 0;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), d);
    if (ec != std::errc() || end != item.data() + item.size() || d < 1)
      fail_input("--tensor-parallel '{}': '{}' is not a degree (a whole number, 1 or more)", text,
                 item);
    degrees.push_back(d);
  }
  if (degrees.empty()) fail_input("--tensor-parallel '{}': no degrees", text);
  if (degrees.size() == 1) {  // one degree for every stage
    const int32_t d = degrees[0];
    if (workers % d != 0)
      fail_input("--tensor-parallel {}: {} worker ranks do not split into groups of {}", text,
                 workers, d);
    degrees.assign(static_cast<size_t>(workers / d), d);
  }
  const int32_t sum = std::accumulate(degrees.begin(), degrees.end(), 0);
  if (sum != workers)
    fail_input(
        "--tensor-parallel {}: the stages take {} worker ranks but the job has {} "
        "(mpirun -np {})",
        text, sum, workers, sum + 1);
  return degrees;
}

std::vector<int32_t> uniform_layers(int32_t layers, int32_t stages) {
  std::vector<int32_t> out;
  for (int32_t i = 0; i < stages; ++i)
    out.push_back(layers / stages + (i < layers % stages ? 1 : 0));
  return out;
}

ClusterPlan make_uniform_plan(const ModelConfig& config, const PlanOptions& o) {
  const int32_t n = config.n_layers, s = o.stages();
  if (o.workers < 1)
    fail_input(
        "a cluster needs at least one worker rank besides the coordinator (mpirun -np 2 or more)");
  if (!o.tp_degrees.empty() && s > n)
    fail_input("{} tensor-parallel pipeline stages but {} has only {} layers", s, o.model_spec, n);
  const int32_t e = o.encoder_stages;
  if (e < 0 || (e > 0 && e >= s))
    fail_input("WAA with {} prefill stages of {} worker ranks: each side needs at least one", e, s);
  if (e == 0 && s > n)
    fail_input(
        "{} worker ranks but {} has only {} layers: each pipeline stage needs at least one layer; "
        "run at most mpirun -np {}",
        s, o.model_spec, n, n + 1);
  if (e > 0 && std::max(e, s - e) > n)
    fail_input(
        "WAA with {} prefill and {} decode ranks but {} has only {} layers: each stage of a "
        "pipeline needs at least one layer",
        e, s - e, o.model_spec, n);
  if (e == 0 && !o.nodes.empty() && o.tp_degrees.empty())
    return make_plan(config, o, balanced_layers(config, o));
  if (e == 0) return make_plan(config, o, uniform_layers(n, s));
  std::vector<int32_t> layers = uniform_layers(n, e);
  for (int32_t c : uniform_layers(n, s - e)) layers.push_back(c);
  return make_plan(config, o, layers);
}

namespace {

// The allocation names a layer count for each pipeline stage, and the tensor-parallel
// degrees cover the worker ranks.
void check_allocation(const PlanOptions& o, const std::vector<int32_t>& layers) {
  if (static_cast<int32_t>(layers.size()) != o.stages())
    fail_input("an allocation of {} stages for {} pipeline stages", layers.size(), o.stages());
  if (!o.tp_degrees.empty() &&
      std::accumulate(o.tp_degrees.begin(), o.tp_degrees.end(), 0) != o.workers)
    fail_input("tensor-parallel degrees [{}] for {} worker ranks", fmt::join(o.tp_degrees, ", "),
               o.workers);
}

// What the stages share: the model, the batch and KV sizes, the micro-batches and WAA's
// encoder side.
ClusterPlan shared_plan(const ModelConfig& config, const PlanOptions& o) {
  ClusterPlan plan;
  plan.plan_id = 1;
  plan.model_spec = o.model_spec;
  plan.num_layers = config.n_layers;
  plan.hidden_size = config.hidden;
  plan.max_batch_rows = o.max_batch_rows;
  plan.micro_batches = o.micro_batches;
  plan.kv_slots = o.kv_slots;
  plan.kv_capacity = o.kv_capacity;
  plan.encoder_stages = o.encoder_stages;
  plan.encoder_kv_slots = o.encoder_stages > 0 ? o.encoder_kv_slots : 0;
  return plan;
}

// Whether the stage on `rank` sends and receives over NCCL, as the workers' links will find
// (transport/tensor_channel.h nccl_members over the nodes' device keys; the coordinator has
// none). Without nodes: every device stage, each on its own GPU.
bool nccl_rank(const PlanOptions& o, int32_t rank, bool use_gpu) {
  if (o.nodes.empty()) return use_gpu;
  std::vector<int> keys{0};
  for (const StageNode& n : o.nodes) keys.push_back(n.nccl_key);
  const std::vector<int> members = nccl_members(keys);
  return std::find(members.begin(), members.end(), rank) != members.end();
}

// The stages in rank order, each over the next `layers[i]` layers; a tensor-parallel stage
// takes its degree's consecutive ranks, its leader's first. The first stage of a pipeline
// embeds, its last holds the head.
std::vector<StagePlan> lay_out_stages(const PlanOptions& o, const std::vector<int32_t>& layers) {
  const auto s = static_cast<int32_t>(layers.size());
  std::vector<StagePlan> stages;
  int32_t begin = 0;
  int32_t rank = 1;
  for (int32_t i = 0; i < s; ++i) {
    // A WAA plan starts its decode pipeline at layer 0 again.
    const bool first = i == 0 || i == o.encoder_stages;
    const bool last = i == s - 1 || i + 1 == o.encoder_stages;
    if (first) begin = 0;
    StagePlan st;
    st.rank = rank;
    const int32_t degree = o.tp_degrees.empty() ? 1 : o.tp_degrees[static_cast<size_t>(i)];
    for (int32_t k = 0; k < degree && degree > 1; ++k) st.tp_ranks.push_back(rank + k);
    rank += degree;
    st.layer_begin = begin;
    st.layer_end = begin + layers[static_cast<size_t>(i)];
    st.has_embedding = first;
    st.has_head = last;
    st.use_gpu = placement_of(o, st.rank).device_compute;
    st.nccl = nccl_rank(o, st.rank, st.use_gpu);
    begin = st.layer_end;
    stages.push_back(st);
  }
  return stages;
}

// A stage as placement/ places it under `policy` (unset: the operator gave none), and with
// the worker's link buffers added, checked against the stage's budgets with the links
// included.
ChosenStage place_with_links(const ModelConfig& config, const ClusterPlan& plan,
                             const StagePlan& st, const PlanOptions& o,
                             const std::optional<Policy>& policy) {
  // A tensor-parallel stage is placed as its leader's shard (the other members hold the
  // same without the head).
  const ModelShape shape = tensor_parallel_shard(config, st.tp_degree()).shape();
  StagePlacementOptions po = placement_of(o, st.rank);
  po.policy = policy;
  StageRequest r = stage_request(st, plan, po, o.stage_mem);
  // A chosen policy names the cache's tiers; the weights fill the budgets after it.
  r.weight_shares = o.placement.policy.has_value();
  ChosenStage c;
  c.policy = policy.value_or(Policy{});
  c.placed = place_stage(shape, r);
  const TierBytes links = link_buffer_bytes(st, plan);
  TierBudgets whole = r.budgets;  // shortfalls against the stage's budgets, links included
  for (Tier t : kTiers) {
    int64_t& b = t == Tier::kGpu ? whole.gpu : t == Tier::kCpu ? whole.cpu : whole.disk;
    if (b >= 0) b += links[t];
  }
  c.with_links = c.placed;
  c.with_links.host_workspace_bytes += links.cpu;
  c.with_links.activation_bytes += links.gpu;
  c.shortfalls = shortfalls(c.with_links, whole);
  return c;
}

// The cache's shares to try, nearest the compute first: the compute tier's share falls a
// percent at a time to the host (device compute) and then to the disk.
std::vector<std::pair<int, int>> cache_shares(bool device_compute) {
  std::vector<std::pair<int, int>> out;
  for (int g = 100; g >= 0; --g) out.emplace_back(g, device_compute ? 100 - g : 0);
  if (device_compute)
    for (int c = 99; c >= 0; --c) out.emplace_back(0, c);
  return out;
}

// The policy that fits (fit-then-stream): weights fill the budgets, compute tier first, the
// rest streaming from the host and the disk; while the stage still does not fit, the KV
// cache leaves the compute tier a layer at a time.
ChosenStage fit_stage(const ModelConfig& config, const ClusterPlan& plan, const StagePlan& st,
                      const PlanOptions& o) {
  ChosenStage chosen = place_with_links(config, plan, st, o, std::nullopt);
  if (chosen.shortfalls.empty()) return chosen;
  std::vector<Tier> last;
  for (const auto& [g, c] : cache_shares(st.use_gpu)) {
    Policy p;
    p.cache_gpu_percent = g;
    p.cache_cpu_percent = c;
    const std::vector<Tier> tiers = tiers_from_shares(st.n_layers(), g, c, "cache");
    if (tiers == last) continue;  // the same layers as the share before
    last = tiers;
    chosen = place_with_links(config, plan, st, o, p);
    if (chosen.shortfalls.empty()) return chosen;
  }
  // Nothing fits: the refusal names what the stage needs with everything streamed, the
  // least any placement needs of its compute tier.
  return chosen;
}

// The policy's switches the stage's worker applies.
void set_policy(StagePlan& st, const Policy& policy) {
  st.compress_weight = policy.compress_weight;
  st.compress_cache = policy.compress_cache;
  st.cache_f16 = policy.cache_f16;
  st.cpu_attention = policy.cpu_cache_compute;
}

// What the stage holds in each tier as placed, link buffers included.
void set_placed_bytes(StagePlan& st, const TierBytes& total) {
  st.placed_gpu_bytes = static_cast<uint64_t>(total.gpu);
  st.placed_cpu_bytes = static_cast<uint64_t>(total.cpu);
  st.placed_disk_bytes = static_cast<uint64_t>(total.disk);
}

}  // namespace

ClusterPlan make_plan(const ModelConfig& config, const PlanOptions& o,
                      const std::vector<int32_t>& layers) {
  check_allocation(o, layers);
  ClusterPlan plan = shared_plan(config, o);
  plan.stages = lay_out_stages(o, layers);
  plan.validate();
  std::string refused;
  for (StagePlan& st : plan.stages) {
    const ChosenStage c = choose_stage(config, plan, st, o);
    for (const std::string& line : c.shortfalls)
      refused += fmt::format("{}stage {} (layers [{}, {}){}): {}", refused.empty() ? "" : "; ",
                             st.rank, st.layer_begin, st.layer_end,
                             o.node(st.rank) ? ", " + o.node(st.rank)->name : "", line);
    st.weight_tiers = tiers_to_wire(c.placed.weights.tiers);
    st.cache_tiers = tiers_to_wire(c.placed.cache.tiers);
    set_policy(st, c.policy);
    st.gpu_batch_size = c.placed.gpu_batch_size;
    st.pie_host_layers =
        c.placed.cache.pie_host_layers ? c.placed.cache.pie_host_layers->lowest : 0;
    st.hetegen_alpha = c.placed.weights.hetegen_alpha;
    set_placed_bytes(st, c.with_links.total());
  }
  if (!refused.empty())
    fail_input(
        "{} does not fit: {}; run more ranks (mpirun -np), fewer KV slots (--max-batch), a "
        "shorter context (--max-context), larger budgets (--cpu-mem, --gpu-mem, --disk-mem, "
        "--stage-mem, --nodes) or a policy that streams more (--policy w=, c=)",
        o.model_spec, refused);
  plan.validate();
  return plan;
}

ChosenStage choose_stage(const ModelConfig& config, const ClusterPlan& plan, const StagePlan& st,
                         const PlanOptions& o) {
  if (o.placement.policy) return place_with_links(config, plan, st, o, o.placement.policy);
  return fit_stage(config, plan, st, o);
}

std::vector<int32_t> balanced_layers(const ModelConfig& config, const PlanOptions& o) {
  const int32_t n = config.n_layers, s = o.stages();
  const ClusterPlan plan = shared_plan(config, o);
  // The step of stage i holding k layers (layers are alike: only the count matters, and
  // whether it embeds or holds the head); infinite where it does not fit.
  auto step = [&](int32_t i, int32_t k) {
    StagePlan st;
    st.rank = i + 1;
    st.layer_end = k;
    st.has_embedding = i == 0;
    st.has_head = i == s - 1;
    st.use_gpu = placement_of(o, st.rank).device_compute;
    const ChosenStage c = choose_stage(config, plan, st, o);
    return c.shortfalls.empty() ? decode_step_seconds(c.placed, *o.node(st.rank))
                                : std::numeric_limits<double>::infinity();
  };
  std::vector<int32_t> layers(static_cast<size_t>(s), 1);
  std::vector<double> next(static_cast<size_t>(s));
  for (int32_t i = 0; i < s; ++i) next[static_cast<size_t>(i)] = step(i, 2);
  for (int32_t given = s; given < n; ++given) {
    const auto best = std::min_element(next.begin(), next.end()) - next.begin();
    if (!std::isfinite(next[static_cast<size_t>(best)])) return uniform_layers(n, s);
    const int32_t k = ++layers[static_cast<size_t>(best)];
    next[static_cast<size_t>(best)] =
        k < n ? step(static_cast<int32_t>(best), k + 1) : std::numeric_limits<double>::infinity();
  }
  for (int32_t i = 0; i < s; ++i)
    if (!std::isfinite(step(i, layers[static_cast<size_t>(i)]))) return uniform_layers(n, s);
  return layers;
}
}  // namespace strata
