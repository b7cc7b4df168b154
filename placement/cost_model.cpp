#include "placement/cost_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "kernels/error.h"

namespace strata {

// ---- linear-term algebra -----------------------------------------------------------

LinearTerm operator+(LinearTerm a, const LinearTerm& b) {
  a.constant += b.constant;
  for (int v = 0; v < kNumPlacementVars; ++v) a.coef[v] += b.coef[v];
  return a;
}

LinearTerm operator*(double k, LinearTerm a) {
  a.constant *= k;
  for (double& c : a.coef) c *= k;
  return a;
}

namespace {

LinearTerm constant(double c) {
  LinearTerm t;
  t.constant = c;
  return t;
}

LinearTerm var(PlacementVar v, double k) {
  LinearTerm t;
  t.coef[v] = k;
  return t;
}

// k * (1 - x_v): what is not on the tier v names (e.g. the weights FlexGen streams in).
LinearTerm rest(PlacementVar v, double k) {
  return constant(k) + var(v, -k);
}

// ---- the sizes A.3 is written in ----------------------------------------------------

// Bytes, FLOPs and lengths of one layer; FlexGen's names in the comments (fp16, e = 2).
struct Sizes {
  double e = 0;          // bytes per element
  double w = 0;          // weights of one layer as stored: 8h1^2 + 4h1h2
  double w_fp = 0;       // ... uncompressed
  double w_dequant = 0;  // GPU buffer for one layer dequantised (compressed weights only)
  double kv = 0;         // K and V of one token as stored: 4h1
  double h1 = 0, h2 = 0;
  double q_dim = 0;   // n_heads * head_dim (= h1 in OPT)
  double kv_dim = 0;  // n_kv_heads * head_dim (= h1 in OPT)
  double mlp_in = 0;  // MLP hidden width (2 h2 when gated)
  double nh = 0;
  double mm_flops_tok = 0;  // linear-layer FLOPs per token: 8h1^2 + 4h1h2
  double s = 0, n = 0, l = 0, gbs = 0, bls = 0;
};

Sizes sizes_of(const ModelShape& m, const Workload& w, const Policy& p) {
  STRATA_CHECK(m.hidden > 0 && (m.intermediate > 0 || m.moe()) && m.n_layers > 0 && m.n_heads > 0 &&
                   m.n_kv_heads > 0 && m.head_dim > 0 && m.weight_bytes_per_elem > 0,
               "cost model needs a complete shape: {}", m.str());
  Sizes z;
  z.e = double(m.weight_bytes_per_elem);
  const double packed = compressed_fraction(m.weight_bytes_per_elem);
  // A MoE layer as FlexGen would offload it: every expert stored and streamed (w), the k a
  // token runs computed (mm_flops_tok), an expert's width the MLP's working set.
  const double matmul_params = double(m.attention_params_per_layer() + m.mlp_params_per_layer() -
                                      (m.n_experts - m.experts_per_token) * m.expert_params());
  z.w_fp = double(m.params_per_layer()) * z.e;
  z.w = z.w_fp * (p.compress_weight ? packed : 1.0);
  z.w_dequant = p.compress_weight ? z.w_fp : 0.0;
  z.kv_dim = double(m.n_kv_heads * m.head_dim);
  z.kv = 2 * z.kv_dim * kv_cache_elem_bytes(p);
  z.h1 = double(m.hidden);
  z.h2 = double(std::max(m.intermediate, m.expert_intermediate));
  z.q_dim = double(m.n_heads * m.head_dim);
  z.mlp_in = z.h2 * (m.gated_mlp ? 2 : 1);
  z.nh = double(m.n_heads);
  z.mm_flops_tok = 2 * matmul_params;
  z.s = double(w.prompt_len);
  z.n = double(w.gen_len);
  z.l = double(m.n_layers);
  z.gbs = double(p.gbs());
  z.bls = double(p.block_size());
  return z;
}

// ---- T_pre and T_gen terms ---------------------------------------------------------

PhaseTerms prefill_terms(const Sizes& z, const HardwareSpec& hw) {
  const double act = z.e * z.s * z.h1 * z.bls;    // 2 s h1 bls
  const double cache = z.kv * (z.s + 1) * z.bls;  // 4 (s + 1) h1 bls
  PhaseTerms t;
  t.ctog = (1 / hw.ctog_bdw) * (rest(kWg, z.w) + rest(kHg, act));
  t.gtoc = (1 / hw.gtoc_bdw_cache) * rest(kCg, cache) + (1 / hw.gtoc_bdw_hidden) * rest(kHg, act);
  t.dtoc = (1 / hw.dtoc_bdw) * (var(kWd, z.w) + var(kHd, act));
  t.ctod =
      (1 / hw.ctod_bdw_cache_prefill) * var(kCd, cache) + (1 / hw.ctod_bdw_other) * var(kHd, act);
  // Prefill attention always runs on the GPU: the cache is produced there.
  t.gpu_comp = constant(z.bls * z.s * z.mm_flops_tok / hw.mm_flops_prefill +
                        4 * z.bls * z.s * z.s * z.q_dim / hw.bmm_flops_prefill);
  return t;
}

// Without CPU attention FlexGen moves the off-GPU cache to the GPU to attend to it and
// writes the new token's K/V back: A.3 only spells out the CPU-attention case.
PhaseTerms decode_terms(const Sizes& z, const HardwareSpec& hw, bool cpu_attention) {
  const double act = z.e * z.h1 * z.bls;                // 2 h1 bls
  const double cache = z.kv * (z.s + z.n / 2) * z.bls;  // 4 bls (s + n/2) h1, on average
  const double new_kv = z.kv * z.bls;                   // 4 bls h1
  const double att_flops = 4 * z.bls * (z.s + z.n / 2) * z.q_dim;
  PhaseTerms t;
  t.ctog = (1 / hw.ctog_bdw) * (rest(kWg, z.w) + rest(kHg, act));
  t.gtoc = (1 / hw.gtoc_bdw_hidden) * rest(kHg, act);
  t.dtoc = (1 / hw.dtoc_bdw) * (var(kCd, cache) + var(kWd, z.w) + var(kHd, act));
  t.ctod = (1 / hw.ctod_bdw_other) * (var(kCd, new_kv) + var(kHd, act));
  t.gpu_comp = constant(z.bls * z.mm_flops_tok / hw.mm_flops_decode);
  if (cpu_attention) {
    t.gpu_comp = t.gpu_comp + var(kCg, att_flops / hw.bmm_flops_decode);
    t.cpu_comp = rest(kCg, att_flops / hw.cpu_flops_for(z.gbs, z.h1));
  } else {
    t.ctog = t.ctog + (1 / hw.ctog_bdw) * rest(kCg, cache);
    t.gtoc = t.gtoc + (1 / hw.gtoc_bdw_cache) * rest(kCg, new_kv);
    t.gpu_comp = t.gpu_comp + constant(att_flops / hw.bmm_flops_decode);
  }
  return t;
}

// ---- peak memory ------------------------------------------------------------------

// What each tier holds for the whole run ("home"): its share of all layers' weights, of the
// block's activations (`act`) and of the block's cache for s + n tokens.
LinearTerm home(const Sizes& z, PlacementVar w, PlacementVar h, PlacementVar c, double act) {
  return var(w, z.w * z.l) + var(h, act) + var(c, z.kv * (z.s + z.n) * z.bls * z.l);
}

// GPU working sets of one GPU batch over `t` tokens attending to `ctx` positions; `att`
// scales the attention ones (A.3: cg in decode, where only the GPU's share is attended
// there). A.3 multiplies the prefill ones by cg too, but prefill attention always runs on
// the GPU, whatever the cache placement.
std::vector<LinearTerm> gpu_working(const Sizes& z, double t, double ctx, const LinearTerm& att) {
  const double e = z.e, g = z.gbs;
  const double qkv = g * e * t * (z.h1 + z.q_dim + 2 * z.kv_dim);               // 8 s h1 gbs
  const double att1 = g * e * (t * z.q_dim + ctx * z.kv_dim + z.nh * t * ctx);  // q, K, scores
  const double att2 = g * e * (z.nh * t * ctx + ctx * z.kv_dim + t * z.q_dim);  // scores, V, out
  const double embed = g * e * t * 2 * z.h1;                                    // 4 s h1 gbs
  const double mlp = g * e * t * (z.h1 + z.mlp_in);                             // 2 s gbs (h1 + h2)
  return {constant(qkv), att1 * att, att2 * att, constant(embed), constant(mlp), constant(mlp)};
}

PeakTerms gpu_prefill_peak(const Sizes& z) {
  PeakTerms p;
  p.base = home(z, kWg, kHg, kCg, z.e * z.s * z.h1 * z.bls) + rest(kWg, 2 * z.w) +
           rest(kHg, z.e * z.s * z.h1 * z.gbs) + constant(z.w_dequant);
  p.alternatives = gpu_working(z, z.s, z.s, constant(1));
  return p;
}

// A.3 writes (1 - hg) 2 s h1 gbs for the decode activation buffer too; a decode step moves
// one token per sequence (its gpu_home^g has 2 h1 bls), so the s is dropped here.
PeakTerms gpu_decode_peak(const Sizes& z, bool cpu_attention) {
  PeakTerms p;
  p.base = home(z, kWg, kHg, kCg, z.e * z.h1 * z.bls) + rest(kWg, 2 * z.w) +
           rest(kHg, z.e * z.h1 * z.gbs) + constant(z.w_dequant);
  if (!cpu_attention)  // the off-GPU cache of the current and the next GPU batch
    p.base = p.base + rest(kCg, 2 * z.kv * (z.s + z.n) * z.gbs);
  p.alternatives = gpu_working(z, 1, z.s + z.n, cpu_attention ? var(kCg, 1) : constant(1));
  return p;
}

PeakTerms cpu_prefill_peak(const Sizes& z) {
  PeakTerms p;
  p.base = home(z, kWc, kHc, kCc, z.e * z.s * z.h1 * z.bls) + rest(kWg, z.w) +
           rest(kHg, z.e * z.s * z.h1 * z.gbs);
  return p;
}

PeakTerms cpu_decode_peak(const Sizes& z, bool cpu_attention) {
  PeakTerms p;
  p.base = home(z, kWc, kHc, kCc, z.e * z.h1 * z.bls) + var(kWd, z.w) +
           var(kHd, 2 * z.e * z.h1 * z.gbs) + var(kCd, 2 * z.kv * (z.s + z.n) * z.gbs);
  if (cpu_attention)  // attention scores and output of one GPU batch on the CPU
    p.base = p.base + constant(z.e * z.nh * (z.s + z.n) * z.gbs + z.e * z.h1 * z.gbs);
  return p;
}

PeakTerms disk_peak(const Sizes& z) {
  PeakTerms p;
  p.base = home(z, kWd, kHd, kCd, z.e * z.s * z.h1 * z.bls);
  return p;
}

// ---- Pie and HeteGen ---------------------------------------------------------------

// HeteGen (eq. 4): of the CPU-tier weights only alpha crosses the link and computes on the
// GPU; the CPU computes the other 1 - alpha where they lie. `tokens` per sequence.
void apply_hetegen(PhaseTerms& t, const Sizes& z, double alpha, double tokens, double gpu_flops,
                   const HardwareSpec& hw) {
  const double rest_share = 1 - alpha;
  const double flops = z.bls * tokens * z.mm_flops_tok;  // the block's linears, one layer
  t.ctog = t.ctog + var(kWc, -rest_share * z.w / hw.ctog_bdw);
  t.gpu_comp = t.gpu_comp + var(kWc, -rest_share * flops / gpu_flops);
  t.cpu_split = var(kWc, rest_share * flops / hw.cpu_flops);
}

// The GPU's buffers for streamed weights hold only the alpha share of a CPU-tier layer.
void hetegen_buffers(PeakTerms& gpu, const Sizes& z, double alpha) {
  gpu.base = gpu.base + var(kWc, -(1 - alpha) * 2 * z.w);
}

// One layer's K and V for the block as the cache allocates them (s + n positions).
double pie_layer_bytes(const Sizes& z) {
  return z.kv * (z.s + z.n) * z.bls;
}

// Pie with m host layers: each token m layers swap in and m out, on average m / l of a
// layer per layer computed on each link.
void pie_traffic(PhaseTerms& t, const Sizes& z, int m, const HardwareSpec& hw) {
  const double moved = double(m) / z.l * pie_layer_bytes(z);
  t.ctog = t.ctog + constant(moved / hw.ctog_bdw);
  t.gtoc = t.gtoc + constant(moved / hw.gtoc_bdw_cache);
}

// §3.3's protocol starts a swap only when a layer begins and runs one each way at a time,
// so m host layers are hidden iff floor((l - 1) / (m + 2)) layers' compute covers one swap
// (the closed form of Pie's simulator, placement/offload_estimates.h).
TimeBound pie_bound(const Sizes& z, int m, const HardwareSpec& hw) {
  const double layer = pie_layer_bytes(z);
  const double swap = std::max(layer / hw.ctog_bdw, layer / hw.gtoc_bdw_cache);
  const double layers_per_swap = std::floor((z.l - 1) / double(m + 2));
  return {"pie", constant(swap / layers_per_swap)};
}

void pie_memory(CostModelTerms& t, const Sizes& z, int m) {
  const double layer = pie_layer_bytes(z);
  const double host_layers = std::min(z.l, double(m + 2));
  for (PeakTerms* gpu : {&t.gpu_prefill, &t.gpu_decode})
    gpu->base = gpu->base + var(kCg, -m * layer);
  for (PeakTerms* cpu : {&t.cpu_prefill, &t.cpu_decode})
    cpu->base = cpu->base + var(kCg, host_layers * layer);
}

void check_pie(const ModelShape& m, const Policy& p) {
  if (p.pie_host_layers > 0 && p.pie_host_layers > m.n_layers - 3)
    fail_input(
        "policy pie={}: the cost model covers at most l - 3 = {} host layers for this "
        "{}-layer model (two of the GPU's l - m layer buffers are Pie's swap buffers)",
        p.pie_host_layers, m.n_layers - 3, m.n_layers);
}

// ---- evaluation --------------------------------------------------------------------

std::vector<TimeBound> paper_bounds(const PhaseTerms& t) {
  return {{"ctog", t.ctog},
          {"gtoc", t.gtoc},
          {"dtoc", t.dtoc},
          {"ctod", t.ctod},
          {"comp", t.gpu_comp + t.cpu_comp}};
}

// HeteGen's CPU share beside the GPU, on the CPU with CPU attention.
void add_cpu_bound(PhaseTerms& t) {
  if (t.bounds.size() == 1 && t.bounds[0].name == "serial") {
    t.bounds[0].time = t.bounds[0].time + t.cpu_split;
    return;
  }
  t.bounds.push_back({"cpu", t.cpu_comp + t.cpu_split});
}

std::vector<TimeBound> fitted_bounds(const PhaseTerms& t, bool prefill) {
  const LinearTerm comp = t.gpu_comp + t.cpu_comp;
  if (prefill)
    return {{"ctog+dtoc", t.ctog + t.dtoc}, {"gtoc+ctod", t.gtoc + t.ctod}, {"comp", comp}};
  return {{"ctog+gtoc", t.ctog + t.gtoc},
          {"ctog+dtoc", t.ctog + t.dtoc},
          {"ctog+ctod", t.ctog + t.ctod},
          {"ctog+comp", t.ctog + comp}};
}

void set_bounds(PhaseTerms& t, OverlapModel model, bool overlap, bool prefill) {
  if (!overlap)
    t.bounds = {{"serial", t.ctog + t.gtoc + t.dtoc + t.ctod + t.gpu_comp + t.cpu_comp}};
  else if (model == OverlapModel::kPaper)
    t.bounds = paper_bounds(t);
  else
    t.bounds = fitted_bounds(t, prefill);
}

PhaseCost evaluate(const PhaseTerms& t, const Placement& x) {
  PhaseCost c;
  c.ctog = t.ctog.eval(x);
  c.gtoc = t.gtoc.eval(x);
  c.dtoc = t.dtoc.eval(x);
  c.ctod = t.ctod.eval(x);
  c.gpu_comp = t.gpu_comp.eval(x);
  c.cpu_comp = t.cpu_comp.eval(x);
  c.cpu_split = t.cpu_split.eval(x);
  std::vector<std::pair<double, std::string_view>> terms = {
      {c.ctog, "ctog"}, {c.gtoc, "gtoc"}, {c.dtoc, "dtoc"}, {c.ctod, "ctod"}, {c.comp(), "comp"}};
  if (c.cpu_split > 0) terms.push_back({c.cpu_comp + c.cpu_split, "cpu"});
  c.bottleneck = std::max_element(terms.begin(), terms.end(), [](auto& a, auto& b) {
                   return a.first < b.first;
                 })->second;
  for (const TimeBound& b : t.bounds) {
    const double v = b.time.eval(x);
    if (c.binding.empty() || v > c.time) c.time = v, c.binding = b.name;
  }
  return c;
}

nlohmann::json phase_json(const PhaseCost& c) {
  return {{"ctog_s", c.ctog},     {"gtoc_s", c.gtoc},          {"dtoc_s", c.dtoc},
          {"ctod_s", c.ctod},     {"gpu_comp_s", c.gpu_comp},  {"cpu_comp_s", c.cpu_comp},
          {"comp_s", c.comp()},   {"time_s", c.time},          {"bottleneck", c.bottleneck},
          {"binding", c.binding}, {"cpu_split_s", c.cpu_split}};
}

std::string phase_str(const PhaseCost& c) {
  return fmt::format(
      "ctog={:.4g} gtoc={:.4g} dtoc={:.4g} ctod={:.4g} comp={:.4g} (cpu {:.4g}){} s "
      "-> {:.4g} s ({}; largest {})",
      c.ctog, c.gtoc, c.dtoc, c.ctod, c.comp(), c.cpu_comp,
      c.cpu_split > 0 ? fmt::format(" cpu_split={:.4g}", c.cpu_split) : "", c.time, c.binding,
      c.bottleneck);
}

void shortfall(std::vector<std::string>& out, const char* tier, const char* field, double need,
               const char* phase, double have) {
  if (need <= have) return;
  out.push_back(fmt::format("{} memory: needs {} ({}) but {} is {} (short by {})", tier,
                            format_gib(need), phase, field, format_gib(have),
                            format_gib(need - have)));
}

}  // namespace

void Workload::validate() const {
  if (prompt_len <= 0) fail_input("workload: prompt_len={} must be positive", prompt_len);
  if (gen_len <= 0) fail_input("workload: gen_len={} must be positive", gen_len);
}

double compressed_fraction(int64_t elem_bytes) {
  const double per_elem = kCompressBits / 8.0 + 2.0 * double(elem_bytes) / kCompressGroup;
  return per_elem / double(elem_bytes);
}

double kv_cache_elem_bytes(const Policy& p) {
  const int64_t e = p.cache_f16 ? 2 : 4;
  return static_cast<double>(e) * (p.compress_cache ? compressed_fraction(e) : 1.0);
}

Placement placement_of(const Policy& p) {
  return {p.w_gpu_percent / 100.0,     p.w_cpu_percent / 100.0,     p.w_disk_percent() / 100.0,
          p.cache_gpu_percent / 100.0, p.cache_cpu_percent / 100.0, p.cache_disk_percent() / 100.0,
          p.act_gpu_percent / 100.0,   p.act_cpu_percent / 100.0,   p.act_disk_percent() / 100.0};
}

double LinearTerm::eval(const Placement& x) const {
  double v = constant;
  for (int i = 0; i < kNumPlacementVars; ++i) v += coef[i] * x[i];
  return v;
}

double PeakTerms::eval(const Placement& x) const {
  double top = 0;
  for (const LinearTerm& a : alternatives) top = std::max(top, a.eval(x));
  return base.eval(x) + top;
}

CostModelTerms cost_model_terms(const ModelShape& shape, const Workload& w, const Policy& schedule,
                                const HardwareSpec& hw) {
  const Sizes z = sizes_of(shape, w, schedule);
  const bool cpu_attn = schedule.cpu_cache_compute;
  CostModelTerms t;
  t.n_layers = shape.n_layers;
  t.gen_len = w.gen_len;
  t.block_size = schedule.block_size();
  check_pie(shape, schedule);
  const int pie = schedule.pie_host_layers;
  const double alpha = schedule.hetegen_alpha_percent / 100.0;
  t.prefill = prefill_terms(z, hw);
  t.decode = decode_terms(z, hw, cpu_attn);
  if (alpha > 0) {
    apply_hetegen(t.prefill, z, alpha, z.s, hw.mm_flops_prefill, hw);
    apply_hetegen(t.decode, z, alpha, 1, hw.mm_flops_decode, hw);
  }
  if (pie > 0) pie_traffic(t.prefill, z, pie, hw), pie_traffic(t.decode, z, pie, hw);
  set_bounds(t.prefill, hw.overlap_model, schedule.overlap, true);
  set_bounds(t.decode, hw.overlap_model, schedule.overlap, false);
  for (PhaseTerms* p : {&t.prefill, &t.decode}) {
    if (alpha > 0) add_cpu_bound(*p);
    if (pie > 0) p->bounds.push_back(pie_bound(z, pie, hw));
  }
  t.gpu_prefill = gpu_prefill_peak(z);
  t.gpu_decode = gpu_decode_peak(z, cpu_attn);
  t.cpu_prefill = cpu_prefill_peak(z);
  t.cpu_decode = cpu_decode_peak(z, cpu_attn);
  t.disk = disk_peak(z);
  if (alpha > 0) hetegen_buffers(t.gpu_prefill, z, alpha), hetegen_buffers(t.gpu_decode, z, alpha);
  if (pie > 0) pie_memory(t, z, pie);
  return t;
}

CostEstimate estimate_cost(const ModelShape& shape, const Workload& w, const Policy& policy,
                           const HardwareSpec& hw) {
  policy.validate();
  w.validate();
  hw.validate("hardware spec");
  const CostModelTerms t = cost_model_terms(shape, w, policy, hw);
  const Placement x = placement_of(policy);
  CostEstimate c;
  c.policy = policy;
  c.workload = w;
  c.n_layers = shape.n_layers;
  c.prefill = evaluate(t.prefill, x);
  c.decode = evaluate(t.decode, x);
  const double l = double(shape.n_layers), n = double(w.gen_len);
  c.total_time = c.prefill.time * l + c.decode.time * (n - 1) * l;
  c.throughput = double(policy.block_size()) * n / c.total_time;
  c.peak = {t.gpu_prefill.eval(x), t.gpu_decode.eval(x), t.cpu_prefill.eval(x),
            t.cpu_decode.eval(x), t.disk.eval(x)};
  return c;
}

std::vector<std::string> CostEstimate::memory_shortfalls(const HardwareSpec& hw) const {
  std::vector<std::string> out;
  const bool gpu_pre = peak.gpu_prefill >= peak.gpu_decode;
  const bool cpu_pre = peak.cpu_prefill >= peak.cpu_decode;
  shortfall(out, "GPU", "gpu_mem", peak.gpu(), gpu_pre ? "prefill" : "decode", hw.gpu_mem);
  shortfall(out, "CPU", "cpu_mem", peak.cpu(), cpu_pre ? "prefill" : "decode", hw.cpu_mem);
  shortfall(out, "Disk", "disk_mem", peak.disk, "whole run", hw.disk_mem);
  return out;
}

std::string CostEstimate::str() const {
  return fmt::format(
      "CostEstimate({}, s={}, n={}, l={}: throughput={:.3f} token/s, T={:.2f} s; "
      "T_pre per layer: {}; T_gen per layer: {}; peak memory GPU {} / {}, CPU {} / {} "
      "(prefill / decode), disk {})",
      policy.str(), workload.prompt_len, workload.gen_len, n_layers, throughput, total_time,
      phase_str(prefill), phase_str(decode), format_gib(peak.gpu_prefill),
      format_gib(peak.gpu_decode), format_gib(peak.cpu_prefill), format_gib(peak.cpu_decode),
      format_gib(peak.disk));
}

nlohmann::json CostEstimate::to_json() const {
  return {{"policy", policy.compact()},
          {"block_size", policy.block_size()},
          {"prompt_len", workload.prompt_len},
          {"gen_len", workload.gen_len},
          {"n_layers", n_layers},
          {"prefill_per_layer", phase_json(prefill)},
          {"decode_per_layer", phase_json(decode)},
          {"total_time_s", total_time},
          {"throughput_token_s", throughput},
          {"peak_memory_bytes",
           {{"gpu_prefill", peak.gpu_prefill},
            {"gpu_decode", peak.gpu_decode},
            {"cpu_prefill", peak.cpu_prefill},
            {"cpu_decode", peak.cpu_decode},
            {"disk", peak.disk}}}};
}

std::string format_gib(double bytes) {
  return fmt::format("{:.1f} GiB", bytes / double(int64_t{1} << 30));
}

}  // namespace strata
