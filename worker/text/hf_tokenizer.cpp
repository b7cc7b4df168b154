// Hugging Face `tokenizers` semantics, re-implemented from its documented behaviour and source
// (huggingface/tokenizers 0.23): added tokens are cut out of the raw text first, every other
// segment goes normalizer -> pre-tokenizer -> BPE, and the post-processor wraps the result.
// Each component reproduces the library's quirks where they change ids (see docs/TEXT.md).
#include "worker/text/hf_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <charconv>
#include <cstring>
#include <nlohmann/json.hpp>
#include <unordered_map>
#include <utility>

#include "kernels/error.h"

namespace strata {
namespace {

using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------
// UTF-8

// Length of the well-formed sequence at p (n > 0 bytes left), or 0 with *bad = the length of the
// maximal invalid subpart: the unit Rust's from_utf8_lossy replaces by one U+FFFD.
size_t utf8_sequence(const unsigned char* p, size_t n, size_t* bad) {
  const unsigned char c = p[0];
  if (c < 0x80) return 1;
  size_t want = 0;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    want = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    want = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    want = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    *bad = 1;
    return 0;
  }
  for (size_t k = 1; k < want; ++k) {
    const unsigned char min = k == 1 ? lo : 0x80, max = k == 1 ? hi : 0xBF;
    if (k >= n || p[k] < min || p[k] > max) {
      *bad = k;
      return 0;
    }
  }
  return want;
}

// Offset of the first byte that is not valid UTF-8, or npos.
size_t first_invalid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t i = 0, bad = 0;
  while (i < s.size()) {
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    const size_t len = utf8_sequence(p + i, s.size() - i, &bad);
    if (len == 0) return i;
    i += len;
  }
  return std::string_view::npos;
}

std::string utf8_lossy(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  std::string out;
  out.reserve(s.size());
  size_t i = 0, bad = 0;
  while (i < s.size()) {
    const size_t len = utf8_sequence(p + i, s.size() - i, &bad);
    if (len == 0) {
      out += "\xEF\xBF\xBD";
      i += bad;
    } else {
      out.append(s.data() + i, len);
      i += len;
    }
  }
  return out;
}

size_t utf8_len(unsigned char lead) {
  if (lead < 0x80) return 1;
  if (lead < 0xE0) return 2;
  if (lead < 0xF0) return 3;
  return 4;
}

// Decodes the code point at s[i] of valid UTF-8; *len receives its byte length.
char32_t decode_utf8(std::string_view s, size_t i, size_t* len) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data()) + i;
  *len = utf8_len(p[0]);
  switch (*len) {
    case 1:
      return p[0];
    case 2:
      return (char32_t(p[0] & 0x1F) << 6) | (p[1] & 0x3F);
    case 3:
      return (char32_t(p[0] & 0x0F) << 12) | (char32_t(p[1] & 0x3F) << 6) | (p[2] & 0x3F);
    default:
      return (char32_t(p[0] & 0x07) << 18) | (char32_t(p[1] & 0x3F) << 12) |
             (char32_t(p[2] & 0x3F) << 6) | (p[3] & 0x3F);
  }
}

void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out += char(c);
  } else if (c < 0x800) {
    out += char(0xC0 | (c >> 6));
    out += char(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += char(0xE0 | (c >> 12));
    out += char(0x80 | ((c >> 6) & 0x3F));
    out += char(0x80 | (c & 0x3F));
  } else {
    out += char(0xF0 | (c >> 18));
    out += char(0x80 | ((c >> 12) & 0x3F));
    out += char(0x80 | ((c >> 6) & 0x3F));
    out += char(0x80 | (c & 0x3F));
  }
}

std::string utf8_of(char32_t c) {
  std::string s;
  append_utf8(s, c);
  return s;
}

