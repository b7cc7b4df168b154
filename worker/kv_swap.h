// Pie's per-layer KV-cache swapping on a device-compute stage (papers/pie.md §3), executed
// with the backend's asynchronous transfers. Each logical layer's K and V live either in
// one of the device's layer buffers or in one of the host's, as the mapping table
// (placement/pie.h) says. When layer i begins, the hottest host layer starts swapping in
// and the coldest GPU layer swapping out by §3.3's protocol; layer i's compute waits until
// its own swap-in has completed. With adaptive expansion the controller of §3.4.2 picks m
// between steps; the layers move through later swaps, never touching a live sequence's
// positions. Buffers are allocated once: the device n - m layers (the lowest m the
// controller may choose), the host m + 2 (m on the host, one arriving, one leaving).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "placement/pie.h"
#include "placement/tier.h"

namespace strata {

struct KvSwapStats {
  int32_t host_layers = 0;  // m now
  double expansion = 1;     // n / (n - m)
  int64_t swap_ins = 0;
  int64_t swap_outs = 0;
  int64_t early_swap_ins = 0;  // of the next step's layers (§3.4.2's violations)
  int64_t bytes_in = 0;        // host -> device
  int64_t bytes_out = 0;       // device -> host
  double stall_seconds = 0;    // the host waiting for a swap before a layer could compute
  int64_t adjustments = 0;     // changes of m by the controller
  int64_t steps = 0;
  // What the swaps run over, as KvSwap sized it: one layer's K (or V) and the buffers.
  int64_t layer_bytes = 0;
  PieBuffers buffers;
  std::string str() const;
  std::string json() const;  // the counters above as one JSON object
};

class KvSwap {
 public:
  // `layer_bytes`: one layer's K (and again its V) as the cache stores it.
  KvSwap(Backend& backend, int32_t n_layers, size_t layer_bytes, const PieOptions& options);
  ~KvSwap();
  KvSwap(const KvSwap&) = delete;
  KvSwap& operator=(const KvSwap&) = delete;

  // Layer i's K and V in device memory. Only once its swap-in has completed (after
  // begin_layer(i)): a layer still on the host or in transit is a broken precondition.
  void* k(int32_t layer) const;
  void* v(int32_t layer) const;

  // Before layer i's compute is enqueued: the swaps §3.3 starts now, then the wait (a
  // stall) until layer i is on the device.
  void begin_layer(int32_t layer);
  // After the step's last layer: the step's observation goes to the controller, whose m
  // holds from the next step.
  void end_step();

  // Between steps, for copies of a slot (KV hand-over): every swap under way completes, and
  // the layer's K and V are where the table says, on the device or in host memory.
  struct Location {
    std::byte* k = nullptr;
    std::byte* v = nullptr;
    bool device = false;
  };
  Location settle(int32_t layer);

  const PieMappingTable& table() const { return table_; }
  const PieOptions& options() const { return options_; }
  KvSwapStats stats() const;
  TierBytes memory() const;  // the device's layer buffers and the host's

 private:
  using Clock = std::chrono::steady_clock;
  struct Swap {
    int32_t layer = -1;
    TransferTicket ticket;
  };
  void poll();
  void start(const PieSwapDecision& d);
  void finish_in(bool wait);
  void finish_out(bool wait);
  std::byte* device_ptr(int32_t layer) const;
  std::byte* host_ptr(int32_t layer) const;

  Backend& backend_;
  PieOptions options_;
  size_t layer_bytes_;
  PieBuffers buffers_;
  size_t stride_;  // K at 0, V at stride_ in each buffer
  PieMappingTable table_;
  std::unique_ptr<PieExpansionController> controller_;
  std::vector<DeviceBuffer> device_, host_;
  std::vector<int32_t> device_of_, host_of_;  // per layer: its buffer, or -1
  std::vector<int32_t> free_device_, free_host_;
  Swap in_, out_;
  KvSwapStats stats_;
  // This step's observation.
  Clock::time_point step_start_;
  bool in_step_ = false;
  double step_stall_ = 0;
  int32_t step_ins_ = 0;
  int32_t step_early_ = 0;
};

}  // namespace strata
