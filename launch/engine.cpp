#include "launch/engine.h"

#include <algorithm>

#include "kernels/accelerator.h"
#include "kernels/error.h"
#include "kernels/log.h"

namespace strata::cli {

Engine make_engine(const EngineOptions& o) {
  auto log = log::get("launch");
  const AcceleratorInfo acc = probe_accelerators();
  Engine e;
  auto cpu = std::make_unique<CpuBackend>(o.threads);
  if (acc.available()) {
    log->info("found {}; the engine computes on the CPU until the CUDA engine path lands", acc.str());
  } else {
    log->info("{}; using the CPU", acc.str());
  }
  log->info("backend: {}", cpu->name());
  e.cpu = std::move(cpu);
  e.backend = e.cpu.get();
  if (o.profile) {
    e.profiler = std::make_unique<ProfilingBackend>(*e.cpu);
    e.backend = e.profiler.get();
  }

  LoadOptions lo;
  lo.dummy_dtype = parse_dtype(o.dtype).value_or(DType::kF32);
  lo.dummy_seed = o.weight_seed;
  lo.cpu_mem = o.cpu_mem.empty() ? -1 : parse_size(o.cpu_mem, "--cpu-mem");
  lo.disk_dir = o.disk_dir;
  lo.overlap = o.overlap;
  LoadedModel m = load_model(o.model, lo);
  log->info("model: {}", m.config.str());
  e.config = m.config;
  e.tokenizer = std::move(m.tokenizer);
  e.generator.max_batch = o.max_batch;
  e.generator.max_step_tokens = o.max_step_tokens;
  const int32_t rows = std::max(o.max_batch, o.max_step_tokens);
  if (!m.placement.disk_layers.empty()) log->info("weights: {}", m.placement.str());
  e.model = std::make_unique<Model>(m.config, std::move(m.weights), *e.backend, rows, std::move(m.streamer));
  return e;
}

}  // namespace strata::cli
