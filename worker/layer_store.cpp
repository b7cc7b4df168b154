#include "worker/layer_store.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "kernels/clock.h"
#include "kernels/error.h"
#include "kernels/log.h"

namespace strata {

static_assert(kDirectAlignment == static_cast<size_t>(kPageBytes),
              "placement/tier.h models O_DIRECT transfers with kPageBytes");

namespace {

// Every tensor member of LayerWeights, in a fixed order.

// How long compute waits for a layer before calling the disk dead.
constexpr auto kReadDeadline = std::chrono::seconds(120);

void* aligned_in(Buffer& b) {
  return reinterpret_cast<void*>(align_up(reinterpret_cast<uintptr_t>(b.data())));
}

}  // namespace

LayerLayout LayerLayout::of(const LayerWeights& example) {
  LayerLayout l;
  const auto add = [&](const Field& f, const Tensor& t) {
    if (t.data == nullptr) return;
    Field placed = f;
    placed.dtype = t.dtype;
    placed.shape = t.shape;
    placed.offset = l.bytes_;
    l.fields_.push_back(placed);
    l.bytes_ = align_up(l.bytes_ + t.bytes(), 64);
  };
  for (auto member : kLayerMembers) add(Field{member, nullptr, -1, {}, {}, 0}, example.*member);
  l.n_experts_ = example.experts.size();
  for (size_t e = 0; e < example.experts.size(); ++e)
    for (const ExpertMember m : kExpertMembers)
      add(Field{nullptr, m, static_cast<int32_t>(e), {}, {}, 0}, example.experts[e].*m);
  l.bytes_ = align_up(l.bytes_);
  return l;
}

Tensor& LayerLayout::at(LayerWeights& w, const Field& f) {
  return f.expert < 0 ? w.*(f.member) : w.experts[static_cast<size_t>(f.expert)].*(f.expert_member);
}

const Tensor& LayerLayout::at(const LayerWeights& w, const Field& f) {
  if (f.expert < 0) return w.*(f.member);
  STRATA_CHECK(static_cast<size_t>(f.expert) < w.experts.size(), "expert {} of a layer of {}",
               f.expert, w.experts.size());
  return w.experts[static_cast<size_t>(f.expert)].*(f.expert_member);
}

void LayerLayout::pack(const LayerWeights& src, void* blob) const {
  for (const Field& f : fields_) {
    const Tensor& t = at(src, f);
    STRATA_CHECK(t.shape == f.shape && t.dtype == f.dtype,
                 "layer tensor {} does not match the layout", t.describe());
    std::memcpy(static_cast<char*>(blob) + f.offset, t.data, t.bytes());
  }
}

LayerWeights LayerLayout::bind(void* blob) const {
  LayerWeights w;
  w.experts.resize(n_experts_);
  for (const Field& f : fields_) {
    Tensor& t = at(w, f);
    t.data = static_cast<char*>(blob) + f.offset;
    t.dtype = f.dtype;
    t.shape = f.shape;
  }
  return w;
}

LayerStreamer::LayerStreamer(DirectFile file, LayerLayout layout, std::vector<int32_t> disk_layers,
                             bool overlap)
    : file_(std::move(file)),
      layout_(std::move(layout)),
      prefetch_(std::move(disk_layers), overlap) {
  STRATA_CHECK(!prefetch_.streamed().empty(), "a layer streamer needs at least one disk layer");
  for (Slot& s : slots_) {
    s.storage = Buffer(layout_.bytes() + kDirectAlignment);
    s.blob = aligned_in(s.storage);
    s.view = layout_.bind(s.blob);
  }
  io_ = std::thread([this] { io_loop(); });
  prefetch_.prime(*this);  // the first token needs the first disk layer first
}

LayerStreamer::~LayerStreamer() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  io_.join();
}

size_t LayerStreamer::index_of(int32_t layer) const {
  const std::vector<int32_t>& d = prefetch_.streamed();
  return static_cast<size_t>(std::lower_bound(d.begin(), d.end(), layer) - d.begin());
}

void LayerStreamer::start(int slot, int32_t layer) {
  std::unique_lock lock(mu_);
  // One read in flight at a time: the disk gives no more bandwidth to two.
  if (!cv_.wait_for(lock, kReadDeadline, [&] { return pending_ == nullptr || !io_error_.empty(); }))
    fail(ErrorKind::kFailed, "a read from '{}' did not finish within {} s", file_.path(),
         kReadDeadline.count());
  Slot& s = slots_[slot];
  s.layer = layer;
  s.ready = false;
  pending_ = &s;
  // Counted when asked for, not when done: a reader of the stats between steps then sees the
  // same count whether or not the prefetch the last layer started has finished yet.
  stats_.layers_read += 1;
  stats_.bytes_read += static_cast<int64_t>(layout_.bytes());
  cv_.notify_all();
}

