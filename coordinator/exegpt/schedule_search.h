// ExeGPT's XScheduler (§5): maximise throughput under a latency bound over the control
// variables. Algorithm 1 is a branch-and-bound over two variables whose throughput and
// latency both grow with each (§5.1's monotonic problem; ε_T and ε_L absorb small
// violations). Strata runs it for RRA over (B_E, encoding frequency 1 / N_D) with the
// micro-batch count fixed per run (as the paper fixes the TP degree), and for WAA-C / WAA-M
// over (B_E, 1 / B_m); RRA again for each partial tensor parallelism (degree, groups); the
// best of all wins. The FasterTransformer-style baseline is
// searched exhaustively over its static batch and micro-batches in the same simulator.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <vector>

#include "coordinator/exegpt/simulator.h"

namespace strata {

struct Perf {
  double throughput = 0;
  double latency = std::numeric_limits<double>::infinity();
};

// perf(i1, i2) on the grid [0, n1) x [0, n2), both indices ordered so that throughput and
// latency grow with them. A point that cannot run is {inf, inf}.
using PerfFn = std::function<Perf(int32_t i1, int32_t i2)>;

struct BnbOptions {
  double latency_bound = std::numeric_limits<double>::infinity();
  double eps_throughput = 0;  // ε_T, as a fraction of the best throughput so far
  double eps_latency = 0;     // ε_L, as a fraction of the bound
};

struct BnbResult {
  bool found = false;
  int32_t i1 = -1, i2 = -1;
  Perf perf;
  int64_t points_evaluated = 0;  // distinct grid points perf() was asked for
  double fastest_latency = std::numeric_limits<double>::infinity();  // at (0, 0)
};

// Algorithm 1. Each distinct point is evaluated once.
BnbResult branch_and_bound(int32_t n1, int32_t n2, const PerfFn& perf, const BnbOptions& o);
// Every point: the reference branch-and-bound must agree with on a monotonic grid.
BnbResult exhaustive(int32_t n1, int32_t n2, const PerfFn& perf, double latency_bound);

struct ScheduleSearchOptions {
  double latency_bound = std::numeric_limits<double>::infinity();
  std::vector<int32_t> encode_batches;  // B_E values, ascending
  std::vector<int32_t> decode_iters;    // N_D values, ascending (RRA)
  std::vector<int32_t> micro_batches;   // RRA's pipeline micro-batches (one search each)
  // WAA's B_m values, ascending; the simulator raises each to one per decoder stage.
  std::vector<int32_t> decoder_micro_batches;
  // Partial tensor parallelism for RRA (§5.1: the degree fixed per run of the algorithm,
  // the number of workers it is applied to varied): each degree here is searched with 1, 2,
  // ... groups of that many workers, besides the search without.
  std::vector<int32_t> tp_degrees;
  std::vector<SchedulePolicy> policies = {SchedulePolicy::kRra, SchedulePolicy::kWaaC,
                                          SchedulePolicy::kWaaM};
  double eps_throughput = 0.0;
  double eps_latency = 0.0;
  bool exhaustive = false;  // enumerate every point instead (for comparison)
  // A running cluster re-planning keeps its layers: every point on this allocation (RRA).
  std::optional<Allocation> fixed_allocation;
  // Grids sized from the workload and the run's limits.
  static ScheduleSearchOptions defaults(const Simulator& sim, int32_t max_encode_batch);
};

struct ScheduleChoice {
  bool feasible = false;  // some schedule meets the bound
  Prediction best;
  std::vector<Prediction> per_search;  // the best of each (policy, micro-batches) search
  double fastest_latency_s = std::numeric_limits<double>::infinity();  // over every policy
  int64_t points_evaluated = 0;
  int64_t grid_points = 0;             // what an exhaustive search would evaluate
  std::optional<Prediction> baseline;  // FT's best under the same bound
  int64_t baseline_points = 0;
  double latency_bound = 0;
  // The evaluated point with the smallest B_E that did not fit (memory, KV slots; its
  // infeasible_reason says why); none when every point evaluated fit.
  std::optional<Prediction> smallest_unfit;

  // No point fits at all, so no latency is achievable.
  bool fits_nowhere() const;
  // Why no schedule meets the bound: the fastest achievable latency, or, when none fits at
  // all, why the smallest tried does not (which stage, which tier, by how much).
  std::string why_none() const;
  nlohmann::json to_json() const;
  std::string str() const;
};

ScheduleChoice search_schedule(const Simulator& sim, const ScheduleSearchOptions& options);

// The baseline: every static batch in `batches` with every micro-batch count; the best
// throughput within the bound (nullopt when none meets it). `all` receives every
// feasible configuration's prediction (for choosing bounds as the paper does).
std::optional<Prediction> search_baseline(const Simulator& sim, double latency_bound,
                                          const std::vector<int32_t>& batches,
                                          const std::vector<int32_t>& micro_batches,
                                          std::vector<Prediction>* all = nullptr,
                                          int64_t* points = nullptr);

// 1, 2, 3, 4, 6, 8, 12, 16, ... up to `max` (included).
std::vector<int32_t> geometric_values(int32_t max);

}  // namespace strata
