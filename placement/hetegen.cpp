#include "placement/hetegen.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "kernels/error.h"

namespace strata::hetegen {
namespace {

void check_speed(const char* name, double v) {
  if (!(std::isfinite(v) && v > 0))
    fail_input("HeteGen: {} must be a positive, finite speed, got {}", name, v);
}

void check_time(const char* name, double t) {
  if (!(std::isfinite(t) && t >= 0))
    fail_input("HeteGen: {} must be a non-negative, finite time, got {}", name, t);
}

}  // namespace

double alpha_from_speeds(double v_cpu, double v_gpu, double v_com) {
  check_speed("V_cpu", v_cpu);
  check_speed("V_gpu", v_gpu);
  check_speed("V_com", v_com);
  return 1.0 / (v_cpu / v_com + v_cpu / v_gpu + 1.0);
}

double alpha_ignoring_gpu(double v_cpu, double v_com) {
  check_speed("V_cpu", v_cpu);
  check_speed("V_com", v_com);
  return v_com / (v_com + v_cpu);
}

double alpha_from_times(double t_cpu, double t_com) {
  check_time("T'_cpu", t_cpu);
  check_time("T'_com", t_com);
  if (t_cpu + t_com <= 0) fail_input("HeteGen: T'_cpu and T'_com are both 0");
  return t_cpu / (t_cpu + t_com);
}

double alpha_from_times(double t_cpu, double t_pin, double t_trans) {
  check_time("T'_cpu", t_cpu);
  check_time("T'_pin", t_pin);
  check_time("T'_trans", t_trans);
  const double t_com = std::max(t_pin, t_trans);
  if (t_com <= 0)
    fail_input("HeteGen: max(T'_pin, T'_trans) must be positive, got T'_pin {} and T'_trans {}",
               t_pin, t_trans);
  return t_cpu / (t_cpu + t_com);
}

double FittedPolynomial::operator()(double alpha) const {
  const double u = (alpha - center) / scale;
  double y = 0;
  for (size_t i = coef.size(); i-- > 0;) y = y * u + coef[i];  // Horner
  return y;
}

FittedPolynomial fit_polynomial(std::span<const double> x, std::span<const double> y, int degree) {
  if (degree < 1 || degree > kMaxFitDegree)
    fail_input("HeteGen fit: degree must be in [1, {}], got {}", kMaxFitDegree, degree);
  if (x.size() != y.size()) fail_input("HeteGen fit: {} alphas but {} times", x.size(), y.size());
  for (size_t i = 0; i < x.size(); ++i)
    if (!std::isfinite(x[i]) || !std::isfinite(y[i]))
      fail_input("HeteGen fit: sample {} is not finite (alpha {}, time {})", i, x[i], y[i]);
  std::vector<double> distinct(x.begin(), x.end());
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  if (distinct.size() <= static_cast<size_t>(degree))
    fail_input("HeteGen fit: a degree-{} polynomial needs {} distinct alphas, got {}", degree,
               degree + 1, distinct.size());

  FittedPolynomial p;
  p.center = std::accumulate(x.begin(), x.end(), 0.0) / static_cast<double>(x.size());
  p.scale = 0;
  for (double xi : x) p.scale = std::max(p.scale, std::fabs(xi - p.center));
  // Normal equations (V^T V) c = V^T y in u; n <= kMaxFitDegree + 1 unknowns, u in [-1, 1].
  const auto n = static_cast<size_t>(degree) + 1;
  std::vector<double> a(n * (n + 1), 0.0);  // augmented [n, n + 1]
  std::vector<double> pw(2 * n - 1);
  for (size_t s = 0; s < x.size(); ++s) {
    const double u = (x[s] - p.center) / p.scale;
    pw[0] = 1;
    for (size_t k = 1; k < pw.size(); ++k) pw[k] = pw[k - 1] * u;
    for (size_t r = 0; r < n; ++r) {
      for (size_t c = 0; c < n; ++c) a[r * (n + 1) + c] += pw[r + c];
      a[r * (n + 1) + n] += pw[r] * y[s];
    }
  }
  // Gaussian elimination with partial pivoting: enough distinct alphas make V^T V positive
  // definite, so no pivot vanishes.
  for (size_t col = 0; col < n; ++col) {
    size_t piv = col;
    for (size_t r = col + 1; r < n; ++r)
      if (std::fabs(a[r * (n + 1) + col]) > std::fabs(a[piv * (n + 1) + col])) piv = r;
    if (piv != col)
      for (size_t c = 0; c <= n; ++c) std::swap(a[col * (n + 1) + c], a[piv * (n + 1) + c]);
    const double d = a[col * (n + 1) + col];
    STRATA_CHECK(d != 0, "singular normal equations at column {}", col);
    for (size_t r = col + 1; r < n; ++r) {
      const double f = a[r * (n + 1) + col] / d;
      for (size_t c = col; c <= n; ++c) a[r * (n + 1) + c] -= f * a[col * (n + 1) + c];
    }
  }
  p.coef.assign(n, 0.0);
  for (size_t r = n; r-- > 0;) {
    double s = a[r * (n + 1) + n];
    for (size_t c = r + 1; c < n; ++c) s -= a[r * (n + 1) + c] * p.coef[c];
    p.coef[r] = s / a[r * (n + 1) + r];
  }
  return p;
}

void AlphaBenchmarkOptions::validate() const {
  if (!(alpha0 >= 0 && alpha0 <= 1))
    fail_input("HeteGen alpha benchmark: alpha0 must be in [0, 1], got {}", alpha0);
  if (!(gamma > 0 && gamma <= 1))
    fail_input("HeteGen alpha benchmark: gamma must be in (0, 1], got {}", gamma);
  if (!(lambda > 0 && lambda <= 2 * gamma))
    fail_input("HeteGen alpha benchmark: lambda must be in (0, 2 x gamma = {}], got {}", 2 * gamma,
               lambda);
  if (degree < 1 || degree > kMaxFitDegree)
    fail_input("HeteGen alpha benchmark: degree must be in [1, {}], got {}", kMaxFitDegree, degree);
}

std::vector<double> alpha_grid(const AlphaBenchmarkOptions& o) {
  o.validate();
  std::vector<double> out;
  // Counted, not accumulated, so the last point lands on alpha0 + gamma despite rounding.
  const auto steps = static_cast<int64_t>(std::floor(2 * o.gamma / o.lambda + 1e-9));
  for (int64_t i = 0; i <= steps; ++i) {
    const double a = o.alpha0 - o.gamma + static_cast<double>(i) * o.lambda;
    if (a >= -1e-12 && a <= 1 + 1e-12) out.push_back(std::clamp(a, 0.0, 1.0));
  }
  return out;
}

AlphaBenchmarkResult fit_alpha(std::span<const AlphaSample> samples, int degree) {
  if (samples.empty()) fail_input("HeteGen alpha benchmark: no samples to fit");
  std::vector<double> xs, cpu, com;
  for (const AlphaSample& s : samples) {
    if (!(s.alpha >= 0 && s.alpha <= 1))
      fail_input("HeteGen alpha benchmark: sample alpha must be in [0, 1], got {}", s.alpha);
    check_time(fmt::format("T_cpu at alpha {}", s.alpha).c_str(), s.timing.t_cpu);
    check_time(fmt::format("T_pin at alpha {}", s.alpha).c_str(), s.timing.t_pin);
    check_time(fmt::format("T_trans at alpha {}", s.alpha).c_str(), s.timing.t_trans);
    xs.push_back(s.alpha);
    cpu.push_back(s.timing.t_cpu);
    com.push_back(s.timing.t_com());
  }
  AlphaBenchmarkResult r;
  r.samples.assign(samples.begin(), samples.end());
  r.f_cpu = fit_polynomial(xs, cpu, degree);
  r.f_com = fit_polynomial(xs, com, degree);
  const auto diff = [&](double a) { return r.f_cpu(a) - r.f_com(a); };

  // Scan [0, 1] for brackets where F_cpu - F_com turns from positive to not positive, then
  // bisect each on that predicate. A polynomial of degree <= 6 has at most 6 roots, far
  // apart next to the 1/1024 scan step unless two nearly touch (a tangency, no real balance).
  constexpr int kScan = 1024;
  const double mean = r.f_cpu.center;
  double best = -1;
  for (int i = 0; i < kScan; ++i) {
    double lo = static_cast<double>(i) / kScan, hi = static_cast<double>(i + 1) / kScan;
    if (!(diff(lo) > 0 && !(diff(hi) > 0))) continue;
    for (int it = 0; it < 100 && hi - lo > 1e-15; ++it) {
      const double mid = 0.5 * (lo + hi);
      (diff(mid) > 0 ? lo : hi) = mid;
    }
    const double root = 0.5 * (lo + hi);
    if (best < 0 || std::fabs(root - mean) < std::fabs(best - mean)) best = root;
  }
  if (best >= 0) {
    r.crossed = true;
    r.alpha = best;
  } else {
    // No balance point in [0, 1]: one side is slower everywhere, so the module's time
    // max(T_cpu, T_com) is smallest at an end; take the end where it is smaller.
    const double at0 = std::max(r.f_cpu(0.0), r.f_com(0.0));
    const double at1 = std::max(r.f_cpu(1.0), r.f_com(1.0));
    r.crossed = false;
    r.alpha = at1 < at0 ? 1.0 : 0.0;
  }
  r.t_cpu = r.f_cpu(r.alpha);
  r.t_com = r.f_com(r.alpha);
  return r;
}

AlphaBenchmarkResult run_alpha_benchmark(const AlphaBenchmarkOptions& options,
                                         const AlphaMeasure& measure) {
  STRATA_CHECK(static_cast<bool>(measure), "alpha benchmark without a measurement");
  const std::vector<double> grid = alpha_grid(options);
  if (grid.size() <= static_cast<size_t>(options.degree))
    fail_input(
        "HeteGen alpha benchmark: the window alpha0 {} +- gamma {} in steps of lambda {} holds "
        "{} alphas inside [0, 1]; a degree-{} fit needs {}",
        options.alpha0, options.gamma, options.lambda, grid.size(), options.degree,
        options.degree + 1);
  std::vector<AlphaSample> samples;
  samples.reserve(grid.size());
  for (double a : grid) samples.push_back({a, measure(a)});
  return fit_alpha(samples, options.degree);
}

AlphaBenchmarkResult benchmark_module(const AlphaMeasure& measure, AlphaBenchmarkOptions window) {
  STRATA_CHECK(static_cast<bool>(measure), "alpha benchmark without a measurement");
  const AlphaTiming all_cpu = measure(0.0);
  const AlphaTiming all_gpu = measure(1.0);
  window.alpha0 = alpha_from_times(all_cpu.t_cpu, all_gpu.t_pin, all_gpu.t_trans);
  return run_alpha_benchmark(window, measure);
}

std::string AlphaBenchmarkResult::str() const {
  std::string s = fmt::format(
      "alpha benchmark: alpha-bar {:.4f} ({}), T-bar_cpu {:.6g}, T-bar_com {:.6g}, {} samples",
      alpha, crossed ? "F_cpu = F_com" : "no crossing in [0, 1]: clamped", t_cpu, t_com,
      samples.size());
  for (const AlphaSample& x : samples)
    s += fmt::format("\n  alpha {:.4f}: T_cpu {:.6g}, T_pin {:.6g}, T_trans {:.6g}", x.alpha,
                     x.timing.t_cpu, x.timing.t_pin, x.timing.t_trans);
  return s;
}

const char* module_placement_name(ModulePlacement p) {
  return p == ModulePlacement::kGpu ? "gpu" : "split";
}

int64_t split_gpu_rows(double alpha, int64_t out) {
  STRATA_CHECK(alpha >= 0 && alpha <= 1 && out >= 0, "split of {} rows at alpha {}", out, alpha);
  // ceil in floating point can land one above alpha x out when the product is an integer
  // that rounding nudged up (0.3 x 10 = 3.0000000000000004); a tolerance keeps it at 3.
  const double rows = alpha * static_cast<double>(out);
  const auto r = static_cast<int64_t>(std::ceil(rows - 1e-9 * std::max(1.0, rows)));
  return std::clamp<int64_t>(r, 0, out);
}

int64_t split_gpu_bytes(const Module& m) {
  return static_cast<int64_t>(std::ceil(m.alpha * static_cast<double>(m.bytes)));
}

HeteGenPlan schedule_modules(std::span<const Module> modules, int64_t gpu_budget, bool streamed) {
  HeteGenPlan plan;
  plan.gpu_budget = gpu_budget;
  if (gpu_budget < 0) fail_input("HeteGen scheduler: GPU budget {} is negative", gpu_budget);
  for (const Module& m : modules) {
    if (m.bytes <= 0) fail_input("HeteGen scheduler: module {} has {} bytes", m.name, m.bytes);
    if (!(m.alpha >= 0 && m.alpha <= 1))
      fail_input("HeteGen scheduler: module {} alpha must be in [0, 1], got {}", m.name, m.alpha);
    check_time(fmt::format("T_cpu of module {}", m.name).c_str(), m.t_cpu);
    check_time(fmt::format("T_gpu of module {}", m.name).c_str(), m.t_gpu);
    ModulePlan p;
    p.name = m.name;
    p.alpha = m.alpha;
    p.gain = m.gain();
    p.gpu_bytes = streamed ? 0 : split_gpu_bytes(m);
    p.time = m.t_cpu;
    plan.gpu_bytes += p.gpu_bytes;
    plan.modules.push_back(p);
  }
  if (plan.gpu_bytes > gpu_budget)
    fail_input(
        "HeteGen scheduler: GPU budget {} bytes is below the {} bytes the split modules keep "
        "on the GPU at their alphas",
        gpu_budget, plan.gpu_bytes);

  std::vector<size_t> order(modules.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return modules[a].gain() > modules[b].gain(); });
  for (size_t i : order) {
    ModulePlan& p = plan.modules[i];
    const int64_t extra = modules[i].bytes - p.gpu_bytes;
    if (plan.gpu_bytes + extra > gpu_budget) break;
    plan.gpu_bytes += extra;
    p.placement = ModulePlacement::kGpu;
    p.alpha = 1;
    p.gpu_bytes = modules[i].bytes;
    p.time = modules[i].t_gpu;
  }
  for (const ModulePlan& p : plan.modules) plan.time += p.time;
  return plan;
}

