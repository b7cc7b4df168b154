// HeteGen's scheduling stage (papers/hetegen.md §4.1, Fig. 4) run by the engine before the
// model loads: the alpha benchmark per module shape (--hetegen-alpha auto; eq. 9-12, measured
// on this node by worker/hetegen_bench.h and cached in the node profile), then the module
// scheduler (§4.5): with the --gpu-mem left after the fixed parts, whole modules move onto
// the device in order of gain T_cpu / Mem while memory allows; the rest are split.
#pragma once

#include <string>

#include "launch/commands.h"
#include "worker/config.h"
#include "worker/loader.h"

namespace strata::cli {

// The node profile's HeteGen file: $STRATA_PROFILE_DIR, else ~/.cache/strata/profiles (where
// serve keeps its layer profiles), else /tmp/strata-profiles; "hetegen-alpha.json". One entry
// per module shape, dtype, rows, device backend and CPU backend (its threads and ISA).
std::string hetegen_profile_path();

// Fills lo.hetegen_alpha / hetegen_slot_alpha (auto) and lo.hetegen_whole (the scheduler,
// when --gpu-mem is given and no policy places the weights by shares: every layer then goes
// to the CPU tier and the scheduler decides which of its modules are whole on the device).
// Needs lo.device and lo.hetegen_cpu. Logs what it chose.
void plan_hetegen(const EngineOptions& o, LoadOptions& lo, const ModelConfig& config);

}  // namespace strata::cli
