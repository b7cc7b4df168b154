// From a model spec on the command line to config, weights and tokenizer:
//   a directory with config.json + safetensors (+ tokenizer.model), or
//   "dummy:NAME" for a generated shape (see dummy.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "worker/config.h"
#include "worker/tokenizer.h"
#include "worker/weights.h"

namespace strata {

struct LoadOptions {
  DType dummy_dtype = DType::kF32;  // storage dtype of dummy weights
  uint64_t dummy_seed = 0;
};

struct LoadedModel {
  ModelConfig config;
  ModelWeights weights;
  std::unique_ptr<Tokenizer> tokenizer;
};

LoadedModel load_model(const std::string& spec, const LoadOptions& options = {});

}  // namespace strata
