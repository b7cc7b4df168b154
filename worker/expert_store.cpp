#include "worker/expert_store.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <numeric>

#include "kernels/clock.h"
#include "kernels/error.h"
#include "kernels/log.h"

namespace strata {
namespace {

// How long compute waits for an expert before calling the disk dead.
constexpr auto kReadDeadline = std::chrono::seconds(120);

void* aligned_in(Buffer& b) {
  return reinterpret_cast<void*>(align_up(reinterpret_cast<uintptr_t>(b.data())));
}

// A layer holding one expert: what LayerLayout packs for one expert blob.
LayerWeights one_expert(const ExpertWeights& e) {
  LayerWeights w;
  w.experts.push_back(e);
  return w;
}

}  // namespace

// ---- popularity ---------------------------------------------------------------------

ExpertPopularity::ExpertPopularity(int32_t n_layers, int32_t n_experts, int32_t window)
    : n_layers_(n_layers), n_experts_(n_experts), window_(window) {
  STRATA_CHECK(n_layers > 0 && n_experts > 0 && window > 0, "popularity of {} x {} over {}",
               n_layers, n_experts, window);
  ring_.assign(static_cast<size_t>(n_layers) * window * n_experts, 0);
  sums_.assign(static_cast<size_t>(n_layers) * n_experts, 0);
  next_.assign(static_cast<size_t>(n_layers), 0);
}

void ExpertPopularity::record(int32_t layer, const ExpertRouting& routing) {
  STRATA_CHECK(layer >= 0 && layer < n_layers_ && routing.n_experts == n_experts_,
               "popularity of layer {} ({} experts) given {} experts", layer, n_experts_,
               routing.n_experts);
  int32_t& slot = next_[static_cast<size_t>(layer)];
  int32_t* counts = ring_.data() +
                    (static_cast<size_t>(layer) * window_ + static_cast<size_t>(slot)) * n_experts_;
  int64_t* sums = sums_.data() + static_cast<size_t>(layer) * n_experts_;
  for (int32_t e = 0; e < n_experts_; ++e) {
    sums[e] += routing.rows_of(e) - counts[e];  // the oldest routing leaves the window
    counts[e] = routing.rows_of(e);
  }
  slot = (slot + 1) % window_;
}

int64_t ExpertPopularity::count(int32_t layer, int32_t expert) const {
  return sums_[static_cast<size_t>(layer) * n_experts_ + static_cast<size_t>(expert)];
}

int64_t ExpertPopularity::total(int32_t layer) const {
  int64_t t = 0;
  for (int32_t e = 0; e < n_experts_; ++e) t += count(layer, e);
  return t;
}

std::vector<int32_t> ExpertPopularity::ranked(int32_t layer) const {
  std::vector<int32_t> r(static_cast<size_t>(n_experts_));
  std::iota(r.begin(), r.end(), 0);
  std::stable_sort(r.begin(), r.end(),
                   [&](int32_t a, int32_t b) { return count(layer, a) > count(layer, b); });
  return r;
}

// ---- the store ----------------------------------------------------------------------

std::string ExpertStreamStats::str() const {
  return fmt::format(
      "experts from disk: {} needed, {} cache hits, {} reads ({:.1f} MiB, {:.1f} MiB/s), "
      "compute waited {:.3f} s",
      requested, hits, reads, static_cast<double>(bytes_read) / (1 << 20), read_rate() / (1 << 20),
      wait_seconds);
}

ExpertStore::ExpertStore(DirectFile file, LayerLayout layout,
                         std::vector<std::vector<int32_t>> disk, int32_t cache_slots,
                         const ExpertPopularity* popularity)
    : file_(std::move(file)),
      layout_(std::move(layout)),
      disk_(std::move(disk)),
      popularity_(popularity) {
  STRATA_CHECK(cache_slots >= 1, "an expert cache of {} slots", cache_slots);
  int64_t at = 0;
  for (const auto& layer : disk_) {
    first_.push_back(at);
    for (size_t j = 0; j < layer.size(); ++j) index_.push_back(at++);
  }
  slots_.resize(static_cast<size_t>(cache_slots));
  for (Slot& s : slots_) {
    s.storage = Buffer(layout_.bytes() + kDirectAlignment);
    s.blob = aligned_in(s.storage);
    s.view = layout_.bind(s.blob);
  }
  io_ = std::thread([this] { io_loop(); });
}

ExpertStore::~ExpertStore() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  io_.join();
}

