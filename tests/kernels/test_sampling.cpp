// Penalties, min-p and log-probabilities against hand-worked cases: the expected numbers are
// the formulas (OpenAI's presence/frequency penalties, CTRL's repetition penalty, log-softmax
// at a temperature) worked out on paper, not this code's output.
#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <vector>

#include "kernels/error.h"
#include "kernels/sampling.h"

namespace strata {
namespace {

TEST(Sampling, RepetitionPenaltyDividesPositiveAndMultipliesNegativeLogitsOnce) {
  // Prompt {0, 1}, output {1, 1}: token 1 is in both and is penalised once, token 3 never.
  std::vector<float> logits{2.0f, -1.0f, 0.5f, 3.0f};
  TokenHistory h;
  h.add_prompt({0, 1});
  h.add_output(1);
  h.add_output(1);
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  h.apply_penalties(logits.data(), 4, p);
  EXPECT_FLOAT_EQ(logits[0], 1.0f);   // 2 / 2
  EXPECT_FLOAT_EQ(logits[1], -2.0f);  // -1 x 2
  EXPECT_FLOAT_EQ(logits[2], 0.5f);
  EXPECT_FLOAT_EQ(logits[3], 3.0f);
}

TEST(Sampling, FrequencyAndPresencePenaltiesCountOnlyTheOutput) {
  // Output 0, 0, 2 and a prompt holding 1: logit -= 0.5 x count + 0.25 x (count > 0).
  std::vector<float> logits{1.0f, 1.0f, 1.0f};
  TokenHistory h;
  h.add_prompt({1});
  for (int32_t t : {0, 0, 2}) h.add_output(t);
  SamplingParams p;
  p.frequency_penalty = 0.5f;
  p.presence_penalty = 0.25f;
  h.apply_penalties(logits.data(), 3, p);
  EXPECT_FLOAT_EQ(logits[0], 1.0f - 1.0f - 0.25f);
  EXPECT_FLOAT_EQ(logits[1], 1.0f);
  EXPECT_FLOAT_EQ(logits[2], 1.0f - 0.5f - 0.25f);
}

TEST(Sampling, PenaltiesOffLeaveTheLogitsAlone) {
  std::vector<float> logits{1.0f, -2.0f};
  TokenHistory h;
  h.add_prompt({0, 1});
  h.add_output(0);
  const SamplingParams p;
  EXPECT_FALSE(p.uses_history());
  h.apply_penalties(logits.data(), 2, p);
  EXPECT_EQ(logits, (std::vector<float>{1.0f, -2.0f}));
}

TEST(Sampling, LogprobsAreTheLogSoftmaxAtTheTemperature) {
  // Logits 0, ln 2, ln 3: at T = 1 the probabilities are 1/6, 2/6, 3/6.
  const std::vector<float> logits{0.0f, std::log(2.0f), std::log(3.0f)};
  Logprobs a = token_logprobs(logits.data(), 3, 1.0f, 1, 2);
  EXPECT_NEAR(a.logprob, std::log(2.0 / 6.0), 1e-6);
  ASSERT_EQ(a.top.size(), 2u);
  EXPECT_EQ(a.top[0].token, 2);
  EXPECT_NEAR(a.top[0].logprob, std::log(0.5), 1e-6);
  EXPECT_EQ(a.top[1].token, 1);
  // At T = 0.5 the scaled logits are 0, 2 ln 2, 2 ln 3: probabilities 1/14, 4/14, 9/14.
  Logprobs b = token_logprobs(logits.data(), 3, 0.5f, 0, 0);
  EXPECT_NEAR(b.logprob, std::log(1.0 / 14.0), 1e-6);
  EXPECT_TRUE(b.top.empty());
  // Greedy (T = 0) reports the distribution at T = 1.
  EXPECT_NEAR(token_logprobs(logits.data(), 3, 0.0f, 2, 0).logprob, std::log(0.5), 1e-6);
}

TEST(Sampling, TopLogprobsBreakTiesTowardTheLowerId) {
  const std::vector<float> logits{1.0f, 3.0f, 3.0f, 2.0f};
  Logprobs l = token_logprobs(logits.data(), 4, 1.0f, 0, 3);
  ASSERT_EQ(l.top.size(), 3u);
  EXPECT_EQ(l.top[0].token, 1);
  EXPECT_EQ(l.top[1].token, 2);
  EXPECT_EQ(l.top[2].token, 3);
}

TEST(Sampling, MinPDropsTokensBelowItsShareOfTheTopProbability) {
  // Probabilities 0.5, 0.3, 0.15, 0.05; min_p 0.35 keeps p >= 0.175: tokens 0 and 1 only.
  const std::vector<float> logits{std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};
  SamplingParams p;
  p.temperature = 1.0f;
  p.min_p = 0.35f;
  Sampler s;
  Rng rng(7);
  std::set<int32_t> seen;
  int zeros = 0;
  constexpr int kDraws = 4000;
  for (int i = 0; i < kDraws; ++i) {
    const int32_t t = s.sample(logits.data(), 4, p, rng);
    seen.insert(t);
    zeros += t == 0;
  }
  EXPECT_EQ(seen, (std::set<int32_t>{0, 1}));
  // Renormalised over the kept two: P(0) = 0.5 / 0.8 = 0.625.
  EXPECT_NEAR(zeros / double(kDraws), 0.625, 0.03);
  p.min_p = 0.0f;  // off: all four appear
  seen.clear();
  for (int i = 0; i < kDraws; ++i) seen.insert(s.sample(logits.data(), 4, p, rng));
  EXPECT_EQ(seen.size(), 4u);
}

TEST(Sampling, ValidateNamesTheFieldOutOfRange) {
  const auto refused = [](auto set, const char* field) {
    SamplingParams p;
    set(p);
    try {
      p.validate();
      ADD_FAILURE() << field << " accepted";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  refused([](SamplingParams& p) { p.min_p = 1.5f; }, "min_p");
  refused([](SamplingParams& p) { p.presence_penalty = 2.5f; }, "presence_penalty");
  refused([](SamplingParams& p) { p.frequency_penalty = -3.0f; }, "frequency_penalty");
  refused([](SamplingParams& p) { p.repetition_penalty = 0.0f; }, "repetition_penalty");
  refused([](SamplingParams& p) { p.logprobs = kMaxTopLogprobs + 1; }, "top_logprobs");
}

}  // namespace
}  // namespace strata
