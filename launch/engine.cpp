#include "launch/engine.h"

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <utility>

#include "kernels/accelerator.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/error.h"
#include "kernels/log.h"
#include "kernels/tunables.h"
#include "launch/hetegen_setup.h"
#include "launch/progress.h"
#include "placement/pie.h"
#include "placement/policy.h"
#include "placement/stage_budget.h"
#include "placement/stage_placement.h"
#include "worker/dummy.h"

namespace strata::cli {

int pick_device(const std::string& choice, const AcceleratorInfo& acc, int auto_index) {
  auto log = log::get("launch");
  if (choice == "cpu" || choice == "host") return -1;
  if (choice == "auto") {
    if (!acc.available()) {
      log->info("{}; using the CPU", acc.str());
      return -1;
    }
    log->info("found {}", acc.str());
    return std::max(auto_index, 0) % static_cast<int>(acc.devices.size());
  }
  int index = 0;
  if (choice.rfind("cuda:", 0) == 0) {
    try {
      index = std::stoi(choice.substr(5));
    } catch (const std::exception&) {
      index = -1;
    }
  } else if (choice != "cuda") {
    fail_input("--device '{}': expected auto, cpu, host, cuda or cuda:N", choice);
  }
  if (!acc.available()) fail_input("--device {}: {}", choice, acc.str());
  if (index < 0 || static_cast<size_t>(index) >= acc.devices.size())
    fail_input("--device {}: no such device ({} present)", choice, acc.devices.size());
  return index;
}

namespace {

// The parts of a policy the engine runs today; the rest is refused, not ignored.
struct PolicyChoice {
  int w_gpu = -1, w_cpu = -1;
  bool compress_weight = false;
  CacheOptions cache;
  bool overlap = true;
  int max_batch = 0;       // the block size when a policy is given
  int gpu_batch_size = 0;  // sequences per GPU batch of the block schedule
};

PolicyChoice apply_policy(const std::optional<Policy>& policy, bool device_compute) {
  PolicyChoice out;
  if (!policy) return out;
  const Policy& p = *policy;
  p.validate();
  check_engine_activations(p, device_compute);
  out.compress_weight = p.compress_weight;
  out.w_gpu = p.w_gpu_percent;
  out.w_cpu = p.w_cpu_percent;
  out.cache.placement.gpu_percent = p.cache_gpu_percent;
  out.cache.placement.cpu_percent = p.cache_cpu_percent;
  out.cache.cpu_attention = p.cpu_cache_compute;
  out.cache.placement.compress = p.compress_cache;
  out.cache.placement.dtype = p.cache_f16 ? DType::kF16 : DType::kF32;
  out.overlap = p.overlap;
  // The block schedule only when the policy names it; otherwise --max-batch (or bench's
  // --batch) is one GPU batch.
  if (p.names_block()) {
    out.max_batch = static_cast<int>(p.block_size());
    out.gpu_batch_size = static_cast<int>(p.gbs());
  }
  return out;
}

// Pie as the command line asks for it (placement/pie.h decides).
PieRequest pie_request(const EngineOptions& o) {
  PieRequest q;
  q.host_layers = o.pie_host_layers;
  q.adaptive = o.pie_adaptive;
  q.min_host_layers = o.pie_min_host_layers;
  q.max_host_layers = o.pie_max_host_layers;
  if (o.policy) {
    q.policy_host_layers = o.policy->pie_host_layers;
    q.policy = o.policy->compact();
  }
  return q;
}

// Checked when a run sizes its cache (Model::make_cache), before anything of it is allocated:
// the stage placed with that cache against the budgets (placement/stage_budget.h).
void check_stage_memory(const EngineOptions& o, const ComputeSetup& c, Model& model,
                        const KvPackingOptions& packing) {
  // c.load.device, not c.device_compute(): the engine has taken the backends by now.
  const bool device = c.load.device != nullptr;
  StageRequest base = weight_request(c.load);
  if (!device) base.budgets.gpu = -1;  // ignored on the host, with a warning
  if (base.budgets.gpu < 0 && base.budgets.cpu < 0 && base.budgets.disk < 0) return;
  if (o.policy) base.policy = *o.policy;
  base.max_rows = model.max_rows();
  if (c.cache.placement.pie.enabled()) {
    const PieOptions& pie = c.cache.placement.pie;
    base.pie =
        PieHostLayers{pie.lowest_host_layers(), pie.highest_host_layers(model.config().n_layers)};
  }
  const ModelShape shape = model.config().shape();
  const std::string policy = o.policy ? o.policy->compact() : std::string();
  const int64_t packed = device ? 0 : packing.budget;  // S3 commits host pages as it fills them
  // Scoring sizes a cache per text: the warning without a policy is said once.
  auto warned = std::make_shared<bool>(false);
  model.set_cache_check([base, shape, policy, packed, warned](int32_t slots, int32_t capacity) {
    StageRequest r = base;
    r.kv_slots = slots;
    r.kv_capacity = capacity;
    if (packed > 0 && packed < int64_t{slots} * capacity) r.kv_positions = packed;
    const std::vector<std::string> warnings =
        check_cache_budgets(place_stage(shape, r), r.budgets, policy, slots, capacity);
    if (!warnings.empty() && !std::exchange(*warned, true))
      log::get("launch")->warn("{}", warnings.front());
  });
}

// HeteGen's alpha from --hetegen-alpha or a policy's hetegen= (what `strata plan` chose).
double hetegen_alpha(const EngineOptions& o) {
  const int percent = o.policy ? o.policy->hetegen_alpha_percent : 0;
  if (percent == 0) return o.hetegen_alpha;
  if (o.hetegen_alpha_auto || (o.hetegen_alpha != 0 && o.hetegen_alpha != percent / 100.0))
    fail_input("--hetegen-alpha {} and --policy hetegen={}: give alpha once",
               o.hetegen_alpha_auto ? std::string("auto") : fmt::format("{}", o.hetegen_alpha),
               percent);
  return percent / 100.0;
}

}  // namespace

ComputeSetup make_compute(const EngineOptions& o, int auto_index) {
  auto log = log::get("launch");
  ComputeSetup c;
  c.cpu = std::make_unique<CpuBackend>(o.threads);
  c.device = pick_device(o.device, probe_accelerators(), auto_index);
  c.backend = c.cpu.get();
  if (c.device >= 0) {
    c.gpu = make_cuda_backend(c.device);
    c.backend = c.gpu.get();
  } else if (o.device == "host") {
    // A second CPU backend in the device's role: weight tiers, --gpu-mem, the cache's GPU
    // tier, Pie's swaps and HeteGen's splits all run, their copies within host memory. It
    // shows the offloading mechanics (bytes, overlap, stalls) on a machine with no GPU;
    // it is not faster than --device cpu.
    c.gpu = std::make_unique<CpuBackend>(o.threads);
    c.backend = c.gpu.get();
    c.cpu->bind_thread();
    log->info("the CPU stands in for a device (--device host)");
  }
  log->info("backend: {}", c.backend->name());
  LoadOptions& lo = c.load;
  lo.dummy_dtype = parse_dtype(o.dtype).value_or(DType::kF32);
  lo.dummy_seed = o.weight_seed;
  lo.cpu_mem = o.cpu_mem.empty() ? -1 : parse_size(o.cpu_mem, "--cpu-mem");
  lo.gpu_mem = o.gpu_mem.empty() ? -1 : parse_size(o.gpu_mem, "--gpu-mem");
  lo.disk_mem = o.disk_mem.empty() ? -1 : parse_size(o.disk_mem, "--disk-mem");
  if (!c.device_compute() && lo.gpu_mem >= 0)
    log->warn("--gpu-mem ignored: the engine computes on the CPU");
  // HeteGen splits work between a device and the CPU; where the CPU computes everything
  // already there is nothing to split, and like --gpu-mem the option is ignored, not refused
  // (the same command line then runs on machines with and without a GPU).
  const double alpha = hetegen_alpha(o);
  const bool hetegen = alpha != 0 || o.hetegen_alpha_auto;
  if (o.hetegen_cpu_threads > 0 && !hetegen)
    fail_input("--hetegen-cpu-threads requires --hetegen-alpha (or a policy's hetegen=)");
  if (hetegen && !c.device_compute()) {
    log->warn("--hetegen-alpha ignored: the engine computes on the CPU");
  } else if (hetegen) {
    c.hetegen_cpu =
        std::make_unique<CpuBackend>(o.hetegen_cpu_threads > 0 ? o.hetegen_cpu_threads : o.threads);
    lo.hetegen_alpha = alpha;  // auto: set by plan_hetegen before the model loads
    lo.hetegen_cpu = c.hetegen_cpu.get();
    c.cpu->bind_thread();  // the new backend set this thread's OpenMP count to its own
    log->info("HeteGen: CPU-tier layers split at alpha {}, the CPU shares on {}",
              o.hetegen_alpha_auto ? std::string("auto") : fmt::format("{}", alpha),
              c.hetegen_cpu->name());
  }
  lo.disk_dir = o.disk_dir;
  lo.resident_experts = o.resident_experts;
  lo.expert_cache_slots = o.expert_cache;
  lo.limits = input_limits(o.limits);
  lo.check_weights = o.check_weights;
  // The activations are sized by these before any request arrives.
  lo.limits.check(&InputLimits::batch, o.max_batch, "command line", "--max-batch");
  lo.limits.check(&InputLimits::step_tokens, o.max_step_tokens, "command line",
                  "--max-step-tokens");
  lo.device = c.device_compute() ? c.backend : nullptr;
  lo.on_layer = [progress = progress_callback("loading layers")](int32_t loaded, int32_t total) {
    progress(static_cast<size_t>(loaded), static_cast<size_t>(total));
  };
  if (o.policy_auto)
    fail_input("--policy auto: only `strata bench` searches for a policy; give key=value pairs");
  PolicyChoice pc = apply_policy(o.policy, c.device_compute());
  lo.w_gpu_percent = pc.w_gpu;
  lo.w_cpu_percent = pc.w_cpu;
  lo.compress_weight = pc.compress_weight;
  lo.overlap = o.overlap && pc.overlap;
  c.cache = pc.cache;
  c.cache.placement.disk_dir = o.disk_dir;
  c.cache.host = c.cpu.get();
  // Pie swaps between a device and the host; where the CPU computes, there is no device
  // memory to expand, and like --gpu-mem the options are ignored, not refused.
  const PieRequest pie = pie_request(o);
  if (pie.asked() && !c.device_compute()) {
    log->warn("{} ignored: the engine computes on the CPU", pie.option());
  } else if (pie.asked()) {
    c.cache.placement.pie = engine_pie(pie, c.cache.placement.gpu_percent, c.cache.placement.str());
  }
  c.max_batch = pc.max_batch;
  c.gpu_batch_size = pc.gpu_batch_size;
  return c;
}

Engine make_engine(const EngineOptions& o) {
  auto log = log::get("launch");
  Engine e;
  e.local.packing = packing_options(o);  // refused before anything loads
  ComputeSetup c = make_compute(o);
  e.cpu = std::move(c.cpu);
  e.gpu = std::move(c.gpu);
  e.hetegen_cpu = std::move(c.hetegen_cpu);
  e.backend = c.backend;
  if (o.profile) {
    e.profiler = std::make_unique<ProfilingBackend>(*e.backend);
    e.backend = e.profiler.get();
    if (c.load.device != nullptr) c.load.device = e.backend;
  }
  if (c.cache.placement.pie.enabled()) {  // refused before the weights load
    const ModelConfig config = load_spec_config(o.model, c.load.dummy_dtype);
    check_pie_layers(pie_request(o), c.cache.placement.pie, config.n_layers, config.source);
  }
  if (c.load.hetegen_cpu != nullptr) {  // alpha benchmark, module scheduler (HeteGen's Fig. 4)
    plan_hetegen(o, c.load, load_spec_config(o.model, c.load.dummy_dtype));
    e.cpu->bind_thread();  // the benchmark's CPU backend set this thread's OpenMP count
  }
  LoadedModel m = load_model(o.model, c.load);
  log->info("model: {}", m.config.str());
  log->info("weights: {}", m.placement.str());
  if (c.load.hetegen_alpha != 0 && m.placement.split_layers() == 0)
    log->warn("--hetegen-alpha: no CPU-tier layer to split (HeteGen splits only those)");
  e.config = m.config;
  e.placement = m.placement;
  e.tokenizer = std::move(m.tokenizer);
  e.local.max_batch = c.max_batch > 0 ? c.max_batch : o.max_batch;
  e.local.max_step_tokens = o.max_step_tokens;
  const int32_t rows = std::max(e.local.max_batch, o.max_step_tokens);
  e.model = std::make_unique<Model>(m.config, std::move(m.weights), *e.backend, rows,
                                    std::move(m.streamer), std::move(m.feeder));
  e.model->set_experts(std::move(m.experts));
  e.model->set_cache_options(c.cache);
  e.model->set_gpu_batch_size(c.gpu_batch_size);
  check_stage_memory(o, c, *e.model, e.local.packing);
  if (c.cache.placement.pie.enabled())
    log->info("Pie: {} over {} KV-cache layers", c.cache.placement.pie.str(), e.config.n_layers);
  if (o.policy)
    log->info("{}; kv cache {}{}",
              c.gpu_batch_size > 0
                  ? fmt::format("block: {} GPU batch(es) of {} sequences",
                                c.max_batch / c.gpu_batch_size, c.gpu_batch_size)
                  : fmt::format("block: one GPU batch of --max-batch {}", e.local.max_batch),
              c.cache.placement.str(), c.cache.cpu_attention ? ", attention on the CPU" : "");
  return e;
}

std::string profile_dir() {
  if (const auto d = tunable_text(TunableId::kProfileDir)) return *d;
  if (const auto home = foreign_variable("HOME"); home && !home->empty())
    return *home + "/.cache/strata/profiles";
  return "/tmp/strata-profiles";
}

}  // namespace strata::cli
