// The tree's one clock for timing: the monotonic (steady) clock, which a change of the
// wall-clock time never moves, so a measured interval is never negative.
#pragma once

#include <chrono>

namespace strata {

using MonotonicClock = std::chrono::steady_clock;

// Seconds since an arbitrary fixed origin: only differences of two readings mean anything.
inline double now_s() {
  return std::chrono::duration<double>(MonotonicClock::now().time_since_epoch()).count();
}

// Seconds from `t0` to now.
inline double seconds_since(MonotonicClock::time_point t0) {
  return std::chrono::duration<double>(MonotonicClock::now() - t0).count();
}

}  // namespace strata
