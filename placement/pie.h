// Pie's per-layer KV-cache swapping (papers/pie.md §3): the mapping table that says where
// each logical layer's cache physically is, the swap protocol of §3.3 (at the start of
// layer k, swap in the hottest host layer and swap out the coldest GPU layer), an
// event-driven simulator of that protocol on a simulated clock, and the adaptive expansion
// controller of §3.4.2. Pure decisions: worker/kv_swap.h executes them with real copies.
//
// Layers are 0-based here; the paper numbers them from 1 (its layer 1 is our layer 0).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace strata {

// The mapping table's status column (Figure 3). Two-phase: a swap is started, then
// completed, and only completion moves the layer to the other side.
enum class PieLayerState : uint8_t { kOnGpu, kOnHost, kSwappingIn, kSwappingOut };
const char* pie_layer_state_name(PieLayerState s);

enum class PieSwapKind : uint8_t { kIn, kOut };

// The mapping table of n logical layers with m of them on the host (expansion n / (n - m)).
// The GPU has room for n - m layers; a layer being swapped either way holds its GPU space
// until the swap completes, so a swap-in can only go into space a completed swap-out (or
// a lowered m) gave back. The paper's two GPU swap buffers are two of those n - m spaces,
// the one leaving and the one arriving: Figure 4's layer 1 finds no room for a swap-in.
class PieMappingTable {
 public:
  // The last `host_layers` layers start on the host (Figure 4: layers 8 and 9 of 9).
  // InputError for n_layers < 1 or host_layers outside [0, n_layers).
  PieMappingTable(int32_t n_layers, int32_t host_layers);

  int32_t n_layers() const { return static_cast<int32_t>(states_.size()); }
  int32_t host_layers() const { return host_layers_; }  // m, the target
  double expansion() const;                             // n / (n - m)
  int32_t gpu_capacity() const { return n_layers() - host_layers_; }

  PieLayerState state(int32_t layer) const;
  bool on_gpu(int32_t layer) const { return state(layer) == PieLayerState::kOnGpu; }
  // Layers holding GPU space: on the GPU or in a swap either way.
  int32_t gpu_resident() const { return gpu_resident_; }
  bool has_free_gpu_space() const { return gpu_resident_ < gpu_capacity(); }
  int32_t swapping_in() const { return swapping_in_; }  // the layer, or -1
  int32_t swapping_out() const { return swapping_out_; }

  // Adaptive expansion: a new m. Nothing moves now; later swaps bring the table there
  // (a higher m leaves the GPU over-full until swap-outs free the space).
  void set_host_layers(int32_t host_layers);

  void start_swap_in(int32_t layer);  // on host -> swapping in; needs free GPU space
  void complete_swap_in(int32_t layer);
  void start_swap_out(int32_t layer);  // on GPU -> swapping out
  void complete_swap_out(int32_t layer);

  std::string str() const;  // "m=2 of 9 (expansion 1.29): G G G ... H H"

 private:
  void check_layer(int32_t layer) const;

  std::vector<PieLayerState> states_;
  int32_t host_layers_ = 0;
  int32_t gpu_resident_ = 0;
  int32_t swapping_in_ = -1;
  int32_t swapping_out_ = -1;
};

// What §3.3's protocol starts at the beginning of one layer.
struct PieSwapDecision {
  int32_t swap_in = -1;   // the hottest host layer, or -1
  int32_t swap_out = -1;  // the coldest GPU layer, or -1
  // swap_in is needed only by the next token (every host layer this token still needs is
  // already back): §3.4.2's rule violation, a sign that the expansion is too small.
  bool early = false;
  std::string str() const;
};

// §3.3 at the beginning of layer k. Temperatures are distances in the cyclic layer order:
// layer j is needed (j - k) mod n layers after k, so k itself is the hottest and k - 1,
// the last layer that finished computation, the coldest.
class PieSwapPolicy {
 public:
  static int32_t distance(int32_t n_layers, int32_t k, int32_t layer);
  // The host layer needed soonest from k on (k itself when it is on the host), other than
  // `except`, or -1.
  static int32_t hottest_host_layer(const PieMappingTable& table, int32_t k, int32_t except = -1);
  // The GPU layer needed last from k on, other than k (k is about to compute), or -1.
  static int32_t coldest_gpu_layer(const PieMappingTable& table, int32_t k);
  // (a) the previous swap-in has completed and there is GPU space: swap in the hottest host
  // layer; (b) the previous swap-out has completed: swap out the coldest GPU layer, unless
  // every host layer still waiting is colder than it (the swap would only make room for a
  // layer needed later than the one evicted) or the GPU still has room after (a). A raised
  // m that left the GPU over-full swaps out regardless.
  static PieSwapDecision decide(const PieMappingTable& table, int32_t k);
};

