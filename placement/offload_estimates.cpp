#include "placement/offload_estimates.h"

#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "kernels/error.h"
#include "placement/hetegen.h"
#include "placement/pie.h"

namespace strata {
namespace {

// Tokens Pie's simulator runs before it is judged (the FIFO fills in the first), and after.
constexpr int kWarmTokens = 3;
constexpr int kJudgedTokens = 4;

bool stalls(int32_t n_layers, int32_t host_layers, double compute_s, double swap_s) {
  PieSimulator sim(PieSimConfig{n_layers, host_layers, compute_s, swap_s});
  for (int t = 0; t < kWarmTokens; ++t) sim.run_token();
  double stall = 0;
  for (int t = 0; t < kJudgedTokens; ++t) stall += sim.run_token().stall;
  return stall > 1e-9 * compute_s;
}

}  // namespace

int32_t max_stall_free_host_layers(int32_t n_layers, double compute_s, double swap_s) {
  int32_t m = 0;
  while (m + 1 < n_layers && !stalls(n_layers, m + 1, compute_s, swap_s)) ++m;
  return m;
}

PieEstimate estimate_pie(const ModelShape& shape, const Workload& w, const Policy& policy,
                         const HardwareSpec& hw) {
  const CostEstimate cost = estimate_cost(shape, w, policy, hw);
  PieEstimate e;
  e.n_layers = static_cast<int32_t>(shape.n_layers);
  const double elem = kv_cache_elem_bytes(policy);
  e.layer_cache_bytes = static_cast<int64_t>(static_cast<double>(policy.block_size()) *
                                             static_cast<double>(w.prompt_len + w.gen_len) * 2 *
                                             static_cast<double>(shape.kv_width()) * elem);
  e.compute_s = cost.decode.gpu_comp;
  const auto bytes = static_cast<double>(e.layer_cache_bytes);
  e.swap_s = std::max(bytes / hw.ctog_bdw, bytes / hw.gtoc_bdw_cache);
  if (!(e.compute_s > 0))
    fail_input("Pie needs decode compute on the GPU to hide swaps behind; the policy has none");
  e.host_layers = max_stall_free_host_layers(e.n_layers, e.compute_s, e.swap_s);
  e.expansion = static_cast<double>(e.n_layers) / (e.n_layers - e.host_layers);
  return e;
}

std::string PieEstimate::str() const {
  return fmt::format(
      "Pie: a layer's KV cache for the block is {}, swapped in {:.4f} s against {:.4f} s of "
      "decode compute; up to {} of {} layers on the host without a stall (expansion {:.2f}: the "
      "GPU's cache memory holds {:.2f}x the cache)",
      format_gib(static_cast<double>(layer_cache_bytes)), swap_s, compute_s, host_layers, n_layers,
      expansion, expansion);
}

nlohmann::json PieEstimate::to_json() const {
  return {{"layer_cache_bytes", layer_cache_bytes},
          {"swap_s", swap_s},
          {"compute_s", compute_s},
          {"host_layers", host_layers},
          {"n_layers", n_layers},
          {"expansion", expansion}};
}

HeteGenEstimate estimate_hetegen(const ModelShape& shape, const Policy& policy, int64_t rows,
                                 const HardwareSpec& hw) {
  if (rows < 1) fail_input("HeteGen's estimate needs at least one sequence, got {}", rows);
  HeteGenEstimate e;
  e.rows = rows;
  const double elem =
      static_cast<double>(shape.weight_bytes_per_elem) *
      (policy.compress_weight ? compressed_fraction(shape.weight_bytes_per_elem) : 1);
  e.v_gpu = hw.mm_flops_decode / (2 * static_cast<double>(rows));
  e.v_cpu = hw.cpu_flops / (2 * static_cast<double>(rows));
  e.v_com = hw.ctog_bdw / elem;
  e.alpha = hetegen::alpha_from_speeds(e.v_cpu, e.v_gpu, e.v_com);
  e.layer_params = shape.params_per_layer();
  const auto W = static_cast<double>(e.layer_params);
  // FlexGen's fitted decode (cost_model.h): the weight transfer does not hide behind compute.
  e.stream_s = W / e.v_com + W / e.v_gpu;
  e.split_s = (1 - e.alpha) * W / e.v_cpu;
  return e;
}

std::string HeteGenEstimate::str() const {
  return fmt::format(
      "HeteGen at {} sequences: alpha {:.3f} (eq. 5 with V_cpu {:.3g}, V_gpu {:.3g}, V_com {:.3g} "
      "parameters/s); a host-resident layer decodes in {:.4f} s split against {:.4f} s streamed "
      "whole ({:.2f}x)",
      rows, alpha, v_cpu, v_gpu, v_com, split_s, stream_s, stream_s / split_s);
}

nlohmann::json HeteGenEstimate::to_json() const {
  return {{"rows", rows},         {"alpha", alpha},    {"v_cpu", v_cpu},
          {"v_gpu", v_gpu},       {"v_com", v_com},    {"layer_params", layer_params},
          {"stream_s", stream_s}, {"split_s", split_s}};
}

}  // namespace strata
