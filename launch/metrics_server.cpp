#include "launch/metrics_server.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <string_view>
#include <vector>

#include "kernels/error.h"
#include "kernels/log.h"

namespace strata::cli {
namespace {

using Clock = std::chrono::steady_clock;

// One client: its request head coming in, then its answer going out, each before a deadline.
struct Connection {
  int fd = -1;
  Clock::time_point deadline;
  std::string in;
  std::string out;  // non-empty: the head is in and the answer is being written
  size_t sent = 0;
};

// Held connections cost a descriptor each: let the process open as many as its hard limit
// allows, as servers of many clients do.
void raise_descriptor_limit(int want) {
  rlimit r{};
  if (getrlimit(RLIMIT_NOFILE, &r) != 0) return;
  const rlim_t need = static_cast<rlim_t>(want) + 256;
  if (r.rlim_cur >= need) return;
  r.rlim_cur = std::min(need, r.rlim_max);
  (void)setrlimit(RLIMIT_NOFILE, &r);
}

int listen_on(const std::string& host, int port, int& bound_port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (getaddrinfo(host.c_str(), service.c_str(), &hints, &found) != 0 || found == nullptr)
    return -1;
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, SOMAXCONN) != 0) {
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  if (fd < 0) return -1;
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  bound_port = addr.ss_family == AF_INET6
                   ? ntohs(reinterpret_cast<const sockaddr_in6*>(&addr)->sin6_port)
                   : ntohs(reinterpret_cast<const sockaddr_in*>(&addr)->sin_port);
  return fd;
}

std::string answer(int status, std::string_view reason, std::string_view type,
                   const std::string& body) {
  return fmt::format(
      "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
      status, reason, type, body.size(), body);
}

// The answer to a complete request head.
std::string respond(std::string_view head, const std::function<std::string()>& render,
                    const std::function<bool()>& ready) {
  const std::string_view line = head.substr(0, head.find("\r\n"));
  const size_t sp1 = line.find(' ');
  const size_t sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp2 == std::string_view::npos)
    return answer(400, "Bad Request", "text/plain", "bad request line\n");
  const std::string_view method = line.substr(0, sp1);
  std::string_view path = line.substr(sp1 + 1, sp2 - sp1 - 1);
  path = path.substr(0, path.find('?'));
  if (method != "GET") return answer(405, "Method Not Allowed", "text/plain", "GET only\n");
  if (path == "/metrics")
    return answer(200, "OK", "text/plain; version=0.0.4; charset=utf-8", render());
  if (path == "/health")
    return !ready || ready() ? answer(200, "OK", "text/plain", "ok\n")
                             : answer(503, "Service Unavailable", "text/plain", "starting\n");
  return answer(404, "Not Found", "text/plain", "/metrics or /health\n");
}

}  // namespace

MetricsServer::MetricsServer(const std::string& host, int port, std::function<std::string()> render,
                             MetricsServerLimits limits, std::function<bool()> ready)
    : render_(std::move(render)), ready_(std::move(ready)), limits_(limits) {
  if (port < 0 || port > 65535) fail_input("--metrics-port {}: not a TCP port (0 to 65535)", port);
  raise_descriptor_limit(limits_.max_connections);
  listen_fd_ = listen_on(host, port, port_);
  if (listen_fd_ < 0)
    fail_input("--metrics-port {}: cannot listen on {}:{} (in use, or not an address of this host)",
               port, host, port);
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) {
    close(listen_fd_);
    fail(ErrorKind::kFailed, "metrics server: eventfd: {}", std::strerror(errno));
  }
  thread_ = std::thread([this] { serve(); });
  log::get("launch")->info("metrics on http://{}:{}/metrics", host, port_);
}

MetricsServer::~MetricsServer() {
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
  if (thread_.joinable()) thread_.join();
  close(wake_fd_);
  close(listen_fd_);
}

// One poll over the listener, the stop and every connection; a connection past its deadline
// is closed, so a client that sends slowly, or never reads, holds only its own descriptor.
void MetricsServer::serve() {
  std::deque<Connection> conns;  // oldest first
  std::vector<pollfd> fds;
  const auto drop = [](Connection& c) {
    close(c.fd);
    c.fd = -1;
  };
  for (;;) {
    const Clock::time_point now = Clock::now();
    for (Connection& c : conns)
      if (c.fd >= 0 && now >= c.deadline) drop(c);
    std::erase_if(conns, [](const Connection& c) { return c.fd < 0; });
    Clock::time_point next = now + std::chrono::seconds(1);
    fds.assign({{wake_fd_, POLLIN, 0}, {listen_fd_, POLLIN, 0}});
    for (const Connection& c : conns) {
      fds.push_back({c.fd, static_cast<short>(c.out.empty() ? POLLIN : POLLOUT), 0});
      next = std::min(next, c.deadline);
    }
    const auto wait = std::chrono::ceil<std::chrono::milliseconds>(next - now).count();
    if (poll(fds.data(), fds.size(), static_cast<int>(std::max<int64_t>(wait, 0))) < 0 &&
        errno != EINTR)
      break;
    if (fds[0].revents != 0) break;  // stop
    for (size_t i = 0; i < conns.size(); ++i) {
      Connection& c = conns[i];
      const short ev = fds[i + 2].revents;
      if (ev == 0) continue;
      if (c.out.empty()) {
        char buf[2048];
        const ssize_t n = recv(c.fd, buf, sizeof(buf), 0);
        if (n <= 0) {
          if (n == 0 || (errno != EAGAIN && errno != EINTR)) drop(c);
          continue;
        }
        c.in.append(buf, static_cast<size_t>(n));
        const size_t end = c.in.find("\r\n\r\n");
        if (end == std::string::npos && c.in.size() <= limits_.max_head_bytes) continue;
        c.out =
            end == std::string::npos
                ? answer(431, "Request Header Fields Too Large", "text/plain", "head too long\n")
                : respond(std::string_view(c.in).substr(0, end), render_, ready_);
        c.in.clear();
        c.deadline = Clock::now() + limits_.write_deadline;
      }
      const ssize_t n = send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL);
      if (n < 0) {
        if (errno != EAGAIN && errno != EINTR) drop(c);
        continue;
      }
      c.sent += static_cast<size_t>(n);
      if (c.sent == c.out.size()) drop(c);
    }
    if (fds[1].revents != 0) {
      for (;;) {
        const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) break;
        // Shed the oldest first: a flood of held connections cannot keep a new scrape out.
        while (static_cast<int>(conns.size()) >= limits_.max_connections) {
          if (conns.front().fd >= 0) close(conns.front().fd);
          conns.pop_front();
        }
        conns.push_back({fd, Clock::now() + limits_.head_deadline, {}, {}, 0});
      }
    }
  }
  for (Connection& c : conns)
    if (c.fd >= 0) close(c.fd);
}

}  // namespace strata::cli
