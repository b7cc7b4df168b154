// Layer allocation beyond ExeGPT (which assumes identical GPUs and equal layer counts per
// stage): contiguous layer ranges, one per worker in rank order, that balance the stages'
// times as each worker's own profile prices them -- the embedding counted on the first stage
// and the head on the last (OPT-125m's head costs about as much as its six layers) -- within
// the layers each stage's memory holds under its offloading policy.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

namespace strata {

struct StageCost {
  double per_layer = 0;  // seconds one layer costs on this stage's worker
  double fixed = 0;      // seconds the stage costs besides its layers (embedding, head)
  int32_t max_layers = std::numeric_limits<int32_t>::max();  // what its memory holds
};

// Layer counts n_s >= 1 (sum `layers`) minimising max_s (n_s * per_layer_s + fixed_s), with
// n_s <= max_layers_s; exact (dynamic programming over split points), and among splits with
// the same bottleneck the evenest (smallest sum of squared stage times). InputError when
// the stages cannot hold the layers at all, naming how many they hold.
std::vector<int32_t> balance_layers(int32_t layers, const std::vector<StageCost>& stages);

// The stage times an allocation gives.
std::vector<double> stage_times(const std::vector<int32_t>& counts,
                                const std::vector<StageCost>& stages);

}  // namespace strata
