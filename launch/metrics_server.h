// GET /metrics (Prometheus) and GET /health over HTTP for `strata serve --metrics-port`: one
// thread polling every connection, so no client can hold a handler. Each connection must
// deliver its request head within a deadline and take its answer within another; beyond
// kMaxConnections the oldest connection is shed for the newest; the listen backlog is the
// kernel's largest. A scrape is answered in the time render() takes, however many clients
// hold connections open (docs/METRICS.md).
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <thread>

namespace strata::cli {

struct MetricsServerLimits {
  std::chrono::milliseconds head_deadline{2000};   // accept to the end of the request head
  std::chrono::milliseconds write_deadline{5000};  // the answer, once the head is in
  int max_connections = 4096;                      // open at once; then the oldest is shed
  size_t max_head_bytes = 8192;                    // request line and headers
};

class MetricsServer {
 public:
  // Listens on host:port (port 0: any free port); an InputError when it cannot. /health
  // answers 200 "ok" once `ready` says so (always, without one), 503 "starting" before.
  MetricsServer(const std::string& host, int port, std::function<std::string()> render,
                MetricsServerLimits limits = {}, std::function<bool()> ready = nullptr);
  ~MetricsServer();  // stops serving (every connection closed) and joins the thread
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  int port() const { return port_; }

 private:
  void serve();

  std::function<std::string()> render_;
  std::function<bool()> ready_;
  MetricsServerLimits limits_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // an eventfd: the destructor's stop
  int port_ = 0;
  std::thread thread_;
};

}  // namespace strata::cli
