// fast_exp (kernels/fast_exp.h) against exp in double over the whole range it serves, its
// clamps, and NaN.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "kernels/fast_exp.h"

namespace strata {
namespace {

TEST(FastExp, WithinOneTenMillionthOfExpOverItsRange) {
  double worst = 0;
  for (float x = -87.0f; x <= 88.0f; x += 0.00137f) {
    const double want = std::exp(static_cast<double>(x));
    worst = std::max(worst, std::fabs(static_cast<double>(fast_exp(x)) - want) / want);
  }
  EXPECT_LT(worst, 1e-7);
  EXPECT_EQ(fast_exp(0.0f), 1.0f);
}

TEST(FastExp, ClampsOutsideTheRangeAndKeepsNaN) {
  EXPECT_FLOAT_EQ(fast_exp(-1000.0f), fast_exp(-87.0f));
  EXPECT_NEAR(fast_exp(-87.0f) / std::exp(-87.0), 1.0, 1e-6);
  EXPECT_FLOAT_EQ(fast_exp(1000.0f), fast_exp(88.0f));
  EXPECT_TRUE(std::isfinite(fast_exp(std::numeric_limits<float>::infinity())));
  EXPECT_TRUE(std::isnan(fast_exp(std::numeric_limits<float>::quiet_NaN())));
}

}  // namespace
}  // namespace strata
