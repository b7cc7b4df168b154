#include "coordinator/exegpt/schedule_search.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>

#include "kernels/error.h"

namespace strata {
namespace {

using json = nlohmann::json;

// A block of the grid, inclusive corners (lo1, lo2) .. (hi1, hi2).
struct Block {
  int32_t lo1, lo2, hi1, hi2;
  Perf upper;  // at (hi1, hi2): the most throughput any point of the block can have
  Perf lower;  // at (lo1, lo2): the least latency any point of the block can have
  bool point() const { return lo1 == hi1 && lo2 == hi2; }
};

class Evaluator {
 public:
  explicit Evaluator(const PerfFn& f) : f_(f) {}
  Perf operator()(int32_t i1, int32_t i2) {
    const auto key = std::make_pair(i1, i2);
    if (auto it = memo_.find(key); it != memo_.end()) return it->second;
    return memo_[key] = f_(i1, i2);
  }
  int64_t evaluated() const { return static_cast<int64_t>(memo_.size()); }

 private:
  const PerfFn& f_;
  std::map<std::pair<int32_t, int32_t>, Perf> memo_;
};

}  // namespace

BnbResult exhaustive(int32_t n1, int32_t n2, const PerfFn& perf, double latency_bound) {
  BnbResult r;
  for (int32_t i = 0; i < n1; ++i)
    for (int32_t j = 0; j < n2; ++j) {
      const Perf p = perf(i, j);
      ++r.points_evaluated;
      if (i == 0 && j == 0) r.fastest_latency = p.latency;
      r.fastest_latency = std::min(r.fastest_latency, p.latency);
      if (std::isfinite(p.latency) && p.latency <= latency_bound &&
          (!r.found || p.throughput > r.perf.throughput)) {
        r = BnbResult{true, i, j, p, r.points_evaluated, r.fastest_latency};
      }
    }
  return r;
}

// Algorithm 1 (§5.1). Blocks are taken best upper bound first; a block whose least latency
// misses the bound (by more than ε_L) holds no feasible point and is dropped, one whose
// upper bound trails the best found (by more than ε_T) is pruned. A block is split where
// its better feasible corner points: top-left (x1 low, x2 high) better -> split along x1,
// bottom-right better -> along x2, neither feasible -> along the longer side.
BnbResult branch_and_bound(int32_t n1, int32_t n2, const PerfFn& perf, const BnbOptions& o) {
  STRATA_CHECK(n1 > 0 && n2 > 0, "search grid {} x {}", n1, n2);
  Evaluator eval(perf);
  BnbResult best;
  const double bound = o.latency_bound;
  const double eps_l = std::isfinite(bound) ? o.eps_latency * bound : 0.0;
  // A point that cannot run at all has infinite latency (and an unknown, infinite,
  // throughput: it bounds nothing from above).
  auto feasible = [&](const Perf& p) { return std::isfinite(p.latency) && p.latency <= bound; };
  auto offer = [&](int32_t i1, int32_t i2, const Perf& p) {
    if (feasible(p) && (!best.found || p.throughput > best.perf.throughput))
      best = BnbResult{true, i1, i2, p, 0, best.fastest_latency};
  };
  auto make = [&](int32_t lo1, int32_t lo2, int32_t hi1, int32_t hi2) {
    return Block{lo1, lo2, hi1, hi2, eval(hi1, hi2), eval(lo1, lo2)};
  };
  Block root = make(0, 0, n1 - 1, n2 - 1);
  best.fastest_latency = root.lower.latency;
  offer(0, 0, root.lower);
  offer(n1 - 1, n2 - 1, root.upper);
  if (feasible(root.upper) || root.lower.latency >= bound + eps_l) {  // optimal at once, or none
    best.points_evaluated = eval.evaluated();
    return best;
  }
  auto cmp = [](const Block& a, const Block& b) { return a.upper.throughput < b.upper.throughput; };
  std::vector<Block> queue{root};
  auto prune = [&] {
    if (!best.found) return;
    const double floor = best.perf.throughput * (1 - o.eps_throughput);
    std::erase_if(queue, [&](const Block& b) { return b.upper.throughput < floor; });
  };
  while (!queue.empty()) {
    std::pop_heap(queue.begin(), queue.end(), cmp);
    const Block b = queue.back();
    queue.pop_back();
    if (b.point()) continue;  // its one point was offered when the block was made
    const Perf tl = eval(b.lo1, b.hi2), br = eval(b.hi1, b.lo2);
    offer(b.lo1, b.hi2, tl);
    offer(b.hi1, b.lo2, br);
    bool along_x1;  // split the x1 range (a vertical cut)
    if (feasible(tl) && (!feasible(br) || tl.throughput >= br.throughput)) {
      along_x1 = true;
    } else if (feasible(br)) {
      along_x1 = false;
    } else {
      along_x1 = b.hi1 - b.lo1 >= b.hi2 - b.lo2;
    }
    if (along_x1 && b.hi1 == b.lo1) along_x1 = false;
    if (!along_x1 && b.hi2 == b.lo2) along_x1 = true;
    Block parts[2];
    if (along_x1) {
      const int32_t mid = (b.lo1 + b.hi1) / 2;
      parts[0] = make(b.lo1, b.lo2, mid, b.hi2);
      parts[1] = make(mid + 1, b.lo2, b.hi1, b.hi2);
    } else {
      const int32_t mid = (b.lo2 + b.hi2) / 2;
      parts[0] = make(b.lo1, b.lo2, b.hi1, mid);
      parts[1] = make(b.lo1, mid + 1, b.hi1, b.hi2);
    }
    for (const Block& part : parts) {
      offer(part.hi1, part.hi2, part.upper);
      offer(part.lo1, part.lo2, part.lower);
      if (part.lower.latency < bound + eps_l) {
        queue.push_back(part);
        std::push_heap(queue.begin(), queue.end(), cmp);
      }
    }
    prune();
    std::make_heap(queue.begin(), queue.end(), cmp);
  }
  best.points_evaluated = eval.evaluated();
  return best;
}

std::vector<int32_t> geometric_values(int32_t max) {
  std::vector<int32_t> v;
  for (int64_t p = 1; p <= max; p *= 2) {
    v.push_back(static_cast<int32_t>(p));
    if (p >= 2 && p + p / 2 <= max) v.push_back(static_cast<int32_t>(p + p / 2));
  }
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  if (max >= 1 && v.back() != max) v.push_back(max);
  return v;
}

ScheduleSearchOptions ScheduleSearchOptions::defaults(const Simulator& sim,
                                                      int32_t max_encode_batch) {
  ScheduleSearchOptions o;
  o.encode_batches = geometric_values(std::max(max_encode_batch, 1));
  const int32_t longest = std::max(sim.inputs().workload.output.percentile(0.99) - 1, 1);
  o.decode_iters = geometric_values(longest);
  o.micro_batches = {1};
  for (int32_t k = 2; k <= std::min(sim.workers(), 4); k *= 2) o.micro_batches.push_back(k);
  // One decoder micro-batch per decoder stage dominates in the simulator's cost model
  // (simulator.cpp waa()): 1 asks for exactly that.
  o.decoder_micro_batches = {1};
  for (int32_t d : {2, 4})
    if (d <= sim.workers() && sim.inputs().shape.tp_divides(d)) o.tp_degrees.push_back(d);
  return o;
}

namespace {

// A schedule that does not fit in memory: no latency, and no bound on the throughput of the
// points below it (the memory grows with both variables, so they may well fit).
Perf perf_of(const Prediction& p) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  return p.feasible ? Perf{p.throughput_tok_s, p.p99_latency_s} : Perf{kInf, kInf};
}

// One search over two variables for one policy and micro-batch count.
struct Search {
  const Simulator& sim;
  const ScheduleSearchOptions& o;
  SchedulePolicy policy;
  int32_t micro_batches;  // RRA's, fixed for this search
  int32_t tp_degree = 1;  // RRA's partial tensor parallelism, fixed for this search
  int32_t tp_groups = 0;

