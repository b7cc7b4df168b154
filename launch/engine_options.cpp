#include <charconv>
#include <cmath>
#include <cstdio>
#include <new>

#include "kernels/cpu_backend.h"
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
// Reads a whole number >= 0 into n; the message for anything else, empty when it is one.
std::string read_whole_number(const std::string& v, int& n) {
  n = -1;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  if (ec != std::errc() || end != v.data() + v.size() || n < 0)
    return "must be a whole number >= 0, got " + v;
  return std::string();
}

// A count: a whole number >= 0 ("must be a whole number >= 0, got -1").
CLI::Validator whole_number() {
  return CLI::Validator(
      [](std::string& v) -> std::string {
        int n = -1;
        return read_whole_number(v, n);
      },
      "N >= 0");
}
}  // namespace

CLI::Validator non_negative() {
  return number_check(">= 0", [](double x) { return x >= 0; });
}
CLI::Validator positive() {
  return number_check("> 0", [](double x) { return x > 0; });
}

CLI::Validator thread_count() {
  return CLI::Validator(
      [](std::string& v) -> std::string {
        int n = -1;
        if (std::string bad = read_whole_number(v, n); !bad.empty()) return bad;
        try {
          resolve_cpu_threads(n);
        } catch (const InputError& e) {
          return e.what();
        }
        return std::string();
      },
      "0 (all cores) to max_cpu_threads");
}

InputLimits input_limits(const std::vector<std::string>& overrides) {
  InputLimits l = InputLimits::from_env();
  for (const std::string& o : overrides) l.set_from_text(o, "--limit");
  return l;
}

KvPackingOptions packing_options(const EngineOptions& o) {
  KvPackingOptions p = o.packing;
  if (p.budget == 0 && !p.budget_from_schedule && !p.predictor_path.empty())
    fail_input(
        "--predictor {} needs a --kv-budget: the predictor's reservations are what the "
        "budget packs",
        p.predictor_path);
  if (!o.kv_reserve.empty()) {
    p.reserve = parse_kv_reserve(o.kv_reserve);
  } else if (p.budget > 0 || p.budget_from_schedule) {
    p.reserve = p.predictor_path.empty() ? KvReserve::kContext : KvReserve::kPredicted;
  }
  if (!o.kv_admission.empty()) p.admission = parse_kv_admission(o.kv_admission);
  p.validate();
  return p;
}

namespace {

void add_packing_options(CLI::App& cmd, EngineOptions& o) {
  const char* group = "S3 packing";
  cmd.add_option("--kv-budget", o.packing.budget,
                 "KV positions all running sequences may reserve together (S3; 0: each holds "
                 "a whole --max-batch slot of the context)")
      ->check(non_negative())
      ->group(group);
  cmd.add_option("--kv-reserve", o.kv_reserve,
                 "What a sequence reserves: context (worst case), max-new (prompt + "
                 "max_new_tokens), predicted (S3's length predictor; the default with "
                 "--predictor)")
      ->check(CLI::IsMember({"context", "max-new", "predicted"}))
      ->group(group);
  cmd.add_option("--kv-admission", o.kv_admission,
                 "How sequences fit the budget: reserved (S3: each reservation covers its "
                 "output at --predict-confidence, together within the budget) or pooled (their "
                 "summed final positions within the budget at that confidence, positions "
                 "filled always within it; the fewest-filled preempted on overflow)")
      ->check(CLI::IsMember({"reserved", "pooled"}))
      ->group(group);
  cmd.add_option("--predictor", o.packing.predictor_path,
                 "The length predictor's file (strata predict train); learned online and "
                 "written back at the end unless --no-predictor-learn")
      ->group(group);
  cmd.add_option("--predict-confidence", o.packing.confidence,
                 "A predicted reservation covers the output this often (its bucket "
                 "distribution's quantile)")
      ->capture_default_str()
      ->group(group);
  cmd.add_option("--predict-buckets", o.packing.buckets,
                 "An untrained predictor's length buckets (a --predictor file has its own)")
      ->capture_default_str()
      ->group(group);
  cmd.add_option("--predict-bucket-width", o.packing.bucket_width,
                 "Output tokens per bucket of an untrained predictor")
      ->capture_default_str()
      ->group(group);
  cmd.add_flag("!--no-predictor-learn", o.packing.learn,
               "Do not train the predictor on finished requests")
      ->group(group);
  cmd.add_flag("!--no-length-hint", o.packing.length_hint,
               "max_new_tokens is a stop rule only: it neither caps reservations nor feeds the "
               "predictor (benchmarks that enforce true lengths through it)")
      ->group(group);
}

}  // namespace

