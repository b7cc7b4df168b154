#include "transport/liveness.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <sstream>

#include "kernels/error.h"
#include "kernels/log.h"

namespace strata {
namespace {

constexpr char kGoodbye = 'B';

int remaining_ms(const Deadline& deadline) {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline.at() - Deadline::Clock::now());
  return static_cast<int>(std::max<int64_t>(0, left.count()));
}

// A dead host sends no FIN: keepalive probes find it (5 s idle, then 3 probes 1 s apart).
void keep_alive(int fd) {
  const int on = 1, idle = 5, interval = 1, count = 3;
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof(on));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on));
}

// Rank 0's IPv4 addresses, the loopback last: the workers on its own host reach any of them.
std::vector<std::string> own_addresses() {
  std::vector<std::string> out, loopback;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return {"127.0.0.1"};
  for (const ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    if ((a->ifa_flags & IFF_UP) == 0) continue;
    char text[INET_ADDRSTRLEN] = {};
    const auto* in = reinterpret_cast<const sockaddr_in*>(a->ifa_addr);
    inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text));
    ((a->ifa_flags & IFF_LOOPBACK) != 0 ? loopback : out).emplace_back(text);
  }
  freeifaddrs(list);
  out.insert(out.end(), loopback.begin(), loopback.end());
  return out;
}

int listen_any(int& port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) fail(ErrorKind::kFailed, "liveness links: socket: {}", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof(addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(fd, SOMAXCONN) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const std::string why = std::strerror(errno);
    close(fd);
    fail(ErrorKind::kFailed, "liveness links: cannot listen on a TCP port: {}", why);
  }
  port = ntohs(addr.sin_port);
  return fd;
}

// A connected socket to address:port within `seconds`, or -1 (the reason in `why`).
int connect_to(const std::string& address, int port, double seconds, std::string& why) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, address.c_str(), &addr.sin_addr) != 1) {
    why = fmt::format("{}: not an IPv4 address", address);
    return -1;
  }
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    why = std::strerror(errno);
    return -1;
  }
  int rc = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  if (rc != 0 && errno == EINPROGRESS) {
    pollfd p{fd, POLLOUT, 0};
    rc = poll(&p, 1, static_cast<int>(seconds * 1000)) == 1 ? 0 : -1;
    int err = rc == 0 ? 0 : ETIMEDOUT;
    socklen_t len = sizeof(err);
    if (rc == 0) getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    errno = err;
    rc = err == 0 ? 0 : -1;
  }
  if (rc != 0) {
    why = fmt::format("{}:{}: {}", address, port, std::strerror(errno));
    close(fd);
    return -1;
  }
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fd;
}

bool write_all(int fd, const void* data, size_t n) {
  return send(fd, data, n, MSG_NOSIGNAL) == static_cast<ssize_t>(n);
}

// Reads exactly n bytes before the deadline.
bool read_all(int fd, void* data, size_t n, const Deadline& deadline) {
  auto* at = static_cast<char*>(data);
  while (n > 0) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, remaining_ms(deadline)) != 1) return false;
    const ssize_t got = recv(fd, at, n, 0);
    if (got <= 0) return false;
    at += got;
    n -= static_cast<size_t>(got);
  }
  return true;
}

// A worker's side: rank 0's address list ("port a1 a2 ..."), each tried in turn.
int connect_worker(const std::string& announced, int rank, double seconds) {
  std::istringstream in(announced);
  int port = 0;
  in >> port;
  std::vector<std::string> reasons;
  for (std::string address; in >> address;) {
    std::string why;
    const int fd = connect_to(address, port, seconds, why);
    const uint32_t me = htonl(static_cast<uint32_t>(rank));
    if (fd >= 0 && write_all(fd, &me, sizeof(me))) return fd;
    if (fd >= 0) close(fd);
    reasons.push_back(why);
  }
  log::get("transport")
      ->warn(
          "rank {}: no liveness link to rank 0 ({}): its death is noticed by the heartbeat "
          "timeout alone",
          rank, fmt::join(reasons, "; "));
  return -1;
}

// Rank 0's side: one accepted connection per worker that said it connected.
std::vector<int> accept_workers(int listener, size_t expected, const Deadline& deadline,
                                std::vector<int>& ranks) {
  std::vector<int> fds;
  while (fds.size() < expected) {
    pollfd p{listener, POLLIN, 0};
    if (poll(&p, 1, remaining_ms(deadline)) != 1) break;
    const int fd = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    uint32_t rank = 0;
    if (!read_all(fd, &rank, sizeof(rank), deadline)) {
      close(fd);
      continue;
    }
    fds.push_back(fd);
    ranks.push_back(static_cast<int>(ntohl(rank)));
  }
  return fds;
}

}  // namespace

