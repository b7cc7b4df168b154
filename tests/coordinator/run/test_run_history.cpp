// What the coordinator keeps of served requests stays bounded (run_history.h): latencies
// exact up to a cap, then from 1%-wide buckets; recent ids as a window of hashes. Expected
// values by hand: nearest-rank percentiles of 1 .. n ms are p ms exactly.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "coordinator/run/coordinator.h"
#include "coordinator/run/run_history.h"

namespace strata {
namespace {

TEST(LatencyRecorder, ExactBelowTheCap) {
  LatencyRecorder r(100);
  for (double v : {7.0, 3.0, 10.0, 1.0, 9.0, 2.0, 8.0, 4.0, 6.0, 5.0}) r.add(v);
  const LatencySummary s = r.summary();
  EXPECT_EQ(s.count, 10);
  EXPECT_DOUBLE_EQ(s.p50, 5.0);
  EXPECT_DOUBLE_EQ(s.p90, 9.0);
  EXPECT_DOUBLE_EQ(s.p99, 10.0);
  EXPECT_DOUBLE_EQ(s.mean, 5.5);
  EXPECT_EQ(LatencyRecorder().summary().count, 0);
}

TEST(LatencyRecorder, PastTheCapWithinHalfAPercentInBoundedMemory) {
  LatencyRecorder r(1000);
  const int n = 1000000;
  for (int i = 1; i <= n; ++i) r.add(i * 1e-4);  // 0.1 ms .. 100 s
  const LatencySummary s = r.summary();
  EXPECT_EQ(s.count, n);
  EXPECT_NEAR(s.mean, (n + 1) / 2.0 * 1e-4, 1e-6);
  EXPECT_DOUBLE_EQ(s.max, 100.0);
  EXPECT_NEAR(s.p50, 50.0, 50.0 * 0.005);
  EXPECT_NEAR(s.p90, 90.0, 90.0 * 0.005);
  EXPECT_NEAR(s.p99, 99.0, 99.0 * 0.005);
  // Buckets from 1 us to 100 s at 1%: ln(1e8) / ln(1.01) = 1852 of them.
  EXPECT_LE(r.bytes(), 1900u * sizeof(int64_t) + 64);
}

TEST(RecentIds, AWindowOfTheLastIds) {
  RecentIds ids(3);
  EXPECT_FALSE(ids.seen_again("a"));
  EXPECT_FALSE(ids.seen_again("b"));
  EXPECT_FALSE(ids.seen_again("c"));
  EXPECT_TRUE(ids.seen_again("a"));
  EXPECT_FALSE(ids.seen_again("d"));  // a leaves the window
  EXPECT_FALSE(ids.seen_again("a"));
  EXPECT_EQ(ids.size(), 3u);
  RecentIds many;
  for (int i = 0; i < 200000; ++i) many.seen_again("request-" + std::to_string(i));
  EXPECT_EQ(many.size(), size_t{1} << 16);
}

}  // namespace
}  // namespace strata