int64_t ExpertStore::index_of(int32_t layer, int32_t expert) const {
  if (layer < 0 || static_cast<size_t>(layer) >= disk_.size()) return -1;
  const std::vector<int32_t>& d = disk_[static_cast<size_t>(layer)];
  const auto it = std::lower_bound(d.begin(), d.end(), expert);
  if (it == d.end() || *it != expert) return -1;
  return first_[static_cast<size_t>(layer)] + (it - d.begin());
}

bool ExpertStore::holds(int32_t layer, int32_t expert) const {
  return index_of(layer, expert) >= 0;
}

ExpertStore::Slot* ExpertStore::find(int32_t layer, int32_t expert) {
  for (Slot& s : slots_)
    if (s.layer == layer && s.expert == expert) return &s;
  return nullptr;
}

// The unpinned slot whose expert is least popular in its layer's window (least recently used
// among equals, and without popularity); an empty slot first.
ExpertStore::Slot* ExpertStore::victim() {
  Slot* best = nullptr;
  auto score = [&](const Slot& s) -> int64_t {
    if (s.expert < 0) return -1;
    return popularity_ != nullptr ? popularity_->count(s.layer, s.expert) : 0;
  };
  for (Slot& s : slots_) {
    if (s.pinned) continue;
    if (best == nullptr || score(s) < score(*best) ||
        (score(s) == score(*best) && s.used < best->used))
      best = &s;
  }
  return best;
}

// Cached experts first (they cost no read, and computing them first frees their slots for
// the reads), then the misses in the order asked, each read on the I/O thread.
std::span<const int32_t> ExpertStore::request(int32_t layer, std::span<const int32_t> experts) {
  std::lock_guard lock(mu_);
  if (!io_error_.empty()) fail(ErrorKind::kFailed, "{}", io_error_);
  order_.clear();
  ++clock_;
  for (const int32_t e : experts) {
    STRATA_CHECK(holds(layer, e), "expert {} of layer {} is not on disk", e, layer);
    ++stats_.requested;
    if (Slot* s = find(layer, e); s != nullptr && s->ready) {
      s->pinned = true;
      s->used = clock_;
      order_.push_back(e);
      ++stats_.hits;
    }
  }
  for (const int32_t e : experts) {
    if (std::find(order_.begin(), order_.end(), e) != order_.end()) continue;
    order_.push_back(e);
    queue_.emplace_back(layer, e);
  }
  cv_.notify_all();
  return order_;
}

const ExpertWeights& ExpertStore::wait(int32_t layer, int32_t expert) {
  std::unique_lock lock(mu_);
  const double t0 = now_s();
  Slot* s = nullptr;
  if (!cv_.wait_for(lock, kReadDeadline, [&] {
        s = find(layer, expert);
        return (s != nullptr && s->ready && s->pinned) || !io_error_.empty();
      }))
    fail(ErrorKind::kFailed, "reading expert {} of layer {} from '{}' did not finish within {} s",
         expert, layer, file_.path(), kReadDeadline.count());
  if (!io_error_.empty()) fail(ErrorKind::kFailed, "{}", io_error_);
  stats_.wait_seconds += now_s() - t0;
  return s->view.experts[0];
}

void ExpertStore::release(int32_t layer, int32_t expert) {
  std::lock_guard lock(mu_);
  if (Slot* s = find(layer, expert)) s->pinned = false;
  cv_.notify_all();
}

