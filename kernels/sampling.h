// Token sampling on host logits: greedy, temperature, top-k, top-p, with a seeded RNG per
// sequence so a sequence's samples do not depend on what else is in its batch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace strata {

struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy (argmax, ties to the lowest id)
  int32_t top_k = 0;         // 0: off
  float top_p = 1.0f;        // 1: off
  uint64_t seed = 0;

  std::string str() const;
  // Throws InputError naming the field when a value is out of range.
  void validate() const;
};

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
  // Picks a token from logits[0 .. n). Reuses internal scratch (no allocation once warm).
  int32_t sample(const float* logits, int32_t n, const SamplingParams& params, Rng& rng);

 private:
  std::vector<std::pair<float, int32_t>> candidates_;
};

int32_t argmax(const float* x, int32_t n);

}  // namespace strata
