// HeteGen (papers/hetegen.md): how much of each linear module the GPU takes, and which
// modules go to the GPU whole. Pure decisions; worker/split_linear.h executes them.
//
//  - alpha, the share of a module's parameters computed on the GPU (§3.2): from speeds
//    (eq. 5, and its approximations eq. 6 and 7) or from the whole-module times of the CPU,
//    the pinning and the transfer (eq. 9, hybrid parallelism with asynchronous pinning).
//  - the alpha benchmark (§4.4, eq. 10-12): times measured at alphas around a first guess,
//    fitted by polynomials F_cpu and F_com, and the alpha where they meet.
//  - the heterogeneous module scheduler (§4.5, eq. 13): whole modules moved to the GPU in
//    order of gain g = T_cpu / Mem while the GPU budget allows; the rest stay split.
//
// Direction throughout: the GPU computes the alpha share, so the transfer carries alpha of
// the parameters and the CPU computes the (1 - alpha) share; T_cpu falls and T_com rises as
// alpha grows.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "kernels/tensor.h"
#include "placement/layer_linears.h"
#include "placement/model_shape.h"
#include "placement/stage_placement.h"

namespace strata::hetegen {

// --- alpha (§3.2, §4.2) --------------------------------------------------------------------

// Eq. 5, the exact balance of eq. 4 ((1 - alpha) W / V_cpu = alpha W / V_gpu + alpha W / V_com):
//   alpha = 1 / (V_cpu / V_com + V_cpu / V_gpu + 1).
// Speeds in parameters (or bytes) per second, any one unit for all three. InputError names a
// speed that is not positive and finite.
double alpha_from_speeds(double v_cpu, double v_gpu, double v_com);
// Eq. 6: eq. 5 without the GPU term (V_cpu / V_gpu is small next to V_cpu / V_com):
//   alpha ~= V_com / (V_com + V_cpu).
double alpha_ignoring_gpu(double v_cpu, double v_com);
// Eq. 7: eq. 6 with V = 1 / T', T' the time of the whole operation on the whole module
// (T'_cpu: the CPU computing all of it; T'_com: transferring all of it):
//   alpha ~= T'_cpu / (T'_cpu + T'_com).
double alpha_from_times(double t_cpu, double t_com);
// Eq. 9: with pinning and transfer running concurrently (Fig. 5c), communication costs the
// slower of the two:   alpha ~= T'_cpu / (T'_cpu + max(T'_pin, T'_trans)).
// T'_pin may be 0 (memory already pinned); the larger of T'_pin and T'_trans must be positive.
double alpha_from_times(double t_cpu, double t_pin, double t_trans);

// --- the alpha benchmark (§4.4) ------------------------------------------------------------

// One measurement of a split module at `alpha`: the CPU computing its (1 - alpha) share, the
// pinning and the transfer of the alpha share. T_com = max(T_pin, T_trans) (eq. 8, 12).
struct AlphaTiming {
  double t_cpu = 0;
  double t_pin = 0;
  double t_trans = 0;
  double t_com() const { return t_pin > t_trans ? t_pin : t_trans; }
};

struct AlphaSample {
  double alpha = 0;
  AlphaTiming timing;
};

// Measures one alpha: the worker runs the split module for real, a test returns given
// times. Seconds (any one unit).
using AlphaMeasure = std::function<AlphaTiming(double alpha)>;

// A least-squares polynomial in u = (alpha - center) / scale: centring and scaling the
// narrow alpha window to [-1, 1] keeps the normal equations well conditioned.
struct FittedPolynomial {
  std::vector<double> coef;  // of u^0, u^1, ...
  double center = 0;
  double scale = 1;
  double operator()(double alpha) const;
};

// Fits y[i] at x[i] by a polynomial of `degree`. InputError unless the sizes agree, the
// values are finite, degree is in [1, kMaxFitDegree] and x has more than `degree` distinct
// values.
FittedPolynomial fit_polynomial(std::span<const double> x, std::span<const double> y, int degree);
inline constexpr int kMaxFitDegree = 6;

struct AlphaBenchmarkOptions {
  double alpha0 = 0.5;   // the first guess (eq. 9 from whole-module times)
  double gamma = 0.1;    // half-width of the window [alpha0 - gamma, alpha0 + gamma]
  double lambda = 0.02;  // step between measured alphas
  // Degree 2 by default: the times are nearly linear in alpha (proportional to the rows each
  // side gets) plus fixed costs and a bend where a share stops fitting a cache, which is what
  // the paper fits polynomials for (§4.4: not "direct proportionality"). A quadratic takes
  // that bend with three coefficients; higher degrees over ~10 noisy samples of a narrow
  // window chase the noise and can invent crossings.
  int degree = 2;
  void validate() const;  // InputError naming the field and value
};

// The alphas the benchmark measures: alpha0 - gamma, then every lambda up to alpha0 + gamma,
// those outside [0, 1] left out.
std::vector<double> alpha_grid(const AlphaBenchmarkOptions& options);

struct AlphaBenchmarkResult {
  double alpha = 0;  // alpha-bar: F_cpu(alpha-bar) = F_com(alpha-bar) (eq. 10)
  double t_cpu = 0;  // T-bar_cpu = F_cpu(alpha-bar) (eq. 11)
  double t_com = 0;  // T-bar_com = max(T-bar_pin, T-bar_trans) = F_com(alpha-bar) (eq. 12)
  // false: the fitted curves do not cross in [0, 1]; alpha is then the end of [0, 1] where
  // max(F_cpu, F_com) is smaller.
  bool crossed = false;
  FittedPolynomial f_cpu, f_com;
  std::vector<AlphaSample> samples;
  std::string str() const;
};

// Eq. 10-12 from given samples. The crossing wanted is where F_cpu - F_com goes from positive
// to negative as alpha grows (the CPU stops being the slower side): there max(T_cpu, T_com),
// the module's time, is at a minimum. Several such crossings (a quadratic may cross twice):
// the one nearest the samples' mean alpha, where the fit was made. InputError for no samples,
// an alpha outside [0, 1], a negative or non-finite time, or too few distinct alphas.
AlphaBenchmarkResult fit_alpha(std::span<const AlphaSample> samples, int degree = 2);
// Measures every alpha of alpha_grid(options), then fit_alpha.
AlphaBenchmarkResult run_alpha_benchmark(const AlphaBenchmarkOptions& options,
                                         const AlphaMeasure& measure);

// The engine's alpha benchmark for one module (--hetegen-alpha auto): eq. 9's first guess
// from the whole-module times -- T'_cpu, the CPU computing every row (measure(0)), and
// max(T'_pin, T'_trans), the whole module pinned and moved (measure(1)) -- then the window
// `window.alpha0` +- gamma around it measured and fitted (eq. 10-12; window.alpha0 is
// replaced by the guess). The engine fits lines (degree 1): its times are a share of rows'
// work plus a fixed cost, and a narrow window of noisy samples gives a quadratic crossings of
// its own.
AlphaBenchmarkResult benchmark_module(const AlphaMeasure& measure, AlphaBenchmarkOptions window);
inline AlphaBenchmarkOptions engine_alpha_window() {
  AlphaBenchmarkOptions o;
  o.gamma = 0.1;
  o.lambda = 0.05;
  o.degree = 1;
  return o;
}

// --- the heterogeneous module scheduler (§4.5) ---------------------------------------------

// One linear module as the scheduler sees it.
struct Module {
  std::string name;   // e.g. "layer.3.up"
  int64_t bytes = 0;  // Mem: its parameters as stored
  // T-bar_cpu (eq. 11): the module's time split at its alpha, where T_cpu = T_gpu + T_com.
  // Moving it to the GPU whole saves this (the paper's "saved time").
  double t_cpu = 0;
  double alpha = 0;  // its split (alpha benchmark, or eq. 9)
  double t_gpu = 0;  // its time computed wholly on the GPU (0: negligible, as the paper takes it)
  double gain() const { return t_cpu / static_cast<double>(bytes); }  // eq. 13
};

enum class ModulePlacement : uint8_t { kGpu = 0, kSplit = 1 };
const char* module_placement_name(ModulePlacement p);

struct ModulePlan {
  std::string name;
  ModulePlacement placement = ModulePlacement::kSplit;
  double alpha = 0;       // 1 when the module is on the GPU whole
  double gain = 0;        // g = T_cpu / Mem
  int64_t gpu_bytes = 0;  // what it keeps on the GPU
  double time = 0;        // predicted: T-bar_cpu split, t_gpu whole
};

struct HeteGenPlan {
  std::vector<ModulePlan> modules;  // in the order given
  int64_t gpu_budget = 0;
  int64_t gpu_bytes = 0;  // all modules' GPU bytes
  double time = 0;        // sum of the modules' predicted times (they run one after another)
  // The module's alpha (1 when on the GPU whole); InputError for an unknown name.
  double alpha_of(const std::string& name) const;
  std::string str() const;
};

// Output rows of a [out, in] linear the GPU takes at alpha: ceil(alpha x out). The worker
// splits by it (worker/split_linear.h) and placement/stage_placement.cpp counts by it, so the
// two agree to the byte.
int64_t split_gpu_rows(double alpha, int64_t out);

// A split module keeps ceil(alpha x bytes) on the GPU: the paper streams its alpha share
// through the GPU each pass, so "the GPU's memory is occupied by parameters equivalent to only
// alpha times the parameter size" (§4.3). (The engine streams the shares of all split modules
// through two device slots, so what it holds is two layers' alpha shares; the scheduler's
// budget is per module, as the paper's.) A module on the GPU whole keeps all its bytes there.
int64_t split_gpu_bytes(const Module& m);

// Every module starts split (the least GPU memory that still runs, §4.5); then, in order of
// gain (highest first; ties keep the given order), each moves to the GPU whole while the
// extra (bytes - split bytes) fits the budget. The first that does not fit stops the moves,
// as the paper migrates "until the memory limit is reached". InputError for a module with
// no bytes, a negative or non-finite time, an alpha outside [0, 1], or a budget below what
// the split modules alone keep on the GPU (named with both numbers).
// `streamed`: the engine's accounting -- a split module keeps nothing of its own on the GPU
// (its alpha share streams through device slots counted with the fixed parts), so moving it
// whole costs all its bytes.
HeteGenPlan schedule_modules(std::span<const Module> modules, int64_t gpu_budget,
                             bool streamed = false);

// --- what the engine carries ---------------------------------------------------------------

// A layer's linear modules, in LinearSlot's order (placement/layer_linears.h): q, k, v, o,
// gate, up, down. Per-module decisions are indexed by this slot.
inline constexpr int kModuleSlots = kLinearSlots;
const char* module_slot_name(int slot);  // "q", ..., "down"

// The split the engine runs on its CPU-tier layers, as the loader (worker/loader.h) and
// placement (placement/stage_placement.h) both read it:
//  - alpha > 0 turns HeteGen on and is every module's alpha unless `slot_alpha` names one
//    per module slot (the alpha benchmark's, per module shape; each in [0, 1]);
//  - `whole`, kModuleSlots flags per stage-local layer, marks the modules the module
//    scheduler (§4.5) keeps whole on the device; the others are split, their alpha shares
//    streamed to the device each pass.
double module_alpha(double alpha, std::span<const double> slot_alpha, int slot);
bool module_whole(std::span<const uint8_t> whole, int32_t layer, int slot);
// InputError: alpha outside (0, 1], slot_alpha not empty and not kModuleSlots values in
// [0, 1], whole not empty and not kModuleSlots x n_layers flags.
void check_split(double alpha, std::span<const double> slot_alpha, std::span<const uint8_t> whole,
                 int32_t n_layers);

// The engine's HeteGen switch: every layer linear split at `alpha` (rows [0, ceil(alpha x
// out)) on the device, the rest on the host CPU), the CPU share on a CPU backend of
// `cpu_threads` threads (0: all cores).
struct HeteGenOptions {
  bool enabled = false;
  double alpha = 0.5;
  int cpu_threads = 0;
  void validate() const;    // InputError: alpha outside [0, 1], negative threads
  std::string str() const;  // "hetegen(alpha=0.700, cpu_threads=0)" or "hetegen(off)"
};

// --- the engine's stage: its modules, their alphas, the scheduler over every layer --------

// One linear module as the engine stores it: the alpha benchmark's key (a module of this shape
// is measured once) and its bytes.
struct ModuleShapeKey {
  int64_t out = 0, in = 0;
  DType dtype = DType::kF32;  // as stored: kQ4 for 4-bit weights
  bool bias = false;
  std::string str() const;  // "[768, 3072] f16 +bias"
};

struct SlotModule {
  bool present = false;
  ModuleShapeKey key;
  int64_t bytes = 0;  // weight and bias as stored
};
using SlotModules = std::array<SlotModule, kModuleSlots>;
// A layer's modules of `shape` in slot order (layer_linears), as stored (compress: 4-bit).
SlotModules slot_modules(const ModelShape& shape, bool compress);

struct SlotAlpha {
  double alpha = 0;
  double t_cpu = 0;  // T-bar_cpu at alpha (eq. 11), seconds
};
using SlotAlphas = std::array<SlotAlpha, kModuleSlots>;

// A fixed alpha: the CPU's time modelled as its share of the module's bytes, so every module
// has the same gain and the scheduler fills the device in layer order.
SlotAlphas fixed_slot_alphas(const SlotModules& modules, double alpha);
// The alpha that switches HeteGen on when the modules take their own (the benchmark's): the
// largest, or 1 when none is above 0. What the placement prints.
double switch_alpha(const SlotAlphas& alphas);

// Section 4.5 over every module of every layer of a stage whose layers are all split
// (`request`: its weights all on the CPU tier), with `gpu_mem` the device's weight budget.
struct StageModuleSchedule {
  bool scheduled = false;      // false: the fixed parts alone exceed gpu_mem (the load refuses it)
  std::vector<uint8_t> whole;  // kModuleSlots flags per layer (StageRequest::hetegen_whole)
  std::vector<std::string> moved;  // the modules kept whole, in the order of gain moved in
  size_t modules = 0;              // modules scheduled
  int64_t fixed = 0;               // the device's bytes with every module split
  int64_t budget = 0;              // gpu_mem - fixed
  int64_t used = 0;                // of the budget, by the whole modules (page rounding too)
};
// Every module split to begin with; schedule_modules (streamed) moves modules whole by gain;
// then, since the packed blobs round each layer to a page, the last moves are given back
// until place_weights fits gpu_mem.
StageModuleSchedule schedule_stage_modules(const ModelShape& shape, StageRequest request,
                                           int64_t gpu_mem, const SlotModules& modules,
                                           const SlotAlphas& alphas);

}  // namespace strata::hetegen

namespace strata {
// The scheduler's name for a module (hetegen::Module::name): "layer.3.up".
std::string hetegen_module_name(int32_t layer, LinearSlot slot);
}  // namespace strata
