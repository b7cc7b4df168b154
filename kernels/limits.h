// This machine's limits, measured: memory bandwidth (STREAM triad) and BLAS GEMM FLOP/s.
// Benchmarks print their results as a fraction of these, measured in the same run.
#pragma once

#include <string>

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

// Runs both measurements with `threads` threads (OpenMP + OpenBLAS). Takes about a second.
MachineLimits measure_machine_limits(int threads, int gemm_n = 2048, size_t triad_mib = 256);

}  // namespace strata