// Rust's char::is_whitespace: the Unicode White_Space property.
bool is_white_space(char32_t c) {
  return (c >= 0x9 && c <= 0xD) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

// Rust's char::is_numeric: general categories Nd, Nl, No.
bool is_numeric(char32_t c) {
  const auto cat = utf8proc_category(utf8proc_int32_t(c));
  return cat == UTF8PROC_CATEGORY_ND || cat == UTF8PROC_CATEGORY_NL || cat == UTF8PROC_CATEGORY_NO;
}

// Rust regex's \w (approximated by category: Alphabetic is L + Nl + most marks).
bool is_word_char(char32_t c) {
  if (c == 0x200C || c == 0x200D) return true;
  switch (utf8proc_category(utf8proc_int32_t(c))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
}

char32_t last_char(std::string_view s) {
  size_t i = s.size();
  while (i > 0 && (static_cast<unsigned char>(s[i - 1]) & 0xC0) == 0x80) --i;
  size_t len = 0;
  return i == 0 ? 0 : decode_utf8(s, i - 1, &len);
}

// Byte offset where the trailing run of white space of `s` starts.
size_t trailing_space_start(std::string_view s) {
  size_t i = s.size();
  while (i > 0) {
    size_t j = i - 1;
    while (j > 0 && (static_cast<unsigned char>(s[j]) & 0xC0) == 0x80) --j;
    size_t len = 0;
    if (!is_white_space(decode_utf8(s, j, &len))) break;
    i = j;
  }
  return i;
}

size_t leading_space_end(std::string_view s) {
  size_t i = 0, len = 0;
  while (i < s.size() && is_white_space(decode_utf8(s, i, &len))) i += len;
  return i;
}

// ---------------------------------------------------------------------------------------------
// JSON access that names the field at fault.

struct Json {
  const std::string& source;

  [[noreturn]] void fail(const std::string& path, const std::string& what) const {
    fail_input("{}: {} {}", source, path, what);
  }
  // Null when the key is absent or null.
  static const json* opt(const json& obj, const char* key) {
    auto it = obj.find(key);
    return it == obj.end() || it->is_null() ? nullptr : &*it;
  }
  const json& need(const json& obj, const std::string& path, const char* key) const {
    const json* v = opt(obj, key);
    if (v == nullptr) fail(path + "." + key, "is missing");
    return *v;
  }
  std::string str(const json& v, const std::string& path) const {
    if (!v.is_string()) fail(path, fmt::format("must be a string (got {})", v.type_name()));
    return v.get<std::string>();
  }
  std::string str(const json& obj, const std::string& path, const char* key) const {
    return str(need(obj, path, key), path + "." + key);
  }
  std::optional<std::string> opt_str(const json& obj, const std::string& path,
                                     const char* key) const {
    const json* v = opt(obj, key);
    if (v == nullptr) return std::nullopt;
    return str(*v, path + "." + key);
  }
  bool flag(const json& obj, const std::string& path, const char* key, bool dflt) const {
    const json* v = opt(obj, key);
    if (v == nullptr) return dflt;
    if (!v->is_boolean()) {
      fail(path + "." + key, fmt::format("must be a boolean (got {})", v->type_name()));
    }
    return v->get<bool>();
  }
  int64_t integer(const json& v, const std::string& path, int64_t max) const {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > max) {
      fail(path, fmt::format("must be an integer in [0, {}] (got {})", max, v.dump()));
    }
    return v.get<int64_t>();
  }
  const json& array(const json& obj, const std::string& path, const char* key) const {
    const json& v = need(obj, path, key);
    if (!v.is_array()) fail(path + "." + key, "must be an array");
    return v;
  }
  std::string type(const json& obj, const std::string& path) const {
    if (!obj.is_object()) fail(path, "must be an object or null");
    return str(obj, path, "type");
  }
  [[noreturn]] void unsupported(const std::string& path, const std::string& what,
                                const char* supported) const {
    fail(path, fmt::format("'{}' is not supported (supported: {})", what, supported));
  }
  char32_t single_char(const json& obj, const std::string& path, const char* key) const {
    const std::string s = str(obj, path, key);
    size_t len = 0;
    const char32_t c = s.empty() ? 0 : decode_utf8(s, 0, &len);
    if (s.empty() || first_invalid_utf8(s) != std::string_view::npos || len != s.size()) {
      fail(path + "." + key, fmt::format("must be a single character (got '{}')", s));
    }
    return c;
  }
};

// Ids beyond this are refused: id -> token tables are dense.
constexpr int64_t kMaxId = (int64_t{1} << 24) - 1;

// ---------------------------------------------------------------------------------------------
// Regular expressions (PCRE2 with UTF + UCP stands in for the Oniguruma the library uses).

struct PcreThreadState {
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  pcre2_jit_stack* stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
  PcreThreadState() { pcre2_jit_stack_assign(context, nullptr, stack); }
  ~PcreThreadState() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
  PcreThreadState(const PcreThreadState&) = delete;
  PcreThreadState& operator=(const PcreThreadState&) = delete;
};

// Match data and JIT stack are per thread, so encode() can run on many threads at once.
PcreThreadState& pcre_state() {
  thread_local PcreThreadState state;
  return state;
}

class Regex {
 public:
  Regex(const std::string& pattern, const Json& js, const std::string& path) {
    int err = 0;
    PCRE2_SIZE offset = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                          PCRE2_UTF | PCRE2_UCP, &err, &offset, nullptr);
    if (code_ == nullptr) {
      std::array<PCRE2_UCHAR, 256> msg{};
      pcre2_get_error_message(err, msg.data(), msg.size());
      js.fail(path, fmt::format("regex '{}' does not compile at offset {}: {}", pattern, offset,
                                reinterpret_cast<const char*>(msg.data())));
    }
    jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // The leftmost match at or after `from` (in the whole text, so lookarounds see context).
  bool find(std::string_view text, size_t from, size_t* start, size_t* end) const {
    PcreThreadState& st = pcre_state();
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    const int rc = jit_ ? pcre2_jit_match(code_, subject, text.size(), from, 0, st.data, st.context)
                        : pcre2_match(code_, subject, text.size(), from, PCRE2_NO_UTF_CHECK,
                                      st.data, st.context);
    if (rc == PCRE2_ERROR_NOMATCH) return false;
    if (rc < 0) {
      std::array<PCRE2_UCHAR, 256> msg{};
      pcre2_get_error_message(rc, msg.data(), msg.size());
      fail(ErrorKind::kFailed, "tokenizer regex match failed: {}",
           reinterpret_cast<const char*>(msg.data()));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(st.data);
    *start = ov[0];
    *end = ov[1];
    return true;
  }

 private:
  pcre2_code* code_ = nullptr;
  bool jit_ = false;
};

// ---------------------------------------------------------------------------------------------
// Patterns and splitting, as NormalizedString::split.

struct Span {
  size_t start, end;
  bool match;
};

class Pattern {
 public:
  static Pattern literal(std::string s) {
    Pattern p;
    p.literal_ = std::move(s);
    return p;
  }
  static Pattern regex(std::shared_ptr<const Regex> re) {
    Pattern p;
    p.regex_ = std::move(re);
    return p;
  }
  static Pattern predicate(bool (*pred)(char32_t)) {
    Pattern p;
    p.pred_ = pred;
    return p;
  }
  // {"String": "..."} or {"Regex": "..."}.
  static Pattern from_json(const json& v, const Json& js, const std::string& path) {
    if (!v.is_object()) js.fail(path, "must be an object {\"String\": ...} or {\"Regex\": ...}");
    if (const json* s = Json::opt(v, "String")) return literal(js.str(*s, path + ".String"));
    if (const json* r = Json::opt(v, "Regex")) {
      return regex(std::make_shared<Regex>(js.str(*r, path + ".Regex"), js, path + ".Regex"));
    }
    js.fail(path, "must be {\"String\": ...} or {\"Regex\": ...}");
  }

  // Spans covering all of `text`, each flagged whether it matched.
  void find_matches(std::string_view text, std::vector<Span>& out) const {
    out.clear();
    if (text.empty()) {
      out.push_back({0, 0, false});
    } else if (pred_ != nullptr) {
      find_chars(text, out);
    } else if (regex_ == nullptr && literal_.empty()) {
      out.push_back({0, text.size(), false});
    } else {
      find_substrings(text, out);
    }
  }

 private:
  // Each matching character is a match of its own; the runs between them are merged.
  void find_chars(std::string_view text, std::vector<Span>& out) const {
    size_t last = 0, len = 0;
    for (size_t i = 0; i < text.size(); i += len) {
      if (!pred_(decode_utf8(text, i, &len))) continue;
      if (last < i) out.push_back({last, i, false});
      out.push_back({i, i + len, true});
      last = i + len;
    }
    if (last < text.size()) out.push_back({last, text.size(), false});
  }
  void find_substrings(std::string_view text, std::vector<Span>& out) const {
    size_t prev = 0, from = 0, start = 0, end = 0;
    while (from <= text.size() && next(text, from, &start, &end)) {
      if (end == start) {  // an empty match yields no piece; step past it
        size_t len = 1;
        if (start < text.size()) decode_utf8(text, start, &len);
        from = start + len;
        continue;
      }
      if (prev != start) out.push_back({prev, start, false});
      out.push_back({start, end, true});
      prev = from = end;
    }
    if (prev != text.size()) out.push_back({prev, text.size(), false});
  }
  bool next(std::string_view text, size_t from, size_t* start, size_t* end) const {
    if (regex_ != nullptr) return regex_->find(text, from, start, end);
    const size_t at = text.find(literal_, from);
    if (at == std::string_view::npos) return false;
    *start = at;
    *end = at + literal_.size();
    return true;
  }

  std::string literal_;
  std::shared_ptr<const Regex> regex_;
  bool (*pred_)(char32_t) = nullptr;
};

enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

Behavior behavior_from_json(const json& obj, const Json& js, const std::string& path) {
  const std::string b = js.str(obj, path, "behavior");
  if (b == "Removed") return Behavior::kRemoved;
  if (b == "Isolated") return Behavior::kIsolated;
  if (b == "MergedWithPrevious") return Behavior::kMergedWithPrevious;
  if (b == "MergedWithNext") return Behavior::kMergedWithNext;
  if (b == "Contiguous") return Behavior::kContiguous;
  js.unsupported(path + ".behavior", b,
                 "Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous");
}

struct Range {
  size_t start, end;
};

// Folds matches into pieces per the behaviour; the library's fold keeps a match at the very
// start (or end, for MergedWithNext) as its own piece when there is nothing to merge into.
void fold_spans(const std::vector<Span>& m, Behavior b, std::vector<Range>& out) {
  bool prev = false;
  switch (b) {
    case Behavior::kIsolated:
      for (const Span& s : m) out.push_back({s.start, s.end});
      break;
    case Behavior::kRemoved:
      for (const Span& s : m) {
        if (!s.match) out.push_back({s.start, s.end});
      }
      break;
    case Behavior::kContiguous:
      for (const Span& s : m) {
        if (s.match == prev && !out.empty()) {
          out.back().end = s.end;
        } else {
          out.push_back({s.start, s.end});
        }
        prev = s.match;
      }
      break;
    case Behavior::kMergedWithPrevious:
      for (const Span& s : m) {
        if (s.match && !prev && !out.empty()) {
          out.back().end = s.end;
        } else {
          out.push_back({s.start, s.end});
        }
        prev = s.match;
      }
      break;
    case Behavior::kMergedWithNext: {
      const size_t first = out.size();
      for (auto it = m.rbegin(); it != m.rend(); ++it) {
        if (it->match && !prev && out.size() > first) {
          out.back().start = it->start;
        } else {
          out.push_back({it->start, it->end});
        }
        prev = it->match;
      }
      std::reverse(out.begin() + static_cast<std::ptrdiff_t>(first), out.end());
      break;
    }
  }
}

// Non-empty pieces of `text`.
void split_ranges(std::string_view text, const Pattern& p, Behavior b, bool invert,
                  std::vector<Range>& out) {
  thread_local std::vector<Span> spans;
  p.find_matches(text, spans);
  if (invert) {
    for (Span& s : spans) s.match = !s.match;
  }
  out.clear();
  fold_spans(spans, b, out);
  std::erase_if(out, [](const Range& r) { return r.start == r.end; });
}

void replace_all(std::string& s, const Pattern& p, std::string_view content) {
  thread_local std::vector<Span> spans;
  p.find_matches(s, spans);
  if (std::none_of(spans.begin(), spans.end(), [](const Span& x) { return x.match; })) return;
  std::string out;
  out.reserve(s.size());
  for (const Span& x : spans) {
    if (x.match) {
      out += content;
    } else {
      out.append(s, x.start, x.end - x.start);
    }
  }
  s = std::move(out);
}

// ---------------------------------------------------------------------------------------------
// Normalizers

struct Normalizer {
  virtual ~Normalizer() = default;
  virtual void apply(std::string& s) const = 0;
  // True when every printable ASCII byte (0x21-0x7e) of the input leaves at least one byte
  // in the output: what HfTokenizer::max_token_bytes's bound needs. Whitespace may go
  // (Strip), characters may compose (a letter and its accent) or change case, but none of
  // these drops a printable ASCII character; a Replace may remove anything.
  virtual bool keeps_printable_ascii() const { return true; }
};

// A `Sequence` of any one kind of component (normalizer, pre-tokenizer, decoder): its parts
// in order, on the same value.
template <class Component, class Value>
class SequenceOf final : public Component {
 public:
  explicit SequenceOf(std::vector<std::unique_ptr<Component>> parts) : parts_(std::move(parts)) {}
  void apply(Value& value) const override {
    for (const auto& p : parts_) p->apply(value);
  }

 private:
  std::vector<std::unique_ptr<Component>> parts_;
};

class SequenceNormalizer final : public Normalizer {
 public:
  explicit SequenceNormalizer(std::vector<std::unique_ptr<Normalizer>> parts)
      : parts_(std::move(parts)) {}
  void apply(std::string& s) const override {
    for (const auto& p : parts_) p->apply(s);
  }
  bool keeps_printable_ascii() const override {
    return std::all_of(parts_.begin(), parts_.end(),
                       [](const auto& p) { return p->keeps_printable_ascii(); });
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> parts_;
};

class UnicodeNormalizer : public Normalizer {
 public:
  explicit UnicodeNormalizer(utf8proc_option_t options) : options_(options) {}
  void apply(std::string& s) const override {
    // Every normalization form leaves ASCII alone.
    if (std::all_of(s.begin(), s.end(), [](char c) { return (c & 0x80) == 0; })) return;
    utf8proc_uint8_t* out = nullptr;
    const utf8proc_ssize_t n =
        utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                     static_cast<utf8proc_ssize_t>(s.size()), &out, options_);
    if (n < 0) fail_input("unicode normalization failed: {}", utf8proc_errmsg(n));
    s.assign(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
    std::free(out);
  }

 private:
  utf8proc_option_t options_;
};

class LowercaseNormalizer : public Normalizer {
 public:
  void apply(std::string& s) const override {
    std::string out;
    out.reserve(s.size());
    size_t len = 0;
    for (size_t i = 0; i < s.size(); i += len) {
      const char32_t c = decode_utf8(s, i, &len);
      if (c == 0x130) {  // the one unconditional multi-character lowercase mapping
        out += "i\xCC\x87";
      } else {
        append_utf8(out, char32_t(utf8proc_tolower(utf8proc_int32_t(c))));
      }
    }
    s = std::move(out);
  }
};

class ReplaceNormalizer : public Normalizer {
 public:
  ReplaceNormalizer(Pattern p, std::string content)
      : pattern_(std::move(p)), content_(std::move(content)) {}
  void apply(std::string& s) const override { replace_all(s, pattern_, content_); }
  bool keeps_printable_ascii() const override { return false; }

 private:
  Pattern pattern_;
  std::string content_;
};

class PrependNormalizer : public Normalizer {
 public:
  explicit PrependNormalizer(std::string prefix) : prefix_(std::move(prefix)) {}
  void apply(std::string& s) const override {
    if (!s.empty()) s.insert(0, prefix_);
  }

 private:
  std::string prefix_;
};

class StripNormalizer : public Normalizer {
 public:
  StripNormalizer(bool left, bool right) : left_(left), right_(right) {}
  void apply(std::string& s) const override {
    if (right_) s.resize(trailing_space_start(s));
    if (left_) s.erase(0, leading_space_end(s));
  }

 private:
  bool left_, right_;
};

std::unique_ptr<Normalizer> make_normalizer(const json& v, const Json& js,
                                            const std::string& path) {
  const std::string type = js.type(v, path);
  if (type == "Sequence") {
    std::vector<std::unique_ptr<Normalizer>> parts;
    const json& list = js.array(v, path, "normalizers");
    for (size_t i = 0; i < list.size(); ++i) {
      parts.push_back(make_normalizer(list[i], js, fmt::format("{}.normalizers[{}]", path, i)));
    }
    return std::make_unique<SequenceNormalizer>(std::move(parts));
  }
  const auto stable = UTF8PROC_STABLE;
  if (type == "NFC")
    return std::make_unique<UnicodeNormalizer>(utf8proc_option_t(stable | UTF8PROC_COMPOSE));
  if (type == "NFD")
    return std::make_unique<UnicodeNormalizer>(utf8proc_option_t(stable | UTF8PROC_DECOMPOSE));
  if (type == "NFKC")
    return std::make_unique<UnicodeNormalizer>(
        utf8proc_option_t(stable | UTF8PROC_COMPOSE | UTF8PROC_COMPAT));
  if (type == "NFKD")
    return std::make_unique<UnicodeNormalizer>(
        utf8proc_option_t(stable | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT));
  if (type == "Lowercase") return std::make_unique<LowercaseNormalizer>();
  if (type == "Replace") {
    return std::make_unique<ReplaceNormalizer>(
        Pattern::from_json(js.need(v, path, "pattern"), js, path + ".pattern"),
        js.str(v, path, "content"));
  }
  if (type == "Prepend") return std::make_unique<PrependNormalizer>(js.str(v, path, "prepend"));
  if (type == "Strip") {
    return std::make_unique<StripNormalizer>(js.flag(v, path, "strip_left", true),
                                             js.flag(v, path, "strip_right", true));
  }
  js.unsupported(path + ".type", type,
                 "Sequence, NFC, NFD, NFKC, NFKD, Lowercase, Replace, Prepend, Strip");
}

// ---------------------------------------------------------------------------------------------
// Pre-tokenizers

struct Piece {
  std::string text;
  bool at_origin;  // starts at offset 0 of the original input (Metaspace's "first")
};
using Pieces = std::vector<Piece>;

struct PreTokenizer {
  virtual ~PreTokenizer() = default;
  virtual void apply(Pieces& pieces) const = 0;
};

// Replaces each piece by its non-empty sub-pieces.
template <typename F>
void split_each(Pieces& pieces, F&& split_one) {
  thread_local std::vector<Range> ranges;
  Pieces out;
  out.reserve(pieces.size());
  for (Piece& p : pieces) {
    split_one(p, ranges);
    if (ranges.size() == 1 && ranges[0].start == 0 && ranges[0].end == p.text.size()) {
      out.push_back(std::move(p));
      continue;
    }
    for (const Range& r : ranges) {
      out.push_back({p.text.substr(r.start, r.end - r.start), p.at_origin && r.start == 0});
    }
  }
  pieces = std::move(out);
}

using SequencePreTokenizer = SequenceOf<PreTokenizer, Pieces>;

// Split, and WhitespaceSplit / Digits (a character predicate) / Whitespace (a regex) as splits.
class SplitPreTokenizer : public PreTokenizer {
 public:
  SplitPreTokenizer(Pattern p, Behavior b, bool invert)
      : pattern_(std::move(p)), behavior_(b), invert_(invert) {}
  void apply(Pieces& pieces) const override {
    split_each(pieces, [&](const Piece& p, std::vector<Range>& out) {
      split_ranges(p.text, pattern_, behavior_, invert_, out);
    });
  }

 private:
  Pattern pattern_;
  Behavior behavior_;
  bool invert_;
};

// GPT-2's byte -> printable character table: bytes that print stay, the rest move to U+0100+.
const std::array<std::string, 256>& byte_chars() {
  static const std::array<std::string, 256> table = [] {
    std::array<std::string, 256> t;
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      t[size_t(b)] = utf8_of(printable ? char32_t(b) : next++);
    }
    return t;
  }();
  return table;
}

// The inverse table; -1 for characters that stand for no byte.
int byte_of_char(char32_t c) {
  static const std::vector<int> table = [] {
    std::vector<int> t(512, -1);
    for (int b = 0; b < 256; ++b) {
      size_t len = 0;
      t[decode_utf8(byte_chars()[size_t(b)], 0, &len)] = b;
    }
    return t;
  }();
  return c < table.size() ? table[c] : -1;
}

constexpr const char* kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

class ByteLevelPreTokenizer : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(bool add_prefix_space, std::shared_ptr<const Regex> re)
      : add_prefix_space_(add_prefix_space), pattern_(Pattern::regex(re)), use_regex_(re) {}
  void apply(Pieces& pieces) const override {
    if (add_prefix_space_) {
      for (Piece& p : pieces) {
        if (p.text.empty() || p.text[0] != ' ') p.text.insert(0, " ");
      }
    }
    if (use_regex_) {
      split_each(pieces, [&](const Piece& p, std::vector<Range>& out) {
        split_ranges(p.text, pattern_, Behavior::kIsolated, false, out);
      });
    }
    const auto& table = byte_chars();
    for (Piece& p : pieces) {
      std::string mapped;
      mapped.reserve(p.text.size() * 2);
      for (char c : p.text) mapped += table[static_cast<unsigned char>(c)];
      p.text = std::move(mapped);
    }
  }

 private:
  bool add_prefix_space_;
  Pattern pattern_;
  bool use_regex_;
};

enum class PrependScheme { kFirst, kNever, kAlways };

class MetaspacePreTokenizer : public PreTokenizer {
 public:
  MetaspacePreTokenizer(char32_t replacement, PrependScheme scheme, bool split)
      : rep_(utf8_of(replacement)),
        scheme_(scheme),
        split_(split),
        space_(Pattern::literal(" ")),
        rep_pattern_(Pattern::literal(rep_)) {}
  void apply(Pieces& pieces) const override {
    for (Piece& p : pieces) {
      replace_all(p.text, space_, rep_);
      const bool starts = p.text.starts_with(rep_);
      if (!starts && (scheme_ == PrependScheme::kAlways ||
                      (scheme_ == PrependScheme::kFirst && p.at_origin))) {
        p.text.insert(0, rep_);
      }
    }
    if (!split_) return;
    split_each(pieces, [&](const Piece& p, std::vector<Range>& out) {
      split_ranges(p.text, rep_pattern_, Behavior::kMergedWithNext, false, out);
    });
  }

 private:
  std::string rep_;
  PrependScheme scheme_;
  bool split_;
  Pattern space_, rep_pattern_;
};

PrependScheme prepend_scheme(const json& v, const Json& js, const std::string& path) {
  PrependScheme scheme = PrependScheme::kAlways;
  if (auto s = js.opt_str(v, path, "prepend_scheme")) {
    if (*s == "first") {
      scheme = PrependScheme::kFirst;
    } else if (*s == "never") {
      scheme = PrependScheme::kNever;
    } else if (*s != "always") {
      js.unsupported(path + ".prepend_scheme", *s, "first, never, always");
    }
  }
  // The legacy field: false means never (the library refuses it against another scheme).
  if (!js.flag(v, path, "add_prefix_space", true)) {
    if (Json::opt(v, "prepend_scheme") != nullptr && scheme != PrependScheme::kNever) {
      js.fail(path + ".add_prefix_space", "false contradicts prepend_scheme");
    }
    scheme = PrependScheme::kNever;
  }
  return scheme;
}

std::shared_ptr<const Regex> gpt2_regex(const Json& js) {
  return std::make_shared<Regex>(kGpt2Regex, js, "(GPT-2 pre-tokenizer regex)");
}

std::unique_ptr<PreTokenizer> make_pre_tokenizer(const json& v, const Json& js,
                                                 const std::string& path) {
  const std::string type = js.type(v, path);
  if (type == "Sequence") {
    std::vector<std::unique_ptr<PreTokenizer>> parts;
    const json& list = js.array(v, path, "pretokenizers");
    for (size_t i = 0; i < list.size(); ++i) {
      parts.push_back(
          make_pre_tokenizer(list[i], js, fmt::format("{}.pretokenizers[{}]", path, i)));
    }
    return std::make_unique<SequencePreTokenizer>(std::move(parts));
  }
  if (type == "Split") {
    return std::make_unique<SplitPreTokenizer>(
        Pattern::from_json(js.need(v, path, "pattern"), js, path + ".pattern"),
        behavior_from_json(v, js, path), js.flag(v, path, "invert", false));
  }
  if (type == "ByteLevel") {
    return std::make_unique<ByteLevelPreTokenizer>(
        js.flag(v, path, "add_prefix_space", true),
        js.flag(v, path, "use_regex", true) ? gpt2_regex(js) : nullptr);
  }
  if (type == "Metaspace") {
    return std::make_unique<MetaspacePreTokenizer>(js.single_char(v, path, "replacement"),
                                                   prepend_scheme(v, js, path),
                                                   js.flag(v, path, "split", true));
  }
  if (type == "Whitespace") {
    auto re = std::make_shared<Regex>(R"(\w+|[^\w\s]+)", js, path);
    return std::make_unique<SplitPreTokenizer>(Pattern::regex(re), Behavior::kRemoved, true);
  }
  if (type == "WhitespaceSplit") {
    return std::make_unique<SplitPreTokenizer>(Pattern::predicate(is_white_space),
                                               Behavior::kRemoved, false);
  }
  if (type == "Digits") {
    const bool each = js.flag(v, path, "individual_digits", false);
    return std::make_unique<SplitPreTokenizer>(
        Pattern::predicate(is_numeric), each ? Behavior::kIsolated : Behavior::kContiguous, false);
  }
  js.unsupported(path + ".type", type,
                 "Sequence, Split, ByteLevel, Metaspace, Whitespace, WhitespaceSplit, Digits");
}

// ---------------------------------------------------------------------------------------------
// BPE model

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using Vocab = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

// (left id, right id) -> (rank, merged id), open addressing: looked up once per symbol pair.
class MergeTable {
 public:
  struct Merge {
    uint32_t rank;
    int32_t id;  // of the merged token
  };
  void build(const std::vector<std::pair<uint64_t, Merge>>& entries) {
    size_t cap = 16;
    while (cap < entries.size() * 2) cap <<= 1;
    slots_.assign(cap, Slot{});
    mask_ = cap - 1;
    for (const auto& [key, value] : entries) {
      Slot& s = probe(key);
      s.key = key;  // a repeated pair keeps the last rank, as the library's HashMap does
      s.value = value;
    }
  }
  static uint64_t key(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }
  // Null when the pair does not merge.
  const Merge* find(int32_t a, int32_t b) const {
    const uint64_t k = key(a, b);
    for (size_t i = hash(k);; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.key == k) return &s.value;
      if (s.key == kEmpty) return nullptr;
    }
  }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};
  struct Slot {
    uint64_t key = kEmpty;
    Merge value{};
  };
  size_t hash(uint64_t k) const { return size_t((k * 0x9E3779B97F4A7C15ull) >> 20) & mask_; }
  Slot& probe(uint64_t k) {
    size_t i = hash(k);
    while (slots_[i].key != kEmpty && slots_[i].key != k) i = (i + 1) & mask_;
    return slots_[i];
  }
  std::vector<Slot> slots_;
  size_t mask_ = 0;
};

