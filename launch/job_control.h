// A rank's start and end as a job sees them: stop signals from the first instruction, a
// bound on the start (MPI_Init cannot be interrupted), and the exit status the launch
// scripts read (launch/local-cluster.sh, docs/CLUSTER.md "Stopping").
#pragma once

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

namespace strata::cli {

// SIGTERM (mpirun, Slurm, a user) and SIGINT (Ctrl-C) are blocked before main() runs, so
// one that comes while the process starts waits instead of killing it half-started. A
// command that stops gracefully (serve, profile-layers) then catches them: the signal's
// number goes to stop_signal() and the command acts on it. Any other command unblocks them
// with their default action, so a pending one ends it as it always would.
void catch_stop_signals();
void default_stop_signals();
// The signal that asked this process to stop; 0 while none has.
const std::atomic<int>& stop_signal();

// Tells launch/local-cluster.sh (by a file in STRATA_RANK_STATUS_DIR) that this rank's
// signals are blocked or caught: the script passes a stop signal only to ranks that are
// ready for it. A no-op outside the script.
void say_ready_for_signals();
// ... and that this rank's start is over (MPI_Init and the links to rank 0 done): a rank
// that ends before saying so leaves the others in MPI_Init, so the script stops them.
void say_started();

// The status this rank ends with, where the launch script reads it: under
// `orte_abort_on_non_zero_status 0` mpirun exits 0 whatever a rank returns, and after
// MPI_Abort with the status of the first rank that ended (a killed worker's 137), not the
// coordinator's reason. Returns code.
int leave_status(int code);
// The status another rank left there before it ended (0: none): a worker that refused its
// options ended with 2, and rank 0 then ends the job with that, not with "a peer died".
int status_left_by(int rank);

// Tells the service manager (systemd's sd_notify protocol: a datagram to $NOTIFY_SOCKET, a
// path or, with a leading '@', an abstract name) the service's `state`, e.g. "READY=1".
// False when there is no NOTIFY_SOCKET or the datagram could not be sent.
bool notify_service_manager(const std::string& state);

// Ends this process when its start (MPI_Init up to the liveness links) takes longer than
// `bound_s`, or longer than kStopBoundSeconds after a stop signal: a rank that died while
// the job started leaves the others inside MPI_Init, which no deadline of ours reaches.
class StartWatchdog {
 public:
  static constexpr double kStopBoundSeconds = 5.0;
  explicit StartWatchdog(double bound_s);
  StartWatchdog(const StartWatchdog&) = delete;
  StartWatchdog& operator=(const StartWatchdog&) = delete;
  ~StartWatchdog();  // the start is over

 private:
  void watch(double bound_s);
  std::mutex mutex_;
  std::condition_variable wake_;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace strata::cli
