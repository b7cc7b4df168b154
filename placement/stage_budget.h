// What each of the engine's memory budgets bounds, said once. With a policy (FlexGen's shares
// of each tier), --gpu-mem, --cpu-mem and --disk-mem each bound everything the engine keeps on
// their tier -- weights, KV cache (Pie's buffers where on) and step buffers -- counted as
// place_stage counts them. Without one they bound the weights alone, which fill them first;
// the cache and the buffers then come on top, and the run says so.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "placement/stage_placement.h"

namespace strata {

// Checked when a run sizes its KV cache of `slots` sequences x `capacity` positions, before
// anything of it is allocated: `p` is the stage placed with that cache, `budgets` the
// engine's. Under a policy (`policy`, its compact form; "" for none) a tier over its budget is
// an InputError naming the option, the need by part, the shortfall and how to need less.
// Without one, what to warn: a line per tier over its budget, in the order gpu, cpu, disk.
std::vector<std::string> check_cache_budgets(const StagePlacement& p, const TierBudgets& budgets,
                                             const std::string& policy, int32_t slots,
                                             int32_t capacity);

}  // namespace strata
