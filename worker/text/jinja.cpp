// A Jinja2 subset: lexer -> parser (AST) -> tree-walking evaluator over a small Value type.
// Semantics follow jinja2 3.1 as transformers configures it (see jinja.h); Python's
// behaviour (str(), repr(), json.dumps, slicing, floor division) is reproduced where chat
// templates can observe it, because rendered prompts must match transformers byte for byte.
#include "worker/text/jinja.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <unordered_map>
#include <utility>

#include "kernels/error.h"

namespace strata::jinja {
namespace {

using nlohmann::json;

constexpr int kMaxValueDepth = 512;
constexpr std::size_t kMaxItems = std::size_t{1} << 20;
constexpr std::int64_t kMaxRange = 100000;  // jinja2's sandbox MAX_RANGE
constexpr int kMaxMacroDepth = 64;

// A failure inside the evaluator; Renderer adds the template name and the line.
struct EvalError {
  std::string message;
};

template <typename... Args>
[[noreturn]] void eval_fail(fmt::format_string<Args...> f, Args&&... args) {
  throw EvalError{fmt::format(f, std::forward<Args>(args)...)};
}

// ---------------------------------------------------------------------------------------
// UTF-8 and Python string helpers. Python indexes, slices and measures strings in code
// points, and its str.strip() knows Unicode whitespace.

char32_t next_cp(std::string_view s, std::size_t& i) {
  const auto b = static_cast<unsigned char>(s[i]);
  int extra = 0;
  char32_t cp = b;
  if (b >= 0x80) {
    if ((b & 0xE0) == 0xC0) {
      extra = 1, cp = b & 0x1F;
    } else if ((b & 0xF0) == 0xE0) {
      extra = 2, cp = b & 0x0F;
    } else if ((b & 0xF8) == 0xF0) {
      extra = 3, cp = b & 0x07;
    } else {
      ++i;
      return b;
    }
    if (i + extra >= s.size()) {
      ++i;
      return b;
    }
    for (int k = 1; k <= extra; ++k) {
      const auto c = static_cast<unsigned char>(s[i + k]);
      if ((c & 0xC0) != 0x80) {
        ++i;
        return b;
      }
      cp = (cp << 6) | (c & 0x3F);
    }
  }
  i += 1 + extra;
  return cp;
}

void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

std::u32string to_u32(std::string_view s) {
  std::u32string out;
  for (std::size_t i = 0; i < s.size();) out += next_cp(s, i);
  return out;
}

std::string from_u32(std::u32string_view s) {
  std::string out;
  for (char32_t c : s) append_utf8(out, c);
  return out;
}

std::size_t cp_count(std::string_view s) {
  std::size_t n = 0;
  for (char c : s) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return n;
}

// What Python's str.isspace() accepts.
bool py_space(char32_t c) {
  return (c >= 9 && c <= 13) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

std::size_t prev_cp_start(std::string_view s, std::size_t end) {
  std::size_t j = end - 1;
  while (j > 0 && end - j < 4 && (static_cast<unsigned char>(s[j]) & 0xC0) == 0x80) --j;
  return j;
}

// Python's str.strip/lstrip/rstrip; `chars` null means whitespace.
std::string_view py_strip(std::string_view s, bool left, bool right, const std::u32string* chars) {
  auto strip_it = [&](char32_t c) {
    return chars ? chars->find(c) != std::u32string::npos : py_space(c);
  };
  std::size_t b = 0, e = s.size();
  while (left && b < e) {
    std::size_t j = b;
    if (!strip_it(next_cp(s, j))) break;
    b = j;
  }
  while (right && e > b) {
    const std::size_t k = prev_cp_start(s, e);
    std::size_t t = k;
    if (!strip_it(next_cp(s, t))) break;
    e = k;
  }
  return s.substr(b, e - b);
}

// Python's repr(float): the shortest round-tripping digits, exponent form outside
// 1e-4 <= |x| < 1e16.
std::string py_float(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string_view sci(buf, static_cast<std::size_t>(r.ptr - buf));
  std::string sign;
  if (sci.front() == '-') sign = "-", sci.remove_prefix(1);
  const std::size_t epos = sci.find('e');
  std::string digits;
  for (char c : sci.substr(0, epos)) {
    if (c != '.') digits += c;
  }
  const int exp10 = std::atoi(std::string(sci.substr(epos + 1)).c_str());
  const int decpt = exp10 + 1;
  const int n = static_cast<int>(digits.size());
  if (decpt <= -4 || decpt > 16) {
    std::string out = sign + digits.substr(0, 1);
    if (n > 1) out += "." + digits.substr(1);
    const int e = decpt - 1;
    out += fmt::format("e{}{:02d}", e < 0 ? '-' : '+', std::abs(e));
    return out;
  }
  if (decpt <= 0) return sign + "0." + std::string(static_cast<std::size_t>(-decpt), '0') + digits;
  if (decpt >= n)
    return sign + digits + std::string(static_cast<std::size_t>(decpt - n), '0') + ".0";
  return sign + digits.substr(0, static_cast<std::size_t>(decpt)) + "." +
         digits.substr(static_cast<std::size_t>(decpt));
}

bool py_printable(char32_t c) {
  if (c < 0x20 || c == 0x7F || (c >= 0x80 && c <= 0xA0) || c == 0xAD) return false;
  if ((c >= 0x200B && c <= 0x200F) || c == 0x2028 || c == 0x2029 || (c >= 0x2060 && c <= 0x2064))
    return false;
  return c != 0xFEFF && !(c >= 0xD800 && c <= 0xDFFF);
}

std::string py_repr_str(std::string_view s) {
  const bool has_single = s.find('\'') != std::string_view::npos;
  const bool has_double = s.find('"') != std::string_view::npos;
  const char q = has_single && !has_double ? '"' : '\'';
  std::string out(1, q);
  for (std::size_t i = 0; i < s.size();) {
    const char32_t c = next_cp(s, i);
    if (c == static_cast<char32_t>(q) || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (py_printable(c)) {
      append_utf8(out, c);
    } else if (c < 0x100) {
      out += fmt::format("\\x{:02x}", static_cast<unsigned>(c));
    } else {
      out += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
    }
  }
  out += q;
  return out;
}

// ---------------------------------------------------------------------------------------
// Values

struct Value;
using List = std::vector<Value>;
using Dict = std::vector<std::pair<std::string, Value>>;  // insertion-ordered, like Python
class Renderer;

struct CallArgs {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
};

struct Callable {
  std::string name;
  std::function<Value(Renderer&, CallArgs&)> fn;
};

struct Value {
  enum class Kind : std::uint8_t {
    kUndefined,
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kList,
    kDict,
    kNamespace,
    kFunction
  };
  Kind kind = Kind::kUndefined;
  bool boolean = false;
  bool tuple = false;            // prints as (a, b)
  bool holds_namespace = false;  // refused inside a namespace: it could form a cycle
  std::uint16_t depth = 0;
  std::int64_t integer = 0;
  double number = 0;
  std::shared_ptr<const std::string> str;  // kString; kUndefined: why it is undefined
  std::shared_ptr<const List> list;
  std::shared_ptr<Dict> dict;  // kDict: frozen once built; kNamespace: mutable
  std::shared_ptr<const Callable> fn;

  bool is(Kind k) const { return kind == k; }
  const std::string& s() const { return *str; }
};
using K = Value::Kind;

Value undefined(std::string why) {
  Value v;
  v.str = std::make_shared<const std::string>(std::move(why));
  return v;
}

Value none_v() {
  Value v;
  v.kind = K::kNone;
  return v;
}

Value bool_v(bool b) {
  Value v;
  v.kind = K::kBool;
  v.boolean = b;
  return v;
}

Value int_v(std::int64_t i) {
  Value v;
  v.kind = K::kInt;
  v.integer = i;
  return v;
}

Value float_v(double d) {
  Value v;
  v.kind = K::kFloat;
  v.number = d;
  return v;
}

Value str_v(std::string s) {
  if (s.size() > kMaxOutputBytes) eval_fail("string longer than {} bytes", kMaxOutputBytes);
  Value v;
  v.kind = K::kString;
  v.str = std::make_shared<const std::string>(std::move(s));
  return v;
}

void absorb_child(Value& parent, const Value& child) {
  parent.depth = std::max<std::uint16_t>(parent.depth, static_cast<std::uint16_t>(child.depth + 1));
  parent.holds_namespace |= child.holds_namespace || child.is(K::kNamespace);
}

Value list_v(List items, bool tuple = false) {
  if (items.size() > kMaxItems) eval_fail("list longer than {} items", kMaxItems);
  Value v;
  v.kind = K::kList;
  v.tuple = tuple;
  v.depth = 1;
  for (const Value& item : items) {
    absorb_child(v, item);
    if (v.depth > kMaxValueDepth) eval_fail("value nested deeper than {}", kMaxValueDepth);
  }
  v.list = std::make_shared<const List>(std::move(items));
  return v;
}

Value dict_v(Dict items, K kind = K::kDict) {
  if (items.size() > kMaxItems) eval_fail("dict larger than {} items", kMaxItems);
  Value v;
  v.kind = kind;
  v.depth = 1;
  for (const auto& item : items) {
    absorb_child(v, item.second);
    if (v.depth > kMaxValueDepth) eval_fail("value nested deeper than {}", kMaxValueDepth);
  }
  v.dict = std::make_shared<Dict>(std::move(items));
  return v;
}

Value fn_v(std::string name, std::function<Value(Renderer&, CallArgs&)> fn) {
  Value v;
  v.kind = K::kFunction;
  v.fn = std::make_shared<const Callable>(Callable{std::move(name), std::move(fn)});
  return v;
}

const Value* dict_find(const Dict& d, std::string_view key) {
  for (const auto& [k, v] : d) {
    if (k == key) return &v;
  }
  return nullptr;
}

void dict_set(Dict& d, std::string key, Value value) {
  for (auto& [k, v] : d) {
    if (k == key) {
      v = std::move(value);
      return;
    }
  }
  d.emplace_back(std::move(key), std::move(value));
}

const char* type_name(const Value& v) {
  switch (v.kind) {
    case K::kUndefined:
      return "Undefined";
    case K::kNone:
      return "NoneType";
    case K::kBool:
      return "bool";
    case K::kInt:
      return "int";
    case K::kFloat:
      return "float";
    case K::kString:
      return "str";
    case K::kList:
      return v.tuple ? "tuple" : "list";
    case K::kDict:
      return "dict";
    case K::kNamespace:
      return "Namespace";
    case K::kFunction:
      return "function";
  }
  return "?";
}

[[noreturn]] void undefined_error(const Value& v) {
  eval_fail("{}", v.s());
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case K::kUndefined:
    case K::kNone:
      return false;
    case K::kBool:
      return v.boolean;
    case K::kInt:
      return v.integer != 0;
    case K::kFloat:
      return v.number != 0;
    case K::kString:
      return !v.str->empty();
    case K::kList:
      return !v.list->empty();
    case K::kDict:
      return !v.dict->empty();
    case K::kNamespace:
    case K::kFunction:
      return true;
  }
  return false;
}

bool is_number(const Value& v) {
  return v.is(K::kBool) || v.is(K::kInt) || v.is(K::kFloat);
}
bool is_integral(const Value& v) {
  return v.is(K::kBool) || v.is(K::kInt);
}
std::int64_t as_int(const Value& v) {
  return v.is(K::kBool) ? v.boolean : v.integer;
}
double as_double(const Value& v) {
  return v.is(K::kFloat) ? v.number : static_cast<double>(as_int(v));
}

std::string repr(const Value& v);

// Python's str().
std::string to_str(const Value& v) {
  switch (v.kind) {
    case K::kUndefined:
      return "";
    case K::kNone:
      return "None";
    case K::kBool:
      return v.boolean ? "True" : "False";
    case K::kInt:
      return std::to_string(v.integer);
    case K::kFloat:
      return py_float(v.number);
    case K::kString:
      return v.s();
    case K::kList: {
      std::string out = v.tuple ? "(" : "[";
      for (std::size_t i = 0; i < v.list->size(); ++i) {
        if (i) out += ", ";
        out += repr((*v.list)[i]);
        if (out.size() > kMaxOutputBytes) eval_fail("string longer than {} bytes", kMaxOutputBytes);
      }
      if (v.tuple && v.list->size() == 1) out += ",";
      return out + (v.tuple ? ")" : "]");
    }
    case K::kDict:
    case K::kNamespace: {
      std::string out = v.is(K::kNamespace) ? "<Namespace {" : "{";
      bool first = true;
      for (const auto& [k, item] : *v.dict) {
        if (!first) out += ", ";
        first = false;
        out += py_repr_str(k) + ": " + repr(item);
        if (out.size() > kMaxOutputBytes) eval_fail("string longer than {} bytes", kMaxOutputBytes);
      }
      return out + (v.is(K::kNamespace) ? "}>" : "}");
    }
    case K::kFunction:
      eval_fail("cannot print function '{}'", v.fn->name);
  }
  return "";
}

std::string repr(const Value& v) {
  if (v.is(K::kString)) return py_repr_str(v.s());
  if (v.is(K::kUndefined)) return "Undefined";
  return to_str(v);
}

bool py_eq(const Value& a, const Value& b) {
  if (is_number(a) && is_number(b)) {
    if (is_integral(a) && is_integral(b)) return as_int(a) == as_int(b);
    return as_double(a) == as_double(b);
  }
  if (a.kind != b.kind || a.tuple != b.tuple) return false;  // (1, 2) != [1, 2]
  switch (a.kind) {
    case K::kUndefined:
    case K::kNone:
      return true;
    case K::kString:
      return a.s() == b.s();
    case K::kList: {
      if (a.list->size() != b.list->size()) return false;
      for (std::size_t i = 0; i < a.list->size(); ++i) {
        if (!py_eq((*a.list)[i], (*b.list)[i])) return false;
      }
      return true;
    }
    case K::kDict: {
      if (a.dict->size() != b.dict->size()) return false;
      for (const auto& [k, v] : *a.dict) {
        const Value* other = dict_find(*b.dict, k);
        if (!other || !py_eq(v, *other)) return false;
      }
      return true;
    }
    case K::kNamespace:
      return a.dict == b.dict;
    case K::kFunction:
      return a.fn == b.fn;
    default:
      return false;
  }
}

bool py_lt(const Value& a, const Value& b) {
  if (a.is(K::kUndefined)) undefined_error(a);
  if (b.is(K::kUndefined)) undefined_error(b);
  if (is_number(a) && is_number(b)) {
    if (is_integral(a) && is_integral(b)) return as_int(a) < as_int(b);
    return as_double(a) < as_double(b);
  }
  if (a.is(K::kString) && b.is(K::kString)) return a.s() < b.s();  // UTF-8 order = code points
  if (a.is(K::kList) && b.is(K::kList)) {
    const List& x = *a.list;
    const List& y = *b.list;
    for (std::size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (!py_eq(x[i], y[i])) return py_lt(x[i], y[i]);
    }
    return x.size() < y.size();
  }
  eval_fail("'<' not supported between instances of '{}' and '{}'", type_name(a), type_name(b));
}

template <typename J>
Value from_json(const J& j, int depth) {
  if (depth > kMaxValueDepth) eval_fail("context nested deeper than {}", kMaxValueDepth);
  switch (j.type()) {
    case J::value_t::null:
      return none_v();
    case J::value_t::boolean:
      return bool_v(j.template get<bool>());
    case J::value_t::number_integer:
      return int_v(j.template get<std::int64_t>());
    case J::value_t::number_unsigned: {
      const auto u = j.template get<std::uint64_t>();
      if (u > static_cast<std::uint64_t>(INT64_MAX)) eval_fail("integer {} is too large", u);
      return int_v(static_cast<std::int64_t>(u));
    }
    case J::value_t::number_float:
      return float_v(j.template get<double>());
    case J::value_t::string:
      return str_v(j.template get<std::string>());
    case J::value_t::array: {
      List items;
      items.reserve(j.size());
      for (const J& e : j) items.push_back(from_json(e, depth + 1));
      return list_v(std::move(items));
    }
    case J::value_t::object: {
      Dict items;
      items.reserve(j.size());
      for (const auto& [k, e] : j.items()) items.emplace_back(k, from_json(e, depth + 1));
      return dict_v(std::move(items));
    }
    default:
      eval_fail("unsupported JSON value of type {}", j.type_name());
  }
}

json to_json(const Value& v) {
  switch (v.kind) {
    case K::kUndefined:
    case K::kNone:
      return nullptr;
    case K::kBool:
      return v.boolean;
    case K::kInt:
      return v.integer;
    case K::kFloat:
      return v.number;
    case K::kString:
      return v.s();
    case K::kList: {
      json out = json::array();
      for (const Value& e : *v.list) out.push_back(to_json(e));
      return out;
    }
    case K::kDict:
    case K::kNamespace: {
      json out = json::object();
      for (const auto& [k, e] : *v.dict) out[k] = to_json(e);
      return out;
    }
    case K::kFunction:
      eval_fail("cannot pass function '{}' to a host function", v.fn->name);
  }
  return nullptr;
}

// transformers' tojson: json.dumps(x, ensure_ascii=False, indent=None, separators=None,
// sort_keys=False) -- Python's formatting, not nlohmann's.
struct JsonStyle {
  bool ensure_ascii = false;
  bool indented = false;
  std::string indent;
  std::string item_sep = ", ";
  std::string key_sep = ": ";
  bool sort_keys = false;
};

void dump_json_string(std::string& out, std::string_view s, bool ensure_ascii) {
  out += '"';
  for (std::size_t i = 0; i < s.size();) {
    const char32_t c = next_cp(s, i);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20 || (ensure_ascii && c >= 0x7F)) {
          if (c >= 0x10000) {
            const char32_t v = c - 0x10000;
            out += fmt::format("\\u{:04x}\\u{:04x}", 0xD800 + (static_cast<unsigned>(v) >> 10),
                               0xDC00 + (static_cast<unsigned>(v) & 0x3FF));
          } else {
            out += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
          }
        } else {
          append_utf8(out, c);
        }
    }
  }
  out += '"';
}

void dump_json(std::string& out, const Value& v, const JsonStyle& st, int level) {
  if (out.size() > kMaxOutputBytes) eval_fail("string longer than {} bytes", kMaxOutputBytes);
  auto newline = [&](int lvl) {
    if (!st.indented) return;
    out += '\n';
    for (int i = 0; i < lvl; ++i) out += st.indent;
  };
  switch (v.kind) {
    case K::kNone:
      out += "null";
      return;
    case K::kBool:
      out += v.boolean ? "true" : "false";
      return;
    case K::kInt:
      out += std::to_string(v.integer);
      return;
    case K::kFloat:
      if (std::isnan(v.number)) {
        out += "NaN";
      } else if (std::isinf(v.number)) {
        out += v.number < 0 ? "-Infinity" : "Infinity";
      } else {
        out += py_float(v.number);
      }
      return;
    case K::kString:
      dump_json_string(out, v.s(), st.ensure_ascii);
      return;
    case K::kList: {
      if (v.list->empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (std::size_t i = 0; i < v.list->size(); ++i) {
        if (i) out += st.item_sep;
        newline(level + 1);
        dump_json(out, (*v.list)[i], st, level + 1);
      }
      newline(level);
      out += ']';
      return;
    }
    case K::kDict: {
      if (v.dict->empty()) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& item : *v.dict) items.push_back(&item);
      if (st.sort_keys) {
        std::stable_sort(items.begin(), items.end(),
                         [](auto* a, auto* b) { return a->first < b->first; });
      }
      out += '{';
      for (std::size_t i = 0; i < items.size(); ++i) {
        if (i) out += st.item_sep;
        newline(level + 1);
        dump_json_string(out, items[i]->first, st.ensure_ascii);
        out += st.key_sep;
        dump_json(out, items[i]->second, st, level + 1);
      }
      newline(level);
      out += '}';
      return;
    }
    default:
      eval_fail("Object of type {} is not JSON serializable", type_name(v));
  }
}

// ---------------------------------------------------------------------------------------
// Lexer. Whitespace control follows jinja2's lexer: `-` strips all whitespace on that side,
// `+` disables lstrip_blocks/trim_blocks, lstrip_blocks removes spaces and tabs before a
// block or comment tag that starts a line, trim_blocks removes one newline after a block or
// comment tag.

enum class T {
  kData,
  kVarBegin,
  kVarEnd,
  kBlockBegin,
  kBlockEnd,
  kName,
  kString,
  kInt,
  kFloat,
  kOp,
  kEof
};

struct Token {
  T type;
  std::string text;
  int line = 0;
  std::int64_t ival = 0;
  double fval = 0;
};

bool ascii_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}
bool name_start(char c) {
  return std::isalpha(static_cast<unsigned char>(c)) || c == '_';
}
bool name_char(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
}

