// The CPU linear at the shapes of a Llama of stories110M's size (docs/BENCHMARKS.md, "Panel
// GEMM" and "4-bit panels"), through CpuBackend::linear as the engine calls it, in four
// weight layouts (the `layout` argument):
//   0  f32 rows (the GEMV for m <= 16, OpenBLAS's sgemm above)
//   1  f32 panels (kernels/gemm_panel.h)
//   2  4-bit rows, kQ4 (the byte GEMV for m <= 16, f32 panels decoded per call above)
//   3  4-bit panels (kernels/gemm_q4_panel.h; AVX-512 VNNI)
//   bench_gemm --benchmark_format=json            every shape, hot in cache
//   bench_gemm --benchmark_filter=Step            a decode step's matrices streamed from memory
//   bench_gemm --benchmark_filter=ExpertStep      a MoE decode step's experts, m rows each
// STRATA_BENCH_THREADS sets the threads (default 2). Counters: GFLOP/s and weight GB/s, and
// for a step read_bound_fraction (paired with the read stream, kernels/limits.h).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <vector>

#include "kernels/clock.h"
#include "kernels/cpu_backend.h"
#include "kernels/gemm_panel.h"
#include "kernels/gemm_q4_panel.h"
#include "kernels/limits.h"
#include "kernels/quant.h"
#include "kernels/tensor.h"
#include "kernels/tunables.h"

