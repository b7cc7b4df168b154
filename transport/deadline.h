// Deadlines for every wait in transport/: no wait without a deadline. A wait
// polls a completion test with a short backoff instead of blocking inside MPI or NCCL, so a
// dead or silent peer becomes an Error of kind kDisconnected that names it, never a hang.
#pragma once

#include <chrono>
#include <string>

namespace strata {

class Deadline {
 public:
  using Clock = std::chrono::steady_clock;

  static Deadline after(Clock::duration budget) { return Deadline(Clock::now(), budget); }
  static Deadline after_seconds(double s);

  bool expired() const { return Clock::now() >= at_; }
  Clock::time_point at() const { return at_; }
  // The budget the deadline was made with, for messages ("after 2.0 s").
  double budget_seconds() const;

 private:
  Deadline(Clock::time_point start, Clock::duration budget) : start_(start), at_(start + budget) {}
  Clock::time_point start_;
  Clock::time_point at_;
};

// Sleeps a little longer on each call: spins first (a step's reply is usually microseconds
// away), then yields, then sleeps so waiting ranks leave the cores to ranks that compute
// (tests and small clusters oversubscribe 2 cores with 3 ranks). Sleeps stay at or below
// 128 us for about half a second: a step's result or command is then noticed within that,
// which on steps of a millisecond is what separates the pipeline's throughput from its
// profile (docs/SCHEDULING.md); a wait that goes on longer (an idle queue) backs off to 1 ms.
class Backoff {
 public:
  void pause();

 private:
  int calls_ = 0;
};

// Calls done() until it returns true (true) or the deadline passes (false). done() is
// tried once more after expiry, so a completion racing the deadline still counts.
template <typename Done>
bool poll_until(const Deadline& deadline, Done&& done) {
  Backoff backoff;
  while (!deadline.expired()) {
    if (done()) return true;
    backoff.pause();
  }
  return done();
}

// Throws Error(kDisconnected): "timed out after 2.0 s waiting for rank 3 (step result)".
[[noreturn]] void fail_timeout(const Deadline& deadline, const std::string& peer,
                               const std::string& awaited);

}  // namespace strata