class Lexer {
 public:
  Lexer(std::string_view source, const std::string& name) : name_(name) {
    // jinja2 normalizes every newline to \n and drops one trailing newline.
    for (std::size_t i = 0; i < source.size(); ++i) {
      if (source[i] == '\r') {
        src_ += '\n';
        if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
      } else {
        src_ += source[i];
      }
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
  }

  std::vector<Token> run() {
    while (pos_ < src_.size()) {
      const std::size_t tag = find_tag(pos_);
      if (tag == std::string::npos) {
        emit_data(src_.substr(pos_), line_);
        advance_to(src_.size());
        break;
      }
      lex_tag(tag);
    }
    out_.push_back(Token{T::kEof, "", line_});
    return std::move(out_);
  }

 private:
  [[noreturn]] void fail(int line, const std::string& msg) const {
    fail_input("{} line {}: {}", name_, line, msg);
  }

  std::size_t find_tag(std::size_t from) const {
    for (std::size_t p = src_.find('{', from); p != std::string::npos; p = src_.find('{', p + 1)) {
      if (p + 1 < src_.size() && (src_[p + 1] == '{' || src_[p + 1] == '%' || src_[p + 1] == '#'))
        return p;
    }
    return std::string::npos;
  }

  void advance_to(std::size_t p) {
    line_ += static_cast<int>(std::count(src_.begin() + static_cast<std::ptrdiff_t>(pos_),
                                         src_.begin() + static_cast<std::ptrdiff_t>(p), '\n'));
    pos_ = p;
  }

  void emit_data(std::string text, int line) {
    if (!text.empty()) out_.push_back(Token{T::kData, std::move(text), line});
  }

  // The text before a tag, after `-` or lstrip_blocks have had their say.
  std::string strip_before(std::string text, char sign, bool lstrip) const {
    if (sign == '-') return std::string(py_strip(text, false, true, nullptr));
    if (sign == '+' || !lstrip) return text;
    const std::size_t l = text.rfind('\n') + 1;  // npos + 1 == 0
    if (l == 0 && !line_starting_) return text;
    if (l == text.size()) return text;
    const std::string_view tail(text.data() + l, text.size() - l);
    if (!py_strip(tail, true, false, nullptr).empty()) return text;
    return text.substr(0, l);
  }

  // Consumes what follows a tag end: all whitespace after `-`, one newline for trim_blocks.
  void after_tag_end(std::size_t end, char sign, bool trim_newline) {
    std::size_t p = end;
    if (sign == '-') {
      p = end + (src_.size() - end -
                 py_strip(std::string_view(src_).substr(end), true, false, nullptr).size());
    } else if (sign != '+' && trim_newline && p < src_.size() && src_[p] == '\n') {
      ++p;
    }
    // jinja2 asks whether the text the tag's end consumed ended a line.
    line_starting_ = p > end && src_[p - 1] == '\n';
    advance_to(p);
  }

  void lex_tag(std::size_t tag) {
    const char kind = src_[tag + 1];
    char sign = tag + 2 < src_.size() ? src_[tag + 2] : '\0';
    if (sign != '-' && sign != '+') sign = '\0';
    const int text_line = line_;
    emit_data(strip_before(src_.substr(pos_, tag - pos_), sign, kind != '{'), text_line);
    advance_to(tag);
    const int tag_line = line_;
    advance_to(tag + 2 + (sign ? 1 : 0));
    if (kind == '#') return lex_comment(tag_line);
    if (kind == '%' && try_raw(tag_line)) return;
    lex_expression(kind == '%', tag_line);
  }

  void lex_comment(int tag_line) {
    const std::size_t e = src_.find("#}", pos_);
    if (e == std::string::npos) fail(tag_line, "unterminated comment '{#'");
    char sign = e > pos_ ? src_[e - 1] : '\0';
    if (sign != '-' && sign != '+') sign = '\0';
    advance_to(e);
    after_tag_end(e + 2, sign, true);
  }

  static bool match_word(std::string_view s, std::size_t& p, std::string_view word) {
    if (s.substr(p, word.size()) != word) return false;
    if (p + word.size() < s.size() && name_char(s[p + word.size()])) return false;
    p += word.size();
    return true;
  }

  // Matches `[-+]?%}` at p; returns the sign ('%' when none) or 0.
  char match_block_end(std::size_t& p) const {
    while (p < src_.size() && ascii_space(src_[p])) ++p;
    if (src_.compare(p, 2, "%}") == 0) {
      p += 2;
      return '%';
    }
    if ((src_[p] == '-' || src_[p] == '+') && src_.compare(p + 1, 2, "%}") == 0) {
      p += 3;
      return src_[p - 3];
    }
    return 0;
  }

  // {% raw %}...{% endraw %}: the body is data, whatever it contains.
  bool try_raw(int tag_line) {
    std::size_t p = pos_;
    while (p < src_.size() && ascii_space(src_[p])) ++p;
    if (!match_word(src_, p, "raw")) return false;
    const char open_sign = match_block_end(p);
    if (!open_sign) return false;
    if (open_sign == '-') {
      p +=
          src_.size() - p - py_strip(std::string_view(src_).substr(p), true, false, nullptr).size();
    }
    line_starting_ = p > 0 && src_[p - 1] == '\n';
    advance_to(p);
    for (std::size_t q = src_.find("{%", pos_); q != std::string::npos;
         q = src_.find("{%", q + 1)) {
      std::size_t r = q + 2;
      char sign = r < src_.size() ? src_[r] : '\0';
      if (sign == '-' || sign == '+') {
        ++r;
      } else {
        sign = '\0';
      }
      while (r < src_.size() && ascii_space(src_[r])) ++r;
      if (!match_word(src_, r, "endraw")) continue;
      const char close_sign = match_block_end(r);
      if (!close_sign) continue;
      emit_data(strip_before(src_.substr(pos_, q - pos_), sign, true), line_);
      advance_to(r - (close_sign == '%' ? 2 : 3));
      after_tag_end(r, close_sign == '%' ? '\0' : close_sign, true);
      return true;
    }
    fail(tag_line, "unterminated '{% raw %}' (missing '{% endraw %}')");
  }

  void lex_expression(bool block, int tag_line) {
    out_.push_back(Token{block ? T::kBlockBegin : T::kVarBegin, "", tag_line});
    int balance = 0;
    while (true) {
      while (pos_ < src_.size() && ascii_space(src_[pos_])) advance_to(pos_ + 1);
      if (pos_ >= src_.size()) {
        fail(tag_line, block ? "unterminated '{%' tag (missing '%}')"
                             : "unterminated '{{' expression (missing '}}')");
      }
      if (balance == 0 && lex_end(block)) return;
      lex_token(balance);
    }
  }

  bool lex_end(bool block) {
    const std::string_view rest = std::string_view(src_).substr(pos_);
    const std::string_view close = block ? "%}" : "}}";
    char sign = '\0';
    std::size_t len = 0;
    if ((rest.substr(0, 1) == "-" || (block && rest.substr(0, 1) == "+")) &&
        rest.substr(1, 2) == close) {
      sign = rest[0], len = 3;
    } else if (rest.substr(0, 2) == close) {
      len = 2;
    } else {
      return false;
    }
    out_.push_back(Token{block ? T::kBlockEnd : T::kVarEnd, "", line_});
    after_tag_end(pos_ + len, sign, block);
    return true;
  }

  void lex_token(int& balance) {
    const char c = src_[pos_];
    if (name_start(c)) {
      std::size_t e = pos_;
      while (e < src_.size() && name_char(src_[e])) ++e;
      out_.push_back(Token{T::kName, src_.substr(pos_, e - pos_), line_});
      return advance_to(e);
    }
    if (std::isdigit(static_cast<unsigned char>(c))) return lex_number();
    if (c == '\'' || c == '"') return lex_string();
    static constexpr std::string_view kTwo[] = {"//", "**", "==", "!=", "<=", ">="};
    for (std::string_view op : kTwo) {
      if (src_.compare(pos_, 2, op) == 0) {
        out_.push_back(Token{T::kOp, std::string(op), line_});
        return advance_to(pos_ + 2);
      }
    }
    if (std::strchr("+-*/%~<>=()[]{},.:|", c) == nullptr) {
      fail(line_, fmt::format("unexpected character '{}'", c));
    }
    if (c == '(' || c == '[' || c == '{') ++balance;
    if (c == ')' || c == ']' || c == '}') {
      if (--balance < 0) fail(line_, fmt::format("unexpected '{}'", c));
    }
    out_.push_back(Token{T::kOp, std::string(1, c), line_});
    advance_to(pos_ + 1);
  }

  void lex_number() {
    auto digits = [&](std::size_t p) {
      while (p < src_.size() &&
             (std::isdigit(static_cast<unsigned char>(src_[p])) || src_[p] == '_'))
        ++p;
      return p;
    };
    std::size_t e = digits(pos_);
    bool is_float = false;
    const bool after_dot = !out_.empty() && out_.back().type == T::kOp && out_.back().text == ".";
    if (!after_dot && e + 1 < src_.size() && src_[e] == '.' &&
        std::isdigit(static_cast<unsigned char>(src_[e + 1]))) {
      e = digits(e + 1);
      is_float = true;
    }
    if (!after_dot && e < src_.size() && (src_[e] == 'e' || src_[e] == 'E')) {
      std::size_t p = e + 1;
      if (p < src_.size() && (src_[p] == '+' || src_[p] == '-')) ++p;
      if (p < src_.size() && std::isdigit(static_cast<unsigned char>(src_[p]))) {
        e = digits(p);
        is_float = true;
      }
    }
    std::string text;
    for (std::size_t i = pos_; i < e; ++i) {
      if (src_[i] != '_') text += src_[i];
    }
    Token t{is_float ? T::kFloat : T::kInt, text, line_};
    if (is_float) {
      t.fval = std::strtod(text.c_str(), nullptr);
    } else {
      const auto r = std::from_chars(text.data(), text.data() + text.size(), t.ival);
      if (r.ec != std::errc()) fail(line_, fmt::format("integer literal {} is too large", text));
    }
    out_.push_back(std::move(t));
    advance_to(e);
  }

  void lex_string() {
    const char q = src_[pos_];
    const int start_line = line_;
    std::size_t p = pos_ + 1;
    while (p < src_.size() && src_[p] != q) p += src_[p] == '\\' ? 2 : 1;
    if (p >= src_.size()) fail(start_line, "unterminated string literal");
    std::string value = unescape(std::string_view(src_).substr(pos_ + 1, p - pos_ - 1), start_line);
    out_.push_back(Token{T::kString, std::move(value), start_line});
    advance_to(p + 1);
  }

  // Python's unicode-escape decoding, which jinja2 applies to string literals.
  std::string unescape(std::string_view s, int line) const {
    std::string out;
    for (std::size_t i = 0; i < s.size(); ++i) {
      if (s[i] != '\\' || i + 1 >= s.size()) {
        out += s[i];
        continue;
      }
      const char c = s[++i];
      switch (c) {
        case '\n':
          break;
        case '\\':
          out += '\\';
          break;
        case '\'':
          out += '\'';
          break;
        case '"':
          out += '"';
          break;
        case 'a':
          out += '\a';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'v':
          out += '\v';
          break;
        case 'x':
          append_utf8(out, hex_escape(s, i, 2, line));
          break;
        case 'u':
          append_utf8(out, hex_escape(s, i, 4, line));
          break;
        case 'U':
          append_utf8(out, hex_escape(s, i, 8, line));
          break;
        case 'N':
          fail(line, "'\\N{...}' escapes are not supported");
        default:
          if (c >= '0' && c <= '7') {
            unsigned v = 0;
            std::size_t n = 0;
            for (; n < 3 && i < s.size() && s[i] >= '0' && s[i] <= '7'; ++n, ++i)
              v = v * 8 + static_cast<unsigned>(s[i] - '0');
            --i;
            append_utf8(out, v);
          } else {
            out += '\\';
            out += c;
          }
      }
    }
    return out;
  }

  char32_t hex_escape(std::string_view s, std::size_t& i, std::size_t n, int line) const {
    if (i + n >= s.size()) fail(line, "truncated escape in string literal");
    char32_t v = 0;
    for (std::size_t k = 1; k <= n; ++k) {
      const char h = s[i + k];
      if (!std::isxdigit(static_cast<unsigned char>(h)))
        fail(line, "truncated escape in string literal");
      v = v * 16 + static_cast<char32_t>(std::isdigit(static_cast<unsigned char>(h))
                                             ? h - '0'
                                             : (std::tolower(h) - 'a' + 10));
    }
    if (v > 0x10FFFF) fail(line, "escape outside the Unicode range in string literal");
    i += n;
    return v;
  }

  const std::string& name_;
  std::string src_;
  std::size_t pos_ = 0;
  int line_ = 1;
  bool line_starting_ = true;
  std::vector<Token> out_;
};

// ---------------------------------------------------------------------------------------
// AST

enum class EK {
  kConst,
  kName,
  kAttr,
  kItem,
  kSlice,
  kCall,
  kFilter,
  kTest,
  kNeg,
  kPos,
  kNot,
  kAnd,
  kOr,
  kBinary,
  kCompare,
  kCond,
  kList,
  kTuple,
  kDict,
  kConcat
};

struct Expr;
using ExprP = std::unique_ptr<Expr>;

struct Expr {
  EK kind;
  int line;
  Value value;              // kConst
  std::string name;         // kName, kAttr, kFilter, kTest, kBinary (the operator)
  std::vector<ExprP> args;  // operands; kSlice/kCond keep null slots for omitted parts
  std::vector<std::pair<std::string, ExprP>> kwargs;
  std::vector<std::string> ops;  // kCompare
  bool negated = false;          // kTest: `is not`
};

enum class SK {
  kText,
  kOutput,
  kIf,
  kFor,
  kSet,
  kSetAttr,
  kSetBlock,
  kBreak,
  kContinue,
  kMacro,
  kBlock
};

struct Stmt;
using StmtP = std::unique_ptr<Stmt>;
using Body = std::vector<StmtP>;

struct Stmt {
  SK kind;
  int line;
  std::string text;                // kText
  std::vector<std::string> names;  // targets; kSetAttr: {ns, attr}; kMacro: {name, params...}
  std::vector<ExprP> exprs;  // kIf: conditions; kFor: {iter, filter-or-null}; kMacro: defaults
  std::vector<Body> bodies;  // kIf: per condition (+ else); kFor: {body, else}
};

}  // namespace

