// Test support: a CPU backend that takes the fused calls an accelerator backend takes for
// decode rows (Backend::linear_then; with `sets` also Backend::linears with its norm and ReLU
// for every shape, and Backend::store_and_attend where every sequence has one new row, as
// the CUDA backend), computing them with the CPU's own ops. The transformer's folded paths
// then run on any machine, and the counts say which ones it took.
#pragma once

#include <algorithm>
#include <span>
#include <string>
#include <vector>

#include "support/forwarding_backend.h"

namespace strata::testing {

class FoldingBackend final : public ForwardingBackend {
 public:
  FoldingBackend(CpuBackend& inner, bool sets) : ForwardingBackend(inner), sets_(sets) {}
  std::string name() const override { return "cpu folding linear_then / linears"; }

  bool linear_then(const float* x, int64_t m, const Tensor& w, const float* bias, LinearThen then,
                   float* y) override {
    const int64_t n = m * w.shape[0];
    std::vector<float> out(static_cast<size_t>(n));
    inner_.linear(x, m, w, bias, out.data());
    if (then == LinearThen::kRelu) {
      inner_.relu(out.data(), n);
      std::copy(out.begin(), out.end(), y);
      ++relu_calls;
    } else {
      inner_.add(y, out.data(), n);
      ++accumulate_calls;
    }
    return true;
  }

  // The norm into a buffer of its own, then each linear into its own, last first, then copied
  // out: an output that aliased another's or x would show, and so would a written norm(x).
  bool linears(const float* x, int64_t m, std::span<const LinearOut> outs,
               const LinearsFold& fold) override {
    if (!sets_) return false;
    const int64_t k = outs[0].w->shape[1];
    std::vector<float> in(x, x + m * k);
    if (fold.norm != nullptr) {
      const NormSpec& n = *fold.norm;
      if (n.layer) {
        inner_.layer_norm(x, m, k, n.weight, n.bias, n.eps, in.data());
      } else {
        inner_.rms_norm(x, m, k, n.weight, n.eps, in.data());
      }
      ++norm_folds;
    }
    std::vector<std::vector<float>> ys(outs.size());
    for (size_t i = outs.size(); i-- > 0;) {
      ys[i].resize(static_cast<size_t>(m * outs[i].w->shape[0]));
      inner_.linear(in.data(), m, *outs[i].w, outs[i].bias, ys[i].data());
      if (fold.relu) inner_.relu(ys[i].data(), static_cast<int64_t>(ys[i].size()));
    }
    for (size_t i = 0; i < outs.size(); ++i) std::copy(ys[i].begin(), ys[i].end(), outs[i].y);
    ++linears_calls;
    return true;
  }

  bool store_and_attend(const float* q, const float* k, const float* v, const StepRows& rows,
                        const KvLayerView& cache, const AttentionDims& dims, float* out) override {
    if (!sets_) return false;
    for (const SeqSlice& s : rows.seqs)
      if (s.n_new != 1) return false;
    inner_.kv_store(k, v, rows, cache);
    inner_.attention(q, rows, cache, dims, out);
    ++attend_folds;
    return true;
  }

  int relu_calls = 0;
  int attend_folds = 0;
  int accumulate_calls = 0;
  int linears_calls = 0;
  int norm_folds = 0;

 private:
  bool sets_;
};

}  // namespace strata::testing
