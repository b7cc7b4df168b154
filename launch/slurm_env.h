// Under Slurm: does this process's MPI world hold every task that Slurm started? `srun`
// without a working PMI (for Debian's Open MPI: anything but `srun --mpi=pmix`) can start
// N one-process MPI worlds, each of which would serve the whole model alone. docs/SLURM.md.
//
// What each launcher sets (measured with Slurm 22.05 and Open MPI 4.1; world = MPI's size):
//   srun --mpi=pmix -n N          SLURM_STEP_NUM_TASKS=N SLURM_NTASKS=N, world N
//   srun -n N, no working PMI     SLURM_STEP_NUM_TASKS=N SLURM_NTASKS=N, world 1 in each task
//   mpirun -np M in the batch     OMPI_COMM_WORLD_SIZE=M, SLURM_NTASKS = the job's tasks,
//     shell (on the first node)   no SLURM_STEP_NUM_TASKS, world M
//   mpirun's daemons on other     OMPI_COMM_WORLD_SIZE=M, SLURM_STEP_NUM_TASKS = SLURM_NTASKS
//     nodes (an `srun` step)      = the number of nodes, world M
//   strata in the batch shell     SLURM_NTASKS = the job's tasks, no SLURM_STEP_NUM_TASKS,
//                                 world 1 (one process: not checked)
// So the check compares the world with SLURM_STEP_NUM_TASKS (the tasks of the srun step this
// process belongs to) and only when mpirun did not start it (no OMPI_COMM_WORLD_SIZE):
// SLURM_NTASKS is the job's count in a batch shell and the node count under mpirun's daemons.
#pragma once

#include <optional>
#include <string>

namespace strata::cli {

// The environment variables the check reads; nullopt where unset.
struct LaunchEnv {
  std::optional<std::string> slurm_step_num_tasks;  // SLURM_STEP_NUM_TASKS
  std::optional<std::string> slurm_job_id;          // SLURM_JOB_ID (named in the message)
  std::optional<std::string> ompi_comm_world_size;  // OMPI_COMM_WORLD_SIZE: started by mpirun
};

// The message when `world_size` ranks cannot be the tasks Slurm started, nullopt otherwise
// (or when Slurm did not start this process through srun, or mpirun did).
std::optional<std::string> slurm_world_size_error(const LaunchEnv& env, int world_size);

// This process's environment.
LaunchEnv launch_env();

// Throws InputError (fail_input) with slurm_world_size_error's message, if any.
void check_slurm_world_size(int world_size);

}  // namespace strata::cli