namespace detail {
struct Program {
  std::string name;
  Body body;
};
}  // namespace detail

namespace {

const std::vector<std::string_view>& known_filters() {
  static const std::vector<std::string_view> k = {
      "abs",     "capitalize", "count", "d",      "default", "dictsort",   "first",
      "float",   "indent",     "int",   "items",  "join",    "last",       "length",
      "list",    "lower",      "map",   "max",    "min",     "reject",     "rejectattr",
      "replace", "reverse",    "round", "safe",   "select",  "selectattr", "sort",
      "string",  "sum",        "title", "tojson", "trim",    "unique",     "upper"};
  return k;
}

const std::vector<std::string_view>& known_tests() {
  static const std::vector<std::string_view> k = {
      "defined",  "undefined", "none",   "boolean", "true",        "false",
      "integer",  "float",     "number", "string",  "mapping",     "iterable",
      "sequence", "callable",  "even",   "odd",     "divisibleby", "eq",
      "equalto",  "==",        "ne",     "!=",      "lt",          "<",
      "lessthan", "le",        "<=",     "gt",      ">",           "greaterthan",
      "ge",       ">=",        "in",     "sameas",  "lower",       "upper"};
  return k;
}

bool contains(const std::vector<std::string_view>& v, std::string_view s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

// ---------------------------------------------------------------------------------------
// Parser: jinja2's grammar and operator precedence (parse_condexpr down to parse_primary).

class Parser {
 public:
  Parser(std::vector<Token> tokens, const std::string& name)
      : toks_(std::move(tokens)), name_(name) {}

  Body run() {
    std::string end;
    Body body = parse_body({}, end);
    return body;
  }

 private:
  struct Guard {
    explicit Guard(Parser& p) : p_(p) {
      if (++p_.depth_ > kMaxNesting)
        p_.fail(p_.cur().line, fmt::format("nesting deeper than {}", kMaxNesting));
    }
    ~Guard() { --p_.depth_; }
    Parser& p_;
  };

  [[noreturn]] void fail(int line, const std::string& msg) const {
    fail_input("{} line {}: {}", name_, line, msg);
  }
  const Token& cur() const { return toks_[i_]; }
  const Token& peek(std::size_t k = 1) const { return toks_[std::min(i_ + k, toks_.size() - 1)]; }
  bool is_op(std::string_view op) const { return cur().type == T::kOp && cur().text == op; }
  bool is_name(std::string_view n) const { return cur().type == T::kName && cur().text == n; }
  static std::string describe(const Token& t) {
    switch (t.type) {
      case T::kEof:
        return "end of template";
      case T::kBlockEnd:
        return "end of tag '%}'";
      case T::kVarEnd:
        return "end of expression '}}'";
      case T::kData:
        return "text";
      default:
        return "'" + t.text + "'";
    }
  }
  void expect_op(std::string_view op) {
    if (!is_op(op)) fail(cur().line, fmt::format("expected '{}', found {}", op, describe(cur())));
    ++i_;
  }
  std::string expect_name() {
    if (cur().type != T::kName)
      fail(cur().line, fmt::format("expected a name, found {}", describe(cur())));
    return toks_[i_++].text;
  }
  void expect_block_end() {
    if (cur().type != T::kBlockEnd)
      fail(cur().line, fmt::format("expected end of tag '%}}', found {}", describe(cur())));
    ++i_;
  }

  ExprP node(EK kind, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = line;
    return e;
  }

  // Statements until one of `ends` (a block tag name), which is consumed into `found`.
  Body parse_body(std::initializer_list<std::string_view> ends, std::string& found) {
    Guard guard(*this);
    Body body;
    while (true) {
      const Token& t = cur();
      if (t.type == T::kEof) {
        if (ends.size() == 0) return body;
        fail(t.line, fmt::format("unexpected end of template, expected '{}'", *(ends.end() - 1)));
      }
      if (t.type == T::kData) {
        auto s = std::make_unique<Stmt>();
        s->kind = SK::kText;
        s->line = t.line;
        s->text = t.text;
        body.push_back(std::move(s));
        ++i_;
      } else if (t.type == T::kVarBegin) {
        ++i_;
        auto s = std::make_unique<Stmt>();
        s->kind = SK::kOutput;
        s->line = t.line;
        s->exprs.push_back(parse_expr());
        if (cur().type != T::kVarEnd)
          fail(cur().line,
               fmt::format("expected end of expression '}}}}', found {}", describe(cur())));
        ++i_;
        body.push_back(std::move(s));
      } else if (t.type == T::kBlockBegin) {
        ++i_;
        const int line = cur().line;
        const std::string tag = expect_name();
        if (std::find(ends.begin(), ends.end(), tag) != ends.end()) {
          found = tag;
          return body;
        }
        body.push_back(parse_tag(tag, line));
      } else {
        fail(t.line, fmt::format("unexpected {}", describe(t)));
      }
    }
  }

  StmtP parse_tag(const std::string& tag, int line) {
    if (tag == "if") return parse_if(line);
    if (tag == "for") return parse_for(line);
    if (tag == "set") return parse_set(line);
    if (tag == "macro") return parse_macro(line);
    if (tag == "generation") return parse_generation(line);
    if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) fail(line, fmt::format("'{}' outside a for loop", tag));
      expect_block_end();
      auto s = std::make_unique<Stmt>();
      s->kind = tag == "break" ? SK::kBreak : SK::kContinue;
      s->line = line;
      return s;
    }
    static const std::vector<std::string_view> closing = {
        "elif", "else", "endif", "endfor", "endset", "endmacro", "endgeneration", "endraw"};
    if (contains(closing, tag)) fail(line, fmt::format("unexpected tag '{}'", tag));
    fail(line, fmt::format("tag '{}' is not supported", tag));
  }

  StmtP parse_if(int line) {
    auto s = std::make_unique<Stmt>();
    s->kind = SK::kIf;
    s->line = line;
    std::string found = "if";
    while (found == "if" || found == "elif") {
      s->exprs.push_back(parse_expr());
      expect_block_end();
      s->bodies.push_back(parse_body({"elif", "else", "endif"}, found));
    }
    if (found == "else") {
      expect_block_end();
      s->bodies.push_back(parse_body({"endif"}, found));
    }
    expect_block_end();
    return s;
  }

  StmtP parse_for(int line) {
    auto s = std::make_unique<Stmt>();
    s->kind = SK::kFor;
    s->line = line;
    s->names.push_back(expect_name());
    while (is_op(",")) {
      ++i_;
      s->names.push_back(expect_name());
    }
    if (!is_name("in")) fail(cur().line, fmt::format("expected 'in', found {}", describe(cur())));
    ++i_;
    s->exprs.push_back(parse_or());  // no conditional expression: a trailing `if` filters
    if (is_op(",")) s->exprs.back() = parse_tuple_rest(std::move(s->exprs.back()), false);
    ExprP filter;
    if (is_name("if")) {
      ++i_;
      filter = parse_expr();
    }
    s->exprs.push_back(std::move(filter));
    if (is_name("recursive")) fail(cur().line, "recursive for loops are not supported");
    expect_block_end();
    std::string found;
    ++loop_depth_;
    s->bodies.push_back(parse_body({"else", "endfor"}, found));
    --loop_depth_;
    Body else_body;
    if (found == "else") {
      expect_block_end();
      else_body = parse_body({"endfor"}, found);
    }
    s->bodies.push_back(std::move(else_body));
    expect_block_end();
    return s;
  }

  StmtP parse_set(int line) {
    auto s = std::make_unique<Stmt>();
    s->line = line;
    s->kind = SK::kSet;
    s->names.push_back(expect_name());
    if (is_op(".")) {
      ++i_;
      s->kind = SK::kSetAttr;
      s->names.push_back(expect_name());
    } else {
      while (is_op(",")) {
        ++i_;
        s->names.push_back(expect_name());
      }
    }
    if (cur().type == T::kBlockEnd && s->kind == SK::kSet && s->names.size() == 1) {
      ++i_;
      s->kind = SK::kSetBlock;
      std::string found;
      s->bodies.push_back(parse_body({"endset"}, found));
      expect_block_end();
      return s;
    }
    expect_op("=");
    ExprP value = parse_expr();
    if (is_op(",")) value = parse_tuple_rest(std::move(value), true);
    s->exprs.push_back(std::move(value));
    expect_block_end();
    return s;
  }

  StmtP parse_macro(int line) {
    auto s = std::make_unique<Stmt>();
    s->kind = SK::kMacro;
    s->line = line;
    s->names.push_back(expect_name());
    expect_op("(");
    while (!is_op(")")) {
      if (!s->exprs.empty() || s->names.size() > 1) expect_op(",");
      if (is_op(")")) break;
      s->names.push_back(expect_name());
      ExprP def;
      if (is_op("=")) {
        ++i_;
        def = parse_expr();
      }
      s->exprs.push_back(std::move(def));
    }
    ++i_;
    expect_block_end();
    const int saved_loops = loop_depth_;
    loop_depth_ = 0;
    std::string found;
    s->bodies.push_back(parse_body({"endmacro"}, found));
    loop_depth_ = saved_loops;
    if (cur().type == T::kName) ++i_;  // {% endmacro name %}
    expect_block_end();
    return s;
  }