  // x1: B_E ascending; x2: RRA N_D descending (encode more often), WAA B_m descending.
  ScheduleVars vars(int32_t i1, int32_t i2) const {
    ScheduleVars v;
    v.policy = policy;
    v.encode_batch = o.encode_batches[static_cast<size_t>(i1)];
    if (policy == SchedulePolicy::kRra) {
      v.decode_iters = o.decode_iters[o.decode_iters.size() - 1 - static_cast<size_t>(i2)];
      v.micro_batches = micro_batches;
      v.tp_degree = tp_degree;
      v.tp_groups = tp_groups;
    } else {
      const auto& bm = o.decoder_micro_batches;
      v.micro_batches = bm[bm.size() - 1 - static_cast<size_t>(i2)];
    }
    return v;
  }
  int32_t n2() const {
    return static_cast<int32_t>(policy == SchedulePolicy::kRra ? o.decode_iters.size()
                                                               : o.decoder_micro_batches.size());
  }
};

// Algorithm 1 (or every point) over one search's grid; its best within the bound joins
// the choice.
void run_search(const Search& s, ScheduleChoice& choice) {
  const ScheduleSearchOptions& o = s.o;
  const auto n1 = static_cast<int32_t>(o.encode_batches.size());
  std::map<std::pair<int32_t, int32_t>, Prediction> seen;
  const PerfFn f = [&](int32_t i1, int32_t i2) {
    const Prediction p = o.fixed_allocation ? s.sim.predict(s.vars(i1, i2), *o.fixed_allocation)
                                            : s.sim.predict(s.vars(i1, i2));
    seen[{i1, i2}] = p;
    if (!p.feasible &&
        (!choice.smallest_unfit || p.vars.encode_batch < choice.smallest_unfit->vars.encode_batch))
      choice.smallest_unfit = p;
    return perf_of(p);
  };
  const BnbResult r =
      o.exhaustive ? exhaustive(n1, s.n2(), f, o.latency_bound)
                   : branch_and_bound(n1, s.n2(), f,
                                      BnbOptions{o.latency_bound, o.eps_throughput, o.eps_latency});
  choice.points_evaluated += r.points_evaluated;
  choice.grid_points += static_cast<int64_t>(n1) * s.n2();
  choice.fastest_latency_s = std::min(choice.fastest_latency_s, r.fastest_latency);
  if (!r.found) return;
  const Prediction& p = seen.at({r.i1, r.i2});
  choice.per_search.push_back(p);
  if (!choice.feasible || p.throughput_tok_s > choice.best.throughput_tok_s) {
    choice.best = p;
    choice.feasible = true;
  }
}

}  // namespace

