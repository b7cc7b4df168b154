#include "kernels/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <unistd.h>

#include <mutex>

#include "kernels/tunables.h"

namespace strata::log {
namespace {

std::mutex g_mutex;
std::string g_identity;  // "host:pid rank dev", fixed after set_identity

std::string host_name() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "?";
  return buf;
}

std::string make_pattern() {
  if (g_identity.empty()) g_identity = fmt::format("{}:{} r0 cpu", host_name(), getpid());
  return fmt::format("[%H:%M:%S.%e] [{}] [%n] [%l] %v", g_identity);
}

spdlog::level::level_enum level_from_env() {
  const std::optional<std::string> v = tunable_text(TunableId::kLogLevel);
  if (!v) return spdlog::level::info;
  return spdlog::level::from_str(*v);
}

}  // namespace

void set_identity(int rank, const std::string& device) {
  std::lock_guard lock(g_mutex);
  g_identity = fmt::format("{}:{} r{} {}", host_name(), getpid(), rank, device);
  spdlog::apply_all(
      [](const std::shared_ptr<spdlog::logger>& l) { l->set_pattern(make_pattern()); });
}

std::shared_ptr<spdlog::logger> get(const std::string& subsystem) {
  std::lock_guard lock(g_mutex);
  if (auto existing = spdlog::get(subsystem)) return existing;
  auto logger = spdlog::stderr_color_mt(subsystem);
  logger->set_pattern(make_pattern());
  logger->set_level(level_from_env());
  return logger;
}

}  // namespace strata::log