struct BpeConfig {
  std::optional<std::string> unk_token;
  std::string prefix;  // continuing_subword_prefix
  std::string suffix;  // end_of_word_suffix
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;
};

class Bpe {
 public:
  Bpe(Vocab vocab, const std::vector<std::pair<std::string, std::string>>& merges, BpeConfig cfg,
      const Json& js, const std::string& path);

  // Appends the ids of one pre-tokenized word.
  void tokenize(std::string_view word, std::vector<int32_t>& out) const;
  const Vocab& vocab() const { return vocab_; }
  int32_t max_id() const { return max_id_; }

 private:
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
    uint32_t len;  // bytes of the word it covers; 0 once merged into its left neighbour
  };
  struct Candidate {
    uint32_t rank;
    int32_t pos;
    int32_t id;
    // Max-heap order that pops the lowest rank, then the leftmost position.
    bool operator<(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  struct Cache;
  Cache& cache() const;
  void merge_word(std::string_view word, std::vector<int32_t>& out) const;
  int32_t lookup(std::string_view s) const {
    auto it = vocab_.find(s);
    return it == vocab_.end() ? -1 : it->second;
  }
  int32_t char_id(std::string_view word, size_t i, size_t len, bool first, bool last) const;
  void initial_symbols(std::string_view word, std::vector<Symbol>& syms) const;
  void merge_all(std::vector<Symbol>& syms) const;
  void push_candidate(const std::vector<Symbol>& syms, int32_t pos,
                      std::vector<Candidate>& heap) const;

  Vocab vocab_;
  MergeTable merges_;
  BpeConfig cfg_;
  int32_t unk_id_ = -1;
  int32_t max_id_ = -1;
  std::array<int32_t, 256> byte_ids_{};  // <0xNN> tokens for byte_fallback, -1 when absent
  std::vector<int32_t> small_char_ids_;  // single code points below 0x800, -1 when absent
  uint64_t instance_ = next_instance();  // keys the per-thread word caches

  static uint64_t next_instance() {
    static std::atomic<uint64_t> counter{0};
    return ++counter;
  }
};

// Words recur (" the", "\n"), and merging them again costs a dozen hash probes; a per-thread
// cache needs no locks. Keyed by instance id, not address: a new tokenizer may reuse an address.
struct Bpe::Cache {
  static constexpr size_t kMaxWordBytes = 64;
  static constexpr size_t kMaxEntries = 1 << 16;  // then it starts over
  uint64_t owner = 0;
  std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> words;
};

Bpe::Cache& Bpe::cache() const {
  constexpr size_t kTokenizersPerThread = 4;
  thread_local std::array<Cache, kTokenizersPerThread> caches;
  thread_local size_t victim = 0;
  for (Cache& c : caches) {
    if (c.owner == instance_) return c;
  }
  Cache& c = caches[victim++ % kTokenizersPerThread];
  c.owner = instance_;
  c.words.clear();
  return c;
}

Bpe::Bpe(Vocab vocab, const std::vector<std::pair<std::string, std::string>>& merges, BpeConfig cfg,
         const Json& js, const std::string& path)
    : vocab_(std::move(vocab)), cfg_(std::move(cfg)) {
  for (const auto& [tok, id] : vocab_) max_id_ = std::max(max_id_, id);
  if (cfg_.unk_token) {
    unk_id_ = lookup(*cfg_.unk_token);
    if (unk_id_ < 0) {
      js.fail(path + ".unk_token", fmt::format("'{}' is not in model.vocab", *cfg_.unk_token));
    }
  }
  std::vector<std::pair<uint64_t, MergeTable::Merge>> entries;
  entries.reserve(merges.size());
  for (size_t i = 0; i < merges.size(); ++i) {
    const auto& [a, b] = merges[i];
    const std::string where = fmt::format("{}.merges[{}]", path, i);
    const int32_t ia = lookup(a), ib = lookup(b);
    if (ia < 0 || ib < 0) {
      js.fail(where, fmt::format("'{}' is not in model.vocab", ia < 0 ? a : b));
    }
    if (b.size() < cfg_.prefix.size()) js.fail(where, "is shorter than the subword prefix");
    const std::string merged = a + b.substr(cfg_.prefix.size());
    const int32_t im = lookup(merged);
    if (im < 0) js.fail(where, fmt::format("merged token '{}' is not in model.vocab", merged));
    entries.push_back({MergeTable::key(ia, ib), {uint32_t(i), im}});
  }
  merges_.build(entries);
  for (size_t b = 0; b < 256; ++b) byte_ids_[b] = lookup(fmt::format("<0x{:02X}>", b));
  small_char_ids_.assign(0x800, -1);
  for (char32_t c = 0; c < 0x800; ++c) small_char_ids_[c] = lookup(utf8_of(c));
}

int32_t Bpe::char_id(std::string_view word, size_t i, size_t len, bool first, bool last) const {
  const bool plain = (first || cfg_.prefix.empty()) && (!last || cfg_.suffix.empty());
  if (plain) {
    if (len <= 2) {
      size_t n = 0;
      return small_char_ids_[decode_utf8(word, i, &n)];
    }
    return lookup(word.substr(i, len));
  }
  std::string s = first ? std::string() : cfg_.prefix;
  s += word.substr(i, len);
  if (last) s += cfg_.suffix;
  return lookup(s);
}

// One symbol per character (or per byte via <0xNN>, or one <unk> for a run when fuse_unk).
void Bpe::initial_symbols(std::string_view word, std::vector<Symbol>& syms) const {
  syms.clear();
  int32_t unk_len = -1;  // pending unknown run
  auto add = [&](int32_t id, size_t len) {
    const int32_t n = int32_t(syms.size());
    syms.push_back({id, n - 1, n + 1, uint32_t(len)});
  };
  for (size_t i = 0; i < word.size();) {
    const size_t len = utf8_len(static_cast<unsigned char>(word[i]));
    const int32_t id = char_id(word, i, len, i == 0, i + len == word.size());
    if (id >= 0) {
      if (unk_len >= 0) add(unk_id_, size_t(unk_len));
      unk_len = -1;
      add(id, len);
    } else if (cfg_.byte_fallback &&
               std::all_of(word.begin() + std::ptrdiff_t(i), word.begin() + std::ptrdiff_t(i + len),
                           [&](char c) { return byte_ids_[static_cast<unsigned char>(c)] >= 0; })) {
      // The library adds these without flushing a pending <unk> first; so do we.
      for (size_t k = 0; k < len; ++k) add(byte_ids_[static_cast<unsigned char>(word[i + k])], 1);
    } else if (unk_id_ >= 0) {
      if (unk_len >= 0 && !cfg_.fuse_unk) {
        add(unk_id_, size_t(unk_len));
        unk_len = -1;
      }
      unk_len = int32_t(len) + (unk_len >= 0 ? unk_len : 0);
    }
    i += len;
  }
  if (unk_len >= 0) add(unk_id_, size_t(unk_len));
  if (!syms.empty()) syms.back().next = -1;
}

void Bpe::push_candidate(const std::vector<Symbol>& syms, int32_t pos,
                         std::vector<Candidate>& heap) const {
  const int32_t next = syms[size_t(pos)].next;
  if (next < 0) return;
  if (const auto* m = merges_.find(syms[size_t(pos)].id, syms[size_t(next)].id)) {
    heap.push_back({m->rank, pos, m->id});
    std::push_heap(heap.begin(), heap.end());
  }
}

// Merges the lowest-ranked adjacent pair first (leftmost among equals) until none applies.
void Bpe::merge_all(std::vector<Symbol>& syms) const {
  thread_local std::vector<Candidate> heap;
  heap.clear();
  for (int32_t i = 0; i + 1 < int32_t(syms.size()); ++i) push_candidate(syms, i, heap);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end());
    const Candidate top = heap.back();
    heap.pop_back();
    Symbol& left = syms[size_t(top.pos)];
    if (left.len == 0 || left.next < 0) continue;
    Symbol& right = syms[size_t(left.next)];
    const auto* m = merges_.find(left.id, right.id);
    if (m == nullptr || m->id != top.id) continue;  // stale: a neighbour changed
    left.id = top.id;
    left.len += right.len;
    left.next = right.next;
    right.len = 0;
    if (left.next >= 0) syms[size_t(left.next)].prev = top.pos;
    if (left.prev >= 0) push_candidate(syms, left.prev, heap);
    push_candidate(syms, top.pos, heap);
  }
}

