// config.json as text. A config that parses must be one the engine can size without
// overflow: the arithmetic below runs under UBSan, so a limit that lets a product overflow
// is a finding.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "fuzz_common.h"
#include "worker/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace strata;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  fuzz::expect_input_error_or_success([&] {
    const ModelConfig c = parse_model_config_text(text, "fuzz/config.json");
    const InputLimits l;
    fuzz::require(c.n_layers >= 1 && c.n_layers <= l.layers, "layers within the limit");
    fuzz::require(c.max_positions >= 1 && c.max_positions <= l.context, "context in limit");
    fuzz::require(c.norm_eps > 0.0f && c.norm_eps <= 0.1f, "epsilon sane");
    fuzz::require(c.bos_token_id < c.vocab, "bos inside the vocabulary");
    for (int32_t e : c.eos_token_ids) fuzz::require(e >= 0 && e < c.vocab, "eos in vocabulary");
    const ModelShape s = c.shape();
    fuzz::require(s.total_params() > 0, "a model has parameters");
    fuzz::require(s.decode_weight_bytes() > 0, "a decode step reads weights");
    (void)s.layer_flops_per_token(c.max_positions);
    (void)c.str();
  });
  return 0;
}
