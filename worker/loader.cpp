#include "worker/loader.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "kernels/cpu_isa.h"
#include "kernels/error.h"
#include "kernels/gemm_panel.h"
#include "kernels/gemm_q4_panel.h"
#include "kernels/quant.h"
#include "placement/layer_linears.h"
#include "worker/dummy.h"

namespace strata {
namespace {

WeightParts weight_parts(const ModelConfig& full, const LoadOptions& o) {
  const int32_t end = o.layer_end < 0 ? full.n_layers : o.layer_end;
  if (o.layer_begin < 0 || o.layer_begin >= end || end > full.n_layers)
    fail_input("{}: layer range [{}, {}) is not a non-empty part of its {} layers", full.source,
               o.layer_begin, end, full.n_layers);
  return WeightParts{o.layer_begin, end - o.layer_begin, o.embedding,
                     o.head,        o.tp_index,          o.tp_degree};
}

}  // namespace

namespace {

using MatrixConvert = bool (*)(Tensor& t, std::vector<std::unique_ptr<OwnedTensor>>& store,
                               std::vector<float>& f32);

// One matrix to kQ4 storage appended to `store`; false (left as it is) when absent, already
// packed, or its rows are not whole groups.
bool compress_matrix(Tensor& t, std::vector<std::unique_ptr<OwnedTensor>>& store,
                     std::vector<float>& f32) {
  if (t.data == nullptr || t.dtype == DType::kQ4 || t.dtype == DType::kF32Panel ||
      !compressible(t.shape[1]))
    return false;
  const int64_t n = t.shape.numel();
  f32.resize(static_cast<size_t>(n));
  convert_to_f32(t.dtype, t.data, f32.data(), static_cast<size_t>(n));
  const QuantizedTensor q =
      quantize_4bit(f32.data(), {t.shape[0], t.shape[1], kQuantGroupSize, QuantAxis::kAlongRow});
  store.push_back(std::make_unique<OwnedTensor>(DType::kQ4, t.shape));
  write_q4_blob(q, store.back()->storage.data());
  t = store.back()->view;
  return true;
}

// One matrix repacked for the host's kernels, appended to `store`: f32 into the GEMM's
// panels (kernels/gemm_panel.h), 4-bit into the 4-bit panels where the CPU runs their kernel
// (kernels/gemm_q4_panel.h). False (left as it is) when absent or neither. A mapped
// checkpoint's pages of an f32 original go back to the kernel; a 4-bit original made in
// `store` leaves it (one in another owner's list is freed by that owner).
bool pack_matrix(Tensor& t, std::vector<std::unique_ptr<OwnedTensor>>& store,
                 std::vector<float>& /*unused*/) {
  if (t.data == nullptr || t.shape.rank != 2) return false;
  if (t.dtype == DType::kQ4 && q4_panels_pay(active_cpu_isa())) {
    const void* original = t.data;
    store.push_back(std::make_unique<OwnedTensor>(DType::kQ4Panel, t.shape));
    pack_q4_panels(q4_view(t), store.back()->storage.as<uint8_t>());
    t = store.back()->view;
    std::erase_if(store,
                  [&](const std::unique_ptr<OwnedTensor>& o) { return o->view.data == original; });
    return true;
  }
  if (t.dtype != DType::kF32) return false;
  store.push_back(std::make_unique<OwnedTensor>(DType::kF32Panel, t.shape));
  pack_panels(t.as<const float>(), t.shape[0], t.shape[1], store.back()->storage.as<float>());
  drop_mapped_pages(t);
  t = store.back()->view;
  return true;
}

int convert_layer(LayerWeights& w, std::vector<std::unique_ptr<OwnedTensor>>& store,
                  MatrixConvert convert) {
  int converted = 0;
  std::vector<float> f32;
  for (LinearSlot slot : kAllLinearSlots)
    converted += convert(w.*slot_weight_member(slot), store, f32);
  return converted;
}

// The matrices outside the layers: the projections, the head, and the embedding where
// `embedding` asks for it (a tied head is the embedding: both change together).
int convert_fixed(ModelWeights& w, bool embedding, MatrixConvert convert) {
  const bool tied = w.lm_head.data != nullptr && w.lm_head.data == w.embed.data;
  std::vector<Tensor*> targets{&w.project_in, &w.project_out};
  if (embedding || tied) targets.push_back(&w.embed);
  if (!tied) targets.push_back(&w.lm_head);
  std::vector<std::unique_ptr<OwnedTensor>> made;
  std::vector<const void*> replaced;
  std::vector<float> f32;
  int converted = 0;
  for (Tensor* t : targets) {
    const void* before = t->data;
    if (!convert(*t, made, f32)) continue;
    replaced.push_back(before);
    ++converted;
  }
  if (tied) w.lm_head = w.embed;
  // Generated or converted originals are spent (a checkpoint's stay mapped).
  std::erase_if(w.owned, [&](const std::unique_ptr<OwnedTensor>& o) {
    return std::find(replaced.begin(), replaced.end(), o->view.data) != replaced.end();
  });
  for (auto& t : made) w.owned.push_back(std::move(t));
  return converted;
}

}  // namespace

int compress_layer(LayerWeights& w, std::vector<std::unique_ptr<OwnedTensor>>& store) {
  return convert_layer(w, store, compress_matrix);
}

int compress_fixed(ModelWeights& w) {
  return convert_fixed(w, true, compress_matrix);
}

int pack_layer(LayerWeights& w, std::vector<std::unique_ptr<OwnedTensor>>& store) {
  return convert_layer(w, store, pack_matrix);
}

int pack_fixed(ModelWeights& w) {
  return convert_fixed(w, false, pack_matrix);
}

bool cpu_panels_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("STRATA_CPU_WEIGHTS");
    if (v == nullptr || *v == '\0' || std::strcmp(v, "panels") == 0) return true;
    if (std::strcmp(v, "rows") == 0) return false;
    fail_input("STRATA_CPU_WEIGHTS='{}': expected panels or rows", v);
  }();
  return enabled;
}

