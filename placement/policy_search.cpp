#include "placement/policy_search.h"

#include <fmt/format.h>

#include <ClpSimplex.hpp>
#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <utility>

#include "kernels/error.h"
#include "placement/offload_estimates.h"

namespace strata {

namespace {

// LP columns: the nine placement fractions, then T_pre and T_gen (epigraph variables: each
// is bounded below by every activity of its phase, so at the optimum it is their max).
constexpr int kTpre = kNumPlacementVars;
constexpr int kTgen = kNumPlacementVars + 1;
constexpr int kNumCols = kNumPlacementVars + 2;

// The few ClpSimplex calls the search makes (ClpSimplex owns and frees its own arrays).
class Lp {
 public:
  explicit Lp(int cols) {
    lp_.setLogLevel(0);
    lp_.resize(0, cols);
  }
  void column(int col, double lo, double hi, double cost) {
    lp_.setColumnBounds(col, lo, hi);
    lp_.setObjectiveCoefficient(col, cost);
  }
  // lo <= scale * (sum coef[v] x[v] + extra) <= hi, extra being (column, coefficient) pairs.
  void row(const LinearTerm& t, double scale, std::vector<std::pair<int, double>> extra, double lo,
           double hi) {
    std::vector<int> cols;
    std::vector<double> vals;
    for (int v = 0; v < kNumPlacementVars; ++v)
      if (t.coef[v] != 0) cols.push_back(v), vals.push_back(scale * t.coef[v]);
    for (auto [c, k] : extra) cols.push_back(c), vals.push_back(scale * k);
    lp_.addRow(int(cols.size()), cols.data(), vals.data(), lo, hi);
  }
  // wg + wc + wd = 1 and likewise for the cache and the activations.
  void placement_sums() {
    for (int first : {kWg, kCg, kHg}) {
      LinearTerm t;
      t.coef[first] = t.coef[first + 1] = t.coef[first + 2] = 1;
      row(t, 1, {}, 1, 1);
    }
    for (int v = 0; v < kNumPlacementVars; ++v) column(v, 0, 1, 0);
  }
  bool solve() {
    lp_.initialSolve();
    return lp_.isProvenOptimal();
  }
  void cost(int col, double c) { lp_.setObjectiveCoefficient(col, c); }
  double value(int col) const { return lp_.primalColumnSolution()[col]; }

