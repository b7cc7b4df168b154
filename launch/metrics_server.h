// GET /metrics over HTTP for Prometheus (`strata serve --metrics-port`): cpp-httplib's
// server on a thread of its own, answering with what `render` returns at that moment.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>

namespace httplib {
class Server;
}

namespace strata::cli {

class MetricsServer {
 public:
  // Listens on host:port (port 0: any free port); an InputError when it cannot.
  MetricsServer(const std::string& host, int port, std::function<std::string()> render);
  ~MetricsServer();  // stops serving and joins the thread
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  int port() const { return port_; }

 private:
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  int port_ = 0;
};

}  // namespace strata::cli
