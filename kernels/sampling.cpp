#include "kernels/sampling.h"

#include <algorithm>
#include <cmath>

#include "kernels/error.h"

namespace strata {

std::string SamplingParams::str() const {
  return fmt::format("temperature={} top_k={} top_p={} seed={}", temperature, top_k, top_p, seed);
}

void SamplingParams::validate() const {
  if (!(temperature >= 0.0f) || !std::isfinite(temperature))
    fail_input("temperature must be >= 0, got {}", temperature);
  if (top_k < 0) fail_input("top_k must be >= 0 (0 = off), got {}", top_k);
  if (!(top_p > 0.0f && top_p <= 1.0f)) fail_input("top_p must be in (0, 1], got {}", top_p);
}

namespace {
uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
uint64_t rotl(uint64_t x, int k) {
  return (x << k) | (x >> (64 - k));
}
}  // namespace

Rng::Rng(uint64_t seed) {
  for (auto& s : s_) s = splitmix64(seed);
}

uint64_t Rng::next() {
  const uint64_t result = rotl(s_[1] * 5, 7) * 9;
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = rotl(s_[3], 45);
  return result;
}

float Rng::uniform() {
  return static_cast<float>(next() >> 40) * (1.0f / 16777216.0f);
}

int32_t argmax(const float* x, int32_t n) {
  int32_t best = 0;
  for (int32_t i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return best;
}

int32_t Sampler::sample(const float* logits, int32_t n, const SamplingParams& params, Rng& rng) {
  STRATA_CHECK(n > 0, "sample over {} logits", n);
  if (params.temperature == 0.0f) return argmax(logits, n);

  candidates_.resize(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i)
    candidates_[static_cast<size_t>(i)] = {logits[i] / params.temperature, i};
  // Highest logit first; equal logits keep the lower id first so results are reproducible.
  auto by_logit = [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  size_t keep = candidates_.size();
  if (params.top_k > 0 && static_cast<size_t>(params.top_k) < keep) {
    keep = static_cast<size_t>(params.top_k);
    std::partial_sort(candidates_.begin(), candidates_.begin() + static_cast<std::ptrdiff_t>(keep),
                      candidates_.end(), by_logit);
  } else {
    std::sort(candidates_.begin(), candidates_.end(), by_logit);
  }
  // Softmax over the kept candidates (sorted, so the first is the maximum).
  const float mx = candidates_[0].first;
  float sum = 0.0f;
  for (size_t i = 0; i < keep; ++i) {
    candidates_[i].first = std::exp(candidates_[i].first - mx);
    sum += candidates_[i].first;
  }
  for (size_t i = 0; i < keep; ++i) candidates_[i].first /= sum;
  // Nucleus: the smallest prefix whose probability reaches top_p.
  if (params.top_p < 1.0f) {
    float cum = 0.0f;
    size_t cut = keep;
    for (size_t i = 0; i < keep; ++i) {
      cum += candidates_[i].first;
      if (cum >= params.top_p) {
        cut = i + 1;
        break;
      }
    }
    keep = cut;
    sum = cum;
  } else {
    sum = 1.0f;
  }
  const float r = rng.uniform() * sum;
  float cum = 0.0f;
  for (size_t i = 0; i < keep; ++i) {
    cum += candidates_[i].first;
    if (r < cum) return candidates_[i].second;
  }
  return candidates_[keep - 1].second;  // rounding left r at the very top
}

}  // namespace strata
