// The metrics endpoint (launch/metrics_server.h) on 127.0.0.1 while clients try to hold it:
// 100 slowloris clients (a header line every 250 ms, never the blank line) and 1,000 idle
// ones (connected, nothing sent). Every scrape must be answered within 1 s; the slow ones
// are cut at the head deadline; a request head past the limit is refused.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "kernels/error.h"
#include "launch/metrics_server.h"

namespace strata::cli {
namespace {

using Clock = std::chrono::steady_clock;

int connect_to(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    if (fd >= 0) close(fd);
    return -1;
  }
  return fd;
}

// Sends `request` and reads to EOF, giving up after `limit`; what came back.
std::string exchange(int port, const std::string& request, std::chrono::milliseconds limit) {
  const int fd = connect_to(port);
  if (fd < 0) return "";
  (void)!send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string got;
  const auto end = Clock::now() + limit;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now());
    pollfd p{fd, POLLIN, 0};
    if (left.count() <= 0 || poll(&p, 1, static_cast<int>(left.count())) <= 0) break;
    char buf[4096];
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    got.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  return got;
}

std::string scrape(int port, std::chrono::milliseconds limit = std::chrono::milliseconds(1000)) {
  return exchange(port, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", limit);
}

void allow_descriptors(rlim_t n) {
  rlimit r{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &r), 0);
  if (r.rlim_cur < n) {
    ASSERT_GE(r.rlim_max, n) << "this test holds " << n << " descriptors";
    r.rlim_cur = n;
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &r), 0);
  }
}

TEST(MetricsServer, AnswersMetricsHealthAndRefusals) {
  MetricsServer server("127.0.0.1", 0, [] { return std::string("strata_up 1\n"); });
  const std::string m = scrape(server.port());
  EXPECT_EQ(m.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << m;
  EXPECT_NE(m.find("text/plain; version=0.0.4"), std::string::npos) << m;
  EXPECT_NE(m.find("\r\n\r\nstrata_up 1\n"), std::string::npos) << m;
  const auto ms = std::chrono::milliseconds(1000);
  EXPECT_NE(exchange(server.port(), "GET /health HTTP/1.1\r\n\r\n", ms).find("\r\n\r\nok\n"),
            std::string::npos);
  EXPECT_EQ(exchange(server.port(), "GET /nope HTTP/1.1\r\n\r\n", ms).rfind("HTTP/1.1 404", 0), 0u);
  EXPECT_EQ(exchange(server.port(), "POST /metrics HTTP/1.1\r\n\r\n", ms).rfind("HTTP/1.1 405", 0),
            0u);
  EXPECT_EQ(exchange(server.port(), std::string(10000, 'A'), ms).rfind("HTTP/1.1 431", 0), 0u);
}

// /health is the readiness an operator waits on: 503 "starting" until the run says it is
// ready (every stage loaded), 200 "ok" from then on; /metrics answers throughout.
TEST(MetricsServer, HealthSaysStartingUntilReady) {
  std::atomic<bool> ready{false};
  MetricsServer server(
      "127.0.0.1", 0, [] { return std::string("strata_up 1\n"); }, {},
      [&ready] { return ready.load(); });
  const auto ms = std::chrono::milliseconds(1000);
  const std::string before = exchange(server.port(), "GET /health HTTP/1.1\r\n\r\n", ms);
  EXPECT_EQ(before.rfind("HTTP/1.1 503 Service Unavailable\r\n", 0), 0u) << before;
  EXPECT_NE(before.find("\r\n\r\nstarting\n"), std::string::npos) << before;
  EXPECT_EQ(scrape(server.port()).rfind("HTTP/1.1 200 OK", 0), 0u);
  ready = true;
  const std::string after = exchange(server.port(), "GET /health HTTP/1.1\r\n\r\n", ms);
  EXPECT_EQ(after.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << after;
  EXPECT_NE(after.find("\r\n\r\nok\n"), std::string::npos) << after;
}

TEST(MetricsServer, ScrapedWithinASecondWhileSlowAndIdleClientsHoldConnections) {
  allow_descriptors(4096);
  MetricsServerLimits limits;
  limits.head_deadline = std::chrono::milliseconds(1500);
  MetricsServer server(
      "127.0.0.1", 0, [] { return std::string("strata_up 1\n"); }, limits);
  const int port = server.port();
  std::vector<int> idle, slow;
  for (int i = 0; i < 1000; ++i) idle.push_back(connect_to(port));
  for (int i = 0; i < 100; ++i) slow.push_back(connect_to(port));
  ASSERT_EQ(std::count(idle.begin(), idle.end(), -1) + std::count(slow.begin(), slow.end(), -1), 0);
  std::atomic<bool> stop{false};
  std::atomic<int> cut{0};  // slowloris connections the server closed
  std::thread loris([&] {
    for (int fd : slow) (void)!send(fd, "GET /metrics HTTP/1.1\r\n", 23, MSG_NOSIGNAL);
    while (!stop) {
      for (int& fd : slow) {
        if (fd < 0) continue;
        if (send(fd, "X-Slow: 1\r\n", 11, MSG_NOSIGNAL) < 0) {
          close(fd);
          fd = -1;
          ++cut;
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(250));
    }
  });
  // Scrapes for 3 s: before and after the head deadline has cut the held connections.
  int answered = 0;
  double worst = 0;
  const auto end = Clock::now() + std::chrono::seconds(3);
  while (Clock::now() < end) {
    const auto t0 = Clock::now();
    const std::string m = scrape(port);
    const double took = std::chrono::duration<double>(Clock::now() - t0).count();
    worst = std::max(worst, took);
    EXPECT_NE(m.find("strata_up 1"), std::string::npos)
        << "scrape " << answered << ": '" << m << "'";
    EXPECT_LT(took, 1.0) << "scrape " << answered;
    ++answered;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  stop = true;
  loris.join();
  std::printf("%d scrapes, slowest %.3f s; %d of 100 slowloris connections cut\n", answered, worst,
              cut.load());
  EXPECT_GE(answered, 10);
  // The head deadline (1.5 s) has passed for every slowloris: the server closed them (a send
  // on a closed peer fails once its reset is back).
  EXPECT_GE(cut.load(), 90);
  // The idle ones too: each reads EOF.
  int closed = 0;
  for (int fd : idle) {
    pollfd p{fd, POLLIN, 0};
    char c;
    if (poll(&p, 1, 0) == 1 && recv(fd, &c, 1, MSG_DONTWAIT) <= 0) ++closed;
    close(fd);
  }
  for (int fd : slow)
    if (fd >= 0) close(fd);
  EXPECT_EQ(closed, 1000);
}

TEST(MetricsServer, TheOldestConnectionIsShedForANewScrape) {
  MetricsServerLimits limits;
  limits.max_connections = 16;
  limits.head_deadline = std::chrono::milliseconds(60000);  // only shedding can free a slot
  MetricsServer server(
      "127.0.0.1", 0, [] { return std::string("strata_up 1\n"); }, limits);
  std::vector<int> held;
  for (int i = 0; i < 64; ++i) held.push_back(connect_to(server.port()));
  EXPECT_NE(scrape(server.port()).find("strata_up 1"), std::string::npos);
  for (int fd : held) close(fd);
}

TEST(MetricsServer, RefusesABadPortOrAddress) {
  EXPECT_THROW(MetricsServer("127.0.0.1", 70000, [] { return std::string(); }), InputError);
  EXPECT_THROW(MetricsServer("203.0.113.1", 0, [] { return std::string(); }), InputError);
}

}  // namespace
}  // namespace strata::cli
