// The world-size check under Slurm (launch/slurm_env.h), over the environments that srun,
// srun without a PMI, mpirun inside an allocation and a batch shell actually set (Slurm
// 22.05, Open MPI 4.1; tests/launch/test_slurm.py runs the real ones).
#include <gtest/gtest.h>

#include <cstdlib>

#include "kernels/error.h"
#include "launch/slurm_env.h"

namespace strata::cli {
namespace {

LaunchEnv srun_step(const char* tasks) {
  return LaunchEnv{tasks, "42", std::nullopt};
}

TEST(SlurmEnv, SrunWithPmixJoinsTheTasks) {
  // srun --mpi=pmix -n 3: one world of 3.
  EXPECT_EQ(slurm_world_size_error(srun_step("3"), 3), std::nullopt);
  EXPECT_EQ(slurm_world_size_error(srun_step("1"), 1), std::nullopt);
  EXPECT_EQ(slurm_world_size_error(srun_step("128"), 128), std::nullopt);
}

TEST(SlurmEnv, SrunWithoutPmixStartsSingletons) {
  // srun -n 3 without a PMI the MPI library speaks: three worlds of one.
  const std::optional<std::string> error = slurm_world_size_error(srun_step("3"), 1);
  ASSERT_TRUE(error.has_value());
  EXPECT_NE(error->find("this process is an MPI world of its own (1 rank)"), std::string::npos)
      << *error;
  EXPECT_NE(error->find("Slurm started 3 tasks in this step of job 42"), std::string::npos)
      << *error;
  EXPECT_NE(error->find("SLURM_STEP_NUM_TASKS=3"), std::string::npos) << *error;
  EXPECT_NE(error->find("srun --mpi=pmix"), std::string::npos) << *error;
}

TEST(SlurmEnv, AWorldOfAnotherSize) {
  const std::optional<std::string> error = slurm_world_size_error(srun_step("4"), 2);
  ASSERT_TRUE(error.has_value());
  EXPECT_NE(error->find("this process's MPI world has 2 ranks but Slurm started 4 tasks"),
            std::string::npos)
      << *error;
  // A world larger than the step is as wrong.
  EXPECT_TRUE(slurm_world_size_error(srun_step("2"), 3).has_value());
  const std::optional<std::string> one = slurm_world_size_error(srun_step("1"), 2);
  ASSERT_TRUE(one.has_value());
  EXPECT_NE(one->find("has 2 ranks but Slurm started 1 task in this step of job 42"),
            std::string::npos)
      << *one;
}

TEST(SlurmEnv, MpirunInsideTheAllocationIsNotChecked) {
  // mpirun -np 2 in the batch shell of a 3-task job: its ranks see the batch step's
  // variables (SLURM_NTASKS=3, which the check does not read) and no step count.
  EXPECT_EQ(slurm_world_size_error(LaunchEnv{std::nullopt, "42", "2"}, 2), std::nullopt);
  // On the other nodes mpirun's daemons are an srun step of one task per node: the ranks
  // inherit SLURM_STEP_NUM_TASKS = the node count (2), not the 5 ranks.
  EXPECT_EQ(slurm_world_size_error(LaunchEnv{"2", "42", "5"}, 5), std::nullopt);
  EXPECT_EQ(slurm_world_size_error(LaunchEnv{"1", "42", "3"}, 3), std::nullopt);
}

TEST(SlurmEnv, OutsideAnSrunStepIsNotChecked) {
  // No Slurm at all, and `strata serve` run directly in a batch shell (one process).
  EXPECT_EQ(slurm_world_size_error(LaunchEnv{}, 1), std::nullopt);
  EXPECT_EQ(slurm_world_size_error(LaunchEnv{}, 3), std::nullopt);
  EXPECT_EQ(slurm_world_size_error(LaunchEnv{std::nullopt, "42", std::nullopt}, 1), std::nullopt);
}

TEST(SlurmEnv, UnusableValuesAreNotCompared) {
  for (const char* tasks : {"", "0", "-3", "three", "3x", " 3", "99999999999999999999"})
    EXPECT_EQ(slurm_world_size_error(srun_step(tasks), 1), std::nullopt) << "'" << tasks << "'";
  // An empty OMPI_COMM_WORLD_SIZE is no sign of mpirun.
  EXPECT_TRUE(slurm_world_size_error(LaunchEnv{"3", std::nullopt, ""}, 1).has_value());
  // Without a job id the message still reads.
  const std::optional<std::string> error =
      slurm_world_size_error(LaunchEnv{"3", std::nullopt, std::nullopt}, 1);
  ASSERT_TRUE(error.has_value());
  EXPECT_NE(error->find("Slurm started 3 tasks in this step (SLURM_STEP_NUM_TASKS=3)"),
            std::string::npos)
      << *error;
}

TEST(SlurmEnv, TheWrapperReadsTheEnvironment) {
  ::setenv("SLURM_STEP_NUM_TASKS", "3", 1);
  ::setenv("SLURM_JOB_ID", "7", 1);
  ::unsetenv("OMPI_COMM_WORLD_SIZE");
  EXPECT_NO_THROW(check_slurm_world_size(3));
  try {
    check_slurm_world_size(1);
    ADD_FAILURE() << "no error for a world of 1 in a step of 3";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("step of job 7 (SLURM_STEP_NUM_TASKS=3)"),
              std::string::npos)
        << e.what();
  }
  ::setenv("OMPI_COMM_WORLD_SIZE", "1", 1);
  EXPECT_NO_THROW(check_slurm_world_size(1));
  ::unsetenv("SLURM_STEP_NUM_TASKS");
  ::unsetenv("SLURM_JOB_ID");
  ::unsetenv("OMPI_COMM_WORLD_SIZE");
  EXPECT_NO_THROW(check_slurm_world_size(1));
}

}  // namespace
}  // namespace strata::cli
