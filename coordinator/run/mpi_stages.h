// The stages of a cluster on ranks 1..N-1 of an MPI world, reached from rank 0: the plan
// and steps go out over the control channel (transport/control_channel.h), results come
// back from the last stage. A worker that dies or hangs is named (heartbeats and
// PeerMonitor) within the heartbeat timeout; a worker's error report ends the run.
#pragma once

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <set>
#include <string>

#include "coordinator/plan/stages.h"
#include "transport/control_channel.h"
#include "transport/liveness.h"
#include "transport/mpi_session.h"
#include "transport/peer_monitor.h"
#include "transport/tensor_channel.h"

namespace strata {

struct MpiStagesOptions {
  double heartbeat_interval_s = 1.0;
  double heartbeat_timeout_s = 30.0;  // a worker silent this long is declared dead
  double load_timeout_s = 300.0;      // plan to every stage loaded
  double step_timeout_s = 60.0;       // one control send
  // The liveness links to the workers (transport/liveness.h): a worker whose process ended is
  // named at once, not after the heartbeat timeout. Optional.
  LivenessLinks* links = nullptr;
  // Non-zero: stop (a signal came); the stages' load is not waited out. Optional.
  const std::atomic<int>* stop_signal = nullptr;
};

class MpiStages final : public Stages {
 public:
  MpiStages(const Communicator& world, const MpiStagesOptions& options);

  int32_t count() const override { return static_cast<int32_t>(workers_.size()); }
  int32_t ranks() const override { return world_.size(); }
  void start(const ClusterPlan& plan) override;
  void dispatch(const ScheduledStep& step) override;
  void leave(const std::vector<uint64_t>& seq_ids) override;
  std::optional<StepResult> poll() override;
  std::vector<StageReport> finish(const std::string& reason) override;
  std::vector<StageReport> live() const override;
  ProfileResult profile(const ProfileRequest& request) override;
  bool runs_waa() const override { return true; }
  void hand_over(const KvHandover& handover) override;
  std::vector<HandoverDone> handovers_done() override;
  void abort(const std::string& reason) noexcept override;

 private:
  void wait_ready();
  void on_message(const Received& r);
  void ping_workers();
  void check_alive() const;
  void check_links(const std::set<int>* awaited) const;
  std::string describe(int rank) const;  // "worker rank 2 (stage layers [1, 3))"
  Received recv_watching(const std::set<int>& awaited, const Deadline& deadline,
                         const std::string& what, bool stoppable);
  [[noreturn]] void on_error_report(const ErrorReport& report);
  int last_rank(Phase phase) const { return plan_.pipeline(phase).back().rank; }
  void on_handover_done(const KvHandoverDone& done);

  const Communicator& world_;
  MpiStagesOptions options_;
  ControlChannel control_;
  std::vector<int> workers_;
  ClusterPlan plan_;
  std::unique_ptr<TensorLinks> links_;
  std::unique_ptr<PeerMonitor> monitor_;
  std::optional<StepResult> result_;  // the one on_message just read
  struct Handover {
    size_t acks = 0;  // stages that said KvHandoverDone
    uint64_t bytes = 0;
  };
  std::map<uint64_t, Handover> handovers_;  // in progress
  std::vector<HandoverDone> handovers_done_;
  uint64_t ping_seq_ = 0;
  std::map<int, StageStats> live_;  // by rank: the latest heartbeat's statistics
  std::chrono::steady_clock::time_point last_ping_;
};

// Tells every worker to stop (best effort, each send bounded by `seconds`).
void shutdown_workers(const Communicator& world, const std::string& reason, double seconds);

}  // namespace strata
