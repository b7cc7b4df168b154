// Expert placement for a mixture-of-experts model on one GPU node (the plan `strata plan`
// explains beside FlexGen's layer offloading): the attention, norms and router of every
// layer and the hottest experts on the GPU, the other experts in host memory (then on disk),
// and each step's host experts either computed on the CPU where their bytes are or copied
// to the GPU, by Fiddler's rule (Kamahori et al., "Fiddler: CPU-GPU Orchestration for Fast
// Inference of MoE Models", §3: compare the copy time with the CPU's time for the rows the
// expert has). The step time per layer overlaps GPU compute, the CPU, the host-to-GPU link
// and the disk (MoE-Lightning's CGOPipe: T = max(comm, T_cpu, T_gpu)); throughput is
// FlexGen's, b n / (prefill + decode).
//
// Routing is taken as uniform (every expert equally popular, rows spread evenly): the
// expected distinct experts of a step of r rows is E (1 - (1 - k/E)^r). With skewed routing
// the GPU's hottest experts serve more rows than this counts, so the estimate is a floor.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "placement/cost_model.h"
#include "placement/hardware.h"
#include "placement/model_shape.h"

namespace strata {

// What computing an expert on the host costs, beside FlexGen's constants (HardwareSpec has
// only CPU attention's rate): the rate the CPU streams a weight matrix at through a GEMM of
// few rows (memory-bound), and its GEMM rate over many rows (compute-bound).
struct CpuExpertRates {
  double weight_bdw = 20e9;  // bytes/s
  double gemm_flops = 0.5e12;
  void validate() const;
};

// Fiddler's rule for one host-memory expert that `rows` rows of a step need.
struct ExpertSiteChoice {
  bool cpu = false;   // computed on the CPU (else copied to the GPU and computed there)
  double cpu_s = 0;   // max(bytes / weight_bdw, flops / gemm_flops)
  double copy_s = 0;  // bytes / ctog_bdw
  double gpu_s = 0;   // flops / the GPU's matmul rate, after the copy
  double time() const { return cpu ? cpu_s : copy_s + gpu_s; }
};
ExpertSiteChoice fiddler_rule(double expert_bytes, double flops_per_row, double rows,
                              double gpu_flops, const HardwareSpec& hw, const CpuExpertRates& cpu);

struct MoePlan {
  int64_t batch = 0;  // sequences decoding together (one GPU batch)
  int64_t gpu_experts = 0, host_experts = 0, disk_experts = 0;  // per layer
  bool kv_on_gpu = true;  // else in host memory, attended there (CPU attention)
  double expert_bytes = 0;
  double active_experts = 0;                   // per layer per decode step
  double rows_per_expert = 0;                  // of an active expert, per decode step
  ExpertSiteChoice decode_site, prefill_site;  // a host expert's, per phase
  double gpu_bytes = 0, cpu_bytes = 0, disk_bytes = 0;
  // Seconds per layer of one decode step, by resource, and the step's (their max).
  double t_gpu = 0, t_cpu = 0, t_link = 0, t_disk = 0;
  double decode_layer_s = 0, prefill_layer_s = 0;
  double throughput = 0;  // generated tokens / (prefill + decode) seconds
  // plan_moe's candidates: the best placement at each batch that fits, for the explanation.
  struct Candidate {
    int64_t batch;
    double throughput;
    bool cpu_experts;  // decode computes host experts on the CPU
    std::string bound;
  };
  std::vector<Candidate> by_batch;
  std::string bound() const;  // the resource that sets the decode step: gpu, cpu, link, disk
  std::string str() const;
  std::string candidates() const;
  nlohmann::json to_json() const;
};

struct MoePlanOptions {
  CpuExpertRates cpu;
  // FlexGen's 4-bit group-wise weights (§5): every stored and moved weight byte times
  // compressed_fraction (the CPU and GPU compute from them dequantised, as Strata's do).
  bool compress_weight = false;
  std::vector<int64_t> batches = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024};
};

// The highest-throughput placement over the batches tried; InputError when none fits the
// GPU (its dense part alone), naming the shortfall.
MoePlan plan_moe(const ModelShape& shape, const Workload& w, const HardwareSpec& hw,
                 const MoePlanOptions& options = {});
// One batch's placement and time (what plan_moe compares); `fits` false when it does not.
MoePlan moe_plan_for(const ModelShape& shape, const Workload& w, const HardwareSpec& hw,
                     const MoePlanOptions& options, int64_t batch, bool kv_on_gpu, bool& fits);

}  // namespace strata
