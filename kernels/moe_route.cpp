#include "kernels/moe_route.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "kernels/error.h"

namespace strata {

int32_t ExpertRouting::active_experts() const {
  int32_t n = 0;
  for (int32_t e = 0; e < n_experts; ++e) n += rows_of(e) > 0 ? 1 : 0;
  return n;
}

std::string ExpertRouting::str() const {
  std::string s;
  for (int32_t e = 0; e < n_experts; ++e) s += fmt::format("{}{}", e == 0 ? "" : " ", rows_of(e));
  return fmt::format("ExpertRouting({} experts, top-{}, rows per expert: {})", n_experts, top_k, s);
}

namespace {

// One row: its top_k experts (most probable first) and their weights.
void route_row(const float* logit, int32_t n_experts, int32_t top_k, bool renormalise,
               std::vector<float>& prob, int32_t* experts, float* weights) {
  float max = -INFINITY;
  for (int32_t e = 0; e < n_experts; ++e) max = std::max(max, logit[e]);
  float sum = 0.0f;
  for (int32_t e = 0; e < n_experts; ++e) {
    prob[static_cast<size_t>(e)] = std::exp(logit[e] - max);
    sum += prob[static_cast<size_t>(e)];
  }
  const bool finite = std::isfinite(max) && std::isfinite(sum) && sum > 0.0f;
  for (int32_t e = 0; e < n_experts; ++e)
    prob[static_cast<size_t>(e)] = finite ? prob[static_cast<size_t>(e)] / sum : 0.0f;
  // Selection by insertion: k is small (2 to 8) and a strict > keeps the lower index first.
  int32_t n = 0;
  for (int32_t e = 0; e < n_experts; ++e) {
    const float p = prob[static_cast<size_t>(e)];
    if (n == top_k && !(p > weights[n - 1])) continue;
    int32_t at = n < top_k ? n++ : top_k - 1;
    while (at > 0 && p > weights[at - 1]) {
      weights[at] = weights[at - 1];
      experts[at] = experts[at - 1];
      --at;
    }
    weights[at] = p;
    experts[at] = e;
  }
  if (!renormalise) return;
  float picked = 0.0f;
  for (int32_t j = 0; j < top_k; ++j) picked += weights[j];
  for (int32_t j = 0; j < top_k; ++j) weights[j] = picked > 0.0f ? weights[j] / picked : 0.0f;
}

}  // namespace

void route_top_k(const float* logits, int64_t rows, int32_t n_experts, int32_t top_k,
                 bool renormalise, ExpertRouting& out) {
  STRATA_CHECK(n_experts > 0 && top_k > 0 && top_k <= n_experts && rows >= 0,
               "routing {} rows to top-{} of {} experts", rows, top_k, n_experts);
  const auto k = static_cast<size_t>(top_k);
  const auto entries = static_cast<size_t>(rows) * k;
  std::vector<int32_t>& picked = out.picked;
  std::vector<float>& weight = out.picked_weights;
  std::vector<float>& prob = out.probabilities;
  picked.resize(entries);
  weight.resize(entries);
  prob.resize(static_cast<size_t>(n_experts));
  for (int64_t r = 0; r < rows; ++r)
    route_row(logits + r * n_experts, n_experts, top_k, renormalise, prob,
              picked.data() + static_cast<size_t>(r) * k,
              weight.data() + static_cast<size_t>(r) * k);
  // Counting sort by expert: stable, so each expert's rows stay ascending.
  out.n_experts = n_experts;
  out.top_k = top_k;
  out.offsets.assign(static_cast<size_t>(n_experts) + 1, 0);
  for (const int32_t e : picked) ++out.offsets[static_cast<size_t>(e) + 1];
  for (size_t e = 0; e < static_cast<size_t>(n_experts); ++e) out.offsets[e + 1] += out.offsets[e];
  out.rows.resize(entries);
  out.weights.resize(entries);
  std::vector<int32_t>& next = out.next;
  next.assign(out.offsets.begin(), out.offsets.end() - 1);
  for (size_t i = 0; i < entries; ++i) {
    const auto at = static_cast<size_t>(next[static_cast<size_t>(picked[i])]++);
    out.rows[at] = static_cast<int32_t>(i / k);
    out.weights[at] = weight[i];
  }
}

}  // namespace strata
