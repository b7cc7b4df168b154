#include "kernels/limits.h"

#include <cblas.h>
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <vector>

#include "kernels/cpu_backend.h"
#include "kernels/tensor.h"

namespace strata {
namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double measure_triad_gbs(size_t bytes_total) {
  const size_t n = bytes_total / 3 / sizeof(float);
  Buffer a(n * 4), b(n * 4), c(n * 4);
  float* pa = a.as<float>();
  float* pb = b.as<float>();
  float* pc = c.as<float>();
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; ++i) {
    pb[i] = 1.0f;
    pc[i] = 2.0f;
    pa[i] = 0.0f;
  }
  double best = 1e30;
  for (int rep = 0; rep < 6; ++rep) {
    const double t0 = now_s();
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; ++i) pa[i] = pb[i] + 0.5f * pc[i];
    best = std::min(best, now_s() - t0);
  }
  return static_cast<double>(3 * n * sizeof(float)) / best / 1e9;
}

// Read-only stream (a sum over one large array): the access pattern of a weight GEMV.
double measure_read_gbs(size_t bytes_total) {
  const size_t n = bytes_total / sizeof(float);
  Buffer a(n * 4);
  float* pa = a.as<float>();
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; ++i) pa[i] = 1.0f;
  double best = 1e30;
  volatile float sink = 0.0f;
  for (int rep = 0; rep < 6; ++rep) {
    const double t0 = now_s();
    float total = 0.0f;
#pragma omp parallel for simd schedule(static) reduction(+ : total)
    for (size_t i = 0; i < n; ++i) total += pa[i];
    best = std::min(best, now_s() - t0);
    sink = sink + total;
  }
  return static_cast<double>(n * sizeof(float)) / best / 1e9;
}

double measure_gemm_gflops(int n) {
  const size_t elems = static_cast<size_t>(n) * static_cast<size_t>(n);
  std::vector<float> a(elems, 0.5f), b(elems, 0.25f), c(elems, 0.0f);
  double best = 1e30;
  for (int rep = 0; rep < 4; ++rep) {
    const double t0 = now_s();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, n, 1.0f, a.data(), n, b.data(), n,
                0.0f, c.data(), n);
    best = std::min(best, now_s() - t0);
  }
  return 2.0 * n * static_cast<double>(n) * n / best / 1e9;
}

}  // namespace

std::string MachineLimits::json() const {
  return fmt::format(
      R"({{"threads": {}, "memory_bandwidth_gbs": {:.3f}, "memory_read_gbs": {:.3f}, "gemm_gflops": {:.3f}, "gemm_n": {}}})",
      threads, memory_bandwidth_gbs, memory_read_gbs, gemm_gflops, gemm_n);
}

MachineLimits measure_machine_limits(int threads, int gemm_n, size_t triad_mib) {
  threads = resolve_cpu_threads(threads);
  omp_set_num_threads(threads);
  openblas_set_num_threads(threads);
  MachineLimits m;
  m.threads = threads;
  m.triad_bytes = static_cast<double>(triad_mib) * 1024 * 1024;
  m.memory_bandwidth_gbs = measure_triad_gbs(triad_mib * 1024 * 1024);
  m.memory_read_gbs = measure_read_gbs(triad_mib * 1024 * 1024);
  m.gemm_n = gemm_n;
  m.gemm_gflops = measure_gemm_gflops(gemm_n);
  return m;
}

}  // namespace strata
