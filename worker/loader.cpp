#include "worker/loader.h"

#include <algorithm>
#include <cmath>

#include "kernels/cpu_isa.h"
#include "kernels/error.h"
#include "kernels/gemm_panel.h"
#include "kernels/gemm_q4_panel.h"
#include "kernels/log.h"
#include "kernels/quant.h"
#include "kernels/tunables.h"
#include "placement/layer_linears.h"
#include "worker/dummy.h"
#include "worker/model_path.h"

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
  for (ExpertWeights& e : w.experts)  // the router stays as stored: its top-k picks experts
    for (const ExpertMember m : kExpertMembers) converted += convert(e.*m, store, f32);
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
  static const bool enabled = tunable_choice(TunableId::kCpuWeights) == 0;
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
  r.resident_experts = o.resident_experts;
  r.expert_cache_slots = o.expert_cache_slots;
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

// The plan decided each weight layer's tier: the placement executes it (its disk layers and
// staging buffers follow from the tiers).
void follow_planned_tiers(WeightPlacement& p, const std::vector<Tier>& planned, int32_t n_layers,
                          const std::string& source) {
  if (planned.size() != static_cast<size_t>(n_layers))
    fail_input("{}: the plan places {} weight layers but the stage has {}", source, planned.size(),
               n_layers);
  p.tiers = planned;
  p.disk_layers.clear();
  for (int32_t i = 0; i < n_layers; ++i)
    if (p.tiers[static_cast<size_t>(i)] == Tier::kDisk) p.disk_layers.push_back(i);
  p.device_staging_bytes = p.streamed_layers() > 0 ? 2 * p.layer_bytes : 0;
  p.staging_bytes = p.disk_layers.empty() ? 0 : 2 * (p.layer_bytes + kPageBytes);
}

// A device stage's feeder: each layer to its tier, HeteGen's CPU share split off (α).
std::unique_ptr<LayerFeeder> device_feeder(const LoadOptions& options,
                                           const std::vector<Tier>& tiers) {
  if (options.hetegen_alpha != 0 && (options.device == nullptr || options.hetegen_cpu == nullptr))
    fail_input("HeteGen (alpha {}) needs a device to compute on and a CPU backend for its share",
               options.hetegen_alpha);
  if (options.device == nullptr) return nullptr;
  const LayerSplit split{options.hetegen_alpha,
                         options.hetegen_alpha != 0 ? options.hetegen_cpu : nullptr,
                         options.hetegen_slot_alpha, options.hetegen_whole};
  return std::make_unique<LayerFeeder>(*options.device, tiers, options.overlap, split);
}

// Where each loaded layer goes: its disk file, or the device feeder; none (an empty sink)
// when every layer stays in host memory.
LayerSink placement_sink(LoadedModel& m, LayerOffloader& offloader) {
  if (m.feeder != nullptr) {
    return [m = &m, offloader = &offloader](int32_t i, LayerWeights& w) {
      if (m->placement.tiers[static_cast<size_t>(i)] == Tier::kDisk) {
        (*offloader)(i, w);
      } else {
        m->feeder->take(i, w);
      }
    };
  }
  if (!m.placement.disk_layers.empty())
    return [offloader = &offloader](int32_t i, LayerWeights& w) { (*offloader)(i, w); };
  return {};
}

// Each layer's experts that placement keeps off it to their disk file, then the layer to its
// tier.
LayerSink expert_sink(LayerSink place, ExpertOffloader& experts) {
  if (!experts.active()) return place;
  return [place = std::move(place), experts = &experts](int32_t i, LayerWeights& w) {
    (*experts)(i, w);
    if (place) place(i, w);
  };
}

// kQ4 and panel storage of a layer before it is placed. 4-bit first: a matrix it leaves f32
// (rows that are not whole groups) is still packed for the host's GEMM. The copies of the
// layers that stay resident are kept in `converted`.
LayerSink converting_sink(LayerSink place, bool compress, bool pack,
                          std::vector<std::unique_ptr<OwnedTensor>>& converted) {
  return
      [place = std::move(place), compress, pack, store = &converted](int32_t i, LayerWeights& w) {
        const size_t mark = store->size();
        if (compress) compress_layer(w, *store);
        if (pack) pack_layer(w, *store);
        if (place) place(i, w);
        if (w.q.data == nullptr) {
          store->resize(mark);  // stored elsewhere: the copy is spent
        } else {
          drop_unreferenced(w, *store, mark);  // experts the sink moved to disk
        }
      };
}

