// strata plan: the offloading policy Strata would choose (FlexGen's cost model and LP
// search) for a model, a machine and a workload -- or the cost of a policy given with
// --policy. Prints the policy, predicted throughput, the bottleneck and peak memory per
// tier; an infeasible budget names the constraint and the shortfall.
#include <cstdio>
#include <nlohmann/json.hpp>

#include "kernels/error.h"
#include "launch/commands.h"
#include "placement/policy_search.h"
#include "worker/config.h"
#include "worker/dummy.h"

namespace strata::cli {
namespace {

struct PlanOptions {
  std::string model;
  std::string dtype = "f16";  // FlexGen plans fp16 weights
  std::string hardware;       // JSON file (HardwareSpec); empty: FlexGen's T4 machine
  double gpu_mem_gib = -1, cpu_mem_gib = -1, disk_mem_gib = -1;
  int64_t prompt_len = 512, gen_len = 32;
  std::string policy;
  bool compress_weight = false, compress_cache = false, cpu_attention = true;
  std::string format = "text";
};

ModelShape plan_shape(const PlanOptions& o) {
  const DType dt = parse_dtype(o.dtype).value_or(DType::kF16);
  ModelConfig c = is_dummy_model(o.model) ? dummy_model_config(o.model.substr(6), dt)
                                          : load_model_config(o.model);
  c.dtype = dt;
  return c.shape();
}

HardwareSpec plan_hardware(const PlanOptions& o) {
  HardwareSpec hw =
      o.hardware.empty() ? HardwareSpec::flexgen_t4() : HardwareSpec::load(o.hardware);
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  if (o.gpu_mem_gib >= 0) hw.gpu_mem = o.gpu_mem_gib * kGiB;
  if (o.cpu_mem_gib >= 0) hw.cpu_mem = o.cpu_mem_gib * kGiB;
  if (o.disk_mem_gib >= 0) hw.disk_mem = o.disk_mem_gib * kGiB;
  hw.validate(o.hardware.empty() ? "the T4 preset with the given budgets" : o.hardware);
  return hw;
}

int run_plan(const PlanOptions& o) {
  const ModelShape shape = plan_shape(o);
  const HardwareSpec hw = plan_hardware(o);
  const Workload w{o.prompt_len, o.gen_len};
  w.validate();
  nlohmann::json out;
  std::string text;
  if (!o.policy.empty()) {
    const CostEstimate cost = estimate_cost(shape, w, Policy::parse(o.policy), hw);
    const auto shortfalls = cost.memory_shortfalls(hw);
    for (const auto& s : shortfalls)
      std::fprintf(stderr, "strata: policy does not fit: %s\n", s.c_str());
    out = cost.to_json();
    text = cost.str();
    if (!shortfalls.empty()) {
      std::printf("%s\n", o.format == "json" ? out.dump(2).c_str() : text.c_str());
      return 1;
    }
  } else {
    SearchOptions so;
    so.compress_weight = o.compress_weight;
    so.compress_cache = o.compress_cache;
    so.cpu_attention = o.cpu_attention;
    const SearchResult r = search_policy(shape, w, hw, so);
    out = r.to_json();
    text = r.str();
  }
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
      "plan", "Choose an offloading policy with FlexGen's cost model and LP search");
  cmd->add_option("--model", o->model, "Model directory (its config.json) or dummy:NAME")
      ->required();
  cmd->add_option("--dtype", o->dtype, "Weight dtype the plan assumes")
      ->check(CLI::IsMember({"f32", "f16", "bf16"}));
  cmd->add_option("--hardware", o->hardware,
                  "HardwareSpec JSON (default: FlexGen's T4 machine, Table 1)");
  cmd->add_option("--gpu-mem", o->gpu_mem_gib, "GPU memory budget, GiB")->check(non_negative());
  cmd->add_option("--cpu-mem", o->cpu_mem_gib, "CPU memory budget, GiB")->check(non_negative());
  cmd->add_option("--disk-mem", o->disk_mem_gib, "Disk budget, GiB")->check(non_negative());
  cmd->add_option("--prompt-len", o->prompt_len, "Prompt tokens (s)")->check(positive());
  cmd->add_option("--gen-len", o->gen_len, "Generated tokens (n)")->check(positive());
  cmd->add_option(
      "--policy", o->policy,
      "Evaluate this policy instead of searching, e.g. gbs=48,ngb=3,w=20/80/0,c=0/100/0,h=0/100/0");
  cmd->add_flag("--compress-weight", o->compress_weight, "Search with 4-bit weights");
  cmd->add_flag("--compress-cache", o->compress_cache, "Search with a 4-bit KV cache");
  cmd->add_flag("!--no-cpu-attention", o->cpu_attention, "Search without CPU attention");
  cmd->add_option("--format", o->format, "Output format")->check(CLI::IsMember({"text", "json"}));
  return {cmd, [o] { return run_plan(*o); }};
}

}  // namespace strata::cli
