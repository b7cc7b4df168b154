#include "transport/peer_monitor.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "kernels/error.h"

namespace strata {

PeerMonitor::PeerMonitor(std::vector<int> ranks, Clock::duration timeout) : timeout_(timeout) {
  const Clock::time_point now = Clock::now();
  for (int r : ranks) peers_.push_back(Peer{r, now});
}

void PeerMonitor::heard_from(int rank) {
  for (Peer& p : peers_) {
    if (p.rank == rank) p.last = Clock::now();
  }
}

std::optional<int> PeerMonitor::silent_rank() const {
  auto oldest = std::min_element(peers_.begin(), peers_.end(),
                                 [](const Peer& a, const Peer& b) { return a.last < b.last; });
  if (oldest == peers_.end() || Clock::now() - oldest->last <= timeout_) return std::nullopt;
  return oldest->rank;
}

bool PeerMonitor::alive(int rank) const {
  for (const Peer& p : peers_) {
    if (p.rank == rank) return Clock::now() - p.last <= timeout_;
  }
  return false;
}

void PeerMonitor::check() const {
  const std::optional<int> silent = silent_rank();
  if (!silent) return;
  for (const Peer& p : peers_) {
    if (p.rank != *silent) continue;
    using Seconds = std::chrono::duration<double>;
    fail(ErrorKind::kDisconnected, "rank {} silent for {:.1f} s (limit {:.1f} s)", p.rank,
         Seconds(Clock::now() - p.last).count(), Seconds(timeout_).count());
  }
}

void ping_all(ControlChannel& channel, const std::vector<int>& ranks, uint64_t sequence,
              PeerMonitor& monitor, const Deadline& deadline, std::vector<Received>& other) {
  const int self = channel.comm().rank();
  for (int r : ranks) channel.send(r, Heartbeat{self, sequence, false}, deadline);
  std::vector<int> waiting = ranks;
  while (!waiting.empty()) {
    std::optional<Received> got;
    poll_until(deadline,
               [&] { return (got = channel.try_recv(kAnySource, deadline)).has_value(); });
    if (!got) {
      fail(ErrorKind::kDisconnected, "no heartbeat reply within {:.1f} s from rank(s) {}",
           deadline.budget_seconds(), waiting);
    }
    monitor.heard_from(got->source);
    const auto* beat = std::get_if<Heartbeat>(&got->message);
    if (beat != nullptr && beat->reply && beat->sequence == sequence) {
      std::erase(waiting, got->source);
    } else {
      other.push_back(std::move(*got));
    }
  }
}

void answer_ping(ControlChannel& channel, int source, const Heartbeat& ping,
                 const Deadline& deadline, std::optional<StageStats> stats) {
  channel.send(source, Heartbeat{channel.comm().rank(), ping.sequence, true, std::move(stats)},
               deadline);
}

}  // namespace strata
