// The loop a worker rank (1..N-1) runs in a cluster: receive the coordinator's plan, load
// its pipeline stage, then run step commands as they come, activations in from the previous
// stage and out to the next (the last stage sends sampled tokens to rank 0), until Shutdown.
// Every wait has a deadline and answers the coordinator's heartbeat pings meanwhile, so a
// worker stuck behind a dead rank still says it is alive and the coordinator can name the
// dead one. The stage computes on its own thread (worker/compute_thread.h) so that the
// pings are answered during a long step too; all MPI stays on the calling thread.
#pragma once

#include <chrono>
#include <cstdint>

#include "kernels/backend.h"
#include "transport/mpi_session.h"
#include "worker/stage.h"

namespace strata {

struct StageWorkerOptions {
  StageOptions stage;           // how the stage computes its layers (the plan sets which)
  int device = -1;              // the CUDA device `backend` computes on (NCCL links); -1: the host
  double plan_timeout_s = 120;  // waiting for the plan, and for the tensor links
  // Silence from the coordinator (it pings every heartbeat interval) before this worker
  // takes it for gone and ends: the cluster's heartbeat timeout.
  double coordinator_timeout_s = 30;
  // Waiting for one step's activations (or for a send), and for one step's compute.
  double step_timeout_s = 60;
  int64_t debug_exit_after_steps = -1;  // tests: die (SIGKILL) after this many steps
  double debug_step_delay_s = 0;        // tests: every step computes this much longer
  int32_t debug_crash_token = -1;       // tests: the first stage dies on a prompt with this id
  // tests: die (SIGKILL) with the KV transfers of this rank's n-th hand-over posted (WAA)
  int64_t debug_die_in_handover = -1;
};

// run_stage_worker's result after an error that means a peer is gone (kDisconnected): the
// caller must not MPI_Finalize (it would wait for the lost rank) but abort.
inline constexpr int kStageLostPeer = 3;

// Runs until Shutdown; returns the process exit code: 0, 1 after an error that was reported
// to rank 0, kStageLostPeer (also when a step's compute never ended: the caller must end
// the process then). Errors before the plan arrives propagate.
int run_stage_worker(const Communicator& world, Backend& backend,
                     const StageWorkerOptions& options);

}  // namespace strata
