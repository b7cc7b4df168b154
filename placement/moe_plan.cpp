#include "placement/moe_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "kernels/error.h"

namespace strata {

void CpuExpertRates::validate() const {
  if (!(weight_bdw > 0 && std::isfinite(weight_bdw)) ||
      !(gemm_flops > 0 && std::isfinite(gemm_flops)))
    fail_input("CPU expert rates must be positive: weight bandwidth {} B/s, GEMM {} FLOP/s",
               weight_bdw, gemm_flops);
}

ExpertSiteChoice fiddler_rule(double expert_bytes, double flops_per_row, double rows,
                              double gpu_flops, const HardwareSpec& hw, const CpuExpertRates& cpu) {
  ExpertSiteChoice c;
  c.cpu_s = std::max(expert_bytes / cpu.weight_bdw, flops_per_row * rows / cpu.gemm_flops);
  c.copy_s = expert_bytes / hw.ctog_bdw;
  c.gpu_s = flops_per_row * rows / gpu_flops;
  c.cpu = c.cpu_s < c.copy_s + c.gpu_s;
  return c;
}

namespace {

constexpr double kPrefillChunk = 8192;

// The model's sizes the plan is written in, bytes and parameters of one layer.
struct MoeSizes {
  double e = 0;             // bytes per element (KV cache, as FlexGen plans; weights stored)
  double w = 0;             // bytes per weight element as stored (4-bit: compressed_fraction)
  double dense_params = 0;  // attention, norms, router, shared expert
  double expert_params = 0;
  double fixed_bytes = 0;  // embedding, head, final norm
  double kv_token_layer = 0;
  double l = 0, n_experts = 0, k = 0;
};

MoeSizes sizes(const ModelShape& s, bool compress) {
  MoeSizes z;
  z.e = static_cast<double>(s.weight_bytes_per_elem);
  z.w = z.e * (compress ? compressed_fraction(s.weight_bytes_per_elem) : 1.0);
  z.expert_params = static_cast<double>(s.expert_params());
  z.n_experts = static_cast<double>(s.n_experts);
  z.k = static_cast<double>(s.experts_per_token);
  z.dense_params = static_cast<double>(s.params_per_layer()) - z.n_experts * z.expert_params;
  z.fixed_bytes = static_cast<double>(s.embedding_params() + s.head_params() + s.hidden) * z.w;
  z.kv_token_layer = 2.0 * static_cast<double>(s.kv_width()) * z.e;
  z.l = static_cast<double>(s.n_layers);
  return z;
}

// One phase's seconds per layer by resource: `rows` rows, `attn_s` of attention (on the
// GPU or, with the cache in host memory, on the CPU).
struct PhaseTimes {
  double gpu = 0, cpu = 0, link = 0, disk = 0;
  ExpertSiteChoice site;
  double max() const { return std::max({gpu, cpu, link, disk}); }
};

PhaseTimes phase(const ModelShape& s, const MoeSizes& z, const MoePlan& p, const HardwareSpec& hw,
                 const CpuExpertRates& cpu, double rows, double mm_flops, double attn_s,
                 bool attn_on_cpu) {
  PhaseTimes t;
  const double active = s.expected_active_experts(static_cast<int64_t>(std::ceil(rows)));
  const double per_expert = rows * z.k / std::max(active, 1e-9);
  const double flops_row = 2.0 * z.expert_params;
  t.gpu = 2.0 * z.dense_params * rows / mm_flops;
  (attn_on_cpu ? t.cpu : t.gpu) += attn_s;
  const double share = active / z.n_experts;  // of each placement's experts, the active ones
  t.gpu += share * static_cast<double>(p.gpu_experts) * flops_row * per_expert / mm_flops;
  t.site = fiddler_rule(p.expert_bytes, flops_row, per_expert, mm_flops, hw, cpu);
  const double off_gpu = share * static_cast<double>(p.host_experts + p.disk_experts);
  if (t.site.cpu) {
    t.cpu += off_gpu * t.site.cpu_s;
  } else {
    t.link += off_gpu * t.site.copy_s;
    t.gpu += off_gpu * t.site.gpu_s;
  }
  t.disk = share * static_cast<double>(p.disk_experts) * p.expert_bytes / hw.dtoc_bdw;
  return t;
}

}  // namespace

MoePlan moe_plan_for(const ModelShape& s, const Workload& w, const HardwareSpec& hw,
                     const MoePlanOptions& options, int64_t batch, bool kv_on_gpu, bool& fits) {
  STRATA_CHECK(s.moe() && batch > 0, "a MoE plan of {} at batch {}", s.str(), batch);
  const MoeSizes z = sizes(s, options.compress_weight);
  const CpuExpertRates& cpu = options.cpu;
  const double b = static_cast<double>(batch), sl = static_cast<double>(w.prompt_len),
               n = static_cast<double>(w.gen_len);
  MoePlan p;
  p.batch = batch;
  p.kv_on_gpu = kv_on_gpu;
  p.expert_bytes = z.expert_params * z.w;
  const double kv = b * (sl + n) * z.kv_token_layer * z.l;
  const double staging = 2.0 * p.expert_bytes;  // a streamed expert's two device slots
  // Prefill's working set, its steps chunked to at most kPrefillChunk rows (the engine's
  // --max-step-tokens bounds a step the same way).
  const double act = 4.0 * std::min(b * sl, kPrefillChunk) * static_cast<double>(s.hidden) * z.e;
  const double dense = z.l * z.dense_params * z.w;
  const double gpu_left = hw.gpu_mem - z.fixed_bytes - dense - (kv_on_gpu ? kv : 0) - act - staging;
  const double host_left = hw.cpu_mem - (kv_on_gpu ? 0 : kv) - staging;
  const auto experts = static_cast<int64_t>(s.n_experts);
  const auto whole = [&](double bytes) {
    return std::clamp<int64_t>(static_cast<int64_t>(std::floor(bytes / (z.l * p.expert_bytes))), 0,
                               experts);
  };
  p.gpu_experts = gpu_left > 0 ? whole(gpu_left) : 0;
  p.host_experts = host_left > 0 ? std::min(whole(host_left), experts - p.gpu_experts) : 0;
  p.disk_experts = experts - p.gpu_experts - p.host_experts;
  p.gpu_bytes = hw.gpu_mem - gpu_left + z.l * static_cast<double>(p.gpu_experts) * p.expert_bytes;
  p.cpu_bytes = hw.cpu_mem - host_left + z.l * static_cast<double>(p.host_experts) * p.expert_bytes;
  p.disk_bytes = z.l * static_cast<double>(p.disk_experts) * p.expert_bytes;
  fits = gpu_left >= 0 && host_left >= 0 && p.disk_bytes <= hw.disk_mem;
  // Decode: b rows attending over s + n/2 positions on average; prefill: b s rows.
  const double q = static_cast<double>(s.q_width());
  const double decode_attn = 4.0 * b * (sl + n / 2) * q;
  const PhaseTimes d =
      phase(s, z, p, hw, cpu, b, hw.mm_flops_decode,
            kv_on_gpu ? decode_attn / hw.bmm_flops_decode
                      : decode_attn / hw.cpu_flops_for(b, static_cast<double>(s.hidden)),
            !kv_on_gpu);
  const PhaseTimes f = phase(s, z, p, hw, cpu, b * sl, hw.mm_flops_prefill,
                             4.0 * b * sl * sl * q / hw.bmm_flops_prefill, false);
  p.t_gpu = d.gpu;
  p.t_cpu = d.cpu;
  p.t_link = d.link;
  p.t_disk = d.disk;
  p.decode_site = d.site;
  p.prefill_site = f.site;
  p.active_experts = s.expected_active_experts(batch);
  p.rows_per_expert = b * z.k / p.active_experts;
  p.decode_layer_s = d.max();
  p.prefill_layer_s = f.max();
  p.throughput = b * n / (z.l * (p.prefill_layer_s + (n - 1) * p.decode_layer_s));
  return p;
}

MoePlan plan_moe(const ModelShape& s, const Workload& w, const HardwareSpec& hw,
                 const MoePlanOptions& options) {
  if (!s.moe()) fail_input("{} is not a mixture-of-experts model", s.str());
  options.cpu.validate();
  w.validate();
  MoePlan best;
  bool any = false;
  std::vector<MoePlan::Candidate> by_batch;
  for (const int64_t b : options.batches) {
    MoePlan at_b;
    bool fits_b = false;
    for (const bool kv_on_gpu : {true, false}) {
      bool fits = false;
      const MoePlan p = moe_plan_for(s, w, hw, options, b, kv_on_gpu, fits);
      if (fits && (!fits_b || p.throughput > at_b.throughput)) at_b = p;
      fits_b = fits_b || fits;
    }
    if (!fits_b) continue;
    by_batch.push_back({b, at_b.throughput, at_b.decode_site.cpu, at_b.bound()});
    if (!any || at_b.throughput > best.throughput) best = at_b;
    any = true;
  }
  best.by_batch = by_batch;
  if (!any) {
    bool fits = false;
    const MoePlan p = moe_plan_for(s, w, hw, options, 1, false, fits);
    fail_input(
        "no expert placement fits: at batch 1 the GPU needs {:.2f} GiB for the embedding, head "
        "and every layer's attention and router but gpu_mem is {:.2f} GiB (short by {:.2f} GiB)",
        p.gpu_bytes / (1 << 30), hw.gpu_mem / (1 << 30), (p.gpu_bytes - hw.gpu_mem) / (1 << 30));
  }
  return best;
}

std::string MoePlan::bound() const {
  const double m = decode_layer_s;
  return m == t_gpu ? "gpu" : m == t_cpu ? "cpu" : m == t_link ? "link" : "disk";
}

std::string MoePlan::str() const {
  const auto site = [](const ExpertSiteChoice& c) {
    return fmt::format("{} (CPU {:.2f} ms vs copy {:.2f} + GPU {:.2f} ms)",
                       c.cpu ? "on the CPU" : "copied to the GPU", c.cpu_s * 1e3, c.copy_s * 1e3,
                       c.gpu_s * 1e3);
  };
  return fmt::format(
             "MoE expert placement: batch {}, per layer {} experts on the GPU (the hottest), {} in "
             "host "
             "memory, {} on disk ({:.1f} MiB each); the attention, norms and router of every layer "
             "on "
             "the GPU; KV cache {}.\n"
             "  decode step: {:.2f} active experts per layer, {:.1f} rows each; a host expert is "
             "computed {}\n"
             "  prefill: a host expert is computed {}\n"
             "  decode per layer: gpu {:.2f} ms, cpu {:.2f} ms, link {:.2f} ms, disk {:.2f} ms -> "
             "{:.2f} ms ({}-bound); prefill per layer {:.2f} ms\n"
             "  memory: gpu {:.2f} GiB, cpu {:.2f} GiB, disk {:.2f} GiB; predicted throughput "
             "{:.2f} "
             "token/s",
             batch, gpu_experts, host_experts, disk_experts, expert_bytes / (1 << 20),
             kv_on_gpu ? "on the GPU" : "in host memory (attention on the CPU)", active_experts,
             rows_per_expert, site(decode_site), site(prefill_site), t_gpu * 1e3, t_cpu * 1e3,
             t_link * 1e3, t_disk * 1e3, decode_layer_s * 1e3, bound(), prefill_layer_s * 1e3,
             gpu_bytes / (1 << 30), cpu_bytes / (1 << 30), disk_bytes / (1 << 30), throughput) +
         candidates();
}

std::string MoePlan::candidates() const {
  if (by_batch.empty()) return "";
  std::string s = "\n  by batch (token/s, where decode computes host experts, bound):";
  for (const Candidate& c : by_batch)
    s += fmt::format(" {}: {:.2f} {} {};", c.batch, c.throughput, c.cpu_experts ? "CPU" : "GPU",
                     c.bound);
  return s;
}

nlohmann::json MoePlan::to_json() const {
  const auto site = [](const ExpertSiteChoice& c) {
    return nlohmann::json{
        {"cpu", c.cpu}, {"cpu_s", c.cpu_s}, {"copy_s", c.copy_s}, {"gpu_s", c.gpu_s}};
  };
  return {{"batch", batch},
          {"gpu_experts_per_layer", gpu_experts},
          {"host_experts_per_layer", host_experts},
          {"disk_experts_per_layer", disk_experts},
          {"kv_on_gpu", kv_on_gpu},
          {"expert_bytes", expert_bytes},
          {"active_experts_per_layer", active_experts},
          {"rows_per_expert", rows_per_expert},
          {"decode_host_expert", site(decode_site)},
          {"prefill_host_expert", site(prefill_site)},
          {"decode_layer_s",
           {{"gpu", t_gpu},
            {"cpu", t_cpu},
            {"link", t_link},
            {"disk", t_disk},
            {"step", decode_layer_s},
            {"bound", bound()}}},
          {"prefill_layer_s", prefill_layer_s},
          {"memory_bytes", {{"gpu", gpu_bytes}, {"cpu", cpu_bytes}, {"disk", disk_bytes}}},
          {"throughput", throughput},
          {"by_batch", [&] {
             nlohmann::json a = nlohmann::json::array();
             for (const Candidate& c : by_batch)
               a.push_back({{"batch", c.batch},
                            {"throughput", c.throughput},
                            {"decode_host_experts_on", c.cpu_experts ? "cpu" : "gpu"},
                            {"bound", c.bound}});
             return a;
           }()}};
}

}  // namespace strata