ScheduleChoice search_schedule(const Simulator& sim, const ScheduleSearchOptions& o) {
  if (o.encode_batches.empty() || o.decode_iters.empty() || o.micro_batches.empty())
    fail_input("the schedule search needs B_E, N_D and micro-batch values");
  ScheduleChoice choice;
  choice.latency_bound = o.latency_bound;
  for (SchedulePolicy policy : o.policies) {
    const bool rra = policy == SchedulePolicy::kRra;
    if (!rra && o.fixed_allocation) continue;  // WAA allocates its own
    if (!rra && sim.workers() < 2) continue;   // WAA needs an encoder and a decoder
    // (degree, groups): none, then each degree over 1, 2, ... groups (RRA on its own
    // allocation only; a fixed one keeps its groups).
    std::vector<std::pair<int32_t, int32_t>> splits = {{1, 0}};
    if (rra && !o.fixed_allocation)
      for (int32_t d : o.tp_degrees)
        for (int32_t g = 1; g * d <= sim.workers(); ++g) splits.emplace_back(d, g);
    for (const auto& [tp_degree, tp_groups] : splits)
      for (int32_t k : rra ? o.micro_batches : std::vector<int32_t>{0})
        run_search(Search{sim, o, policy, k, tp_degree, tp_groups}, choice);
  }
  if (!o.fixed_allocation)
    choice.baseline = search_baseline(sim, o.latency_bound, o.encode_batches, o.micro_batches,
                                      nullptr, &choice.baseline_points);
  return choice;
}