void Bpe::tokenize(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (cfg_.ignore_merges) {
    const int32_t whole = lookup(word);
    if (whole >= 0) {
      out.push_back(whole);
      return;
    }
  }
  if (word.size() > Cache::kMaxWordBytes) {
    merge_word(word, out);
    return;
  }
  Cache& c = cache();
  if (auto it = c.words.find(word); it != c.words.end()) {
    out.insert(out.end(), it->second.begin(), it->second.end());
    return;
  }
  const size_t mark = out.size();
  merge_word(word, out);
  if (c.words.size() >= Cache::kMaxEntries) c.words.clear();
  c.words.emplace(std::string(word),
                  std::vector<int32_t>(out.begin() + std::ptrdiff_t(mark), out.end()));
}

void Bpe::merge_word(std::string_view word, std::vector<int32_t>& out) const {
  thread_local std::vector<Symbol> syms;
  initial_symbols(word, syms);
  merge_all(syms);
  for (const Symbol& s : syms) {
    if (s.len != 0) out.push_back(s.id);
  }
}

// ---------------------------------------------------------------------------------------------
// Added tokens: cut out of the text before anything else (leftmost, then longest).

struct AddedToken {
  // What is matched and what decodes: for normalized tokens, as the normalizer leaves it.
  std::string content;
  int32_t id;
  bool single_word, lstrip, rstrip, normalized, special;
  std::string original;  // the content as the file gives it: what token_to_id knows
};

