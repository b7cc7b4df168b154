#include "worker/kv_swap.h"

#include <algorithm>

#include "kernels/error.h"

namespace strata {

namespace {

double seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// Validates before the buffers and the mapping table are sized, so the error names the
// option.
PieBuffers checked_buffers(const PieOptions& o, int32_t n, size_t layer_bytes) {
  o.validate(n);
  return PieBuffers::of(n, o.lowest_host_layers(), o.highest_host_layers(n),
                        static_cast<int64_t>(layer_bytes));
}

}  // namespace

std::string KvSwapStats::str() const {
  return fmt::format(
      "pie m={} (expansion {:.2f}): {} swap-ins ({} early, {:.1f} MiB), {} swap-outs ({:.1f} "
      "MiB), stall {:.6f} s, {} adjustments over {} steps",
      host_layers, expansion, swap_ins, early_swap_ins, static_cast<double>(bytes_in) / (1 << 20),
      swap_outs, static_cast<double>(bytes_out) / (1 << 20), stall_seconds, adjustments, steps);
}

std::string KvSwapStats::json() const {
  return fmt::format(
      R"({{"host_layers": {}, "expansion": {:.4f}, "swap_ins": {}, "swap_outs": {}, )"
      R"("early_swap_ins": {}, "bytes_in": {}, "bytes_out": {}, "stall_seconds": {:.6f}, )"
      R"("adjustments": {}, "steps": {}}})",
      host_layers, expansion, swap_ins, swap_outs, early_swap_ins, bytes_in, bytes_out,
      stall_seconds, adjustments, steps);
}

KvSwap::KvSwap(Backend& backend, int32_t n_layers, size_t layer_bytes, const PieOptions& options)
    : backend_(backend),
      options_(options),
      layer_bytes_(layer_bytes),
      buffers_(checked_buffers(options, n_layers, layer_bytes)),
      stride_(static_cast<size_t>(buffers_.bytes / 2)),
      table_(n_layers, options.host_layers) {
  STRATA_CHECK(layer_bytes > 0, "Pie over layers of {} bytes", layer_bytes);
  const int32_t lo = options_.lowest_host_layers();
  const int32_t hi = options_.highest_host_layers(n_layers);
  if (options_.adaptive) {
    PieControllerOptions c = options_.controller;
    c.n_layers = n_layers;
    c.min_host_layers = lo;
    c.max_host_layers = hi;
    controller_ = std::make_unique<PieExpansionController>(c, options_.host_layers);
  }
  const auto bytes = static_cast<size_t>(buffers_.bytes);
  with_oom_context(fmt::format("allocating Pie's {} device and {} host KV layer buffers",
                               buffers_.device, buffers_.host),
                   [&] {
                     for (int32_t i = 0; i < buffers_.device; ++i)
                       device_.emplace_back(backend, bytes);
                     for (int32_t i = 0; i < buffers_.host; ++i)
                       host_.push_back(DeviceBuffer::host(backend, bytes));
                   });
  for (auto i = static_cast<int32_t>(device_.size()) - 1; i >= 0; --i) free_device_.push_back(i);
  for (auto i = static_cast<int32_t>(host_.size()) - 1; i >= 0; --i) free_host_.push_back(i);
  device_of_.assign(static_cast<size_t>(n_layers), -1);
  host_of_.assign(static_cast<size_t>(n_layers), -1);
  for (int32_t i = 0; i < n_layers; ++i) {
    auto& pool = table_.on_gpu(i) ? free_device_ : free_host_;
    (table_.on_gpu(i) ? device_of_ : host_of_)[static_cast<size_t>(i)] = pool.back();
    pool.pop_back();
  }
  stats_.host_layers = table_.host_layers();
  stats_.expansion = table_.expansion();
}

KvSwap::~KvSwap() {
  // The buffers are freed next: no copy may still be writing or reading them.
  try {
    backend_.host_waits(in_.ticket);
    backend_.host_waits(out_.ticket);
  } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor cannot report it
  }
}

std::byte* KvSwap::device_ptr(int32_t layer) const {
  const int32_t b = device_of_[static_cast<size_t>(layer)];
  STRATA_CHECK(b >= 0, "layer {} has no device buffer: {}", layer, table_.str());
  return static_cast<std::byte*>(device_[static_cast<size_t>(b)].data());
}

std::byte* KvSwap::host_ptr(int32_t layer) const {
  const int32_t b = host_of_[static_cast<size_t>(layer)];
  STRATA_CHECK(b >= 0, "layer {} has no host buffer: {}", layer, table_.str());
  return static_cast<std::byte*>(host_[static_cast<size_t>(b)].data());
}

void* KvSwap::k(int32_t layer) const {
  STRATA_CHECK(table_.on_gpu(layer), "attention at layer {} while it is {}", layer,
               pie_layer_state_name(table_.state(layer)));
  return device_ptr(layer);
}

void* KvSwap::v(int32_t layer) const {
  return static_cast<std::byte*>(k(layer)) + stride_;
}

void KvSwap::finish_in(bool wait) {
  if (in_.layer < 0 || !(wait || backend_.transfer_done(in_.ticket))) return;
  if (wait) backend_.host_waits(in_.ticket);
  table_.complete_swap_in(in_.layer);
  auto& h = host_of_[static_cast<size_t>(in_.layer)];
  free_host_.push_back(h);
  h = -1;
  in_ = {};
}

