// CPU decode attention at the shape of a Llama of stories110M's size (12 heads of 64, the
// positions of a prompt of 128 generating 64: docs/BENCHMARKS.md, "The read bound beside
// each step"), through CpuBackend::attention as the engine calls it. Each iteration runs
// one layer of `layers` in turn, so with the default 48 the K/V rows come from memory as
// they do in a step (the weights between two layers' attention flush every cache).
// Counters: KV GB/s and read_bound_fraction, the iteration against passes of the read
// stream around it (kernels/limits.h StepPairing; the probe reads 64 MiB, twice this
// machine's L3, so it streams from memory, and the bound scales to the KV bytes).
//   bench_attention --benchmark_format=json
// STRATA_BENCH_THREADS sets the threads (default 2).
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdlib>
#include <utility>
#include <vector>

#include "kernels/clock.h"
#include "kernels/cpu_backend.h"
#include "kernels/dtype.h"
#include "kernels/limits.h"
#include "kernels/quant.h"
#include "kernels/tensor.h"
#include "kernels/tunables.h"

namespace strata {
namespace {

int bench_threads() {
  return static_cast<int>(tunable_int(TunableId::kBenchThreads));
}

// Times `attend(layer)` once per iteration over the layers in turn, each between passes of
// the read stream (StepPairing), and reports KV GB/s and the read-bound fraction of `bytes`
// (a layer's K and V as stored).
template <class Attend>
void time_layers(benchmark::State& state, int32_t layers, double bytes, Attend attend) {
  StepPairing pairing(size_t{64} << 20);
  int32_t layer = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    attend(layer);
    const double s = seconds_since(t0);
    layer = (layer + 1) % layers;
    state.PauseTiming();
    pairing.after_step(s, bytes);
    state.ResumeTiming();
  }
  state.counters["kv_GB/s"] =
      benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["read_bound_fraction"] = pairing.summary().median_fraction;
}

// args: batch (sequences, one decode row each), context (positions read), layers, f16 (0:
// an f32 cache, 1: f16, policy cf16)
void BM_DecodeAttention(benchmark::State& state) {
  static CpuBackend cpu(bench_threads());
  const auto batch = static_cast<int32_t>(state.range(0));
  const auto ctx = static_cast<int32_t>(state.range(1));
  const auto layers = static_cast<int32_t>(state.range(2));
  const DType dtype = state.range(3) != 0 ? DType::kF16 : DType::kF32;
  const AttentionDims dims{12, 12, 64, 0.125f};
  const KvLayerView shape{nullptr, nullptr, batch, ctx, dims.n_kv_heads, dims.head_dim, dtype};
  const size_t layer_bytes = shape.tensor_bytes();
  std::vector<float> kf(shape.slot_stride() * static_cast<size_t>(batch * layers));
  std::vector<float> vf(kf.size());
  for (size_t i = 0; i < kf.size(); ++i) {
    kf[i] = static_cast<float>(i % 89) * 1e-2f - 0.4f;
    vf[i] = static_cast<float>(i % 83) * 1e-2f - 0.4f;
  }
  std::vector<std::byte> k(layer_bytes * static_cast<size_t>(layers)), v(k.size());
  for (size_t i = 0; i < kf.size(); ++i) {  // as the cache stores them
    if (dtype == DType::kF16) {
      reinterpret_cast<uint16_t*>(k.data())[i] = f32_to_f16(kf[i]);
      reinterpret_cast<uint16_t*>(v.data())[i] = f32_to_f16(vf[i]);
    } else {
      reinterpret_cast<float*>(k.data())[i] = kf[i];
      reinterpret_cast<float*>(v.data())[i] = vf[i];
    }
  }
  const int64_t width = int64_t{dims.n_heads} * dims.head_dim;
  std::vector<float> q(static_cast<size_t>(batch * width), 0.1f), out(q.size());
  std::vector<SeqSlice> seqs;
  for (int32_t b = 0; b < batch; ++b) seqs.push_back({b, 1, ctx - 1, b});
  time_layers(state, layers, 2.0 * static_cast<double>(layer_bytes), [&](int32_t layer) {
    KvLayerView c = shape;
    c.k = k.data() + layer_bytes * static_cast<size_t>(layer);
    c.v = v.data() + layer_bytes * static_cast<size_t>(layer);
    cpu.attention(q.data(), StepRows(seqs), c, dims, out.data());
    benchmark::DoNotOptimize(out.data());
  });
}

BENCHMARK(BM_DecodeAttention)
    ->ArgNames({"batch", "ctx", "layers", "f16"})
    ->ArgsProduct({{1, 8, 32}, {160, 512}, {48}, {0, 1}})
    ->UseRealTime()
    ->MinTime(0.5);

// The same shape over a 4-bit cache (policy cc=1; groups of 64 along head_dim), each slot
// holding exactly ctx positions. whole_layer 0: attention_q4, which dequantises each task's
// rows as it goes; 1: what the engine did before it, kv_dequantize of the whole layer into
// an f32 copy and then attention over that. With capacity = ctx the whole layer is only the
// positions read, the least that path ever dequantises. Counters as above, with the bytes
// those of the 4-bit cache.
void BM_DecodeAttentionQ4(benchmark::State& state) {
  static CpuBackend cpu(bench_threads());
  const auto batch = static_cast<int32_t>(state.range(0));
  const auto ctx = static_cast<int32_t>(state.range(1));
  const auto layers = static_cast<int32_t>(state.range(2));
  const bool whole_layer = state.range(3) != 0;
  const AttentionDims dims{12, 12, 64, 0.125f};
  const KvQ4LayerView shape{nullptr,
                            nullptr,
                            batch,
                            ctx,
                            dims.n_kv_heads,
                            dims.head_dim,
                            KvQ4LayerView::group_for(dims.head_dim)};
  const size_t layer_bytes = shape.tensor_bytes();
  std::vector<uint8_t> k(layer_bytes * static_cast<size_t>(layers)), v(k.size());
  const size_t n = shape.rows() * static_cast<size_t>(shape.head_dim);
  std::vector<float> kf(n), vf(n);
  for (int32_t l = 0; l < layers; ++l) {
    for (size_t i = 0; i < n; ++i) {
      kf[i] = static_cast<float>((i + static_cast<size_t>(l)) % 89) * 1e-2f - 0.4f;
      vf[i] = static_cast<float>((i + static_cast<size_t>(l)) % 83) * 1e-2f - 0.4f;
    }
    for (auto [x, blob] : {std::pair{&kf, &k}, std::pair{&vf, &v}}) {
      uint8_t* codes = blob->data() + layer_bytes * static_cast<size_t>(l);
      auto* mins = reinterpret_cast<float*>(codes + shape.codes_bytes());
      float* scales = mins + shape.groups();
      for (size_t g = 0; g < shape.groups(); ++g)
        quantize_group(x->data() + g * static_cast<size_t>(shape.group), shape.group,
                       codes + g * static_cast<size_t>(shape.group) / 2, mins + g, scales + g);
    }
  }
  const KvLayerView f32{nullptr, nullptr, batch, ctx, dims.n_kv_heads, dims.head_dim};
  std::vector<float> work_k(whole_layer ? n : 0), work_v(work_k.size());
  const int64_t width = int64_t{dims.n_heads} * dims.head_dim;
  std::vector<float> q(static_cast<size_t>(batch * width), 0.1f), out(q.size());
  std::vector<SeqSlice> seqs;
  for (int32_t b = 0; b < batch; ++b) seqs.push_back({b, 1, ctx - 1, b});
  time_layers(state, layers, 2.0 * static_cast<double>(layer_bytes), [&](int32_t layer) {
    KvQ4LayerView c = shape;
    c.k = k.data() + layer_bytes * static_cast<size_t>(layer);
    c.v = v.data() + layer_bytes * static_cast<size_t>(layer);
    if (whole_layer) {
      KvLayerView w = f32;
      w.k = work_k.data();
      w.v = work_v.data();
      cpu.kv_dequantize(c, w);
      cpu.attention(q.data(), StepRows(seqs), w, dims, out.data());
    } else {
      cpu.attention_q4(q.data(), StepRows(seqs), c, dims, out.data());
    }
    benchmark::DoNotOptimize(out.data());
  });
}

BENCHMARK(BM_DecodeAttentionQ4)
    ->ArgNames({"batch", "ctx", "layers", "whole_layer"})
    ->ArgsProduct({{1, 8, 32}, {160, 512}, {48}, {0, 1}})
    ->UseRealTime()
    ->MinTime(0.5);

}  // namespace
}  // namespace strata

BENCHMARK_MAIN();
