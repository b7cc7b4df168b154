#include "transport/deadline.h"

#include <algorithm>
#include <thread>

#include "kernels/error.h"

namespace strata {

Deadline Deadline::after_seconds(double s) {
  return after(std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s)));
}

double Deadline::budget_seconds() const {
  return std::chrono::duration<double>(at_ - start_).count();
}

void Backoff::pause() {
  constexpr int kSpins = 64;
  constexpr int kYields = 256;
  ++calls_;
  if (calls_ <= kSpins) return;
  if (calls_ <= kYields) {
    std::this_thread::yield();
    return;
  }
  constexpr int kShortSleeps = 4000;  // of at most 128 us: about half a second
  const int exponent = std::min(calls_ - kYields, calls_ - kYields < kShortSleeps ? 4 : 7);
  std::this_thread::sleep_for(std::chrono::microseconds(8 << exponent));  // 8 us .. 1 ms
}

void fail_timeout(const Deadline& deadline, const std::string& peer, const std::string& awaited) {
  fail(ErrorKind::kDisconnected, "timed out after {:.1f} s waiting for {} ({})",
       deadline.budget_seconds(), peer, awaited);
}

}  // namespace strata