namespace strata {
namespace {

int bench_threads() {
  return static_cast<int>(tunable_int(TunableId::kBenchThreads));
}

CpuBackend& backend() {
  static CpuBackend cpu(bench_threads());
  return cpu;
}

// A [n, k] weight in the layout asked for, with values that keep products finite.
std::unique_ptr<OwnedTensor> make_weight(int64_t n, int64_t k, int64_t layout) {
  std::vector<float> rows(static_cast<size_t>(n * k));
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i % 97) * 1e-3f - 0.05f;
  const DType dtype[] = {DType::kF32, DType::kF32Panel, DType::kQ4, DType::kQ4Panel};
  auto w = std::make_unique<OwnedTensor>(dtype[layout], Shape{n, k});
  if (layout == 0) std::copy(rows.begin(), rows.end(), w->view.as<float>());
  if (layout == 1) pack_panels(rows.data(), n, k, w->view.as<float>());
  if (layout >= 2) {
    const QuantizedTensor q = quantize_4bit(rows.data(), {n, k});
    if (layout == 2) write_q4_blob(q, w->view.data);
    if (layout == 3) pack_q4_panels(q.view(), w->view.as<uint8_t>());
  }
  return w;
}

void report(benchmark::State& state, double flop, double bytes) {
  state.counters["GFLOP/s"] =
      benchmark::Counter(flop * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["weight_GB/s"] =
      benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// args: layout, n, k, m
void BM_Linear(benchmark::State& state) {
  const int64_t layout = state.range(0);
  const int64_t n = state.range(1), k = state.range(2), m = state.range(3);
  const auto w = make_weight(n, k, layout);
  std::vector<float> x(static_cast<size_t>(m * k), 0.25f), y(static_cast<size_t>(m * n));
  for (auto _ : state) {
    backend().linear(x.data(), m, w->view, nullptr, y.data());
    benchmark::DoNotOptimize(y.data());
  }
  report(state, 2.0 * static_cast<double>(m * n * k), static_cast<double>(w->view.bytes()));
}

// Every matrix of `ws` at m rows, each read from memory once a step; the counters as
// report's, and read_bound_fraction: a pass of the read stream over the same bytes after
// each step (untimed) pairs each step with the passes around it (kernels/limits.h).
void time_steps(benchmark::State& state, const std::vector<std::unique_ptr<OwnedTensor>>& ws,
                int64_t m) {
  double flop = 0, bytes = 0;
  int64_t widest = 0;
  for (const auto& w : ws) {
    flop += 2.0 * static_cast<double>(m * w->view.shape.numel());
    bytes += static_cast<double>(w->view.bytes());
    widest = std::max({widest, w->view.shape[0], w->view.shape[1]});
  }
  std::vector<float> x(static_cast<size_t>(m * widest), 0.25f), y(x.size());
  StepPairing pairing(static_cast<size_t>(bytes));
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    for (const auto& w : ws) backend().linear(x.data(), m, w->view, nullptr, y.data());
    benchmark::DoNotOptimize(y.data());
    const double step = seconds_since(t0);
    state.PauseTiming();
    pairing.after_step(step, bytes);
    state.ResumeTiming();
  }
  report(state, flop, bytes);
  state.counters["read_bound_fraction"] = pairing.summary().median_fraction;
}

// A decode step's matrices (12 layers of q, k, v, o, gate, up, down and the head): args
// layout, m, fused (q/k/v as one [2304, 768] matrix and gate/up as one [4096, 768], as a
// loader that fused them would give; on the CPU the engine keeps them apart,
// docs/BENCHMARKS.md "The read bound beside each step").
void BM_Step(benchmark::State& state) {
  const int64_t layout = state.range(0);
  const bool fused = state.range(2) != 0;
  using NK = std::pair<int64_t, int64_t>;
  const std::vector<NK> apart = {{768, 768},  {768, 768},  {768, 768}, {768, 768},
                                 {2048, 768}, {2048, 768}, {768, 2048}};
  const std::vector<NK> joined = {{2304, 768}, {768, 768}, {4096, 768}, {768, 2048}};
  std::vector<std::unique_ptr<OwnedTensor>> ws;
  for (int layer = 0; layer < 12; ++layer)
    for (const auto& [n, k] : fused ? joined : apart) ws.push_back(make_weight(n, k, layout));
  ws.push_back(make_weight(32000, 768, layout));
  time_steps(state, ws, state.range(1));
}

// A decode step's expert matrices of a Mixtral-shaped MoE (scripts/make-moe-bench-model.py's
// mixtral-mini: 8 layers of 8 experts, gate and up [3584, 1024], down [1024, 3584]; 2.8 GB in
// f32), every expert at m rows: a batch of 32 at top-2 of 8 gives each about 8. args
// layout, m.
void BM_ExpertStep(benchmark::State& state) {
  std::vector<std::unique_ptr<OwnedTensor>> ws;
  for (int expert = 0; expert < 8 * 8; ++expert)
    for (const auto& [n, k] : {std::pair<int64_t, int64_t>{3584, 1024}, {3584, 1024}, {1024, 3584}})
      ws.push_back(make_weight(n, k, state.range(0)));
  time_steps(state, ws, state.range(1));
}

void linear_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"layout", "n", "k", "m"});
  for (int64_t layout : {0, 1, 2, 3})
    for (const auto& [n, k] : {std::pair<int64_t, int64_t>{768, 768},
                               {2048, 768},
                               {768, 2048},
                               {32000, 768},
                               {3584, 1024},
                               {1024, 3584}})  // the last two: mixtral-mini's experts
      for (int64_t m : {1, 8, 32, 128}) b->Args({layout, n, k, m});
}

BENCHMARK(BM_Linear)->Apply(linear_args)->UseRealTime()->MinTime(0.2);
BENCHMARK(BM_Step)
    ->ArgNames({"layout", "m", "fused"})
    ->ArgsProduct({{0, 1, 2, 3}, {1, 32}, {0, 1}})
    ->UseRealTime()
    ->MinTime(1.0);

BENCHMARK(BM_ExpertStep)
    ->ArgNames({"layout", "m"})
    ->ArgsProduct({{1, 3}, {1, 4, 8, 12}})
    ->UseRealTime()
    ->MinTime(1.0);

}  // namespace
}  // namespace strata

BENCHMARK_MAIN();
