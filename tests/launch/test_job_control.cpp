// launch/job_control.h: the sd_notify datagram (systemd's protocol, read back from a socket
// this test binds, a path and an abstract name), the stop signals blocked before main()
// and caught by serve, and the status file the launch script reads.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "launch/job_control.h"

namespace strata::cli {
namespace {

// A datagram socket bound to `name` (a path, or '@' and an abstract name), as systemd's.
int bind_notify_socket(const std::string& name) {
  const int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, name.data(), name.size());
  if (name[0] == '@') addr.sun_path[0] = '\0';
  const auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size());
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), len), 0) << std::strerror(errno);
  return fd;
}

std::string receive(int fd) {
  timeval t{2, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &t, sizeof(t));
  char buf[256] = {};
  const ssize_t n = recv(fd, buf, sizeof(buf), 0);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

TEST(JobControl, ReadyGoesToTheNotifySocketAtAPathAndAnAbstractName) {
  const std::string path =
      (std::filesystem::temp_directory_path() / ("strata-notify-" + std::to_string(getpid())))
          .string();
  std::filesystem::remove(path);
  const int fd = bind_notify_socket(path);
  setenv("NOTIFY_SOCKET", path.c_str(), 1);
  EXPECT_TRUE(notify_service_manager("READY=1"));
  EXPECT_EQ(receive(fd), "READY=1");
  close(fd);
  std::filesystem::remove(path);

  const std::string abstract = "@strata-notify-" + std::to_string(getpid());
  const int afd = bind_notify_socket(abstract);
  setenv("NOTIFY_SOCKET", abstract.c_str(), 1);
  EXPECT_TRUE(notify_service_manager("STATUS=serving"));
  EXPECT_EQ(receive(afd), "STATUS=serving");
  close(afd);

  unsetenv("NOTIFY_SOCKET");
  EXPECT_FALSE(notify_service_manager("READY=1"));  // not under systemd: nothing to tell
}

// The constructor blocked SIGTERM before main(): a SIGTERM sent now waits, and once
// caught it is a number in stop_signal(), not the end of the process.
TEST(JobControl, AStopSignalBeforeTheHandlerWaitsAndIsThenCaught) {
  sigset_t blocked;
  sigprocmask(SIG_BLOCK, nullptr, &blocked);
  ASSERT_EQ(sigismember(&blocked, SIGTERM), 1) << "SIGTERM not blocked before main()";
  ASSERT_EQ(sigismember(&blocked, SIGINT), 1);
  ASSERT_EQ(stop_signal().load(), 0);
  ASSERT_EQ(raise(SIGTERM), 0);  // pending: the process lives on
  EXPECT_EQ(stop_signal().load(), 0);
  catch_stop_signals();
  EXPECT_EQ(stop_signal().load(), SIGTERM);
}

TEST(JobControl, StatusFileForTheLaunchScript) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("strata-status-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  setenv("STRATA_RANK_STATUS_DIR", dir.c_str(), 1);
  setenv("OMPI_COMM_WORLD_RANK", "0", 1);
  EXPECT_EQ(leave_status(0), 0);
  EXPECT_FALSE(std::filesystem::exists(dir / "rank.0"));  // success leaves nothing
  EXPECT_EQ(leave_status(1), 1);
  std::ifstream in(dir / "rank.0");
  int code = -1;
  in >> code;
  EXPECT_EQ(code, 1);
  std::filesystem::remove_all(dir);
  unsetenv("STRATA_RANK_STATUS_DIR");
}

}  // namespace
}  // namespace strata::cli
