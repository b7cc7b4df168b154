// strata: the command-line entry point. Every error ends as one line on stderr and a
// non-zero exit: 2 for bad command-line input, 1 for everything else.
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <new>
#include <string>

#include "kernels/error.h"
#include "kernels/tunables.h"
#include "launch/commands.h"
#include "launch/job_control.h"
#include "launch/openmp_wait.h"

namespace {

int run(int argc, char** argv) {
  CLI::App app{"Strata: LLM inference on machines whose accelerator memory is too small"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "strata 0.1.0");
  const strata::cli::Command commands[] = {
      strata::cli::add_generate(app), strata::cli::add_bench(app),
      strata::cli::add_limits(app),   strata::cli::add_score(app),
      strata::cli::add_profile(app),  strata::cli::add_plan(app),
      strata::cli::add_serve(app),    strata::cli::add_profile_layers(app),
      strata::cli::add_submit(app),   strata::cli::add_collect(app),
      strata::cli::add_predict(app),  strata::cli::add_tokenize(app),
  };
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {
    return app.exit(e);  // --help / --version
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "strata: error: %s (see strata --help)\n", e.what());
    return 2;
  }
  const char* running = "";
  try {
    for (const auto& c : commands) {
      if (!c.app->parsed()) continue;
      running = c.app->get_name().c_str();
      c.graceful_stop ? strata::cli::catch_stop_signals() : strata::cli::default_stop_signals();
      return c.run();
    }
    return 2;
  } catch (const std::bad_alloc&) {
    // Allocations that know what they are say so (with_oom_context); this names the command.
    return strata::cli::report_error(strata::Error(
        strata::ErrorKind::kOverloaded,
        fmt::format("out of memory while running 'strata {}' (std::bad_alloc)", running)));
  } catch (const std::exception& e) {
    return strata::cli::report_error(e);
  }
}

}  // namespace

int main(int argc, char** argv) {
  strata::cli::say_ready_for_signals();   // blocked since before main (launch/job_control.h)
  strata::cli::settle_openmp_wait(argv);  // may run this binary again, with GOMP_SPINCOUNT set
  return strata::cli::leave_status(run(argc, argv));
}
