#include "worker/loader.h"

#include <algorithm>
#include <cmath>

#include "kernels/error.h"
#include "kernels/quant.h"
#include "worker/dummy.h"

namespace strata {
namespace {

double mib(int64_t bytes) {
  return static_cast<double>(bytes) / (1 << 20);
}

// Layer counts per tier from policy shares, rounded to whole layers.
void counts_from_shares(const WeightBudget& b, int32_t n, int32_t& n_gpu, int32_t& n_cpu) {
  const std::vector<Tier> t = tiers_from_shares(n, b.w_gpu_percent, b.w_cpu_percent, "weight");
  n_gpu = static_cast<int32_t>(std::count(t.begin(), t.end(), Tier::kGpu));
  n_cpu = static_cast<int32_t>(std::count(t.begin(), t.end(), Tier::kCpu));
  if (!b.device_compute) {  // the host computes: GPU shares are host-resident too
    n_cpu += n_gpu;
    n_gpu = 0;
  }
}

// Layer counts per tier from the budgets alone: fill the compute tier, then the host.
void counts_from_budgets(const WeightBudget& b, const WeightPlacement& p, int32_t n, int32_t& n_gpu,
                         int32_t& n_cpu) {
  const int64_t L = p.layer_bytes;
  n_gpu = 0;
  if (b.device_compute) {
    if (b.gpu_mem < 0 || p.fixed_bytes + n * L <= b.gpu_mem) {
      n_gpu = n;
    } else {
      n_gpu =
          static_cast<int32_t>(std::clamp<int64_t>((b.gpu_mem - p.fixed_bytes - 2 * L) / L, 0, n));
    }
  }
  const int32_t rest = n - n_gpu;
  const int64_t host_fixed = b.device_compute ? 0 : p.fixed_bytes;
  if (b.cpu_mem < 0 || host_fixed + rest * L <= b.cpu_mem) {
    n_cpu = rest;
  } else {
    n_cpu =
        static_cast<int32_t>(std::clamp<int64_t>((b.cpu_mem - host_fixed - 2 * L) / L, 0, rest));
  }
}

void check_budget(const char* option, int64_t budget, int64_t need, const WeightPlacement& p,
                  const char* what) {
  if (budget < 0 || need <= budget) return;
  fail_input(
      "{} {:.1f} MiB is too small for this weight placement: {} need {:.1f} MiB (short by {:.1f} "
      "MiB; {})",
      option, mib(budget), what, mib(need), mib(need - budget), p.str());
}

// One layer's bytes as stored: matrices in their dtype (or kQ4), vectors in f32.
int64_t layer_bytes_estimate(const ModelConfig& c, bool compress) {
  const int64_t h = c.hidden, qw = c.q_width(), kvw = c.kv_width(), f = c.intermediate;
  struct Mat {
    int64_t rows, cols;
  };
  std::vector<Mat> mats{{qw, h}, {kvw, h}, {kvw, h}, {h, qw}, {f, h}, {h, f}};
  if (c.is_llama()) mats.push_back({f, h});
  int64_t total = 0;
  for (Mat m : mats) {
    Tensor t{nullptr, c.dtype, {m.rows, m.cols}};
    if (compress && m.cols % kQuantGroupSize == 0) t.dtype = DType::kQ4;
    total += static_cast<int64_t>(align_up(t.bytes(), 64));
  }
  const ModelShape s = c.shape();
  const int64_t vector_params =
      s.params_per_layer() -
      (2 * qw * h + 2 * kvw * h + static_cast<int64_t>(mats.size() - 4) * f * h);
  return static_cast<int64_t>(align_up(static_cast<size_t>(total + vector_params * 4)));
}

WeightParts weight_parts(const ModelConfig& full, const LoadOptions& o) {
  const int32_t end = o.layer_end < 0 ? full.n_layers : o.layer_end;
  if (o.layer_begin < 0 || o.layer_begin >= end || end > full.n_layers)
    fail_input("{}: layer range [{}, {}) is not a non-empty part of its {} layers", full.source,
               o.layer_begin, end, full.n_layers);
  return WeightParts{o.layer_begin, end - o.layer_begin, o.embedding, o.head};
}

}  // namespace

int compress_layer(LayerWeights& w, std::vector<std::unique_ptr<OwnedTensor>>& store) {
  int compressed = 0;
  std::vector<float> f32;
  for (Tensor* t : {&w.q, &w.k, &w.v, &w.o, &w.gate, &w.up, &w.down}) {
    if (t->data == nullptr || t->dtype == DType::kQ4 || t->shape[1] % kQuantGroupSize != 0)
      continue;
    const int64_t n = t->shape.numel();
    f32.resize(static_cast<size_t>(n));
    convert_to_f32(t->dtype, t->data, f32.data(), static_cast<size_t>(n));
    const QuantizedTensor q = quantize_4bit(
        f32.data(), {t->shape[0], t->shape[1], kQuantGroupSize, QuantAxis::kAlongRow});
    store.push_back(std::make_unique<OwnedTensor>(DType::kQ4, t->shape));
    write_q4_blob(q, store.back()->storage.data());
    *t = store.back()->view;
    ++compressed;
  }
  return compressed;
}

int32_t WeightPlacement::count(Tier t) const {
  return static_cast<int32_t>(std::count(tiers.begin(), tiers.end(), t));
}

int64_t WeightPlacement::gpu_bytes() const {
  if (!device_compute) return 0;
  return fixed_bytes + count(Tier::kGpu) * layer_bytes + device_staging_bytes;
}

int64_t WeightPlacement::cpu_bytes() const {
  return (device_compute ? 0 : fixed_bytes) + count(Tier::kCpu) * layer_bytes + staging_bytes;
}

std::string WeightPlacement::str() const {
  return fmt::format(
      "WeightPlacement({} compute, layers gpu/cpu/disk {}/{}/{}, fixed {:.1f} MiB, layer {:.1f} "
      "MiB, "
      "device slots {:.1f} MiB, host staging {:.1f} MiB)",
      device_compute ? "device" : "host", count(Tier::kGpu), count(Tier::kCpu), count(Tier::kDisk),
      mib(fixed_bytes), mib(layer_bytes), mib(device_staging_bytes), mib(staging_bytes));
}

WeightPlacement place_weights(const ModelConfig& c, const WeightBudget& b) {
  const ModelShape s = c.shape();
  const int32_t n = c.n_layers;
  WeightPlacement p;
  p.device_compute = b.device_compute;
  p.layer_bytes = layer_bytes_estimate(c, b.compress_weight);
  p.fixed_bytes =
      (s.embedding_params() + s.head_params()) * s.weight_bytes_per_elem + 2 * s.hidden * 4;
  int32_t n_gpu = 0, n_cpu = 0;
  if (b.w_gpu_percent >= 0 || b.w_cpu_percent >= 0) {
    counts_from_shares(b, n, n_gpu, n_cpu);
  } else {
    counts_from_budgets(b, p, n, n_gpu, n_cpu);
  }
  const int32_t n_disk = n - n_gpu - n_cpu;
  if (b.device_compute && n_gpu < n) p.device_staging_bytes = 2 * p.layer_bytes;
  if (n_disk > 0) p.staging_bytes = 2 * p.layer_bytes;

  p.tiers = spread_tiers(n, n_gpu, n_cpu);
  for (int32_t i = 0; i < n; ++i)
    if (p.tiers[static_cast<size_t>(i)] == Tier::kDisk) p.disk_layers.push_back(i);

  if (b.device_compute)
    check_budget("--gpu-mem", b.gpu_mem, p.gpu_bytes(), p,
                 "embeddings, head, GPU-tier layers and two device slots");
  check_budget("--disk-mem", b.disk_mem, p.count(Tier::kDisk) * p.layer_bytes, p,
               "disk-tier layers");
  check_budget("--cpu-mem", b.cpu_mem, p.cpu_bytes(), p,
               b.device_compute ? "CPU-tier layers and disk staging"
                                : "embeddings, head, resident layers and disk staging");
  return p;
}

WeightPlacement place_weights(const ModelConfig& config, int64_t cpu_mem) {
  WeightBudget b;
  b.cpu_mem = cpu_mem;
  return place_weights(config, b);
}

namespace {

LoadedModel load_model_parts(const std::string& spec, const LoadOptions& options) {
  LoadedModel m;
  const bool dummy = is_dummy_model(spec);
  const ModelConfig full = dummy ? dummy_model_config(spec.substr(6), options.dummy_dtype)
                                 : load_model_config(spec, options.limits);
  const WeightParts parts = weight_parts(full, options);
  m.config = full;
  m.config.n_layers = parts.n_layers;
  m.layer_begin = parts.layer_begin;
  WeightBudget budget{options.device != nullptr, options.gpu_mem,       options.cpu_mem,
                      options.w_gpu_percent,     options.w_cpu_percent, options.compress_weight,
                      options.disk_mem};
  m.placement = place_weights(m.config, budget);
  LayerOffloader offloader(m.placement.disk_layers, options.disk_dir);
  if (options.device != nullptr)
    m.feeder = std::make_unique<LayerFeeder>(*options.device, m.placement.tiers, options.overlap);
  LayerSink sink;
  if (m.feeder != nullptr) {
    sink = [&](int32_t i, LayerWeights& w) {
      if (m.placement.tiers[static_cast<size_t>(i)] == Tier::kDisk) {
        offloader(i, w);
      } else {
        m.feeder->take(i, w);
      }
    };
  } else if (!m.placement.disk_layers.empty()) {
    sink = [&](int32_t i, LayerWeights& w) { offloader(i, w); };
  }
  std::vector<std::unique_ptr<OwnedTensor>> compressed;  // kQ4 storage of resident layers
  if (options.compress_weight) {
    sink = [&, place = sink](int32_t i, LayerWeights& w) {
      const size_t mark = compressed.size();
      compress_layer(w, compressed);
      if (place) place(i, w);
      if (w.q.data == nullptr) compressed.resize(mark);  // packed elsewhere: the copy is spent
    };
  }
  if (dummy) {
    m.weights = make_dummy_weights(full, options.dummy_seed, sink, parts);
    m.tokenizer = Tokenizer::ids_only(m.config);
  } else {
    m.weights = load_checkpoint_weights(full, spec, sink, parts,
                                        CheckpointOptions{options.limits, options.check_weights});
    m.tokenizer = Tokenizer::load(spec, m.config, options.limits);
  }
  for (auto& t : compressed) m.weights.owned.push_back(std::move(t));
  auto streamer = offloader.finish(m.weights.layers.size(), options.overlap);
  if (m.feeder != nullptr) {
    m.feeder->finish(std::move(streamer));
    upload_fixed_weights(*options.device, m.weights);
  } else {
    m.streamer = std::move(streamer);
  }
  return m;
}

}  // namespace

LoadedModel load_model(const std::string& spec, const LoadOptions& options) {
  if (spec.empty()) fail_input("no model given: pass a model directory or dummy:NAME");
  return with_oom_context(fmt::format("loading the model {}", spec),
                          [&] { return load_model_parts(spec, options); });
}

}  // namespace strata
