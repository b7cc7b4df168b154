#include "launch/hetegen_setup.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "kernels/error.h"
#include "kernels/log.h"
#include "kernels/quant.h"
#include "launch/engine.h"
#include "placement/hetegen.h"
#include "placement/stage_placement.h"
#include "worker/hetegen_bench.h"
#include "worker/split_linear.h"

namespace strata::cli {
namespace {

constexpr int kSlots = hetegen::kModuleSlots;
constexpr int kBenchRepeats = 5;

struct SlotModule {
  bool present = false;
  ModuleShapeKey key;
  int64_t bytes = 0;  // weight and bias as stored
};

// The layer's modules in LinearSlot order (q, k, v, o, gate, up, down), as stored.
std::array<SlotModule, kSlots> slot_modules(const ModelShape& s, bool compress) {
  std::array<SlotModule, kSlots> out;
  const int64_t h = s.hidden, qw = s.q_width(), kvw = s.kv_width(), f = s.intermediate;
  auto set = [&](int i, bool present, int64_t rows, int64_t cols, bool bias) {
    if (!present) return;
    SlotModule& m = out[static_cast<size_t>(i)];
    m.present = true;
    const DType dtype = compress && cols % kQuantGroupSize == 0 ? DType::kQ4 : s.dtype;
    m.key = ModuleShapeKey{rows, cols, dtype, bias};
    m.bytes = static_cast<int64_t>(Tensor{nullptr, dtype, Shape{rows, cols}}.bytes()) +
              (bias ? rows * 4 : 0);
  };
  set(0, true, qw, h, s.attention_bias);
  set(1, true, kvw, h, s.attention_bias);
  set(2, true, kvw, h, s.attention_bias);
  set(3, true, h, qw, s.attention_bias);
  set(4, s.gated_mlp, f, h, false);
  set(5, true, f, h, s.mlp_bias);
  set(6, true, h, f, s.mlp_bias);
  return out;
}

nlohmann::json load_profile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return nlohmann::json::object();
  try {
    nlohmann::json j = nlohmann::json::parse(in);
    if (j.is_object() && j.value("version", 0) == 1 && j.contains("modules")) return j;
  } catch (const nlohmann::json::exception&) {
  }
  log::get("launch")->warn("HeteGen: ignoring the unreadable node profile {}", path);
  return nlohmann::json::object();
}

void save_profile(const std::string& path, const nlohmann::json& j) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(fs::path(path).parent_path(), ec);
  const std::string tmp = fmt::format("{}.{}.tmp", path, ::getpid());
  {
    std::ofstream out(tmp);
    out << j.dump(2) << "\n";
    if (!out) {
      log::get("launch")->warn("HeteGen: cannot write the node profile {}", path);
      return;
    }
  }
  fs::rename(tmp, path, ec);  // whole or not at all
  if (ec)
    log::get("launch")->warn("HeteGen: cannot write the node profile {}: {}", path, ec.message());
}

struct SlotAlpha {
  double alpha = 0;
  double t_cpu = 0;  // T-bar_cpu at alpha (eq. 11), seconds
};

// Alpha per module slot from the benchmark at `rows` activation rows (the decode step's),
// measured once per distinct module shape and row count and cached under `path`.
std::array<SlotAlpha, kSlots> benchmark_alphas(const std::array<SlotModule, kSlots>& modules,
                                               int32_t rows, Backend& device, Backend& cpu,
                                               const std::string& path) {
  auto log = log::get("launch");
  nlohmann::json profile = load_profile(path);
  if (!profile.contains("modules"))
    profile = {{"version", 1}, {"modules", nlohmann::json::object()}};
  bool measured = false;
  std::array<SlotAlpha, kSlots> out;
  for (int i = 0; i < kSlots; ++i) {
    const SlotModule& m = modules[static_cast<size_t>(i)];
    if (!m.present) continue;
    const std::string key =
        fmt::format("{} rows={} device={} cpu={}", m.key.str(), rows, device.name(), cpu.name());
    nlohmann::json& entry = profile["modules"][key];
    const bool cached = entry.is_object() && entry.contains("alpha");
    if (!cached) {
      const hetegen::AlphaBenchmarkResult r =
          hetegen::benchmark_module(module_alpha_measure(device, cpu, m.key, rows, kBenchRepeats),
                                    hetegen::engine_alpha_window());
      nlohmann::json samples = nlohmann::json::array();
      for (const hetegen::AlphaSample& x : r.samples)
        samples.push_back({x.alpha, x.timing.t_cpu, x.timing.t_pin, x.timing.t_trans});
      entry = {{"alpha", r.alpha},
               {"t_cpu", r.t_cpu},
               {"t_com", r.t_com},
               {"crossed", r.crossed},
               {"samples", samples}};
      measured = true;
    }
    out[static_cast<size_t>(i)] = {entry["alpha"].get<double>(), entry["t_cpu"].get<double>()};
    log->info(
        "HeteGen alpha benchmark: {} module {}: alpha {:.3f} (T_cpu {:.3g} ms, T_com {:.3g} "
        "ms{}), {} {}",
        hetegen::module_slot_name(i), key, out[static_cast<size_t>(i)].alpha,
        entry["t_cpu"].get<double>() * 1e3, entry["t_com"].get<double>() * 1e3,
        entry.value("crossed", true) ? "" : "; no crossing: clamped",
        cached ? "reused from" : "measured, saved to", path);
  }
  if (measured) save_profile(path, profile);
  return out;
}

