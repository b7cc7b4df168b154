// The transformer, written once against the backend for both families: the embeddings, one
// layer and the head, each for one GPU batch. What differs between families is read from
// the config's Architecture. It knows nothing of blocks, prefetching or where a layer's
// weights came from: the block executor (block_executor.h) hands it each layer's weights and
// each GPU batch's state.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/backend.h"
#include "kernels/moe_route.h"
#include "worker/config.h"
#include "worker/expert_store.h"
#include "worker/kv_attention.h"
#include "worker/kv_cache.h"
#include "worker/weights.h"

namespace strata {

// The work of one forward step: rows (one per new token) of several sequences, packed
// without padding, and which rows need logits.
struct StepBatch {
  std::vector<int32_t> tokens;     // one per row
  std::vector<int32_t> positions;  // one per row
  std::vector<SeqSlice> seqs;
  std::vector<int32_t> logit_rows;  // rows whose next-token logits are wanted, in output order

  void clear();
  int32_t rows() const { return static_cast<int32_t>(tokens.size()); }
  // Appends `n` tokens of the sequence in `slot` that already has `n_past` cached; if
  // `want_logits`, its last row's logits are requested. Returns the slice index.
  size_t add(int32_t slot, int32_t n_past, std::span<const int32_t> new_tokens, bool want_logits);
};

// One GPU batch's state across the layers of a block (FlexGen keeps each GPU batch's
// activations between layers): its residual stream and its step ids — token ids, positions
// and the row table every layer's kv_store and attention read — uploaded together once per
// step. Sized for the stage's max rows when the executor is built.
struct BatchState {
  DeviceBuffer x;  // [max_rows, wide] residual stream
  // This step's tokens [rows], positions [rows], RowEntry [rows] and rope rows [rows] (the
  // rotary table's row of each: its position, or past the short table for longrope's long
  // factors), packed.
  DeviceBuffer ids;
  std::vector<int32_t> host_ids;  // the same on the host, filled before the upload
  int32_t max_rows = 0;
  int32_t rows = 0;    // this step's
  StepRows step_rows;  // this step's slices and its row table on the device
  // A sliding-window cache's: the slices as rows of the held window, and the step's slides
  // (reserved for max_rows sequences).
  std::vector<SeqSlice> held;
  std::vector<KvSlide> slides;

  const int32_t* tokens() const { return static_cast<const int32_t*>(ids.data()); }
  const int32_t* positions() const { return tokens() + rows; }
  const int32_t* rope_rows() const {
    return reinterpret_cast<const int32_t*>(reinterpret_cast<const RowEntry*>(positions() + rows) +
                                            rows);
  }
  static size_t ids_bytes(int32_t rows) {
    return static_cast<size_t>(rows) * (3 * sizeof(int32_t) + sizeof(RowEntry));
  }
};

class BlockReduce;       // worker/tensor_parallel.h
class SplitLinearTable;  // worker/split_linear.h
enum class LinearSlot : uint8_t;

class Transformer {
 public:
  // `fixed` (the embeddings and the head, where the model has them) outlives the
  // transformer. Step workspaces for `max_rows` rows are allocated here, once.
  Transformer(const ModelConfig& config, const ModelWeights& fixed, Backend& backend,
              int32_t max_rows, bool device_compute);

  const ModelConfig& config() const { return config_; }
  const Architecture& architecture() const { return arch_; }
  int32_t max_rows() const { return max_rows_; }
  KvAttention& attention() { return attention_; }
  const KvAttention& attention() const { return attention_; }

  // A tensor-parallel shard (its config is config.h's tensor_parallel_shard): the partial
  // output of every attention and MLP block is summed over the group by `reduce` before it
  // joins the residual stream. nullptr: the whole layer is here.
  void set_block_reduce(BlockReduce* reduce) { reduce_ = reduce; }
  // HeteGen: the layer linears `splits` holds run split between this transformer's backend
  // (its gpu()) and a CPU backend (split_linear.h); the others, and all of them when
  // nullptr, run on the backend. It outlives the transformer's steps.
  void set_split_linears(SplitLinearTable* splits);
  // A MoE model: where the experts a layer's weights do not hold live (nullptr: every
  // expert is in its layer), and where the router's picks are counted (may be null). Both
  // outlive the transformer's steps.
  void set_experts(ExpertSource* source, ExpertPopularity* popularity) {
    expert_source_ = source;
    popularity_ = popularity;
  }
  const ExpertRouting& last_routing() const { return routing_; }

  // A GPU batch's state of this transformer's size.
  BatchState make_batch_state() const;
  // Uploads the state's token ids, positions and row table for `batch` (checked against
  // `cache`) in one copy: once per step, before the layers.
  void upload_batch(const StepBatch& batch, const KvCache& cache, BatchState& s) const;
  // Token (and learned position) embeddings of the batch into s.x.
  void embed(const StepBatch& batch, BatchState& s);
  // Layer `i` (its weights `L`) on the batch's residual stream s.x.
  void layer(const LayerWeights& L, int32_t i, BatchState& s, int32_t rows, KvCache& cache);
  // Final norm and LM head on the batch's logit rows, into host memory `logits`
  // [logit_rows, vocab].
  void head(const StepBatch& batch, const BatchState& s, float* logits);

