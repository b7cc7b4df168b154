#include "kernels/limits.h"

#include <cblas.h>
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <vector>

#include "kernels/backend.h"
#include "kernels/clock.h"
#include "kernels/cpu_backend.h"
#include "kernels/dtype.h"
#include "kernels/error.h"
#include "kernels/tensor.h"

namespace strata {
namespace {

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
  const ReadProbe probe(bytes_total);
  double best = 1e30;
  for (int rep = 0; rep < 6; ++rep) best = std::min(best, probe.pass_seconds());
  return static_cast<double>(probe.bytes()) / best / 1e9;
}

// Linear interpolation between order statistics (numpy's default percentile).
double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  const double at = q * static_cast<double>(v.size() - 1);
  const auto lo = static_cast<size_t>(at);
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (at - static_cast<double>(lo));
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

ReadProbe::ReadProbe(size_t bytes)
    : floats_(bytes / sizeof(float)), buffer_(floats_ * sizeof(float)) {
  if (floats_ == 0)
    fail_input("a read probe needs at least {} bytes, got {}", sizeof(float), bytes);
  float* p = buffer_.as<float>();
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < floats_; ++i) p[i] = 1.0f;
}

double ReadProbe::pass_seconds() const {
  const float* p = buffer_.as<float>();
  const size_t n = floats_;
  const double t0 = now_s();
  float total = 0.0f;
#pragma omp parallel for simd schedule(static) reduction(+ : total)
  for (size_t i = 0; i < n; ++i) total += p[i];
  const double seconds = now_s() - t0;
  volatile float sink = total;  // the sum must be computed
  (void)sink;
  return seconds;
}

std::string PairedReadBound::json() const {
  return fmt::format(
      R"({{"steps": {}, "median_fraction": {:.4f}, "p25_fraction": {:.4f}, "p75_fraction": {:.4f}, "median_probe_gbs": {:.3f}}})",
      steps, median_fraction, p25_fraction, p75_fraction, median_probe_gbs);
}

PairedReadBound paired_read_bound(const std::vector<PairedStep>& steps, double probe_bytes) {
  if (!(probe_bytes > 0))
    fail_input("paired read bound: probe bytes {} must be positive", probe_bytes);
  PairedReadBound r;
  r.steps = static_cast<int64_t>(steps.size());
  if (steps.empty()) return r;
  std::vector<double> fractions, rates;
  for (size_t i = 0; i < steps.size(); ++i) {
    const PairedStep& s = steps[i];
    const double probe = 0.5 * (s.probe_before_seconds + s.probe_after_seconds);
    if (!(s.step_seconds > 0) || !(s.probe_before_seconds > 0) || !(s.probe_after_seconds > 0) ||
        !(s.step_bytes > 0))
      fail_input(
          "paired read bound: step {} read {} bytes in {} s between probe passes of {} s and {} "
          "s; all must be positive",
          i, s.step_bytes, s.step_seconds, s.probe_before_seconds, s.probe_after_seconds);
    // The step's read bound at the rate the probe saw around it, over the step's time.
    fractions.push_back(s.step_bytes * probe / probe_bytes / s.step_seconds);
    rates.push_back(probe_bytes / probe / 1e9);
  }
  r.median_fraction = quantile(fractions, 0.5);
  r.p25_fraction = quantile(fractions, 0.25);
  r.p75_fraction = quantile(fractions, 0.75);
  r.median_probe_gbs = quantile(rates, 0.5);
  return r;
}

StepPairing::StepPairing(size_t probe_bytes)
    : probe_(probe_bytes), last_pass_seconds_(probe_.pass_seconds()) {}

void StepPairing::after_step(double seconds, double bytes, bool record) {
  const double pass = probe_.pass_seconds();
  if (record) steps_.push_back({seconds, last_pass_seconds_, pass, bytes});
  last_pass_seconds_ = pass;
}

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

namespace {

// Best of three timed copies of `bytes` (after one warm-up), in GB/s.
double copy_gbs(Backend& b, void* dst, const void* src, size_t bytes, CopyKind kind) {
  double best = 0;
  for (int i = 0; i < 4; ++i) {
    b.synchronize();
    const double t0 = now_s();
    b.copy(dst, src, bytes, kind);
    b.synchronize();
    if (i > 0) best = std::max(best, static_cast<double>(bytes) / (now_s() - t0) / 1e9);
  }
  return best;
}

// The backend's linear over f16 weights [n, n] with m rows, best of five (after one
// warm-up), in TFLOP/s. The weights go into `weights` (device memory of n * n * 2 bytes or
// more): their values do not matter for timing, zeros excepted.
double linear_f16_tflops(Backend& b, void* weights, int64_t n, int64_t m) {
  std::vector<uint16_t> values(static_cast<size_t>(n * n), f32_to_f16(0.001f));
  b.copy(weights, values.data(), values.size() * 2, CopyKind::kHostToDevice);
  const Tensor w{weights, DType::kF16, {n, n}, b.device()};
  std::vector<float> xs(static_cast<size_t>(m * n), 0.5f);
  DeviceBuffer x(b, xs.size() * 4), y(b, static_cast<size_t>(m * n) * 4);
  b.copy(x.data(), xs.data(), xs.size() * 4, CopyKind::kHostToDevice);
  double best = 0;
  for (int i = 0; i < 6; ++i) {
    b.synchronize();
    const double t0 = now_s();
    b.linear(x.f32(), m, w, nullptr, y.f32());
    b.synchronize();
    if (i > 0) best = std::max(best, 2.0 * m * n * n / (now_s() - t0) / 1e12);
  }
  return best;
}

}  // namespace

DeviceLimits measure_device_limits(Backend& b) {
  const size_t bytes = size_t{512} << 20;
  DeviceBuffer host = DeviceBuffer::host(b, bytes);
  DeviceBuffer d1(b, bytes), d2(b, bytes);
  DeviceLimits l;
  l.host_to_device_gbs = copy_gbs(b, d1.data(), host.data(), bytes, CopyKind::kHostToDevice);
  l.device_memory_gbs = 2 * copy_gbs(b, d2.data(), d1.data(), bytes, CopyKind::kDeviceToDevice);
  // A GEMM's shape: f16 weights [8192, 8192] (in d1, reused), 1024 rows.
  l.linear_f16_tflops = linear_f16_tflops(b, d1.data(), 8192, 1024);
  return l;
}

}  // namespace strata
