#include "launch/metrics_server.h"

#include <httplib.h>

#include <chrono>

#include "kernels/error.h"
#include "kernels/log.h"

namespace strata::cli {

MetricsServer::MetricsServer(const std::string& host, int port, std::function<std::string()> render)
    : server_(std::make_unique<httplib::Server>()) {
  if (port < 0 || port > 65535) fail_input("--metrics-port {}: not a TCP port (0 to 65535)", port);
  server_->Get("/metrics",
               [render = std::move(render)](const httplib::Request&, httplib::Response& res) {
                 res.set_content(render(), "text/plain; version=0.0.4; charset=utf-8");
               });
  if (port == 0) {
    port_ = server_->bind_to_any_port(host);
  } else {
    port_ = server_->bind_to_port(host, port) ? port : -1;
  }
  if (port_ < 0)
    fail_input("--metrics-port {}: cannot listen on {}:{} (in use, or not an address of this host)",
               port, host, port);
  thread_ = std::thread([this] { server_->listen_after_bind(); });
  log::get("launch")->info("metrics on http://{}:{}/metrics", host, port_);
}

MetricsServer::~MetricsServer() {
  // stop() only ends a loop that has started: wait for it (bounded) so the join cannot hang.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!server_->is_running() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  server_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace strata::cli
