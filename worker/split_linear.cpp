#include "worker/split_linear.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "kernels/clock.h"
#include "kernels/error.h"
#include "kernels/quant.h"

namespace strata {
namespace {

// Copies `bytes` from `src` (the compute backend's memory when src_on_gpu) to `dst` (likewise).
// On a host compute backend both are host memory and the kind does not matter.
void copy_bytes(Backend& gpu, void* dst, bool dst_on_gpu, const void* src, bool src_on_gpu,
                size_t bytes) {
  if (bytes == 0) return;
  if (!dst_on_gpu && !src_on_gpu) {
    std::memcpy(dst, src, bytes);
    return;
  }
  const CopyKind kind = dst_on_gpu && src_on_gpu ? CopyKind::kDeviceToDevice
                        : dst_on_gpu             ? CopyKind::kHostToDevice
                                                 : CopyKind::kDeviceToHost;
  gpu.copy(dst, src, bytes, kind);
}

// Rows [r0, r0 + n) of the [rows, in] matrix w into `dst` as a [n, in] tensor of w's dtype.
// A kQ4 blob is codes, then mins, then scales, each in row order with a row's groups
// together, so the rows' slice of each part lands after the previous part.
void copy_rows(Backend& gpu, const Tensor& w, int64_t r0, int64_t n, void* dst, bool dst_on_gpu) {
  const bool src_on_gpu = w.device != Device::kHost;
  const auto* src = static_cast<const char*>(w.data);
  auto* out = static_cast<char*>(dst);
  const int64_t rows = w.shape[0], in = w.shape[1];
  if (w.dtype != DType::kQ4) {
    const size_t row_bytes = static_cast<size_t>(in) * dtype_size(w.dtype);
    copy_bytes(gpu, out, dst_on_gpu, src + static_cast<size_t>(r0) * row_bytes, src_on_gpu,
               static_cast<size_t>(n) * row_bytes);
    return;
  }
  const auto code_row = static_cast<size_t>(in / 2);
  const auto stat_row = static_cast<size_t>(in / kQuantGroupSize) * sizeof(float);
  const size_t codes = static_cast<size_t>(rows) * code_row;
  const size_t stats = static_cast<size_t>(rows) * stat_row;
  const auto first = static_cast<size_t>(r0), count = static_cast<size_t>(n);
  copy_bytes(gpu, out, dst_on_gpu, src + first * code_row, src_on_gpu, count * code_row);
  out += count * code_row;
  copy_bytes(gpu, out, dst_on_gpu, src + codes + first * stat_row, src_on_gpu, count * stat_row);
  out += count * stat_row;
  copy_bytes(gpu, out, dst_on_gpu, src + codes + stats + first * stat_row, src_on_gpu,
             count * stat_row);
}

}  // namespace

Tensor leading_rows(const Tensor& w, int64_t rows, std::vector<std::byte>& storage) {
  STRATA_CHECK(w.shape.rank == 2 && w.data != nullptr && w.device == Device::kHost && rows >= 0 &&
                   rows <= w.shape[0],
               "the first {} rows of {}", rows, w.describe());
  Tensor t{w.data, w.dtype, Shape{rows, w.shape[1]}, Device::kHost};
  if (w.dtype != DType::kQ4) return t;  // row-major: the rows are a prefix
  storage.resize(t.bytes());
  t.data = storage.data();
  const auto* src = static_cast<const char*>(w.data);
  auto* out = static_cast<char*>(t.data);
  const int64_t in = w.shape[1];
  const auto code_row = static_cast<size_t>(in / 2);
  const auto stat_row = static_cast<size_t>(in / kQuantGroupSize) * sizeof(float);
  const size_t codes = static_cast<size_t>(w.shape[0]) * code_row;
  const size_t stats = static_cast<size_t>(w.shape[0]) * stat_row;
  const auto n = static_cast<size_t>(rows);
  std::memcpy(out, src, n * code_row);
  std::memcpy(out + n * code_row, src + codes, n * stat_row);
  std::memcpy(out + n * code_row + n * stat_row, src + codes + stats, n * stat_row);
  return t;
}

SplitLinearWeights::SplitLinearWeights(const Tensor& w, const Tensor& bias, double alpha,
                                       Backend& gpu, Backend& cpu, SplitShare share)
    : alpha_(alpha), share_(share) {
  if (!(alpha >= 0 && alpha <= 1)) fail_input("HeteGen: alpha must be in [0, 1], got {}", alpha);
  if (w.shape.rank != 2 || w.data == nullptr)
    fail_input("HeteGen: a split linear needs a resident 2-D weight, got {}{}", w.describe(),
               w.data == nullptr ? " without data (on disk?)" : "");
  STRATA_CHECK(w.dtype != DType::kI32, "linear weight {}", w.describe());
  out_ = w.shape[0];
  in_ = w.shape[1];
  const bool has_bias = bias.data != nullptr;
  has_bias_ = has_bias;
  if (has_bias)
    STRATA_CHECK(bias.dtype == DType::kF32 && bias.shape.numel() == out_, "bias {} for weight {}",
                 bias.describe(), w.describe());
  const int64_t g = split_gpu_rows(alpha, out_);
  const int64_t c = out_ - g;
  const bool gpu_is_device = gpu.device() != Device::kHost;

  const bool resident = share == SplitShare::kResident;
  gpu_ = Tensor{nullptr, w.dtype, Shape{g, in_}, gpu.device()};
  cpu_ = Tensor{nullptr, w.dtype, Shape{c, in_}, Device::kHost};
  if (resident) gpu_storage_ = DeviceBuffer(gpu, gpu_.bytes());
  cpu_storage_ = DeviceBuffer(cpu, cpu_.bytes());
  gpu_.data = gpu_storage_.data();
  cpu_.data = cpu_storage_.data();
  if (g > 0 && resident) copy_rows(gpu, w, 0, g, gpu_.data, gpu_is_device);
  if (c > 0) copy_rows(gpu, w, g, c, cpu_.data, false);
  if (has_bias) {
    const bool bias_on_gpu = bias.device != Device::kHost;
    if (resident) gpu_bias_ = DeviceBuffer(gpu, static_cast<size_t>(g) * sizeof(float));
    cpu_bias_ = DeviceBuffer(cpu, static_cast<size_t>(c) * sizeof(float));
    if (resident)
      copy_bytes(gpu, gpu_bias_.data(), gpu_is_device, bias.data, bias_on_gpu,
                 static_cast<size_t>(g) * sizeof(float));
    copy_bytes(gpu, cpu_bias_.data(), false, bias.f32() + g, bias_on_gpu,
               static_cast<size_t>(c) * sizeof(float));
  }
}

TierBytes SplitLinearWeights::memory() const {
  TierBytes m;
  m.gpu = static_cast<int64_t>(gpu_storage_.size() + gpu_bias_.size());
  m.cpu = static_cast<int64_t>(cpu_storage_.size() + cpu_bias_.size());
  return m;
}

SplitLinearScratch::SplitLinearScratch(Backend& gpu, int64_t max_rows, int64_t max_in,
                                       int64_t max_out)
    : max_rows_(max_rows), max_in_(max_in), max_out_(max_out) {
  STRATA_CHECK(max_rows > 0 && max_in > 0 && max_out > 0, "split linear scratch {} x {} -> {}",
               max_rows, max_in, max_out);
  const auto rows = static_cast<size_t>(max_rows);
  x_host_ = DeviceBuffer::host(gpu, rows * static_cast<size_t>(max_in) * sizeof(float));
  y_host_ = DeviceBuffer::host(gpu, rows * static_cast<size_t>(max_out) * sizeof(float));
  stage_ = DeviceBuffer(gpu, rows * static_cast<size_t>(max_out) * sizeof(float));
}

TierBytes SplitLinearScratch::memory() const {
  TierBytes m;
  m.cpu = static_cast<int64_t>(x_host_.size() + y_host_.size());
  m.gpu = static_cast<int64_t>(stage_.size());
  return m;
}

void split_linear(const SplitLinearWeights& w, const float* x, int64_t m, float* y, Backend& gpu,
                  Backend& cpu, SplitLinearScratch& s, const Tensor* gpu_w, const float* gpu_b) {
  const int64_t g = w.gpu_rows(), c = w.cpu_rows(), out = w.out_features(), in = w.in_features();
  STRATA_CHECK(m >= 0 && m <= s.max_rows_ && in <= s.max_in_ && out <= s.max_out_,
               "split linear of {} rows, {} -> {}, over scratch for {} rows, {} -> {}", m, in, out,
               s.max_rows_, s.max_in_, s.max_out_);
  if (m == 0) return;
  // The alpha share this call computes from: the split's own, or the one streamed in.
  const Tensor* share = &w.gpu_weight();
  const float* share_bias = w.gpu_bias();
  if (w.share() == SplitShare::kStreamed && g > 0) {
    STRATA_CHECK(gpu_w != nullptr && gpu_w->data != nullptr &&
                     gpu_w->shape == w.gpu_weight().shape && gpu_w->dtype == w.gpu_weight().dtype &&
                     (gpu_b != nullptr) == w.has_bias(),
                 "streamed alpha share {} (bias {}) for a split of {} with bias {}",
                 gpu_w != nullptr ? gpu_w->describe() : "none", gpu_b != nullptr,
                 w.gpu_weight().describe(), w.has_bias());
    share = gpu_w;
    share_bias = gpu_b;
  }
  if (c == 0) {  // alpha 1: all on the compute backend, as unsplit
    gpu.linear(x, m, *share, share_bias, y);
    return;
  }
  const size_t f = sizeof(float);
  auto* x_host = static_cast<float*>(s.x_host_.data());
  auto* y_host = static_cast<float*>(s.y_host_.data());
  // x goes down for the CPU share; the transfer waits for the compute that wrote x.
  const TransferTicket down =
      gpu.transfer(x_host, x, static_cast<size_t>(m * in) * f, CopyKind::kDeviceToHost);
  // With one row (decode at batch 1, the paper's case) or no GPU share, each share's output is
  // one contiguous piece of y and goes straight there; otherwise the shares are column blocks
  // of y's rows and are staged, then joined row by row.
  const bool direct = m == 1 || g == 0;
  float* y_gpu = direct ? y : s.stage_.f32();
  float* y_cpu = direct ? y + g : s.stage_.f32() + m * g;
  // The GPU share is enqueued first, so it runs while x comes down and the CPU computes.
  if (g > 0) gpu.linear(x, m, *share, share_bias, y_gpu);
  gpu.host_waits(down);
  gpu.host_waits(s.upload_);  // y_host's previous upload has left it
  // OpenMP's thread count is the calling thread's (kernels/cpu_backend.h): set the CPU
  // share's on whichever thread computes.
  cpu.bind_thread();
  const auto t0 = std::chrono::steady_clock::now();
  cpu.linear(x_host, m, w.cpu_weight(), w.cpu_bias(), y_host);
  s.cpu_seconds_ += seconds_since(t0);
  s.cpu_calls_ += 1;
  s.upload_ = gpu.transfer(y_cpu, y_host, static_cast<size_t>(m * c) * f, CopyKind::kHostToDevice);
  gpu.compute_waits(s.upload_);
  if (direct) return;
  for (int64_t r = 0; r < m; ++r) {
    gpu.copy(y + r * out, y_gpu + r * g, static_cast<size_t>(g) * f, CopyKind::kDeviceToDevice);
    gpu.copy(y + r * out + g, y_cpu + r * c, static_cast<size_t>(c) * f, CopyKind::kDeviceToDevice);
  }
}

SplitLinearTable::SplitLinearTable(Backend& gpu, Backend& cpu, int32_t n_layers)
    : gpu_(gpu), cpu_(cpu) {
  STRATA_CHECK(n_layers >= 0, "split table of {} layers", n_layers);
  layers_.resize(static_cast<size_t>(n_layers));
}

SplitLinearTable::SplitLinearTable(std::span<const LayerWeights> layers, const AlphaFor& alpha,
                                   Backend& gpu, Backend& cpu, int32_t max_rows)
    : SplitLinearTable(gpu, cpu, static_cast<int32_t>(layers.size())) {
  for (size_t l = 0; l < layers.size(); ++l) add(static_cast<int32_t>(l), layers[l], alpha);
  reserve(max_rows);
}

void SplitLinearTable::add(int32_t layer, const LayerWeights& w, const AlphaFor& alpha,
                           SplitShare share) {
  STRATA_CHECK(static_cast<bool>(alpha), "split table without alphas");
  STRATA_CHECK(layer >= 0 && layer < n_layers(), "split of layer {} in a table of {}", layer,
               n_layers());
  auto& slots = layers_[static_cast<size_t>(layer)];
  for (LinearSlot slot : kAllLinearSlots) {
    const Tensor& t = slot_weight(w, slot);
    if (t.shape.rank != 2) continue;  // not in this family
    const double a = alpha(layer, slot);
    if (a < 0) continue;
    auto split = std::make_unique<SplitLinearWeights>(t, slot_bias(w, slot), a, gpu_, cpu_, share);
    max_in_ = std::max(max_in_, split->in_features());
    max_out_ = std::max(max_out_, split->out_features());
    if (split->cpu_rows() > 0)
      cpu_bounds_.add_weight(split->cpu_rows(), split->in_features(), t.dtype, true);
    slots[static_cast<size_t>(slot)] = std::move(split);
    ++n_splits_;
  }
}

void SplitLinearTable::reserve(int32_t max_rows) {
  STRATA_CHECK(max_rows > 0, "split table for {} rows", max_rows);
  if (n_splits_ == 0) return;  // nothing to stage (placement/ counts no staging then)
  const int64_t rows = std::max<int64_t>(max_rows, scratch_.max_rows());
  if (rows == scratch_.max_rows() && max_in_ <= scratch_.max_in() && max_out_ <= scratch_.max_out())
    return;
  cpu_bounds_.max_rows = rows;
  cpu_.reserve(cpu_bounds_);
  // The last upload out of the old staging may still be reading it.
  if (scratch_.max_rows() > 0) gpu_.synchronize();
  scratch_ = SplitLinearScratch(gpu_, rows, max_in_, max_out_);
}

namespace {

SplitLinearTable::AlphaFor uniform_alpha(const hetegen::HeteGenOptions& options) {
  options.validate();
  return [alpha = options.alpha](int32_t, LinearSlot) { return alpha; };
}

}  // namespace

SplitLinearTable::SplitLinearTable(std::span<const LayerWeights> layers,
                                   const hetegen::HeteGenOptions& options, Backend& gpu,
                                   Backend& cpu, int32_t max_rows)
    : SplitLinearTable(layers, uniform_alpha(options), gpu, cpu, max_rows) {}

const SplitLinearWeights* SplitLinearTable::find(int32_t layer, LinearSlot slot) const {
  STRATA_CHECK(layer >= 0 && layer < n_layers(), "split table of {} layers asked for layer {}",
               n_layers(), layer);
  return layers_[static_cast<size_t>(layer)][static_cast<size_t>(slot)].get();
}

bool SplitLinearTable::splits(int32_t layer) const {
  for (LinearSlot slot : kAllLinearSlots)
    if (find(layer, slot) != nullptr) return true;
  return false;
}

TierBytes SplitLinearTable::memory() const {
  TierBytes m = scratch_.memory();
  for (const auto& layer : layers_)
    for (const auto& split : layer)
      if (split) m += split->memory();
  return m;
}

std::string SplitLinearTable::str() const {
  std::string s =
      fmt::format("HeteGen split linears: {} layers, {}", layers_.size(), memory().str());
  for (size_t l = 0; l < layers_.size(); ++l) {
    s += fmt::format("\n  layer {}:", l);
    for (LinearSlot slot : kAllLinearSlots) {
      const auto& split = layers_[l][static_cast<size_t>(slot)];
      if (split)
        s += fmt::format(" {} {}+{} (alpha {:.3f})", linear_slot_name(slot), split->gpu_rows(),
                         split->cpu_rows(), split->alpha());
    }
  }
  return s;
}

}  // namespace strata