std::unique_ptr<LivenessLinks> LivenessLinks::create(const Communicator& world,
                                                     const Deadline& deadline,
                                                     double connect_seconds) {
  int port = 0;
  int listener = -1;
  std::string announced;
  if (world.rank() == 0) {
    listener = listen_any(port);
    announced = fmt::format("{} {}", port, fmt::join(own_addresses(), " "));
  }
  const std::string rank0 =
      allgather_text(world, announced, deadline, "rank 0's liveness address").at(0);
  std::vector<Link> links;
  const int fd = world.rank() == 0 ? -1 : connect_worker(rank0, world.rank(), connect_seconds);
  const std::vector<int> connected =
      world.allgather(fd >= 0 ? 1 : 0, deadline, "the liveness links");
  if (world.rank() != 0) {
    if (fd >= 0) links.push_back(Link{0, fd});
  } else {
    size_t expected = 0;
    for (int c : connected) expected += static_cast<size_t>(c);
    std::vector<int> ranks;
    const std::vector<int> fds = accept_workers(listener, expected, deadline, ranks);
    close(listener);
    for (size_t i = 0; i < fds.size(); ++i) links.push_back(Link{ranks[i], fds[i]});
    if (fds.size() < static_cast<size_t>(world.size() - 1))
      log::get("transport")
          ->warn("liveness links: {} of {} workers linked; the others are watched by heartbeats",
                 fds.size(), world.size() - 1);
  }
  for (const Link& l : links) keep_alive(l.fd);
  return std::unique_ptr<LivenessLinks>(new LivenessLinks(world.rank(), std::move(links), port));
}

LivenessLinks::LivenessLinks(int rank, std::vector<Link> links, int port)
    : rank_(rank), port_(port), links_(std::move(links)) {
  STRATA_CHECK(pipe2(wake_, O_CLOEXEC) == 0, "pipe2: {}", std::strerror(errno));
  watcher_ = std::thread([this] { watch(); });
}

LivenessLinks::~LivenessLinks() {
  const char stop = 1;
  if (write(wake_[1], &stop, 1) != 1) {
    // The watcher then ends with the process; nothing else can be done in a destructor.
  }
  watcher_.join();
  for (Link& l : links_) {
    if (l.fd < 0) continue;
    // Goodbye, then a half close, and what the peer sent drained: a close with unread bytes
    // would reset the connection, and a reset may lose the goodbye on its way.
    write_all(l.fd, &kGoodbye, 1);
    shutdown(l.fd, SHUT_WR);
    char sink[64];
    while (recv(l.fd, sink, sizeof(sink), MSG_DONTWAIT) > 0) {
    }
    close(l.fd);
  }
  close(wake_[0]);
  close(wake_[1]);
}

void LivenessLinks::watch() {
  while (true) {
    std::vector<pollfd> fds{{wake_[0], POLLIN, 0}};
    std::vector<Link*> of;
    for (Link& l : links_)
      if (l.fd >= 0) {
        fds.push_back({l.fd, POLLIN, 0});
        of.push_back(&l);
      }
    if (poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[0].revents != 0) return;
    for (size_t i = 1; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      char bytes[64];
      const ssize_t got = recv(of[i - 1]->fd, bytes, sizeof(bytes), MSG_DONTWAIT);
      if (got > 0 && std::memchr(bytes, kGoodbye, static_cast<size_t>(got)) != nullptr) {
        closed(*of[i - 1], true);
      } else if (got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR)) {
        closed(*of[i - 1], false);
      }
    }
  }
}

void LivenessLinks::closed(Link& link, bool goodbye) {
  close(link.fd);
  link.fd = -1;
  if (goodbye) return;
  OnLost handler;
  {
    std::lock_guard lock(mutex_);
    if (lost_) return;
    lost_ = link.rank;
    if (!handler_) return;
    handler = handler_;
    handed_ = true;
  }
  handler(link.rank);
}

void LivenessLinks::on_lost(OnLost handler) {
  OnLost now;
  int rank = -1;
  {
    std::lock_guard lock(mutex_);
    handler_ = std::move(handler);
    if (!lost_ || handed_ || !handler_) return;
    handed_ = true;
    now = handler_;
    rank = *lost_;
  }
  now(rank);
}

std::optional<int> LivenessLinks::lost() const {
  std::lock_guard lock(mutex_);
  return lost_;
}

std::vector<int> LivenessLinks::linked() const {
  std::vector<int> out;
  for (const Link& l : links_) out.push_back(l.rank);
  return out;
}

std::string LivenessLinks::str() const {
  if (rank_ != 0) return links_.empty() ? "no liveness link to rank 0" : "linked to rank 0";
  return fmt::format("{} workers linked on port {}", links_.size(), port_);
}

}  // namespace strata
