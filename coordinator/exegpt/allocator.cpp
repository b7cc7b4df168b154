#include "coordinator/exegpt/allocator.h"

#include <algorithm>

#include "kernels/error.h"

namespace strata {

std::vector<int32_t> balance_layers(int32_t layers, const std::vector<StageCost>& stages) {
  const auto n = static_cast<int32_t>(stages.size());
  if (n <= 0) fail_input("no stages to allocate {} layers to", layers);
  if (layers < n) fail_input("{} layers cannot give each of {} stages one", layers, n);
  int64_t room = 0;
  for (const StageCost& s : stages) room += std::max(s.max_layers, 0);
  if (room < layers)
    fail_input("the {} stages hold {} layers in their memory, the model has {}", n, room, layers);
  constexpr double kInf = std::numeric_limits<double>::infinity();
  // best[s][j]: the smallest bottleneck of stages 0..s-1 holding layers [0, j), ties broken
  // by the smaller sum of squared stage times (the evener split); cut[s][j]: the layers
  // stage s-1 takes in it.
  struct Cost {
    double max = kInf, squares = kInf;
    bool operator<(const Cost& o) const {
      constexpr double kTie = 1e-12;
      if (max < o.max - kTie * std::max(1.0, o.max)) return true;
      if (max > o.max + kTie * std::max(1.0, o.max)) return false;
      return squares < o.squares;
    }
  };
  const auto L = static_cast<size_t>(layers);
  std::vector<std::vector<Cost>> best(static_cast<size_t>(n) + 1, std::vector<Cost>(L + 1));
  std::vector<std::vector<int32_t>> cut(static_cast<size_t>(n) + 1, std::vector<int32_t>(L + 1, 0));
  best[0][0] = Cost{0, 0};
  for (int32_t s = 1; s <= n; ++s) {
    const StageCost& c = stages[static_cast<size_t>(s - 1)];
    for (int32_t j = s; j <= layers - (n - s); ++j) {
      for (int32_t k = 1; k <= std::min(j - (s - 1), c.max_layers); ++k) {
        const Cost& prev = best[static_cast<size_t>(s - 1)][static_cast<size_t>(j - k)];
        if (prev.max == kInf) continue;
        const double t = k * c.per_layer + c.fixed;
        const Cost v{std::max(prev.max, t), prev.squares + t * t};
        if (v < best[static_cast<size_t>(s)][static_cast<size_t>(j)]) {
          best[static_cast<size_t>(s)][static_cast<size_t>(j)] = v;
          cut[static_cast<size_t>(s)][static_cast<size_t>(j)] = k;
        }
      }
    }
  }
  if (best[static_cast<size_t>(n)][L].max == kInf)
    fail_input("no split of {} layers over {} stages fits their memory", layers, n);
  std::vector<int32_t> counts(static_cast<size_t>(n));
  int32_t j = layers;
  for (int32_t s = n; s >= 1; --s) {
    counts[static_cast<size_t>(s - 1)] = cut[static_cast<size_t>(s)][static_cast<size_t>(j)];
    j -= counts[static_cast<size_t>(s - 1)];
  }
  return counts;
}

std::vector<double> stage_times(const std::vector<int32_t>& counts,
                                const std::vector<StageCost>& stages) {
  STRATA_CHECK(counts.size() == stages.size(), "{} counts for {} stages", counts.size(),
               stages.size());
  std::vector<double> t;
  for (size_t s = 0; s < counts.size(); ++s)
    t.push_back(counts[s] * stages[s].per_layer + stages[s].fixed);
  return t;
}

}  // namespace strata
