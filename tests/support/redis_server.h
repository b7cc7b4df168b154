// A real redis-server for a test: started on a free loopback port with its data in a
// folder of the test's own, killed (SIGKILL, as a crash) or restarted on the same port and
// data, stopped at the end. The queue's guarantees are tested against the real server,
// never a fake.
#pragma once

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "transport/redis_client.h"

namespace strata::testing {

inline int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    close(fd);
    throw std::runtime_error("no free port");
  }
  close(fd);
  return ntohs(a.sin_port);
}

class RedisServer {
 public:
  // `extra`: more redis-server options, e.g. {"--appendonly", "yes", "--appendfsync", "always"}.
  explicit RedisServer(const std::string& dir, std::vector<std::string> extra = {})
      : dir_(dir), extra_(std::move(extra)), port_(free_port()) {
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    start();
  }
  ~RedisServer() { kill(); }
  RedisServer(const RedisServer&) = delete;
  RedisServer& operator=(const RedisServer&) = delete;

  int port() const { return port_; }
  std::string url() const { return "redis://127.0.0.1:" + std::to_string(port_); }
  RedisEndpoint endpoint() const { return RedisEndpoint::parse(url()); }
  RedisConnection connect() const {
    return RedisConnection::open(endpoint(), Deadline::after_seconds(5));
  }

  void start() {
    std::vector<std::string> args{
        "redis-server", "--bind",    "127.0.0.1",        "--port", std::to_string(port_),
        "--dir",        dir_,        "--save",           "",       "--daemonize",
        "no",           "--logfile", dir_ + "/redis.log"};
    if (std::find(extra_.begin(), extra_.end(), "--appendonly") == extra_.end())
      args.insert(args.end(), {"--appendonly", "no"});
    args.insert(args.end(), extra_.begin(), extra_.end());
    pid_ = fork();
    if (pid_ == 0) {
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execvp("redis-server", argv.data());
      _exit(127);
    }
    for (int i = 0; i < 200; ++i) {  // answers PING within milliseconds; 10 s at most
      try {
        connect().command({"PING"}, Deadline::after_seconds(1));
        return;
      } catch (const RedisError&) {
        return;  // it answers (NOAUTH with --requirepass)
      } catch (const Error&) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    }
    throw std::runtime_error("redis-server did not start on port " + std::to_string(port_));
  }

  // SIGKILL: a crash, no shutdown save.
  void kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

  void restart() {
    kill();
    start();
  }

 private:
  std::string dir_;
  std::vector<std::string> extra_;
  int port_;
  pid_t pid_ = -1;
};

}  // namespace strata::testing
