#include "launch/job_control.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>

#include "kernels/log.h"
#include "kernels/tunables.h"

namespace strata::cli {
namespace {

std::atomic<int> g_stop_signal{0};
static_assert(std::atomic<int>::is_always_lock_free, "written in a signal handler");

sigset_t stop_set() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  return set;
}

// Before every other constructor and main(): from here on a stop signal waits. Threads
// started later inherit the mask until main() sets the signals' fate.
__attribute__((constructor(101))) void block_stop_signals() {
  const sigset_t set = stop_set();
  sigprocmask(SIG_BLOCK, &set, nullptr);
}

void on_stop_signal(int signal) {
  g_stop_signal.store(signal);
}

// A file in the launch script's status folder (STRATA_RANK_STATUS_DIR), if there is one.
std::optional<std::string> status_path(const std::string& name) {
  const std::optional<std::string> dir = tunable_text(TunableId::kRankStatusDir);
  if (!dir) return std::nullopt;
  return *dir + "/" + name;
}

void unblock() {
  const sigset_t set = stop_set();
  pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
}

}  // namespace

void catch_stop_signals() {
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
  unblock();  // a signal that came while starting is caught now
}

void default_stop_signals() {
  unblock();
}

const std::atomic<int>& stop_signal() {
  return g_stop_signal;
}

void say_ready_for_signals() {
  if (const auto path = status_path("ready." + std::to_string(getpid())))
    std::ofstream(*path) << "\n";
}

void say_started() {
  if (const auto path = status_path("started." + std::to_string(getpid())))
    std::ofstream(*path) << "\n";
}

int leave_status(int code) {
  if (code == 0) return code;
  const std::optional<std::string> rank = foreign_variable("OMPI_COMM_WORLD_RANK");
  if (const auto path = status_path("rank." + rank.value_or("0")))
    std::ofstream(*path) << code << '\n';
  return code;
}

bool notify_service_manager(const std::string& state) {
  const std::optional<std::string> path = foreign_variable("NOTIFY_SOCKET");
  if (!path || path->empty()) return false;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path->size() >= sizeof(addr.sun_path)) return false;
  std::memcpy(addr.sun_path, path->data(), path->size());
  if (addr.sun_path[0] == '@') addr.sun_path[0] = '\0';  // an abstract socket
  const auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + path->size());
  const int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  const bool sent =
      sendto(fd, state.data(), state.size(), MSG_NOSIGNAL, reinterpret_cast<sockaddr*>(&addr),
             len) == static_cast<ssize_t>(state.size());
  close(fd);
  return sent;
}

int status_left_by(int rank) {
  const std::optional<std::string> path = status_path("rank." + std::to_string(rank));
  if (!path) return 0;
  std::ifstream in(*path);
  int code = 0;
  return in >> code ? code : 0;
}

StartWatchdog::StartWatchdog(double bound_s) : thread_([this, bound_s] { watch(bound_s); }) {}

StartWatchdog::~StartWatchdog() {
  {
    std::lock_guard lock(mutex_);
    done_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void StartWatchdog::watch(double bound_s) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  std::optional<Clock::time_point> signalled;
  std::unique_lock lock(mutex_);
  while (!wake_.wait_for(lock, std::chrono::milliseconds(50), [this] { return done_; })) {
    const int signal = g_stop_signal.load();
    if (signal != 0 && !signalled) signalled = Clock::now();
    const double since_start = std::chrono::duration<double>(Clock::now() - start).count();
    const double since_signal =
        signalled ? std::chrono::duration<double>(Clock::now() - *signalled).count() : 0.0;
    if (since_signal <= kStopBoundSeconds && since_start <= bound_s) continue;
    const int code = signal != 0 ? 128 + signal : 1;
    log::get("launch")->error(
        "the job's start (MPI_Init and the links to rank 0) did not finish {}; another rank "
        "probably died while the job started: this rank ends with status {}",
        signal != 0 ? fmt::format("within {} s of signal {}", kStopBoundSeconds, signal)
                    : fmt::format("within --load-timeout {} s", bound_s),
        code);
    std::_Exit(leave_status(code));
  }
}

}  // namespace strata::cli