  // transformers' {% generation %} marks assistant text for its token mask; the text renders
  // unchanged.
  StmtP parse_generation(int line) {
    expect_block_end();
    auto s = std::make_unique<Stmt>();
    s->kind = SK::kBlock;
    s->line = line;
    std::string found;
    s->bodies.push_back(parse_body({"endgeneration"}, found));
    expect_block_end();
    return s;
  }

  ExprP parse_tuple_rest(ExprP first, bool with_cond) {
    auto t = node(EK::kTuple, first->line);
    t->args.push_back(std::move(first));
    while (is_op(",")) {
      ++i_;
      if (cur().type == T::kBlockEnd || cur().type == T::kVarEnd || is_name("if")) break;
      t->args.push_back(with_cond ? parse_expr() : parse_or());
    }
    return t;
  }

  ExprP parse_expr() {
    Guard guard(*this);
    ExprP e = parse_or();
    while (is_name("if")) {
      const int line = cur().line;
      ++i_;
      auto c = node(EK::kCond, line);
      ExprP cond = parse_or();
      ExprP other;
      if (is_name("else")) {
        ++i_;
        other = parse_expr();
      }
      c->args.push_back(std::move(e));
      c->args.push_back(std::move(cond));
      c->args.push_back(std::move(other));
      e = std::move(c);
    }
    return e;
  }

  ExprP binary_chain(EK kind, std::string_view word, ExprP (Parser::*next)()) {
    ExprP e = (this->*next)();
    while (is_name(word)) {
      auto b = node(kind, cur().line);
      ++i_;
      b->args.push_back(std::move(e));
      b->args.push_back((this->*next)());
      e = std::move(b);
    }
    return e;
  }
  ExprP parse_or() { return binary_chain(EK::kOr, "or", &Parser::parse_and); }
  ExprP parse_and() { return binary_chain(EK::kAnd, "and", &Parser::parse_not); }

  ExprP parse_not() {
    if (!is_name("not")) return parse_compare();
    Guard guard(*this);
    auto n = node(EK::kNot, cur().line);
    ++i_;
    n->args.push_back(parse_not());
    return n;
  }

  ExprP parse_compare() {
    ExprP first = parse_math1();
    ExprP cmp;
    static const std::vector<std::string_view> ops = {"==", "!=", "<", "<=", ">", ">="};
    while (true) {
      std::string op;
      if (cur().type == T::kOp && contains(ops, cur().text)) {
        op = cur().text;
        ++i_;
      } else if (is_name("in")) {
        op = "in";
        ++i_;
      } else if (is_name("not") && peek().type == T::kName && peek().text == "in") {
        op = "notin";
        i_ += 2;
      } else {
        break;
      }
      if (!cmp) {
        cmp = node(EK::kCompare, first->line);
        cmp->args.push_back(std::move(first));
      }
      cmp->ops.push_back(op);
      cmp->args.push_back(parse_math1());
    }
    return cmp ? std::move(cmp) : std::move(first);
  }

  ExprP binary_ops(std::initializer_list<std::string_view> ops, ExprP (Parser::*next)()) {
    ExprP e = (this->*next)();
    while (cur().type == T::kOp && std::find(ops.begin(), ops.end(), cur().text) != ops.end()) {
      auto b = node(EK::kBinary, cur().line);
      b->name = toks_[i_++].text;
      b->args.push_back(std::move(e));
      b->args.push_back((this->*next)());
      e = std::move(b);
    }
    return e;
  }
  ExprP parse_math1() { return binary_ops({"+", "-"}, &Parser::parse_concat); }
  ExprP parse_math2() { return binary_ops({"*", "/", "//", "%"}, &Parser::parse_pow); }
  ExprP parse_pow() { return binary_ops({"**"}, &Parser::parse_unary_filtered); }

  ExprP parse_concat() {
    ExprP e = parse_math2();
    if (!is_op("~")) return e;
    auto c = node(EK::kConcat, e->line);
    c->args.push_back(std::move(e));
    while (is_op("~")) {
      ++i_;
      c->args.push_back(parse_math2());
    }
    return c;
  }

  ExprP parse_unary_filtered() { return parse_unary(true); }

  ExprP parse_unary(bool with_filter) {
    Guard guard(*this);
    ExprP e;
    if (is_op("-") || is_op("+")) {
      e = node(is_op("-") ? EK::kNeg : EK::kPos, cur().line);
      ++i_;
      e->args.push_back(parse_unary(false));
    } else {
      e = parse_primary();
    }
    e = parse_postfix(std::move(e));
    if (with_filter) e = parse_filter_expr(std::move(e));
    return e;
  }

  ExprP constant(Value v, int line) {
    auto c = node(EK::kConst, line);
    c->value = std::move(v);
    return c;
  }

  ExprP parse_primary() {
    const Token& t = cur();
    const int line = t.line;
    switch (t.type) {
      case T::kName: {
        ++i_;
        if (t.text == "true" || t.text == "True") return constant(bool_v(true), line);
        if (t.text == "false" || t.text == "False") return constant(bool_v(false), line);
        if (t.text == "none" || t.text == "None") return constant(none_v(), line);
        auto n = node(EK::kName, line);
        n->name = t.text;
        return n;
      }
      case T::kString: {
        std::string s;
        while (cur().type == T::kString) s += toks_[i_++].text;
        return constant(str_v(std::move(s)), line);
      }
      case T::kInt:
        ++i_;
        return constant(int_v(t.ival), line);
      case T::kFloat:
        ++i_;
        return constant(float_v(t.fval), line);
      case T::kOp:
        if (t.text == "(") return parse_paren();
        if (t.text == "[") return parse_list();
        if (t.text == "{") return parse_dict();
        break;
      default:
        break;
    }
    fail(line, fmt::format("unexpected {}", describe(t)));
  }

  ExprP parse_paren() {
    const int line = cur().line;
    ++i_;
    if (is_op(")")) {
      ++i_;
      return node(EK::kTuple, line);
    }
    ExprP e = parse_expr();
    if (is_op(",")) {
      auto t = node(EK::kTuple, line);
      t->args.push_back(std::move(e));
      while (is_op(",")) {
        ++i_;
        if (is_op(")")) break;
        t->args.push_back(parse_expr());
      }
      e = std::move(t);
    }
    expect_op(")");
    return e;
  }

  ExprP parse_list() {
    auto l = node(EK::kList, cur().line);
    ++i_;
    while (!is_op("]")) {
      if (!l->args.empty()) expect_op(",");
      if (is_op("]")) break;
      l->args.push_back(parse_expr());
    }
    ++i_;
    return l;
  }

  ExprP parse_dict() {
    auto d = node(EK::kDict, cur().line);
    ++i_;
    while (!is_op("}")) {
      if (!d->args.empty()) expect_op(",");
      if (is_op("}")) break;
      d->args.push_back(parse_expr());
      expect_op(":");
      d->args.push_back(parse_expr());
    }
    ++i_;
    return d;
  }

  ExprP parse_postfix(ExprP e) {
    while (true) {
      if (is_op(".")) {
        const int line = cur().line;
        ++i_;
        if (cur().type == T::kInt) {
          auto it = node(EK::kItem, line);
          it->args.push_back(std::move(e));
          it->args.push_back(constant(int_v(toks_[i_++].ival), line));
          e = std::move(it);
        } else {
          auto a = node(EK::kAttr, line);
          a->name = expect_name();
          a->args.push_back(std::move(e));
          e = std::move(a);
        }
      } else if (is_op("[")) {
        e = parse_subscript(std::move(e));
      } else if (is_op("(")) {
        e = parse_call(std::move(e));
      } else {
        return e;
      }
    }
  }

  ExprP parse_subscript(ExprP obj) {
    const int line = cur().line;
    ++i_;
    ExprP parts[3];
    int n = 0;
    bool slice = false;
    while (true) {
      if (is_op(":")) {
        slice = true;
        if (++n > 2) fail(cur().line, "unexpected ':' in subscript");
        ++i_;
        continue;
      }
      if (is_op("]")) break;
      if (is_op(",")) fail(cur().line, "tuple subscripts are not supported");
      if (parts[n]) fail(cur().line, fmt::format("expected ']', found {}", describe(cur())));
      parts[n] = parse_expr();
    }
    ++i_;
    auto e = node(slice ? EK::kSlice : EK::kItem, line);
    e->args.push_back(std::move(obj));
    if (!slice && !parts[0]) fail(line, "empty subscript");
    for (int k = 0; k < (slice ? 3 : 1); ++k) e->args.push_back(std::move(parts[k]));
    return e;
  }

  void parse_call_args(Expr& call) {
    expect_op("(");
    bool first = true;
    while (!is_op(")")) {
      if (!first) expect_op(",");
      first = false;
      if (is_op(")")) break;
      if (is_op("*") || is_op("**")) fail(cur().line, "'*' and '**' arguments are not supported");
      if (cur().type == T::kName && peek().type == T::kOp && peek().text == "=") {
        std::string key = toks_[i_].text;
        i_ += 2;
        call.kwargs.emplace_back(std::move(key), parse_expr());
      } else {
        if (!call.kwargs.empty()) fail(cur().line, "positional argument after keyword argument");
        call.args.push_back(parse_expr());
      }
    }
    ++i_;
  }

  ExprP parse_call(ExprP callee) {
    auto c = node(EK::kCall, cur().line);
    c->args.push_back(std::move(callee));
    parse_call_args(*c);
    return c;
  }

  ExprP parse_filter_expr(ExprP e) {
    while (true) {
      if (is_op("|")) {
        const int line = cur().line;
        ++i_;
        auto f = node(EK::kFilter, line);
        f->name = expect_name();
        if (!contains(known_filters(), f->name))
          fail(line, fmt::format("filter '{}' is not supported", f->name));
        f->args.push_back(std::move(e));
        if (is_op("(")) parse_call_args(*f);
        e = std::move(f);
      } else if (is_name("is")) {
        e = parse_test(std::move(e));
      } else if (is_op("(")) {
        e = parse_call(std::move(e));
      } else {
        return e;
      }
    }
  }

  ExprP parse_test(ExprP e) {
    const int line = cur().line;
    ++i_;
    auto t = node(EK::kTest, line);
    if (is_name("not")) {
      t->negated = true;
      ++i_;
    }
    t->name = expect_name();
    if (!contains(known_tests(), t->name))
      fail(line, fmt::format("test '{}' is not supported", t->name));
    t->args.push_back(std::move(e));
    const Token& n = cur();
    const bool arg_start = n.type == T::kName || n.type == T::kString || n.type == T::kInt ||
                           n.type == T::kFloat ||
                           (n.type == T::kOp && (n.text == "[" || n.text == "{"));
    if (is_op("(")) {
      parse_call_args(*t);
    } else if (arg_start && !is_name("else") && !is_name("or") && !is_name("and")) {
      if (is_name("is")) fail(n.line, "tests cannot be chained with 'is'");
      t->args.push_back(parse_postfix(parse_primary()));
    }
    return t;
  }

  std::vector<Token> toks_;
  const std::string& name_;
  std::size_t i_ = 0;
  int depth_ = 0;
  int loop_depth_ = 0;
};

// ---------------------------------------------------------------------------------------
// String operations with Python's semantics.

char32_t ascii_upper(char32_t c) {
  return c >= 'a' && c <= 'z' ? c - 32 : c;
}
char32_t ascii_lower(char32_t c) {
  return c >= 'A' && c <= 'Z' ? c + 32 : c;
}
bool ascii_alpha(char32_t c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
}
bool ascii_digit(char32_t c) {
  return c >= '0' && c <= '9';
}

// Case mapping is ASCII-only: other letters pass through unchanged (documented limitation).
std::string map_chars(std::string_view s, char32_t (*f)(char32_t)) {
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) append_utf8(out, f(next_cp(s, i)));
  return out;
}

std::string py_capitalize(std::string_view s) {
  std::string out;
  bool first = true;
  for (std::size_t i = 0; i < s.size();) {
    const char32_t c = next_cp(s, i);
    append_utf8(out, first ? ascii_upper(c) : ascii_lower(c));
    first = false;
  }
  return out;
}

// str.title(): a letter after a non-letter starts a word.
std::string py_title_method(std::string_view s) {
  std::string out;
  bool prev_cased = false;
  for (std::size_t i = 0; i < s.size();) {
    const char32_t c = next_cp(s, i);
    const bool cased = ascii_alpha(c) || c >= 0x80;
    append_utf8(out, !cased ? c : prev_cased ? ascii_lower(c) : ascii_upper(c));
    prev_cased = cased;
  }
  return out;
}

// jinja2's title filter: words start after whitespace or one of -({[<.
std::string jinja_title(std::string_view s) {
  std::string out;
  bool at_start = true;
  for (std::size_t i = 0; i < s.size();) {
    const char32_t c = next_cp(s, i);
    const bool sep = py_space(c) || c == '-' || c == '(' || c == '{' || c == '[' || c == '<';
    append_utf8(out, sep ? c : at_start ? ascii_upper(c) : ascii_lower(c));
    at_start = sep;
  }
  return out;
}

std::string py_replace(std::string_view s, std::string_view old, std::string_view repl,
                       std::int64_t count) {
  std::string out;
  if (old.empty()) {
    std::size_t i = 0;
    while (count != 0) {
      out += repl;
      if (count > 0) --count;
      if (i >= s.size()) return out;
      const std::size_t start = i;
      next_cp(s, i);
      out += s.substr(start, i - start);
      if (out.size() > kMaxOutputBytes) eval_fail("string longer than {} bytes", kMaxOutputBytes);
    }
    out += s.substr(i);
    return out;
  }
  std::size_t pos = 0;
  while (count != 0) {
    const std::size_t hit = s.find(old, pos);
    if (hit == std::string_view::npos) break;
    out += s.substr(pos, hit - pos);
    out += repl;
    if (out.size() > kMaxOutputBytes) eval_fail("string longer than {} bytes", kMaxOutputBytes);
    pos = hit + old.size();
    if (count > 0) --count;
  }
  out += s.substr(pos);
  return out;
}

