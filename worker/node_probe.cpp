#include "worker/node_probe.h"

#include <fcntl.h>
#include <omp.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "kernels/accelerator.h"
#include "kernels/clock.h"
#include "kernels/cpu_isa.h"
#include "kernels/error.h"
#include "kernels/limits.h"
#include "kernels/log.h"
#include "transport/mpi_session.h"
#include "worker/direct_file.h"

namespace strata {
namespace {

constexpr size_t kProbeBytes = size_t{64} << 20;  // past any cache, a few layers' worth

struct Rates {
  bool o_direct = false;
  double memory_read_gbs = 0, disk_read_gbs = 0, host_to_device_gbs = 0, device_memory_gbs = 0;
};

// The fastest of three read passes over kProbeBytes on `threads` threads.
double measure_memory_read(int threads) {
  omp_set_num_threads(threads);
  const ReadProbe probe(kProbeBytes);
  double best = probe.pass_seconds();
  for (int i = 0; i < 2; ++i) best = std::min(best, probe.pass_seconds());
  return static_cast<double>(probe.bytes()) / best / 1e9;
}

Rates measure(const NodeProbeRequest& r) {
  Rates m;
  m.memory_read_gbs = measure_memory_read(r.threads);
  // kProbeBytes in 8 MiB requests, around the page cache where the filesystem allows.
  const DirectIoTimes io = time_direct_io(r.disk_dir, kProbeBytes, size_t{8} << 20);
  m.o_direct = io.o_direct;
  m.disk_read_gbs = static_cast<double>(io.bytes) / io.read_s / 1e9;
  if (r.device != nullptr && r.cuda_device >= 0) {
    const DeviceLimits d = measure_device_limits(*r.device);
    m.host_to_device_gbs = d.host_to_device_gbs;
    m.device_memory_gbs = d.device_memory_gbs;
  } else if (r.device_compute && r.cuda_device < 0) {
    // A stand-in's "transfers" are copies within host memory.
    m.host_to_device_gbs = m.memory_read_gbs;
  }
  return m;
}

// The filesystem `dir` is on (its device number): every folder on one disk reads alike.
uint64_t disk_device(const std::string& dir) {
  struct stat st {};
  return ::stat(dir.c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_dev) : 0;
}

// Kept per host, compute, threads and disk (not per folder: a run's scratch folder is new
// each time, its disk is not).
std::string cache_path(const NodeProbeRequest& r, const std::string& compute) {
  std::string host = r.host;
  for (char& c : host)
    if (c == '/' || c == ':' || c == ' ') c = '_';
  const std::string key = fmt::format("{}|{}|disk {}", compute, r.threads, disk_device(r.disk_dir));
  return fmt::format("{}/node-{}-{:08x}.json", r.cache_dir, host,
                     static_cast<uint32_t>(name_key(key)));
}

std::optional<Rates> cached(const std::string& path) {
  std::ifstream in(path);
  const auto j = nlohmann::json::parse(in, nullptr, false);
  if (!j.is_object() || j.value("version", 0) != 1) return std::nullopt;
  return Rates{j.value("o_direct", false), j.value("memory_read_gbs", 0.0),
               j.value("disk_read_gbs", 0.0), j.value("host_to_device_gbs", 0.0),
               j.value("device_memory_gbs", 0.0)};
}

void keep(const std::string& path, const NodeProbeRequest& r, const std::string& compute,
          const Rates& m) {
  std::error_code ec;
  const std::string tmp = fmt::format("{}.{}.tmp", path, getpid());
  std::ofstream out(tmp);
  out << nlohmann::json{{"version", 1},
                        {"compute", compute},
                        {"threads", r.threads},
                        {"disk_dir", r.disk_dir},
                        {"disk_device", disk_device(r.disk_dir)},
                        {"o_direct", m.o_direct},
                        {"memory_read_gbs", m.memory_read_gbs},
                        {"disk_read_gbs", m.disk_read_gbs},
                        {"host_to_device_gbs", m.host_to_device_gbs},
                        {"device_memory_gbs", m.device_memory_gbs}}
             .dump(2)
      << "\n";
  out.close();
  if (!out || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::filesystem::remove(tmp, ec);
    log::get("worker")->warn("could not keep the node's rates in {}", path);
  }
}

// The host's measurements one at a time (an flock on the cache folder's lock file): ranks
// that measure the same disk and memory at once would each see a share of it. Held until
// destroyed; without it after `seconds` the measurement goes ahead unserialised.
class MeasureLock {
 public:
  MeasureLock(const std::string& dir, double seconds) {
    fd_ = ::open((dir + "/.measure.lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    const auto t0 = std::chrono::steady_clock::now();
    while (fd_ >= 0 && ::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      if (seconds_since(t0) > seconds) {
        log::get("worker")->warn("the node's rates are measured without the host's lock");
        ::close(fd_);
        fd_ = -1;
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  ~MeasureLock() {
    if (fd_ >= 0) ::close(fd_);  // releases the lock
  }
  MeasureLock(const MeasureLock&) = delete;
  MeasureLock& operator=(const MeasureLock&) = delete;

 private:
  int fd_ = -1;
};

// The cached rates, or measured and cached; a cache that does not read is measured again.
Rates rates(const NodeProbeRequest& r, const std::string& compute) {
  if (r.cache_dir.empty()) return measure(r);
  const std::string path = cache_path(r, compute);
  if (!r.remeasure)
    if (const auto c = cached(path)) return *c;
  std::error_code ec;
  std::filesystem::create_directories(r.cache_dir, ec);
  const MeasureLock lock(r.cache_dir, 120.0);
  // Another rank of this host may have measured the same while this one waited.
  if (!r.remeasure)
    if (const auto c = cached(path)) return *c;
  const Rates m = measure(r);
  keep(path, r, compute, m);
  return m;
}

}  // namespace

int64_t host_available_bytes() {
  std::ifstream in("/proc/meminfo");
  for (std::string key; in >> key;) {
    int64_t kib = 0;
    in >> kib;
    if (key == "MemAvailable:") return kib * 1024;
    in.ignore(1 << 10, '\n');
  }
  return 0;
}

int64_t disk_free_bytes(const std::string& dir) {
  struct statvfs st {};
  if (statvfs(dir.c_str(), &st) != 0 || !std::filesystem::is_directory(dir))
    fail_input("--disk-dir '{}' is not a folder this rank can use", dir);
  return static_cast<int64_t>(st.f_bavail) * static_cast<int64_t>(st.f_frsize);
}

namespace {

int64_t status_kib(const std::string& field) {
  std::ifstream in("/proc/self/status");
  for (std::string key; in >> key;) {
    if (key == field) {
      int64_t kib = 0;
      in >> kib;
      return kib * 1024;
    }
    in.ignore(1 << 12, '\n');
  }
  return 0;
}

}  // namespace

int64_t process_rss_bytes() {
  return status_kib("VmRSS:");
}

int64_t process_peak_rss_bytes() {
  return status_kib("VmHWM:");
}

bool reset_peak_rss() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5\n";
  out.close();
  return static_cast<bool>(out);
}

std::string cuda_device_name(int index) {
  for (const AcceleratorDevice& d : probe_accelerators().devices)
    if (d.index == index)
      return fmt::format("cuda:{} {} ({} SMs, {:.1f} GiB)", d.index, d.name, d.multiprocessors,
                         static_cast<double>(d.memory_bytes) / (1 << 30));
  return fmt::format("cuda:{}", index);
}

NodeInventory probe_node(const NodeProbeRequest& r) {
  NodeInventory n;
  n.rank = r.rank;
  n.host = r.host;
  n.ranks_on_host = r.ranks_on_host;
  n.nccl_key = r.nccl_key;
  n.budget = r.budget;
  n.threads = r.threads;
  n.isa = cpu_isa_name(active_cpu_isa());
  n.device_compute = r.device_compute;
  n.compute = r.cuda_device >= 0 ? r.device_name
              : r.device_compute ? fmt::format("the CPU standing in for a device ({}, {} threads)",
                                               n.isa, r.threads)
                                 : fmt::format("cpu ({}, {} threads)", n.isa, r.threads);
  n.device_free_bytes = r.cuda_device >= 0 ? accelerator_free_bytes(r.cuda_device) : -1;
  n.host_available_bytes = host_available_bytes();
  n.disk_dir = r.disk_dir;
  n.disk_free_bytes = disk_free_bytes(r.disk_dir);
  const Rates m = rates(r, n.compute);
  n.o_direct = m.o_direct;
  n.memory_read_gbs = m.memory_read_gbs;
  n.disk_read_gbs = m.disk_read_gbs;
  n.host_to_device_gbs = m.host_to_device_gbs;
  n.device_memory_gbs = m.device_memory_gbs;
  return n;
}

}  // namespace strata
