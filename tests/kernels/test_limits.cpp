// The paired read bound (kernels/limits.h): a step's fraction of the read stream measured
// around it. Expected values are hand calculations from the definition: bound = the step's
// bytes at the probe's rate (probe bytes over the mean of the two passes), fraction = bound
// over the step's seconds, quartiles by linear interpolation between order statistics.
#include <gtest/gtest.h>

#include <vector>

#include "kernels/error.h"
#include "kernels/limits.h"

namespace strata {
namespace {

TEST(PairedReadBound, OneStepIsItsOwnMedian) {
  // Passes of 10 ms and 14 ms over 1 GB: 12 ms mean, 83.3 GB/s. The step reads 0.5 GB, so its
  // bound is 6 ms; it took 8 ms: 0.75.
  const PairedReadBound r = paired_read_bound({{0.008, 0.010, 0.014, 0.5e9}}, 1e9);
  EXPECT_EQ(r.steps, 1);
  EXPECT_NEAR(r.median_fraction, 0.75, 1e-12);
  EXPECT_NEAR(r.p25_fraction, 0.75, 1e-12);
  EXPECT_NEAR(r.p75_fraction, 0.75, 1e-12);
  EXPECT_NEAR(r.median_probe_gbs, 1e9 / 0.012 / 1e9, 1e-9);
}

TEST(PairedReadBound, EachStepUsesTheRateAroundIt) {
  // Same bytes read by step and probe. The machine slows between steps 1 and 2: a fixed
  // bandwidth figure would make step 2 look half as good, the passes around it do not.
  const std::vector<PairedStep> steps = {
      {0.010, 0.009, 0.009, 1e8},  // 0.9
      {0.020, 0.018, 0.018, 1e8},  // 0.9
      {0.020, 0.012, 0.020, 1e8},  // 0.8
      {0.010, 0.010, 0.010, 1e8},  // 1.0
  };
  const PairedReadBound r = paired_read_bound(steps, 1e8);
  EXPECT_EQ(r.steps, 4);
  // Sorted 0.8, 0.9, 0.9, 1.0: median at 1.5 -> 0.9; p25 at 0.75 -> 0.875; p75 at 2.25 -> 0.925.
  EXPECT_NEAR(r.median_fraction, 0.9, 1e-12);
  EXPECT_NEAR(r.p25_fraction, 0.875, 1e-12);
  EXPECT_NEAR(r.p75_fraction, 0.925, 1e-12);
  // Rates 1e8 / {0.009, 0.018, 0.016, 0.010} s = {11.1, 5.56, 6.25, 10} GB/s: median 8.125.
  EXPECT_NEAR(r.median_probe_gbs, (6.25 + 10.0) / 2, 1e-9);
}

TEST(PairedReadBound, ProbeOfOtherBytesScales) {
  // The probe reads 4x the step's bytes in 40 ms around it: the step's bound is 10 ms.
  const PairedReadBound r = paired_read_bound({{0.0125, 0.040, 0.040, 2.5e8}}, 1e9);
  EXPECT_NEAR(r.median_fraction, 0.8, 1e-12);
}

TEST(PairedReadBound, EachStepHasItsOwnBytes) {
  // A decode step reads its weights and a KV cache that grows: 1.00e8 and 1.02e8 bytes,
  // both in 10 ms, beside passes of 1e8 bytes in 9 ms: 0.9 and 0.918, median 0.909.
  const PairedReadBound r =
      paired_read_bound({{0.010, 0.009, 0.009, 1.00e8}, {0.010, 0.009, 0.009, 1.02e8}}, 1e8);
  EXPECT_NEAR(r.median_fraction, (0.9 + 0.918) / 2, 1e-12);
}

TEST(PairedReadBound, NoStepsGivesZeros) {
  const PairedReadBound r = paired_read_bound({}, 1e8);
  EXPECT_EQ(r.steps, 0);
  EXPECT_EQ(r.median_fraction, 0.0);
}

TEST(PairedReadBound, RefusesTimesAndBytesThatAreNotPositive) {
  EXPECT_THROW(paired_read_bound({{0.0, 0.01, 0.01, 1e8}}, 1e8), InputError);
  EXPECT_THROW(paired_read_bound({{0.01, 0.01, -1.0, 1e8}}, 1e8), InputError);
  EXPECT_THROW(paired_read_bound({{0.01, 0.01, 0.01, 0.0}}, 1e8), InputError);
  EXPECT_THROW(paired_read_bound({{0.01, 0.01, 0.01, 1e8}}, 0.0), InputError);
  try {
    paired_read_bound({{0.01, 0.0, 0.01, 1e8}}, 1e8);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("step 0"), std::string::npos) << e.what();
  }
}

TEST(StepPairing, EachRecordedStepGetsThePassBeforeAndAfterIt) {
  StepPairing pairing(64 * 1024);
  pairing.after_step(0.5, 1e6, false);  // a prefill: its pass only
  pairing.after_step(0.25, 2e6);
  pairing.after_step(0.125, 3e6);
  const std::vector<PairedStep>& steps = pairing.steps();
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(steps[0].step_seconds, 0.25);
  EXPECT_EQ(steps[0].step_bytes, 2e6);
  EXPECT_EQ(steps[1].step_seconds, 0.125);
  // One pass between the two steps: after the first and before the second.
  EXPECT_EQ(steps[0].probe_after_seconds, steps[1].probe_before_seconds);
  EXPECT_NE(steps[0].probe_before_seconds, 0.0);
  EXPECT_EQ(pairing.probe_bytes(), 64.0 * 1024);
  EXPECT_EQ(pairing.summary().steps, 2);
}

TEST(ReadProbe, PassesTakeTimeAndCountWholeFloats) {
  const ReadProbe probe(4 * 1024 + 3);
  EXPECT_EQ(probe.bytes(), size_t{4 * 1024});
  EXPECT_GT(probe.pass_seconds(), 0.0);
  EXPECT_THROW(ReadProbe(3), InputError);
}

}  // namespace
}  // namespace strata