List py_split(std::string_view s, const Value& sep, std::int64_t maxsplit, bool from_right) {
  std::vector<std::string> parts;
  if (sep.is(K::kNone) || sep.is(K::kUndefined)) {
    // Runs of whitespace separate; leading/trailing whitespace yields nothing.
    std::u32string u = to_u32(s);
    if (from_right) std::reverse(u.begin(), u.end());
    std::size_t i = 0;
    while (true) {
      while (i < u.size() && py_space(u[i])) ++i;
      if (i >= u.size()) break;
      if (maxsplit >= 0 && static_cast<std::int64_t>(parts.size()) == maxsplit) {
        parts.push_back(from_u32(std::u32string_view(u).substr(i)));  // keeps trailing space
        break;
      }
      std::size_t e = i;
      while (e < u.size() && !py_space(u[e])) ++e;
      parts.push_back(from_u32(std::u32string_view(u).substr(i, e - i)));
      i = e;
    }
    if (from_right) {
      for (std::string& p : parts) {
        std::u32string r = to_u32(p);
        std::reverse(r.begin(), r.end());
        p = from_u32(r);
      }
      std::reverse(parts.begin(), parts.end());
    }
  } else {
    if (!sep.is(K::kString)) eval_fail("must be str or None, not {}", type_name(sep));
    const std::string& d = sep.s();
    if (d.empty()) eval_fail("empty separator");
    if (!from_right) {
      std::size_t pos = 0;
      while (maxsplit < 0 || static_cast<std::int64_t>(parts.size()) < maxsplit) {
        const std::size_t hit = s.find(d, pos);
        if (hit == std::string_view::npos) break;
        parts.emplace_back(s.substr(pos, hit - pos));
        pos = hit + d.size();
      }
      parts.emplace_back(s.substr(pos));
    } else {
      std::size_t end = s.size();
      while (maxsplit < 0 || static_cast<std::int64_t>(parts.size()) < maxsplit) {
        if (end < d.size()) break;
        const std::size_t hit = s.rfind(d, end - d.size());
        if (hit == std::string_view::npos) break;
        parts.emplace_back(s.substr(hit + d.size(), end - hit - d.size()));
        end = hit;
      }
      parts.emplace_back(s.substr(0, end));
      std::reverse(parts.begin(), parts.end());
    }
  }
  List out;
  for (std::string& p : parts) out.push_back(str_v(std::move(p)));
  return out;
}

bool line_break(char32_t c) {
  return c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || c == 0x1C || c == 0x1D || c == 0x1E ||
         c == 0x85 || c == 0x2028 || c == 0x2029;
}

// str.splitlines()
std::vector<std::string> py_splitlines(std::string_view s, bool keepends) {
  std::vector<std::string> lines;
  std::size_t start = 0;
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t at = i;
    const char32_t c = next_cp(s, i);
    if (!line_break(c)) continue;
    if (c == '\r' && i < s.size() && s[i] == '\n') ++i;
    lines.emplace_back(s.substr(start, (keepends ? i : at) - start));
    start = i;
  }
  if (start < s.size()) lines.emplace_back(s.substr(start));
  return lines;
}

std::int64_t cp_index(std::string_view s, std::size_t byte_pos) {
  return static_cast<std::int64_t>(cp_count(s.substr(0, byte_pos)));
}

bool parse_py_int(std::string_view text, std::int64_t& out) {
  std::string t(py_strip(text, true, true, nullptr));
  std::string digits;
  for (std::size_t i = 0; i < t.size(); ++i) {
    if (t[i] == '_' && i > 0 && i + 1 < t.size() &&
        std::isdigit(static_cast<unsigned char>(t[i - 1])) &&
        std::isdigit(static_cast<unsigned char>(t[i + 1])))
      continue;
    digits += t[i];
  }
  if (!digits.empty() && digits[0] == '+') digits.erase(0, 1);
  if (digits.empty()) return false;
  const auto r = std::from_chars(digits.data(), digits.data() + digits.size(), out);
  return r.ec == std::errc() && r.ptr == digits.data() + digits.size();
}

bool parse_py_float(std::string_view text, double& out) {
  std::string t(py_strip(text, true, true, nullptr));
  if (t.empty() || t.find_first_of("xXpP") != std::string::npos) return false;
  std::string lower = map_chars(t, ascii_lower);
  std::string_view body = lower;
  if (!body.empty() && (body[0] == '+' || body[0] == '-')) body.remove_prefix(1);
  if (body == "inf" || body == "infinity" || body == "nan") {
    out = body == "nan" ? NAN : INFINITY;
    if (lower[0] == '-') out = -out;
    return true;
  }
  if (body.find_first_not_of("0123456789.e+-") != std::string_view::npos) return false;
  char* end = nullptr;
  out = std::strtod(t.c_str(), &end);
  return end == t.c_str() + t.size();
}

// ---------------------------------------------------------------------------------------
// Evaluator

enum class Flow { kNormal, kBreak, kContinue };

const Value* arg(const CallArgs& a, std::size_t index, std::string_view key) {
  if (index < a.pos.size()) return &a.pos[index];
  for (const auto& [k, v] : a.kw) {
    if (k == key) return &v;
  }
  return nullptr;
}

void check_args(const CallArgs& a, std::string_view what,
                std::initializer_list<std::string_view> names) {
  if (a.pos.size() > names.size())
    eval_fail("{} takes at most {} arguments ({} given)", what, names.size(), a.pos.size());
  for (const auto& [k, v] : a.kw) {
    const auto it = std::find(names.begin(), names.end(), k);
    if (it == names.end()) eval_fail("{} got an unexpected keyword argument '{}'", what, k);
    if (static_cast<std::size_t>(it - names.begin()) < a.pos.size())
      eval_fail("{} got multiple values for argument '{}'", what, k);
  }
}

bool given(const Value* v) {
  return v && !v->is(K::kNone) && !v->is(K::kUndefined);
}

std::int64_t int_arg(const Value* v, std::int64_t fallback, std::string_view what) {
  if (!given(v)) return fallback;
  if (!is_integral(*v)) eval_fail("{} expects an integer, not {}", what, type_name(*v));
  return as_int(*v);
}

std::string str_arg(const Value& v, std::string_view what) {
  if (!v.is(K::kString)) eval_fail("{} expects a string, not {}", what, type_name(v));
  return v.s();
}

const std::vector<std::string_view> kStrMethods = {
    "strip", "lstrip",  "rstrip",  "split",      "rsplit",  "splitlines", "startswith", "endswith",
    "upper", "lower",   "title",   "capitalize", "replace", "find",       "rfind",      "count",
    "join",  "isdigit", "isalpha", "isalnum",    "isspace", "isupper",    "islower"};
const std::vector<std::string_view> kDictMethods = {"get", "items", "keys", "values"};
const std::vector<std::string_view> kPyStrMethods = {
    "format",    "format_map", "zfill",        "center",       "ljust",        "rjust",
    "encode",    "partition",  "rpartition",   "swapcase",     "casefold",     "expandtabs",
    "translate", "index",      "rindex",       "removeprefix", "removesuffix", "isnumeric",
    "isdecimal", "istitle",    "isidentifier", "isprintable"};
const std::vector<std::string_view> kPyListMethods = {"append", "extend", "insert", "pop",
                                                      "remove", "clear",  "sort",   "reverse",
                                                      "index",  "count",  "copy"};
const std::vector<std::string_view> kPyDictMethods = {"update", "pop",  "setdefault", "popitem",
                                                      "clear",  "copy", "fromkeys"};

class Renderer {
 public:
  Renderer(const detail::Program& prog, const Functions* host) : prog_(prog), host_(host) {
    install_globals();
  }

  template <typename J>
  std::string run(const J& context) {
    if (!context.is_object())
      fail_input("{}: the template context must be a JSON object", prog_.name);
    try {
      frames_.emplace_back();
      for (const auto& [k, v] : context.items()) frames_[0][k] = from_json(v, 0);
      std::string out;
      out_ = &out;
      exec(prog_.body);
      return out;
    } catch (const EvalError& e) {
      if (line_ == 0) fail_input("{}: {}", prog_.name, e.message);
      fail_input("{} line {}: {}", prog_.name, line_, e.message);
    }
  }

  Value call_macro(const Stmt& m, CallArgs& a);
  Value call_method(const Value& obj, const std::string& name, CallArgs& a);

 private:
  using Frame = std::unordered_map<std::string, Value>;

  void install_globals();
  void emit(std::string_view s) {
    out_->append(s);
    if (out_->size() > kMaxOutputBytes) eval_fail("output longer than {} bytes", kMaxOutputBytes);
  }
  void step() {
    if (++steps_ > kMaxLoopSteps) eval_fail("more than {} loop iterations", kMaxLoopSteps);
  }

  Value lookup(const std::string& name) const {
    for (std::size_t i = frames_.size(); i-- > base_;) {
      const auto it = frames_[i].find(name);
      if (it != frames_[i].end()) return it->second;
    }
    if (base_ > 0) {
      const auto it = frames_[0].find(name);
      if (it != frames_[0].end()) return it->second;
    }
    const auto g = globals_.find(name);
    if (g != globals_.end()) return g->second;
    return undefined(fmt::format("'{}' is undefined", name));
  }
  void assign(const std::string& name, Value v) { frames_.back()[name] = std::move(v); }

  void assign_targets(const std::vector<std::string>& names, const Value& v) {
    if (names.size() == 1) return assign(names[0], v);
    if (!v.is(K::kList)) eval_fail("cannot unpack non-sequence {}", type_name(v));
    if (v.list->size() != names.size())
      eval_fail("cannot unpack {} values into {} names", v.list->size(), names.size());
    for (std::size_t i = 0; i < names.size(); ++i) assign(names[i], (*v.list)[i]);
  }

  Flow exec(const Body& body) {
    for (const StmtP& s : body) {
      const Flow f = exec(*s);
      if (f != Flow::kNormal) return f;
    }
    return Flow::kNormal;
  }

  Flow exec(const Stmt& s);
  Flow exec_for(const Stmt& s);
  std::string capture(const Body& body);
  Value make_loop(const List& items, std::size_t i);

  Value eval(const Expr& e);
  Value eval_call(const Expr& e);
  CallArgs eval_args(const Expr& e, std::size_t first);
  Value get_attr(const Value& obj, const std::string& name);
  Value get_item(const Value& obj, const Value& key);
  Value get_path(const Value& obj, const std::string& path);
  Value slice(const Value& obj, const Expr* lo, const Expr* hi, const Expr* st);
  Value binary(const std::string& op, const Value& a, const Value& b);
  bool compare(const std::string& op, const Value& a, const Value& b);
  bool contains_op(const Value& container, const Value& item);
  List iterate(const Value& v);
  Value filter(const std::string& name, const Value& v, CallArgs& a);
  Value filter_select(const std::string& name, const Value& v, CallArgs& a);
  Value filter_sort(const std::string& name, const Value& v, CallArgs& a);
  bool test(const std::string& name, const Value& v, const CallArgs& a);
  Value str_method(const std::string& s, const std::string& name, CallArgs& a);
  Value call(const Value& callee, CallArgs& a) {
    if (callee.is(K::kUndefined)) undefined_error(callee);
    if (!callee.is(K::kFunction)) eval_fail("'{}' object is not callable", type_name(callee));
    return callee.fn->fn(*this, a);
  }
  Value bound_method(const Value& obj, const std::string& name) {
    return fn_v(name,
                [obj, name](Renderer& r, CallArgs& a) { return r.call_method(obj, name, a); });
  }

  const detail::Program& prog_;
  const Functions* host_;
  std::unordered_map<std::string, Value> globals_;
  std::vector<Frame> frames_;
  std::size_t base_ = 0;  // a macro sees its own frames and the template's top level only
  std::string* out_ = nullptr;
  int line_ = 0;
  std::int64_t steps_ = 0;
  int macro_depth_ = 0;
};

void Renderer::install_globals() {
  globals_["range"] = fn_v("range", [](Renderer&, CallArgs& a) {
    if (!a.kw.empty() || a.pos.empty() || a.pos.size() > 3)
      eval_fail("range expects 1 to 3 integer arguments");
    for (const Value& v : a.pos) {
      if (!is_integral(v)) eval_fail("range expects integers, not {}", type_name(v));
    }
    std::int64_t start = 0, stop = as_int(a.pos[0]), stride = 1;
    if (a.pos.size() >= 2) start = as_int(a.pos[0]), stop = as_int(a.pos[1]);
    if (a.pos.size() == 3) stride = as_int(a.pos[2]);
    if (stride == 0) eval_fail("range() arg 3 must not be zero");
    const double n =
        std::max(0.0, std::ceil((static_cast<double>(stop) - static_cast<double>(start)) /
                                static_cast<double>(stride)));
    if (n > static_cast<double>(kMaxRange))
      eval_fail("range of {} items is larger than the allowed {}", n, kMaxRange);
    List items;
    for (std::int64_t i = 0; i < static_cast<std::int64_t>(n); ++i)
      items.push_back(int_v(start + i * stride));
    return list_v(std::move(items));
  });
  auto kw_dict = [](CallArgs& a, const char* what) {
    Dict d;
    if (a.pos.size() > 1) eval_fail("{} takes at most one positional argument", what);
    if (!a.pos.empty()) {
      if (!a.pos[0].is(K::kDict))
        eval_fail("{} expects a mapping, not {}", what, type_name(a.pos[0]));
      d = *a.pos[0].dict;
    }
    for (auto& [k, v] : a.kw) dict_set(d, k, v);
    return d;
  };
  globals_["namespace"] = fn_v("namespace", [kw_dict](Renderer&, CallArgs& a) {
    Value ns = dict_v(kw_dict(a, "namespace"), K::kNamespace);
    if (ns.holds_namespace) eval_fail("a namespace inside a namespace is not supported");
    return ns;
  });
  globals_["dict"] =
      fn_v("dict", [kw_dict](Renderer&, CallArgs& a) { return dict_v(kw_dict(a, "dict")); });
  globals_["raise_exception"] = fn_v("raise_exception", [](Renderer& r, CallArgs& a) -> Value {
    throw InputError(r.prog_.name + ": " + (a.pos.empty() ? std::string() : to_str(a.pos[0])));
  });
  if (!host_) return;
  for (const auto& entry : *host_) {
    const Function* fp = &entry.second;
    const std::string name = entry.first;  // clang 14 cannot capture a structured binding
    globals_[name] = fn_v(name, [fp, name](Renderer&, CallArgs& a) {
      if (!a.kw.empty()) eval_fail("{} takes no keyword arguments", name);
      std::vector<json> args;
      for (const Value& v : a.pos) args.push_back(to_json(v));
      try {
        return from_json((*fp)(args), 0);
      } catch (const InputError& e) {  // give it the template's name and line
        eval_fail("{}", e.what());
      }
    });
  }
}

