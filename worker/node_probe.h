// A rank's own inventory before any plan (placement/node.h NodeInventory): what it computes
// on, the memory and disk it has, and the rates it reads at -- host memory with its threads,
// its --disk-dir around the page cache (O_DIRECT), host -> device and device memory. The
// rates take seconds to measure, so they are kept per host, compute, threads and disk (the
// filesystem of the disk folder) in a cache folder and measured again only on request; what
// is free is read every time.
#pragma once

#include <string>

#include "kernels/backend.h"
#include "placement/node.h"

namespace strata {

struct NodeProbeRequest {
  int rank = 0;
  std::string host;
  int ranks_on_host = 1;
  int nccl_key = 0;             // transport/tensor_channel.h device_key of its CUDA device
  NodeBudget budget;            // what the operator gave this rank, resolved
  bool device_compute = false;  // a device computes (cuda_device's, or the CPU standing in)
  int cuda_device = -1;         // the device's CUDA index; -1: a stand-in, or none
  std::string device_name;      // its name (cuda:0 NVIDIA H200 (132 SMs))
  // The CUDA device's backend, to measure its rates with (nullptr: not measured; a cached
  // measurement is still read).
  Backend* device = nullptr;
  int threads = 1;
  std::string disk_dir = "/tmp";
  std::string cache_dir;  // where the measured rates are kept ("": measured every time)
  bool remeasure = false;
};

NodeInventory probe_node(const NodeProbeRequest& request);

// "cuda:0 NVIDIA H200 (132 SMs, 139.8 GiB)" from the runtime's properties; "cuda:N" where it
// does not answer.
std::string cuda_device_name(int index);

// MemAvailable of /proc/meminfo in bytes (0 where it cannot be read).
int64_t host_available_bytes();
// Space an unprivileged user may still write under `dir` (statvfs); InputError naming the
// folder when it is none.
int64_t disk_free_bytes(const std::string& dir);

// This process's resident memory now (VmRSS) and its peak (VmHWM), in bytes (0 where
// /proc/self/status cannot be read); reset_peak_rss() starts the peak again from now
// (/proc/self/clear_refs), false where the kernel refuses.
int64_t process_rss_bytes();
int64_t process_peak_rss_bytes();
bool reset_peak_rss();

}  // namespace strata
