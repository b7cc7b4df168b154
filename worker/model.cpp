#include "worker/model.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "kernels/error.h"

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

Model::Model(const ModelConfig& config, ModelWeights weights, Backend& backend, int32_t max_rows,
             std::unique_ptr<LayerStreamer> streamer, std::unique_ptr<LayerFeeder> feeder)
    : config_(config),
      weights_(std::move(weights)),
      streamer_(std::move(streamer)),
      feeder_(std::move(feeder)),
      backend_(backend),
      max_rows_(max_rows) {
  STRATA_CHECK(max_rows > 0, "max_rows {}", max_rows);
  with_oom_context(fmt::format("allocating the activations of {} rows", max_rows),
                   [&] { allocate_activations(); });
  if (config.is_llama())
    with_oom_context(
        fmt::format("building the rotary tables of {} positions", config.max_positions),
        [&] { build_rope_tables(); });
}

void Model::allocate_activations() {
  const ModelConfig& config = config_;
  const int32_t max_rows = max_rows_;
  const auto rows = static_cast<size_t>(max_rows);
  const size_t wide =
      static_cast<size_t>(std::max({config.hidden, config.q_width(), config.word_embed_proj_dim}));
  Backend& backend = backend_;
  auto buf = [&](size_t width) { return DeviceBuffer(backend, rows * width * sizeof(float)); };
  x_ = buf(wide);
  h_ = buf(wide);
  q_ = buf(static_cast<size_t>(config.q_width()));
  k_ = buf(static_cast<size_t>(config.kv_width()));
  v_ = buf(static_cast<size_t>(config.kv_width()));
  attn_ = buf(static_cast<size_t>(config.q_width()));
  f1_ = buf(static_cast<size_t>(config.intermediate));
  f2_ = buf(static_cast<size_t>(config.intermediate));
  sel_ = buf(wide);
  if (weights_.lm_head.data != nullptr)  // a pipeline stage without the head has no logits
    logits_ = DeviceBuffer(backend, static_cast<size_t>(std::min(max_rows, kLogitChunk)) *
                                        static_cast<size_t>(config.vocab) * sizeof(float));
  tokens_ = DeviceBuffer(backend, rows * sizeof(int32_t));
  positions_ = DeviceBuffer(backend, rows * sizeof(int32_t));
}

