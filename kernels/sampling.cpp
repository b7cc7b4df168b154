#include "kernels/sampling.h"

#include <algorithm>
#include <cmath>

#include "kernels/error.h"

namespace strata {

std::string SamplingParams::str() const {
  std::string s =
      fmt::format("temperature={} top_k={} top_p={} seed={}", temperature, top_k, top_p, seed);
  if (min_p != 0.0f) s += fmt::format(" min_p={}", min_p);
  if (presence_penalty != 0.0f) s += fmt::format(" presence_penalty={}", presence_penalty);
  if (frequency_penalty != 0.0f) s += fmt::format(" frequency_penalty={}", frequency_penalty);
  if (repetition_penalty != 1.0f) s += fmt::format(" repetition_penalty={}", repetition_penalty);
  if (logprobs >= 0) s += fmt::format(" logprobs={}", logprobs);
  return s;
}

void SamplingParams::validate() const {
  if (!(temperature >= 0.0f) || !std::isfinite(temperature))
    fail_input("temperature must be >= 0, got {}", temperature);
  if (top_k < 0) fail_input("top_k must be >= 0 (0 = off), got {}", top_k);
  if (!(top_p > 0.0f && top_p <= 1.0f)) fail_input("top_p must be in (0, 1], got {}", top_p);
  if (!(min_p >= 0.0f && min_p <= 1.0f)) fail_input("min_p must be in [0, 1], got {}", min_p);
  if (!(presence_penalty >= -2.0f && presence_penalty <= 2.0f))
    fail_input("presence_penalty must be in [-2, 2], got {}", presence_penalty);
  if (!(frequency_penalty >= -2.0f && frequency_penalty <= 2.0f))
    fail_input("frequency_penalty must be in [-2, 2], got {}", frequency_penalty);
  if (!(repetition_penalty > 0.0f) || !std::isfinite(repetition_penalty))
    fail_input("repetition_penalty must be > 0 (1 = off), got {}", repetition_penalty);
  if (logprobs < -1 || logprobs > kMaxTopLogprobs)
    fail_input("top_logprobs must be in [0, {}], got {}", kMaxTopLogprobs, logprobs);
}

void TokenHistory::add_prompt(const std::vector<int32_t>& ids) {
  prompt_.insert(ids.begin(), ids.end());
}

void TokenHistory::add_output(int32_t id) {
  ++output_counts_[id];
}

void TokenHistory::apply_penalties(float* logits, int32_t n, const SamplingParams& p) const {
  const auto repeat = [&](int32_t id) {
    float& l = logits[id];
    l = l > 0.0f ? l / p.repetition_penalty : l * p.repetition_penalty;
  };
  if (p.repetition_penalty != 1.0f) {
    for (int32_t id : prompt_)
      if (id >= 0 && id < n) repeat(id);
    for (const auto& [id, _] : output_counts_)
      if (id >= 0 && id < n && !prompt_.contains(id)) repeat(id);
  }
  if (p.frequency_penalty == 0.0f && p.presence_penalty == 0.0f) return;
  for (const auto& [id, count] : output_counts_)
    if (id >= 0 && id < n)
      logits[id] -= p.frequency_penalty * static_cast<float>(count) + p.presence_penalty;
}

Logprobs token_logprobs(const float* logits, int32_t n, float temperature, int32_t token,
                        int32_t top) {
  STRATA_CHECK(n > 0 && token >= 0 && token < n, "logprobs of token {} over {} logits", token, n);
  const float inv_t = temperature > 0.0f ? 1.0f / temperature : 1.0f;
  float mx = logits[0] * inv_t;
  for (int32_t i = 1; i < n; ++i) mx = std::max(mx, logits[i] * inv_t);
  double sum = 0.0;  // double: a 150k-token vocabulary sums many small terms
  for (int32_t i = 0; i < n; ++i) sum += std::exp(static_cast<double>(logits[i] * inv_t - mx));
  const auto log_z = static_cast<float>(mx + std::log(sum));
  Logprobs out;
  out.logprob = logits[token] * inv_t - log_z;
  if (top <= 0) return out;
  std::vector<TokenLogprob> all(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) all[static_cast<size_t>(i)] = {i, logits[i] * inv_t - log_z};
  const auto k = static_cast<ptrdiff_t>(std::min(top, n));
  std::partial_sort(all.begin(), all.begin() + k, all.end(), [](const auto& a, const auto& b) {
    return a.logprob > b.logprob || (a.logprob == b.logprob && a.token < b.token);
  });
  out.top.assign(all.begin(), all.begin() + k);
  return out;
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
  // min-p: relative to the top token, so the renormalisation after top-p does not move it.
  if (params.min_p > 0.0f) {
    const float floor = params.min_p * candidates_[0].first;
    size_t cut = 1;
    while (cut < keep && candidates_[cut].first >= floor) ++cut;
    if (cut < keep) {
      sum = 0.0f;
      for (size_t i = 0; i < cut; ++i) sum += candidates_[i].first;
      keep = cut;
    }
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
