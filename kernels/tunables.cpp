#include "kernels/tunables.h"

#include <charconv>
#include <cstdlib>

#include "kernels/error.h"

extern char** environ;  // POSIX: the process's environment, for a family's members

namespace strata {
namespace {

constexpr Tunable kTunables[] = {
#define STRATA_TUNABLE_ENTRY(id, name, type, def, choices, what) \
  {TunableId::id, name, TunableType::type, def, choices, what},
    STRATA_TUNABLES(STRATA_TUNABLE_ENTRY)
#undef STRATA_TUNABLE_ENTRY
};

// The one read of the environment in the tree.
std::optional<std::string> raw_variable(const std::string& name) {
  const char* v = std::getenv(name.c_str());
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

// "a, b or c": how an error lists the values a choice takes.
std::string spoken_list(const std::vector<std::string_view>& words) {
  std::string s;
  for (size_t i = 0; i < words.size(); ++i)
    s += std::string(i == 0 ? "" : i + 1 == words.size() ? " or " : ", ") + std::string(words[i]);
  return s;
}

const Tunable& typed(TunableId id, TunableType type) {
  const Tunable& t = tunable(id);
  STRATA_CHECK(t.type == type, "{} is read as a {}, but declared a {}", t.name,
               tunable_type_name(type), tunable_type_name(t.type));
  return t;
}

}  // namespace

const char* tunable_type_name(TunableType type) {
  switch (type) {
    case TunableType::kChoice:
      return "choice";
    case TunableType::kInt:
      return "int";
    case TunableType::kText:
      return "text";
    case TunableType::kPath:
      break;
  }
  return "path";
}

std::string Tunable::variable(std::string_view member) const {
  if (!family()) return std::string(name);
  STRATA_CHECK(!member.empty(), "{} is a family: read one member of it", name);
  std::string s(name.substr(0, name.size() - std::string_view("<NAME>").size()));
  for (char c : member) s += static_cast<char>(c >= 'a' && c <= 'z' ? c - 'a' + 'A' : c);
  return s;
}

std::vector<std::string_view> Tunable::choice_list() const {
  std::vector<std::string_view> out;
  for (std::string_view rest = choices; !rest.empty();) {
    const size_t bar = rest.find('|');
    out.push_back(rest.substr(0, bar));
    rest = bar == std::string_view::npos ? std::string_view{} : rest.substr(bar + 1);
  }
  return out;
}

std::span<const Tunable> tunables() {
  return kTunables;
}

const Tunable& tunable(TunableId id) {
  const auto i = static_cast<size_t>(id);
  STRATA_CHECK(i < std::size(kTunables), "tunable id {} outside the table", i);
  return kTunables[i];
}

std::optional<std::string> tunable_text(TunableId id, std::string_view member) {
  std::optional<std::string> v = raw_variable(tunable(id).variable(member));
  if (v && v->empty()) return std::nullopt;
  return v;
}

std::optional<int> tunable_choice_if_set(TunableId id) {
  const Tunable& t = typed(id, TunableType::kChoice);
  const std::optional<std::string> v = tunable_text(id);
  if (!v) return std::nullopt;
  const std::vector<std::string_view> choices = t.choice_list();
  for (size_t i = 0; i < choices.size(); ++i)
    if (choices[i] == *v) return static_cast<int>(i);
  fail_input("{}='{}': expected {}", t.name, *v, spoken_list(choices));
}

int tunable_choice(TunableId id) {
  if (const std::optional<int> set = tunable_choice_if_set(id)) return *set;
  const Tunable& t = tunable(id);
  const std::vector<std::string_view> choices = t.choice_list();
  for (size_t i = 0; i < choices.size(); ++i)
    if (choices[i] == t.default_value) return static_cast<int>(i);
  STRATA_CHECK(false, "{}'s default '{}' is not one of its choices", t.name, t.default_value);
}

std::optional<int64_t> tunable_int_if_set(TunableId id, std::string_view member) {
  const Tunable& t = typed(id, TunableType::kInt);
  const std::optional<std::string> v = tunable_text(id, member);
  if (!v) return std::nullopt;
  int64_t n = 0;
  const char* end = v->data() + v->size();
  const auto [ptr, ec] = std::from_chars(v->data(), end, n);
  if (ec != std::errc{} || ptr != end)
    fail_input("{}='{}': expected a whole number", t.variable(member), *v);
  return n;
}

int64_t tunable_int(TunableId id) {
  if (const std::optional<int64_t> set = tunable_int_if_set(id)) return *set;
  const Tunable& t = tunable(id);
  int64_t n = 0;
  const char* end = t.default_value.data() + t.default_value.size();
  const auto [ptr, ec] = std::from_chars(t.default_value.data(), end, n);
  STRATA_CHECK(ec == std::errc{} && ptr == end, "{}'s default '{}' is not a whole number", t.name,
               t.default_value);
  return n;
}

std::vector<std::pair<std::string, std::string>> tunable_family_values(TunableId id) {
  const Tunable& t = tunable(id);
  STRATA_CHECK(t.family(), "{} is not a family", t.name);
  const std::string_view prefix =
      t.name.substr(0, t.name.size() - std::string_view("<NAME>").size());
  std::vector<std::pair<std::string, std::string>> out;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string_view entry(*e);
    const size_t eq = entry.find('=');
    if (!entry.starts_with(prefix) || eq == std::string_view::npos || eq + 1 == entry.size())
      continue;
    out.emplace_back(entry.substr(0, eq), entry.substr(eq + 1));
  }
  return out;
}

std::optional<std::string> foreign_variable(const char* name) {
  STRATA_CHECK(!std::string_view(name).starts_with("STRATA_"),
               "{} is Strata's own: declare it in STRATA_TUNABLES (kernels/tunables.h)", name);
  return raw_variable(name);
}

}  // namespace strata