StageRequest weight_request(const LoadOptions& o) {
  StageRequest r;
  r.layer_begin = o.layer_begin;
  r.layer_end = o.layer_end;
  r.embedding = o.embedding;
  r.head = o.head;
  r.device_compute = o.device != nullptr;
  r.budgets = TierBudgets{o.gpu_mem, o.cpu_mem, o.disk_mem, false};
  r.hetegen_alpha = o.hetegen_alpha;
  r.hetegen_slot_alpha = o.hetegen_slot_alpha;
  r.hetegen_whole = o.hetegen_whole;
  const bool shares = o.w_gpu_percent >= 0 || o.w_cpu_percent >= 0;
  if (shares || o.compress_weight) {
    Policy p;
    p.w_gpu_percent = std::max(o.w_gpu_percent, 0);
    p.w_cpu_percent = std::max(o.w_cpu_percent, 0);
    p.compress_weight = o.compress_weight;
    r.policy = p;
    r.weight_shares = shares;
  }
  return r;
}

namespace {

LoadedModel load_model_parts(const std::string& spec, const LoadOptions& options) {
  LoadedModel m;
  const bool dummy = is_dummy_model(spec);
  const ModelConfig full = dummy ? dummy_model_config(spec.substr(6), options.dummy_dtype)
                                 : load_model_config(spec, options.limits);
  const WeightParts parts = weight_parts(full, options);
  const ModelConfig shard = tensor_parallel_shard(full, options.tp_degree);
  m.config = shard;
  m.config.n_layers = parts.n_layers;
  m.layer_begin = parts.layer_begin;
  m.placement = place_weights(shard.shape(), weight_request(options));
  if (!options.weight_tiers.empty()) {  // decided by the plan: execute it
    if (options.weight_tiers.size() != static_cast<size_t>(parts.n_layers))
      fail_input("{}: the plan places {} weight layers but the stage has {}", full.source,
                 options.weight_tiers.size(), parts.n_layers);
    WeightPlacement& p = m.placement;
    p.tiers = options.weight_tiers;
    p.disk_layers.clear();
    for (int32_t i = 0; i < parts.n_layers; ++i)
      if (p.tiers[static_cast<size_t>(i)] == Tier::kDisk) p.disk_layers.push_back(i);
    p.device_staging_bytes = p.streamed_layers() > 0 ? 2 * p.layer_bytes : 0;
    p.staging_bytes = p.disk_layers.empty() ? 0 : 2 * (p.layer_bytes + kPageBytes);
  }
  LayerOffloader offloader(m.placement.disk_layers, options.disk_dir);
  if (options.hetegen_alpha != 0 && (options.device == nullptr || options.hetegen_cpu == nullptr))
    fail_input("HeteGen (alpha {}) needs a device to compute on and a CPU backend for its share",
               options.hetegen_alpha);
  if (options.device != nullptr) {
    const LayerSplit split{options.hetegen_alpha,
                           options.hetegen_alpha != 0 ? options.hetegen_cpu : nullptr,
                           options.hetegen_slot_alpha, options.hetegen_whole};
    m.feeder =
        std::make_unique<LayerFeeder>(*options.device, m.placement.tiers, options.overlap, split);
  }
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
  // Nothing places a layer elsewhere: it stays in host memory (packing keeps its size).
  const bool host_resident = !sink && !options.compress_weight;
  // kQ4 and panel storage of resident layers. 4-bit first: a matrix it leaves f32 (rows
  // that are not whole groups) is still packed for the host's GEMM.
  const bool pack = options.device == nullptr && options.cpu_panels && cpu_panels_enabled();
  std::vector<std::unique_ptr<OwnedTensor>> converted;
  if (options.compress_weight || pack) {
    sink = [&, place = sink](int32_t i, LayerWeights& w) {
      const size_t mark = converted.size();
      if (options.compress_weight) compress_layer(w, converted);
      if (pack) pack_layer(w, converted);
      if (place) place(i, w);
      if (w.q.data == nullptr) converted.resize(mark);  // stored elsewhere: the copy is spent
    };
  }
  if (options.on_layer) {
    sink = [&, place = sink, loaded = int32_t{0}](int32_t i, LayerWeights& w) mutable {
      if (place) place(i, w);
      options.on_layer(++loaded, parts.n_layers);
    };
  }
  if (dummy) {
    m.weights = make_dummy_weights(full, options.dummy_seed, sink, parts, host_resident);
    m.tokenizer = Tokenizer::ids_only(m.config);
  } else {
    m.weights = load_checkpoint_weights(full, spec, sink, parts,
                                        CheckpointOptions{options.limits, options.check_weights});
    m.tokenizer = Tokenizer::load(spec, m.config, options.limits);
  }
  for (auto& t : converted) m.weights.owned.push_back(std::move(t));
  if (options.compress_weight) compress_fixed(m.weights);
  if (pack) pack_fixed(m.weights);
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
