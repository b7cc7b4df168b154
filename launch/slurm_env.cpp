#include "launch/slurm_env.h"

#include <charconv>

#include "kernels/error.h"
#include "kernels/tunables.h"

namespace strata::cli {
namespace {

bool set(const std::optional<std::string>& value) {
  return value.has_value() && !value->empty();
}

// A positive count, or nullopt for anything else (then there is nothing to compare with).
std::optional<long> count(const std::optional<std::string>& value) {
  if (!set(value)) return std::nullopt;
  long n = 0;
  const char* end = value->data() + value->size();
  const auto [ptr, ec] = std::from_chars(value->data(), end, n);
  if (ec != std::errc{} || ptr != end || n < 1) return std::nullopt;
  return n;
}

}  // namespace

std::optional<std::string> slurm_world_size_error(const LaunchEnv& env, int world_size) {
  // mpirun decided the world (its daemons may run as a Slurm step of one task per node).
  if (set(env.ompi_comm_world_size)) return std::nullopt;
  const std::optional<long> tasks = count(env.slurm_step_num_tasks);
  if (!tasks || *tasks == world_size) return std::nullopt;
  const std::string job = set(env.slurm_job_id) ? " of job " + *env.slurm_job_id : "";
  const std::string world = world_size == 1
                                ? "this process is an MPI world of its own (1 rank)"
                                : fmt::format("this process's MPI world has {} ranks", world_size);
  return fmt::format(
      "{} but Slurm started {} task{} in this step{} (SLURM_STEP_NUM_TASKS={}): the tasks did "
      "not join one MPI job, and each MPI world would serve on its own. Start them with "
      "`srun --mpi=pmix` (Open MPI under Slurm; pmi2 does not work with Debian's Open MPI), "
      "or set MpiDefault=pmix in slurm.conf; launch/slurm/strata.sbatch is a template "
      "(docs/SLURM.md)",
      world, *tasks, *tasks == 1 ? "" : "s", job, *env.slurm_step_num_tasks);
}

LaunchEnv launch_env() {
  return LaunchEnv{foreign_variable("SLURM_STEP_NUM_TASKS"), foreign_variable("SLURM_JOB_ID"),
                   foreign_variable("OMPI_COMM_WORLD_SIZE")};
}

void check_slurm_world_size(int world_size) {
  if (const std::optional<std::string> error = slurm_world_size_error(launch_env(), world_size))
    fail_input("{}", *error);
}

}  // namespace strata::cli