// Reports each layer loaded (of n_layers) after placing it.
LayerSink reporting_sink(LayerSink place, const LoadOptions& options, int32_t n_layers) {
  return [place = std::move(place), on_layer = &options.on_layer, n_layers, loaded = int32_t{0}](
             int32_t i, LayerWeights& w) mutable {
    if (place) place(i, w);
    (*on_layer)(++loaded, n_layers);
  };
}

// The stage's weights and the tokenizer, from a checkpoint or generated for a dummy model.
void load_weights(LoadedModel& m, const std::string& spec, const ModelConfig& full,
                  const LoadOptions& options, const LayerSink& sink, const WeightParts& parts,
                  bool host_resident) {
  if (is_dummy_model(spec)) {
    m.weights = make_dummy_weights(full, options.dummy_seed, sink, parts, host_resident);
    m.tokenizer = Tokenizer::ids_only(m.config);
  } else {
    m.weights = load_checkpoint_weights(full, spec, sink, parts,
                                        CheckpointOptions{options.limits, options.check_weights});
    m.tokenizer = Tokenizer::load(spec, m.config, options.limits);
  }
}

// The layers' converted copies join the weights, the embedding and head are converted as
// the layers were, and the streamed layers go to the feeder (a device stage, which also
// takes the embedding and head) or to the host's streamer.
void finish_loading(LoadedModel& m, const LoadOptions& options, bool pack,
                    std::vector<std::unique_ptr<OwnedTensor>> converted,
                    LayerOffloader& offloader) {
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
}

LoadedModel load_model_parts(const std::string& spec, const LoadOptions& options) {
  LoadedModel m;
  const ModelConfig full = load_spec_config(spec, options.dummy_dtype, options.limits);
  const WeightParts parts = weight_parts(full, options);
  const ModelConfig shard = tensor_parallel_shard(full, options.tp_degree);
  m.config = shard;
  m.config.n_layers = parts.n_layers;
  m.config.first_layer = parts.layer_begin;  // a stage's windows are the whole model's layers'
  m.layer_begin = parts.layer_begin;
  m.placement = place_weights(shard.shape(), weight_request(options));
  if (!options.weight_tiers.empty())
    follow_planned_tiers(m.placement, options.weight_tiers, parts.n_layers, full.source);
  LayerOffloader offloader(m.placement.disk_layers, options.disk_dir);
  m.feeder = device_feeder(options, m.placement.tiers);
  if (m.placement.experts_on_disk() && m.feeder != nullptr)
    fail_input(
        "{}: experts on disk ({} of {} per layer resident) need host compute; a device "
        "stage keeps each layer's experts with it",
        full.source, m.placement.resident_experts, m.placement.n_experts);
  ExpertOffloader experts(
      parts.n_layers, m.placement.n_experts,
      m.placement.experts_on_disk() ? m.placement.resident_experts : m.placement.n_experts,
      options.disk_dir);
  LayerSink sink = expert_sink(placement_sink(m, offloader), experts);
  // Nothing places a layer elsewhere: it stays in host memory (packing keeps its size).
  const bool host_resident = !sink && !options.compress_weight;
  const bool pack = options.device == nullptr && options.cpu_panels && cpu_panels_enabled();
  std::vector<std::unique_ptr<OwnedTensor>> converted;
  if (options.compress_weight || pack)
    sink = converting_sink(std::move(sink), options.compress_weight, pack, converted);
  if (options.on_layer) sink = reporting_sink(std::move(sink), options, parts.n_layers);
  load_weights(m, spec, full, options, sink, parts, host_resident);
  finish_loading(m, options, pack, std::move(converted), offloader);
  m.experts = experts.finish(m.placement.expert_cache_slots);
  return m;
}

}  // namespace

LoadedModel load_model(const std::string& spec, const LoadOptions& options) {
  if (spec.empty()) fail_input("no model given: pass a model directory, ORG/NAME or dummy:NAME");
  // Resolved here, on this process's host: a cluster's ranks each find their own copy.
  const std::string folder = resolve_model_path(spec);
  if (folder != spec) log::get("worker")->info("model {}: {}", spec, folder);
  return with_oom_context(fmt::format("loading the model {}", spec),
                          [&] { return load_model_parts(folder, options); });
}

}  // namespace strata
