#include "placement/pie.h"

#include <algorithm>
#include <cmath>

#include "kernels/error.h"

namespace strata {

namespace {

void check_layers(int32_t n_layers, int32_t host_layers, const char* who) {
  if (n_layers < 1) fail_input("{}: {} layers; Pie needs at least one", who, n_layers);
  if (host_layers < 0 || host_layers >= n_layers)
    fail_input(
        "{}: {} host layers of {}: m must be in [0, {}] (at least one layer's KV cache stays "
        "on the GPU)",
        who, host_layers, n_layers, n_layers - 1);
}

void check_time(double t, const char* what) {
  if (!(t > 0) || !std::isfinite(t))
    fail_input("Pie simulation: {} {} must be a positive number of seconds", what, t);
}

// Swaps ending at the decision time count as completed then (the paper's layer 4 sees the
// swap-out of layer 1 that ends as it begins); the slack absorbs rounding of summed times.
bool ended_by(double end, double t) {
  return end <= t + 1e-9 * std::max(1.0, std::abs(t));
}

}  // namespace

const char* pie_layer_state_name(PieLayerState s) {
  switch (s) {
    case PieLayerState::kOnGpu:
      return "on GPU";
    case PieLayerState::kOnHost:
      return "on host";
    case PieLayerState::kSwappingIn:
      return "swapping in";
    case PieLayerState::kSwappingOut:
      return "swapping out";
  }
  return "?";
}

PieMappingTable::PieMappingTable(int32_t n_layers, int32_t host_layers) {
  check_layers(n_layers, host_layers, "Pie mapping table");
  states_.assign(static_cast<size_t>(n_layers), PieLayerState::kOnGpu);
  for (int32_t i = n_layers - host_layers; i < n_layers; ++i)
    states_[static_cast<size_t>(i)] = PieLayerState::kOnHost;
  host_layers_ = host_layers;
  gpu_resident_ = n_layers - host_layers;
}

double PieMappingTable::expansion() const {
  return static_cast<double>(n_layers()) / static_cast<double>(gpu_capacity());
}

void PieMappingTable::check_layer(int32_t layer) const {
  STRATA_CHECK(layer >= 0 && layer < n_layers(), "Pie layer {} of {}", layer, n_layers());
}

PieLayerState PieMappingTable::state(int32_t layer) const {
  check_layer(layer);
  return states_[static_cast<size_t>(layer)];
}

void PieMappingTable::set_host_layers(int32_t host_layers) {
  check_layers(n_layers(), host_layers, "Pie mapping table");
  host_layers_ = host_layers;
}

void PieMappingTable::start_swap_in(int32_t layer) {
  STRATA_CHECK(state(layer) == PieLayerState::kOnHost && swapping_in_ < 0 && has_free_gpu_space(),
               "swap-in of layer {} ({}) with layer {} swapping in and {} of {} GPU layers used",
               layer, pie_layer_state_name(state(layer)), swapping_in_, gpu_resident_,
               gpu_capacity());
  states_[static_cast<size_t>(layer)] = PieLayerState::kSwappingIn;
  swapping_in_ = layer;
  ++gpu_resident_;
}

void PieMappingTable::complete_swap_in(int32_t layer) {
  STRATA_CHECK(swapping_in_ == layer && layer >= 0, "completion of a swap-in of layer {} ({})",
               layer, swapping_in_);
  states_[static_cast<size_t>(layer)] = PieLayerState::kOnGpu;
  swapping_in_ = -1;
}

void PieMappingTable::start_swap_out(int32_t layer) {
  STRATA_CHECK(state(layer) == PieLayerState::kOnGpu && swapping_out_ < 0,
               "swap-out of layer {} ({}) with layer {} swapping out", layer,
               pie_layer_state_name(state(layer)), swapping_out_);
  states_[static_cast<size_t>(layer)] = PieLayerState::kSwappingOut;
  swapping_out_ = layer;
}

void PieMappingTable::complete_swap_out(int32_t layer) {
  STRATA_CHECK(swapping_out_ == layer && layer >= 0, "completion of a swap-out of layer {} ({})",
               layer, swapping_out_);
  states_[static_cast<size_t>(layer)] = PieLayerState::kOnHost;
  swapping_out_ = -1;
  --gpu_resident_;
}

std::string PieMappingTable::str() const {
  std::string s =
      fmt::format("m={} of {} (expansion {:.2f}):", host_layers_, n_layers(), expansion());
  for (PieLayerState st : states_) {
    s += st == PieLayerState::kOnGpu        ? " G"
         : st == PieLayerState::kOnHost     ? " H"
         : st == PieLayerState::kSwappingIn ? " >G"
                                            : " >H";
  }
  return s;
}

std::string PieSwapDecision::str() const {
  std::string s = swap_in >= 0 ? fmt::format("in L{}{}", swap_in, early ? " (early)" : "")
                               : std::string("no swap-in");
  s += swap_out >= 0 ? fmt::format(", out L{}", swap_out) : std::string(", no swap-out");
  return s;
}

int32_t PieSwapPolicy::distance(int32_t n_layers, int32_t k, int32_t layer) {
  return ((layer - k) % n_layers + n_layers) % n_layers;
}

int32_t PieSwapPolicy::hottest_host_layer(const PieMappingTable& t, int32_t k, int32_t except) {
  const int32_t n = t.n_layers();
  for (int32_t d = 0; d < n; ++d) {
    const int32_t j = (k + d) % n;
    if (j != except && t.state(j) == PieLayerState::kOnHost) return j;
  }
  return -1;
}

int32_t PieSwapPolicy::coldest_gpu_layer(const PieMappingTable& t, int32_t k) {
  const int32_t n = t.n_layers();
  for (int32_t d = n - 1; d > 0; --d) {
    const int32_t j = (k + d) % n;
    if (t.state(j) == PieLayerState::kOnGpu) return j;
  }
  return -1;
}

PieSwapDecision PieSwapPolicy::decide(const PieMappingTable& t, int32_t k) {
  const int32_t n = t.n_layers();
  PieSwapDecision d;
  const int32_t hottest = hottest_host_layer(t, k);
  if (t.swapping_in() < 0 && t.has_free_gpu_space() && hottest >= 0) {
    d.swap_in = hottest;
    d.early = hottest < k;  // k's token has passed it: the next token needs it first
  }
  if (t.swapping_out() >= 0) return d;
  const int32_t coldest = coldest_gpu_layer(t, k);
  if (coldest < 0) return d;
  // A swap-out makes room for the host layers still waiting (the one swapped in now has
  // its room). If all of them are needed after the coldest GPU layer, the swap would evict
  // a layer needed sooner than the one it makes room for.
  const int32_t waiting = hottest_host_layer(t, k, d.swap_in);
  const bool host_hotter = waiting >= 0 && distance(n, k, waiting) < distance(n, k, coldest);
  // Not while the GPU still has room after this swap-in: that room is for the next one.
  // With m fixed the GPU is full whenever a swap-out could start (so §3.3's rule is
  // unchanged); after m was lowered, this lets swap-ins bring layers back instead of the
  // FIFO circulating the old m for ever.
  const int32_t resident = t.gpu_resident() + (d.swap_in >= 0 ? 1 : 0);
  const bool room_left = resident < t.gpu_capacity();
  const bool over_full = resident > t.gpu_capacity();  // m was raised
  if (over_full || (host_hotter && !room_left)) d.swap_out = coldest;
  return d;
}

std::string PieSwapEvent::str() const {
  return fmt::format("{} L{} [{:g}, {:g}){}", kind == PieSwapKind::kIn ? "in" : "out", layer, start,
                     end, early ? " early" : "");
}

std::string PieTokenStats::str() const {
  return fmt::format("token {} m={} [{:g}, {:g}) stall {:g}, {} in ({} early), {} out", token,
                     host_layers, start, end, stall, swap_ins, early_swap_ins, swap_outs);
}

void PieSimConfig::validate() const {
  check_layers(n_layers, host_layers, "Pie simulation");
  check_time(compute_time, "compute time per layer");
  check_time(swap_time, "swap time per layer");
}

std::string PieSimConfig::str() const {
  return fmt::format("PieSim(n={}, m={}, t_compute={:g}, t_swap={:g})", n_layers, host_layers,
                     compute_time, swap_time);
}

std::string PieSimResult::str() const {
  std::string s = fmt::format("{}: {} tokens, {} swaps, stall {:g}, end {:g}", config.str(),
                              tokens.size(), events.size(), stall, end);
  for (const PieSwapEvent& e : events) s += "\n  " + e.str();
  return s;
}

PieSimulator::PieSimulator(const PieSimConfig& config)
    : config_(config), table_(config.n_layers, config.host_layers) {
  config_.validate();
  result_.config = config_;
  result_.timeline.resize(static_cast<size_t>(config_.n_layers));
  for (int32_t i = 0; i < config_.n_layers; ++i)
    result_.timeline[static_cast<size_t>(i)].push_back({table_.state(i), 0, 0});
}

void PieSimulator::set_host_layers(int32_t host_layers) {
  table_.set_host_layers(host_layers);
  config_.host_layers = host_layers;
}

void PieSimulator::set_swap_time(double seconds) {
  check_time(seconds, "swap time per layer");
  config_.swap_time = seconds;
}

void PieSimulator::set_compute_time(double seconds) {
  check_time(seconds, "compute time per layer");
  config_.compute_time = seconds;
}

void PieSimulator::set_state(int32_t layer, PieLayerState s) {
  auto& spans = result_.timeline[static_cast<size_t>(layer)];
  spans.back().end = now_;
  spans.push_back({s, now_, now_});
}

int32_t PieSimulator::complete_until(double t) {
  int32_t completed = 0;
  if (out_.layer >= 0 && ended_by(out_.end, t)) {
    ++completed;
    table_.complete_swap_out(out_.layer);
    set_state(out_.layer, PieLayerState::kOnHost);
    out_ = {};
  }
  if (in_.layer >= 0 && ended_by(in_.end, t)) {
    ++completed;
    table_.complete_swap_in(in_.layer);
    set_state(in_.layer, PieLayerState::kOnGpu);
    in_ = {};
  }
  return completed;
}

void PieSimulator::start(const PieSwapDecision& d, PieTokenStats& stats) {
  const double end = now_ + config_.swap_time;
  if (d.swap_in >= 0) {
    table_.start_swap_in(d.swap_in);
    set_state(d.swap_in, PieLayerState::kSwappingIn);
    in_ = {d.swap_in, end};
    result_.events.push_back({d.swap_in, PieSwapKind::kIn, now_, end, token_, d.early});
    ++stats.swap_ins;
    stats.early_swap_ins += d.early ? 1 : 0;
  }
  if (d.swap_out >= 0) {
    table_.start_swap_out(d.swap_out);
    set_state(d.swap_out, PieLayerState::kSwappingOut);
    out_ = {d.swap_out, end};
    result_.events.push_back({d.swap_out, PieSwapKind::kOut, now_, end, token_, false});
    ++stats.swap_outs;
  }
}

PieTokenStats PieSimulator::run_token() {
  PieTokenStats stats;
  stats.token = token_;
  stats.host_layers = table_.host_layers();
  stats.start = now_;
  for (int32_t k = 0; k < config_.n_layers; ++k) {
    complete_until(now_);
    start(PieSwapPolicy::decide(table_, k), stats);
    // A stall: wait for the next completion, then decide again. k is the hottest layer, so
    // it comes in as soon as a swap-in can start; the bound only turns a broken policy into
    // an error instead of a livelock.
    for (int32_t waits = 0; !table_.on_gpu(k); ++waits) {
      STRATA_CHECK(waits <= 2 * config_.n_layers + 4, "layer {} still waits after {} swaps: {}", k,
                   waits, table_.str());
      double next = INFINITY;
      if (in_.layer >= 0) next = std::min(next, in_.end);
      if (out_.layer >= 0) next = std::min(next, out_.end);
      STRATA_CHECK(std::isfinite(next), "layer {} on the host with no swap under way: {}", k,
                   table_.str());
      stats.stall += next - now_;
      now_ = next;
      STRATA_CHECK(complete_until(now_) > 0, "no swap completed at {} while layer {} waits", now_,
                   k);
      start(PieSwapPolicy::decide(table_, k), stats);
    }
    now_ += config_.compute_time;
  }
  stats.end = now_;
  result_.stall += stats.stall;
  result_.end = now_;
  result_.tokens.push_back(stats);
  ++token_;
  return stats;
}

PieSimResult PieSimulator::result() const {
  PieSimResult r = result_;
  r.config = config_;
  for (auto& spans : r.timeline) spans.back().end = now_;
  return r;
}

PieBuffers PieBuffers::of(int32_t n_layers, int32_t lowest_m, int32_t highest_m,
                          int64_t layer_bytes) {
  if (n_layers < 1 || lowest_m < 0 || lowest_m > highest_m || highest_m >= n_layers ||
      layer_bytes <= 0)
    fail_input("Pie buffers: host layers [{}, {}] of {} layers (of {} bytes) outside [0, {}]",
               lowest_m, highest_m, n_layers, layer_bytes, n_layers - 1);
  constexpr int64_t kAlign = 256;
  const int64_t stride = (layer_bytes + kAlign - 1) / kAlign * kAlign;
  PieBuffers b;
  b.device = n_layers - lowest_m;
  b.host = std::min(n_layers, highest_m + 2);
  b.bytes = 2 * stride;
  b.swap_bytes = stride + layer_bytes;
  return b;
}

PieSimResult simulate_pie(int32_t n_layers, int32_t host_layers, double compute_time,
                          double swap_time, int32_t tokens) {
  if (tokens < 1) fail_input("Pie simulation: {} tokens; at least one", tokens);
  PieSimulator sim({n_layers, host_layers, compute_time, swap_time});
  for (int32_t t = 0; t < tokens; ++t) sim.run_token();
  return sim.result();
}

void PieControllerOptions::validate() const {
  if (n_layers < 2)
    fail_input("Pie expansion controller: {} layers; adaptive expansion needs at least 2",
               n_layers);
  const int32_t hi = max_host_layers < 0 ? n_layers - 1 : max_host_layers;
  if (min_host_layers < 0 || min_host_layers >= n_layers)
    fail_input("Pie expansion controller: min host layers {} outside [0, {}]", min_host_layers,
               n_layers - 1);
  if (hi < min_host_layers || hi >= n_layers)
    fail_input("Pie expansion controller: max host layers {} outside [{}, {}]", max_host_layers,
               min_host_layers, n_layers - 1);
  if (!(stall_tolerance >= 0) || stall_tolerance >= 1)
    fail_input("Pie expansion controller: stall tolerance {} outside [0, 1)", stall_tolerance);
  if (patience < 1) fail_input("Pie expansion controller: patience {} below 1", patience);
  if (settle_tokens < 0)
    fail_input("Pie expansion controller: settle tokens {} negative", settle_tokens);
  if (!(min_gain >= 0)) fail_input("Pie expansion controller: min gain {} negative", min_gain);
  if (!(violation_ratio >= 0) || violation_ratio > 1)
    fail_input("Pie expansion controller: violation ratio {} outside [0, 1]", violation_ratio);
  if (probe_interval < 1)
    fail_input("Pie expansion controller: probe interval {} below 1", probe_interval);
}

std::string PieControllerOptions::str() const {
  return fmt::format(
      "PieController(n={}, m in [{}, {}], stall_tolerance={:g}, patience={}, settle={}, "
      "min_gain={:g}, violation_ratio={:g}, probe_interval={})",
      n_layers, min_host_layers, max_host_layers < 0 ? n_layers - 1 : max_host_layers,
      stall_tolerance, patience, settle_tokens, min_gain, violation_ratio, probe_interval);
}

std::string PieTokenObservation::str() const {
  return fmt::format("stall {:g} of {:g} s, {} swap-ins ({} early), throughput {:g}", stall_seconds,
                     token_seconds, swap_ins, early_swap_ins, throughput);
}

PieExpansionController::PieExpansionController(const PieControllerOptions& options,
                                               int32_t host_layers)
    : options_(options), m_(host_layers) {
  options_.validate();
  if (host_layers < options_.min_host_layers || host_layers > max_m())
    fail_input("Pie expansion controller: initial host layers {} outside [{}, {}]", host_layers,
               options_.min_host_layers, max_m());
  throughput_.assign(static_cast<size_t>(options_.n_layers), 0.0);
}

int32_t PieExpansionController::max_m() const {
  return options_.max_host_layers < 0 ? options_.n_layers - 1 : options_.max_host_layers;
}

double PieExpansionController::expansion() const {
  return static_cast<double>(options_.n_layers) / static_cast<double>(options_.n_layers - m_);
}

void PieExpansionController::change(int32_t m) {
  raises_ += m > m_ ? 1 : 0;
  lowerings_ += m < m_ ? 1 : 0;
  m_ = m;
  ++adjustments_;
  judged_from_ = options_.settle_tokens;
  waits_ = 0;
  quiet_ = 0;
}

int32_t PieExpansionController::observe(const PieTokenObservation& o) {
  if (judged_from_ > 0) {
    --judged_from_;
    return m_;
  }
  const bool waited = o.stall_seconds > options_.stall_tolerance * std::max(0.0, o.token_seconds);
  if (waited) {
    // Too many layers in swapping: the swaps no longer hide behind compute.
    if (++waits_ >= options_.patience && m_ > options_.min_host_layers) {
      change(m_ - 1);
      hold_ = options_.probe_interval;
    }
    return m_;
  }
  waits_ = 0;
  if (o.throughput > 0) {
    auto& here = throughput_[static_cast<size_t>(m_)];
    here = o.throughput;
    const double below =
        m_ > options_.min_host_layers ? throughput_[static_cast<size_t>(m_ - 1)] : 0.0;
    // The workload stopped scaling: one fewer host layer served it as well with less
    // swapping, so go back there and only probe now and then.
    if (below > 0 && here < below * (1 + options_.min_gain)) {
      change(m_ - 1);
      hold_ = options_.probe_interval;
      return m_;
    }
  }
  if (hold_ > 0) {
    --hold_;
    return m_;
  }
  // Compute did not wait, and either nothing is on the host yet or the interconnect ran
  // ahead into the next token: room for another layer in swapping. Without that sign, a
  // probe now and then finds out whether the conditions changed.
  const bool violated =
      o.swap_ins == 0 ||
      (o.early_swap_ins > 0 && o.early_swap_ins >= options_.violation_ratio * o.swap_ins);
  if (m_ < max_m() && (violated || ++quiet_ >= options_.probe_interval)) change(m_ + 1);
  return m_;
}

std::string PieExpansionController::str() const {
  return fmt::format("PieExpansion(m={}, expansion {:.2f}, {} adjustments: {} up, {} down)", m_,
                     expansion(), adjustments_, raises_, lowerings_);
}

int32_t PieOptions::highest_host_layers(int32_t n_layers) const {
  if (!adaptive) return host_layers;
  return max_host_layers < 0 ? n_layers - 1 : max_host_layers;
}

void PieOptions::validate(int32_t n_layers) const {
  if (host_layers < 0 || host_layers >= n_layers)
    fail_input(
        "Pie: {} host layers of {} KV-cache layers: m must be in [0, {}] (at least one layer "
        "stays on the device)",
        host_layers, n_layers, n_layers - 1);
  if (!adaptive) return;
  const int32_t hi = max_host_layers < 0 ? n_layers - 1 : max_host_layers;
  if (min_host_layers < 0 || hi >= n_layers || min_host_layers > hi)
    fail_input("Pie: adaptive host layers [{}, {}] outside [0, {}] or out of order",
               min_host_layers, max_host_layers, n_layers - 1);
  if (host_layers < min_host_layers || host_layers > hi)
    fail_input("Pie: adaptive expansion starts at {} host layers, outside [{}, {}]", host_layers,
               min_host_layers, hi);
}

std::string PieOptions::str() const {
  if (!enabled()) return "pie(off)";
  if (!adaptive) return fmt::format("pie(m={})", host_layers);
  return fmt::format("pie(adaptive, m={} in [{}, {}])", host_layers, min_host_layers,
                     max_host_layers < 0 ? std::string("n-1") : std::to_string(max_host_layers));
}

std::string PieRequest::option() const {
  if (adaptive) return "--pie-adaptive";
  if (host_layers >= 0) return fmt::format("--pie-host-layers {}", host_layers);
  return fmt::format("--policy pie={}", policy_host_layers);
}

PieOptions engine_pie(const PieRequest& q, int cache_gpu_percent, const std::string& cache) {
  const int32_t policy_m = q.policy_host_layers;
  if (q.host_layers >= 0 && policy_m > 0 && q.host_layers != policy_m)
    fail_input("--pie-host-layers {} and --policy pie={}: give the host layers once", q.host_layers,
               policy_m);
  PieOptions pie;
  pie.adaptive = q.adaptive;
  pie.min_host_layers = q.min_host_layers;
  pie.max_host_layers = q.max_host_layers;
  pie.host_layers = q.host_layers >= 0 ? q.host_layers
                    : policy_m > 0     ? policy_m
                                       : (q.adaptive ? q.min_host_layers : 0);
  if (!pie.enabled()) return {};
  if (cache_gpu_percent != 100)
    fail_input(
        "{}: the policy '{}' puts {}% of the KV cache off the GPU tier; Pie swaps a cache that "
        "lives wholly there (c=100/0/0)",
        q.option(), q.policy.empty() ? cache : q.policy, 100 - cache_gpu_percent);
  return pie;
}

void check_pie_layers(const PieRequest& q, const PieOptions& pie, int32_t n,
                      const std::string& source) {
  const std::string m_option = q.host_layers >= 0
                                   ? fmt::format("--pie-host-layers {}", pie.host_layers)
                                   : fmt::format("--policy pie={}", pie.host_layers);
  if (!pie.adaptive && pie.host_layers >= n)
    fail_input(
        "{}: {} has {} KV-cache layers; at most {} can be in host memory (one stays on the "
        "device)",
        m_option, source, n, n - 1);
  if (pie.adaptive) {
    const int32_t hi = pie.highest_host_layers(n);
    if (hi >= n)
      fail_input(
          "--pie-max-host-layers {}: {} has {} KV-cache layers; at most {} can be in host "
          "memory",
          pie.max_host_layers, source, n, n - 1);
    if (pie.min_host_layers > hi)
      fail_input("--pie-min-host-layers {}: above the most host layers, {}", pie.min_host_layers,
                 hi);
    if (pie.host_layers < pie.min_host_layers || pie.host_layers > hi)
      fail_input("{}: adaptive expansion starts outside its bounds [{}, {}]", m_option,
                 pie.min_host_layers, hi);
  }
  try {
    pie.validate(n);
  } catch (const InputError& e) {
    fail_input("{}: {}", q.option(), e.what());
  }
}

}  // namespace strata