// One read at a time, into a slot no pending compute holds; the slot is pinned for the
// compute that asked for it.
void ExpertStore::io_loop() {
  std::unique_lock lock(mu_);
  while (true) {
    Slot* slot = nullptr;
    cv_.wait(lock, [&] { return stop_ || (!queue_.empty() && (slot = victim()) != nullptr); });
    if (stop_) return;
    const auto [layer, expert] = queue_.front();
    queue_.pop_front();
    slot->layer = layer;
    slot->expert = expert;
    slot->ready = false;
    slot->pinned = true;
    slot->used = clock_;
    const auto offset = static_cast<uint64_t>(index_of(layer, expert)) * layout_.bytes();
    lock.unlock();
    double dt = 0;
    const std::string error = file_.read_noexcept(slot->blob, layout_.bytes(), offset, dt);
    lock.lock();
    if (!error.empty()) io_error_ = error;
    slot->ready = true;
    ++stats_.reads;
    stats_.bytes_read += static_cast<int64_t>(layout_.bytes());
    stats_.read_seconds += dt;
    cv_.notify_all();
  }
}

ExpertStreamStats ExpertStore::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

TierBytes ExpertStore::memory() const {
  TierBytes m;
  for (const Slot& s : slots_) m.cpu += static_cast<int64_t>(s.storage.size());
  m.disk = static_cast<int64_t>(index_.size() * layout_.bytes());
  return m;
}

// ---- the offloader ------------------------------------------------------------------

ExpertOffloader::ExpertOffloader(int32_t n_layers, int32_t n_experts, int32_t resident,
                                 const std::string& dir)
    : n_experts_(n_experts), resident_(std::clamp(resident, 0, n_experts)) {
  if (!active()) return;
  disk_.resize(static_cast<size_t>(n_layers));
  namespace fs = std::filesystem;
  if (!fs::is_directory(dir)) fail_input("--disk-dir '{}' is not a directory", dir);
  // One file per offloader: several models (pipeline stages) may share a process and a dir.
  static std::atomic<int> files{0};
  file_ = DirectFile::create(
      (fs::path(dir) / fmt::format("strata-experts-{}-{}.bin", ::getpid(), files++)).string());
  file_.unlink_on_close();
}

void ExpertOffloader::operator()(int32_t layer, LayerWeights& w) {
  if (!active() || w.experts.empty()) return;
  STRATA_CHECK(static_cast<int32_t>(w.experts.size()) == n_experts_ &&
                   static_cast<size_t>(layer) < disk_.size(),
               "layer {} with {} experts (expected {})", layer, w.experts.size(), n_experts_);
  for (int32_t e = resident_; e < n_experts_; ++e) {
    ExpertWeights& x = w.experts[static_cast<size_t>(e)];
    const LayerWeights one = one_expert(x);
    if (layout_.bytes() == 0) {
      layout_ = LayerLayout::of(one);
      staging_ = Buffer(layout_.bytes() + kDirectAlignment);
    }
    void* blob = aligned_in(staging_);
    std::memset(blob, 0, layout_.bytes());
    layout_.pack(one, blob);
    file_.write(blob, layout_.bytes(), static_cast<uint64_t>(written_++) * layout_.bytes());
    for (const ExpertMember m : kExpertMembers) drop_mapped_pages(x.*m);
    x = ExpertWeights{};
    disk_[static_cast<size_t>(layer)].push_back(e);
  }
}

std::unique_ptr<ExpertStore> ExpertOffloader::finish(int32_t cache_slots) {
  if (!active() || written_ == 0) return nullptr;
  log::get("worker")->info(
      "{} experts on disk in {} ({:.2f} MiB each{}), {} of {} per layer resident, {} cache slots",
      written_, file_.path(), static_cast<double>(layout_.bytes()) / (1 << 20),
      file_.direct() ? ", O_DIRECT" : ", buffered: the filesystem refused O_DIRECT", resident_,
      n_experts_, cache_slots);
  staging_ = Buffer();
  return std::make_unique<ExpertStore>(std::move(file_), layout_, std::move(disk_), cache_slots);
}

}  // namespace strata
