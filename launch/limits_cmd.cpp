// strata limits: this machine's memory bandwidth and GEMM FLOP/s as JSON; with --input, the
// input limits (worker/input_limits.h) in force instead, after STRATA_LIMIT_* and --limit.
#include <cstdio>

#include "kernels/cpu_backend.h"
#include "kernels/limits.h"
#include "launch/commands.h"

namespace strata::cli {

Command add_limits(CLI::App& app) {
  auto threads = std::make_shared<int>(0);
  auto gemm_n = std::make_shared<int>(2048);
  auto input = std::make_shared<bool>(false);
  auto overrides = std::make_shared<std::vector<std::string>>();
  CLI::App* cmd = app.add_subcommand(
      "limits", "Measure memory bandwidth and BLAS GEMM FLOP/s (JSON); --input: the input limits");
  cmd->add_option("--threads", *threads, "Threads (0: all cores)")->check(thread_count());
  // Three n x n f32 matrices: 16384 is 3 GiB.
  cmd->add_option("--gemm-n", *gemm_n, "GEMM size n (n x n x n)")->check(CLI::Range(1, 16384));
  cmd->add_flag("--input", *input,
                "Print the input limits (name, value, default, max, env variable, what each "
                "bounds) instead of measuring");
  cmd->add_option("--limit", *overrides, "With --input: an override NAME=N to show applied");
  return {cmd, [threads, gemm_n, input, overrides] {
            if (*input) {
              std::printf("%s\n", input_limits(*overrides).json().c_str());
              return 0;
            }
            const int t = resolve_cpu_threads(*threads);
            std::printf("%s\n", measure_machine_limits(t, *gemm_n).json().c_str());
            return 0;
          }};
}

}  // namespace strata::cli
