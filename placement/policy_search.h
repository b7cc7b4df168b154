// FlexGen's policy search (§4.3, Eq. 1): a two-level optimisation. The outer level
// enumerates the schedule (GPU batch size, number of GPU batches); for each, the placement
// (wg..hd) that minimises T / bls under the peak-memory constraints is a linear program,
// solved here with COIN-OR CLP. The LP relaxes the percentages to reals; its solution is
// rounded to the granularity the runtime can place (weights in whole steps of
// weight_step_percent, FlexGen's layer granularity; cache and activations in whole
// percents), re-checked with the cost model, and the best feasible policy wins -- where
// "best" treats throughputs within SearchOptions::tie_tolerance as equal and then prefers
// the smallest block (see policy_search.cpp for why).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "placement/cost_model.h"

namespace strata {

struct SearchOptions {
  // GPU batch sizes to try; empty means {1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, ...}
  // up to max_gpu_batch_size (FlexGen: "typically gbs is a multiple of 4").
  std::vector<int64_t> gpu_batch_sizes;
  int64_t max_gpu_batch_size = 512;
  int64_t max_num_gpu_batches = 32;
  int weight_step_percent = 5;
  // Fixed for the whole search, like FlexGen's --compress-w; cpu_attention on is FlexGen's
  // default (its cost model assumes it).
  bool compress_weight = false;
  bool compress_cache = false;
  // An f16 KV cache (policy cf16), as FlexGen's own: half the bytes of an f32 one in every
  // tier, for the cost model, the placement LP and Pie's swaps alike.
  bool cache_f16 = false;
  bool cpu_attention = true;
  bool overlap = true;
  // Policies predicted within this fraction of the best throughput are ties, which go to
  // the smallest block (then the faster, then the larger GPU batch). 5%: about the model's
  // error against FlexGen's measured runs (Table 21).
  double tie_tolerance = 0.05;
  // Also consider, for every schedule, Pie's cache swapping with the most host layers that
  // stay stall-free (and half as many), and HeteGen's split of the CPU-tier weights at eq.
  // 5's alpha for the block (placement/offload_estimates.h); and both together. Each is one
  // more LP per schedule; the best over all wins as above.
  bool pie = false;
  bool hetegen = false;
  // Progress (may be empty): GPU batch sizes searched so far, of how many.
  std::function<void(size_t done, size_t total)> on_progress;
};

// The LP optimum for one schedule: the relaxed placement and the objective T / bls.
struct PlacementLp {
  Placement placement{};
  double time_per_sequence = 0;  // T / bls, seconds
};

// Solves Eq. (1) for the schedule in `schedule` (its percentages are not read); nullopt
// when no placement satisfies the memory constraints.
std::optional<PlacementLp> solve_placement_lp(const ModelShape& shape, const Workload& w,
                                              const Policy& schedule, const HardwareSpec& hw);

struct SearchResult {
  Policy policy;
  CostEstimate cost;
  int64_t schedules_tried = 0;     // LPs solved: (gbs, ngb) pairs, times the variants tried
  int64_t schedules_feasible = 0;  // ... with a rounded placement that fits
  std::string str() const;
  nlohmann::json to_json() const;
};

// The best policy for `shape` and `w` on `hw`. Throws InputError when even the smallest
// schedule cannot fit, naming the tier and the shortfall, e.g. "GPU memory: the smallest
// configuration (gpu_batch_size=1, num_gpu_batches=1) needs 20.3 GiB but gpu_mem is
// 16.0 GiB (short by 4.3 GiB)".
SearchResult search_policy(const ModelShape& shape, const Workload& w, const HardwareSpec& hw,
                           const SearchOptions& options = {});

}  // namespace strata