double HeteGenPlan::alpha_of(const std::string& name) const {
  for (const ModulePlan& p : modules)
    if (p.name == name) return p.alpha;
  fail_input("HeteGen plan: no module named '{}'", name);
}

std::string HeteGenPlan::str() const {
  std::string s = fmt::format("HeteGen plan: {} modules, GPU {} of {} bytes, predicted {:.6g} s",
                              modules.size(), gpu_bytes, gpu_budget, time);
  for (const ModulePlan& p : modules)
    s += fmt::format("\n  {}: {} alpha {:.4f} gain {:.6g} s/B gpu {} B time {:.6g} s", p.name,
                     module_placement_name(p.placement), p.alpha, p.gain, p.gpu_bytes, p.time);
  return s;
}

const char* module_slot_name(int slot) {
  return slot >= 0 && slot < kModuleSlots ? linear_slot_name(static_cast<LinearSlot>(slot)) : "?";
}

double module_alpha(double alpha, std::span<const double> slot_alpha, int slot) {
  STRATA_CHECK(slot >= 0 && slot < kModuleSlots, "module slot {}", slot);
  return slot_alpha.empty() ? alpha : slot_alpha[static_cast<size_t>(slot)];
}

bool module_whole(std::span<const uint8_t> whole, int32_t layer, int slot) {
  if (whole.empty()) return false;
  const auto i = static_cast<size_t>(layer) * kModuleSlots + static_cast<size_t>(slot);
  STRATA_CHECK(layer >= 0 && slot >= 0 && slot < kModuleSlots && i < whole.size(),
               "module {} of layer {} in a plan of {} flags", slot, layer, whole.size());
  return whole[i] != 0;
}

