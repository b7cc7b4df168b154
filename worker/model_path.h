// Where a --model spec's files are, found offline where users keep models:
//   a model folder (config.json + safetensors) or a tokenizer file, as given;
//   a Hugging Face hub cache snapshot, .../models--ORG--NAME/snapshots/REV/ (its files are
//     symlinks into ../../blobs/, which every reader follows), as given;
//   a hub cache repo folder, .../models--ORG--NAME: its refs/main snapshot, or its only one;
//   ORG/NAME or ORG/NAME@REV (REV a name in refs/ or a snapshot's commit hash), looked up in
//     the hub cache that huggingface_hub itself would use (hub_cache below).
// Strata never downloads: a name that is not in the cache is refused saying where it looked.
// Each process resolves its own spec, so every rank of a cluster finds the model on its host.
#pragma once

#include <optional>
#include <string>

namespace strata {

// The variables that place the hub cache (an empty value counts as unset).
struct HubEnvironment {
  std::optional<std::string> hf_hub_cache;           // HF_HUB_CACHE
  std::optional<std::string> huggingface_hub_cache;  // HUGGINGFACE_HUB_CACHE (its old name)
  std::optional<std::string> hf_home;                // HF_HOME
  std::optional<std::string> xdg_cache_home;         // XDG_CACHE_HOME
  std::optional<std::string> home;                   // HOME
  // This process's, read through foreign_variable() (kernels/tunables.h).
  static HubEnvironment from_process();
};

struct HubCache {
  std::string dir;  // empty: no variable places it (not even HOME)
  std::string why;  // how it was chosen, for messages: "HF_HUB_CACHE=/x", "HF_HOME=/y: /y/hub"
};

// huggingface_hub's rule (its constants.py): HF_HUB_CACHE, else HUGGINGFACE_HUB_CACHE, else
// $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub; a
// leading ~ in a value is HOME.
HubCache hub_cache(const HubEnvironment& env);

// "ORG/NAME" or "ORG/NAME@REV" -> true: a spec shaped like a hub repo id (which may still
// name an existing folder, and then the folder wins).
bool is_hub_name(const std::string& spec);

// The folder (or file) a model spec names, per the list above; a dummy:NAME spec, an empty
// one and one that is neither an existing path nor a hub name come back unchanged (the
// loaders then refuse them as before). Throws InputError for a hub name or repo folder that
// does not resolve: naming the spec, each place looked in, and what the cache holds.
std::string resolve_model_path(const std::string& spec, const HubEnvironment& env);
std::string resolve_model_path(const std::string& spec);  // HubEnvironment::from_process()

}  // namespace strata
