// strata profile: what the cost model needs to know about this node, measured: disk read
// and write bandwidth around the page cache (O_DIRECT), host memory bandwidth, GEMM FLOP/s
// at prefill and decode shapes, CPU attention throughput, and the accelerators present.
// Saved as JSON. Host<->device bandwidth is not measured here: `strata bench` measures it on
// the device the engine computes on (kernels/limits.h measure_device_limits).

#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "kernels/accelerator.h"
#include "kernels/clock.h"
#include "kernels/cpu_backend.h"
#include "kernels/error.h"
#include "kernels/limits.h"
#include "launch/commands.h"
#include "launch/progress.h"
#include "worker/direct_file.h"

namespace strata::cli {
namespace {

struct ProfileOptions {
  int threads = 0;
  std::string disk_dir = "/tmp";
  int disk_mib = 512;
  std::string out;
};

// Sequential O_DIRECT write then read of `mib` MiB in 64 MiB requests (layer-sized, as the
// disk tier issues them); GB/s each way.
nlohmann::json measure_disk(const std::string& dir, int mib) {
  const DirectIoTimes t = time_direct_io(dir, static_cast<size_t>(mib) << 20, size_t{64} << 20);
  return {{"dir", dir},
          {"bytes", t.bytes},
          {"o_direct", t.o_direct},
          {"write_gbs", static_cast<double>(t.bytes) / t.write_s / 1e9},
          {"read_gbs", static_cast<double>(t.bytes) / t.read_s / 1e9}};
}

// FLOP/s of CpuBackend::attention at a decode shape: `batch` sequences of `ctx` cached tokens.
double measure_cpu_attention(CpuBackend& cpu, int batch, int ctx, int heads, int head_dim) {
  KvLayerView kv;
  kv.n_slots = batch;
  kv.capacity = ctx;
  kv.n_kv_heads = heads;
  kv.head_dim = head_dim;
  const size_t kv_elems = static_cast<size_t>(batch) * kv.slot_stride();
  Buffer k(kv_elems * 4), v(kv_elems * 4), q(static_cast<size_t>(batch * heads * head_dim) * 4),
      out(static_cast<size_t>(batch * heads * head_dim) * 4);
  kv.k = k.as<float>();
  kv.v = v.as<float>();
  std::vector<SeqSlice> seqs;
  for (int s = 0; s < batch; ++s) seqs.push_back({s, 1, ctx - 1, s});
  const AttentionDims dims{heads, heads, head_dim, 0.125f};
  double best = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    cpu.attention(q.as<float>(), seqs, kv, dims, out.as<float>());
    best = std::min(best, seconds_since(t0));
  }
  return 4.0 * batch * ctx * heads * head_dim / best;
}

int run_profile(const ProfileOptions& o) {
  const int threads = resolve_cpu_threads(o.threads);
  CpuBackend cpu(threads);
  nlohmann::ordered_json j;
  j["accelerators"] = probe_accelerators().str();
  j["threads"] = threads;
  Progress progress("profiling: memory, GEMM, attention, disk", 3);
  const MachineLimits lim = measure_machine_limits(threads);
  j["host"] = {{"memory_bandwidth_gbs", lim.memory_bandwidth_gbs},
               {"memory_read_gbs", lim.memory_read_gbs},
               {"gemm_gflops_2048", lim.gemm_gflops}};
  progress.update(1);
  j["cpu_attention_gflops"] = measure_cpu_attention(cpu, 32, 512, 32, 128) / 1e9;
  progress.update(2);
  j["disk"] = measure_disk(o.disk_dir, o.disk_mib);
  progress.finish(3);
  const std::string text = j.dump(2);
  std::printf("%s\n", text.c_str());
  if (!o.out.empty()) {
    std::ofstream f(o.out);
    if (!(f << text << "\n")) fail_input("cannot write profile to '{}'", o.out);
  }
  return 0;
}

}  // namespace

Command add_profile(CLI::App& app) {
  auto o = std::make_shared<ProfileOptions>();
  CLI::App* cmd =
      app.add_subcommand("profile", "Measure this node's disk, memory and compute rates (JSON)");
  cmd->add_option("--threads", o->threads, "CPU threads (0: all cores)")->check(thread_count());
  cmd->add_option("--disk-dir", o->disk_dir, "Directory on the disk the offloading tier will use");
  cmd->add_option("--disk-mib", o->disk_mib, "MiB written and read back")->check(positive());
  cmd->add_option("--out", o->out, "Also save the JSON here");
  return {cmd, [o] { return run_profile(*o); }};
}

}  // namespace strata::cli
