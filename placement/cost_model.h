// FlexGen's cost model (§4.3, appendix A.3): the time of one block per layer in prefill
// (T_pre) and decode (T_gen) from five activities -- CPU->GPU (ctog), GPU->CPU (gtoc),
// disk->CPU (dtoc) and CPU->disk (ctod) traffic and compute (comp, GPU plus CPU attention)
// -- combined as HardwareSpec::overlap_model says (A.3's max, or the chains FlexGen fitted
// its constants with), the block time T = T_pre*l + T_gen*(n-1)*l, throughput bls*n/T, and
// the peak memory of GPU, CPU and disk ("Peak Memory Constraints").
//
// Every term is linear in the nine placement fractions (wg..hd) once the schedule
// (gbs, number of GPU batches, the flags) is fixed; cost_model_terms() returns them in that
// form, which is both what estimate_cost() evaluates and what the policy search hands to
// the LP solver, so the two can never disagree.
//
// FlexGen counts fp16 (2 bytes per element: weights 8h1^2 + 4h1h2 bytes per layer, KV cache
// 4h1 bytes per token per layer, activations 2h1); here the element size is the model's
// weight_bytes_per_elem, except the KV cache's (kv_cache_elem_bytes: f32 as the engine keeps
// it, f16 under cf16), so an fp16 ModelShape under cf16=1 gives FlexGen's numbers. Weights per
// layer are the layer's parameters (q/k/v/o and MLP, biases and norms too; FlexGen's
// 4h1^2 + 2h1h2 for OPT without the small vectors); K/V use n_kv_heads * head_dim (= h1 in
// OPT). Embeddings and the LM head are ignored, as FlexGen does (§4, footnote 1).
//
// Where this departs from A.3 as printed (each marked in cost_model.cpp):
//  - prefill attention working memory is not scaled by cg: prefill attends on the GPU
//    whatever the cache placement; the decode activation buffer is 2 h1 gbs, not 2 s h1 gbs;
//  - without CPU attention (A.3 only covers the case with it) the off-GPU cache crosses
//    CPU->GPU to be attended, the new token's K/V go back, and the GPU double-buffers it;
//  - the KV cache is 4 bytes an element (the engine's f32 cache) whatever the weights' type,
//    2 under cf16 (FlexGen's f16 cache);
//  - compression (§5) scales stored weights / cache by compressed_fraction() in every
//    transfer and home, and the GPU holds one layer dequantised; (de)quantisation time is
//    not modelled, as in FlexGen's own cost model;
//  - CPU attention runs at HardwareSpec::cpu_flops_for(gbs, h1), FlexGen's fitted
//    piece-wise rate (A.3: "piece-wise functions"), equal to cpu_flops for gbs >= 64.
//
// Two placements FlexGen does not have, each fixed per policy so the terms stay linear:
//  - Pie (policy pie=m, papers/pie.md §3): the GPU holds (l - m) / l of the cache, the host
//    min(l, m + 2) layers of it; each token m layers swap in and out, on average m / l of a
//    layer per layer on each link; §3.3's protocol hides them iff one layer's compute is at
//    least t_swap / floor((l - 1) / (m + 2)) (docs/PIE_HETEGEN.md), the bound "pie".
//  - HeteGen (policy hetegen=A, papers/hetegen.md eq. 4): of the CPU-tier weights (wc) only
//    alpha crosses the link and is computed on the GPU; the CPU computes the rest at its
//    FLOP rate beside them (the bound "cpu", with CPU attention).
#pragma once

#include <array>
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "placement/hardware.h"
#include "placement/model_shape.h"
#include "placement/policy.h"