// One swap on the simulated clock.
struct PieSwapEvent {
  int32_t layer = 0;
  PieSwapKind kind = PieSwapKind::kIn;
  double start = 0;
  double end = 0;
  int64_t token = 0;  // the token whose layer began when the swap started
  bool early = false;
  std::string str() const;  // "in L7 [3, 5)"
};

// One stretch of a layer's residency on the simulated clock.
struct PieResidencySpan {
  PieLayerState state = PieLayerState::kOnGpu;
  double start = 0;
  double end = 0;
};

// One token (a pass over every layer) of a simulation.
struct PieTokenStats {
  int64_t token = 0;
  int32_t host_layers = 0;  // m during the token
  double start = 0;
  double end = 0;
  double stall = 0;  // compute waiting for swap-ins
  int32_t swap_ins = 0;
  int32_t swap_outs = 0;
  int32_t early_swap_ins = 0;
  double seconds() const { return end - start; }
  std::string str() const;
};

struct PieSimConfig {
  int32_t n_layers = 0;
  int32_t host_layers = 0;  // m
  double compute_time = 1;  // t_compute, one layer
  double swap_time = 1;     // t_swap, one layer one way; swaps in and out run side by side
  // InputError naming the field and value: n < 1, m outside [0, n), a time not positive.
  void validate() const;
  std::string str() const;
};

struct PieSimResult {
  PieSimConfig config;
  std::vector<PieSwapEvent> events;  // in start order
  std::vector<PieTokenStats> tokens;
  std::vector<std::vector<PieResidencySpan>> timeline;  // per layer, in time order
  double stall = 0;
  double end = 0;
  std::string str() const;  // the summary, then one line per event
};

// The protocol on a simulated clock: each layer computes for compute_time once its cache is
// on the GPU; a swap takes swap_time; one swap-in and one swap-out may run at a time.
// Decisions are taken when a layer begins, after every swap ending by then has completed,
// and again at each completion while the layer waits for its swap-in.
class PieSimulator {
 public:
  explicit PieSimulator(const PieSimConfig& config);

  PieTokenStats run_token();
  // Between tokens: the controller's new m, or changed costs (background bus traffic).
  // Swaps already under way keep their end times.
  void set_host_layers(int32_t host_layers);
  void set_swap_time(double seconds);
  void set_compute_time(double seconds);

  const PieMappingTable& table() const { return table_; }
  double now() const { return now_; }
  PieSimResult result() const;  // so far, residency spans closed at now()

 private:
  struct InFlight {
    int32_t layer = -1;
    double end = 0;
  };
  int32_t complete_until(double t);  // returns how many swaps completed
  void start(const PieSwapDecision& d, PieTokenStats& stats);
  void set_state(int32_t layer, PieLayerState s);

  PieSimConfig config_;
  PieMappingTable table_;
  double now_ = 0;
  int64_t token_ = 0;
  InFlight in_, out_;
  PieSimResult result_;
};

// The memory Pie's KV cache holds (worker/kv_swap.h): one rule for the worker that allocates
// it and placement/ that counts it (stage_placement.h). Each buffer holds one layer's K and
// then its V, V starting 256-byte aligned (a 4-bit layer's float groups stay aligned). The
// device keeps n - lowest_m buffers (the fewest host layers m may come down to), the host
// min(n, highest_m + 2): m on the host, one arriving and one leaving.
struct PieBuffers {
  int32_t device = 0;
  int32_t host = 0;
  int64_t bytes = 0;       // each buffer: K, the gap to V's alignment, V
  int64_t swap_bytes = 0;  // one swap either way: K, the gap, V (the buffer less V's tail)

  // `layer_bytes`: one layer's K (or V) as the cache stores it. InputError for m outside
  // [0, n) or out of order.
  static PieBuffers of(int32_t n_layers, int32_t lowest_m, int32_t highest_m, int64_t layer_bytes);
  int64_t device_bytes() const { return device * bytes; }
  int64_t host_bytes() const { return host * bytes; }
};

// `tokens` tokens of the protocol from the initial table (the last m layers on the host).
PieSimResult simulate_pie(int32_t n_layers, int32_t host_layers, double compute_time,
                          double swap_time, int32_t tokens);

// §3.4.2: the number of host layers chosen token by token from what the engine observed.
struct PieControllerOptions {
  int32_t n_layers = 0;
  int32_t min_host_layers = 0;
  int32_t max_host_layers = -1;  // -1: n - 1
  // A token whose compute waited more than this share of its time waited (absorbs timer
  // noise on a real clock).
  double stall_tolerance = 0.01;
  // Consecutive waiting tokens before m is lowered: a brief burst of foreign bus traffic is
  // tolerated, prolonged traffic is adapted to.
  int32_t patience = 2;
  // Tokens after a change that are not judged: the FIFO refills (a raised m needs an extra
  // swap-out, a lowered one an extra swap-in).
  int32_t settle_tokens = 1;
  // A raise that lifts throughput by less than this share means the workload stopped
  // scaling with expansion.
  double min_gain = 0.02;
  // A token in which at least this share of the swap-ins fetched the next token's layers
  // (§3.4.2's rule violations: no host layer was left for this token, the interconnect was
  // idle for it) asks for more expansion at once. 0: any violation.
  double violation_ratio = 0;
  // Tokens held at an m after lowering it (it waited, or the workload stopped scaling), and
  // quiet tokens (no violations) at any m, before probing one more host layer.
  int32_t probe_interval = 32;
  // InputError naming the field and value.
  void validate() const;
  std::string str() const;
};

