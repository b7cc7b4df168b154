#include "coordinator/exegpt/profiler.h"

#include <chrono>
#include <filesystem>
#include <limits>

#include "kernels/clock.h"
#include "kernels/error.h"
#include "kernels/log.h"
#include "transport/deadline.h"

namespace strata {
namespace {

std::vector<double> as_doubles(const std::vector<int32_t>& v) {
  return {v.begin(), v.end()};
}

void expect_size(const std::vector<double>& v, size_t n, const std::string& what, int32_t rank) {
  if (v.size() != n)
    fail(ErrorKind::kFailed, "rank {}'s profile report has {} {} times, {} were asked for", rank,
         v.size(), what, n);
}

// Least squares through (x, y); a single x (or none) gives a line through the mean.
LinkProfile fit_link(const std::vector<std::pair<double, double>>& points) {
  if (points.empty()) return {};
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (const auto& [x, y] : points) {
    sx += x;
    sy += y;
    sxx += x * x;
    sxy += x * y;
  }
  const double n = static_cast<double>(points.size());
  const double den = n * sxx - sx * sx;
  double slope = den > 0 ? (n * sxy - sx * sy) / den : 0.0;
  slope = std::max(slope, 0.0);
  const double intercept = std::max((sy - slope * sx) / n, 0.0);
  return {intercept, slope};
}

bool covers(const TimeGrid& g, const std::vector<int32_t>& xs, const std::vector<int32_t>& ys) {
  if (g.empty()) return false;
  return g.xs().front() <= xs.front() && g.xs().back() >= xs.back() &&
         (ys.empty() || (g.ys().front() <= ys.front() && g.ys().back() >= ys.back()));
}

}  // namespace

std::string ProfileKey::str() const {
  return fmt::format("{} ({}, placement {}) on {}", model, dtype, placement,
                     fmt::join(hosts, ", "));
}

ProfileKey profile_key(const std::string& model, DType dtype, const std::optional<Policy>& policy,
                       std::vector<std::string> hosts) {
  return {model, dtype_name(dtype), policy ? policy->str() : "budgets", std::move(hosts)};
}

ProfileRequest profile_request(const ProfileGrid& g, int32_t max_rows, int32_t repeats) {
  ProfileRequest r;
  r.prefill_rows = g.prefill_rows;
  r.prefill_lengths = g.prefill_lengths;
  r.decode_seqs = g.decode_seqs;
  r.decode_contexts = g.decode_contexts;
  r.embed_rows = g.embed_rows;
  r.head_rows = g.head_rows;
  r.repeats = repeats;
  r.transfer_rows = {1, std::max(max_rows / 4, 1), max_rows};
  return r;
}

ClusterProfile cluster_profile(const ProfileKey& key, const ProfileGrid& g,
                               const ProfileRequest& request, const ProfileResult& result,
                               int32_t hidden) {
  ClusterProfile p;
  p.model = key.model;
  p.dtype = key.dtype;
  p.placement = key.placement;
  p.hosts = key.hosts;
  p.source = "measured";
  STRATA_CHECK(!result.reports.empty(), "a profile without reports");
  std::vector<std::pair<double, double>> transfers;
  TimeGrid embed, head;
  for (const ProfileReport& r : result.reports) {
    expect_size(r.prefill_seconds, g.prefill_rows.size() * g.prefill_lengths.size(), "prefill",
                r.rank);
    expect_size(r.decode_seconds, g.decode_seqs.size() * g.decode_contexts.size(), "decode",
                r.rank);
    RankProfile rp;
    rp.rank = r.rank;
    rp.host = r.host;
    rp.prefill =
        TimeGrid(as_doubles(g.prefill_rows), as_doubles(g.prefill_lengths), r.prefill_seconds);
    rp.decode =
        TimeGrid(as_doubles(g.decode_seqs), as_doubles(g.decode_contexts), r.decode_seconds);
    if (!r.embed_seconds.empty()) {
      expect_size(r.embed_seconds, g.embed_rows.size(), "embedding", r.rank);
      rp.embed = embed = TimeGrid::curve(as_doubles(g.embed_rows), r.embed_seconds);
    }
    if (!r.head_seconds.empty()) {
      expect_size(r.head_seconds, g.head_rows.size(), "head", r.rank);
      rp.head = head = TimeGrid::curve(as_doubles(g.head_rows), r.head_seconds);
    }
    for (size_t i = 0; i < r.transfer_seconds.size() && i < request.transfer_rows.size(); ++i)
      transfers.emplace_back(static_cast<double>(request.transfer_rows[i]) * hidden * 4,
                             r.transfer_seconds[i]);
    p.ranks.push_back(std::move(rp));
  }
  for (RankProfile& rp : p.ranks) {
    if (rp.embed.empty()) rp.embed = embed;
    if (rp.head.empty()) rp.head = head;
  }
  p.link = fit_link(transfers);
  p.step_overhead_s = result.round_trip_s;
  if (p.hosts.empty())
    for (const RankProfile& rp : p.ranks) p.hosts.push_back(rp.host);
  return p;
}

void measure_step_overhead(Stages& stages, const ClusterPlan& plan, ClusterProfile& p) {
  constexpr int32_t kContext = 16;  // inside every profile's decode grid
  constexpr int kRepeats = 5;
  uint64_t step_id = std::numeric_limits<uint64_t>::max();
  auto round_trip = [&](int32_t seqs) {
    ScheduledStep s;
    s.command = StepCommand{0, Phase::kDecode, 0, {}};
    for (int32_t i = 0; i < seqs; ++i)  // no sampling: nothing joins, the result is empty
      s.command.seqs.push_back(
          SeqStep{step_id - 1000 - static_cast<uint64_t>(i), i, kContext - 1, 1, {0}, false});
    double best = std::numeric_limits<double>::infinity();
    for (int r = 0; r < kRepeats; ++r) {
      s.command.step_id = step_id--;
      const auto t0 = std::chrono::steady_clock::now();
      stages.dispatch(s);
      Backoff backoff;
      while (!stages.poll()) backoff.pause();
      best = std::min(best, seconds_since(t0));
    }
    return best;
  };
  auto compute = [&](int32_t seqs) {
    double t = 0;
    for (size_t s = 0; s < plan.stages.size(); ++s) {
      const RankProfile& r = p.ranks[s];
      t += plan.stages[s].n_layers() * r.decode.at(seqs, kContext);
      if (s == 0) t += r.embed.at(seqs);
      if (s + 1 < plan.stages.size())
        t += p.link.time(static_cast<double>(seqs) * plan.hidden_size * 4);
    }
    return t;
  };
  const int32_t many = std::max(std::min(plan.kv_slots, plan.max_batch_rows), 2);
  const double one = std::max(round_trip(1) - compute(1), 0.0);
  const double full = std::max(round_trip(many) - compute(many), 0.0);
  p.step_overhead_per_row_s = std::max((full - one) / (many - 1), 0.0);
  p.step_overhead_s = std::max(one - p.step_overhead_per_row_s, 0.0);
  log::get("coordinator")
      ->info("coordinator's turn per step: {:.1f} us + {:.2f} us a row", 1e6 * p.step_overhead_s,
             1e6 * p.step_overhead_per_row_s);
}

ClusterProfile measure_profile(Stages& stages, const ClusterPlan& plan, const ProfileKey& key,
                               const ProfileGrid& grid) {
  const ProfileRequest request = profile_request(grid, plan.max_batch_rows, 3);
  ClusterProfile measured =
      cluster_profile(key, grid, request, stages.profile(request), plan.hidden_size);
  measure_step_overhead(stages, plan, measured);
  return measured;
}

ClusterProfile load_or_measure_profile(Stages& stages, const ClusterPlan& plan,
                                       const ProfileKey& key, const ProfileGrid& grid,
                                       const std::string& path) {
  auto log = log::get("coordinator");
  ClusterProfile want;
  want.model = key.model;
  want.dtype = key.dtype;
  want.placement = key.placement;
  want.hosts = key.hosts;
  if (!path.empty() && std::filesystem::exists(path)) {
    const ClusterProfile saved = ClusterProfile::load(path);
    const RankProfile& r = saved.ranks.front();
    if (saved.matches(want) && saved.workers() == stages.count() &&
        covers(r.prefill, grid.prefill_rows, grid.prefill_lengths) &&
        covers(r.decode, grid.decode_seqs, grid.decode_contexts)) {
      log->info("layer profile: {} ({})", path, saved.str());
      return saved;
    }
    log->info("layer profile {} is for {}; measuring this run's ({})", path, saved.key(),
              want.key());
  }
  log->info("profiling the stages: {}", profile_request(grid, plan.max_batch_rows, 3).str());
  ClusterProfile measured = measure_profile(stages, plan, key, grid);
  if (!path.empty()) {
    measured.save(path);
    measured.source = path;
    log->info("layer profile saved to {}", path);
  }
  return measured;
}

}  // namespace strata
