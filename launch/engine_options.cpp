#include <cstdio>

#include "kernels/error.h"
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

CLI::Validator non_negative() {
  return number_check(">= 0", [](double x) { return x >= 0; });
}
CLI::Validator positive() {
  return number_check("> 0", [](double x) { return x > 0; });
}

int64_t parse_size(const std::string& text, const char* option) {
  size_t used = 0;
  double v = -1;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  const std::string unit = text.substr(used);
  double scale = 0;
  if (unit.empty() || unit == "G" || unit == "GiB") scale = 1024.0 * 1024 * 1024;
  if (unit == "M" || unit == "MiB") scale = 1024.0 * 1024;
  if (unit == "K" || unit == "KiB") scale = 1024.0;
  if (unit == "B") scale = 1.0;
  if (used == 0 || scale == 0 || !(v >= 0))
    fail_input("{}: cannot read size '{}' (examples: 1.5GiB, 800MiB, 64KiB; a bare number is GiB)",
               option, text);
  return static_cast<int64_t>(v * scale);
}

void add_engine_options(CLI::App& cmd, EngineOptions& o) {
  cmd.add_option("--model", o.model, "Model directory (config.json + safetensors) or dummy:NAME")
      ->required();
  cmd.add_option("--threads", o.threads, "CPU threads (0: all cores)")->check(non_negative());
  cmd.add_option("--dtype", o.dtype, "Storage dtype of dummy weights")
      ->check(CLI::IsMember({"f32", "f16", "bf16"}));
  cmd.add_option("--weight-seed", o.weight_seed, "Seed of dummy weights");
  cmd.add_option("--max-batch", o.max_batch, "Sequences decoding together")->check(positive());
  cmd.add_option("--max-step-tokens", o.max_step_tokens,
                 "Rows of one prefill step (longer prompts are chunked)")
      ->check(positive());
  cmd.add_flag("--profile", o.profile, "Time every backend operation and report the totals");
  cmd.add_option("--cpu-mem", o.cpu_mem,
                 "Host memory for weights (e.g. 2GiB); layers beyond it stream from --disk-dir");
  cmd.add_option("--disk-dir", o.disk_dir, "Where layers that do not fit --cpu-mem are kept");
  cmd.add_flag("!--no-overlap", o.overlap, "Load streamed layers only when needed (no prefetch)");
  cmd.add_option("--device", o.device, "Compute on: auto (a GPU if present), cpu, cuda or cuda:N");
  cmd.add_option(
      "--gpu-mem", o.gpu_mem,
      "Accelerator memory for weights (e.g. 20GiB); layers beyond it stream from host memory");
  cmd.add_option("--disk-mem", o.disk_mem,
                 "Disk space under --disk-dir the weights may take (e.g. 100GiB)");
  cmd.add_option("--policy", o.policy,
                 "FlexGen policy, e.g. 'gbs=8,ngb=2,w=20/80/0,c=100/0/0' (weights placed by "
                 "w=GPU/CPU/DISK %)");
}

int report_error(const std::exception& e) {
  if (dynamic_cast<const InputError*>(&e) != nullptr) {
    std::fprintf(stderr, "strata: error: %s\n", e.what());
    std::fflush(stderr);
    return 2;
  }
  if (const auto* error = dynamic_cast<const Error*>(&e)) {
    std::fprintf(stderr, "strata: error (%s): %s\n", error_kind_name(error->kind()), e.what());
  } else {
    std::fprintf(stderr, "strata: error: %s\n", e.what());
  }
  std::fflush(stderr);
  return 1;
}

}  // namespace strata::cli
