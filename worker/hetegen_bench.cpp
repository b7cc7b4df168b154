#include "worker/hetegen_bench.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <vector>

#include "kernels/clock.h"
#include "kernels/error.h"
#include "kernels/quant.h"
#include "worker/split_linear.h"
#include "worker/weights.h"

namespace strata {

namespace {

// What one measurement reuses: the module's weights and bias on the host, its bytes again in
// page-locked memory (the transfer's source) and a device buffer (its destination), x and y.
struct Bench {
  Backend& device;
  Backend& cpu;
  ModuleShapeKey shape;
  int32_t rows = 1;
  int repeats = 1;
  std::unique_ptr<OwnedTensor> w, bias;
  DeviceBuffer pinned, on_device;
  std::vector<float> x, y;

  Bench(Backend& d, Backend& c, const ModuleShapeKey& s, int32_t r, int reps)
      : device(d), cpu(c), shape(s), rows(r), repeats(reps) {
    std::mt19937 rng(1234);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float> v(static_cast<size_t>(s.out * s.in));
    for (float& f : v) f = u(rng);
    w = std::make_unique<OwnedTensor>(s.dtype, Shape{s.out, s.in});
    if (s.dtype == DType::kQ4) {
      write_q4_blob(quantize_4bit(v.data(), {s.out, s.in, kQuantGroupSize, QuantAxis::kAlongRow}),
                    w->view.data);
    } else {
      convert_from_f32(s.dtype, v.data(), w->view.data, v.size());
    }
    if (s.bias) {
      bias = std::make_unique<OwnedTensor>(DType::kF32, Shape{s.out});
      std::fill_n(bias->view.f32(), s.out, 0.5f);
    }
    // A share is its weight rows and, with a bias, their bias values (see operator()).
    const size_t share_max =
        w->view.bytes() + (s.bias ? static_cast<size_t>(s.out) * sizeof(float) : 0);
    pinned = DeviceBuffer::host(device, share_max);
    std::memcpy(pinned.data(), w->view.data, w->view.bytes());
    on_device = DeviceBuffer(device, share_max);
    x.assign(static_cast<size_t>(rows * s.in), 0.25f);
    y.assign(static_cast<size_t>(rows * s.out), 0.0f);
    KernelBounds b;
    b.max_rows = rows;
    b.add_weight(s.out, s.in, s.dtype, true);
    cpu.reserve(b);
  }

  hetegen::AlphaTiming operator()(double alpha) {
    const SplitLinearWeights split(w->view, bias ? bias->view : Tensor{}, alpha, device, cpu,
                                   SplitShare::kStreamed);
    hetegen::AlphaTiming t;
    const size_t share = split.gpu_weight().bytes() +
                         (shape.bias ? static_cast<size_t>(split.gpu_rows()) * sizeof(float) : 0);
    double cpu_best = 1e30, trans_best = 1e30;
    cpu.bind_thread();
    for (int rep = 0; rep <= repeats; ++rep) {  // rep 0 warms up, untimed
      if (split.cpu_rows() > 0) {
        const auto t0 = std::chrono::steady_clock::now();
        cpu.linear(x.data(), rows, split.cpu_weight(), split.cpu_bias(), y.data());
        if (rep > 0) cpu_best = std::min(cpu_best, seconds_since(t0));
      }
      if (share > 0) {
        const auto t0 = std::chrono::steady_clock::now();
        device.host_waits(
            device.transfer(on_device.data(), pinned.data(), share, CopyKind::kHostToDevice));
        if (rep > 0) trans_best = std::min(trans_best, seconds_since(t0));
      }
    }
    t.t_cpu = split.cpu_rows() > 0 ? cpu_best : 0;
    t.t_trans = share > 0 ? trans_best : 0;
    t.t_pin = 0;  // the shares are page-locked at load
    return t;
  }
};

}  // namespace

hetegen::AlphaMeasure module_alpha_measure(Backend& device, Backend& cpu,
                                           const ModuleShapeKey& shape, int32_t rows, int repeats) {
  STRATA_CHECK(shape.out > 0 && shape.in > 0 && rows > 0 && repeats > 0,
               "alpha benchmark of {} over {} rows, {} repeats", shape.str(), rows, repeats);
  auto bench = std::make_shared<Bench>(device, cpu, shape, rows, repeats);
  return [bench](double alpha) { return (*bench)(alpha); };
}

namespace {

constexpr int kAlphaBenchRepeats = 5;

nlohmann::json load_profile(const std::string& path, spdlog::logger& log) {
  std::ifstream in(path);
  if (!in) return nlohmann::json::object();
  try {
    nlohmann::json j = nlohmann::json::parse(in);
    if (j.is_object() && j.value("version", 0) == 1 && j.contains("modules")) return j;
  } catch (const nlohmann::json::exception&) {
  }
  log.warn("HeteGen: ignoring the unreadable node profile {}", path);
  return nlohmann::json::object();
}

void save_profile(const std::string& path, const nlohmann::json& j, spdlog::logger& log) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(fs::path(path).parent_path(), ec);
  const std::string tmp = fmt::format("{}.{}.tmp", path, ::getpid());
  {
    std::ofstream out(tmp);
    out << j.dump(2) << "\n";
    if (!out) {
      log.warn("HeteGen: cannot write the node profile {}", path);
      return;
    }
  }
  fs::rename(tmp, path, ec);  // whole or not at all
  if (ec) log.warn("HeteGen: cannot write the node profile {}: {}", path, ec.message());
}

}  // namespace

hetegen::SlotAlphas benchmark_slot_alphas(const hetegen::SlotModules& modules, int32_t rows,
                                          Backend& device, Backend& cpu, const std::string& path,
                                          spdlog::logger& log) {
  nlohmann::json profile = load_profile(path, log);
  if (!profile.contains("modules"))
    profile = {{"version", 1}, {"modules", nlohmann::json::object()}};
  bool measured = false;
  hetegen::SlotAlphas out;
  for (int i = 0; i < hetegen::kModuleSlots; ++i) {
    const hetegen::SlotModule& m = modules[static_cast<size_t>(i)];
    if (!m.present) continue;
    const std::string key =
        fmt::format("{} rows={} device={} cpu={}", m.key.str(), rows, device.name(), cpu.name());
    nlohmann::json& entry = profile["modules"][key];
    const bool cached = entry.is_object() && entry.contains("alpha");
    if (!cached) {
      const hetegen::AlphaBenchmarkResult r = hetegen::benchmark_module(
          module_alpha_measure(device, cpu, m.key, rows, kAlphaBenchRepeats),
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
    log.info(
        "HeteGen alpha benchmark: {} module {}: alpha {:.3f} (T_cpu {:.3g} ms, T_com {:.3g} "
        "ms{}), {} {}",
        hetegen::module_slot_name(i), key, out[static_cast<size_t>(i)].alpha,
        entry["t_cpu"].get<double>() * 1e3, entry["t_com"].get<double>() * 1e3,
        entry.value("crossed", true) ? "" : "; no crossing: clamped",
        cached ? "reused from" : "measured, saved to", path);
  }
  if (measured) save_profile(path, profile, log);
  return out;
}

}  // namespace strata