Flow Renderer::exec(const Stmt& s) {
  switch (s.kind) {
    case SK::kText:
      emit(s.text);
      return Flow::kNormal;
    case SK::kOutput: {
      const Value v = eval(*s.exprs[0]);
      line_ = s.line;
      emit(to_str(v));
      return Flow::kNormal;
    }
    case SK::kIf:
      for (std::size_t i = 0; i < s.exprs.size(); ++i) {
        if (truthy(eval(*s.exprs[i]))) return exec(s.bodies[i]);
      }
      if (s.bodies.size() > s.exprs.size()) return exec(s.bodies.back());
      return Flow::kNormal;
    case SK::kFor:
      return exec_for(s);
    case SK::kSet:
      assign_targets(s.names, eval(*s.exprs[0]));
      return Flow::kNormal;
    case SK::kSetAttr: {
      Value ns = lookup(s.names[0]);
      Value v = eval(*s.exprs[0]);
      line_ = s.line;
      if (!ns.is(K::kNamespace))
        eval_fail("cannot assign attribute on non-namespace object '{}'", s.names[0]);
      if (v.is(K::kNamespace) || v.holds_namespace)
        eval_fail("a namespace inside a namespace is not supported");
      dict_set(*ns.dict, s.names[1], std::move(v));
      return Flow::kNormal;
    }
    case SK::kSetBlock:
      assign(s.names[0], str_v(capture(s.bodies[0])));
      return Flow::kNormal;
    case SK::kBreak:
      return Flow::kBreak;
    case SK::kContinue:
      return Flow::kContinue;
    case SK::kMacro: {
      const Stmt* m = &s;
      assign(s.names[0],
             fn_v(s.names[0], [m](Renderer& r, CallArgs& a) { return r.call_macro(*m, a); }));
      return Flow::kNormal;
    }
    case SK::kBlock:
      return exec(s.bodies[0]);
  }
  return Flow::kNormal;
}

std::string Renderer::capture(const Body& body) {
  std::string captured;
  std::string* saved = out_;
  out_ = &captured;
  exec(body);
  out_ = saved;
  return captured;
}

Value Renderer::make_loop(const List& items, std::size_t i) {
  const auto n = static_cast<std::int64_t>(items.size());
  const auto k = static_cast<std::int64_t>(i);
  Dict d = {{"index", int_v(k + 1)},    {"index0", int_v(k)},
            {"revindex", int_v(n - k)}, {"revindex0", int_v(n - k - 1)},
            {"first", bool_v(i == 0)},  {"last", bool_v(k == n - 1)},
            {"length", int_v(n)},       {"depth", int_v(1)},
            {"depth0", int_v(0)}};
  d.emplace_back("previtem", i > 0 ? items[i - 1] : undefined("there is no previous item"));
  d.emplace_back("nextitem", k + 1 < n ? items[i + 1] : undefined("there is no next item"));
  d.emplace_back("cycle", fn_v("loop.cycle", [i](Renderer&, CallArgs& a) {
                   if (a.pos.empty()) eval_fail("no items for cycling given");
                   return a.pos[i % a.pos.size()];
                 }));
  Value v;
  v.kind = K::kDict;
  v.depth = 1;
  v.dict = std::make_shared<Dict>(std::move(d));
  return v;
}

Flow Renderer::exec_for(const Stmt& s) {
  List items = iterate(eval(*s.exprs[0]));
  line_ = s.line;
  if (s.exprs[1]) {
    List kept;
    for (const Value& item : items) {
      step();
      frames_.emplace_back();
      assign_targets(s.names, item);
      const bool keep = truthy(eval(*s.exprs[1]));
      frames_.pop_back();
      if (keep) kept.push_back(item);
    }
    items = std::move(kept);
  }
  if (items.empty()) return exec(s.bodies[1]);
  for (std::size_t i = 0; i < items.size(); ++i) {
    step();
    frames_.emplace_back();
    assign_targets(s.names, items[i]);
    assign("loop", make_loop(items, i));
    const Flow f = exec(s.bodies[0]);
    frames_.pop_back();
    if (f == Flow::kBreak) break;
  }
  return Flow::kNormal;
}

Value Renderer::call_macro(const Stmt& m, CallArgs& a) {
  const std::size_t nparams = m.names.size() - 1;
  if (a.pos.size() > nparams)
    eval_fail("macro '{}' takes {} arguments ({} given)", m.names[0], nparams, a.pos.size());
  if (++macro_depth_ > kMaxMacroDepth)
    eval_fail("macro calls nested deeper than {}", kMaxMacroDepth);
  step();
  frames_.emplace_back();
  const std::size_t saved_base = base_;
  base_ = frames_.size() - 1;
  for (std::size_t i = 0; i < nparams; ++i) {
    const std::string& p = m.names[i + 1];
    const Value* v = arg(a, i, p);
    if (v) {
      assign(p, *v);
    } else if (m.exprs[i]) {
      assign(p, eval(*m.exprs[i]));
    } else {
      assign(p, undefined(fmt::format("parameter '{}' was not provided", p)));
    }
  }
  for (const auto& [k, v] : a.kw) {
    if (std::find(m.names.begin() + 1, m.names.end(), k) == m.names.end())
      eval_fail("macro '{}' got an unexpected keyword argument '{}'", m.names[0], k);
  }
  std::string out = capture(m.bodies[0]);
  frames_.pop_back();
  base_ = saved_base;
  --macro_depth_;
  return str_v(std::move(out));
}

List Renderer::iterate(const Value& v) {
  switch (v.kind) {
    case K::kUndefined:
      return {};
    case K::kList:
      return *v.list;
    case K::kDict: {
      List keys;
      for (const auto& [k, item] : *v.dict) keys.push_back(str_v(k));
      return keys;
    }
    case K::kString: {
      List chars;
      const std::string& s = v.s();
      for (std::size_t i = 0; i < s.size();) {
        const std::size_t start = i;
        next_cp(s, i);
        chars.push_back(str_v(s.substr(start, i - start)));
      }
      return chars;
    }
    default:
      eval_fail("'{}' object is not iterable", type_name(v));
  }
}

CallArgs Renderer::eval_args(const Expr& e, std::size_t first) {
  CallArgs a;
  for (std::size_t i = first; i < e.args.size(); ++i) a.pos.push_back(eval(*e.args[i]));
  for (const auto& [k, x] : e.kwargs) a.kw.emplace_back(k, eval(*x));
  return a;
}

Value Renderer::eval(const Expr& e) {
  line_ = e.line;
  switch (e.kind) {
    case EK::kConst:
      return e.value;
    case EK::kName:
      return lookup(e.name);
    case EK::kAttr: {
      const Value obj = eval(*e.args[0]);
      line_ = e.line;
      return get_attr(obj, e.name);
    }
    case EK::kItem: {
      const Value obj = eval(*e.args[0]);
      const Value key = eval(*e.args[1]);
      line_ = e.line;
      return get_item(obj, key);
    }
    case EK::kSlice:
      return slice(eval(*e.args[0]), e.args[1].get(), e.args[2].get(), e.args[3].get());
    case EK::kCall:
      return eval_call(e);
    case EK::kFilter: {
      const Value v = eval(*e.args[0]);
      CallArgs a = eval_args(e, 1);
      line_ = e.line;
      return filter(e.name, v, a);
    }
    case EK::kTest: {
      const Value v = eval(*e.args[0]);
      CallArgs a = eval_args(e, 1);
      line_ = e.line;
      return bool_v(test(e.name, v, a) != e.negated);
    }
    case EK::kNeg:
    case EK::kPos: {
      const Value v = eval(*e.args[0]);
      line_ = e.line;
      if (v.is(K::kUndefined)) undefined_error(v);
      if (!is_number(v))
        eval_fail("bad operand type for unary {}: '{}'", e.kind == EK::kNeg ? '-' : '+',
                  type_name(v));
      if (e.kind == EK::kPos) return v.is(K::kBool) ? int_v(as_int(v)) : v;
      if (v.is(K::kFloat)) return float_v(-v.number);
      if (as_int(v) == INT64_MIN) eval_fail("integer overflow");
      return int_v(-as_int(v));
    }
    case EK::kNot:
      return bool_v(!truthy(eval(*e.args[0])));
    case EK::kAnd: {
      Value a = eval(*e.args[0]);
      return truthy(a) ? eval(*e.args[1]) : a;
    }
    case EK::kOr: {
      Value a = eval(*e.args[0]);
      return truthy(a) ? a : eval(*e.args[1]);
    }
    case EK::kBinary: {
      const Value a = eval(*e.args[0]);
      const Value b = eval(*e.args[1]);
      line_ = e.line;
      return binary(e.name, a, b);
    }
    case EK::kCompare: {
      Value left = eval(*e.args[0]);
      for (std::size_t i = 0; i < e.ops.size(); ++i) {
        Value right = eval(*e.args[i + 1]);
        line_ = e.line;
        if (!compare(e.ops[i], left, right)) return bool_v(false);
        left = std::move(right);
      }
      return bool_v(true);
    }
    case EK::kCond:
      if (truthy(eval(*e.args[1]))) return eval(*e.args[0]);
      if (e.args[2]) return eval(*e.args[2]);
      return undefined(fmt::format(
          "the inline if-expression on line {} evaluated to false and no else section was defined",
          e.line));
    case EK::kList:
    case EK::kTuple: {
      List items;
      for (const ExprP& x : e.args) items.push_back(eval(*x));
      return list_v(std::move(items), e.kind == EK::kTuple);
    }
    case EK::kDict: {
      Dict d;
      for (std::size_t i = 0; i + 1 < e.args.size(); i += 2) {
        const Value k = eval(*e.args[i]);
        if (!k.is(K::kString)) eval_fail("dict keys must be strings here, not {}", type_name(k));
        dict_set(d, k.s(), eval(*e.args[i + 1]));
      }
      return dict_v(std::move(d));
    }
    case EK::kConcat: {
      std::string s;
      for (const ExprP& x : e.args) {
        s += to_str(eval(*x));
        if (s.size() > kMaxOutputBytes) eval_fail("string longer than {} bytes", kMaxOutputBytes);
      }
      return str_v(std::move(s));
    }
  }
  return undefined("?");
}

Value Renderer::eval_call(const Expr& e) {
  const Value callee = eval(*e.args[0]);
  CallArgs a = eval_args(e, 1);
  line_ = e.line;
  return call(callee, a);
}

Value Renderer::get_attr(const Value& obj, const std::string& name) {
  switch (obj.kind) {
    case K::kUndefined:
      undefined_error(obj);
    case K::kDict:
      if (contains(kDictMethods, name)) return bound_method(obj, name);
      if (const Value* v = dict_find(*obj.dict, name)) return *v;
      if (contains(kPyDictMethods, name))
        return undefined(fmt::format("dict method '{}' is not supported", name));
      return undefined(fmt::format("'dict object' has no attribute '{}'", name));
    case K::kNamespace:
      if (const Value* v = dict_find(*obj.dict, name)) return *v;
      return undefined(fmt::format("'Namespace object' has no attribute '{}'", name));
    case K::kString:
      if (contains(kStrMethods, name)) return bound_method(obj, name);
      if (contains(kPyStrMethods, name))
        return undefined(fmt::format("str method '{}' is not supported", name));
      return undefined(fmt::format("'str object' has no attribute '{}'", name));
    case K::kList:
      if (contains(kPyListMethods, name))
        return undefined(fmt::format("list method '{}' is not supported", name));
      return undefined(fmt::format("'list object' has no attribute '{}'", name));
    default:
      return undefined(fmt::format("'{} object' has no attribute '{}'", type_name(obj), name));
  }
}

Value Renderer::get_item(const Value& obj, const Value& key) {
  if (obj.is(K::kUndefined)) undefined_error(obj);
  if (obj.is(K::kDict) && key.is(K::kString)) {
    if (const Value* v = dict_find(*obj.dict, key.s())) return *v;
  }
  if ((obj.is(K::kList) || obj.is(K::kString)) && is_integral(key)) {
    std::int64_t i = as_int(key);
    if (obj.is(K::kList)) {
      const auto n = static_cast<std::int64_t>(obj.list->size());
      if (i < 0) i += n;
      if (i >= 0 && i < n) return (*obj.list)[static_cast<std::size_t>(i)];
      return undefined(fmt::format("'list object' has no element {}", as_int(key)));
    }
    const std::u32string u = to_u32(obj.s());
    const auto n = static_cast<std::int64_t>(u.size());
    if (i < 0) i += n;
    if (i >= 0 && i < n) return str_v(from_u32(u.substr(static_cast<std::size_t>(i), 1)));
    return undefined(fmt::format("'str object' has no element {}", as_int(key)));
  }
  if (key.is(K::kString)) return get_attr(obj, key.s());
  return undefined(fmt::format("'{} object' has no element {}", type_name(obj), repr(key)));
}

// jinja2's attribute paths ("a.b", "items.0") for map/selectattr/sort/join.
Value Renderer::get_path(const Value& obj, const std::string& path) {
  Value v = obj;
  std::size_t start = 0;
  while (true) {
    const std::size_t dot = path.find('.', start);
    const std::string part =
        path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    std::int64_t index = 0;
    const bool numeric =
        !part.empty() && part.find_first_not_of("0123456789") == std::string::npos &&
        std::from_chars(part.data(), part.data() + part.size(), index).ec == std::errc();
    v = numeric ? get_item(v, int_v(index)) : get_item(v, str_v(part));
    if (dot == std::string::npos) return v;
    start = dot + 1;
  }
}

Value Renderer::slice(const Value& obj, const Expr* lo, const Expr* hi, const Expr* st) {
  auto bound = [&](const Expr* x, bool& present) -> std::int64_t {
    present = false;
    if (!x) return 0;
    const Value v = eval(*x);
    if (v.is(K::kNone)) return 0;
    if (!is_integral(v)) eval_fail("slice indices must be integers or None, not {}", type_name(v));
    present = true;
    return as_int(v);
  };
  bool has_lo, has_hi, has_st;
  std::int64_t a = bound(lo, has_lo), b = bound(hi, has_hi), step = bound(st, has_st);
  if (!has_st) step = 1;
  if (step == 0) eval_fail("slice step cannot be zero");
  if (obj.is(K::kUndefined)) undefined_error(obj);
  if (!obj.is(K::kList) && !obj.is(K::kString))
    return undefined(fmt::format("'{}' object is not subscriptable", type_name(obj)));
  std::u32string u;
  if (obj.is(K::kString)) u = to_u32(obj.s());
  const auto n = static_cast<std::int64_t>(obj.is(K::kList) ? obj.list->size() : u.size());
  auto clamp = [&](std::int64_t x, bool present, std::int64_t dflt) {
    if (!present) return dflt;
    if (x < 0) x += n;
    if (step > 0) return std::clamp<std::int64_t>(x, 0, n);
    return std::clamp<std::int64_t>(x, -1, n - 1);
  };
  a = clamp(a, has_lo, step > 0 ? 0 : n - 1);
  b = clamp(b, has_hi, step > 0 ? n : -1);
  List items;
  std::u32string chars;
  for (std::int64_t i = a; step > 0 ? i < b : i > b; i += step) {
    if (obj.is(K::kList)) {
      items.push_back((*obj.list)[static_cast<std::size_t>(i)]);
    } else {
      chars += u[static_cast<std::size_t>(i)];
    }
  }
  if (obj.is(K::kString)) return str_v(from_u32(chars));
  return list_v(std::move(items), obj.tuple);
}

