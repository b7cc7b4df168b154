#include "worker/input_limits.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>

#include "kernels/error.h"
#include "kernels/tunables.h"

namespace strata {
namespace {

constexpr InputLimits::Field kFields[] = {
#define STRATA_INPUT_LIMIT_FIELD(name, def, ceiling, what) \
  {#name, &InputLimits::name, def, ceiling, what},
    STRATA_INPUT_LIMITS(STRATA_INPUT_LIMIT_FIELD)
#undef STRATA_INPUT_LIMIT_FIELD
};

const InputLimits::Field* find_field(std::string_view name) {
  for (const auto& f : kFields)
    if (name == f.name) return &f;
  return nullptr;
}

const InputLimits::Field& field_of(InputLimits::Member m) {
  for (const auto& f : kFields)
    if (f.member == m) return f;
  STRATA_CHECK(false, "an InputLimits member without a declaration in STRATA_INPUT_LIMITS");
}

std::string env_name(std::string_view name) {
  return tunable(TunableId::kInputLimit).variable(name);
}

std::string known_names() {
  std::string s;
  for (const auto& f : kFields) s += std::string(s.empty() ? "" : ", ") + f.name;
  return s;
}

// A decimal integer, all of the text, or nothing.
std::optional<int64_t> parse_int(std::string_view text) {
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return v;
}

struct Fd {
  int fd;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

std::span<const InputLimits::Field> InputLimits::fields() {
  return kFields;
}

void InputLimits::set(std::string_view name, int64_t value, std::string_view origin) {
  const Field* f = find_field(name);
  if (f == nullptr)
    fail_input("{}: unknown input limit '{}' (known: {})", origin, name, known_names());
  if (value < 1 || value > f->ceiling)
    fail_input("{}: input limit {} = {} is outside [1, {}]", origin, name, value, f->ceiling);
  this->*(f->member) = value;
}

void InputLimits::set_from_text(std::string_view assignment, std::string_view origin) {
  const size_t eq = assignment.find('=');
  const auto value =
      eq == std::string_view::npos ? std::nullopt : parse_int(assignment.substr(eq + 1));
  if (!value)
    fail_input("{} '{}': expected NAME=N with N a whole number (see strata limits --input)", origin,
               assignment);
  set(assignment.substr(0, eq), *value, origin);
}

InputLimits InputLimits::from_env() {
  InputLimits l;
  for (const auto& f : kFields) {
    if (const auto value = tunable_int_if_set(TunableId::kInputLimit, f.name))
      l.set(f.name, *value, env_name(f.name));
  }
  return l;
}

void InputLimits::check(Member limit, int64_t value, std::string_view where,
                        std::string_view field) const {
  if (value <= this->*limit) return;
  const Field& f = field_of(limit);
  fail_input(
      "{}: {} = {} is above the limit of {} (input limit {}; raise it with --limit {}=N or {}=N)",
      where, field, value, this->*limit, f.name, f.name, env_name(f.name));
}

std::string InputLimits::str() const {
  std::string s;
  for (const auto& f : kFields)
    s += fmt::format("{} = {} (default {}): {}\n", f.name, this->*(f.member), f.default_value,
                     f.what);
  return s;
}

std::string InputLimits::json() const {
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (const auto& f : kFields)
    out.push_back({{"name", f.name},
                   {"value", this->*(f.member)},
                   {"default", f.default_value},
                   {"max", f.ceiling},
                   {"env", env_name(f.name)},
                   {"bounds", f.what}});
  return out.dump(2);
}

void read_bounded(const std::string& path, const InputLimits& limits, InputLimits::Member limit,
                  std::string_view what, const std::function<void(std::string_view)>& consume) {
  const Fd fd{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (fd.fd < 0) fail_input("{}: cannot open {}: {}", path, what, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd.fd, &st) != 0)
    fail_input("{}: cannot stat {}: {}", path, what, std::strerror(errno));
  if (S_ISDIR(st.st_mode)) fail_input("{}: {} is a directory", path, what);
  // A regular file says its size up front: refuse it before reading a byte.
  if (S_ISREG(st.st_mode))
    limits.check(limit, st.st_size, path, fmt::format("{} size in bytes", what));
  int64_t total = 0;
  char buf[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd.fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail_input("{}: cannot read {}: {}", path, what, std::strerror(errno));
    if (n == 0) break;
    // Pipes and devices have no size: stop one chunk past the limit.
    total += n;
    limits.check(limit, total, path, fmt::format("{} size in bytes (at least)", what));
    consume(std::string_view(buf, static_cast<size_t>(n)));
  }
}

std::string read_file_bounded(const std::string& path, const InputLimits& limits,
                              InputLimits::Member limit, std::string_view what) {
  std::string out;
  read_bounded(path, limits, limit, what, [&](std::string_view chunk) { out.append(chunk); });
  return out;
}

}  // namespace strata
