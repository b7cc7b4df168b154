// ExeGPT's XProfiler (§3) through the cluster: the coordinator asks every stage to time its
// part on synthetic steps under its real placement (worker/stage.h PipelineStage::profile)
// and its link to the next stage, and turns the reports into a ClusterProfile the simulator
// reads. Saved as JSON and reused by a later run whose model, dtype, placement and hosts
// match (`strata profile-layers`, or `strata serve --latency-bound` at start).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "coordinator/exegpt/layer_profile.h"
#include "coordinator/plan/stages.h"
#include "kernels/dtype.h"
#include "placement/policy.h"
#include "transport/messages.h"

namespace strata {

// The identity a profile is reused under.
struct ProfileKey {
  std::string model;
  std::string dtype;
  std::string placement;
  std::vector<std::string> hosts;  // the workers', in rank order
  std::string str() const;
};

// A run's key: its model spec, the weights' dtype, its placement (the policy's text, or
// "budgets" when the tiers' budgets place the weights) and its workers' hosts.
ProfileKey profile_key(const std::string& model, DType dtype, const std::optional<Policy>& policy,
                       std::vector<std::string> hosts);

ProfileRequest profile_request(const ProfileGrid& grid, int32_t max_rows, int32_t repeats);

// Reports (rank order) to a profile. The embedding and head are measured on the ranks that
// hold them; the others get theirs (a rank's own cost of them is what it would be there).
// The link is the least-squares line through every stage's (bytes, seconds) transfers.
ClusterProfile cluster_profile(const ProfileKey& key, const ProfileGrid& grid,
                               const ProfileRequest& request, const ProfileResult& result,
                               int32_t hidden);

// The coordinator's turn per step: real steps of one row and of many (no sampling) sent
// through the started stages as the run loop sends them, their round trips less the
// compute and links the profile gives them. Sets the profile's step overhead.
void measure_step_overhead(Stages& stages, const ClusterPlan& plan, ClusterProfile& profile);

// The stages' profile measured through `stages` (started with `plan`): the grid's points
// on every stage, then the coordinator's turn per step.
ClusterProfile measure_profile(Stages& stages, const ClusterPlan& plan, const ProfileKey& key,
                               const ProfileGrid& grid);

// The stages' profile: loaded from `path` when it holds one of this key covering `grid`,
// measured (measure_profile) otherwise, and saved to `path` when one is given.
ClusterProfile load_or_measure_profile(Stages& stages, const ClusterPlan& plan,
                                       const ProfileKey& key, const ProfileGrid& grid,
                                       const std::string& path);

}  // namespace strata