// Python integers do not overflow; rather than wrap, refuse.
template <typename Op>
std::int64_t checked(Op op, std::int64_t a, std::int64_t b) {
  std::int64_t r = 0;
  if (op(a, b, &r)) eval_fail("integer overflow (Python would switch to a big integer)");
  return r;
}
bool add_ovf(std::int64_t a, std::int64_t b, std::int64_t* r) {
  return __builtin_add_overflow(a, b, r);
}
bool sub_ovf(std::int64_t a, std::int64_t b, std::int64_t* r) {
  return __builtin_sub_overflow(a, b, r);
}
bool mul_ovf(std::int64_t a, std::int64_t b, std::int64_t* r) {
  return __builtin_mul_overflow(a, b, r);
}

Value repeat(const Value& seq, std::int64_t times) {
  if (times <= 0) return seq.is(K::kString) ? str_v("") : list_v({}, seq.tuple);
  if (seq.is(K::kString)) {
    if (seq.s().size() * static_cast<std::size_t>(times) > kMaxOutputBytes ||
        times > static_cast<std::int64_t>(kMaxOutputBytes))
      eval_fail("string longer than {} bytes", kMaxOutputBytes);
    std::string out;
    for (std::int64_t i = 0; i < times; ++i) out += seq.s();
    return str_v(std::move(out));
  }
  if (seq.list->size() * static_cast<std::size_t>(times) > kMaxItems ||
      times > static_cast<std::int64_t>(kMaxItems))
    eval_fail("list longer than {} items", kMaxItems);
  List out;
  for (std::int64_t i = 0; i < times; ++i)
    out.insert(out.end(), seq.list->begin(), seq.list->end());
  return list_v(std::move(out), seq.tuple);
}

Value Renderer::binary(const std::string& op, const Value& a, const Value& b) {
  if (a.is(K::kUndefined)) undefined_error(a);
  if (b.is(K::kUndefined)) undefined_error(b);
  const bool nums = is_number(a) && is_number(b);
  const bool ints = is_integral(a) && is_integral(b);
  if (op == "+") {
    if (ints) return int_v(checked(add_ovf, as_int(a), as_int(b)));
    if (nums) return float_v(as_double(a) + as_double(b));
    if (a.is(K::kString) && b.is(K::kString)) return str_v(a.s() + b.s());
    if (a.is(K::kList) && b.is(K::kList)) {
      List items = *a.list;
      items.insert(items.end(), b.list->begin(), b.list->end());
      return list_v(std::move(items), a.tuple);
    }
  } else if (op == "-") {
    if (ints) return int_v(checked(sub_ovf, as_int(a), as_int(b)));
    if (nums) return float_v(as_double(a) - as_double(b));
  } else if (op == "*") {
    if (ints) return int_v(checked(mul_ovf, as_int(a), as_int(b)));
    if (nums) return float_v(as_double(a) * as_double(b));
    if ((a.is(K::kString) || a.is(K::kList)) && is_integral(b)) return repeat(a, as_int(b));
    if ((b.is(K::kString) || b.is(K::kList)) && is_integral(a)) return repeat(b, as_int(a));
  } else if (op == "/") {
    if (nums) {
      if (as_double(b) == 0) eval_fail("division by zero");
      return float_v(as_double(a) / as_double(b));
    }
  } else if (op == "//" || op == "%") {
    if (a.is(K::kString) && op == "%") eval_fail("string formatting with '%' is not supported");
    if (nums && as_double(b) == 0) eval_fail("integer division or modulo by zero");
    if (ints) {
      const std::int64_t x = as_int(a), y = as_int(b);
      if (x == INT64_MIN && y == -1) eval_fail("integer overflow");
      std::int64_t q = x / y, m = x % y;
      if (m != 0 && ((m < 0) != (y < 0))) --q, m += y;
      return int_v(op == "//" ? q : m);
    }
    if (nums) {
      const double x = as_double(a), y = as_double(b);
      double m = std::fmod(x, y);
      if (m != 0 && ((m < 0) != (y < 0))) m += y;
      return float_v(op == "//" ? std::floor((x - m) / y + 0.5) : m);
    }
  } else if (op == "**") {
    if (ints && as_int(b) >= 0) {
      std::int64_t base = as_int(a), result = 1;
      for (std::int64_t e = as_int(b); e > 0; --e) {
        result = checked(mul_ovf, result, base);
        if (result == 0 || result == 1) break;
      }
      return int_v(result);
    }
    if (nums) return float_v(std::pow(as_double(a), as_double(b)));
  }
  eval_fail("unsupported operand type(s) for {}: '{}' and '{}'", op, type_name(a), type_name(b));
}

bool Renderer::contains_op(const Value& container, const Value& item) {
  switch (container.kind) {
    case K::kUndefined:
      return false;
    case K::kString:
      if (!item.is(K::kString))
        eval_fail("'in <string>' requires string as left operand, not {}", type_name(item));
      return container.s().find(item.s()) != std::string::npos;
    case K::kList:
      return std::any_of(container.list->begin(), container.list->end(),
                         [&](const Value& v) { return py_eq(v, item); });
    case K::kDict:
      return item.is(K::kString) && dict_find(*container.dict, item.s()) != nullptr;
    default:
      eval_fail("argument of type '{}' is not iterable", type_name(container));
  }
}

bool Renderer::compare(const std::string& op, const Value& a, const Value& b) {
  if (op == "==") return py_eq(a, b);
  if (op == "!=") return !py_eq(a, b);
  if (op == "<") return py_lt(a, b);
  if (op == ">") return py_lt(b, a);
  if (op == "<=") return py_lt(a, b) || py_eq(a, b);
  if (op == ">=") return py_lt(b, a) || py_eq(a, b);
  if (op == "in") return contains_op(b, a);
  return !contains_op(b, a);  // "notin"
}

std::size_t py_len(const Value& v) {
  switch (v.kind) {
    case K::kUndefined:
      return 0;
    case K::kString:
      return cp_count(v.s());
    case K::kList:
      return v.list->size();
    case K::kDict:
      return v.dict->size();
    default:
      eval_fail("object of type '{}' has no len()", type_name(v));
  }
}

Value items_of(const Value& v) {
  if (v.is(K::kUndefined)) return list_v({});
  if (!v.is(K::kDict)) eval_fail("can only get item pairs from a mapping, not {}", type_name(v));
  List items;
  for (const auto& [k, x] : *v.dict) items.push_back(list_v({str_v(k), x}, true));
  return list_v(std::move(items));
}

Value round_value(const Value& v, std::int64_t precision, const std::string& method) {
  if (!is_number(v)) eval_fail("round expects a number, not {}", type_name(v));
  if (method != "common" && method != "ceil" && method != "floor")
    eval_fail("method must be 'common', 'ceil' or 'floor'");
  if (method == "common") {
    if (is_integral(v) && precision >= 0) return int_v(as_int(v));
    if (is_integral(v)) {  // round(15, -1) == 20: an int, ties to even
      if (precision < -18) return int_v(0);
      std::int64_t f = 1;
      for (std::int64_t k = 0; k < -precision; ++k) f *= 10;
      const std::int64_t x = as_int(v);
      std::int64_t q = x / f, r = x % f;
      if (r < 0) --q, r += f;
      if (2 * r > f || (2 * r == f && q % 2 != 0)) ++q;
      return int_v(checked(mul_ovf, q, f));
    }
    const double x = as_double(v);
    if (!std::isfinite(x)) return float_v(x);
    if (precision < 0 || precision > 300) {
      const double f = std::pow(10.0, static_cast<double>(-precision));
      return float_v(std::nearbyint(x / f) * f);
    }
    // printf rounds the exact binary value half-to-even, as Python's round() does.
    return float_v(std::strtod(fmt::format("{:.{}f}", x, precision).c_str(), nullptr));
  }
  const double f = std::pow(10.0, static_cast<double>(precision));
  const double x = as_double(v) * f;
  return float_v((method == "ceil" ? std::ceil(x) : std::floor(x)) / f);
}

std::string indent_text(const std::string& s, const Value* width, bool first, bool blank) {
  std::string ind = "    ";
  if (width && width->is(K::kString)) {
    ind = width->s();
  } else if (given(width)) {
    ind = std::string(
        static_cast<std::size_t>(std::max<std::int64_t>(0, int_arg(width, 4, "indent"))), ' ');
  }
  const std::vector<std::string> lines = py_splitlines(s + "\n", false);
  std::string rv;
  for (std::size_t i = 0; i < lines.size(); ++i) {
    if (i > 0) rv += "\n";
    if (i > 0 && (blank || !lines[i].empty())) rv += ind;
    rv += lines[i];
    if (rv.size() > kMaxOutputBytes) eval_fail("string longer than {} bytes", kMaxOutputBytes);
  }
  return first ? ind + rv : rv;
}

Value Renderer::filter(const std::string& name, const Value& v, CallArgs& a) {
  const std::string what = "filter '" + name + "'";
  if (name == "trim") {
    check_args(a, what, {"chars"});
    const Value* chars = arg(a, 0, "chars");
    if (!given(chars)) return str_v(std::string(py_strip(to_str(v), true, true, nullptr)));
    const std::u32string set = to_u32(str_arg(*chars, what));
    return str_v(std::string(py_strip(to_str(v), true, true, &set)));
  }
  if (name == "tojson") {
    check_args(a, what, {"ensure_ascii", "indent", "separators", "sort_keys"});
    JsonStyle st;
    if (const Value* x = arg(a, 0, "ensure_ascii")) st.ensure_ascii = truthy(*x);
    if (const Value* x = arg(a, 1, "indent"); given(x)) {
      st.indented = true;
      st.item_sep = ",";
      st.indent =
          x->is(K::kString)
              ? x->s()
              : std::string(
                    static_cast<std::size_t>(std::max<std::int64_t>(0, int_arg(x, 0, what))), ' ');
    }
    if (const Value* x = arg(a, 2, "separators"); given(x)) {
      if (!x->is(K::kList) || x->list->size() != 2)
        eval_fail("{}: separators must be a pair of strings", what);
      st.item_sep = str_arg((*x->list)[0], what);
      st.key_sep = str_arg((*x->list)[1], what);
    }
    if (const Value* x = arg(a, 3, "sort_keys")) st.sort_keys = truthy(*x);
    std::string out;
    dump_json(out, v, st, 0);
    return str_v(std::move(out));
  }
  if (name == "length" || name == "count") {
    check_args(a, what, {});
    return int_v(static_cast<std::int64_t>(py_len(v)));
  }
  if (name == "upper" || name == "lower" || name == "capitalize" || name == "title") {
    check_args(a, what, {});
    const std::string s = to_str(v);
    if (name == "upper") return str_v(map_chars(s, ascii_upper));
    if (name == "lower") return str_v(map_chars(s, ascii_lower));
    if (name == "capitalize") return str_v(py_capitalize(s));
    return str_v(jinja_title(s));
  }
  if (name == "replace") {
    check_args(a, what, {"old", "new", "count"});
    const Value* old = arg(a, 0, "old");
    const Value* repl = arg(a, 1, "new");
    if (!old || !repl) eval_fail("{} needs 'old' and 'new'", what);
    return str_v(
        py_replace(to_str(v), to_str(*old), to_str(*repl), int_arg(arg(a, 2, "count"), -1, what)));
  }
  if (name == "default" || name == "d") {
    check_args(a, what, {"default_value", "boolean"});
    const Value* boolean = arg(a, 1, "boolean");
    if (v.is(K::kUndefined) || (boolean && truthy(*boolean) && !truthy(v))) {
      const Value* d = arg(a, 0, "default_value");
      return d ? *d : str_v("");
    }
    return v;
  }
  if (name == "first" || name == "last") {
    check_args(a, what, {});
    const List items = iterate(v);
    if (items.empty()) return undefined(fmt::format("No {} item, sequence was empty.", name));
    return name == "first" ? items.front() : items.back();
  }
  if (name == "join") {
    check_args(a, what, {"d", "attribute"});
    const Value* d = arg(a, 0, "d");
    const std::string sep = d ? to_str(*d) : "";
    const Value* attr = arg(a, 1, "attribute");
    std::string out;
    bool first = true;
    for (const Value& item : iterate(v)) {
      if (!first) out += sep;
      first = false;
      out += to_str(given(attr) ? get_path(item, to_str(*attr)) : item);
      if (out.size() > kMaxOutputBytes) eval_fail("string longer than {} bytes", kMaxOutputBytes);
    }
    return str_v(std::move(out));
  }
  if (name == "list") {
    check_args(a, what, {});
    return list_v(iterate(v));
  }
  if (name == "string" || name == "safe") {
    check_args(a, what, {});
    return str_v(to_str(v));
  }
  if (name == "int") {
    check_args(a, what, {"default", "base"});
    const Value* d = arg(a, 0, "default");
    const Value fallback = d ? *d : int_v(0);
    if (int_arg(arg(a, 1, "base"), 10, what) != 10)
      eval_fail("{}: only base 10 is supported", what);
    if (is_integral(v)) return int_v(as_int(v));
    double x = 0;
    std::int64_t i = 0;
    if (v.is(K::kString) && parse_py_int(v.s(), i)) return int_v(i);
    if (v.is(K::kFloat)) {
      x = v.number;
    } else if (!v.is(K::kString) || !parse_py_float(v.s(), x)) {
      return fallback;
    }
    if (std::isnan(x)) return fallback;
    if (!std::isfinite(x) || std::fabs(x) >= 9.2e18)
      eval_fail("cannot convert {} to an integer", py_float(x));
    return int_v(static_cast<std::int64_t>(x));
  }
  if (name == "float") {
    check_args(a, what, {"default"});
    const Value* d = arg(a, 0, "default");
    if (is_number(v)) return float_v(as_double(v));
    double x = 0;
    if (v.is(K::kString) && parse_py_float(v.s(), x)) return float_v(x);
    return d ? *d : float_v(0.0);
  }
  if (name == "abs") {
    check_args(a, what, {});
    if (v.is(K::kFloat)) return float_v(std::fabs(v.number));
    if (!is_integral(v)) eval_fail("bad operand type for abs(): '{}'", type_name(v));
    if (as_int(v) == INT64_MIN) eval_fail("integer overflow");
    return int_v(std::llabs(as_int(v)));
  }
  if (name == "round") {
    check_args(a, what, {"precision", "method"});
    const Value* m = arg(a, 1, "method");
    return round_value(v, int_arg(arg(a, 0, "precision"), 0, what), m ? to_str(*m) : "common");
  }
  if (name == "items") {
    check_args(a, what, {});
    return items_of(v);
  }
  if (name == "indent") {
    check_args(a, what, {"width", "first", "blank"});
    const Value* first = arg(a, 1, "first");
    const Value* blank = arg(a, 2, "blank");
    return str_v(indent_text(to_str(v), arg(a, 0, "width"), first && truthy(*first),
                             blank && truthy(*blank)));
  }
  if (name == "reverse") {
    check_args(a, what, {});
    if (v.is(K::kString)) {
      std::u32string u = to_u32(v.s());
      std::reverse(u.begin(), u.end());
      return str_v(from_u32(u));
    }
    List items = iterate(v);
    std::reverse(items.begin(), items.end());
    return list_v(std::move(items));
  }
  if (name == "sum") {
    check_args(a, what, {"attribute", "start"});
    const Value* attr = arg(a, 0, "attribute");
    const Value* start = arg(a, 1, "start");
    Value total = start ? *start : int_v(0);
    for (const Value& item : iterate(v))
      total = binary("+", total, given(attr) ? get_path(item, to_str(*attr)) : item);
    return total;
  }
  if (name == "sort" || name == "unique" || name == "dictsort" || name == "min" || name == "max")
    return filter_sort(name, v, a);
  return filter_select(name, v, a);
}

