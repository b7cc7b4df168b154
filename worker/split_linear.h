// HeteGen's heterogeneous linear (papers/hetegen.md §3.1, §4.2): y = x W^T + b with W
// [out, in] split by output rows, tensor-parallel style. Rows [0, ceil(alpha x out)) -- the
// paper's alpha share -- are computed by the compute backend ("the GPU") from weights in its
// memory; the other rows by a CPU backend from weights in host memory. x goes down to the
// host, both shares run at once, and the CPU share comes back up to be joined into y.
//
// A row split keeps every output element's dot product whole (the same x row against the
// same weight row), so it changes no result beyond the order a kernel sums in. The CPU
// backend's decode kernels (GEMV and 4-bit, up to kGemvMaxRows rows) give each weight row
// its own accumulator, so there a split is bit-identical to the unsplit linear. OpenBLAS's
// sgemm (longer prefills) sums an element in an order that depends on where its column falls
// in the kernel's tiles of the output width, so a share may differ in the last bit there.
//
// The device share is held one of two ways (SplitShare). Streamed, as in the paper: W stays in
// host memory and the alpha share crosses the link every pass (the engine's feeder copies it
// into a device slot while the layer before computes, worker/layer_feeder.h), and the caller
// hands split_linear the device copy; the device holds alpha x W only transiently (§4.3).
// Resident: the split owns a device copy of its alpha share (tests and callers without a
// feeder). The activations make the round trip through the backend's asynchronous transfers
// either way.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "placement/hetegen.h"
#include "placement/layer_linears.h"
#include "placement/tier.h"
#include "worker/weights.h"

namespace strata {

// The linears of a layer HeteGen splits (§4.2: "applying heterogeneous parallelism to linear
// modules, while retaining all other modules on the GPU") are LinearSlot's, the layer's table
// (placement/layer_linears.h).
// Output rows the compute backend takes: ceil(alpha x out) (placement/hetegen.h).
using hetegen::split_gpu_rows;

// The first `rows` rows of the host matrix w ([out, in]) as a host tensor: a view of w's own
// memory for plain dtypes, a copy into `storage` for kQ4 (whose codes, mins and scales are
// stored apart, so a row range is three pieces). What the feeder packs as a streamed share.
Tensor leading_rows(const Tensor& w, int64_t rows, std::vector<std::byte>& storage);

// Where a split keeps its alpha share: its own device copy, or none -- the caller streams one
// in and passes it to split_linear each call (worker/layer_feeder.h).
enum class SplitShare : uint8_t { kResident = 0, kStreamed = 1 };

// One linear's weights split at alpha: the first gpu_rows() rows (and their bias) in the
// compute backend's memory, the rest in host memory for the CPU backend.
//
// 4-bit (kQ4) weights split on row boundaries too: their groups run along rows (quant.h,
// kAlongRow), so each output row owns its in/2 code bytes and its in/64 mins and scales,
// and a range of rows is one range of each of the three parts of the blob.
class SplitLinearWeights {
 public:
  // w: [out, in] f32 / f16 / bf16 / kQ4, in host memory or the compute backend's; bias: [out]
  // f32 or absent (null data). InputError for alpha outside [0, 1] or weights not resident.
  // kStreamed copies only the CPU share: gpu_weight() then has the share's shape and no data.
  SplitLinearWeights(const Tensor& w, const Tensor& bias, double alpha, Backend& gpu, Backend& cpu,
                     SplitShare share = SplitShare::kResident);
  SplitLinearWeights(const SplitLinearWeights&) = delete;
  SplitLinearWeights& operator=(const SplitLinearWeights&) = delete;

  double alpha() const { return alpha_; }
  SplitShare share() const { return share_; }
  bool has_bias() const { return has_bias_; }
  int64_t out_features() const { return out_; }
  int64_t in_features() const { return in_; }
  int64_t gpu_rows() const { return gpu_.shape[0]; }
  int64_t cpu_rows() const { return cpu_.shape[0]; }
  const Tensor& gpu_weight() const { return gpu_; }
  const Tensor& cpu_weight() const { return cpu_; }
  const float* gpu_bias() const { return static_cast<const float*>(gpu_bias_.data()); }
  const float* cpu_bias() const { return static_cast<const float*>(cpu_bias_.data()); }
  TierBytes memory() const;  // gpu: the alpha share and its bias (resident); cpu: the rest

 private:
  double alpha_;
  SplitShare share_;
  bool has_bias_ = false;
  int64_t out_ = 0, in_ = 0;
  DeviceBuffer gpu_storage_, gpu_bias_;  // the compute backend's allocations
  DeviceBuffer cpu_storage_, cpu_bias_;  // the CPU backend's (host memory)
  Tensor gpu_, cpu_;
};

// The staging a split linear needs, sized once for the largest call: x brought down to the
// host, the CPU share's output before it goes up (both transfer-ready host memory of the
// compute backend), and device room for both shares before they are joined row by row.
class SplitLinearScratch {
 public:
  SplitLinearScratch() = default;
  SplitLinearScratch(Backend& gpu, int64_t max_rows, int64_t max_in, int64_t max_out);