struct Segment {
  size_t start, end;
  int32_t id;  // the added token, or -1 for text between them
};

class AddedMatcher {
 public:
  void add(const AddedToken* t) {
    if (t->content.empty()) return;
    int32_t node = 0;
    for (char c : t->content) {
      const auto b = static_cast<unsigned char>(c);
      int32_t child = -1;
      for (const auto& [k, n] : nodes_[size_t(node)].children) {
        if (k == b) child = n;
      }
      if (child < 0) {
        child = int32_t(nodes_.size());
        nodes_[size_t(node)].children.push_back({b, child});
        nodes_.push_back({});
      }
      node = child;
    }
    nodes_[size_t(node)].token = t;
    starts_[static_cast<unsigned char>(t->content[0])] = true;
  }
  bool empty() const { return nodes_.size() == 1; }

  // Segments covering `text`: matched tokens and the (possibly empty) gaps between them.
  void split(std::string_view text, std::vector<Segment>& out) const {
    out.clear();
    size_t done = 0;
    for (size_t i = 0; i < text.size();) {
      size_t end = 0;
      const AddedToken* t =
          starts_[static_cast<unsigned char>(text[i])] ? longest(text, i, &end) : nullptr;
      if (t == nullptr) {
        ++i;
        continue;
      }
      const size_t match_start = i;
      i = end;  // the scan resumes after the match even when the match is discarded
      if (t->single_word && !single_word_ok(text, match_start, end)) continue;
      size_t start = match_start, stop = end;
      if (t->lstrip) start = std::max(trailing_space_start(text.substr(0, start)), done);
      if (t->rstrip) stop += leading_space_end(text.substr(stop));
      if (done < start) out.push_back({done, start, -1});
      out.push_back({start, stop, t->id});
      done = stop;
    }
    if (done != text.size() || out.empty()) out.push_back({done, text.size(), -1});
  }

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int32_t>> children;
    const AddedToken* token = nullptr;
  };
  const AddedToken* longest(std::string_view text, size_t i, size_t* end) const {
    const AddedToken* best = nullptr;
    int32_t node = 0;
    for (size_t k = i; k < text.size(); ++k) {
      const auto b = static_cast<unsigned char>(text[k]);
      int32_t next = -1;
      for (const auto& [c, n] : nodes_[size_t(node)].children) {
        if (c == b) next = n;
      }
      if (next < 0) break;
      node = next;
      if (nodes_[size_t(node)].token != nullptr) {
        best = nodes_[size_t(node)].token;
        *end = k + 1;
      }
    }
    return best;
  }
  static bool single_word_ok(std::string_view text, size_t start, size_t end) {
    size_t len = 0;
    const bool left = start == 0 || !is_word_char(last_char(text.substr(0, start)));
    const bool right = end == text.size() || !is_word_char(decode_utf8(text, end, &len));
    return left && right;
  }
  std::vector<Node> nodes_ = std::vector<Node>(1);
  std::array<bool, 256> starts_{};
};

