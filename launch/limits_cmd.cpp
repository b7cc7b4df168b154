// strata limits: this machine's memory bandwidth and GEMM FLOP/s as JSON; with --input, the
// input limits (worker/input_limits.h) in force instead, after STRATA_LIMIT_* and --limit;
// with --tunables, the table of STRATA_* environment variables (kernels/tunables.h).
#include <cstdio>
#include <nlohmann/json.hpp>

#include "kernels/cpu_backend.h"
#include "kernels/limits.h"
#include "kernels/tunables.h"
#include "launch/commands.h"

namespace strata::cli {
namespace {

// A tunable's value in this environment: its text, a family's set members, or null.
nlohmann::ordered_json current_value(const Tunable& t) {
  if (t.family()) {
    nlohmann::ordered_json members = nlohmann::ordered_json::object();
    for (const auto& [variable, value] : tunable_family_values(t.id)) members[variable] = value;
    return members.empty() ? nlohmann::ordered_json(nullptr) : members;
  }
  const std::optional<std::string> v = tunable_text(t.id);
  return v ? nlohmann::ordered_json(*v) : nlohmann::ordered_json(nullptr);
}

std::string tunables_json() {
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (const Tunable& t : tunables()) {
    nlohmann::ordered_json row = {{"name", t.name},
                                  {"type", tunable_type_name(t.type)},
                                  {"default", t.default_value},
                                  {"current", current_value(t)},
                                  {"description", t.what}};
    if (t.type == TunableType::kChoice) row["choices"] = t.choice_list();
    out.push_back(row);
  }
  return out.dump(2);
}

}  // namespace

Command add_limits(CLI::App& app) {
  auto threads = std::make_shared<int>(0);
  auto gemm_n = std::make_shared<int>(2048);
  auto input = std::make_shared<bool>(false);
  auto tunables = std::make_shared<bool>(false);
  auto overrides = std::make_shared<std::vector<std::string>>();
  CLI::App* cmd = app.add_subcommand(
      "limits",
      "Measure memory bandwidth and BLAS GEMM FLOP/s (JSON); --input: the input limits; "
      "--tunables: the STRATA_* environment variables");
  cmd->add_option("--threads", *threads, "Threads (0: all cores)")->check(thread_count());
  // Three n x n f32 matrices: 16384 is 3 GiB.
  cmd->add_option("--gemm-n", *gemm_n, "GEMM size n (n x n x n)")->check(CLI::Range(1, 16384));
  cmd->add_flag("--input", *input,
                "Print the input limits (name, value, default, max, env variable, what each "
                "bounds) instead of measuring");
  cmd->add_option("--limit", *overrides, "With --input: an override NAME=N to show applied");
  cmd->add_flag("--tunables", *tunables,
                "Print the STRATA_* environment variables (name, type, default, current value, "
                "description) instead of measuring")
      ->excludes("--input");
  return {cmd, [threads, gemm_n, input, overrides, tunables] {
            if (*tunables) {
              std::printf("%s\n", tunables_json().c_str());
              return 0;
            }
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
