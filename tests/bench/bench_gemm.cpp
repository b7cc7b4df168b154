// The CPU linear at the shapes of a Llama of stories110M's size (docs/BENCHMARKS.md, "Panel
// GEMM"): row-major f32 weights (the GEMV for m <= 16, OpenBLAS's sgemm above) against the
// same weights packed into panels (kernels/gemm_panel.h), through CpuBackend::linear as the
// engine calls it.
//   bench_gemm --benchmark_format=json            every shape, hot in cache
//   bench_gemm --benchmark_filter=Step            a decode step's 85 matrices streamed from memory
// STRATA_BENCH_THREADS sets the threads (default 2). Counters: GFLOP/s and weight GB/s.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <memory>
#include <vector>

#include "kernels/cpu_backend.h"
#include "kernels/gemm_panel.h"
#include "kernels/tensor.h"

namespace strata {
namespace {

int bench_threads() {
  const char* t = std::getenv("STRATA_BENCH_THREADS");
  return t != nullptr ? std::atoi(t) : 2;
}

CpuBackend& backend() {
  static CpuBackend cpu(bench_threads());
  return cpu;
}

// A [n, k] weight in the layout asked for, with values that keep products finite.
std::unique_ptr<OwnedTensor> make_weight(int64_t n, int64_t k, bool panels) {
  std::vector<float> rows(static_cast<size_t>(n * k));
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i % 97) * 1e-3f - 0.05f;
  auto w = std::make_unique<OwnedTensor>(panels ? DType::kF32Panel : DType::kF32, Shape{n, k});
  if (panels) {
    pack_panels(rows.data(), n, k, w->view.as<float>());
  } else {
    std::copy(rows.begin(), rows.end(), w->view.as<float>());
  }
  return w;
}

void report(benchmark::State& state, double flop, double bytes) {
  state.counters["GFLOP/s"] =
      benchmark::Counter(flop * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["weight_GB/s"] =
      benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// args: panels (0/1), n, k, m
void BM_Linear(benchmark::State& state) {
  const bool panels = state.range(0) != 0;
  const int64_t n = state.range(1), k = state.range(2), m = state.range(3);
  const auto w = make_weight(n, k, panels);
  std::vector<float> x(static_cast<size_t>(m * k), 0.25f), y(static_cast<size_t>(m * n));
  for (auto _ : state) {
    backend().linear(x.data(), m, w->view, nullptr, y.data());
    benchmark::DoNotOptimize(y.data());
  }
  report(state, 2.0 * static_cast<double>(m * n * k), 4.0 * static_cast<double>(n * k));
}

// A decode step's matrices (12 layers of q, k, v, o, gate, up, down and the head), each
// read from memory once per step: args panels (0/1), m.
void BM_Step(benchmark::State& state) {
  const bool panels = state.range(0) != 0;
  const int64_t m = state.range(1);
  std::vector<std::unique_ptr<OwnedTensor>> ws;
  double flop = 0, bytes = 0;
  for (int layer = 0; layer < 12; ++layer)
    for (const auto& [n, k] : {std::pair<int64_t, int64_t>{768, 768},
                               {768, 768},
                               {768, 768},
                               {768, 768},
                               {2048, 768},
                               {2048, 768},
                               {768, 2048}})
      ws.push_back(make_weight(n, k, panels));
  ws.push_back(make_weight(32000, 768, panels));
  for (const auto& w : ws) {
    flop += 2.0 * static_cast<double>(m * w->view.shape.numel());
    bytes += static_cast<double>(w->view.bytes());
  }
  std::vector<float> x(static_cast<size_t>(m * 2048), 0.25f), y(static_cast<size_t>(m * 32000));
  for (auto _ : state) {
    for (const auto& w : ws) backend().linear(x.data(), m, w->view, nullptr, y.data());
    benchmark::DoNotOptimize(y.data());
  }
  report(state, flop, bytes);
}

void linear_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"panels", "n", "k", "m"});
  for (int64_t panels : {0, 1})
    for (const auto& [n, k] :
         {std::pair<int64_t, int64_t>{768, 768}, {2048, 768}, {768, 2048}, {32000, 768}})
      for (int64_t m : {1, 8, 32, 128}) b->Args({panels, n, k, m});
}

BENCHMARK(BM_Linear)->Apply(linear_args)->UseRealTime()->MinTime(0.2);
BENCHMARK(BM_Step)
    ->ArgNames({"panels", "m"})
    ->ArgsProduct({{0, 1}, {1, 32}})
    ->UseRealTime()
    ->MinTime(1.0);

}  // namespace
}  // namespace strata

BENCHMARK_MAIN();
