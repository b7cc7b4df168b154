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

// The length of the valid UTF-8 sequence at text[i] (RFC 3629: no overlongs, surrogates or
// code points past U+10FFFF), 0 when it is not one.
size_t utf8_length(std::string_view text, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(text[i + k]); };
  const unsigned char c = b(0);
  size_t n = 0;
  if (c >= 0xc2 && c <= 0xdf)
    n = 2;
  else if (c >= 0xe0 && c <= 0xef)
    n = 3;
  else if (c >= 0xf0 && c <= 0xf4)
    n = 4;
  if (n == 0 || i + n > text.size()) return 0;
  for (size_t k = 1; k < n; ++k)
    if ((b(k) & 0xc0) != 0x80) return 0;
  if ((c == 0xe0 && b(1) < 0xa0) || (c == 0xed && b(1) > 0x9f) || (c == 0xf0 && b(1) < 0x90) ||
      (c == 0xf4 && b(1) > 0x8f))
    return 0;
  return n;
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

std::string printable(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const auto u = static_cast<unsigned char>(text[i]);
    if (u >= 0x20 && u < 0x7f && u != '\\') {
      out.push_back(text[i++]);
    } else if (const size_t n = u >= 0x80 ? utf8_length(text, i) : 0; n > 0) {
      out.append(text.substr(i, n));
      i += n;
    } else {
      out += fmt::format("\\x{:02x}", u);
      ++i;
    }
  }
  return out;
}

}  // namespace strata::log
