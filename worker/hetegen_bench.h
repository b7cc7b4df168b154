// HeteGen's alpha benchmark measured on this node (papers/hetegen.md §4.4): one linear module
// of a given shape split at alpha as the engine splits it (worker/split_linear.h), timed for
// real -- the CPU backend computing its (1 - alpha) share of a decode step, and the device's
// transfer queue copying the alpha share from page-locked host memory. placement/hetegen.h
// fits the times (benchmark_module); benchmark_slot_alphas runs it for a layer's modules and
// caches the results in the node profile.
#pragma once

#include <spdlog/spdlog.h>

#include <cstdint>
#include <string>

#include "kernels/backend.h"
#include "placement/hetegen.h"

namespace strata {

using hetegen::ModuleShapeKey;

// Measures `shape` at any alpha: T_cpu, the best of `repeats` CPU-share linears over `rows`
// rows (after one untimed); T_trans, the best of `repeats` host -> device copies of the alpha
// share, waited for; T_pin 0, since the engine keeps the shares page-locked from load on
// (docs/OFFLOADING.md, "HeteGen"). Weights are random (seeded); the measure owns its buffers
// and the backends must outlive it.
hetegen::AlphaMeasure module_alpha_measure(Backend& device, Backend& cpu,
                                           const ModuleShapeKey& shape, int32_t rows, int repeats);

// The engine's alpha benchmark (--hetegen-alpha auto): alpha per module slot, measured at
// `rows` activation rows (the decode step's) once per distinct module shape, row count and
// pair of backends, and cached in the node profile `path` (JSON; written whole or not at
// all). Says on `log` what it measured or reused, and when the profile cannot be read or
// written (it then measures, or keeps its results in memory).
hetegen::SlotAlphas benchmark_slot_alphas(const hetegen::SlotModules& modules, int32_t rows,
                                          Backend& device, Backend& cpu, const std::string& path,
                                          spdlog::logger& log);

}  // namespace strata
