#include "launch/commands.h"

namespace strata::cli {

namespace {
CLI::Validator number_check(const char* rule, bool (*ok)(double)) {
  return CLI::Validator(
      [rule, ok](std::string& v) -> std::string {
        double x = 0;
        try {
          size_t used = 0;
          x = std::stod(v, &used);
          if (used != v.size()) throw std::invalid_argument(v);
        } catch (const std::exception&) {
          return "not a number: '" + v + "'";
        }
        return ok(x) ? std::string() : std::string("must be ") + rule + ", got " + v;
      },
      rule);
}
}  // namespace

CLI::Validator non_negative() { return number_check(">= 0", [](double x) { return x >= 0; }); }
CLI::Validator positive() { return number_check("> 0", [](double x) { return x > 0; }); }

void add_engine_options(CLI::App& cmd, EngineOptions& o) {
  cmd.add_option("--model", o.model, "Model directory (config.json + safetensors) or dummy:NAME")
      ->required();
  cmd.add_option("--threads", o.threads, "CPU threads (0: all cores)")->check(non_negative());
  cmd.add_option("--dtype", o.dtype, "Storage dtype of dummy weights")
      ->check(CLI::IsMember({"f32", "f16", "bf16"}));
  cmd.add_option("--weight-seed", o.weight_seed, "Seed of dummy weights");
  cmd.add_option("--max-batch", o.max_batch, "Sequences decoding together")->check(positive());
  cmd.add_option("--max-step-tokens", o.max_step_tokens, "Rows of one prefill step (longer prompts are chunked)")
      ->check(positive());
  cmd.add_flag("--profile", o.profile, "Time every backend operation and report the totals");
}

}  // namespace strata::cli
