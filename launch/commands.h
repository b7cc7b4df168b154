// The `strata` subcommands. Each registers its options on a CLI11 subcommand and returns
// the function that runs it (exit code) once parsing succeeded.
#pragma once

#include <CLI/CLI.hpp>
#include <exception>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "coordinator/s3/kv_packing.h"
#include "placement/policy.h"
#include "placement/tier.h"
#include "worker/input_limits.h"

namespace strata::cli {

struct Command {
  CLI::App* app = nullptr;
  std::function<int()> run;
  // SIGTERM / SIGINT are caught and acted on (serve, profile-layers), not fatal at once
  // (launch/job_control.h).
  bool graceful_stop = false;
};

Command add_generate(CLI::App& app);
Command add_bench(CLI::App& app);
Command add_limits(CLI::App& app);
Command add_score(CLI::App& app);
Command add_profile(CLI::App& app);
Command add_plan(CLI::App& app);
Command add_serve(CLI::App& app);
Command add_profile_layers(CLI::App& app);
Command add_submit(CLI::App& app);
Command add_collect(CLI::App& app);
Command add_predict(CLI::App& app);
Command add_tokenize(CLI::App& app);

// Prints an error as one line on stderr and returns the exit code: 2 for bad input, 1 for
// anything else (with the error's kind when it is a strata::Error).
int report_error(const std::exception& e);

// --redis-password-file (submit, collect, serve): the Redis password from a file, so it is in
// no command line (transport/redis_client.h RedisEndpoint::resolve).
void add_password_file_option(CLI::App& cmd, std::string& path);

// Number checks whose messages say the rule and the value ("must be >= 0, got -5").
CLI::Validator non_negative();
CLI::Validator positive();
// A --threads value: 0 (all cores) up to max_cpu_threads() (kernels/cpu_backend.h).
CLI::Validator thread_count();

// Options every engine command shares.
struct EngineOptions {
  std::string model;
  int threads = 0;
  std::string dtype = "f32";  // dummy weights
  uint64_t weight_seed = 0;   // dummy weights
  int max_batch = 32;
  int max_step_tokens = 512;
  bool profile = false;  // time every backend op (adds a synchronisation per op)
  std::string cpu_mem;   // host memory for weights ("800MiB", "2GiB"; empty: no limit)
  std::string disk_dir = "/tmp";
  int resident_experts = -1;  // MoE: experts per layer in host memory (< 0: as --cpu-mem holds)
  int expert_cache = 0;       // MoE: host slots disk experts are read into (0: 2 x top-k)
  bool overlap = true;
  std::string device = "auto";  // auto | cpu | cuda[:N]
  std::string gpu_mem;          // accelerator memory for weights (empty: no limit)
  std::string disk_mem;         // disk space for weights under disk_dir (empty: no limit)
  // HeteGen (docs/OFFLOADING.md): CPU-tier layers split at this alpha, the rest of each linear
  // computed on the CPU by hetegen_cpu_threads threads (0: --threads). 0: off.
  double hetegen_alpha = 0;
  // --hetegen-alpha auto: alpha per module shape from the alpha benchmark on this node (eq.
  // 9-12), cached in the node profile (launch/hetegen_setup.h); hetegen_alpha is then unset.
  bool hetegen_alpha_auto = false;
  int hetegen_cpu_threads = 0;
  // Pie (docs/PIE_HETEGEN.md): m KV-cache layers in host memory, swapped through the
  // device's buffers (--pie-host-layers; -1: not given), or chosen step by step between the
  // adaptive bounds (--pie-adaptive; max -1: n - 1).
  int pie_host_layers = -1;
  bool pie_adaptive = false;
  int pie_min_host_layers = 0;
  int pie_max_host_layers = -1;
  // --policy, parsed once on the command line (placement/policy.h); `bench --policy auto`
  // sets policy_auto and the search fills `policy` in.
  std::optional<Policy> policy;
  bool policy_auto = false;
  std::vector<std::string> limits;  // --limit NAME=N overrides of the input limits
  bool check_weights = false;       // scan every weight for NaN / infinity at load
  // S3's packing (coordinator/s3/kv_packing.h): --kv-budget and what sequences reserve in it.
  KvPackingOptions packing;
  std::string kv_reserve;    // --kv-reserve; empty: predicted with a --predictor, else context
  std::string kv_admission;  // --kv-admission; empty: reserved
};

// The packing options once parsed (--kv-reserve read, the combination validated).
KvPackingOptions packing_options(const EngineOptions& o);

// The input limits an engine command runs under: the defaults, then STRATA_LIMIT_<NAME>
// variables, then --limit NAME=N options.
InputLimits input_limits(const std::vector<std::string>& overrides);

void add_engine_options(CLI::App& cmd, EngineOptions& o);

}  // namespace strata::cli
