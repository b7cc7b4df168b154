#include "launch/engine.h"

#include <algorithm>

#include "kernels/accelerator.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/error.h"
#include "kernels/log.h"
#include "launch/progress.h"
#include "placement/policy.h"

namespace strata::cli {

namespace {

// -1: compute on the host; otherwise the CUDA device index to compute on.
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
  // Activations are per-step scratch on the compute tier.
  if (device_compute ? p.act_gpu_percent != 100 : p.act_disk_percent() != 0)
    fail_input(
        "--policy '{}': activations live on the compute tier ({}); h= other than that is not "
        "implemented",
        p.compact(), device_compute ? "h=100/0/0" : "h=0/100/0 on a CPU-only node");
  out.compress_weight = p.compress_weight;
  out.w_gpu = p.w_gpu_percent;
  out.w_cpu = p.w_cpu_percent;
  out.cache.placement.gpu_percent = p.cache_gpu_percent;
  out.cache.placement.cpu_percent = p.cache_cpu_percent;
  out.cache.cpu_attention = p.cpu_cache_compute;
  out.cache.placement.compress = p.compress_cache;
  out.overlap = p.overlap;
  // The block schedule only when the policy names it; otherwise --max-batch (or bench's
  // --batch) is one GPU batch.
  if (p.names_block()) {
    out.max_batch = static_cast<int>(p.block_size());
    out.gpu_batch_size = static_cast<int>(p.gbs());
  }
  return out;
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
  if (o.hetegen_alpha != 0 && !c.device_compute()) {
    log->warn("--hetegen-alpha ignored: the engine computes on the CPU");
  } else if (o.hetegen_alpha != 0) {
    c.hetegen_cpu =
        std::make_unique<CpuBackend>(o.hetegen_cpu_threads > 0 ? o.hetegen_cpu_threads : o.threads);
    lo.hetegen_alpha = o.hetegen_alpha;
    lo.hetegen_cpu = c.hetegen_cpu.get();
    c.cpu->bind_thread();  // the new backend set this thread's OpenMP count to its own
    log->info("HeteGen: CPU-tier layers split at alpha {}, the CPU shares on {}", o.hetegen_alpha,
              c.hetegen_cpu->name());
  }
  lo.disk_dir = o.disk_dir;
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
  e.model->set_cache_options(c.cache);
  e.model->set_gpu_batch_size(c.gpu_batch_size);
  if (o.policy)
    log->info("block: {} GPU batch(es) of {} sequences; kv cache {}{}",
              c.max_batch / std::max(1, c.gpu_batch_size), c.gpu_batch_size,
              c.cache.placement.str(), c.cache.cpu_attention ? ", attention on the CPU" : "");
  return e;
}

}  // namespace strata::cli