 private:
  ClpSimplex lp_;
};

// T >= every bound of the phase, so T is their max at the optimum.
void add_phase(Lp& lp, const PhaseTerms& p, int t_col) {
  for (const TimeBound& b : p.bounds)
    lp.row(b.time, -1, {{t_col, -1}}, b.time.constant, COIN_DBL_MAX);
}

// Where the bottleneck hides a transfer the LP is indifferent to where its data lives and
// returns an arbitrary vertex (activations on disk, say). A tiny cost on every activity,
// hidden or not, breaks such ties towards less data moved, without trading any predicted
// time: hidden transfers still take bandwidth and CPU time in a real run.
constexpr double kRegularization = 1e-4;

void add_regularizer(Lp& lp, const CostModelTerms& t, double per_block) {
  const double n1 = double(t.gen_len - 1);
  for (int v = 0; v < kNumPlacementVars; ++v) {
    double k = 0;
    for (const PhaseTerms* p : {&t.prefill, &t.decode}) {
      const double times = p == &t.prefill ? 1 : n1;
      for (const LinearTerm* a :
           {&p->ctog, &p->gtoc, &p->dtoc, &p->ctod, &p->gpu_comp, &p->cpu_comp, &p->cpu_split})
        k += times * a->coef[v];
    }
    lp.cost(v, kRegularization * per_block * k);
  }
}

// peak <= cap * (1 + slack), rows scaled by 1 / cap so every row is of order one.
void add_peak(Lp& lp, const PeakTerms& peak, double cap, int slack_col) {
  std::vector<LinearTerm> rows;
  if (peak.alternatives.empty()) rows.push_back(peak.base);
  for (const LinearTerm& a : peak.alternatives) rows.push_back(peak.base + a);
  std::vector<std::pair<int, double>> extra;
  if (slack_col >= 0) extra.push_back({slack_col, -cap});
  for (const LinearTerm& r : rows) lp.row(r, 1 / cap, extra, -COIN_DBL_MAX, 1 - r.constant / cap);
}

struct TierSlack {
  int gpu = -1, cpu = -1, disk = -1;
};

void add_memory(Lp& lp, const CostModelTerms& t, const HardwareSpec& hw, TierSlack s) {
  add_peak(lp, t.gpu_prefill, hw.gpu_mem, s.gpu);
  add_peak(lp, t.gpu_decode, hw.gpu_mem, s.gpu);
  add_peak(lp, t.cpu_prefill, hw.cpu_mem, s.cpu);
  add_peak(lp, t.cpu_decode, hw.cpu_mem, s.cpu);
  add_peak(lp, t.disk, hw.disk_mem, s.disk);
}

Policy schedule_of(int64_t gbs, int64_t ngb, const SearchOptions& o) {
  Policy p;
  p.gpu_batch_size = gbs;
  p.num_gpu_batches = ngb;
  p.compress_weight = o.compress_weight;
  p.compress_cache = o.compress_cache;
  p.cache_f16 = o.cache_f16;
  p.cpu_cache_compute = o.cpu_attention;
  p.overlap = o.overlap;
  return p;
}

std::vector<int64_t> default_gpu_batch_sizes(int64_t max_gbs) {
  std::vector<int64_t> out = {1, 2, 4};
  // 8, 16, then the powers of two and the midpoints between them: 24, 32, 48, 64, 96, ...
  for (int64_t p = 8; p <= max_gbs; p *= 2) {
    out.push_back(p);
    if (p >= 16 && p + p / 2 <= max_gbs) out.push_back(p + p / 2);
  }
  std::erase_if(out, [&](int64_t g) { return g > max_gbs; });
  return out;
}

// Grid points next to a relaxed fraction: floor and ceiling on a `step`-percent grid.
std::vector<int> neighbours(double fraction, int step) {
  const double units = fraction * 100 / step;
  const int lo = std::clamp(int(std::floor(units + 1e-6)) * step, 0, 100);
  const int hi = std::clamp(int(std::ceil(units - 1e-6)) * step, 0, 100);
  return lo == hi ? std::vector<int>{lo} : std::vector<int>{lo, hi};
}

// (GPU, CPU) percentage pairs around the relaxed (g, c), the disk taking the rest.
std::vector<std::pair<int, int>> split_candidates(double g, double c, int step) {
  std::vector<std::pair<int, int>> out;
  for (int gi : neighbours(g, step))
    for (int ci : neighbours(c, step))
      if (gi + ci <= 100) out.push_back({gi, ci});
  return out;
}

std::vector<Policy> rounded_policies(const Policy& schedule, const Placement& x, int w_step) {
  std::vector<Policy> out;
  for (auto [wg, wc] : split_candidates(x[kWg], x[kWc], w_step))
    for (auto [cg, cc] : split_candidates(x[kCg], x[kCc], 1))
      for (auto [hg, hc] : split_candidates(x[kHg], x[kHc], 1)) {
        Policy p = schedule;
        p.w_gpu_percent = wg, p.w_cpu_percent = wc;
        p.cache_gpu_percent = cg, p.cache_cpu_percent = cc;
        p.act_gpu_percent = hg, p.act_cpu_percent = hc;
        out.push_back(p);
      }
  return out;
}

// All data moved and work done, overlapped or not: T with nothing overlapped.
double serial_time(const CostEstimate& c) {
  const double n = double(c.workload.gen_len);
  return c.prefill.serial() + (n - 1) * c.decode.serial();
}

// Within one schedule: the fastest rounding; among equally fast ones (a transfer hidden
// behind the bottleneck costs nothing in the model) the one that moves the least.
bool better_rounding(const CostEstimate& a, const CostEstimate& b) {
  constexpr double kSame = 1e-9;
  if (std::abs(a.throughput - b.throughput) > kSame * b.throughput)
    return a.throughput > b.throughput;
  return serial_time(a) < serial_time(b);
}

// Across schedules: throughput within `tol` of the best is a tie (the model is no more
// accurate than that); a tie goes to the smallest block -- its latency T grows with the
// block and it leaves the most memory headroom, and FlexGen notes the peak-memory estimate
// is approximate (§4.3) -- then to the faster, then to the larger GPU batch (fewer GPU
// batches per layer, fewer synchronisations, which the model does not count).
const CostEstimate& choose(const std::vector<CostEstimate>& found, double tol) {
  double top = 0;
  for (const CostEstimate& c : found) top = std::max(top, c.throughput);
  const CostEstimate* pick = nullptr;
  for (const CostEstimate& c : found) {
    if (c.throughput < top * (1 - tol)) continue;
    if (pick == nullptr) {
      pick = &c;
      continue;
    }
    const int64_t bls = c.policy.block_size(), pick_bls = pick->policy.block_size();
    if (bls != pick_bls) {
      if (bls < pick_bls) pick = &c;
    } else if (better_rounding(c, *pick) ||
               (!better_rounding(*pick, c) && c.policy.gbs() > pick->policy.gbs())) {
      pick = &c;
    }
  }
  return *pick;
}

// The least memory any placement needs at the smallest schedule, as an LP that lets each
// tier overflow and minimises the overflow; one line per tier that still overflows. What
// could overflow anywhere (weights, cache) is charged to the slowest tier that can hold it,
// so only what must sit on the GPU (its working buffers) or the CPU is blamed on those.
std::string diagnose(const ModelShape& shape, const Workload& w, const HardwareSpec& hw,
                     const Policy& smallest) {
  const CostModelTerms t = cost_model_terms(shape, w, smallest, hw);
  const TierSlack s{kNumPlacementVars, kNumPlacementVars + 1, kNumPlacementVars + 2};
  Lp lp(kNumPlacementVars + 3);
  lp.placement_sums();
  // Slacks are fractions of each tier's budget; the costs make them GiB, dearer the faster.
  const double gib = double(int64_t{1} << 30);
  lp.column(s.gpu, 0, COIN_DBL_MAX, 4 * hw.gpu_mem / gib);
  lp.column(s.cpu, 0, COIN_DBL_MAX, 2 * hw.cpu_mem / gib);
  lp.column(s.disk, 0, COIN_DBL_MAX, hw.disk_mem / gib);
  add_memory(lp, t, hw, s);
  STRATA_CHECK(lp.solve(), "the overflow LP always has a solution");
  std::string msg;
  const auto tier = [&](const char* name, const char* field, int col, double cap) {
    const double over = lp.value(col) * cap;
    if (over <= 1e-6 * cap) return;
    msg += fmt::format(
        "{}{} memory: the smallest configuration (gpu_batch_size={}, "
        "num_gpu_batches={}) needs {} but {} is {} (short by {})",
        msg.empty() ? "" : "; ", name, smallest.gbs(), smallest.ngb(), format_gib(cap + over),
        field, format_gib(cap), format_gib(over));
  };
  tier("GPU", "gpu_mem", s.gpu, hw.gpu_mem);
  tier("CPU", "cpu_mem", s.cpu, hw.cpu_mem);
  tier("Disk", "disk_mem", s.disk, hw.disk_mem);
  return msg;
}

void validate_options(const SearchOptions& o) {
  if (o.max_gpu_batch_size <= 0 || o.max_gpu_batch_size > Policy::kMaxBatch)
    fail_input("search: max_gpu_batch_size={} must be in [1, {}]", o.max_gpu_batch_size,
               Policy::kMaxBatch);
  if (o.max_num_gpu_batches <= 0 || o.max_num_gpu_batches > Policy::kMaxBatch)
    fail_input("search: max_num_gpu_batches={} must be in [1, {}]", o.max_num_gpu_batches,
               Policy::kMaxBatch);
  if (o.weight_step_percent <= 0 || 100 % o.weight_step_percent != 0)
    fail_input("search: weight_step_percent={} must divide 100", o.weight_step_percent);
  for (int64_t g : o.gpu_batch_sizes)
    if (g <= 0 || g > Policy::kMaxBatch)
      fail_input("search: GPU batch size {} must be in [1, {}]", g, Policy::kMaxBatch);
  if (!(o.tie_tolerance >= 0 && o.tie_tolerance < 1))
    fail_input("search: tie_tolerance={} must be in [0, 1)", o.tie_tolerance);
  schedule_of(1, 1, o).validate();  // e.g. compress_cache with cpu_attention, or with cache_f16
}

std::optional<CostEstimate> best_rounding(const ModelShape& shape, const Workload& w,
                                          const HardwareSpec& hw, const Policy& schedule,
                                          const Placement& x, const SearchOptions& o) {
  std::optional<CostEstimate> best;
  for (const Policy& p : rounded_policies(schedule, x, o.weight_step_percent)) {
    CostEstimate c = estimate_cost(shape, w, p, hw);
    if (c.fits(hw) && (!best || better_rounding(c, *best))) best = std::move(c);
  }
  return best;
}

// The schedule as FlexGen runs it, then with Pie and HeteGen as `o` asks: Pie at the most
// host layers its protocol hides for this block (and half as many: fewer swaps leave the
// link to streamed weights), HeteGen at eq. 5's alpha for the block's rows.
std::vector<Policy> variants_of(const ModelShape& shape, const Workload& w, const HardwareSpec& hw,
                                const Policy& schedule, const SearchOptions& o) {
  std::vector<Policy> out = {schedule};
  int alpha = 0;
  if (o.hetegen) {
    const double a = estimate_hetegen(shape, schedule, schedule.block_size(), hw).alpha;
    alpha = std::clamp(int(std::lround(a * 100)), 1, 100);
    if (alpha < 100) out.push_back(schedule), out.back().hetegen_alpha_percent = alpha;
  }
  if (!o.pie || shape.n_layers < 4) return out;
  const int most =
      std::min<int>(estimate_pie(shape, w, schedule, hw).host_layers, int(shape.n_layers) - 3);
  std::vector<int> host_layers = {most};
  if ((most + 1) / 2 != most) host_layers.push_back((most + 1) / 2);
  for (int m : host_layers) {
    if (m <= 0) continue;
    out.push_back(schedule), out.back().pie_host_layers = m;
    if (alpha > 0 && alpha < 100)
      out.push_back(out.back()), out.back().hetegen_alpha_percent = alpha;
  }
  return out;
}

}  // namespace

std::optional<PlacementLp> solve_placement_lp(const ModelShape& shape, const Workload& w,
                                              const Policy& schedule, const HardwareSpec& hw) {
  const CostModelTerms t = cost_model_terms(shape, w, schedule, hw);
  const double per_block = double(t.n_layers) / double(t.block_size);
  Lp lp(kNumCols);
  lp.placement_sums();
  // min T / bls = (T_pre * l + T_gen * (n - 1) * l) / bls
  lp.column(kTpre, 0, COIN_DBL_MAX, per_block);
  lp.column(kTgen, 0, COIN_DBL_MAX, per_block * double(t.gen_len - 1));
  add_phase(lp, t.prefill, kTpre);
  add_phase(lp, t.decode, kTgen);
  add_memory(lp, t, hw, {});
  add_regularizer(lp, t, per_block);
  if (schedule.pie_host_layers > 0) {  // Pie swaps a cache that lives on the GPU tier
    lp.column(kCg, 1, 1, 0);
    lp.column(kCc, 0, 0, 0);
    lp.column(kCd, 0, 0, 0);
  }
  if (!lp.solve()) return std::nullopt;
  PlacementLp out;
  for (int v = 0; v < kNumPlacementVars; ++v) out.placement[v] = std::clamp(lp.value(v), 0.0, 1.0);
  out.time_per_sequence = per_block * (lp.value(kTpre) + double(t.gen_len - 1) * lp.value(kTgen));
  return out;
}

SearchResult search_policy(const ModelShape& shape, const Workload& w, const HardwareSpec& hw,
                           const SearchOptions& options) {
  validate_options(options);
  w.validate();
  hw.validate("hardware spec");
  std::vector<int64_t> sizes = options.gpu_batch_sizes;
  if (sizes.empty()) sizes = default_gpu_batch_sizes(options.max_gpu_batch_size);
  std::sort(sizes.begin(), sizes.end());
  std::vector<CostEstimate> found;  // the best rounding of each feasible schedule
  int64_t tried = 0;
  size_t sizes_done = 0;
  for (int64_t gbs : sizes) {
    for (int64_t ngb = 1; ngb <= options.max_num_gpu_batches; ++ngb) {
      bool any_lp = false;
      for (const Policy& v : variants_of(shape, w, hw, schedule_of(gbs, ngb, options), options)) {
        ++tried;
        const auto lp = solve_placement_lp(shape, w, v, hw);
        if (!lp) continue;
        any_lp = true;
        if (auto c = best_rounding(shape, w, hw, v, lp->placement, options)) found.push_back(*c);
      }
      if (!any_lp) break;  // memory only grows with the block
    }
    if (options.on_progress) options.on_progress(++sizes_done, sizes.size());
  }
  if (found.empty()) {
    const std::string why = diagnose(shape, w, hw, schedule_of(sizes.front(), 1, options));
    if (!why.empty()) fail_input("policy search: no policy fits. {}", why);
    fail_input(
        "policy search: no policy fits: the relaxed placement of some schedule fits, but none "
        "rounded to {}% weight steps and whole percents does; the budget is too tight",
        options.weight_step_percent);
  }
  const CostEstimate& pick = choose(found, options.tie_tolerance);
  return SearchResult{pick.policy, pick, tried, int64_t(found.size())};
}

nlohmann::json SearchResult::to_json() const {
  return {{"policy", policy.compact()},
          {"cost", cost.to_json()},
          {"schedules_tried", schedules_tried},
          {"schedules_feasible", schedules_feasible}};
}

std::string SearchResult::str() const {
  return fmt::format("SearchResult({} schedules tried, {} feasible; best {}; {})", schedules_tried,
                     schedules_feasible, policy.str(), cost.str());
}

}  // namespace strata
