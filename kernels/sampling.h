// Token sampling on host logits: penalties, greedy, temperature, top-k, top-p, min-p, with a
// seeded RNG per sequence so a sequence's samples do not depend on what else is in its batch,
// and the log-probabilities a request asks for.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace strata {

// The order, as vLLM applies them: penalties on the raw logits (repetition, then frequency
// and presence), temperature, top-k, top-p, then min-p on what is left.
struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy (argmax, ties to the lowest id)
  int32_t top_k = 0;         // 0: off
  float top_p = 1.0f;        // 1: off
  uint64_t seed = 0;
  float min_p = 0.0f;  // 0: off; else drop tokens below min_p x the top token's probability
  // OpenAI's penalties on the tokens generated so far: logit -= frequency x count +
  // presence x (count > 0). In [-2, 2]; 0: off.
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  // CTRL's (Keskar et al. 2019), as Hugging Face and vLLM apply it to every token of the
  // prompt and the output: a positive logit is divided by it, a negative one multiplied.
  // > 0; 1: off.
  float repetition_penalty = 1.0f;
  // Log-probabilities to return with each token: -1 none, 0 the sampled token's, k > 0 also
  // the k most likely tokens'. Of the raw logits' softmax at the temperature (1 when greedy),
  // before penalties and filters (what OpenAI's API and vLLM report by default).
  int32_t logprobs = -1;

  // Penalties need the sequence's tokens (TokenHistory).
  bool uses_history() const {
    return presence_penalty != 0.0f || frequency_penalty != 0.0f || repetition_penalty != 1.0f;
  }
  std::string str() const;
  // Throws InputError naming the field when a value is out of range.
  void validate() const;
  bool operator==(const SamplingParams&) const = default;
};

inline constexpr int32_t kMaxTopLogprobs = 20;

// What the penalties see of one sequence: how often each token was generated, and which
// tokens the prompt holds. Sparse: a sequence touches few of the vocabulary's ids.
class TokenHistory {
 public:
  void add_prompt(const std::vector<int32_t>& ids);
  void add_output(int32_t id);
  // The penalties of `p` on logits[0 .. n) (ids outside it are ignored).
  void apply_penalties(float* logits, int32_t n, const SamplingParams& p) const;

 private:
  std::unordered_map<int32_t, int32_t> output_counts_;
  std::unordered_set<int32_t> prompt_;
};

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.0f;
  bool operator==(const TokenLogprob&) const = default;
};

// log softmax(logits / temperature) at `token`, and the `top` most likely tokens (highest
// first, ties to the lower id); temperature 0 counts as 1.
struct Logprobs {
  float logprob = 0.0f;
  std::vector<TokenLogprob> top;
  bool operator==(const Logprobs&) const = default;
};
Logprobs token_logprobs(const float* logits, int32_t n, float temperature, int32_t token,
                        int32_t top);

// xoshiro256** seeded through splitmix64: small, fast, identical on every platform.
class Rng {
 public:
  explicit Rng(uint64_t seed = 0);
  uint64_t next();
  float uniform();  // [0, 1), 24 random bits

 private:
  uint64_t s_[4];
};

class Sampler {
 public:
  // Picks a token from logits[0 .. n) (already penalised). Reuses internal scratch (no
  // allocation once warm).
  int32_t sample(const float* logits, int32_t n, const SamplingParams& params, Rng& rng);

 private:
  std::vector<std::pair<float, int32_t>> candidates_;
};

int32_t argmax(const float* x, int32_t n);

}  // namespace strata