// cos/sin of position * inv_freq, in f32 like the reference implementations, with the
// inverse frequencies adjusted by the config's rope scaling.
void Model::build_rope_tables() {
  const int32_t half = config_.head_dim / 2;
  const int32_t n_pos = config_.max_positions;
  std::vector<float> inv_freq(static_cast<size_t>(half));
  for (int32_t j = 0; j < half; ++j) {
    float f = 1.0f / std::pow(config_.rope_theta,
                              static_cast<float>(2 * j) / static_cast<float>(config_.head_dim));
    if (config_.rope_scaling_type == "linear") {
      f /= config_.rope_factor;
    } else if (config_.rope_scaling_type == "llama3") {
      const float old_ctx = static_cast<float>(config_.rope_original_max_positions);
      const float low_wavelen = old_ctx / config_.rope_low_freq_factor;
      const float high_wavelen = old_ctx / config_.rope_high_freq_factor;
      const float wavelen = 2.0f * static_cast<float>(M_PI) / f;
      if (wavelen > low_wavelen) {
        f /= config_.rope_factor;
      } else if (wavelen >= high_wavelen) {
        const float smooth = (old_ctx / wavelen - config_.rope_low_freq_factor) /
                             (config_.rope_high_freq_factor - config_.rope_low_freq_factor);
        f = (1.0f - smooth) * f / config_.rope_factor + smooth * f;
      }
    }
    inv_freq[static_cast<size_t>(j)] = f;
  }
  std::vector<float> cos_t(static_cast<size_t>(n_pos) * half), sin_t(cos_t.size());
  for (int32_t p = 0; p < n_pos; ++p) {
    for (int32_t j = 0; j < half; ++j) {
      const float angle = static_cast<float>(p) * inv_freq[static_cast<size_t>(j)];
      cos_t[static_cast<size_t>(p) * half + j] = std::cos(angle);
      sin_t[static_cast<size_t>(p) * half + j] = std::sin(angle);
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

void Model::norm(const Tensor& w, const Tensor& b, const float* x, int32_t rows, float* y) {
  if (config_.is_opt()) {
    backend_.layer_norm(x, rows, config_.hidden, w.f32(), b.f32(), config_.norm_eps, y);
  } else {
    backend_.rms_norm(x, rows, config_.hidden, w.f32(), config_.norm_eps, y);
  }
}

void Model::forward(const StepBatch& batch, KvCache& cache, float* logits) {
  forward_stage(batch, cache, StepIo{nullptr, logits, true, false, false});
}

void Model::forward_stage(const StepBatch& batch, KvCache& cache, const StepIo& io) {
  const int32_t rows = batch.rows();
  STRATA_CHECK(rows > 0 && rows <= max_rows_, "step of {} rows (max {})", rows, max_rows_);
  STRATA_CHECK(io.out != nullptr, "step of {} rows without an output buffer", rows);
  for (int32_t p : batch.positions)
    STRATA_CHECK(p >= 0 && p < config_.max_positions,
                 "position {} outside the model's {} positions", p, config_.max_positions);
  split_gpu_batches(batch);
  std::vector<const StepBatch*> block;
  const int32_t whole = 0;
  std::span<const int32_t> first_rows(&whole, 1);
  if (gpu_batches_.size() <= 1) {
    block.push_back(&batch);
  } else {
    for (const StepBatch& b : gpu_batches_) block.push_back(&b);
    first_rows = gpu_batch_rows_;
  }
  run_block(block, first_rows, cache, io);
}

// FlexGen's zig-zag block schedule (Algorithm 1): the layer loop outside, the GPU batches
// inside, so each layer's weights are fetched once per block and every GPU batch reuses
// them. Each GPU batch keeps its own residual stream, tokens and positions across layers.
// first_rows[b]: where GPU batch b's rows start in the step's activations.
void Model::run_block(std::span<const StepBatch* const> block, std::span<const int32_t> first_rows,
                      KvCache& cache, const StepIo& io) {
  while (block_state_.size() < block.size()) block_state_.push_back(make_batch_state());
  for (size_t b = 0; b < block.size(); ++b) {
    BatchScope scope(*this, b);
    block_input(*block[b], first_rows[b], io);
  }
  for (int32_t i = 0; i < config_.n_layers; ++i) {
    const LayerWeights& w = layer_weights(i);
    for (size_t b = 0; b < block.size(); ++b) {
      BatchScope scope(*this, b);
      layer(w, i, *block[b], cache, block[b]->rows());
    }
  }
  float* logits = io.out;
  const size_t width = static_cast<size_t>(config_.hidden);
  for (size_t b = 0; b < block.size(); ++b) {
    BatchScope scope(*this, b);
    if (io.head) {
      head(*block[b], logits);
      logits += block[b]->logit_rows.size() * static_cast<size_t>(config_.vocab);
      continue;
    }
    backend_.copy(io.out + static_cast<size_t>(first_rows[b]) * width, x_.data(),
                  static_cast<size_t>(block[b]->rows()) * width * sizeof(float),
                  io.out_device ? CopyKind::kDeviceToDevice : CopyKind::kDeviceToHost);
  }
  // Another stream (NCCL's) sends the activations next.
  if (io.out_device && !io.head) backend_.synchronize();
}

// A GPU batch's tokens and positions to the device, then its residual stream: the tokens'
// embeddings, or the previous stage's activations of its rows.
void Model::block_input(const StepBatch& batch, int32_t first_row, const StepIo& io) {
  backend_.copy(tokens_.data(), batch.tokens.data(), batch.tokens.size() * sizeof(int32_t),
                CopyKind::kHostToDevice);
  backend_.copy(positions_.data(), batch.positions.data(), batch.positions.size() * sizeof(int32_t),
                CopyKind::kHostToDevice);
  if (io.in == nullptr) {
    embed(batch, batch.rows());
    return;
  }
  const size_t width = static_cast<size_t>(config_.hidden);
  backend_.copy(x_.data(), io.in + static_cast<size_t>(first_row) * width,
                static_cast<size_t>(batch.rows()) * width * sizeof(float),
                io.in_device ? CopyKind::kDeviceToDevice : CopyKind::kHostToDevice);
}

Model::BatchState Model::make_batch_state() {
  const auto rows = static_cast<size_t>(max_rows_);
  return {DeviceBuffer(backend_, x_.size()), DeviceBuffer(backend_, rows * sizeof(int32_t)),
          DeviceBuffer(backend_, rows * sizeof(int32_t))};
}

// Swaps GPU batch b's state into the working buffers for the scope's lifetime.
Model::BatchScope::BatchScope(Model& m, size_t b) : m_(m), b_(b) {
  swap();
}
Model::BatchScope::~BatchScope() {
  swap();
}
void Model::BatchScope::swap() {
  BatchState& s = m_.block_state_[b_];
  std::swap(m_.x_, s.x);
  std::swap(m_.tokens_, s.tokens);
  std::swap(m_.positions_, s.positions);
}

// Splits a step into GPU batches of at most gpu_batch_size sequences, rows rebased to 0.
// The generator lists logit rows in sequence order, which the split keeps; any other order
// runs as one batch.
void Model::split_gpu_batches(const StepBatch& batch) {
  gpu_batches_.clear();
  gpu_batch_rows_.clear();
  const auto n = static_cast<int32_t>(batch.seqs.size());
  if (gpu_batch_size_ <= 0 || n <= gpu_batch_size_) return;
  if (!std::is_sorted(batch.logit_rows.begin(), batch.logit_rows.end())) return;
  for (int32_t s0 = 0; s0 < n; s0 += gpu_batch_size_) {
    StepBatch& part = gpu_batches_.emplace_back();
    gpu_batch_rows_.push_back(batch.seqs[static_cast<size_t>(s0)].row_begin);
    for (int32_t s = s0; s < std::min(n, s0 + gpu_batch_size_); ++s) {
      const SeqSlice& q = batch.seqs[static_cast<size_t>(s)];
      const auto first = static_cast<size_t>(q.row_begin);
      const bool wants = std::binary_search(batch.logit_rows.begin(), batch.logit_rows.end(),
                                            q.row_begin + q.n_new - 1);
      part.add(q.slot, q.n_past,
               std::span(batch.tokens).subspan(first, static_cast<size_t>(q.n_new)), wants);
    }
  }
  size_t wanted = 0;
  for (const StepBatch& p : gpu_batches_) wanted += p.logit_rows.size();
  if (wanted != batch.logit_rows.size())
    gpu_batches_.clear();  // a row other than a sequence's last
}

void Model::set_gpu_batch_size(int32_t sequences) {
  STRATA_CHECK(sequences >= 0, "GPU batch size {}", sequences);
  gpu_batch_size_ = sequences;
}

const LayerWeights& Model::layer_weights(int32_t i) {
  if (feeder_ != nullptr) return feeder_->acquire(i);
  if (streamer_ != nullptr && streamer_->on_disk(i)) return streamer_->acquire(i);
  return weights_.layers[static_cast<size_t>(i)];
}

void Model::embed(const StepBatch& batch, int32_t rows) {
  const auto* ids = static_cast<const int32_t*>(tokens_.data());
  const ModelWeights& w = weights_;
  if (w.project_in.data != nullptr) {
    backend_.embedding(ids, rows, w.embed, h_.f32());
    backend_.linear(h_.f32(), rows, w.project_in, nullptr, x_.f32());
  } else {
    backend_.embedding(ids, rows, w.embed, x_.f32());
  }
  if (config_.is_opt()) {
    // Learned positions are stored with an offset of 2 (a fairseq legacy). OPT has no RoPE,
    // so positions_ can hold table rows from here on.
    scratch_ids_.resize(static_cast<size_t>(rows));
    for (int32_t r = 0; r < rows; ++r)
      scratch_ids_[static_cast<size_t>(r)] =
          batch.positions[static_cast<size_t>(r)] + config_.position_offset;
    backend_.copy(positions_.data(), scratch_ids_.data(), scratch_ids_.size() * sizeof(int32_t),
                  CopyKind::kHostToDevice);
    backend_.embedding(static_cast<const int32_t*>(positions_.data()), rows, w.positions, h_.f32());
    backend_.add(x_.f32(), h_.f32(), static_cast<int64_t>(rows) * config_.hidden);
  }
}

void Model::layer(const LayerWeights& L, int32_t i, const StepBatch& batch, KvCache& cache,
                  int32_t rows) {
  const bool pre_norm = !config_.is_opt() || config_.do_layer_norm_before;
  const int64_t n = static_cast<int64_t>(rows) * config_.hidden;

  const float* attn_in = x_.f32();
  if (pre_norm) {
    norm(L.attn_norm, L.attn_norm_bias, x_.f32(), rows, h_.f32());
    attn_in = h_.f32();
  }
  if (attn_in != h_.f32())
    backend_.copy(h_.data(), attn_in, static_cast<size_t>(n) * 4, CopyKind::kDeviceToDevice);
  attention_block(L, batch, cache, i, rows);  // h_ -> h_ (output projection)
  backend_.add(x_.f32(), h_.f32(), n);
  if (!pre_norm) norm(L.attn_norm, L.attn_norm_bias, x_.f32(), rows, x_.f32());

  if (pre_norm) {
    norm(L.mlp_norm, L.mlp_norm_bias, x_.f32(), rows, h_.f32());
  } else {
    backend_.copy(h_.data(), x_.data(), static_cast<size_t>(n) * 4, CopyKind::kDeviceToDevice);
  }
  mlp_block(L, rows);  // h_ -> h_
  backend_.add(x_.f32(), h_.f32(), n);
  if (!pre_norm) norm(L.mlp_norm, L.mlp_norm_bias, x_.f32(), rows, x_.f32());
}

void Model::attention_block(const LayerWeights& L, const StepBatch& batch, KvCache& cache,
                            int32_t i, int32_t rows) {
  const float* in = h_.f32();
  backend_.linear(in, rows, L.q, L.q_bias.data ? L.q_bias.f32() : nullptr, q_.f32());
  backend_.linear(in, rows, L.k, L.k_bias.data ? L.k_bias.f32() : nullptr, k_.f32());
  backend_.linear(in, rows, L.v, L.v_bias.data ? L.v_bias.f32() : nullptr, v_.f32());
  if (config_.is_llama()) {
    const auto* pos = static_cast<const int32_t*>(positions_.data());
    backend_.rope(q_.f32(), rows, config_.n_heads, config_.head_dim, pos, rope_);
    backend_.rope(k_.f32(), rows, config_.n_kv_heads, config_.head_dim, pos, rope_);
  }
  AttentionDims dims{config_.n_heads, config_.n_kv_heads, config_.head_dim,
                     1.0f / std::sqrt(static_cast<float>(config_.head_dim))};
  attend(batch, cache, i, dims, rows);  // q_, k_, v_ -> attn_
  backend_.linear(attn_.f32(), rows, L.o, L.o_bias.data ? L.o_bias.f32() : nullptr, h_.f32());
}

// The cache's tier decides where attention runs. On a host-compute engine every tier is
// host memory the backend reads directly; with device compute, a cache kept off the device
// is either attended on the host (delegation) or brought to the device for the layer.
void Model::attend(const StepBatch& batch, KvCache& cache, int32_t i, const AttentionDims& dims,
                   int32_t rows) {
  const Tier tier = cache.tier(i);
  cache.load(i);
  LayerKv kv{cache.compressed(), {}, {}};
  if (kv.q4) {
    kv.packed = cache.q4_layer(i);
  } else {
    kv.f32 = cache.layer(i);
  }
  if (tier == Tier::kGpu || feeder_ == nullptr) {
    const KvLayerView view = store_kv(backend_, k_.f32(), v_.f32(), batch, kv, cache, false);
    backend_.attention(q_.f32(), batch.seqs, view, dims, attn_.f32());
  } else if (cache_options_.cpu_attention) {
    delegated_attention(batch, kv, cache, dims, rows);
  } else {
    staged_attention(batch, kv, cache, dims);
  }
  cache.store(i);
}

// Stores the step's new k/v rows into the layer's cache with backend `b` and returns the
// f32 view attention reads: the cache itself or, for a 4-bit cache, all of it dequantised
// into working memory (host memory when `on_host`) just before use.
KvLayerView Model::store_kv(Backend& b, const float* k, const float* v, const StepBatch& batch,
                            const LayerKv& kv, const KvCache& cache, bool on_host) {
  if (!kv.q4) {
    b.kv_store(k, v, batch.seqs, kv.f32);
    return kv.f32;
  }
  b.kv_store_q4(k, v, batch.seqs, kv.packed);
  KvLayerView work = cache.f32_shape();
  const size_t bytes = work.slot_stride() * static_cast<size_t>(work.n_slots) * sizeof(float);
  DeviceBuffer& wk = on_host ? host_work_k_ : work_k_;
  DeviceBuffer& wv = on_host ? host_work_v_ : work_v_;
  if (wk.size() < bytes) {
    wk = on_host ? DeviceBuffer::host(backend_, bytes) : DeviceBuffer(backend_, bytes);
    wv = on_host ? DeviceBuffer::host(backend_, bytes) : DeviceBuffer(backend_, bytes);
  }
  work.k = wk.f32();
  work.v = wv.f32();
  b.kv_dequantize(kv.packed, work);
  return work;
}

void Model::delegated_attention(const StepBatch& batch, const LayerKv& kv, const KvCache& cache,
                                const AttentionDims& dims, int32_t rows) {
  Backend& host = *cache_options_.host;
  const size_t q_bytes =
      static_cast<size_t>(rows) * static_cast<size_t>(config_.q_width()) * sizeof(float);
  const size_t kv_bytes =
      static_cast<size_t>(rows) * static_cast<size_t>(config_.kv_width()) * sizeof(float);
  if (host_q_.size() == 0) {
    const auto max_rows = static_cast<size_t>(max_rows_);
    host_q_ = DeviceBuffer::host(backend_,
                                 max_rows * static_cast<size_t>(config_.q_width()) * sizeof(float));
    host_out_ = DeviceBuffer::host(backend_, host_q_.size());
    host_k_ = DeviceBuffer::host(
        backend_, max_rows * static_cast<size_t>(config_.kv_width()) * sizeof(float));
    host_v_ = DeviceBuffer::host(backend_, host_k_.size());
  }
  backend_.copy(host_q_.data(), q_.data(), q_bytes, CopyKind::kDeviceToHost);
  backend_.copy(host_k_.data(), k_.data(), kv_bytes, CopyKind::kDeviceToHost);
  backend_.copy(host_v_.data(), v_.data(), kv_bytes, CopyKind::kDeviceToHost);
  const KvLayerView view = store_kv(host, host_k_.f32(), host_v_.f32(), batch, kv, cache, true);
  host.attention(host_q_.f32(), batch.seqs, view, dims, host_out_.f32());
  backend_.copy(attn_.data(), host_out_.data(), q_bytes, CopyKind::kHostToDevice);
}

// The layer's cache (as stored: f32 or 4-bit) copied to the device and back around the
// attention.
void Model::staged_attention(const StepBatch& batch, const LayerKv& kv, const KvCache& cache,
                             const AttentionDims& dims) {
  const size_t bytes = cache.layer_bytes();
  if (staged_k_.size() < bytes) {
    staged_k_ = DeviceBuffer(backend_, bytes);
    staged_v_ = DeviceBuffer(backend_, bytes);
  }
  void* host_k = kv.q4 ? kv.packed.k : static_cast<void*>(kv.f32.k);
  void* host_v = kv.q4 ? kv.packed.v : static_cast<void*>(kv.f32.v);
  LayerKv dev = kv;
  dev.f32.k = staged_k_.f32();
  dev.f32.v = staged_v_.f32();
  dev.packed.k = staged_k_.data();
  dev.packed.v = staged_v_.data();
  backend_.copy(staged_k_.data(), host_k, bytes, CopyKind::kHostToDevice);
  backend_.copy(staged_v_.data(), host_v, bytes, CopyKind::kHostToDevice);
  const KvLayerView view = store_kv(backend_, k_.f32(), v_.f32(), batch, dev, cache, false);
  backend_.attention(q_.f32(), batch.seqs, view, dims, attn_.f32());
  backend_.copy(host_k, staged_k_.data(), bytes, CopyKind::kDeviceToHost);
  backend_.copy(host_v, staged_v_.data(), bytes, CopyKind::kDeviceToHost);
}

void Model::set_cache_options(const CacheOptions& options) {
  STRATA_CHECK(!options.cpu_attention || options.host != nullptr,
               "CPU attention needs a host backend");
  cache_options_ = options;
}

std::unique_ptr<KvCache> Model::make_cache(int32_t n_slots, int32_t capacity) {
  const double bytes = 2.0 * n_slots * capacity * config_.kv_width() * sizeof(float) *
                       static_cast<double>(config_.n_layers);
  return with_oom_context(
      fmt::format("allocating the KV cache of {} sequences x {} positions x {} layers ({:.1f} MiB "
                  "in f32)",
                  n_slots, capacity, config_.n_layers, bytes / (1 << 20)),
      [&] {
        CachePlacement placement = cache_options_.placement;
        placement.device_tier = feeder_ != nullptr;
        auto cache = std::make_unique<KvCache>(backend_, config_, n_slots, capacity, placement);
        reserve_workspaces(*cache);
        return cache;
      });
}

void Model::reserve_workspaces(const KvCache& cache) {
  const int32_t n = cache.n_slots();
  const auto batches = static_cast<size_t>(
      gpu_batch_size_ > 0 && n > gpu_batch_size_ ? (n + gpu_batch_size_ - 1) / gpu_batch_size_ : 1);
  while (block_state_.size() < batches) block_state_.push_back(make_batch_state());
  bool off_device = false;
  for (int32_t i = 0; i < config_.n_layers; ++i)
    off_device = off_device || cache.tier(i) != Tier::kGpu;
  off_device = off_device && feeder_ != nullptr;
  const bool delegated = off_device && cache_options_.cpu_attention;
  if (cache.compressed()) {  // store_kv's dequantised layer, on the compute device
    const KvLayerView f = cache.f32_shape();
    const size_t bytes = f.slot_stride() * static_cast<size_t>(f.n_slots) * sizeof(float);
    if (work_k_.size() < bytes) {
      work_k_ = DeviceBuffer(backend_, bytes);
      work_v_ = DeviceBuffer(backend_, bytes);
    }
  }
  if (off_device && !delegated && staged_k_.size() < cache.layer_bytes()) {
    staged_k_ = DeviceBuffer(backend_, cache.layer_bytes());
    staged_v_ = DeviceBuffer(backend_, cache.layer_bytes());
  }
  if (delegated && host_q_.size() == 0) {
    const auto rows = static_cast<size_t>(max_rows_);
    host_q_ =
        DeviceBuffer::host(backend_, rows * static_cast<size_t>(config_.q_width()) * sizeof(float));
    host_out_ = DeviceBuffer::host(backend_, host_q_.size());
    host_k_ = DeviceBuffer::host(backend_,
                                 rows * static_cast<size_t>(config_.kv_width()) * sizeof(float));
    host_v_ = DeviceBuffer::host(backend_, host_k_.size());
  }
}

TierBytes Model::memory() const {
  TierBytes m;
  // The compute tier: the accelerator's memory when the model computes there.
  int64_t& compute = feeder_ != nullptr || backend_.device() != Device::kHost ? m.gpu : m.cpu;
  auto size = [](const DeviceBuffer& b) { return static_cast<int64_t>(b.size()); };
  for (const DeviceBuffer* b :
       {&x_, &h_, &q_, &k_, &v_, &attn_, &f1_, &f2_, &sel_, &logits_, &tokens_, &positions_,
        &rope_cos_, &rope_sin_, &staged_k_, &staged_v_, &work_k_, &work_v_})
    compute += size(*b);
  for (const BatchState& s : block_state_)
    compute += size(s.x) + size(s.tokens) + size(s.positions);
  for (const DeviceBuffer* b :
       {&host_q_, &host_k_, &host_v_, &host_out_, &host_work_k_, &host_work_v_})
    m.cpu += size(*b);
  if (feeder_ != nullptr) {
    for (const DeviceBuffer& b : weights_.device_owned) m.gpu += size(b);
    m += feeder_->memory();
    return m;
  }
  const ModelWeights& w = weights_;
  auto bytes = [](const Tensor& t) {
    return t.data == nullptr ? 0 : static_cast<int64_t>(t.bytes());
  };
  for (const Tensor* t :
       {&w.embed, &w.positions, &w.project_in, &w.project_out, &w.final_norm, &w.final_norm_bias})
    m.cpu += bytes(*t);
  if (w.lm_head.data != w.embed.data) m.cpu += bytes(w.lm_head);
  for (const LayerWeights& L : w.layers)
    for (const Tensor* t : {&L.attn_norm, &L.attn_norm_bias, &L.q, &L.k, &L.v, &L.o, &L.q_bias,
                            &L.k_bias, &L.v_bias, &L.o_bias, &L.mlp_norm, &L.mlp_norm_bias, &L.gate,
                            &L.up, &L.down, &L.up_bias, &L.down_bias})
      m.cpu += bytes(*t);
  if (streamer_ != nullptr) m += streamer_->memory();
  return m;
}

void Model::mlp_block(const LayerWeights& L, int32_t rows) {
  const int64_t n = static_cast<int64_t>(rows) * config_.intermediate;
  const float* up_bias = L.up_bias.data ? L.up_bias.f32() : nullptr;
  if (config_.is_llama()) {
    backend_.linear(h_.f32(), rows, L.gate, nullptr, f1_.f32());
    backend_.linear(h_.f32(), rows, L.up, up_bias, f2_.f32());
    backend_.silu_mul(f1_.f32(), f2_.f32(), f1_.f32(), n);
  } else {
    backend_.linear(h_.f32(), rows, L.up, up_bias, f1_.f32());
    backend_.relu(f1_.f32(), n);
  }
  backend_.linear(f1_.f32(), rows, L.down, L.down_bias.data ? L.down_bias.f32() : nullptr,
                  h_.f32());
}

// Final norm and LM head on the requested rows only, kLogitChunk rows at a time so the
// logits buffer stays small even when every row of a long prompt wants logits.
void Model::head(const StepBatch& batch, float* logits) {
  const auto n = static_cast<int32_t>(batch.logit_rows.size());
  const int32_t chunk = std::min(max_rows_, kLogitChunk);
  for (int32_t c0 = 0; c0 < n; c0 += chunk) {
    const int32_t rows = std::min(chunk, n - c0);
    head_chunk(
        std::span(batch.logit_rows).subspan(static_cast<size_t>(c0), static_cast<size_t>(rows)),
        batch.rows(), logits + static_cast<size_t>(c0) * static_cast<size_t>(config_.vocab));
  }
}

void Model::head_chunk(std::span<const int32_t> rows, int32_t batch_rows, float* logits) {
  const auto n = static_cast<int32_t>(rows.size());
  const size_t row_bytes = static_cast<size_t>(config_.hidden) * sizeof(float);
  for (int32_t i = 0; i < n; ++i) {
    const int32_t r = rows[static_cast<size_t>(i)];
    STRATA_CHECK(r >= 0 && r < batch_rows, "logit row {} of {}", r, batch_rows);
    backend_.copy(static_cast<char*>(sel_.data()) + static_cast<size_t>(i) * row_bytes,
                  static_cast<const char*>(x_.data()) + static_cast<size_t>(r) * row_bytes,
                  row_bytes, CopyKind::kDeviceToDevice);
  }
  const ModelWeights& w = weights_;
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
  backend_.copy(logits, logits_.data(), static_cast<size_t>(n) * config_.vocab * sizeof(float),
                CopyKind::kDeviceToHost);
}

}  // namespace strata
