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

// Runs both measurements with `threads` threads (OpenMP + OpenBLAS). Takes about a second.
MachineLimits measure_machine_limits(int threads, int gemm_n = 2048, size_t triad_mib = 256);

}  // namespace strata
