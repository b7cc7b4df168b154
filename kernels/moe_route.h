// Mixture-of-experts routing (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): each row's experts and
// weights from its router logits, then the rows grouped by expert, so that an expert
// multiplies all of its rows of a step as one GEMM (a batch of 32 at top-2 of 8 gives each
// expert about 8 rows instead of 32 matrix-vector products; the grouping llama.cpp's
// mul_mat_id and MoE-Lightning's CPU-GPU pipeline both start from).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace strata {

// A step's routing, grouped by expert: expert e's entries are [offsets[e], offsets[e + 1]) of
// rows / weights, its rows ascending.
struct ExpertRouting {
  int32_t n_experts = 0;
  int32_t top_k = 0;
  std::vector<int32_t> offsets;  // n_experts + 1
  std::vector<int32_t> rows;     // rows x top_k entries
  std::vector<float> weights;    // the router's weight of each entry
  // route_top_k's scratch, kept so a step's routing allocates nothing once warm.
  std::vector<int32_t> picked, next;
  std::vector<float> picked_weights, probabilities;

  int32_t rows_of(int32_t e) const {
    return offsets[static_cast<size_t>(e) + 1] - offsets[static_cast<size_t>(e)];
  }
  int32_t begin(int32_t e) const { return offsets[static_cast<size_t>(e)]; }
  int32_t active_experts() const;  // experts with at least one row
  std::string str() const;
};

// Routes rows x n_experts logits as Hugging Face's modelling code does: softmax over all the
// experts in f32, the top_k most probable (ties to the lower index, as torch.topk keeps
// them), their probabilities divided by their sum when `renormalise` (norm_topk_prob;
// Mixtral's softmax over the selected logits is the same thing). Fills `out`, reusing its
// storage. Non-finite logits give a row of weight 0 on the first experts instead of throwing
// mid-step (the next layer then sees the row as the residual alone).
void route_top_k(const float* logits, int64_t rows, int32_t n_experts, int32_t top_k,
                 bool renormalise, ExpertRouting& out);

}  // namespace strata
