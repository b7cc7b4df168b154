// What every engine command sets up: the backend, the model and its tokenizer.
#pragma once

#include <memory>

#include "kernels/cpu_backend.h"
#include "kernels/profiling_backend.h"
#include "launch/commands.h"
#include "worker/generator.h"
#include "worker/loader.h"
#include "worker/model.h"

namespace strata::cli {

struct Engine {
  std::unique_ptr<CpuBackend> cpu;
  std::unique_ptr<Backend> gpu;                // the CUDA backend when the engine computes on a GPU
  std::unique_ptr<ProfilingBackend> profiler;  // wraps the compute backend with --profile
  Backend* backend = nullptr;                  // what the model computes on
  ModelConfig config;
  WeightPlacement placement;
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<Model> model;
  GeneratorOptions generator;
};

// Probes for a GPU (and says what it found), picks the backend, loads the model.
Engine make_engine(const EngineOptions& o);

}  // namespace strata::cli
