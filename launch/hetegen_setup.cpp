#include "launch/hetegen_setup.h"

#include <algorithm>

#include "kernels/error.h"
#include "kernels/log.h"
#include "launch/engine.h"
#include "placement/hetegen.h"
#include "worker/hetegen_bench.h"

namespace strata::cli {
namespace {

// Section 4.5 over every module of every layer, all split to begin with.
void schedule_modules_whole(const ModelShape& shape, const hetegen::SlotModules& modules,
                            const hetegen::SlotAlphas& alphas, LoadOptions& lo) {
  lo.w_gpu_percent = 0;  // every layer split; the scheduler decides what goes whole
  lo.w_cpu_percent = 100;
  const hetegen::StageModuleSchedule s =
      hetegen::schedule_stage_modules(shape, weight_request(lo), lo.gpu_mem, modules, alphas);
  if (!s.scheduled) return;  // the load refuses it, naming the shortfall
  lo.hetegen_whole = s.whole;
  std::string order;
  for (size_t k = 0; k < s.moved.size() && k < 8; ++k)
    order += fmt::format("{}{}", k > 0 ? ", " : "", s.moved[k]);
  if (s.moved.size() > 8) order += ", ...";
  log::get("launch")->info(
      "HeteGen module scheduler: {} of {} modules whole on the device, the rest split ({:.3f} of "
      "{:.3f} MiB left after the fixed parts; by gain T_cpu / Mem: {})",
      s.moved.size(), s.modules, static_cast<double>(s.used) / (1 << 20),
      static_cast<double>(s.budget) / (1 << 20), s.moved.empty() ? "none" : order);
}

}  // namespace

std::string hetegen_profile_path() {
  return profile_dir() + "/hetegen-alpha.json";
}

void plan_hetegen(const EngineOptions& o, LoadOptions& lo, const ModelConfig& config) {
  STRATA_CHECK(lo.device != nullptr && lo.hetegen_cpu != nullptr, "HeteGen without its backends");
  const ModelShape shape = config.shape();
  const hetegen::SlotModules modules = hetegen::slot_modules(shape, lo.compress_weight);
  hetegen::SlotAlphas alphas;
  if (o.hetegen_alpha_auto) {
    // At the engine's full decode batch: a CPU share's time grows with its rows while the
    // alpha share's copy does not, so a larger batch moves alpha towards the device.
    const int32_t rows = std::max(1, o.max_batch);
    alphas = benchmark_slot_alphas(modules, rows, *lo.device, *lo.hetegen_cpu,
                                   hetegen_profile_path(), *log::get("launch"));
    lo.hetegen_slot_alpha.clear();
    for (const hetegen::SlotAlpha& a : alphas) lo.hetegen_slot_alpha.push_back(a.alpha);
    // The switch (and what the placement prints); the modules take their own alphas.
    lo.hetegen_alpha = hetegen::switch_alpha(alphas);
  } else {
    alphas = hetegen::fixed_slot_alphas(modules, lo.hetegen_alpha);
  }
  if (lo.gpu_mem >= 0 && lo.w_gpu_percent < 0 && lo.w_cpu_percent < 0)
    schedule_modules_whole(shape, modules, alphas, lo);
}

}  // namespace strata::cli