void add_engine_options(CLI::App& cmd, EngineOptions& o) {
  cmd.add_option("--model", o.model,
                 "Model folder (config.json + safetensors), a Hugging Face hub cache model "
                 "(ORG/NAME[@REV], found offline) or dummy:NAME")
      ->required();
  cmd.add_option("--threads", o.threads, "CPU threads (0: all cores)")->check(thread_count());
  cmd.add_option("--dtype", o.dtype, "Storage dtype of dummy weights")
      ->check(CLI::IsMember({"f32", "f16", "bf16"}));
  cmd.add_option("--weight-seed", o.weight_seed, "Seed of dummy weights");
  cmd.add_option("--max-batch", o.max_batch, "Sequences decoding together")->check(positive());
  cmd.add_option("--max-step-tokens", o.max_step_tokens,
                 "Rows of one prefill step (longer prompts are chunked)")
      ->check(positive());
  add_packing_options(cmd, o);
  cmd.add_flag("--profile", o.profile, "Time every backend operation and report the totals");
  cmd.add_option("--cpu-mem", o.cpu_mem,
                 "Host memory for weights (e.g. 2GiB); layers beyond it stream from --disk-dir. "
                 "Under --policy: for everything the engine keeps in host memory");
  cmd.add_option("--disk-dir", o.disk_dir, "Where layers that do not fit --cpu-mem are kept");
  cmd.add_option("--resident-experts", o.resident_experts,
                 "MoE models: experts of each layer kept in host memory with it; the others "
                 "live under --disk-dir and are read when the router picks them (default: all "
                 "where --cpu-mem holds them, else as many as it holds)")
      ->check(CLI::NonNegativeNumber);
  cmd.add_option("--expert-cache", o.expert_cache,
                 "MoE models: host slots of one expert each that disk experts are read into "
                 "and kept in while popular (default 2 x experts per token)")
      ->check(CLI::PositiveNumber);
  cmd.add_flag("!--no-overlap", o.overlap, "Load streamed layers only when needed (no prefetch)");
  cmd.add_option(
      "--device", o.device,
      "Compute on: auto (a GPU if present), cpu, cuda or cuda:N; host: the CPU standing in "
      "for a device (offloading mechanics without a GPU)");
  cmd.add_option(
      "--gpu-mem", o.gpu_mem,
      "Accelerator memory for weights (e.g. 20GiB); layers beyond it stream from host memory. "
      "Under --policy: for everything the engine keeps on the device");
  cmd.add_option("--disk-mem", o.disk_mem,
                 "Disk space under --disk-dir the weights may take (e.g. 100GiB). Under "
                 "--policy: the weights and the KV cache's disk layers");
  cmd.add_option_function<std::string>(
         "--hetegen-alpha",
         [&o](const std::string& text) {
           o.hetegen_alpha_auto = text == "auto";
           if (!o.hetegen_alpha_auto) o.hetegen_alpha = std::stod(text);
         },
         "HeteGen: split each CPU-tier layer instead of streaming it whole -- this share "
         "of every linear's rows streamed to the GPU, the rest computed by the CPU (0 < A "
         "<= 1, or auto: per module shape from the alpha benchmark, cached in the node "
         "profile; device compute, single process)")
      ->check(CLI::Validator(
          [](std::string& v) -> std::string {
            if (v == "auto") return {};
            std::string copy = v;
            return number_check("in (0, 1]", [](double x) { return x > 0 && x <= 1; })(copy);
          },
          "in (0, 1] or auto"));
  cmd.add_option("--hetegen-cpu-threads", o.hetegen_cpu_threads,
                 "HeteGen: CPU threads computing the CPU shares (0: --threads)")
      ->check(thread_count());
  cmd.add_option("--pie-host-layers", o.pie_host_layers,
                 "Pie: keep M of the n KV-cache layers in host memory, swapped in layer by "
                 "layer behind compute, so the device holds n - M (device compute, the cache "
                 "on the GPU tier, single process); with --pie-adaptive, where m starts")
      ->check(whole_number());
  auto* pie_adaptive =
      cmd.add_flag("--pie-adaptive", o.pie_adaptive,
                   "Pie: choose m step by step from the stalls and early swap-ins (section "
                   "3.4), from --pie-host-layers (default --pie-min-host-layers)");
  cmd.add_option("--pie-min-host-layers", o.pie_min_host_layers,
                 "Pie adaptive: the fewest host layers (the device keeps n - this buffers)")
      ->check(whole_number())
      ->needs(pie_adaptive);
  cmd.add_option("--pie-max-host-layers", o.pie_max_host_layers,
                 "Pie adaptive: the most host layers (default n - 1)")
      ->check(whole_number())
      ->needs(pie_adaptive);
  cmd.add_option_function<std::string>(
      "--policy",
      [&o](const std::string& text) {
        o.policy_auto = text == "auto";
        if (o.policy_auto) return;
        try {
          o.policy = Policy::parse(text);
        } catch (const InputError& e) {
          throw CLI::ValidationError("--policy", e.what());
        }
      },
      "FlexGen policy, e.g. 'gbs=8,ngb=2,w=20/80/0,c=100/0/0' (weights placed by "
      "w=GPU/CPU/DISK %)");
  cmd.add_option("--limit", o.limits,
                 "Raise or lower an input limit, NAME=N (repeatable; see strata limits --input)");
  cmd.add_flag("--check-weights", o.check_weights,
               "Scan every weight for NaN / infinity at load and refuse the model naming the "
               "tensor and the first bad index");
}

int report_error(const std::exception& e) {
  if (dynamic_cast<const std::bad_alloc*>(&e) != nullptr) {
    // What was being allocated is said where it is known (with_oom_context); this is the rest.
    std::fprintf(stderr, "strata: error (overloaded): out of memory (%s)\n", e.what());
    std::fflush(stderr);
    return 1;
  }
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