// What the engine measured over one token.
struct PieTokenObservation {
  double stall_seconds = 0;  // compute waiting for swap-ins
  double token_seconds = 0;
  int32_t swap_ins = 0;
  int32_t early_swap_ins = 0;  // swap-ins of the next token's layers (§3.4.2's violations)
  // Work done per second (tokens x batch); <= 0: not measured, and scaling is not judged
  // (an engine whose batch does not grow with the expansion).
  double throughput = 0;
  std::string str() const;
};

class PieExpansionController {
 public:
  PieExpansionController(const PieControllerOptions& options, int32_t host_layers = 0);

  // One token's observation; returns m for the next token.
  int32_t observe(const PieTokenObservation& o);

  int32_t host_layers() const { return m_; }
  double expansion() const;
  int64_t adjustments() const { return adjustments_; }
  int64_t raises() const { return raises_; }
  int64_t lowerings() const { return lowerings_; }
  const PieControllerOptions& options() const { return options_; }
  std::string str() const;

 private:
  void change(int32_t m);
  int32_t max_m() const;

  PieControllerOptions options_;
  int32_t m_ = 0;
  int32_t judged_from_ = 0;         // tokens since the last change still to skip
  int32_t waits_ = 0;               // consecutive waiting tokens
  int32_t hold_ = 0;                // tokens before the next raise may be tried
  int32_t quiet_ = 0;               // tokens without violations since the last change
  std::vector<double> throughput_;  // last throughput seen at each m (0: none)
  int64_t adjustments_ = 0;
  int64_t raises_ = 0;
  int64_t lowerings_ = 0;
};

// How an engine asks for Pie: on KvCache through CachePlacement::pie.
struct PieOptions {
  // m, the KV-cache layers kept in host memory (expansion n / (n - m)); with `adaptive`,
  // where the controller starts. 0 and not adaptive: Pie is off.
  int32_t host_layers = 0;
  bool adaptive = false;
  // Adaptive: the range the controller keeps m in (max -1: n - 1). The device keeps
  // n - min_host_layers layer buffers, so a larger minimum saves device memory.
  int32_t min_host_layers = 0;
  int32_t max_host_layers = -1;
  // The controller's tuning; its n_layers and m range are taken from the fields above.
  PieControllerOptions controller;

  bool enabled() const { return adaptive || host_layers > 0; }
  // The range m stays in: fixed, m itself; adaptive, [min_host_layers, max_host_layers]
  // (max -1: n - 1). The buffers follow from it (PieBuffers).
  int32_t lowest_host_layers() const { return adaptive ? min_host_layers : host_layers; }
  int32_t highest_host_layers(int32_t n_layers) const;
  // InputError naming the field and value: m outside [0, n) or outside the adaptive range.
  void validate(int32_t n_layers) const;
  std::string str() const;  // "pie(m=2)" or "pie(adaptive, m=0 in [0, 4])"
};

// How the command line asks for Pie: --pie-host-layers (-1: not given), --pie-adaptive with
// its bounds, and a policy's pie= (0: none).
struct PieRequest {
  int32_t host_layers = -1;
  bool adaptive = false;
  int32_t min_host_layers = 0;
  int32_t max_host_layers = -1;
  int32_t policy_host_layers = 0;
  std::string policy;  // the policy's compact form, for messages ("": none given)

  bool asked() const { return adaptive || host_layers > 0 || policy_host_layers > 0; }
  // The option as the command line names it: "--pie-adaptive", "--pie-host-layers 2" or
  // "--policy pie=2".
  std::string option() const;
};

// The engine's Pie from `request` on a KV cache with `cache_gpu_percent` of its layers on the
// GPU tier (`cache`: that placement in words, named when no policy is): off (default options)
// when nothing asks for it. InputError for m given twice with different values, or a cache
// not wholly on the GPU tier -- KvCache refuses it too, but only once the model is loaded and
// a run sizes its cache.
PieOptions engine_pie(const PieRequest& request, int cache_gpu_percent, const std::string& cache);
// InputError naming the option and its value unless `pie`'s host layers fit a model `source`
// of n_layers KV-cache layers (one stays on the device), before the weights load.
void check_pie_layers(const PieRequest& request, const PieOptions& pie, int32_t n_layers,
                      const std::string& source);

}  // namespace strata