void LayerStreamer::finish(int slot, int32_t layer) {
  std::unique_lock lock(mu_);
  const Slot& s = slots_[slot];
  const double t0 = now_s();
  if (!cv_.wait_for(lock, kReadDeadline, [&] { return s.ready || !io_error_.empty(); }))
    fail(ErrorKind::kFailed, "reading layer {} from '{}' did not finish within {} s", layer,
         file_.path(), kReadDeadline.count());
  if (!io_error_.empty()) fail(ErrorKind::kFailed, "{}", io_error_);
  stats_.wait_seconds += now_s() - t0;
}

const LayerWeights& LayerStreamer::acquire(int32_t layer) {
  return slots_[prefetch_.acquire(layer, *this)].view;
}

const void* LayerStreamer::acquire_blob(int32_t layer) {
  return slots_[prefetch_.acquire(layer, *this)].blob;
}

void LayerStreamer::io_loop() {
  std::unique_lock lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || pending_ != nullptr; });
    if (stop_) return;
    Slot* slot = pending_;
    const int32_t layer = slot->layer;
    lock.unlock();
    double dt = 0;
    const std::string error =
        file_.read_noexcept(slot->blob, layout_.bytes(), index_of(layer) * layout_.bytes(), dt);
    lock.lock();
    if (!error.empty()) io_error_ = error;
    slot->ready = true;
    pending_ = nullptr;
    stats_.read_seconds += dt;
    cv_.notify_all();
  }
}

StreamStats LayerStreamer::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

LayerOffloader::LayerOffloader(std::vector<int32_t> disk_layers, const std::string& dir)
    : disk_layers_(std::move(disk_layers)) {
  namespace fs = std::filesystem;
  if (disk_layers_.empty()) return;
  if (!fs::is_directory(dir)) fail_input("--disk-dir '{}' is not a directory", dir);
  // One file per offloader: several models (pipeline stages) may share a process and a dir.
  static std::atomic<int> files{0};
  file_ = DirectFile::create(
      (fs::path(dir) / fmt::format("strata-weights-{}-{}.bin", getpid(), files++)).string());
  file_.unlink_on_close();
}

void LayerOffloader::operator()(int32_t layer, LayerWeights& w) {
  const auto it = std::lower_bound(disk_layers_.begin(), disk_layers_.end(), layer);
  if (it == disk_layers_.end() || *it != layer) return;
  if (layout_.bytes() == 0) {
    layout_ = LayerLayout::of(w);
    staging_ = Buffer(layout_.bytes() + kDirectAlignment);
  }
  void* blob = aligned_in(staging_);
  std::memset(blob, 0, layout_.bytes());
  layout_.pack(w, blob);
  file_.write(blob, layout_.bytes(),
              static_cast<uint64_t>(it - disk_layers_.begin()) * layout_.bytes());
  release_layer(w);
}

void release_layer(LayerWeights& w) {
  for_each_tensor(w, [](const Tensor& t) { drop_mapped_pages(t); });  // mapped checkpoint pages
  w = LayerWeights{};
}

std::unique_ptr<LayerStreamer> LayerOffloader::finish(size_t n_layers, bool overlap) {
  if (disk_layers_.empty()) return nullptr;
  STRATA_CHECK(layout_.bytes() > 0, "no disk layer was written");
  log::get("worker")->info(
      "{} of {} layers on disk in {} ({:.1f} MiB each{})", disk_layers_.size(), n_layers,
      file_.path(), static_cast<double>(layout_.bytes()) / (1 << 20),
      file_.direct() ? ", O_DIRECT" : ", buffered: the filesystem refused O_DIRECT");
  staging_ = Buffer();
  return std::make_unique<LayerStreamer>(std::move(file_), layout_, disk_layers_, overlap);
}

TierBytes LayerStreamer::memory() const {
  TierBytes m;
  for (const Slot& s : slots_) m.cpu += static_cast<int64_t>(s.storage.size());
  m.disk = static_cast<int64_t>(prefetch_.streamed().size() * layout_.bytes());
  return m;
}

}  // namespace strata
