#include "launch/progress.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <optional>

#include "kernels/log.h"

namespace strata::cli {

std::function<void(size_t, size_t)> progress_callback(std::string what) {
  auto progress = std::make_shared<std::optional<Progress>>();
  return [progress, what = std::move(what)](size_t done, size_t total) {
    if (!*progress) progress->emplace(what, total);
    if (done < total) return (*progress)->update(done);
    (*progress)->finish(done);
    progress->reset();  // a second run of the loop starts a bar of its own
  };
}

Progress::Progress(std::string what, size_t total)
    : what_(std::move(what)),
      total_(total),
      terminal_(isatty(fileno(stderr)) != 0),
      start_(Clock::now()),
      last_draw_(start_) {}

void Progress::update(size_t done) {
  const auto every = terminal_ ? std::chrono::milliseconds(100) : std::chrono::seconds(5);
  if (Clock::now() - last_draw_ >= every) draw(done, false);
}

// Off a terminal a job shorter than one line's interval says nothing: the lines are for
// long jobs, whose logs would otherwise go quiet for minutes.
void Progress::finish(size_t done) {
  if (terminal_ || last_draw_ != start_) draw(done, true);
}

void Progress::draw(size_t done, bool last) {
  last_draw_ = Clock::now();
  const double seconds = std::chrono::duration<double>(last_draw_ - start_).count();
  const double rate = seconds > 0 ? static_cast<double>(done) / seconds : 0.0;
  const double left = rate > 0 ? static_cast<double>(total_ - std::min(done, total_)) / rate : 0;
  const double fraction = total_ > 0 ? static_cast<double>(done) / static_cast<double>(total_) : 1;
  const std::string eta = last       ? fmt::format("in {:.1f} s", seconds)
                          : rate > 0 ? fmt::format("ETA {:.0f} s", left)
                                     : std::string("ETA ?");
  const std::string numbers = fmt::format("{} {}/{} ({:.0f}%), {:.1f}/s, {}", what_, done, total_,
                                          100 * fraction, rate, eta);
  if (!terminal_) {  // a log line: timestamped, named by host and rank, STRATA_LOG_LEVEL applies
    log::get("progress")->info("{}", numbers);
    return;
  }
  constexpr int kWidth = 30;
  const int filled = static_cast<int>(fraction * kWidth);
  std::fprintf(stderr, "\r[%s%s] %s\033[K%s", std::string(static_cast<size_t>(filled), '#').c_str(),
               std::string(static_cast<size_t>(kWidth - filled), '.').c_str(), numbers.c_str(),
               last ? "\n" : "");
}

}  // namespace strata::cli