void KvSwap::finish_out(bool wait) {
  if (out_.layer < 0 || !(wait || backend_.transfer_done(out_.ticket))) return;
  if (wait) backend_.host_waits(out_.ticket);
  table_.complete_swap_out(out_.layer);
  auto& d = device_of_[static_cast<size_t>(out_.layer)];
  free_device_.push_back(d);
  d = -1;
  out_ = {};
}

void KvSwap::poll() {
  finish_out(false);
  finish_in(false);
}

void KvSwap::start(const PieSwapDecision& d) {
  const auto bytes = static_cast<size_t>(buffers_.swap_bytes);  // K, the gap to V's alignment, V
  if (d.swap_in >= 0) {
    STRATA_CHECK(!free_device_.empty(), "swap-in of layer {} with no free device buffer: {}",
                 d.swap_in, table_.str());
    device_of_[static_cast<size_t>(d.swap_in)] = free_device_.back();
    free_device_.pop_back();
    table_.start_swap_in(d.swap_in);
    in_ = {d.swap_in, backend_.transfer(device_ptr(d.swap_in), host_ptr(d.swap_in), bytes,
                                        CopyKind::kHostToDevice)};
    ++stats_.swap_ins;
    stats_.bytes_in += static_cast<int64_t>(bytes);
    ++step_ins_;
    if (d.early) {
      ++stats_.early_swap_ins;
      ++step_early_;
    }
  }
  if (d.swap_out >= 0) {
    STRATA_CHECK(!free_host_.empty(), "swap-out of layer {} with no free host buffer: {}",
                 d.swap_out, table_.str());
    host_of_[static_cast<size_t>(d.swap_out)] = free_host_.back();
    free_host_.pop_back();
    table_.start_swap_out(d.swap_out);
    // The transfer runs after the compute already enqueued: the layer's last writes go too.
    out_ = {d.swap_out, backend_.transfer(host_ptr(d.swap_out), device_ptr(d.swap_out), bytes,
                                          CopyKind::kDeviceToHost)};
    ++stats_.swap_outs;
    stats_.bytes_out += static_cast<int64_t>(bytes);
  }
}

void KvSwap::begin_layer(int32_t layer) {
  if (!in_step_) {
    in_step_ = true;
    step_start_ = Clock::now();
    step_stall_ = 0;
    step_ins_ = step_early_ = 0;
  }
  poll();
  start(PieSwapPolicy::decide(table_, layer));
  const int32_t n = table_.n_layers();
  for (int32_t waits = 0; !table_.on_gpu(layer); ++waits) {
    STRATA_CHECK(waits <= 2 * n + 4, "layer {} still waits after {} swaps: {}", layer, waits,
                 table_.str());
    STRATA_CHECK(in_.layer >= 0 || out_.layer >= 0, "layer {} waits with no swap under way: {}",
                 layer, table_.str());
    // Its own swap-in; else the swap-out that makes room for it, or the swap-in that must
    // end before its own can start.
    const bool out_first = out_.layer == layer || in_.layer < 0 ||
                           (in_.layer != layer && !table_.has_free_gpu_space());
    const Clock::time_point t0 = Clock::now();
    if (out_first && out_.layer >= 0) {
      finish_out(true);
    } else {
      finish_in(true);
    }
    step_stall_ += seconds(Clock::now() - t0);
    poll();
    start(PieSwapPolicy::decide(table_, layer));
  }
}

void KvSwap::end_step() {
  if (!in_step_) return;
  in_step_ = false;
  ++stats_.steps;
  stats_.stall_seconds += step_stall_;
  if (controller_ == nullptr) return;
  PieTokenObservation o;
  o.stall_seconds = step_stall_;
  o.token_seconds = seconds(Clock::now() - step_start_);
  o.swap_ins = step_ins_;
  o.early_swap_ins = step_early_;
  const int32_t m = controller_->observe(o);
  if (m != table_.host_layers()) table_.set_host_layers(m);
  stats_.host_layers = m;
  stats_.expansion = table_.expansion();
  stats_.adjustments = controller_->adjustments();
}

KvSwap::Location KvSwap::settle(int32_t layer) {
  finish_out(true);
  finish_in(true);
  STRATA_CHECK(layer >= 0 && layer < table_.n_layers(), "Pie layer {} of {}", layer,
               table_.n_layers());
  Location l;
  l.device = table_.on_gpu(layer);
  l.k = l.device ? device_ptr(layer) : host_ptr(layer);
  l.v = l.k + stride_;
  return l;
}

KvSwapStats KvSwap::stats() const {
  KvSwapStats s = stats_;
  s.layer_bytes = static_cast<int64_t>(layer_bytes_);
  s.buffers = buffers_;
  return s;
}

TierBytes KvSwap::memory() const {
  TierBytes m;
  for (const DeviceBuffer& b : device_) m.gpu += static_cast<int64_t>(b.size());
  for (const DeviceBuffer& b : host_) m.cpu += static_cast<int64_t>(b.size());
  return m;
}

}  // namespace strata
