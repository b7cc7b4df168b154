// strata limits: this machine's memory bandwidth and GEMM FLOP/s as JSON.
#include <omp.h>

#include <cstdio>

#include "kernels/limits.h"
#include "launch/commands.h"

namespace strata::cli {

Command add_limits(CLI::App& app) {
  auto threads = std::make_shared<int>(0);
  auto gemm_n = std::make_shared<int>(2048);
  CLI::App* cmd =
      app.add_subcommand("limits", "Measure memory bandwidth and BLAS GEMM FLOP/s (JSON)");
  cmd->add_option("--threads", *threads, "Threads (0: all cores)")->check(non_negative());
  cmd->add_option("--gemm-n", *gemm_n, "GEMM size n (n x n x n)")->check(positive());
  return {cmd, [threads, gemm_n] {
            const int t = *threads > 0 ? *threads : omp_get_num_procs();
            std::printf("%s\n", measure_machine_limits(t, *gemm_n).json().c_str());
            return 0;
          }};
}

}  // namespace strata::cli