// Section 4.5 over every module of every layer, all split to begin with.
void schedule_modules_whole(const ModelShape& shape, const std::array<SlotModule, kSlots>& modules,
                            const std::array<SlotAlpha, kSlots>& alphas, LoadOptions& lo) {
  auto log = log::get("launch");
  lo.w_gpu_percent = 0;  // every layer split; the scheduler decides what goes whole
  lo.w_cpu_percent = 100;
  StageRequest r = weight_request(lo);
  const int64_t fixed = place_weights(shape, r).gpu_bytes();
  const int64_t budget = lo.gpu_mem - fixed;
  if (budget < 0) return;  // the load refuses it, naming the shortfall
  std::vector<hetegen::Module> list;
  std::vector<std::pair<int32_t, int>> where;  // (layer, slot) of list[i]
  for (int32_t l = 0; l < static_cast<int32_t>(shape.n_layers); ++l)
    for (int i = 0; i < kSlots; ++i) {
      const SlotModule& m = modules[static_cast<size_t>(i)];
      if (!m.present) continue;
      list.push_back({hetegen_module_name(l, static_cast<LinearSlot>(i)), m.bytes,
                      alphas[static_cast<size_t>(i)].t_cpu, alphas[static_cast<size_t>(i)].alpha,
                      0});
      where.emplace_back(l, i);
    }
  const hetegen::HeteGenPlan plan = hetegen::schedule_modules(list, budget, true);
  r.hetegen_whole.assign(static_cast<size_t>(shape.n_layers) * kSlots, 0);
  std::vector<size_t> moved;  // in the order of gain they were moved in
  for (size_t i = 0; i < list.size(); ++i)
    if (plan.modules[i].placement == hetegen::ModulePlacement::kGpu) moved.push_back(i);
  std::stable_sort(moved.begin(), moved.end(),
                   [&](size_t a, size_t b) { return list[a].gain() > list[b].gain(); });
  for (size_t i : moved)
    r.hetegen_whole[static_cast<size_t>(where[i].first) * kSlots +
                    static_cast<size_t>(where[i].second)] = 1;
  // The packed blobs round each layer to a page: give back the last moves until it fits.
  while (!moved.empty() && place_weights(shape, r).gpu_bytes() > lo.gpu_mem) {
    const size_t i = moved.back();
    moved.pop_back();
    r.hetegen_whole[static_cast<size_t>(where[i].first) * kSlots +
                    static_cast<size_t>(where[i].second)] = 0;
  }
  lo.hetegen_whole = r.hetegen_whole;
  std::string order;
  for (size_t k = 0; k < moved.size() && k < 8; ++k)
    order += fmt::format("{}{}", k > 0 ? ", " : "", list[moved[k]].name);
  if (moved.size() > 8) order += ", ...";
  log->info(
      "HeteGen module scheduler: {} of {} modules whole on the device, the rest split ({:.3f} of "
      "{:.3f} MiB left after the fixed parts; by gain T_cpu / Mem: {})",
      moved.size(), list.size(),
      static_cast<double>(place_weights(shape, r).gpu_bytes() - fixed) / (1 << 20),
      static_cast<double>(budget) / (1 << 20), moved.empty() ? "none" : order);
}

}  // namespace

std::string hetegen_profile_path() {
  return profile_dir() + "/hetegen-alpha.json";
}

void plan_hetegen(const EngineOptions& o, LoadOptions& lo, const ModelConfig& config) {
  STRATA_CHECK(lo.device != nullptr && lo.hetegen_cpu != nullptr, "HeteGen without its backends");
  const ModelShape shape = config.shape();
  const std::array<SlotModule, kSlots> modules = slot_modules(shape, lo.compress_weight);
  std::array<SlotAlpha, kSlots> alphas;
  if (o.hetegen_alpha_auto) {
    // At the engine's full decode batch: a CPU share's time grows with its rows while the
    // alpha share's copy does not, so a larger batch moves alpha towards the device.
    const int32_t rows = std::max(1, o.max_batch);
    alphas = benchmark_alphas(modules, rows, *lo.device, *lo.hetegen_cpu, hetegen_profile_path());
    lo.hetegen_slot_alpha.assign(kSlots, 0.0);
    double top = 0;
    for (int i = 0; i < kSlots; ++i) {
      lo.hetegen_slot_alpha[static_cast<size_t>(i)] = alphas[static_cast<size_t>(i)].alpha;
      top = std::max(top, alphas[static_cast<size_t>(i)].alpha);
    }
    // The switch (and what the placement prints); the modules take their own alphas.
    lo.hetegen_alpha = top > 0 ? top : 1.0;
  } else {
    // A fixed alpha: the CPU's time modelled as its share of the module's bytes, so every
    // module has the same gain and the scheduler fills the device in layer order.
    for (int i = 0; i < kSlots; ++i)
      alphas[static_cast<size_t>(i)] = {
          lo.hetegen_alpha,
          (1 - lo.hetegen_alpha) * static_cast<double>(modules[static_cast<size_t>(i)].bytes)};
  }
  if (lo.gpu_mem >= 0 && lo.w_gpu_percent < 0 && lo.w_cpu_percent < 0)
    schedule_modules_whole(shape, modules, alphas, lo);
}

}  // namespace strata::cli