namespace strata {

// FlexGen's s (prompt length) and n (tokens generated per prompt).
struct Workload {
  int64_t prompt_len = 0;  // s
  int64_t gen_len = 0;     // n
  void validate() const;   // InputError unless both are positive
};

// Group-wise 4-bit quantisation with groups of 64 (FlexGen §5): 4 bits per element plus a
// min and a scale per group in the original type, so fp16 shrinks to 0.28125 of its size.
inline constexpr int kCompressBits = 4;
inline constexpr int kCompressGroup = 64;
double compressed_fraction(int64_t elem_bytes);

// Bytes a KV-cache element takes under `p` as the engine stores it, whatever the weights: f32
// (4), or 2 with an f16 cache (policy cf16, FlexGen's own), times compressed_fraction with a
// 4-bit cache. The cost model and the Pie estimate both use it, so a policy the search finds
// holds in the memory the engine allocates (placement/stage_placement.h counts the same).
double kv_cache_elem_bytes(const Policy& p);

// The LP's variables, in the order FlexGen lists them: percentages / 100.
enum PlacementVar : int { kWg, kWc, kWd, kCg, kCc, kCd, kHg, kHc, kHd, kNumPlacementVars };
using Placement = std::array<double, kNumPlacementVars>;
Placement placement_of(const Policy& p);

// constant + sum_v coef[v] * x[v].
struct LinearTerm {
  double constant = 0;
  std::array<double, kNumPlacementVars> coef{};
  double eval(const Placement& x) const;
};
LinearTerm operator+(LinearTerm a, const LinearTerm& b);
LinearTerm operator*(double k, LinearTerm a);

// One lower bound on a phase's time, e.g. "ctog+comp".
struct TimeBound {
  std::string_view name;
  LinearTerm time;
};

// The five activities of one phase, seconds per layer for the whole block, and the bounds
// whose max is T_pre / T_gen: the activities themselves (OverlapModel::kPaper), FlexGen's
// fitted chains (kFitted), or their sum alone when the policy turns overlap off.
struct PhaseTerms {
  LinearTerm ctog, gtoc, dtoc, ctod, gpu_comp, cpu_comp;
  // HeteGen's CPU share of the CPU-tier linears: runs beside the GPU and the link, so it is
  // its own bound (with CPU attention, which shares the CPU), not part of comp.
  LinearTerm cpu_split;
  std::vector<TimeBound> bounds;
};

// Peak bytes of one tier in one phase: base (home + working buffers) plus the largest of
// the working sets that are alive at different moments (A.3's max(qkv, att1, att2, embed,
// mlp1, mlp2)); `alternatives` is empty where A.3 has no such max.
struct PeakTerms {
  LinearTerm base;
  std::vector<LinearTerm> alternatives;
  double eval(const Placement& x) const;
};

struct CostModelTerms {
  int64_t n_layers = 0;    // l
  int64_t gen_len = 0;     // n
  int64_t block_size = 0;  // bls
  PhaseTerms prefill, decode;
  PeakTerms gpu_prefill, gpu_decode, cpu_prefill, cpu_decode, disk;
};

// The model for the schedule part of `schedule` (gpu_batch_size, num_gpu_batches and the
// four flags) on `hw` (its constants and overlap model); the percentages are not read.
CostModelTerms cost_model_terms(const ModelShape& shape, const Workload& w, const Policy& schedule,
                                const HardwareSpec& hw);

struct PhaseCost {
  double ctog = 0, gtoc = 0, dtoc = 0, ctod = 0;
  double gpu_comp = 0, cpu_comp = 0;
  double cpu_split = 0;              // HeteGen's CPU share (policy hetegen=)
  double time = 0;                   // T_pre or T_gen, seconds per layer per block
  std::string_view bottleneck = "";  // the largest activity: ctog, gtoc, dtoc, ctod, comp
  std::string_view binding = "";     // the bound that sets `time`, e.g. "comp", "ctog+comp"
  double comp() const { return gpu_comp + cpu_comp; }
  // The time with nothing overlapped: a measure of all the data moved and work done.
  double serial() const { return ctog + gtoc + dtoc + ctod + comp() + cpu_split; }
};

struct PeakMemory {
  double gpu_prefill = 0, gpu_decode = 0, cpu_prefill = 0, cpu_decode = 0, disk = 0;  // bytes
  double gpu() const { return gpu_prefill > gpu_decode ? gpu_prefill : gpu_decode; }
  double cpu() const { return cpu_prefill > cpu_decode ? cpu_prefill : cpu_decode; }
};

struct CostEstimate {
  Policy policy;
  Workload workload;
  int64_t n_layers = 0;
  PhaseCost prefill, decode;
  double total_time = 0;  // T: one block, all layers, prefill and n - 1 decode steps
  double throughput = 0;  // generated tokens per second: bls * n / T
  PeakMemory peak;

  // T / bls: the LP's objective.
  double time_per_sequence() const { return total_time / double(policy.block_size()); }

  // One line per tier over its budget in `hw`, e.g. "GPU memory: needs 20.3 GiB (prefill)
  // but gpu_mem is 16.0 GiB (short by 4.3 GiB)"; empty when everything fits.
  std::vector<std::string> memory_shortfalls(const HardwareSpec& hw) const;
  bool fits(const HardwareSpec& hw) const { return memory_shortfalls(hw).empty(); }

  std::string str() const;
  nlohmann::json to_json() const;
};

// Validates its inputs (InputError) and evaluates the model at `policy`.
CostEstimate estimate_cost(const ModelShape& shape, const Workload& w, const Policy& policy,
                           const HardwareSpec& hw);

// "20.3 GiB": the unit FlexGen's numbers are in (see hardware.cpp).
std::string format_gib(double bytes);

}  // namespace strata