// ---------------------------------------------------------------------------------------------
// Post-processors: only what they add around a single sequence matters for ids.

struct Wrap {
  std::vector<int32_t> before, after;
};

int32_t token_ref_id(const json& v, const Json& js, const std::string& path) {
  if (!v.is_array() || v.size() != 2 || !v[0].is_string()) {
    js.fail(path, "must be a [token, id] pair");
  }
  return int32_t(js.integer(v[1], path + "[1]", kMaxId));
}

Wrap template_wrap(const json& v, const Json& js, const std::string& path) {
  const json& single = js.array(v, path, "single");
  const json* specials = Json::opt(v, "special_tokens");
  Wrap w;
  int sequences = 0;
  for (size_t i = 0; i < single.size(); ++i) {
    const std::string where = fmt::format("{}.single[{}]", path, i);
    if (const json* seq = Json::opt(single[i], "Sequence")) {
      const std::string id = js.str(*seq, where + ".Sequence", "id");
      if (id != "A") js.unsupported(where + ".Sequence.id", id, "A");
      ++sequences;
      continue;
    }
    const json* sp = Json::opt(single[i], "SpecialToken");
    if (sp == nullptr) js.fail(where, "must be {\"SpecialToken\": ...} or {\"Sequence\": ...}");
    const std::string name = js.str(*sp, where + ".SpecialToken", "id");
    const json* entry = specials != nullptr ? Json::opt(*specials, name.c_str()) : nullptr;
    if (entry == nullptr) {
      js.fail(path + ".special_tokens", fmt::format("has no entry '{}'", name));
    }
    const std::string epath = fmt::format("{}.special_tokens.{}", path, name);
    const json& ids = js.array(*entry, epath, "ids");
    for (size_t k = 0; k < ids.size(); ++k) {
      (sequences == 0 ? w.before : w.after)
          .push_back(int32_t(js.integer(ids[k], fmt::format("{}.ids[{}]", epath, k), kMaxId)));
    }
  }
  if (sequences != 1) js.fail(path + ".single", "must hold exactly one Sequence A");
  return w;
}

Wrap make_wrap(const json& v, const Json& js, const std::string& path) {
  const std::string type = js.type(v, path);
  if (type == "ByteLevel") return {};
  if (type == "TemplateProcessing") {
    if (!js.need(v, path, "single").is_array()) {
      js.fail(path + ".single", "must be a list of pieces (the string form is not supported)");
    }
    return template_wrap(v, js, path);
  }
  if (type == "BertProcessing" || type == "RobertaProcessing") {
    return {{token_ref_id(js.need(v, path, "cls"), js, path + ".cls")},
            {token_ref_id(js.need(v, path, "sep"), js, path + ".sep")}};
  }
  if (type == "Sequence") {
    Wrap all;
    const json& list = js.array(v, path, "processors");
    for (size_t i = 0; i < list.size(); ++i) {
      Wrap w = make_wrap(list[i], js, fmt::format("{}.processors[{}]", path, i));
      all.before.insert(all.before.begin(), w.before.begin(), w.before.end());
      all.after.insert(all.after.end(), w.after.begin(), w.after.end());
    }
    return all;
  }
  js.unsupported(path + ".type", type,
                 "TemplateProcessing, ByteLevel, BertProcessing, RobertaProcessing, Sequence");
}

// ---------------------------------------------------------------------------------------------
// Decoders: a chain over token strings, joined at the end.

using Tokens = std::vector<std::string>;

struct Decoder {
  virtual ~Decoder() = default;
  virtual void apply(Tokens& tokens) const = 0;
};

using SequenceDecoder = SequenceOf<Decoder, Tokens>;

class ByteLevelDecoder : public Decoder {
 public:
  void apply(Tokens& tokens) const override {
    std::string bytes;
    for (const std::string& t : tokens) {
      const size_t mark = bytes.size();
      size_t len = 0;
      bool all = true;
      for (size_t i = 0; i < t.size() && all; i += len) {
        const int b = byte_of_char(decode_utf8(t, i, &len));
        all = b >= 0;
        if (all) bytes += char(b);
      }
      if (!all) {  // a token with a character outside the table passes through as it is
        bytes.resize(mark);
        bytes += t;
      }
    }
    tokens.assign(1, utf8_lossy(bytes));
  }
};

class ByteFallbackDecoder : public Decoder {
 public:
  void apply(Tokens& tokens) const override {
    Tokens out;
    std::string pending;
    auto flush = [&] {
      if (pending.empty()) return;
      if (first_invalid_utf8(pending) == std::string_view::npos) {
        out.push_back(pending);
      } else {
        out.insert(out.end(), pending.size(), "\xEF\xBF\xBD");
      }
      pending.clear();
    };
    for (std::string& t : tokens) {
      const int b = byte_token(t);
      if (b >= 0) {
        pending += char(b);
        continue;
      }
      flush();
      out.push_back(std::move(t));
    }
    flush();
    tokens = std::move(out);
  }

 private:
  // "<0xNN>" -> NN, else -1 (Rust's from_str_radix also takes "+N").
  static int byte_token(const std::string& t) {
    if (t.size() != 6 || !t.starts_with("<0x") || t[5] != '>') return -1;
    const char* p = t.data() + 3;
    const char* end = t.data() + 5;
    if (*p == '+') ++p;
    unsigned value = 0;
    auto [ptr, ec] = std::from_chars(p, end, value, 16);
    return ec == std::errc() && ptr == end && value < 256 ? int(value) : -1;
  }
};

class FuseDecoder : public Decoder {
 public:
  void apply(Tokens& tokens) const override {
    std::string all;
    for (const std::string& t : tokens) all += t;
    tokens.assign(1, std::move(all));
  }
};

class ReplaceDecoder : public Decoder {
 public:
  ReplaceDecoder(Pattern p, std::string content)
      : pattern_(std::move(p)), content_(std::move(content)) {}
  void apply(Tokens& tokens) const override {
    for (std::string& t : tokens) replace_all(t, pattern_, content_);
  }

 private:
  Pattern pattern_;
  std::string content_;
};

class StripDecoder : public Decoder {
 public:
  StripDecoder(char32_t content, size_t start, size_t stop)
      : content_(content), start_(start), stop_(stop) {}
  void apply(Tokens& tokens) const override {
    for (std::string& t : tokens) {
      std::vector<size_t> offsets;  // char starts, plus the end
      size_t len = 0;
      std::vector<char32_t> chars;
      for (size_t i = 0; i < t.size(); i += len) {
        offsets.push_back(i);
        chars.push_back(decode_utf8(t, i, &len));
      }
      offsets.push_back(t.size());
      size_t cut_start = 0, cut_stop = chars.size();
      for (size_t i = 0; i < std::min(start_, chars.size()) && chars[i] == content_; ++i) {
        cut_start = i + 1;
      }
      for (size_t i = 0; i < std::min(stop_, chars.size()); ++i) {
        const size_t index = chars.size() - i - 1;
        if (chars[index] != content_) break;
        cut_stop = index;
      }
      cut_stop = std::max(cut_stop, cut_start);
      t = t.substr(offsets[cut_start], offsets[cut_stop] - offsets[cut_start]);
    }
  }

