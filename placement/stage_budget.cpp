#include "placement/stage_budget.h"

#include <fmt/format.h>

#include "kernels/error.h"

namespace strata {
namespace {

struct TierBudget {
  Tier tier;
  const char* option;
  const char* where;
  const char* hint;  // how to make the KV cache need less of this tier
};
constexpr TierBudget kTierBudgets[] = {
    {Tier::kGpu, "--gpu-mem", "the device",
     "keep KV layers in host memory (--pie-host-layers, or the policy's c=)"},
    {Tier::kCpu, "--cpu-mem", "host memory", "move KV layers to disk (the policy's c=)"},
    {Tier::kDisk, "--disk-mem", "the disk", "keep more KV layers in memory (the policy's c=)"},
};

constexpr double kMiB = 1 << 20;

// What a tier holds, the device's kernel scratch included (held by the backend, not the engine).
int64_t tier_need(const StagePlacement& p, Tier t) {
  return p.total()[t] + (t == Tier::kGpu ? p.kernel_scratch_bytes : 0);
}

// "host memory needs 3.1 MiB (weights 1.0, KV cache 1.0, buffers 1.1)"
std::string tier_need_str(const StagePlacement& p, const TierBudget& t) {
  const int64_t need = tier_need(p, t.tier);
  const int64_t weights = p.weight_bytes()[t.tier], kv = p.cache_bytes()[t.tier];
  return fmt::format("{} needs {:.1f} MiB (weights {:.1f}, KV cache {:.1f}{}, buffers {:.1f})",
                     t.where, static_cast<double>(need) / kMiB, static_cast<double>(weights) / kMiB,
                     static_cast<double>(kv) / kMiB,
                     t.tier == Tier::kGpu && p.cache.pie_host_layers
                         ? fmt::format(" in Pie's {} of {} layer buffers", p.cache.pie.device,
                                       p.cache.tiers.size())
                         : std::string(),
                     static_cast<double>(need - weights - kv) / kMiB);
}

}  // namespace

std::vector<std::string> check_cache_budgets(const StagePlacement& p, const TierBudgets& budgets,
                                             const std::string& policy, int32_t slots,
                                             int32_t capacity) {
  std::vector<std::string> warnings;
  for (const TierBudget& t : kTierBudgets) {
    const int64_t budget = budgets[t.tier];
    const int64_t need = tier_need(p, t.tier);
    if (budget < 0 || need <= budget) continue;
    if (policy.empty()) {
      warnings.push_back(fmt::format(
          "{} {:.1f} MiB bounds the weights alone (no --policy); with the KV cache of {} "
          "sequences x {} positions {}: give a policy to bound them all",
          t.option, static_cast<double>(budget) / kMiB, slots, capacity, tier_need_str(p, t)));
      continue;
    }
    fail_input(
        "{} {:.1f} MiB is too small for the KV cache of {} sequences x {} positions under "
        "--policy '{}': {}, short by {:.1f} MiB; lower --max-batch or {}",
        t.option, static_cast<double>(budget) / kMiB, slots, capacity, policy, tier_need_str(p, t),
        static_cast<double>(need - budget) / kMiB, t.hint);
  }
  return warnings;
}

}  // namespace strata
