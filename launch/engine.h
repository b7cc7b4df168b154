// What every engine command sets up: the backend, the model and its tokenizer.
#pragma once

#include <memory>

#include "coordinator/run/local_stages.h"
#include "kernels/accelerator.h"
#include "kernels/cpu_backend.h"
#include "kernels/profiling_backend.h"
#include "launch/commands.h"
#include "worker/loader.h"
#include "worker/model.h"

namespace strata::cli {

// The compute side an engine command and a cluster stage share, from the engine options:
// which backend computes, how the weights load, where the KV cache lives, the block.
struct ComputeSetup {
  std::unique_ptr<CpuBackend> cpu;
  // The CUDA backend when computing on a GPU; under --device host a CPU backend standing in.
  std::unique_ptr<Backend> gpu;
  Backend* backend = nullptr;  // what the model computes on
  int device = -1;             // the CUDA device index; -1: no CUDA device
  bool device_compute() const { return gpu != nullptr; }
  LoadOptions load;        // budgets and weight tiers (the caller adds layer ranges)
  CacheOptions cache;      // the policy's cache placement; host = cpu
  int max_batch = 0;       // the policy's block size when it names one, else 0
  int gpu_batch_size = 0;  // sequences per GPU batch (0: the step is one GPU batch)
  // HeteGen's CPU shares (--hetegen-alpha on a GPU); load.hetegen_cpu points at it, so it
  // must outlive the model.
  std::unique_ptr<CpuBackend> hetegen_cpu;
};

// Probes for a GPU (and says what it found) and reads the policy. `auto_index`: the
// device `--device auto` takes when GPUs are present (a cluster worker's place on its
// node), modulo their number.
ComputeSetup make_compute(const EngineOptions& o, int auto_index = 0);
// --device's choice among `acc`: -1 computes on the host (cpu, host, or auto without a GPU);
// otherwise the CUDA device index (auto: auto_index modulo the devices). InputError naming
// the choice when there is no such device.
int pick_device(const std::string& choice, const AcceleratorInfo& acc, int auto_index);

struct Engine {
  std::unique_ptr<CpuBackend> cpu;
  std::unique_ptr<Backend> gpu;                // the CUDA backend when the engine computes on a GPU
  std::unique_ptr<ProfilingBackend> profiler;  // wraps the compute backend with --profile
  std::unique_ptr<CpuBackend> hetegen_cpu;     // HeteGen's CPU shares; outlives the model
  Backend* backend = nullptr;                  // what the model computes on
  ModelConfig config;
  WeightPlacement placement;
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<Model> model;
  LocalOptions local;  // a local run's batch and step rows (strata generate, bench)
};

// Probes for a GPU (and says what it found), picks the backend, loads the model.
Engine make_engine(const EngineOptions& o);

// Where this node's measured profiles live (serve's layer profiles, HeteGen's alphas):
// $STRATA_PROFILE_DIR, else ~/.cache/strata/profiles, else /tmp/strata-profiles.
std::string profile_dir();

}  // namespace strata::cli
