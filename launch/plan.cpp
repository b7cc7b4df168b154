// strata plan: the offloading policy Strata would choose (FlexGen's cost model and LP
// search) for a model, a machine and a workload -- or the cost of a policy given with
// --policy. Prints the policy, predicted throughput, the bottleneck and peak memory per
// tier; an infeasible budget names the constraint and the shortfall.
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "coordinator/plan/cluster_plan.h"
#include "kernels/error.h"
#include "launch/commands.h"
#include "launch/node_setup.h"
#include "launch/plan_schedule.h"
#include "launch/progress.h"
#include "placement/moe_plan.h"
#include "placement/offload_estimates.h"
#include "placement/policy_search.h"
#include "worker/config.h"
#include "worker/dummy.h"

namespace strata::cli {
namespace {

struct PlanOptions {
  std::string model;
  std::string dtype;     // empty: f16, as FlexGen plans; with --nodes f32, as serve loads dummies
  std::string hardware;  // JSON file (HardwareSpec); empty: FlexGen's T4 machine
  std::string gpu_mem, cpu_mem, disk_mem;  // sizes (parse_size); empty: the hardware's
  int64_t prompt_len = 512, gen_len = 32;
  std::string policy;
  bool compress_weight = false, compress_cache = false, cache_f16 = false, cpu_attention = true;
  std::string format = "text";
  // The stages a cluster of `workers` worker ranks would run, placed with the policy
  // (placement/stage_placement.h, the engine's memory model): what each worker allocates.
  int32_t workers = 1;
  int32_t max_step_tokens = 512;
  bool host_compute = false;    // the stages compute on the CPU (default: on the GPU)
  ScheduleCliOptions schedule;  // ExeGPT's scheduler (--workload)
  // What the search may place beside FlexGen's tiers: "pie", "hetegen" (issue 17).
  std::vector<std::string> methods = {"pie", "hetegen"};
  // --nodes FILE (schedule.node_file): the plan `serve` starts with on these nodes, with
  // serve's own options (--max-batch and --stage-mem are schedule's).
  int max_context = 0;
  int micro_batches = 1;
  int threads = 0;
  std::string disk_dir = "/tmp";
  std::string device = "auto";
  bool remeasure = false;
  CpuExpertRates cpu_experts;  // a MoE model's CPU expert compute (placement/moe_plan.h)
};

ModelConfig plan_config(const PlanOptions& o) {
  const DType dt = parse_dtype(o.dtype).value_or(DType::kF16);
  ModelConfig c = load_spec_config(o.model, dt);
  c.dtype = dt;
  return c;
}

// Each stage's placement for `policy` under the budgets, as the cluster planner makes it;
// a refusal names the stage, the tier and the shortfall.
nlohmann::json stage_placements(const PlanOptions& o, const HardwareSpec& hw, const Policy& policy,
                                std::string& text) {
  const ModelConfig c = plan_config(o);
  strata::PlanOptions po;
  po.model_spec = o.model;
  po.workers = o.workers;
  po.kv_slots = static_cast<int32_t>(policy.block_size());
  po.kv_capacity = static_cast<int32_t>(o.prompt_len + o.gen_len);
  po.max_batch_rows = std::max(po.kv_slots, o.max_step_tokens);
  po.placement.device_compute = !o.host_compute;
  po.placement.policy = with_engine_activations(policy, po.placement.device_compute);
  po.placement.budgets =
      TierBudgets{static_cast<int64_t>(hw.gpu_mem), static_cast<int64_t>(hw.cpu_mem),
                  static_cast<int64_t>(hw.disk_mem), true};
  if (o.host_compute) po.placement.budgets.gpu = -1;
  nlohmann::json out = nlohmann::json::array();
  try {
    const ClusterPlan plan = make_uniform_plan(c, po);
    for (const StagePlan& st : plan.stages) {
      const StagePlacement p = place_stage(c.shape(), stage_request(st, plan, po.placement, -1));
      const TierBytes links = link_buffer_bytes(st, plan);
      text += fmt::format(
          "\nstage {} (layers [{}, {})): allocates gpu {} B, cpu {} B, disk {} B "
          "(links {}); {}",
          st.rank, st.layer_begin, st.layer_end, st.placed_gpu_bytes, st.placed_cpu_bytes,
          st.placed_disk_bytes, links.str(), p.str());
      out.push_back({{"rank", st.rank},
                     {"layers", {st.layer_begin, st.layer_end}},
                     {"gpu_bytes", st.placed_gpu_bytes},
                     {"cpu_bytes", st.placed_cpu_bytes},
                     {"disk_bytes", st.placed_disk_bytes},
                     {"placement", p.str()}});
    }
  } catch (const InputError& e) {
    text += fmt::format("\nstages: the engine could not run this policy: {}", e.what());
    out = {{"refused", e.what()}};
  }
  return out;
}

// What Pie and HeteGen would make of the chosen policy (issue 17): estimates beside it.
void add_pie_hetegen(const ModelShape& shape, const Workload& w, const Policy& policy,
                     const HardwareSpec& hw, nlohmann::json& out, std::string& text) {
  try {
    const PieEstimate pie = estimate_pie(shape, w, policy, hw);
    out["pie"] = pie.to_json();
    text += "\n" + pie.str();
  } catch (const InputError& e) {
    text += fmt::format("\nPie: not estimated: {}", e.what());
  }
  nlohmann::json hg = nlohmann::json::array();
  std::vector<int64_t> sizes{policy.block_size()};
  if (policy.block_size() > 1) sizes.push_back(1);  // HeteGen's own case: latency at batch 1
  for (int64_t rows : sizes) {
    const HeteGenEstimate e = estimate_hetegen(shape, policy, rows, hw);
    hg.push_back(e.to_json());
    text += "\n" + e.str();
  }
  out["hetegen"] = hg;
}

ModelShape plan_shape(const PlanOptions& o) {
  return plan_config(o).shape();
}

HardwareSpec plan_hardware(const PlanOptions& o) {
  HardwareSpec hw =
      o.hardware.empty() ? HardwareSpec::flexgen_t4() : HardwareSpec::load(o.hardware);
  if (!o.gpu_mem.empty()) hw.gpu_mem = static_cast<double>(parse_size(o.gpu_mem, "--gpu-mem"));
  if (!o.cpu_mem.empty()) hw.cpu_mem = static_cast<double>(parse_size(o.cpu_mem, "--cpu-mem"));
  if (!o.disk_mem.empty()) hw.disk_mem = static_cast<double>(parse_size(o.disk_mem, "--disk-mem"));
  hw.validate(o.hardware.empty() ? "the T4 preset with the given budgets" : o.hardware);
  return hw;
}

// --nodes: the cluster plan `serve` starts with under the same options, each stage placed
// for its node, printed with the node, the policy and the bytes per tier each worker will
// allocate.
int run_nodes_plan(const PlanOptions& o) {
  const NodeFile file = NodeFile::load(o.schedule.node_file);
  const int workers = o.workers > 1 ? o.workers : file.max_rank();
  if (workers < 1)
    fail_input("{}: no entry names a rank; give --workers N for a plan of N worker ranks",
               file.path);
  if (file.max_rank() > workers)
    fail_input("{}: an entry for rank {} but the plan has worker ranks 1 to {}", file.path,
               file.max_rank(), workers);
  EngineOptions e;
  e.model = o.model;
  e.dtype = o.dtype.empty() ? e.dtype : o.dtype;
  e.max_batch = o.schedule.max_batch > 0 ? o.schedule.max_batch : 32;
  e.max_step_tokens = o.max_step_tokens;
  e.gpu_mem = o.gpu_mem;
  e.cpu_mem = o.cpu_mem;
  e.disk_mem = o.disk_mem;
  e.threads = o.threads;
  e.disk_dir = o.disk_dir;
  e.device = o.device;
  if (!o.policy.empty()) e.policy = Policy::parse(o.policy);
  const ModelConfig config = load_spec_config(e.model, parse_dtype(e.dtype).value_or(DType::kF32));
  const std::vector<NodeInventory> inventories = local_inventories(e, file, workers, o.remeasure);
  const CoordinatorOptions c = planned_run(e, o.micro_batches, o.max_context, o.schedule.stage_mem,
                                           stage_nodes(inventories));
  const strata::PlanOptions po = run_plan_options(c, config, workers);
  const ClusterPlan plan = make_uniform_plan(config, po);
  nlohmann::ordered_json stages = nlohmann::ordered_json::array();
  std::string text = plan.str();
  for (const StagePlan& st : plan.stages) {
    const ChosenStage chosen = choose_stage(config, plan, st, po);
    const StageNode& node = *po.node(st.rank);
    text += fmt::format("\n{}\n  {}\n  policy {}; allocates gpu {} B, cpu {} B, disk {} B\n  {}",
                        st.str(), node.str(), chosen.policy.compact(), st.placed_gpu_bytes,
                        st.placed_cpu_bytes, st.placed_disk_bytes, chosen.placed.str());
    stages.push_back({{"rank", st.rank},
                      {"layers", {st.layer_begin, st.layer_end}},
                      {"device_compute", st.use_gpu},
                      {"node", node.str()},
                      {"inventory", inventories[static_cast<size_t>(st.rank - 1)].to_json()},
                      {"policy", chosen.policy.compact()},
                      {"gpu_bytes", st.placed_gpu_bytes},
                      {"cpu_bytes", st.placed_cpu_bytes},
                      {"disk_bytes", st.placed_disk_bytes},
                      {"placement", chosen.placed.str()}});
  }
  const nlohmann::ordered_json out{{"model", o.model}, {"workers", workers}, {"stages", stages}};
  std::printf("%s\n", o.format == "json" ? out.dump(2).c_str() : text.c_str());
  return 0;
}

// A MoE model: the expert placement (placement/moe_plan.h) beside FlexGen's layer offloading
// of the same model, which streams every expert of each layer it does not hold.
void add_moe_plan(const PlanOptions& o, const ModelShape& shape, const Workload& w,
                  const HardwareSpec& hw, double layer_offloading, nlohmann::json& out,
                  std::string& text) {
  MoePlanOptions mo;
  mo.cpu = o.cpu_experts;
  mo.compress_weight = o.compress_weight;
  MoePlan p;
  try {
    p = plan_moe(shape, w, hw, mo);
  } catch (const InputError& e) {  // FlexGen's layer offloading above may still fit
    out["moe"] = {{"error", e.what()}};
    text += fmt::format("\nMoE expert placement: {}", e.what());
    return;
  }
  out["moe"] = p.to_json();
  out["moe"]["layer_offloading_throughput"] = layer_offloading;
  out["moe"]["vs_layer_offloading"] = layer_offloading > 0 ? p.throughput / layer_offloading : 0;
  out["moe"]["cpu_expert_rates"] = {{"weight_bdw", mo.cpu.weight_bdw},
                                    {"gemm_flops", mo.cpu.gemm_flops}};
  text += fmt::format(
      "\n{}\n  vs FlexGen-style layer offloading of the same model (every expert streamed): "
      "{:.2f} token/s, {:.2f}x (CPU expert rates: weights {:.1f} GB/s, GEMM {:.2f} TFLOP/s)",
      p.str(), layer_offloading, layer_offloading > 0 ? p.throughput / layer_offloading : 0.0,
      mo.cpu.weight_bdw / 1e9, mo.cpu.gemm_flops / 1e12);
}

int run_plan(const PlanOptions& o) {
  if (!o.schedule.node_file.empty()) return run_nodes_plan(o);
  if (!o.schedule.workload.empty()) {
    ScheduleCliInputs in{o.model,        parse_dtype(o.dtype).value_or(DType::kF16),
                         o.hardware,     o.policy,
                         o.host_compute, o.max_step_tokens,
                         o.format};
    return run_schedule_plan(in, o.schedule);
  }
  const ModelShape shape = plan_shape(o);
  const HardwareSpec hw = plan_hardware(o);
  const Workload w{o.prompt_len, o.gen_len};
  w.validate();
  nlohmann::json out;
  std::string text;
  Policy chosen;
  double layer_offloading = 0;  // the FlexGen policy's predicted throughput
  if (!o.policy.empty()) {
    chosen = Policy::parse(o.policy);
    const CostEstimate cost = estimate_cost(shape, w, chosen, hw);
    const auto shortfalls = cost.memory_shortfalls(hw);
    for (const auto& s : shortfalls)
      std::fprintf(stderr, "strata: policy does not fit: %s\n", s.c_str());
    out = cost.to_json();
    text = cost.str();
    layer_offloading = cost.throughput;
    if (!shortfalls.empty()) {
      std::printf("%s\n", o.format == "json" ? out.dump(2).c_str() : text.c_str());
      return 1;
    }
  } else {
    SearchOptions so;
    so.compress_weight = o.compress_weight;
    so.compress_cache = o.compress_cache;
    so.cache_f16 = o.cache_f16;
    so.cpu_attention = o.cpu_attention;
    so.pie = std::ranges::count(o.methods, "pie") > 0;
    so.hetegen = std::ranges::count(o.methods, "hetegen") > 0;
    so.on_progress = progress_callback("policy search: GPU batch sizes");
    const SearchResult r = search_policy(shape, w, hw, so);
    out = r.to_json();
    text = r.str();
    chosen = r.policy;
    layer_offloading = r.cost.throughput;
  }
  if (!o.host_compute) add_pie_hetegen(shape, w, chosen, hw, out, text);
  if (shape.moe() && !o.host_compute) add_moe_plan(o, shape, w, hw, layer_offloading, out, text);
  out["stages"] = stage_placements(o, hw, chosen, text);
  out["model"] = o.model;
  out["hardware"] = hw.to_json();
  std::printf("%s\n", o.format == "json" ? out.dump(2).c_str()
                                         : (shape.str() + "\n" + hw.str() + "\n" + text).c_str());
  return 0;
}

}  // namespace

Command add_plan(CLI::App& app) {
  auto o = std::make_shared<PlanOptions>();
  CLI::App* cmd = app.add_subcommand(
      "plan",
      "Choose an offloading policy (FlexGen's cost model and LP search) or, with --workload, a "
      "schedule under a latency bound (ExeGPT)");
  cmd->add_option(
         "--model", o->model,
         "Model folder (its config.json), a hub cache model (ORG/NAME[@REV]) or dummy:NAME")
      ->required();
  cmd->add_option("--dtype", o->dtype, "Weight dtype the plan assumes")
      ->check(CLI::IsMember({"f32", "f16", "bf16"}));
  cmd->add_option("--hardware", o->hardware,
                  "HardwareSpec JSON (default: FlexGen's T4 machine, Table 1); with --workload a "
                  "node: a40, a100, h100 or a JSON node description (default: this machine)");
  cmd->add_option("--gpu-mem", o->gpu_mem,
                  "GPU memory budget, e.g. 16GiB or 800MiB (a bare number is GiB)");
  cmd->add_option("--cpu-mem", o->cpu_mem, "CPU memory budget (a size, as --gpu-mem)");
  cmd->add_option("--disk-mem", o->disk_mem, "Disk budget (a size, as --gpu-mem)");
  cmd->add_option("--prompt-len", o->prompt_len, "Prompt tokens (s)")->check(positive());
  cmd->add_option("--gen-len", o->gen_len, "Generated tokens (n)")->check(positive());
  cmd->add_option(
      "--policy", o->policy,
      "Evaluate this policy instead of searching, e.g. gbs=48,ngb=3,w=20/80/0,c=0/100/0,h=0/100/0");
  cmd->add_option("--search", o->methods,
                  "What the search may use beside FlexGen's placement: pie (KV-cache swapping), "
                  "hetegen (CPU/GPU split of CPU-tier linears), none")
      ->delimiter(',')
      ->check(CLI::IsMember({"pie", "hetegen", "none"}))
      ->default_str("pie,hetegen");
  cmd->add_flag("--compress-weight", o->compress_weight, "Search with 4-bit weights");
  cmd->add_flag("--compress-cache", o->compress_cache, "Search with a 4-bit KV cache");
  cmd->add_flag("--cache-f16", o->cache_f16,
                "Search with an f16 KV cache (FlexGen's: 2 bytes an element in every tier)");
  cmd->add_flag("!--no-cpu-attention", o->cpu_attention, "Search without CPU attention");
  cmd->add_option("--workers", o->workers,
                  "Pipeline stages to place (worker ranks; each stage's placement is printed)")
      ->check(CLI::Range(1, 1 << 16));
  cmd->add_option("--max-step-tokens", o->max_step_tokens, "Rows of one prefill step")
      ->check(positive());
  cmd->add_flag("--host-compute", o->host_compute,
                "Place the stages for CPU compute (no GPU tier) instead of the GPU");
  cmd->add_option("--format", o->format, "Output format")->check(CLI::IsMember({"text", "json"}));
  cmd->add_option("--cpu-weight-bdw", o->cpu_experts.weight_bdw,
                  "MoE: bytes/s the CPU streams an expert's weights at over few rows (Fiddler's "
                  "CPU expert compute)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--cpu-gemm-flops", o->cpu_experts.gemm_flops,
                  "MoE: FLOP/s of the CPU's GEMM over many rows")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--max-context", o->max_context, "As serve's: KV positions per sequence")
      ->check(non_negative())
      ->group("Cluster (--nodes)");
  cmd->add_option("--micro-batches", o->micro_batches, "As serve's")
      ->check(positive())
      ->group("Cluster (--nodes)");
  cmd->add_option("--threads", o->threads, "As serve's (each node's unless its entry says)")
      ->check(thread_count())
      ->group("Cluster (--nodes)");
  cmd->add_option("--disk-dir", o->disk_dir, "As serve's")->group("Cluster (--nodes)");
  cmd->add_option("--device", o->device, "As serve's: auto, cpu, host, cuda, cuda:N")
      ->group("Cluster (--nodes)");
  cmd->add_flag("--remeasure-nodes", o->remeasure, "Measure this machine's rates again")
      ->group("Cluster (--nodes)");
  add_schedule_options(cmd, o->schedule);
  return {cmd, [o] { return run_plan(*o); }};
}

}  // namespace strata::cli
