#include "coordinator/run/run_history.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>

#include "coordinator/run/coordinator.h"

namespace strata {

LatencyRecorder::LatencyRecorder(size_t exact_cap) : exact_cap_(exact_cap) {}

int32_t LatencyRecorder::bucket(double v) {
  if (!(v > kMin)) return 0;
  return 1 + static_cast<int32_t>(std::floor(std::log(v / kMin) / std::log(kGrowth)));
}

// The middle (geometric) of bucket b; bucket 0 holds everything up to kMin.
double LatencyRecorder::bucket_value(int32_t b) {
  if (b == 0) return kMin;
  return kMin * std::pow(kGrowth, static_cast<double>(b - 1) + 0.5);
}

void LatencyRecorder::add(double seconds) {
  min_ = count_ == 0 ? seconds : std::min(min_, seconds);
  max_ = count_ == 0 ? seconds : std::max(max_, seconds);
  ++count_;
  sum_ += seconds;
  const auto b = static_cast<size_t>(std::min(bucket(seconds), int32_t{1 << 12}));
  if (buckets_.size() <= b) buckets_.resize(b + 1, 0);
  ++buckets_[b];
  if (count_ <= static_cast<int64_t>(exact_cap_)) {
    exact_.push_back(seconds);
  } else if (!exact_.empty()) {  // past the cap: the buckets alone from now on
    exact_.clear();
    exact_.shrink_to_fit();
  }
}

LatencySummary LatencyRecorder::summary() const {
  if (count_ == 0 || static_cast<int64_t>(exact_.size()) == count_)
    return LatencySummary::of(exact_);
  LatencySummary s;
  s.count = count_;
  s.mean = sum_ / static_cast<double>(count_);
  s.max = max_;
  // Nearest rank, as LatencySummary::of: the bucket holding the ceil(p n)-th value.
  auto rank = [&](double p) {
    const auto at = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(p * count_)));
    int64_t seen = 0;
    for (size_t b = 0; b < buckets_.size(); ++b) {
      seen += buckets_[b];
      if (seen >= at) return std::clamp(bucket_value(static_cast<int32_t>(b)), min_, max_);
    }
    return max_;
  };
  s.p50 = rank(0.50);
  s.p90 = rank(0.90);
  s.p99 = rank(0.99);
  return s;
}

size_t LatencyRecorder::bytes() const {
  return exact_.capacity() * sizeof(double) + buckets_.capacity() * sizeof(int64_t);
}

bool RecentIds::seen_again(std::string_view id) {
  const uint64_t h = std::hash<std::string_view>{}(id);
  if (set_.count(h) != 0) return true;
  set_.insert(h);
  order_.push_back(h);
  if (order_.size() > capacity_) {
    set_.erase(order_.front());
    order_.pop_front();
  }
  return false;
}

}  // namespace strata