void check_split(double alpha, std::span<const double> slot_alpha, std::span<const uint8_t> whole,
                 int32_t n_layers) {
  if (!(alpha > 0 && alpha <= 1)) fail_input("HeteGen: alpha must be in (0, 1], got {}", alpha);
  if (!slot_alpha.empty()) {
    if (slot_alpha.size() != kModuleSlots)
      fail_input("HeteGen: {} module alphas, expected one per module slot ({})", slot_alpha.size(),
                 kModuleSlots);
    for (int i = 0; i < kModuleSlots; ++i)
      if (!(slot_alpha[static_cast<size_t>(i)] >= 0 && slot_alpha[static_cast<size_t>(i)] <= 1))
        fail_input("HeteGen: the {} modules' alpha must be in [0, 1], got {}", module_slot_name(i),
                   slot_alpha[static_cast<size_t>(i)]);
  }
  if (!whole.empty() && whole.size() != static_cast<size_t>(n_layers) * kModuleSlots)
    fail_input("HeteGen: {} whole-module flags for {} layers of {} modules", whole.size(), n_layers,
               kModuleSlots);
}

void HeteGenOptions::validate() const {
  if (!(alpha >= 0 && alpha <= 1)) fail_input("HeteGen: alpha must be in [0, 1], got {}", alpha);
  if (cpu_threads < 0) fail_input("HeteGen: cpu_threads must be >= 0, got {}", cpu_threads);
}