 private:
  char32_t content_;
  size_t start_, stop_;
};

class MetaspaceDecoder : public Decoder {
 public:
  MetaspaceDecoder(char32_t replacement, PrependScheme scheme)
      : replacement_(replacement), scheme_(scheme) {}
  void apply(Tokens& tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      std::string out;
      size_t len = 0;
      const std::string& t = tokens[i];
      for (size_t k = 0; k < t.size(); k += len) {
        const char32_t c = decode_utf8(t, k, &len);
        if (c != replacement_) {
          out.append(t, k, len);
        } else if (i != 0 || scheme_ == PrependScheme::kNever) {
          out += ' ';
        }  // the first token loses every replacement character, as in the library
      }
      tokens[i] = std::move(out);
    }
  }

 private:
  char32_t replacement_;
  PrependScheme scheme_;
};

std::unique_ptr<Decoder> make_decoder(const json& v, const Json& js, const std::string& path) {
  const std::string type = js.type(v, path);
  if (type == "Sequence") {
    std::vector<std::unique_ptr<Decoder>> parts;
    const json& list = js.array(v, path, "decoders");
    for (size_t i = 0; i < list.size(); ++i) {
      parts.push_back(make_decoder(list[i], js, fmt::format("{}.decoders[{}]", path, i)));
    }
    return std::make_unique<SequenceDecoder>(std::move(parts));
  }
  if (type == "ByteLevel") return std::make_unique<ByteLevelDecoder>();
  if (type == "ByteFallback") return std::make_unique<ByteFallbackDecoder>();
  if (type == "Fuse") return std::make_unique<FuseDecoder>();
  if (type == "Replace") {
    return std::make_unique<ReplaceDecoder>(
        Pattern::from_json(js.need(v, path, "pattern"), js, path + ".pattern"),
        js.str(v, path, "content"));
  }
  if (type == "Strip") {
    return std::make_unique<StripDecoder>(
        js.single_char(v, path, "content"),
        size_t(js.integer(js.need(v, path, "start"), path + ".start", kMaxId)),
        size_t(js.integer(js.need(v, path, "stop"), path + ".stop", kMaxId)));
  }
  if (type == "Metaspace") {
    return std::make_unique<MetaspaceDecoder>(js.single_char(v, path, "replacement"),
                                              prepend_scheme(v, js, path));
  }
  js.unsupported(path + ".type", type,
                 "Sequence, ByteLevel, ByteFallback, Fuse, Replace, Strip, Metaspace");
}

}  // namespace

// ---------------------------------------------------------------------------------------------

struct HfTokenizer::Impl {
  std::string source;
  std::unique_ptr<Normalizer> normalizer;
  std::unique_ptr<PreTokenizer> pre_tokenizer;
  std::unique_ptr<Bpe> model;
  std::unordered_map<std::string, int32_t> added_ids;  // original content -> id
  std::unordered_map<int32_t, AddedToken> added_by_id;
  int32_t next_added_id = -1;
  AddedMatcher raw_matcher, normalized_matcher;
  Wrap wrap;
  std::unique_ptr<Decoder> decoder;
  std::vector<const std::string*> id_tokens;  // id -> vocab string, null where none
  int32_t vocab_size = 0;
  bool removes_text = false;  // a pre-tokenizer Split with behavior Removed

  void finish();
  void add_token(AddedToken t);
  void encode_segment(std::string_view raw, bool at_origin, std::vector<int32_t>& ids) const;
};

// Ids as the library assigns them, whatever the file says: an earlier added token's or the
// model's id for known content, else the next after the model's entry count.
void HfTokenizer::Impl::add_token(AddedToken t) {
  if (t.content.empty()) return;
  if (next_added_id < 0) next_added_id = int32_t(model->vocab().size());
  t.original = t.content;
  if (auto it = added_ids.find(t.original); it != added_ids.end()) {
    t.id = it->second;
  } else if (auto v = model->vocab().find(t.original); v != model->vocab().end()) {
    t.id = v->second;
  } else {
    t.id = next_added_id++;
  }
  if (t.normalized && normalizer) normalizer->apply(t.content);
  added_ids[t.original] = t.id;
  added_by_id.insert_or_assign(t.id, std::move(t));
}

void HfTokenizer::Impl::finish() {
  int32_t max_id = model->max_id();
  for (const auto& [id, t] : added_by_id) {
    max_id = std::max(max_id, id);
    (t.normalized ? normalized_matcher : raw_matcher).add(&t);
  }
  vocab_size = max_id + 1;
  id_tokens.assign(size_t(vocab_size), nullptr);
  for (const auto& [tok, id] : model->vocab()) id_tokens[size_t(id)] = &tok;
}

void HfTokenizer::Impl::encode_segment(std::string_view raw, bool at_origin,
                                       std::vector<int32_t>& ids) const {
  std::string text(raw);
  if (normalizer) normalizer->apply(text);
  if (text.empty()) return;
  thread_local std::vector<Segment> parts;
  Pieces pieces;
  if (normalized_matcher.empty()) {
    pieces.push_back({std::move(text), at_origin});
  } else {
    normalized_matcher.split(text, parts);
    for (const Segment& s : parts) {
      if (s.id >= 0) {
        if (pre_tokenizer) pre_tokenizer->apply(pieces);
        for (const Piece& p : pieces) model->tokenize(p.text, ids);
        pieces.clear();
        ids.push_back(s.id);
      } else if (s.end > s.start) {
        pieces.push_back({text.substr(s.start, s.end - s.start), at_origin && s.start == 0});
      }
    }
  }
  if (pre_tokenizer) pre_tokenizer->apply(pieces);
  for (const Piece& p : pieces) model->tokenize(p.text, ids);
}

namespace {

using Merges = std::vector<std::pair<std::string, std::string>>;

Vocab vocab_from_json(const json& v, const Json& js, const std::string& path, bool lenient) {
  if (!v.is_object()) js.fail(path, "must be an object token -> id");
  Vocab vocab;
  vocab.reserve(v.size());
  for (auto it = v.begin(); it != v.end(); ++it) {
    if (lenient && !it.value().is_number()) continue;  // as the library reads vocab.json
    vocab[it.key()] = int32_t(js.integer(it.value(), path + "." + it.key(), kMaxId));
  }
  return vocab;
}

Merges merges_from_json(const json& v, const Json& js, const std::string& path) {
  if (!v.is_array()) js.fail(path, "must be an array");
  Merges merges;
  merges.reserve(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const json& m = v[i];
    const std::string where = fmt::format("{}[{}]", path, i);
    if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      merges.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
      continue;
    }
    if (!m.is_string()) js.fail(where, "must be \"a b\" or [\"a\", \"b\"]");
    const std::string s = m.get<std::string>();
    const size_t space = s.find(' ');
    if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
      js.fail(where, fmt::format("'{}' must be two tokens separated by one space", s));
    }
    merges.emplace_back(s.substr(0, space), s.substr(space + 1));
  }
  return merges;
}

std::unique_ptr<Bpe> make_model(const json& v, const Json& js) {
  const std::string path = "model";
  const std::string type = js.type(v, path);
  if (type != "BPE") js.unsupported(path + ".type", type, "BPE");
  if (const json* d = Json::opt(v, "dropout")) {
    if (!d->is_number() || d->get<double>() != 0.0) {
      js.fail(path + ".dropout", fmt::format("{} is not supported (supported: null)", d->dump()));
    }
  }
  BpeConfig cfg;
  cfg.unk_token = js.opt_str(v, path, "unk_token");
  cfg.prefix = js.opt_str(v, path, "continuing_subword_prefix").value_or("");
  cfg.suffix = js.opt_str(v, path, "end_of_word_suffix").value_or("");
  cfg.fuse_unk = js.flag(v, path, "fuse_unk", false);
  cfg.byte_fallback = js.flag(v, path, "byte_fallback", false);
  cfg.ignore_merges = js.flag(v, path, "ignore_merges", false);
  Vocab vocab = vocab_from_json(js.need(v, path, "vocab"), js, path + ".vocab", false);
  const json* merges = Json::opt(v, "merges");
  return std::make_unique<Bpe>(std::move(vocab),
                               merges ? merges_from_json(*merges, js, path + ".merges") : Merges{},
                               std::move(cfg), js, path);
}

