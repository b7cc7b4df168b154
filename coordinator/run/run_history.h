// What the coordinator keeps of the requests it has served, for the run report, in memory
// bounded by configuration, not by how many requests a service that runs for weeks has
// seen: latencies as exact values up to a cap and a log-bucket histogram beyond it, the
// steady window's tokens as two running counts, and recent request ids as a bounded window
// of their hashes.
#pragma once

#include <cstdint>
#include <deque>
#include <string_view>
#include <unordered_set>
#include <vector>

namespace strata {

struct LatencySummary;

// One latency's values. The first `exact_cap` are kept, so a run of fewer requests reports
// exact nearest-rank percentiles; past the cap every value goes to buckets 1% wide
// (relative) from 1 us to 1e6 s, and percentiles come from them (within 0.5%).
class LatencyRecorder {
 public:
  explicit LatencyRecorder(size_t exact_cap = 1 << 16);
  void add(double seconds);
  int64_t count() const { return count_; }
  LatencySummary summary() const;
  size_t bytes() const;  // what it holds (its test bounds it)

 private:
  static constexpr double kMin = 1e-6, kGrowth = 1.01;
  static int32_t bucket(double v);
  static double bucket_value(int32_t b);
  size_t exact_cap_;
  std::vector<double> exact_;  // until count_ passes exact_cap_
  std::vector<int64_t> buckets_;
  int64_t count_ = 0;
  double sum_ = 0, max_ = 0, min_ = 0;
};

// The steady window's tokens (steady_window in coordinator.h) without a log of every
// result: results come in time order, so the tokens in (first finish, end of admissions]
// are the running total at the end of admissions less the total at the first finish.
struct TokenTally {
  int64_t total = 0;
  int64_t at_first_finish = 0;     // the total when the first request finished
  int64_t at_admissions_end = -1;  // the total when admissions ended; -1: not yet
};

// Request ids seen lately, for the duplicate warning: the 64-bit hashes of the last
// `capacity` ids (an older duplicate goes unnoticed here; a queue's done marks still keep
// it from a second result).
class RecentIds {
 public:
  explicit RecentIds(size_t capacity = 1 << 16) : capacity_(capacity) {}
  // True when `id` was among the recent ones; it is recent from now on.
  bool seen_again(std::string_view id);
  size_t size() const { return order_.size(); }

 private:
  size_t capacity_;
  std::unordered_set<uint64_t> set_;
  std::deque<uint64_t> order_;
};

}  // namespace strata