  int64_t max_rows() const { return max_rows_; }
  int64_t max_in() const { return max_in_; }
  int64_t max_out() const { return max_out_; }
  TierBytes memory() const;
  // The CPU shares computed through this staging: calls and seconds on the host (the CPU
  // share's linear alone, what HeteGen overlaps with the transfers and the device's share).
  int64_t cpu_calls() const { return cpu_calls_; }
  double cpu_seconds() const { return cpu_seconds_; }

 private:
  friend void split_linear(const SplitLinearWeights&, const float*, int64_t, float*, Backend&,
                           Backend&, SplitLinearScratch&, const Tensor*, const float*);
  int64_t max_rows_ = 0, max_in_ = 0, max_out_ = 0;
  DeviceBuffer x_host_, y_host_, stage_;
  // The last upload of y_host_: the host waits for it before writing y_host_ again.
  TransferTicket upload_;
  int64_t cpu_calls_ = 0;
  double cpu_seconds_ = 0;
};

// y[m, out] = x[m, in] W^T + b, x and y in the compute backend's memory. The CPU share is
// computed on `cpu` while the compute backend runs its share (where its calls are
// asynchronous, as CUDA's are); y is complete in stream order when this returns. A streamed
// split takes its alpha share from `gpu_w` ([gpu_rows, in] in the compute backend's memory,
// w's dtype) and `gpu_bias` (gpu_rows f32, or null without bias); a resident one ignores them.
void split_linear(const SplitLinearWeights& w, const float* x, int64_t m, float* y, Backend& gpu,
                  Backend& cpu, SplitLinearScratch& scratch, const Tensor* gpu_w = nullptr,
                  const float* gpu_bias = nullptr);

// Every layer linear of a stage split as HeteGen decides, for the transformer
// (Transformer::set_split_linears) to run in place of the compute backend's linear.
class SplitLinearTable {
 public:
  // alpha for (stage-local layer, slot); a negative value leaves that linear unsplit (it then
  // runs on the compute backend from the layer's own weights). For a scheduler's plan:
  //   [&](int32_t l, LinearSlot s) { return plan.alpha_of(hetegen_module_name(l, s)); }
  using AlphaFor = std::function<double(int32_t layer, LinearSlot slot)>;

  // An empty table for a stage of `n_layers` layers, filled by add() one layer at a time (the
  // loader's order: a model larger than memory is never whole in memory), then reserve()d.
  SplitLinearTable(Backend& gpu, Backend& cpu, int32_t n_layers);
  // `layers`: the stage's layers with resident weights (host memory or the compute
  // backend's); they are copied, so they may be dropped or streamed afterwards.
  // `max_rows`: the transformer's.
  SplitLinearTable(std::span<const LayerWeights> layers, const AlphaFor& alpha, Backend& gpu,
                   Backend& cpu, int32_t max_rows);
  // Every linear at options.alpha (validated).
  SplitLinearTable(std::span<const LayerWeights> layers, const hetegen::HeteGenOptions& options,
                   Backend& gpu, Backend& cpu, int32_t max_rows);

  // Splits layer `layer`'s linears (copied: `w` may be dropped afterwards). Before reserve().
  // kStreamed keeps only the CPU shares: the caller streams the alpha shares (layer_feeder.h).
  void add(int32_t layer, const LayerWeights& w, const AlphaFor& alpha,
           SplitShare share = SplitShare::kResident);
  // Sizes the staging for calls of up to `max_rows` rows over the linears added so far, and
  // reserves the CPU backend's kernel scratch for them (grow-only). Between steps.
  void reserve(int32_t max_rows);
  int32_t max_rows() const { return static_cast<int32_t>(scratch_.max_rows()); }

  Backend& gpu() const { return gpu_; }
  Backend& cpu() const { return cpu_; }
  int32_t n_layers() const { return static_cast<int32_t>(layers_.size()); }
  // The split of (layer, slot), or nullptr where it runs unsplit.
  const SplitLinearWeights* find(int32_t layer, LinearSlot slot) const;
  // Whether any linear of `layer` is split.
  bool splits(int32_t layer) const;
  // `gpu_w`, `gpu_bias`: the layer's weights as the compute backend sees them this step (the
  // streamed alpha share, for a streamed split).
  void linear(const SplitLinearWeights& w, const float* x, int64_t m, float* y,
              const Tensor& gpu_w = Tensor{}, const Tensor& gpu_bias = Tensor{}) {
    split_linear(w, x, m, y, gpu_, cpu_, scratch_, &gpu_w,
                 gpu_bias.data != nullptr ? gpu_bias.f32() : nullptr);
  }
  TierBytes memory() const;  // the split weights and the staging
  std::string str() const;   // one line per layer: each slot's rows on each side
  const SplitLinearScratch& scratch() const { return scratch_; }  // its CPU-share counters

 private:
  Backend& gpu_;
  Backend& cpu_;
  std::vector<std::array<std::unique_ptr<SplitLinearWeights>, kLinearSlots>> layers_;
  int64_t n_splits_ = 0;
  int64_t max_in_ = 1, max_out_ = 1;  // over the split linears: the staging's widths
  KernelBounds cpu_bounds_;           // the CPU shares' linears (rows set by reserve)
  SplitLinearScratch scratch_;
};

}  // namespace strata
