// Dummy models: named OPT / Llama shapes with deterministic pseudo-random weights, generated
// tensor by tensor from (seed, tensor name, element index) so a 175B shape needs no
// checkpoint and any single layer can be produced alone (FlexGen measures the same way).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/tensor.h"
#include "worker/config.h"

namespace strata {

// "dummy:opt-125m" -> true.
bool is_dummy_model(const std::string& spec);
// Config of a named dummy shape ("opt-125m" ... "opt-175b", "llama-110m", "llama-7b", ...),
// weights stored as `dtype`. Throws InputError listing the known names for an unknown one.
ModelConfig dummy_model_config(const std::string& name, DType dtype = DType::kF32);
std::vector<std::string> dummy_model_names();

// The config of a model spec as the loader reads it: a dummy shape (weights stored as
// `dummy_dtype`) or the config.json of the folder the spec resolves to (model_path.h: a
// folder or the hub cache; read within `limits`). An empty spec is refused.
ModelConfig load_spec_config(const std::string& spec, DType dummy_dtype,
                             const InputLimits& limits = {});

// Fills `out` (its dtype and shape already set) with the dummy values of tensor `name`.
// `fan_in` scales a matrix's values to keep activations O(1); 0 means a norm weight (ones
// plus small noise), -1 a bias or embedding (small values).
void fill_dummy_tensor(uint64_t seed, const std::string& name, int64_t fan_in, const Tensor& out);

}  // namespace strata
