#include "worker/scoring.h"

#include <algorithm>
#include <cmath>

#include "kernels/error.h"

namespace strata {

std::vector<float> teacher_forced_logits(Model& model, std::span<const int32_t> ids,
                                         int32_t chunk) {
  const ModelConfig& c = model.config();
  if (ids.empty()) fail_input("cannot score an empty sequence");
  if (static_cast<int64_t>(ids.size()) > c.max_positions)
    fail_input("sequence of {} tokens exceeds the model's {} positions", ids.size(),
               c.max_positions);
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= c.vocab)
      fail_input("token {} at index {} is outside the vocabulary [0, {})", ids[i], i, c.vocab);
  const auto step = static_cast<size_t>(std::clamp(chunk, 1, model.max_rows()));
  const std::unique_ptr<KvCache> owned_cache =
      model.make_cache(1, static_cast<int32_t>(ids.size()));
  KvCache& cache = *owned_cache;
  std::vector<float> out(ids.size() * static_cast<size_t>(c.vocab));
  StepBatch batch;
  for (size_t pos = 0; pos < ids.size(); pos += step) {
    const size_t n = std::min(ids.size() - pos, step);
    batch.clear();
    batch.add(0, static_cast<int32_t>(pos), ids.subspan(pos, n), false);
    for (int32_t r = 0; r < static_cast<int32_t>(n); ++r) batch.logit_rows.push_back(r);
    model.forward(batch, cache, out.data() + pos * static_cast<size_t>(c.vocab));
  }
  return out;
}

std::vector<double> next_token_logprobs(std::span<const float> logits, std::span<const int32_t> ids,
                                        int32_t vocab) {
  std::vector<double> lp;
  for (size_t i = 0; i + 1 < ids.size(); ++i) {
    const float* row = logits.data() + i * static_cast<size_t>(vocab);
    const double mx = *std::max_element(row, row + vocab);
    double sum = 0.0;
    for (int32_t v = 0; v < vocab; ++v) sum += std::exp(static_cast<double>(row[v]) - mx);
    lp.push_back(static_cast<double>(row[ids[i + 1]]) - mx - std::log(sum));
  }
  return lp;
}

}  // namespace strata