// selectattr, rejectattr, select, reject, map.
Value Renderer::filter_select(const std::string& name, const Value& v, CallArgs& a) {
  List out;
  if (name == "map") {
    const Value* attr = arg(a, 1000, "attribute");
    if (attr) {
      const Value* dflt = arg(a, 1000, "default");
      for (const Value& item : iterate(v)) {
        Value x = get_path(item, to_str(*attr));
        out.push_back(x.is(K::kUndefined) && dflt ? *dflt : x);
      }
      return list_v(std::move(out));
    }
    if (a.pos.empty()) eval_fail("map requires a filter name or attribute=");
    const std::string fname = to_str(a.pos[0]);
    if (!contains(known_filters(), fname)) eval_fail("filter '{}' is not supported", fname);
    CallArgs rest;
    rest.pos.assign(a.pos.begin() + 1, a.pos.end());
    rest.kw = a.kw;
    for (const Value& item : iterate(v)) out.push_back(filter(fname, item, rest));
    return list_v(std::move(out));
  }
  const bool by_attr = name == "selectattr" || name == "rejectattr";
  const bool keep_if = name == "select" || name == "selectattr";
  if (by_attr && a.pos.empty()) eval_fail("{} requires an attribute name", name);
  const std::size_t test_at = by_attr ? 1 : 0;
  std::string tname;
  CallArgs targs;
  if (a.pos.size() > test_at) {
    tname = to_str(a.pos[test_at]);
    if (!contains(known_tests(), tname)) eval_fail("test '{}' is not supported", tname);
    targs.pos.assign(a.pos.begin() + static_cast<std::ptrdiff_t>(test_at) + 1, a.pos.end());
  }
  for (const Value& item : iterate(v)) {
    step();
    const Value x = by_attr ? get_path(item, to_str(a.pos[0])) : item;
    const bool ok = tname.empty() ? truthy(x) : test(tname, x, targs);
    if (ok == keep_if) out.push_back(item);
  }
  return list_v(std::move(out));
}

// sort, unique, dictsort: keys compared case-insensitively unless asked otherwise.
Value Renderer::filter_sort(const std::string& name, const Value& v, CallArgs& a) {
  const std::string what = "filter '" + name + "'";
  if (name == "dictsort") {
    check_args(a, what, {"case_sensitive", "by", "reverse"});
  } else if (name == "sort") {
    check_args(a, what, {"reverse", "case_sensitive", "attribute"});
  } else {  // unique, min, max
    check_args(a, what, {"case_sensitive", "attribute"});
  }
  const Value* cs = name == "sort" ? arg(a, 1, "case_sensitive") : arg(a, 0, "case_sensitive");
  const bool case_sensitive = cs && truthy(*cs);
  const Value* rev = name == "sort"       ? arg(a, 0, "reverse")
                     : name == "dictsort" ? arg(a, 2, "reverse")
                                          : nullptr;
  const bool reverse = rev && truthy(*rev);
  const Value* attr = name == "sort"       ? arg(a, 2, "attribute")
                      : name == "dictsort" ? nullptr
                                           : arg(a, 1, "attribute");
  std::size_t by_index = 0;
  if (name == "dictsort") {
    const Value* by = arg(a, 1, "by");
    const std::string b = by ? to_str(*by) : "key";
    if (b != "key" && b != "value") eval_fail("You can only sort by either 'key' or 'value'");
    by_index = b == "value";
  }
  List items = name == "dictsort" ? *items_of(v).list : iterate(v);
  auto key_of = [&](const Value& item) {
    Value k = name == "dictsort" ? (*item.list)[by_index]
              : given(attr)      ? get_path(item, to_str(*attr))
                                 : item;
    if (!case_sensitive && k.is(K::kString)) return str_v(map_chars(k.s(), ascii_lower));
    return k;
  };
  if (name == "unique") {
    List out, seen;
    for (const Value& item : items) {
      const Value k = key_of(item);
      if (std::none_of(seen.begin(), seen.end(), [&](const Value& s) { return py_eq(s, k); })) {
        seen.push_back(k);
        out.push_back(item);
      }
    }
    return list_v(std::move(out));
  }
  if (name == "min" || name == "max") {
    const Value* best = nullptr;
    Value best_key;
    for (const Value& item : items) {
      Value k = key_of(item);
      if (!best || (name == "min" ? py_lt(k, best_key) : py_lt(best_key, k)))
        best = &item, best_key = std::move(k);
    }
    return best ? *best : undefined("No aggregated item, sequence was empty.");
  }
  std::vector<std::pair<Value, Value>> keyed;
  for (const Value& item : items) keyed.emplace_back(key_of(item), item);
  std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& x, const auto& y) {
    return reverse ? py_lt(y.first, x.first) : py_lt(x.first, y.first);
  });
  List out;
  for (auto& [k, item] : keyed) out.push_back(std::move(item));
  return list_v(std::move(out));
}

bool cased_all(std::string_view s, bool upper) {
  bool any = false;
  for (std::size_t i = 0; i < s.size();) {
    const char32_t c = next_cp(s, i);
    if (!ascii_alpha(c)) continue;
    any = true;
    if (upper ? (c >= 'a' && c <= 'z') : (c >= 'A' && c <= 'Z')) return false;
  }
  return any;
}

bool Renderer::test(const std::string& name, const Value& v, const CallArgs& a) {
  auto other = [&]() -> const Value& {
    if (a.pos.empty()) eval_fail("test '{}' needs an argument", name);
    return a.pos[0];
  };
  if (name == "defined") return !v.is(K::kUndefined);
  if (name == "undefined") return v.is(K::kUndefined);
  if (name == "none") return v.is(K::kNone);
  if (name == "boolean") return v.is(K::kBool);
  if (name == "true") return v.is(K::kBool) && v.boolean;
  if (name == "false") return v.is(K::kBool) && !v.boolean;
  if (name == "integer") return v.is(K::kInt);
  if (name == "float") return v.is(K::kFloat);
  if (name == "number") return is_number(v);
  if (name == "string") return v.is(K::kString);
  if (name == "mapping") return v.is(K::kDict);
  if (name == "iterable" || name == "sequence")
    return v.is(K::kString) || v.is(K::kList) || v.is(K::kDict) || v.is(K::kUndefined);
  if (name == "callable") return v.is(K::kFunction) || v.is(K::kUndefined);
  if (name == "even" || name == "odd" || name == "divisibleby") {
    if (v.is(K::kUndefined)) undefined_error(v);
    const std::int64_t d = name == "divisibleby" ? int_arg(&other(), 1, "divisibleby") : 2;
    if (!is_number(v)) eval_fail("test '{}' needs a number, not {}", name, type_name(v));
    if (d == 0) eval_fail("integer division or modulo by zero");
    const Value m = binary("%", v, int_v(d));
    const bool zero = as_double(m) == 0;
    return name == "odd" ? !zero : zero;
  }
  if (name == "eq" || name == "equalto" || name == "==") return py_eq(v, other());
  if (name == "ne" || name == "!=") return !py_eq(v, other());
  if (name == "lt" || name == "<" || name == "lessthan") return py_lt(v, other());
  if (name == "le" || name == "<=") return py_lt(v, other()) || py_eq(v, other());
  if (name == "gt" || name == ">" || name == "greaterthan") return py_lt(other(), v);
  if (name == "ge" || name == ">=") return py_lt(other(), v) || py_eq(v, other());
  if (name == "in") return contains_op(other(), v);
  if (name == "sameas") {
    const Value& o = other();
    if (v.kind != o.kind) return false;
    switch (v.kind) {
      case K::kNone:
        return true;
      case K::kBool:
        return v.boolean == o.boolean;
      case K::kInt:
        return v.integer == o.integer;
      case K::kList:
        return v.list == o.list;
      case K::kDict:
      case K::kNamespace:
        return v.dict == o.dict;
      case K::kString:
        return v.str == o.str;
      default:
        return false;
    }
  }
  if (name == "lower" || name == "upper") return cased_all(to_str(v), name == "upper");
  eval_fail("test '{}' is not supported", name);
}

Value Renderer::call_method(const Value& obj, const std::string& name, CallArgs& a) {
  const std::string what = std::string(type_name(obj)) + "." + name + "()";
  if (obj.is(K::kString)) return str_method(obj.s(), name, a);
  if (name == "get") {
    check_args(a, what, {"key", "default"});
    const Value* key = arg(a, 0, "key");
    if (!key) eval_fail("{} needs a key", what);
    if (key->is(K::kString)) {
      if (const Value* v = dict_find(*obj.dict, key->s())) return *v;
    }
    const Value* d = arg(a, 1, "default");
    return d ? *d : none_v();
  }
  check_args(a, what, {});
  if (name == "items") return items_of(obj);
  List out;
  for (const auto& [k, v] : *obj.dict) out.push_back(name == "keys" ? str_v(k) : v);
  return list_v(std::move(out));
}

Value Renderer::str_method(const std::string& s, const std::string& name, CallArgs& a) {
  const std::string what = "str." + name + "()";
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    check_args(a, what, {"chars"});
    const Value* chars = arg(a, 0, "chars");
    const bool left = name != "rstrip", right = name != "lstrip";
    if (!given(chars)) return str_v(std::string(py_strip(s, left, right, nullptr)));
    const std::u32string set = to_u32(str_arg(*chars, what));
    return str_v(std::string(py_strip(s, left, right, &set)));
  }
  if (name == "split" || name == "rsplit") {
    check_args(a, what, {"sep", "maxsplit"});
    const Value* sep = arg(a, 0, "sep");
    return list_v(py_split(s, sep ? *sep : none_v(), int_arg(arg(a, 1, "maxsplit"), -1, what),
                           name == "rsplit"));
  }
  if (name == "splitlines") {
    check_args(a, what, {"keepends"});
    const Value* keep = arg(a, 0, "keepends");
    List out;
    for (std::string& line : py_splitlines(s, keep && truthy(*keep)))
      out.push_back(str_v(std::move(line)));
    return list_v(std::move(out));
  }
  if (name == "startswith" || name == "endswith") {
    check_args(a, what, {"prefix"});
    const Value* p = arg(a, 0, "prefix");
    if (!p) eval_fail("{} takes one argument", what);
    const List options = p->is(K::kList) ? *p->list : List{*p};
    for (const Value& o : options) {
      const std::string x = str_arg(o, what);
      const bool hit = name == "startswith" ? s.compare(0, x.size(), x) == 0
                                            : s.size() >= x.size() &&
                                                  s.compare(s.size() - x.size(), x.size(), x) == 0;
      if (hit) return bool_v(true);
    }
    return bool_v(false);
  }
  if (name == "upper" || name == "lower" || name == "title" || name == "capitalize") {
    check_args(a, what, {});
    if (name == "upper") return str_v(map_chars(s, ascii_upper));
    if (name == "lower") return str_v(map_chars(s, ascii_lower));
    if (name == "title") return str_v(py_title_method(s));
    return str_v(py_capitalize(s));
  }
  if (name == "replace") {
    check_args(a, what, {"old", "new", "count"});
    if (a.pos.size() < 2) eval_fail("{} takes at least 2 arguments", what);
    return str_v(py_replace(s, str_arg(a.pos[0], what), str_arg(a.pos[1], what),
                            int_arg(arg(a, 2, "count"), -1, what)));
  }
  if (name == "find" || name == "rfind" || name == "count") {
    check_args(a, what, {"sub"});
    if (a.pos.empty()) eval_fail("{} takes one argument", what);
    const std::string sub = str_arg(a.pos[0], what);
    if (name == "count") {
      if (sub.empty()) return int_v(static_cast<std::int64_t>(cp_count(s)) + 1);
      std::int64_t n = 0;
      for (std::size_t p = s.find(sub); p != std::string::npos; p = s.find(sub, p + sub.size()))
        ++n;
      return int_v(n);
    }
    const std::size_t p = name == "find" ? s.find(sub) : s.rfind(sub);
    return int_v(p == std::string::npos ? -1 : cp_index(s, p));
  }
  if (name == "join") {
    check_args(a, what, {"iterable"});
    if (a.pos.empty()) eval_fail("{} takes one argument", what);
    std::string out;
    bool first = true;
    for (const Value& item : iterate(a.pos[0])) {
      if (!first) out += s;
      first = false;
      out += str_arg(item, what);
      if (out.size() > kMaxOutputBytes) eval_fail("string longer than {} bytes", kMaxOutputBytes);
    }
    return str_v(std::move(out));
  }
  check_args(a, what, {});
  if (name == "isupper" || name == "islower") return bool_v(cased_all(s, name == "isupper"));
  if (s.empty()) return bool_v(false);
  const std::u32string u = to_u32(s);
  auto all = [&](auto pred) { return bool_v(std::all_of(u.begin(), u.end(), pred)); };
  if (name == "isdigit") return all(ascii_digit);
  if (name == "isalpha") return all(ascii_alpha);
  if (name == "isalnum") return all([](char32_t c) { return ascii_alpha(c) || ascii_digit(c); });
  return all(py_space);  // isspace
}

}  // namespace

Template::Template(std::shared_ptr<const detail::Program> program) : program_(std::move(program)) {}

Template Template::parse(std::string_view source, const std::string& name) {
  auto program = std::make_shared<detail::Program>();
  program->name = name;
  try {
    Parser parser(Lexer(source, name).run(), name);
    program->body = parser.run();
  } catch (const EvalError& e) {  // a literal too large for the value limits
    fail_input("{}: {}", name, e.message);
  }
  return Template(std::move(program));
}

std::string Template::render(const nlohmann::json& context) const {
  return render(context, Functions{});
}

std::string Template::render(const nlohmann::json& context, const Functions& functions) const {
  return Renderer(*program_, &functions).run(context);
}

std::string Template::render_ordered(const nlohmann::ordered_json& context,
                                     const Functions& functions) const {
  return Renderer(*program_, &functions).run(context);
}

const std::string& Template::name() const {
  return program_->name;
}

}  // namespace strata::jinja
