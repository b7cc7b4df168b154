#include "worker/loader.h"

#include "kernels/error.h"
#include "worker/dummy.h"

namespace strata {

LoadedModel load_model(const std::string& spec, const LoadOptions& options) {
  if (spec.empty()) fail_input("no model given: pass a model directory or dummy:NAME");
  LoadedModel m;
  if (is_dummy_model(spec)) {
    m.config = dummy_model_config(spec.substr(6), options.dummy_dtype);
    m.weights = make_dummy_weights(m.config, options.dummy_seed);
    m.tokenizer = Tokenizer::ids_only(m.config);
    return m;
  }
  m.config = load_model_config(spec);
  m.weights = load_checkpoint_weights(m.config, spec);
  m.tokenizer = Tokenizer::load(spec, m.config);
  return m;
}

}  // namespace strata
