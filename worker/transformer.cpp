#include "worker/transformer.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "kernels/error.h"
#include "placement/stage_placement.h"
#include "worker/split_linear.h"
#include "worker/tensor_parallel.h"

namespace strata {

void StepBatch::clear() {
  tokens.clear();
  positions.clear();
  seqs.clear();
  logit_rows.clear();
}

size_t StepBatch::add(int32_t slot, int32_t n_past, std::span<const int32_t> new_tokens,
                      bool want_logits) {
  SeqSlice s;
  s.row_begin = rows();
  s.n_new = static_cast<int32_t>(new_tokens.size());
  s.n_past = n_past;
  s.slot = slot;
  for (int32_t i = 0; i < s.n_new; ++i) {
    tokens.push_back(new_tokens[static_cast<size_t>(i)]);
    positions.push_back(n_past + i);
  }
  if (want_logits && s.n_new > 0) logit_rows.push_back(s.row_begin + s.n_new - 1);
  seqs.push_back(s);
  return seqs.size() - 1;
}

namespace {

// The widest row a step buffer holds: the residual stream, a query, or OPT's narrower or
// wider token embedding before project_in.
size_t wide_width(const ModelConfig& c) {
  return static_cast<size_t>(std::max({c.hidden, c.q_width(), c.architecture().embed_dim}));
}

const float* bias_of(const Tensor& bias) {
  return bias.data != nullptr ? bias.f32() : nullptr;
}

}  // namespace

Transformer::Transformer(const ModelConfig& config, const ModelWeights& fixed, Backend& backend,
                         int32_t max_rows, bool device_compute)
    : config_(config),
      arch_(config.architecture()),
      fixed_(fixed),
      backend_(backend),
      max_rows_(max_rows),
      device_compute_(device_compute),
      attention_(config, backend, max_rows, device_compute) {
  STRATA_CHECK(max_rows > 0, "max_rows {}", max_rows);
  with_oom_context(fmt::format("allocating the activations of {} rows", max_rows), [&] {
    const auto rows = static_cast<size_t>(max_rows);
    auto buf = [&](size_t width) { return DeviceBuffer(backend, rows * width * sizeof(float)); };
    h_ = buf(wide_width(config));
    sel_ = buf(wide_width(config));
    q_ = buf(static_cast<size_t>(config.q_width()));
    attn_ = buf(static_cast<size_t>(config.q_width()));
    k_ = buf(static_cast<size_t>(config.kv_width()));
    v_ = buf(static_cast<size_t>(config.kv_width()));
    const auto mlp = static_cast<size_t>(std::max(config.intermediate, config.expert_intermediate));
    f1_ = buf(mlp);
    f2_ = buf(mlp);
    if (config.moe()) {
      const auto k = static_cast<size_t>(config.experts_per_token);
      route_ = buf(static_cast<size_t>(config.n_experts));
      moe_in_ = buf(static_cast<size_t>(config.hidden));
      moe_out_ = buf(static_cast<size_t>(config.hidden));
      moe_ids_ = buf(2 * k + 2);  // each entry's row and weight, the shared expert's
      host_route_.resize(rows * static_cast<size_t>(config.n_experts));
      identity_rows_.resize(rows);
      for (size_t r = 0; r < rows; ++r) identity_rows_[r] = static_cast<int32_t>(r);
      shared_weights_.assign(rows, 1.0f);
    }
    if (fixed.lm_head.data != nullptr)  // a pipeline stage without the head has no logits
      logits_ = DeviceBuffer(backend, static_cast<size_t>(std::min(max_rows, kLogitChunk)) *
                                          static_cast<size_t>(config.vocab) * sizeof(float));
  });
  if (arch_.rotary())
    with_oom_context(
        fmt::format("building the rotary tables of {} positions", config.max_positions),
        [&] { build_rope_tables(); });
  if (arch_.learned_positions() && fixed.positions.data != nullptr) {
    positions_ = fixed.positions;
    positions_.data = static_cast<char*>(fixed.positions.data) +
                      static_cast<size_t>(arch_.position_offset) *
                          static_cast<size_t>(fixed.positions.shape[1]) *
                          dtype_size(fixed.positions.dtype);
    positions_.shape =
        Shape{fixed.positions.shape[0] - arch_.position_offset, fixed.positions.shape[1]};
  }
}

namespace {

// RoPE's inverse frequencies, adjusted by the config's scaling; longrope divides them by one
// of its factor lists (`longrope`, chosen by the caller).
std::vector<float> rope_inv_freq(const ModelConfig& c, const std::vector<float>* longrope) {
  const int32_t half = c.head_dim / 2;
  std::vector<float> inv_freq(static_cast<size_t>(half));
  for (int32_t j = 0; j < half; ++j) {
    float f =
        1.0f / std::pow(c.rope_theta, static_cast<float>(2 * j) / static_cast<float>(c.head_dim));
    if (longrope != nullptr) {
      f /= (*longrope)[static_cast<size_t>(j)];
    } else if (c.rope_scaling_type == "linear") {
      f /= c.rope_factor;
    } else if (c.rope_scaling_type == "llama3") {
      const float old_ctx = static_cast<float>(c.rope_original_max_positions);
      const float low_wavelen = old_ctx / c.rope_low_freq_factor;
      const float high_wavelen = old_ctx / c.rope_high_freq_factor;
      const float wavelen = 2.0f * static_cast<float>(M_PI) / f;
      if (wavelen > low_wavelen) {
        f /= c.rope_factor;
      } else if (wavelen >= high_wavelen) {
        const float smooth = (old_ctx / wavelen - c.rope_low_freq_factor) /
                             (c.rope_high_freq_factor - c.rope_low_freq_factor);
        f = (1.0f - smooth) * f / c.rope_factor + smooth * f;
      }
    }
    inv_freq[static_cast<size_t>(j)] = f;
  }
  return inv_freq;
}

}  // namespace

// cos/sin of position * inv_freq, in f32 like the reference implementations, times
// longrope's attention factor (1 otherwise). longrope has two tables, one after the other:
// the short factors' and the long ones' (fill_rope_rows picks the row). A sequence that grows
// past the original context during decoding keeps the keys it cached with the short factors;
// Hugging Face recomputes its whole cache with the long ones at that step.
void Transformer::build_rope_tables() {
  const int32_t half = config_.head_dim / 2;
  const bool longrope = config_.rope_scaling_type == "longrope";
  const int32_t n_pos = config_.max_positions * (longrope ? 2 : 1);
  const std::vector<float> inv_freq =
      rope_inv_freq(config_, longrope ? &config_.rope_short_factor : nullptr);
  const std::vector<float> long_inv_freq =
      longrope ? rope_inv_freq(config_, &config_.rope_long_factor) : inv_freq;
  const float factor = config_.rope_attention_factor;
  std::vector<float> cos_t(static_cast<size_t>(n_pos) * half), sin_t(cos_t.size());
  for (int32_t p = 0; p < n_pos; ++p) {
    const bool second = p >= config_.max_positions;
    const std::vector<float>& f = second ? long_inv_freq : inv_freq;
    const float position = static_cast<float>(second ? p - config_.max_positions : p);
    for (int32_t j = 0; j < half; ++j) {
      const float angle = position * f[static_cast<size_t>(j)];
      cos_t[static_cast<size_t>(p) * half + j] = std::cos(angle) * factor;
      sin_t[static_cast<size_t>(p) * half + j] = std::sin(angle) * factor;
    }
  }
  rope_cos_ = DeviceBuffer(backend_, cos_t.size() * sizeof(float));
  rope_sin_ = DeviceBuffer(backend_, sin_t.size() * sizeof(float));
  backend_.copy(rope_cos_.data(), cos_t.data(), cos_t.size() * sizeof(float),
                CopyKind::kHostToDevice);
  backend_.copy(rope_sin_.data(), sin_t.data(), sin_t.size() * sizeof(float),
                CopyKind::kHostToDevice);
  rope_ = {rope_cos_.f32(), rope_sin_.f32(), n_pos, half};
}

BatchState Transformer::make_batch_state() const {
  BatchState s;
  s.max_rows = max_rows_;
  s.x =
      DeviceBuffer(backend_, static_cast<size_t>(max_rows_) * wide_width(config_) * sizeof(float));
  s.ids = DeviceBuffer(backend_, BatchState::ids_bytes(max_rows_));
  s.host_ids.resize(BatchState::ids_bytes(max_rows_) / sizeof(int32_t));  // RowEntry: 3 int32
  s.held.reserve(static_cast<size_t>(max_rows_));
  s.slides.reserve(static_cast<size_t>(max_rows_));
  return s;
}

// A sliding-window cache: each slice as the rows its slot holds (positions from
// first_held), and the slides that make room for the step's new rows.
std::span<const SeqSlice> Transformer::held_slices(const StepBatch& batch, const KvCache& cache,
                                                   BatchState& s) const {
  const KvWindow& w = cache.window();
  s.slides.clear();
  if (!w.active()) return batch.seqs;
  s.held.clear();
  for (const SeqSlice& seq : batch.seqs) {
    STRATA_CHECK(seq.n_past + seq.n_new <= cache.positions(),
                 "kv cache overflow: {} + {} > context {}", seq.n_past, seq.n_new,
                 cache.positions());
    const int32_t before = w.first_held(seq.n_past);
    const int32_t after = w.first_held(seq.n_past + seq.n_new);
    SeqSlice held = seq;
    held.n_past = seq.n_past - after;
    s.held.push_back(held);
    if (after > before && held.n_past > 0)
      s.slides.push_back(KvSlide{seq.slot, after - before, held.n_past});
  }
  return s.held;
}

void Transformer::upload_batch(const StepBatch& batch, const KvCache& cache, BatchState& s) const {
  const int32_t rows = batch.rows();
  STRATA_CHECK(rows > 0 && rows <= s.max_rows, "GPU batch of {} rows (max {})", rows, s.max_rows);
  const auto n = static_cast<size_t>(rows);
  int32_t* host = s.host_ids.data();
  std::memcpy(host, batch.tokens.data(), n * sizeof(int32_t));
  std::memcpy(host + n, batch.positions.data(), n * sizeof(int32_t));
  auto* table = reinterpret_cast<RowEntry*>(host + 2 * n);
  const std::span<const SeqSlice> held = held_slices(batch, cache, s);
  const int64_t n_rows = fill_row_table(held, cache.n_slots(), cache.capacity(), table, rows);
  fill_rope_rows(batch, reinterpret_cast<int32_t*>(table + rows));
  s.rows = rows;
  backend_.copy(s.ids.data(), host, BatchState::ids_bytes(rows), CopyKind::kHostToDevice);
  s.step_rows = StepRows(held);
  s.step_rows.table = reinterpret_cast<const RowEntry*>(s.positions() + rows);
  s.step_rows.n_rows = n_rows;
  s.step_rows.slides = s.slides;
}

// Each row's rotary table row. longrope: a sequence whose length passes the original context
// rotates every position by the long factors (the table's second half), as Hugging Face
// picks the factors by the sequence's length; otherwise each row's position.
void Transformer::fill_rope_rows(const StepBatch& batch, int32_t* out) const {
  const bool longrope = config_.rope_scaling_type == "longrope";
  for (const SeqSlice& seq : batch.seqs) {
    const bool long_factors =
        longrope && seq.n_past + seq.n_new > config_.rope_original_max_positions;
    for (int32_t i = 0; i < seq.n_new; ++i)
      out[seq.row_begin + i] = seq.n_past + i + (long_factors ? config_.max_positions : 0);
  }
}

void Transformer::norm(const Tensor& w, const Tensor& b, const float* x, int32_t rows, float* y) {
  if (arch_.norm == NormKind::kLayer) {
    backend_.layer_norm(x, rows, config_.hidden, w.f32(), b.f32(), config_.norm_eps, y);
  } else {
    backend_.rms_norm(x, rows, config_.hidden, w.f32(), config_.norm_eps, y);
  }
}

void Transformer::embed(const StepBatch& batch, BatchState& s) {
  const int32_t rows = batch.rows();
  const ModelWeights& w = fixed_;
  if (w.project_in.data != nullptr) {
    backend_.embedding(s.tokens(), rows, w.embed, h_.f32());
    backend_.linear(h_.f32(), rows, w.project_in, nullptr, s.x.f32());
  } else {
    backend_.embedding(s.tokens(), rows, w.embed, s.x.f32());
  }
  if (arch_.learned_positions()) {
    backend_.embedding(s.positions(), rows, positions_, h_.f32());
    backend_.add(s.x.f32(), h_.f32(), static_cast<int64_t>(rows) * config_.hidden);
  }
  if (arch_.embed_scale != 1.0f)
    backend_.scale(s.x.f32(), static_cast<int64_t>(rows) * config_.hidden, arch_.embed_scale);
}

void Transformer::layer(const LayerWeights& L, int32_t i, BatchState& s, int32_t rows,
                        KvCache& cache) {
  const bool pre_norm = arch_.pre_norm;
  float* x = s.x.f32();
  attention_block(L, i, s, rows, cache, block_input(L.attn_norm, L.attn_norm_bias, x, rows));
  add_projection(i, LinearSlot::kO, attn_.f32(), rows, L.o, L.o_bias, L.post_attn_norm, x);
  if (!pre_norm) norm(L.attn_norm, L.attn_norm_bias, x, rows, x);
  if (arch_.moe) {  // every MoE family is pre-norm
    moe_block(L, i, rows, block_input(L.mlp_norm, L.mlp_norm_bias, x, rows), x);
    return;
  }
  mlp_block(L, i, rows, block_input(L.mlp_norm, L.mlp_norm_bias, x, rows));  // -> f1_
  add_projection(i, LinearSlot::kDown, f1_.f32(), rows, L.down, L.down_bias, L.post_mlp_norm, x);
  if (!pre_norm) norm(L.mlp_norm, L.mlp_norm_bias, x, rows, x);
}

// Pre-norm: x with its norm still to apply. Post-norm: a copy of x in h_, since the block's
// residual add changes x while the block may still read its input.
Transformer::BlockInput Transformer::block_input(const Tensor& norm_w, const Tensor& norm_b,
                                                 const float* x, int32_t rows) {
  if (arch_.pre_norm) return BlockInput{x, &norm_w, &norm_b};
  const size_t bytes = static_cast<size_t>(rows) * static_cast<size_t>(config_.hidden) * 4;
  backend_.copy(h_.data(), x, bytes, CopyKind::kDeviceToDevice);
  return BlockInput{h_.f32()};
}

void Transformer::attention_block(const LayerWeights& L, int32_t i, BatchState& s, int32_t rows,
                                  KvCache& cache, const BlockInput& in) {
  const int64_t kv_width = static_cast<int64_t>(config_.n_kv_heads) * config_.head_dim;
  const BlockLinear qkv[] = {{LinearSlot::kQ, &L.q, &L.q_bias, q_.f32(), config_.q_width()},
                             {LinearSlot::kK, &L.k, &L.k_bias, k_.f32(), kv_width},
                             {LinearSlot::kV, &L.v, &L.v_bias, v_.f32(), kv_width}};
  block_linears(i, in, rows, qkv, false);
  if (arch_.qk_norm_whole) {  // OLMoE: q and k RMS-normalised over the whole projection
    backend_.rms_norm(q_.f32(), rows, config_.q_width(), L.q_norm.f32(), config_.norm_eps,
                      q_.f32());
    backend_.rms_norm(k_.f32(), rows, config_.kv_width(), L.k_norm.f32(), config_.norm_eps,
                      k_.f32());
  }
  if (arch_.qk_norm) {  // Qwen3: each head's q and k RMS-normalised over head_dim
    backend_.rms_norm(q_.f32(), int64_t{rows} * config_.n_heads, config_.head_dim, L.q_norm.f32(),
                      config_.norm_eps, q_.f32());
    backend_.rms_norm(k_.f32(), int64_t{rows} * config_.n_kv_heads, config_.head_dim,
                      L.k_norm.f32(), config_.norm_eps, k_.f32());
  }
  if (arch_.rotary()) {
    backend_.rope(q_.f32(), rows, config_.n_heads, config_.head_dim, s.rope_rows(), rope_);
    backend_.rope(k_.f32(), rows, config_.n_kv_heads, config_.head_dim, s.rope_rows(), rope_);
  }
  attention_.run(i, q_.f32(), k_.f32(), v_.f32(), s.step_rows, rows, cache, attn_.f32());
}

// x += post_norm(in w^T + bias): the output or down projection and the residual add, with
// Gemma-2's norm of the block's output between (`post_norm` rank 0 where the family has
// none). One kernel where the backend folds the add into the linear, but not where a
// tensor-parallel reduce, a HeteGen split or the norm needs the projection on its own first.
void Transformer::add_projection(int32_t i, LinearSlot slot, const float* in, int32_t rows,
                                 const Tensor& w, const Tensor& bias, const Tensor& post_norm,
                                 float* x) {
  const int64_t n = static_cast<int64_t>(rows) * config_.hidden;
  const bool normed = post_norm.data != nullptr;
  if (reduce_ == nullptr && !split(i, slot) && !normed &&
      backend_.linear_then(in, rows, w, bias_of(bias), LinearThen::kAccumulate, x))
    return;
  linear(i, slot, in, rows, w, bias, h_.f32());
  if (reduce_ != nullptr) reduce_->sum(h_.f32(), n);
  if (normed)
    backend_.rms_norm(h_.f32(), rows, config_.hidden, post_norm.f32(), config_.norm_eps, h_.f32());
  backend_.add(x, h_.f32(), n);
}

void Transformer::mlp_block(const LayerWeights& L, int32_t i, int32_t rows, const BlockInput& in) {
  if (arch_.gated_mlp()) {
    const BlockLinear gate_up[] = {
        {LinearSlot::kGate, &L.gate, &L.gate_bias, f1_.f32(), config_.intermediate},
        {LinearSlot::kUp, &L.up, &L.up_bias, f2_.f32(), config_.intermediate}};
    block_linears(i, in, rows, gate_up, false);
    const int64_t n = static_cast<int64_t>(rows) * config_.intermediate;
    if (arch_.mlp == MlpKind::kGatedGeluTanh) {
      backend_.gelu_tanh_mul(f1_.f32(), f2_.f32(), f1_.f32(), n);
    } else {
      backend_.silu_mul(f1_.f32(), f2_.f32(), f1_.f32(), n);
    }
  } else {
    const BlockLinear up[] = {
        {LinearSlot::kUp, &L.up, &L.up_bias, f1_.f32(), config_.intermediate}};
    block_linears(i, in, rows, up, true);
  }
}

template <class T>
const T* Transformer::on_backend(const T* host, size_t n, size_t at) {
  static_assert(sizeof(T) == sizeof(float), "moe_ids_ holds 4-byte elements");
  if (backend_.device() == Device::kHost) return host;
  T* d = static_cast<T*>(moe_ids_.data()) + at;
  backend_.copy(d, host, n * sizeof(T), CopyKind::kHostToDevice);
  return d;
}

// The router's logits come to the host (rows x n_experts floats: small beside the layer),
// where the top-k and the grouping by expert are decided: which experts run, and so which
// disk experts are read, is a host decision anyway.
void Transformer::route(const LayerWeights& L, int32_t i, const float* xin, int32_t rows) {
  const size_t logits = static_cast<size_t>(rows) * static_cast<size_t>(config_.n_experts);
  backend_.linear(xin, rows, L.router, nullptr, route_.f32());
  const float* host = route_.f32();
  if (backend_.device() != Device::kHost) {
    backend_.copy(host_route_.data(), route_.data(), logits * sizeof(float),
                  CopyKind::kDeviceToHost);
    host = host_route_.data();
  }
  route_top_k(host, rows, config_.n_experts, config_.experts_per_token, config_.norm_topk_prob,
              routing_);
  if (popularity_ != nullptr) popularity_->record(i, routing_);
  const size_t entries = routing_.rows.size();
  const size_t max_entries =
      static_cast<size_t>(max_rows_) * static_cast<size_t>(config_.experts_per_token);
  moe_rows_ = on_backend(routing_.rows.data(), entries, 0);
  moe_weights_ = on_backend(routing_.weights.data(), entries, max_entries);
}

// The expert's rows gathered into one matrix, so that gate and up are one GEMM each over
// them (or one call for both where the backend has it), then down, then each row's share
// added back with its weight.
void Transformer::run_expert(const ExpertWeights& W, int32_t e, const float* xin, float* acc) {
  const int32_t m = routing_.rows_of(e), b = routing_.begin(e);
  const int64_t f = W.gate.shape[0];
  const int64_t h = config_.hidden;
  backend_.gather_rows(xin, h, moe_rows_ + b, m, moe_in_.f32());
  const LinearOut gate_up[] = {{&W.gate, nullptr, f1_.f32()}, {&W.up, nullptr, f2_.f32()}};
  if (!backend_.linears(moe_in_.f32(), m, gate_up, LinearsFold{})) {
    backend_.linear(moe_in_.f32(), m, W.gate, nullptr, f1_.f32());
    backend_.linear(moe_in_.f32(), m, W.up, nullptr, f2_.f32());
  }
  backend_.silu_mul(f1_.f32(), f2_.f32(), f1_.f32(), int64_t{m} * f);
  backend_.linear(f1_.f32(), m, W.down, nullptr, moe_out_.f32());
  backend_.scatter_add_rows(moe_out_.f32(), h, moe_rows_ + b, moe_weights_ + b, m, acc);
}

// Qwen2-MoE's shared expert: a dense SwiGLU over every row (a HeteGen split where it has
// one), its output times sigmoid(x . shared_expert_gate).
void Transformer::shared_expert(const LayerWeights& L, int32_t i, const float* xin, int32_t rows,
                                float* acc) {
  const BlockLinear gate_up[] = {
      {LinearSlot::kGate, &L.gate, &L.gate_bias, f1_.f32(), config_.intermediate},
      {LinearSlot::kUp, &L.up, &L.up_bias, f2_.f32(), config_.intermediate}};
  block_linears(i, BlockInput{xin}, rows, gate_up, false);
  backend_.silu_mul(f1_.f32(), f2_.f32(), f1_.f32(), int64_t{rows} * config_.intermediate);
  linear(i, LinearSlot::kDown, f1_.f32(), rows, L.down, L.down_bias, moe_out_.f32());
  const auto n = static_cast<size_t>(rows);
  if (L.shared_expert_gate.data != nullptr) {
    backend_.linear(xin, rows, L.shared_expert_gate, nullptr, route_.f32());
    backend_.copy(shared_weights_.data(), route_.data(), n * sizeof(float),
                  CopyKind::kDeviceToHost);
    for (size_t r = 0; r < n; ++r)
      shared_weights_[r] = 1.0f / (1.0f + std::exp(-shared_weights_[r]));
  }
  const size_t k = static_cast<size_t>(config_.experts_per_token);
  const size_t at = 2 * static_cast<size_t>(max_rows_) * k;
  const int32_t* ids = on_backend(identity_rows_.data(), n, at);
  const float* weights = on_backend(shared_weights_.data(), n, at + static_cast<size_t>(max_rows_));
  backend_.scatter_add_rows(moe_out_.f32(), config_.hidden, ids, weights, rows, acc);
}

// The resident experts run while the disk experts the step needs are read (in the order the
// store gives), then those, each released once computed so its slot can take the next read.
// A tensor-parallel shard's partial sums gather in h_ to be reduced once.
void Transformer::moe_block(const LayerWeights& L, int32_t i, int32_t rows, const BlockInput& in,
                            float* x) {
  const int64_t n = int64_t{rows} * config_.hidden;
  const float* xin = in.x;
  if (in.norm_weight != nullptr) {
    norm(*in.norm_weight, *in.norm_bias, in.x, rows, sel_.f32());
    xin = sel_.f32();
  }
  route(L, i, xin, rows);
  float* acc = x;
  if (reduce_ != nullptr) {
    acc = h_.f32();
    backend_.copy(acc, xin, static_cast<size_t>(n) * sizeof(float), CopyKind::kDeviceToDevice);
    backend_.scale(acc, n, 0.0f);
  }
  if (L.down.data != nullptr) shared_expert(L, i, xin, rows, acc);
  disk_experts_.clear();
  for (int32_t e = 0; e < config_.n_experts; ++e)
    if (routing_.rows_of(e) > 0 && L.experts[static_cast<size_t>(e)].gate.data == nullptr)
      disk_experts_.push_back(e);
  std::span<const int32_t> order;
  if (!disk_experts_.empty()) {
    STRATA_CHECK(expert_source_ != nullptr,
                 "layer {}: expert {} is neither in the layer nor on disk", i,
                 disk_experts_.front());
    order = expert_source_->request(i, disk_experts_);
  }
  for (int32_t e = 0; e < config_.n_experts; ++e) {
    const ExpertWeights& W = L.experts[static_cast<size_t>(e)];
    if (routing_.rows_of(e) > 0 && W.gate.data != nullptr) run_expert(W, e, xin, acc);
  }
  for (const int32_t e : order) {
    run_expert(expert_source_->wait(i, e), e, xin, acc);
    backend_.synchronize();  // the slot is read by the kernels until they are done
    expert_source_->release(i, e);
  }
  if (reduce_ != nullptr) {
    reduce_->sum(acc, n);
    backend_.add(x, acc, n);
  }
}

// In one backend call where it has a kernel for the set and none is a HeteGen split: with the
// norm folded in, or after it into h_. Otherwise one linear at a time, each ReLU folded into
// its linear where the backend can (linear_then).
void Transformer::block_linears(int32_t i, BlockInput in, int32_t rows,
                                std::span<const BlockLinear> ls, bool relu) {
  bool any_split = false;
  std::array<LinearOut, 3> outs{};
  STRATA_CHECK(ls.size() <= outs.size(), "{} linears over one input", ls.size());
  for (size_t j = 0; j < ls.size(); ++j) {
    any_split = any_split || split(i, ls[j].slot);
    outs[j] = LinearOut{ls[j].w, bias_of(*ls[j].bias), ls[j].y};
  }
  const std::span<const LinearOut> set(outs.data(), ls.size());
  if (in.norm_weight != nullptr) {
    const NormSpec spec{arch_.norm == NormKind::kLayer, in.norm_weight->f32(),
                        bias_of(*in.norm_bias), config_.norm_eps};
    if (!any_split && backend_.linears(in.x, rows, set, LinearsFold{&spec, relu})) return;
    norm(*in.norm_weight, *in.norm_bias, in.x, rows, h_.f32());
    in = BlockInput{h_.f32()};
  }
  if (!any_split && backend_.linears(in.x, rows, set, LinearsFold{nullptr, relu})) return;
  for (const BlockLinear& l : ls) {
    if (relu && !split(i, l.slot) &&
        backend_.linear_then(in.x, rows, *l.w, bias_of(*l.bias), LinearThen::kRelu, l.y))
      continue;
    linear(i, l.slot, in.x, rows, *l.w, *l.bias, l.y);
    if (relu) backend_.relu(l.y, static_cast<int64_t>(rows) * l.width);
  }
}

bool Transformer::split(int32_t i, LinearSlot slot) const {
  return splits_ != nullptr && splits_->find(i, slot) != nullptr;
}

void Transformer::set_split_linears(SplitLinearTable* splits) {
  STRATA_CHECK(splits == nullptr || &splits->gpu() == &backend_,
               "HeteGen splits built for backend {} given to a transformer on {}",
               splits ? splits->gpu().name() : "", backend_.name());
  splits_ = splits;
}

void Transformer::linear(int32_t i, LinearSlot slot, const float* x, int32_t rows, const Tensor& w,
                         const Tensor& bias, float* y) {
  if (splits_ != nullptr) {
    if (const SplitLinearWeights* split = splits_->find(i, slot)) {
      splits_->linear(*split, x, rows, y, w, bias);  // w, bias: a streamed split's device share
      return;
    }
  }
  backend_.linear(x, rows, w, bias_of(bias), y);
}

// Final norm and LM head on the requested rows only, kLogitChunk rows at a time so the
// logits buffer stays small even when every row of a long prompt wants logits.
void Transformer::head(const StepBatch& batch, const BatchState& s, float* logits) {
  const auto n = static_cast<int32_t>(batch.logit_rows.size());
  const int32_t chunk = std::min(max_rows_, kLogitChunk);
  for (int32_t c0 = 0; c0 < n; c0 += chunk) {
    const int32_t rows = std::min(chunk, n - c0);
    head_chunk(
        std::span(batch.logit_rows).subspan(static_cast<size_t>(c0), static_cast<size_t>(rows)),
        batch.rows(), s, logits + static_cast<size_t>(c0) * static_cast<size_t>(config_.vocab));
  }
}

void Transformer::head_chunk(std::span<const int32_t> rows, int32_t batch_rows, const BatchState& s,
                             float* logits) {
  const auto n = static_cast<int32_t>(rows.size());
  const size_t row_bytes = static_cast<size_t>(config_.hidden) * sizeof(float);
  for (int32_t i = 0; i < n; ++i) {
    const int32_t r = rows[static_cast<size_t>(i)];
    STRATA_CHECK(r >= 0 && r < batch_rows, "logit row {} of {}", r, batch_rows);
    backend_.copy(static_cast<char*>(sel_.data()) + static_cast<size_t>(i) * row_bytes,
                  static_cast<const char*>(s.x.data()) + static_cast<size_t>(r) * row_bytes,
                  row_bytes, CopyKind::kDeviceToDevice);
  }
  const ModelWeights& w = fixed_;
  float* hidden = sel_.f32();
  if (w.final_norm.data != nullptr) {
    norm(w.final_norm, w.final_norm_bias, hidden, n, h_.f32());
    hidden = h_.f32();
  }
  if (w.project_out.data != nullptr) {
    backend_.linear(hidden, n, w.project_out, nullptr, f1_.f32());
    hidden = f1_.f32();
  }
  backend_.linear(hidden, n, w.lm_head, nullptr, logits_.f32());
  if (config_.final_softcap > 0.0f)
    backend_.softcap(logits_.f32(), int64_t{n} * config_.vocab, config_.final_softcap);
  backend_.copy(logits, logits_.data(), static_cast<size_t>(n) * config_.vocab * sizeof(float),
                CopyKind::kDeviceToHost);
}

KernelBounds Transformer::kernel_bounds(const LayerWeights& L, int32_t capacity) const {
  KernelBounds b;
  b.max_rows = max_rows_;
  b.max_positions = capacity;
  const ModelWeights& w = fixed_;
  auto add = [&](const Tensor& t, bool in_layer) {
    if (t.shape.rank == 2) b.add_weight(t.shape[0], t.shape[1], t.dtype, in_layer);
  };  // rank 0: absent in this family or on this stage
  for (const Tensor* t : {&L.q, &L.k, &L.v, &L.o, &L.gate, &L.up, &L.down, &L.router})
    add(*t, true);
  if (config_.moe()) {  // an expert's matrices (as the layer holds them, or as the config says)
    const auto held = std::find_if(L.experts.begin(), L.experts.end(),
                                   [](const ExpertWeights& e) { return e.gate.data != nullptr; });
    if (held != L.experts.end()) {
      for (const ExpertMember m : kExpertMembers) add((*held).*m, true);
    } else {
      b.add_weight(config_.expert_intermediate, config_.hidden, config_.dtype, true);
      b.add_weight(config_.hidden, config_.expert_intermediate, config_.dtype, true);
    }
  }
  for (const Tensor* t : {&w.project_in, &w.project_out, &w.lm_head}) add(*t, false);
  return b;
}

TierBytes Transformer::memory() const {
  TierBytes m = attention_.memory();
  int64_t& compute = device_compute_ || backend_.device() != Device::kHost ? m.gpu : m.cpu;
  for (const DeviceBuffer* b : {&h_, &q_, &k_, &v_, &attn_, &f1_, &f2_, &sel_, &logits_, &rope_cos_,
                                &rope_sin_, &route_, &moe_in_, &moe_out_, &moe_ids_})
    compute += static_cast<int64_t>(b->size());
  return m;
}

}  // namespace strata
