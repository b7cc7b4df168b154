// The hardware constants of FlexGen's cost model (appendix A.3, Table 7): memory of the
// three tiers, the four link bandwidths and the compute rates. FlexGen fits them to
// measured runs rather than reading data sheets; its public cost model keeps two GPU->CPU
// bandwidths (cache vs hidden states) and two CPU->disk ones (cache during prefill vs
// everything else), and so do we. All values are in base units: bytes, bytes/s, FLOP/s.
#pragma once

#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>

namespace strata {

// How the cost model combines the activities of a phase into its time. FlexGen fits the
// constants below against measured runs together with this form, so it belongs here.
enum class OverlapModel {
  // Appendix A.3 as printed, perfect overlap: T = max(ctog, gtoc, dtoc, ctod, comp).
  kPaper,
  // FlexGen's released cost model, which its T4 constants were fitted with: in prefill
  // max(ctog + dtoc, gtoc + ctod, comp) -- a disk read lands in CPU memory before it can go
  // on to the GPU, a cache write reaches CPU memory before it can go to disk; in decode
  // ctog + max(gtoc, dtoc, ctod, comp) -- the weight transfer does not hide behind decode
  // compute (FlexGen's Table 21: 48x1 runs at 5.40 token/s, what ctog + comp predicts).
  kFitted,
};
const char* overlap_model_name(OverlapModel m);  // "paper", "fitted"

struct HardwareSpec {
  double gpu_mem = 0;   // gmem, bytes
  double cpu_mem = 0;   // cmem, bytes
  double disk_mem = 0;  // nmem, bytes

  double ctog_bdw = 0;                // CPU -> GPU
  double gtoc_bdw_cache = 0;          // GPU -> CPU, KV cache
  double gtoc_bdw_hidden = 0;         // GPU -> CPU, activations (hidden states)
  double dtoc_bdw = 0;                // disk -> CPU
  double ctod_bdw_cache_prefill = 0;  // CPU -> disk, KV cache written during prefill
  double ctod_bdw_other = 0;          // CPU -> disk, everything else

  double mm_flops_prefill = 0;  // GPU matmul
  double mm_flops_decode = 0;
  double bmm_flops_prefill = 0;  // GPU batched matmul (attention)
  double bmm_flops_decode = 0;
  double cpu_flops = 0;  // CPU attention (computation delegation)
  // FlexGen's fitted slow-down of CPU attention for small GPU batches and hidden sizes:
  // cpu_flops * max(0.1, 1 + c1 * a * b - c2 * a - c3 * b), a = max(0, log2(64 / gbs)),
  // b = max(0, log2(4096 / h1)); A.3's "piece-wise functions" that keep the problem an LP
  // (they depend on constants only). Zero turns it off.
  double cpu_flops_c1 = 0, cpu_flops_c2 = 0, cpu_flops_c3 = 0;
  OverlapModel overlap_model = OverlapModel::kFitted;

  // FlexGen's Google Cloud T4 machine (Table 1) with the constants its public cost model
  // fitted for it.
  static HardwareSpec flexgen_t4();

  // cpu_flops as the cost model uses it for GPU batch size `gbs` and hidden size `h1`.
  double cpu_flops_for(double gbs, double h1) const;

  // Every rate and capacity finite and positive, c1..c3 finite and >= 0; `source` (a file name,
  // "--hardware", ...) leads the InputError message.
  void validate(std::string_view source) const;

  // A flat object with one number per field, named as above, and "overlap_model":
  // "paper" or "fitted".
  nlohmann::json to_json() const;
  // Every field required, no others allowed; errors name `source` and the field.
  static HardwareSpec from_json(const nlohmann::json& j, std::string_view source);
  static HardwareSpec load(const std::string& path);
  void save(const std::string& path) const;

  std::string str() const;
};

}  // namespace strata