void load_added_tokens(const json& root, const Json& js, HfTokenizer::Impl& impl) {
  const json* list = Json::opt(root, "added_tokens");
  if (list == nullptr) return;
  if (!list->is_array()) js.fail("added_tokens", "must be an array");
  for (size_t i = 0; i < list->size(); ++i) {
    const json& t = (*list)[i];
    const std::string path = fmt::format("added_tokens[{}]", i);
    if (!t.is_object()) js.fail(path, "must be an object");
    AddedToken a{js.str(t, path, "content"),
                 int32_t(js.integer(js.need(t, path, "id"), path + ".id", kMaxId)),
                 js.flag(t, path, "single_word", false),
                 js.flag(t, path, "lstrip", false),
                 js.flag(t, path, "rstrip", false),
                 js.flag(t, path, "normalized", true),
                 js.flag(t, path, "special", false),
                 {}};
    impl.add_token(std::move(a));
  }
}

// As the library reads merges.txt: "#version" lines skipped, the rest "a b".
Merges merges_from_txt(std::string_view merges_txt, const Json& js) {
  Merges merges;
  size_t line_no = 0;
  for (size_t pos = 0; pos < merges_txt.size();) {
    size_t eol = merges_txt.find('\n', pos);
    if (eol == std::string_view::npos) eol = merges_txt.size();
    std::string_view line = merges_txt.substr(pos, eol - pos);
    pos = eol + 1;
    ++line_no;
    if (line.ends_with('\r')) line.remove_suffix(1);
    if (line.starts_with("#version")) continue;
    const size_t space = line.find(' ');
    if (space == std::string_view::npos || line.find(' ', space + 1) != std::string_view::npos) {
      js.fail(fmt::format("merges.txt line {}", line_no),
              fmt::format("'{}' must be two tokens separated by one space", line));
    }
    merges.emplace_back(line.substr(0, space), line.substr(space + 1));
  }
  return merges;
}

void refuse_present(const json& root, const Json& js, const char* key, const char* why) {
  if (Json::opt(root, key) != nullptr) {
    js.fail(key, fmt::format("is set; it is not supported ({})", why));
  }
}

json parse_json(std::string_view text, const std::string& source, const char* what) {
  try {
    return json::parse(text);
  } catch (const json::parse_error& e) {
    fail_input("{}: malformed JSON{}: {}", source, what, e.what());
  }
}

}  // namespace

HfTokenizer::HfTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HfTokenizer::~HfTokenizer() = default;

std::unique_ptr<HfTokenizer> HfTokenizer::from_json(std::string_view json_text,
                                                    const std::string& source) {
  const json root = parse_json(json_text, source, "");
  const Json js{source};
  if (!root.is_object()) js.fail("(root)", "must be an object");
  auto impl = std::make_unique<Impl>();
  impl->source = source;
  refuse_present(root, js, "truncation", "the engine bounds prompt length itself");
  refuse_present(root, js, "padding", "the engine batches without padding ids");
  if (const json* n = Json::opt(root, "normalizer")) {
    impl->normalizer = make_normalizer(*n, js, "normalizer");
  }
  if (const json* p = Json::opt(root, "pre_tokenizer")) {
    impl->pre_tokenizer = make_pre_tokenizer(*p, js, "pre_tokenizer");
    // A Split that removes what it matches may remove any text (Whitespace removes only
    // whitespace, which the bound does not count).
    impl->removes_text = p->dump().find(R"("behavior":"Removed")") != std::string::npos;
  }
  impl->model = make_model(js.need(root, "(root)", "model"), js);
  if (const json* p = Json::opt(root, "post_processor")) {
    impl->wrap = make_wrap(*p, js, "post_processor");
  }
  if (const json* d = Json::opt(root, "decoder")) impl->decoder = make_decoder(*d, js, "decoder");
  load_added_tokens(root, js, *impl);
  impl->finish();
  return std::unique_ptr<HfTokenizer>(new HfTokenizer(std::move(impl)));
}

std::unique_ptr<HfTokenizer> HfTokenizer::from_vocab_merges(std::string_view vocab_json,
                                                            std::string_view merges_txt,
                                                            const std::string& source) {
  const Json js{source};
  Vocab vocab =
      vocab_from_json(parse_json(vocab_json, source, " in vocab.json"), js, "vocab.json", true);
  const Merges merges = merges_from_txt(merges_txt, js);
  auto impl = std::make_unique<Impl>();
  impl->source = source;
  impl->model = std::make_unique<Bpe>(std::move(vocab), merges, BpeConfig{}, js, "merges.txt");
  impl->pre_tokenizer = std::make_unique<ByteLevelPreTokenizer>(false, gpt2_regex(js));
  impl->decoder = std::make_unique<ByteLevelDecoder>();
  const std::string eot = "<|endoftext|>";
  if (auto it = impl->model->vocab().find(eot); it != impl->model->vocab().end()) {
    impl->add_token({eot, it->second, false, false, false, false, true, {}});
  }
  impl->finish();
  return std::unique_ptr<HfTokenizer>(new HfTokenizer(std::move(impl)));
}

std::vector<int32_t> HfTokenizer::encode(std::string_view text, bool add_special) const {
  const Impl& im = *impl_;
  if (const size_t bad = first_invalid_utf8(text); bad != std::string_view::npos) {
    fail_input("{}: text to encode is not valid UTF-8 (byte {} of {})", im.source, bad,
               text.size());
  }
  std::vector<int32_t> ids;
  if (add_special) ids = im.wrap.before;
  std::vector<Segment> local;
  if (im.raw_matcher.empty()) {
    local.push_back({0, text.size(), -1});
  } else {
    im.raw_matcher.split(text, local);
  }
  for (const Segment& s : local) {
    if (s.id >= 0) {
      ids.push_back(s.id);
    } else if (s.end > s.start) {
      im.encode_segment(text.substr(s.start, s.end - s.start), s.start == 0, ids);
    }
  }
  if (add_special) ids.insert(ids.end(), im.wrap.after.begin(), im.wrap.after.end());
  return ids;
}

std::string HfTokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  const Impl& im = *impl_;
  Tokens tokens;
  tokens.reserve(ids.size());
  for (const int32_t id : ids) {
    if (id < 0 || id >= im.vocab_size) {
      fail_input("{}: token id {} is out of range [0, {})", im.source, id, im.vocab_size);
    }
    if (auto it = im.added_by_id.find(id); it != im.added_by_id.end()) {
      if (!(skip_special && it->second.special)) tokens.push_back(it->second.content);
    } else if (const std::string* t = im.id_tokens[size_t(id)]) {
      tokens.push_back(*t);
    }
  }
  if (!im.decoder) {
    std::string out;
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (i > 0) out += ' ';
      out += tokens[i];
    }
    return out;
  }
  im.decoder->apply(tokens);
  std::string out;
  for (const std::string& t : tokens) out += t;
  return out;
}

int32_t HfTokenizer::vocab_size() const {
  return impl_->vocab_size;
}

size_t HfTokenizer::max_token_bytes() const {
  const Impl& im = *impl_;
  if (im.removes_text || (im.normalizer != nullptr && !im.normalizer->keeps_printable_ascii()))
    return 0;
  size_t most = 0;
  for (const std::string* t : im.id_tokens)
    if (t != nullptr) most = std::max(most, t->size());
  for (const auto& [id, t] : im.added_by_id) most = std::max(most, t.content.size());
  return most;
}

std::optional<int32_t> HfTokenizer::token_to_id(std::string_view token) const {
  if (auto it = impl_->added_ids.find(std::string(token)); it != impl_->added_ids.end()) {
    return it->second;
  }
  if (auto it = impl_->model->vocab().find(token); it != impl_->model->vocab().end()) {
    return it->second;
  }
  return std::nullopt;
}

std::string HfTokenizer::id_to_token(int32_t id) const {
  const Impl& im = *impl_;
  if (id < 0 || id >= im.vocab_size) return "";
  if (auto it = im.added_by_id.find(id); it != im.added_by_id.end()) return it->second.content;
  const std::string* t = im.id_tokens[size_t(id)];
  return t ? *t : "";
}

bool HfTokenizer::is_special(int32_t id) const {
  auto it = impl_->added_by_id.find(id);
  return it != impl_->added_by_id.end() && it->second.special;
}

const std::string& HfTokenizer::source() const {
  return impl_->source;
}

}  // namespace strata