std::string HeteGenOptions::str() const {
  if (!enabled) return "hetegen(off)";
  return fmt::format("hetegen(alpha={:.3f}, cpu_threads={})", alpha, cpu_threads);
}

}  // namespace strata::hetegen

namespace strata::hetegen {

std::string ModuleShapeKey::str() const {
  return fmt::format("[{}, {}] {}{}", out, in, dtype_name(dtype), bias ? " +bias" : "");
}

SlotModules slot_modules(const ModelShape& shape, bool compress) {
  SlotModules out;
  for (const LayerLinear& l : layer_linears(shape)) {
    if (!l.present) continue;
    SlotModule& m = out[static_cast<size_t>(l.slot)];
    m.present = true;
    m.key = ModuleShapeKey{l.out, l.in, stored_dtype(shape.dtype, l.in, compress), l.bias};
    m.bytes = stored_weight_bytes(shape, l, compress) + (l.bias ? l.out * 4 : 0);
  }
  return out;
}

SlotAlphas fixed_slot_alphas(const SlotModules& modules, double alpha) {
  SlotAlphas out;
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = {alpha, (1 - alpha) * static_cast<double>(modules[i].bytes)};
  return out;
}

double switch_alpha(const SlotAlphas& alphas) {
  double top = 0;
  for (const SlotAlpha& a : alphas) top = std::max(top, a.alpha);
  return top > 0 ? top : 1.0;
}

namespace {

size_t whole_flag(int32_t layer, int slot) {
  return static_cast<size_t>(layer) * kModuleSlots + static_cast<size_t>(slot);
}

}  // namespace

StageModuleSchedule schedule_stage_modules(const ModelShape& shape, StageRequest r, int64_t gpu_mem,
                                           const SlotModules& modules, const SlotAlphas& alphas) {
  StageModuleSchedule out;
  out.fixed = place_weights(shape, r).gpu_bytes();
  out.budget = gpu_mem - out.fixed;
  if (out.budget < 0) return out;
  std::vector<Module> list;
  std::vector<std::pair<int32_t, int>> where;  // (layer, slot) of list[i]
  for (int32_t l = 0; l < static_cast<int32_t>(shape.n_layers); ++l)
    for (int i = 0; i < kModuleSlots; ++i) {
      const SlotModule& m = modules[static_cast<size_t>(i)];
      if (!m.present) continue;
      const SlotAlpha& a = alphas[static_cast<size_t>(i)];
      list.push_back(
          {hetegen_module_name(l, static_cast<LinearSlot>(i)), m.bytes, a.t_cpu, a.alpha, 0});
      where.emplace_back(l, i);
    }
  const HeteGenPlan plan = schedule_modules(list, out.budget, true);
  r.hetegen_whole.assign(static_cast<size_t>(shape.n_layers) * kModuleSlots, 0);
  std::vector<size_t> moved;  // in the order of gain they were moved in
  for (size_t i = 0; i < list.size(); ++i)
    if (plan.modules[i].placement == ModulePlacement::kGpu) moved.push_back(i);
  std::stable_sort(moved.begin(), moved.end(),
                   [&](size_t a, size_t b) { return list[a].gain() > list[b].gain(); });
  for (size_t i : moved) r.hetegen_whole[whole_flag(where[i].first, where[i].second)] = 1;
  while (!moved.empty() && place_weights(shape, r).gpu_bytes() > gpu_mem) {
    r.hetegen_whole[whole_flag(where[moved.back()].first, where[moved.back()].second)] = 0;
    moved.pop_back();
  }
  out.scheduled = true;
  out.whole = r.hetegen_whole;
  out.modules = list.size();
  for (size_t i : moved) out.moved.push_back(list[i].name);
  out.used = place_weights(shape, r).gpu_bytes() - out.fixed;
  return out;
}

}  // namespace strata::hetegen

namespace strata {

std::string hetegen_module_name(int32_t layer, LinearSlot slot) {
  return fmt::format("layer.{}.{}", layer, linear_slot_name(slot));
}

}  // namespace strata
