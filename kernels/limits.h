// This machine's limits, measured: memory bandwidth (STREAM triad) and BLAS GEMM FLOP/s.
// Benchmarks print their results as a fraction of these, measured in the same run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/tensor.h"

namespace strata {

struct MachineLimits {
  int threads = 0;
  double memory_bandwidth_gbs =
      0;                       // triad a[i] = b[i] + s * c[i], bytes = 3 arrays (no write-allocate)
  double memory_read_gbs = 0;  // read-only stream, the pattern of a weight GEMV
  double gemm_gflops = 0;      // sgemm n x n x n, best of several
  int gemm_n = 0;
  double triad_bytes = 0;

  std::string json() const;
};

// One pass of the read-only stream over a buffer of its own, on demand: the read bound
// measured next to the work it bounds. A shared machine's bandwidth drifts by half within
// a minute, so a step timed beside a probe of the same bytes says more than a step against
// a figure taken before the run.
class ReadProbe {
 public:
  explicit ReadProbe(size_t bytes);  // allocates and touches `bytes` (whole floats)

  double pass_seconds() const;  // one timed pass over the buffer, on the current OpenMP threads
  size_t bytes() const { return floats_ * sizeof(float); }

 private:
  size_t floats_;
  Buffer buffer_;
};

// A step timed between two probe passes (the one just before it and the one just after),
// with the bytes it must read: its weights, and in a decode step the KV cache it attends
// over.
struct PairedStep {
  double step_seconds = 0, probe_before_seconds = 0, probe_after_seconds = 0;
  double step_bytes = 0;
};

// A step is bounded by its bytes at the rate of its two passes (probe_bytes over their mean
// time); its fraction is that bound over its own time, and the summary is the fractions'
// quartiles.
struct PairedReadBound {
  int64_t steps = 0;
  double median_fraction = 0, p25_fraction = 0, p75_fraction = 0;
  double median_probe_gbs = 0;  // the probe's own rate, bytes / mean pass seconds

  std::string json() const;
};
PairedReadBound paired_read_bound(const std::vector<PairedStep>& steps, double probe_bytes);

// Steps as they run, each between two probe passes: one pass now, one after every step.
class StepPairing {
 public:
  explicit StepPairing(size_t probe_bytes);

  // The pass after a step of `bytes` that took `seconds`. A step that must not count (a
  // prefill among decode steps) is not recorded, but still gets its pass: the next step's
  // pass before.
  void after_step(double seconds, double bytes, bool record = true);

  std::vector<PairedStep>& steps() { return steps_; }  // to add bytes known only later
  double probe_bytes() const { return static_cast<double>(probe_.bytes()); }
  PairedReadBound summary() const { return paired_read_bound(steps_, probe_bytes()); }

 private:
  ReadProbe probe_;
  double last_pass_seconds_;
  std::vector<PairedStep> steps_;
};

// Runs both measurements with `threads` threads (OpenMP + OpenBLAS). Takes about a second.
MachineLimits measure_machine_limits(int threads, int gemm_n = 2048, size_t triad_mib = 256);

class Backend;

// An accelerator's side of the bounds, measured through its backend: host -> device over
// page-locked memory (what the layer feeder's transfers use), device memory bandwidth (read
// plus write of a device copy) and the peak of the backend's own linear over f16 weights.
struct DeviceLimits {
  double host_to_device_gbs = 0;
  double device_memory_gbs = 0;
  double linear_f16_tflops = 0;
};

// Allocates 512 MiB twice on the device, once page-locked on the host, and the linear's
// operands; takes a few seconds.
DeviceLimits measure_device_limits(Backend& backend);

}  // namespace strata
