// What ExeGPT's XProfiler measures (§3) and XSimulator reads: per worker rank, the time of
// one of its layers for a prefill step (over rows x sequence length) and a decode step
// (over sequences x context), the embedding and the head, and the cost of moving
// activations between stages. Measured on the workers under their real placement
// (stage_worker.cpp, `strata profile-layers`), or modelled from a node description for
// clusters that are not here (NodeModel: a roofline of FLOP/s and memory bandwidth).
// Saved as JSON keyed by model, dtype, placement and hosts, and reused when they match.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "placement/model_shape.h"

namespace strata {

// Seconds at the points of a grid over one or two coordinates, interpolated linearly in
// each (bilinearly for two) and extrapolated linearly from the outermost two points; a
// query outside the measured points says so (`outside`), never fails.
class TimeGrid {
 public:
  TimeGrid() = default;
  // seconds[i * ys.size() + j] at (xs[i], ys[j]); xs and ys strictly ascending. A 1-D grid
  // has ys = {0}.
  TimeGrid(std::vector<double> xs, std::vector<double> ys, std::vector<double> seconds);
  static TimeGrid curve(std::vector<double> xs, std::vector<double> seconds);

  double at(double x, double y, bool* outside = nullptr) const;
  double at(double x, bool* outside = nullptr) const { return at(x, 0, outside); }
  bool empty() const { return xs_.empty(); }
  const std::vector<double>& xs() const { return xs_; }
  const std::vector<double>& ys() const { return ys_; }
  const std::vector<double>& seconds() const { return t_; }

  nlohmann::json to_json() const;
  static TimeGrid from_json(const nlohmann::json& j, const std::string& where);

 private:
  std::vector<double> xs_, ys_, t_;
};

// One worker rank as measured (or modelled).
struct RankProfile {
  int32_t rank = 0;
  std::string host;
  TimeGrid prefill;  // one layer: x = rows of the step, y = sequence length at its end
  TimeGrid decode;   // one layer: x = sequences (one row each), y = context length
  TimeGrid embed;    // the embedding of x rows (measured on the rank that holds it)
  TimeGrid head;     // final norm and LM head for x sampled rows (on the rank that holds it)
};

// Moving x bytes of activations from one stage to the next.
struct LinkProfile {
  double latency_s = 0;
  double seconds_per_byte = 0;
  double time(double bytes) const { return bytes <= 0 ? 0 : latency_s + bytes * seconds_per_byte; }
};

struct ClusterProfile {
  std::string model;      // the model spec
  std::string dtype;      // weights as stored
  std::string placement;  // the offloading policy the workers ran (how a layer cost what it did)
  std::vector<std::string> hosts;  // per rank, in rank order
  std::vector<RankProfile> ranks;  // ranks 1..N
  LinkProfile link;
  // The coordinator's turn per step (commands out, the result back, the scheduler and the
  // results written), beyond the stages' compute and links: fixed plus per row of the step.
  double step_overhead_s = 0;
  double step_overhead_per_row_s = 0;
  double step_overhead(double rows) const {
    return step_overhead_s + rows * step_overhead_per_row_s;
  }
  bool modelled = false;  // from a NodeModel, not measured
  std::string source;     // where it came from (a file, "measured", "modelled a40")

  int32_t workers() const { return static_cast<int32_t>(ranks.size()); }
  // The match key: model, dtype, placement and hosts.
  std::string key() const;
  bool matches(const ClusterProfile& other) const { return key() == other.key(); }

  nlohmann::json to_json() const;
  static ClusterProfile from_json(const nlohmann::json& j, const std::string& source);
  static ClusterProfile load(const std::string& path);
  void save(const std::string& path) const;
  std::string str() const;
};

// A worker's hardware as a roofline, for clusters modelled rather than measured (`strata
// plan --nodes N`): each step costs max(FLOPs / flops, bytes / memory_bandwidth) plus a
// fixed per-layer overhead.
struct NodeModel {
  std::string name;
  double flops = 0;             // achievable GEMM FLOP/s of one worker
  double memory_bandwidth = 0;  // achievable bytes/s reading weights and KV cache
  double memory_bytes = 0;      // memory for weights, KV cache and buffers per worker
  double link_bandwidth = 0;    // between workers, bytes/s
  double link_latency_s = 0;
  double layer_overhead_s = 0;  // per layer and step: kernel launches, synchronisation
  bool device = true;           // computes on an accelerator (else on the host)

  // "a40" (the paper's A40 cluster: PCIe 4.0 nodes, 100 Gb InfiniBand), "a100", "h100".
  static NodeModel preset(const std::string& name);
  // A worker computing on the host at `flops` and `memory_bandwidth` (what `strata plan`
  // measures on this machine): 16 GiB for its stage, a link as fast as Open MPI's shared
  // memory on one machine (ENVIRONMENT.md: 5-6 GB/s) and OpenMP's fork and join of a
  // layer's ops as its per-layer overhead.
  static NodeModel host_worker(const std::string& name, double flops, double memory_bandwidth);
  static NodeModel from_json(const nlohmann::json& j, const std::string& source);
  // A preset name or a JSON file.
  static NodeModel parse(const std::string& spec);
  nlohmann::json to_json() const;
  std::string str() const;
};

// Grid points a profile measures (or models): prefill rows x lengths, decode sequences x
// contexts, embedding and head rows. Sized from the run's limits: rows up to max_rows,
// sequences up to max_seqs, lengths and contexts up to max_context.
struct ProfileGrid {
  std::vector<int32_t> prefill_rows, prefill_lengths;
  std::vector<int32_t> decode_seqs, decode_contexts;
  std::vector<int32_t> embed_rows, head_rows;

  static ProfileGrid for_limits(int32_t max_rows, int32_t max_seqs, int32_t max_context);
  int64_t points() const;
};

// The profile a NodeModel predicts for `workers` identical workers running `shape` with
// weights of `weight_bytes_per_elem` and the engine's f32 KV cache.
ClusterProfile modelled_profile(const ModelShape& shape, const std::string& model,
                                const NodeModel& node, int32_t workers, const ProfileGrid& grid);

}  // namespace strata
