// From a model spec on the command line to config, weights and tokenizer:
//   a directory with config.json + safetensors (+ tokenizer.model), or
//   "dummy:NAME" for a generated shape (see dummy.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "worker/config.h"
#include "worker/layer_store.h"
#include "worker/tokenizer.h"
#include "worker/weights.h"

namespace strata {

struct LoadOptions {
  DType dummy_dtype = DType::kF32;  // storage dtype of dummy weights
  uint64_t dummy_seed = 0;
  // Host memory for weights, bytes (< 0: no limit). Layers that do not fit live in a
  // scratch file under disk_dir and stream back through two staging buffers.
  int64_t cpu_mem = -1;
  std::string disk_dir = "/tmp";
  bool overlap = true;  // prefetch the next disk layer while computing
};

// How a weight budget splits the layers: what stays resident, what goes to disk.
struct WeightPlacement {
  int64_t fixed_bytes = 0;    // embeddings, positions, head, final norm: always resident
  int64_t layer_bytes = 0;    // one layer as stored
  int64_t staging_bytes = 0;  // two layer buffers, only when some layer is on disk
  std::vector<int32_t> disk_layers;
  std::string str() const;
};
// Throws InputError naming the budget and the shortfall when even the fixed part and the
// staging buffers do not fit.
WeightPlacement place_weights(const ModelConfig& config, int64_t cpu_mem);

struct LoadedModel {
  ModelConfig config;
  ModelWeights weights;
  std::unique_ptr<Tokenizer> tokenizer;
  WeightPlacement placement;
  std::unique_ptr<LayerStreamer> streamer;  // nullptr when every layer is resident
};

LoadedModel load_model(const std::string& spec, const LoadOptions& options = {});

}  // namespace strata