std::optional<Prediction> search_baseline(const Simulator& sim, double latency_bound,
                                          const std::vector<int32_t>& batches,
                                          const std::vector<int32_t>& micro_batches,
                                          std::vector<Prediction>* all, int64_t* points) {
  std::optional<Prediction> best;
  for (int32_t k : micro_batches)
    for (int32_t b : batches) {
      if (b < k) continue;
      const Prediction p = sim.predict(ScheduleVars{SchedulePolicy::kBaseline, b, 1, k, 1});
      if (points != nullptr) ++*points;
      if (!p.feasible) continue;
      if (all != nullptr) all->push_back(p);
      if (p.p99_latency_s <= latency_bound &&
          (!best || p.throughput_tok_s > best->throughput_tok_s))
        best = p;
    }
  return best;
}

json ScheduleChoice::to_json() const {
  json j{{"feasible", feasible},
         {"latency_bound_s", std::isfinite(latency_bound) ? json(latency_bound) : json("inf")},
         {"points_evaluated", points_evaluated},
         {"grid_points", grid_points},
         {"fastest_latency_s", fastest_latency_s}};
  if (!feasible) j["why_none"] = why_none();
  if (feasible) {
    const json b = best.to_json();
    j["policy"] = b["policy"];
    j["control_variables"] = b["control_variables"];
    j["allocation"] = b["allocation"];
    j["predicted_throughput_tok_s"] = best.throughput_tok_s;
    j["predicted_p99_latency_s"] = best.p99_latency_s;
    j["schedule"] = b;
  }
  json per = json::array();
  for (const Prediction& p : per_search) per.push_back(p.to_json());
  j["per_search"] = per;
  if (baseline) {
    j["baseline"] = {{"feasible", true},
                     {"control_variables", baseline->vars.to_json()},
                     {"predicted_throughput_tok_s", baseline->throughput_tok_s},
                     {"predicted_p99_latency_s", baseline->p99_latency_s},
                     {"allocation", baseline->allocation.layers}};
  } else {
    j["baseline"] = {{"feasible", false}};
  }
  j["baseline_points"] = baseline_points;
  return j;
}

bool ScheduleChoice::fits_nowhere() const {
  return !feasible && !std::isfinite(fastest_latency_s) && smallest_unfit.has_value();
}

std::string ScheduleChoice::why_none() const {
  if (!fits_nowhere())
    return fmt::format("the fastest achievable p99 latency is {:.3f} s", fastest_latency_s);
  return fmt::format("no schedule fits; the smallest tried, {}: {}", smallest_unfit->vars.str(),
                     smallest_unfit->infeasible_reason);
}

std::string ScheduleChoice::str() const {
  std::string out;
  const std::string bound =
      std::isfinite(latency_bound) ? fmt::format("{:.3f} s", latency_bound) : std::string("inf");
  if (feasible) {
    out += fmt::format("chosen (latency bound {}): {}\n", bound, best.str());
  } else {
    out += fmt::format("no schedule meets the latency bound {}: {}\n", bound, why_none());
  }
  for (const Prediction& p : per_search) out += fmt::format("  best {}\n", p.str());
  out += baseline ? fmt::format("baseline (FT-style): {}\n", baseline->str())
                  : std::string("baseline (FT-style): no configuration meets the bound\n");
  if (feasible && baseline && baseline->throughput_tok_s > 0)
    out += fmt::format("speed-up over the baseline: {:.2f}x\n",
                       best.throughput_tok_s / baseline->throughput_tok_s);
  out += fmt::format("points evaluated: {} of {} ({} for the baseline)", points_evaluated,
                     grid_points, baseline_points);
  return out;
}

}  // namespace strata
