// Liveness links: one TCP connection between every worker rank and rank 0, used for
// nothing but its end. The kernel closes a process's sockets however the process ends
// (kill -9 and the OOM killer included), so each side learns of the other's death within
// milliseconds. MPI does not tell: under `orte_abort_on_non_zero_status 0` (launch/*.sh) a
// wait on a dead rank lasts to its deadline (the heartbeat timeout), and a collective with
// a dead member to its own. An orderly end says goodbye (one byte) before it closes, so it
// is never taken for a death. A lost host (no FIN ever comes) is found by TCP keepalive
// within about 8 s, and by the heartbeats in any case.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "transport/mpi_session.h"

namespace strata {

class LivenessLinks {
 public:
  // Called on the watcher thread, once, with the rank whose link closed without a goodbye.
  using OnLost = std::function<void(int rank)>;

  // Collective over `world`. Rank 0 listens on an ephemeral port and tells the others its
  // IPv4 addresses; each other rank connects, trying each address for up to
  // `connect_seconds`. A rank that cannot connect (a firewall) logs why and is watched by
  // the heartbeats alone.
  static std::unique_ptr<LivenessLinks> create(const Communicator& world, const Deadline& deadline,
                                               double connect_seconds = 2.0);
  LivenessLinks(const LivenessLinks&) = delete;
  LivenessLinks& operator=(const LivenessLinks&) = delete;
  ~LivenessLinks();  // goodbye on every open link, then closed

  // Replaces the handler (nullptr: none). A loss seen before it is set is handed to it at
  // once. The handler may end the process.
  void on_lost(OnLost handler);
  // The first rank whose link closed without a goodbye.
  std::optional<int> lost() const;
  // The ranks this one holds a link to (rank 0: the workers that connected; a worker: 0).
  std::vector<int> linked() const;
  // "2 of 2 workers linked on port 40123"
  std::string str() const;

 private:
  struct Link {
    int rank = -1;
    int fd = -1;
  };
  LivenessLinks(int rank, std::vector<Link> links, int port);
  void watch();
  void closed(Link& link, bool goodbye);

  int rank_;
  int port_;
  std::vector<Link> links_;
  int wake_[2] = {-1, -1};  // a pipe: the destructor wakes the watcher
  mutable std::mutex mutex_;
  OnLost handler_;
  std::optional<int> lost_;
  bool handed_ = false;  // lost_ went to a handler
  std::thread watcher_;
};

}  // namespace strata
