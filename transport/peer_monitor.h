// Liveness of the other ranks, as the coordinator sees it: every message from a rank is a
// sign of life, and a rank silent for longer than the timeout is reported by number.
// The coordinator pings idle workers (Heartbeat) so that silence means trouble, not idleness.
#pragma once

#include <chrono>
#include <optional>
#include <vector>

#include "transport/control_channel.h"

namespace strata {

class PeerMonitor {
 public:
  using Clock = std::chrono::steady_clock;

  PeerMonitor(std::vector<int> ranks, Clock::duration timeout);

  void heard_from(int rank);  // ranks not watched are ignored
  // The watched rank silent the longest, if it has been silent beyond the timeout.
  std::optional<int> silent_rank() const;
  // Throws Error(kDisconnected): "rank 2 silent for 3.1 s (limit 3.0 s)".
  void check() const;
  // Heard from `rank` within the timeout.
  bool alive(int rank) const;

 private:
  struct Peer {
    int rank;
    Clock::time_point last;
  };
  std::vector<Peer> peers_;
  Clock::duration timeout_;
};

// Sends a Heartbeat ping to each rank in `ranks`, then reads control messages until every
// one has answered or the deadline passes. Other messages that arrive meanwhile are kept in
// `other` in arrival order. Every message counts in `monitor`. Throws kDisconnected naming
// the ranks that did not answer. For start-up checks and idle periods.
void ping_all(ControlChannel& channel, const std::vector<int>& ranks, uint64_t sequence,
              PeerMonitor& monitor, const Deadline& deadline, std::vector<Received>& other);

// A worker's side: answer a ping from `source` at once, with its statistics so far when it
// has them.
void answer_ping(ControlChannel& channel, int source, const Heartbeat& ping,
                 const Deadline& deadline, std::optional<StageStats> stats = std::nullopt);

}  // namespace strata
