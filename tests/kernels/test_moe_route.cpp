// MoE routing against hand-computed softmax / top-k / renormalisation (Hugging Face's
// MixtralSparseMoeBlock and Qwen2MoeSparseMoeBlock: softmax over every expert in f32, topk,
// weights / their sum when norm_topk_prob), and the grouping of rows by expert.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "kernels/moe_route.h"

namespace strata {
namespace {

TEST(MoeRoute, SoftmaxTopTwoOfFourByHand) {
  // Row 0: logits (1, 3, 2, 0): probabilities e^l / sum; top-2 experts 1 and 2.
  // Row 1: logits (0, 0, 5, 4): experts 2 and 3.
  const std::vector<float> logits = {1, 3, 2, 0, 0, 0, 5, 4};
  ExpertRouting r;
  route_top_k(logits.data(), 2, 4, 2, /*renormalise=*/false, r);
  const double s0 = std::exp(1.0) + std::exp(3.0) + std::exp(2.0) + 1.0;
  const double s1 = 2.0 + std::exp(5.0) + std::exp(4.0);
  ASSERT_EQ(r.offsets, (std::vector<int32_t>{0, 0, 1, 3, 4}));
  EXPECT_EQ(r.rows, (std::vector<int32_t>{0, 0, 1, 1}));  // expert 1: row 0; 2: rows 0, 1; 3: 1
  EXPECT_NEAR(r.weights[0], std::exp(3.0) / s0, 1e-6);
  EXPECT_NEAR(r.weights[1], std::exp(2.0) / s0, 1e-6);
  EXPECT_NEAR(r.weights[2], std::exp(5.0) / s1, 1e-6);
  EXPECT_NEAR(r.weights[3], std::exp(4.0) / s1, 1e-6);
  EXPECT_EQ(r.active_experts(), 3);
  EXPECT_EQ(r.rows_of(0), 0);
}

TEST(MoeRoute, RenormalisedWeightsAreTheSoftmaxOfTheSelectedLogits) {
  // Mixtral: softmax over all, top-2, divided by their sum == softmax over (3, 2).
  const std::vector<float> logits = {1, 3, 2, 0};
  ExpertRouting r;
  route_top_k(logits.data(), 1, 4, 2, /*renormalise=*/true, r);
  const double a = 1.0 / (1.0 + std::exp(-1.0));  // e^3 / (e^3 + e^2)
  EXPECT_NEAR(r.weights[static_cast<size_t>(r.begin(1))], a, 1e-6);
  EXPECT_NEAR(r.weights[static_cast<size_t>(r.begin(2))], 1.0 - a, 1e-6);
}

TEST(MoeRoute, TiesGoToTheLowerExpertAsTorchTopkKeepsThem) {
  const std::vector<float> logits = {2, 5, 5, 5};
  ExpertRouting r;
  route_top_k(logits.data(), 1, 4, 2, false, r);
  EXPECT_EQ(r.rows_of(1), 1);
  EXPECT_EQ(r.rows_of(2), 1);
  EXPECT_EQ(r.rows_of(3), 0);
}

TEST(MoeRoute, EachExpertsRowsAscendAndEveryRowHasItsK) {
  // 32 rows, top-2 of 8: each row appears exactly twice, each expert's rows ascend.
  std::vector<float> logits(32 * 8);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = std::sin(static_cast<float>(i) * 1.37f);
  ExpertRouting r;
  route_top_k(logits.data(), 32, 8, 2, true, r);
  std::vector<int> seen(32, 0);
  for (int32_t e = 0; e < 8; ++e)
    for (int32_t i = r.begin(e); i < r.begin(e) + r.rows_of(e); ++i) {
      ++seen[static_cast<size_t>(r.rows[static_cast<size_t>(i)])];
      if (i > r.begin(e)) {
        EXPECT_LT(r.rows[static_cast<size_t>(i) - 1], r.rows[static_cast<size_t>(i)]);
      }
    }
  for (int s : seen) EXPECT_EQ(s, 2);
  EXPECT_EQ(r.offsets.back(), 64);
}

TEST(MoeRoute, NonFiniteLogitsGiveZeroWeightsNotAThrow) {
  const std::vector<float> logits = {std::numeric_limits<float>::quiet_NaN(), 1, 2, 3};
  ExpertRouting r;
  route_top_k(logits.data(), 1, 4, 2, true, r);
  for (float w : r.weights) EXPECT_EQ(w, 0.0f);
}

}  // namespace
}  // namespace strata
