// What Pie and HeteGen would do for a FlexGen policy on given hardware, predicted from the
// same constants the cost model uses (issue 17 item 4; `strata plan` prints both):
//
//  - Pie (papers/pie.md §3.1, §3.3): a decode step computes a layer for the block in t_compute
//    (the cost model's GPU compute per layer) while a layer's KV cache for the block crosses
//    the link in t_swap. §3.3's protocol runs stall-free up to some m layers on the host; the
//    expansion n / (n - m) is how much more cache the same GPU memory holds. The largest m is
//    read off Pie's own simulator (placement/pie.h) rather than §3.1's bound t_swap * m <=
//    t_compute * n, which ignores that one swap-in and one swap-out run at a time.
//  - HeteGen (papers/hetegen.md eq. 4-5): a layer whose weights live on the host is split,
//    alpha of its parameters crossing the link and computed on the GPU, the rest computed on
//    the CPU where they lie; alpha balances the two sides. Its decode time per layer against
//    FlexGen streaming the whole layer over the link.
//
// The policy search uses the largest stall-free m and eq. 5's alpha to pick the variants it
// solves (placement/policy_search.h); the cost model prices them (placement/cost_model.h).
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>

#include "placement/cost_model.h"

namespace strata {

struct PieEstimate {
  int32_t n_layers = 0;
  int64_t layer_cache_bytes = 0;  // one layer's K and V for the block at its longest context
  double compute_s = 0;           // one layer's decode compute for the block
  double swap_s = 0;              // one layer's cache over the link, the slower direction
  int32_t host_layers = 0;        // m: the most with no stall after warm-up
  double expansion = 1;           // n / (n - m)
  std::string str() const;
  nlohmann::json to_json() const;
};

// The largest m below n for which §3.3's protocol, once warmed up, never makes compute wait
// on a swap-in, with one layer computing in `compute_s` and swapping in `swap_s`.
int32_t max_stall_free_host_layers(int32_t n_layers, double compute_s, double swap_s);

// InputError from the cost model for a bad shape, workload or policy.
PieEstimate estimate_pie(const ModelShape& shape, const Workload& w, const Policy& policy,
                         const HardwareSpec& hw);

struct HeteGenEstimate {
  int64_t rows = 0;  // sequences decoding together
  // Parameters per second for their decode: the GPU's and the CPU's compute (two FLOPs
  // per parameter per sequence) and the link's bytes.
  double v_gpu = 0, v_cpu = 0, v_com = 0;
  double alpha = 0;          // eq. 5
  int64_t layer_params = 0;  // W, one layer
  double stream_s = 0;       // FlexGen: W over the link, then W computed on the GPU
  double split_s = 0;        // HeteGen: (1 - alpha) W / V_cpu, equal to alpha W (1/V_com + 1/V_gpu)
  std::string str() const;
  nlohmann::json to_json() const;
};

// For `rows` sequences decoding together (the policy's block, or 1: HeteGen's latency case),
// with the policy's weight compression. InputError for rows < 1.
HeteGenEstimate estimate_hetegen(const ModelShape& shape, const Policy& policy, int64_t rows,
                                 const HardwareSpec& hw);

}  // namespace strata
