// HeteGen's alpha benchmark measured on this node (papers/hetegen.md §4.4): one linear module
// of a given shape split at alpha as the engine splits it (worker/split_linear.h), timed for
// real -- the CPU backend computing its (1 - alpha) share of a decode step, and the device's
// transfer queue copying the alpha share from page-locked host memory. placement/hetegen.h
// fits the times (benchmark_module) and the engine caches the result (launch/hetegen_setup).
#pragma once

#include <cstdint>
#include <string>

#include "kernels/backend.h"
#include "placement/hetegen.h"

namespace strata {

struct ModuleShapeKey {
  int64_t out = 0, in = 0;
  DType dtype = DType::kF32;  // as stored: kQ4 for 4-bit weights
  bool bias = false;
  std::string str() const;  // "[768, 3072] f16 +bias"
};

// Measures `shape` at any alpha: T_cpu, the best of `repeats` CPU-share linears over `rows`
// rows (after one untimed); T_trans, the best of `repeats` host -> device copies of the alpha
// share, waited for; T_pin 0, since the engine keeps the shares page-locked from load on
// (docs/OFFLOADING.md, "HeteGen"). Weights are random (seeded); the measure owns its buffers
// and the backends must outlive it.
hetegen::AlphaMeasure module_alpha_measure(Backend& device, Backend& cpu,
                                           const ModuleShapeKey& shape, int32_t rows, int repeats);

}  // namespace strata
