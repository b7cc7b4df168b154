// Progress of a long command on stderr: a bar redrawn in place (done / total, rate, ETA)
// on a terminal, a log line every few seconds otherwise (logs, CI; a job done before the
// first line prints none), never more than a few updates a second.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>

namespace strata::cli {

// A Progress behind a (done, total) callback, made on the first call: for the loops of
// libraries below launch/ that report as they go (policy search, model loading).
std::function<void(size_t done, size_t total)> progress_callback(std::string what);

class Progress {
 public:
  Progress(std::string what, size_t total);
  void update(size_t done);  // cheap: draws only when due
  void finish(size_t done);  // the last line, always drawn

 private:
  using Clock = std::chrono::steady_clock;
  void draw(size_t done, bool last);

  std::string what_;
  size_t total_;
  bool terminal_;
  Clock::time_point start_;
  Clock::time_point last_draw_;
};

}  // namespace strata::cli