  // The largest calls this transformer makes with these layer weights (any layer: all share
  // shapes and dtypes) over a cache of `capacity` positions, for Backend::reserve.
  KernelBounds kernel_bounds(const LayerWeights& example, int32_t capacity) const;
  // The step workspaces, rotary tables and attention workspaces.
  TierBytes memory() const;

 private:
  void norm(const Tensor& w, const Tensor& b, const float* x, int32_t rows, float* y);
  void fill_rope_rows(const StepBatch& batch, int32_t* out) const;
  std::span<const SeqSlice> held_slices(const StepBatch& batch, const KvCache& cache,
                                        BatchState& s) const;
  // What an attention or MLP block's first linears read: x, and in a pre-norm layer the
  // norm still to apply to it (norm_weight set), which the backend may fold into them.
  struct BlockInput {
    const float* x = nullptr;
    const Tensor* norm_weight = nullptr;
    const Tensor* norm_bias = nullptr;
  };
  // One of a block's first linears: y = in w^T + bias, `width` outputs a row (w may be a
  // HeteGen split's device share, narrower than that).
  struct BlockLinear {
    LinearSlot slot;
    const Tensor* w;
    const Tensor* bias;
    float* y;
    int64_t width;
  };
  BlockInput block_input(const Tensor& norm_w, const Tensor& norm_b, const float* x, int32_t rows);
  void attention_block(const LayerWeights& L, int32_t i, BatchState& s, int32_t rows,
                       KvCache& cache, const BlockInput& in);
  void mlp_block(const LayerWeights& L, int32_t i, int32_t rows, const BlockInput& in);
  // A MoE layer's MLP: x += sum over each row's experts of weight * expert(norm(x)), plus
  // Qwen2-MoE's gated shared expert.
  void moe_block(const LayerWeights& L, int32_t i, int32_t rows, const BlockInput& in, float* x);
  // Routes the normed rows `xin` and hands the grouping to the device (moe_rows_, moe_weights_).
  void route(const LayerWeights& L, int32_t i, const float* xin, int32_t rows);
  // One expert's rows of xin through it, added into `acc` with their weights.
  void run_expert(const ExpertWeights& W, int32_t e, const float* xin, float* acc);
  // The shared expert over every row, scaled by sigmoid(x . gate), added into `acc`.
  void shared_expert(const LayerWeights& L, int32_t i, const float* xin, int32_t rows, float* acc);
  // n 4-byte values (int32 or f32) of host memory where the backend reads them: the host's
  // own on a host backend, else copied into moe_ids_ at element `at`.
  template <class T>
  const T* on_backend(const T* host, size_t n, size_t at);
  // The block's first linears over `in`, each y = relu(...) where `relu`.
  void block_linears(int32_t i, BlockInput in, int32_t rows, std::span<const BlockLinear> ls,
                     bool relu);
  // Layer i's linear in `slot`: split where splits_ has it, else the backend's.
  void linear(int32_t i, LinearSlot slot, const float* x, int32_t rows, const Tensor& w,
              const Tensor& bias, float* y);
  // x += post_norm(in w^T + bias) (the output or down projection, Gemma-2's norm of it where
  // post_norm is there, then the residual add).
  void add_projection(int32_t i, LinearSlot slot, const float* in, int32_t rows, const Tensor& w,
                      const Tensor& bias, const Tensor& post_norm, float* x);
  bool split(int32_t i, LinearSlot slot) const;  // layer i's `slot` is a HeteGen split
  void head_chunk(std::span<const int32_t> rows, int32_t batch_rows, const BatchState& s,
                  float* logits);
  void build_rope_tables();

  ModelConfig config_;
  Architecture arch_;
  const ModelWeights& fixed_;
  Backend& backend_;
  int32_t max_rows_;
  bool device_compute_;
  KvAttention attention_;
  // One layer's temporaries, shared by the GPU batches (each runs its layer to the end).
  DeviceBuffer h_, q_, k_, v_, attn_, f1_, f2_, sel_, logits_;
  DeviceBuffer rope_cos_, rope_sin_;
  RopeTables rope_;
  // Learned positions from the table row of position 0 on (OPT stores them at an offset).
  Tensor positions_;
  BlockReduce* reduce_ = nullptr;
  SplitLinearTable* splits_ = nullptr;
  // MoE: router logits, an expert's gathered rows and its output, and the step's grouping as
  // the device reads it (rows and weights of every entry, then the shared expert's).
  DeviceBuffer route_, moe_in_, moe_out_, moe_ids_;
  std::vector<float> host_route_;
  std::vector<int32_t> identity_rows_;
  std::vector<float> shared_weights_;
  const int32_t* moe_rows_ = nullptr;
  const float* moe_weights_ = nullptr;
  std::vector<int32_t> disk_experts_;
  ExpertRouting routing_;
  ExpertSource* expert_source_ = nullptr;
  ExpertPopularity* popularity_ = nullptr;
};

}  // namespace strata
