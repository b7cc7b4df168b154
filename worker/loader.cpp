#include "worker/loader.h"

#include "kernels/error.h"
#include "worker/dummy.h"

#include <algorithm>

namespace strata {

std::string WeightPlacement::str() const {
  return fmt::format("WeightPlacement(fixed {:.1f} MiB, layer {:.1f} MiB, staging {:.1f} MiB, {} layers on disk)",
                     static_cast<double>(fixed_bytes) / (1 << 20), static_cast<double>(layer_bytes) / (1 << 20),
                     static_cast<double>(staging_bytes) / (1 << 20), disk_layers.size());
}

WeightPlacement place_weights(const ModelConfig& c, int64_t cpu_mem) {
  const ModelShape s = c.shape();
  WeightPlacement p;
  p.layer_bytes = static_cast<int64_t>(align_up(static_cast<size_t>(s.params_per_layer() * s.weight_bytes_per_elem)));
  p.fixed_bytes = (s.embedding_params() + s.head_params()) * s.weight_bytes_per_elem + 2 * s.hidden * 4;
  if (cpu_mem < 0 || p.fixed_bytes + c.n_layers * p.layer_bytes <= cpu_mem) return p;
  p.staging_bytes = 2 * p.layer_bytes;
  const int64_t room = cpu_mem - p.fixed_bytes - p.staging_bytes;
  if (room < 0)
    fail_input("--cpu-mem {:.1f} MiB is too small for {}: embeddings and head need {:.1f} MiB and two "
               "staging layers {:.1f} MiB (short by {:.1f} MiB)",
               static_cast<double>(cpu_mem) / (1 << 20), c.source, static_cast<double>(p.fixed_bytes) / (1 << 20),
               static_cast<double>(p.staging_bytes) / (1 << 20), static_cast<double>(-room) / (1 << 20));
  const auto resident = static_cast<int32_t>(std::min<int64_t>(room / p.layer_bytes, c.n_layers));
  p.disk_layers = spread_disk_layers(c.n_layers, c.n_layers - resident);
  return p;
}

LoadedModel load_model(const std::string& spec, const LoadOptions& options) {
  if (spec.empty()) fail_input("no model given: pass a model directory or dummy:NAME");
  LoadedModel m;
  const bool dummy = is_dummy_model(spec);
  m.config = dummy ? dummy_model_config(spec.substr(6), options.dummy_dtype) : load_model_config(spec);
  m.placement = place_weights(m.config, options.cpu_mem);
  LayerOffloader offloader(m.placement.disk_layers, options.disk_dir);
  LayerSink sink;
  if (!m.placement.disk_layers.empty()) sink = [&](int32_t i, LayerWeights& w) { offloader(i, w); };
  if (dummy) {
    m.weights = make_dummy_weights(m.config, options.dummy_seed, sink);
    m.tokenizer = Tokenizer::ids_only(m.config);
  } else {
    m.weights = load_checkpoint_weights(m.config, spec, sink);
    m.tokenizer = Tokenizer::load(spec, m.config);
  }
  m.streamer = offloader.finish(m.weights.layers.size(), options.overlap);
  return m;
}

}  // namespace strata
