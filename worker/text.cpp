#include "worker/text.h"

namespace strata {
namespace {

// Well-formed sequences (Unicode table 3-7): the lead byte fixes the length and the range
// of the second byte; every later byte is 80..BF.
struct Lead {
  int length;  // 0: not a lead byte
  uint8_t second_lo, second_hi;
};

Lead lead_of(uint8_t b) {
  if (b <= 0x7f) return {1, 0, 0};
  if (b >= 0xc2 && b <= 0xdf) return {2, 0x80, 0xbf};
  if (b == 0xe0) return {3, 0xa0, 0xbf};  // no overlong 3-byte forms
  if (b == 0xed) return {3, 0x80, 0x9f};  // no surrogates
  if (b >= 0xe1 && b <= 0xef) return {3, 0x80, 0xbf};
  if (b == 0xf0) return {4, 0x90, 0xbf};  // no overlong 4-byte forms
  if (b == 0xf4) return {4, 0x80, 0x8f};  // nothing above U+10FFFF
  if (b >= 0xf1 && b <= 0xf3) return {4, 0x80, 0xbf};
  return {0, 0, 0};
}

// How many bytes at `i` form the longest prefix of a well-formed sequence (the maximal
// subpart), and whether that prefix is a whole character.
struct Scan {
  size_t bytes;
  bool complete;
};

Scan scan_at(std::string_view t, size_t i) {
  const Lead lead = lead_of(static_cast<uint8_t>(t[i]));
  if (lead.length == 0) return {1, false};
  if (lead.length == 1) return {1, true};
  size_t n = 1;
  for (; n < static_cast<size_t>(lead.length) && i + n < t.size(); ++n) {
    const auto b = static_cast<uint8_t>(t[i + n]);
    const uint8_t lo = n == 1 ? lead.second_lo : 0x80;
    const uint8_t hi = n == 1 ? lead.second_hi : 0xbf;
    if (b < lo || b > hi) return {n, false};
  }
  return {n, n == static_cast<size_t>(lead.length)};
}

}  // namespace

int64_t first_invalid_utf8(std::string_view text) {
  for (size_t i = 0; i < text.size();) {
    const Scan s = scan_at(text, i);
    if (!s.complete) return static_cast<int64_t>(i);
    i += s.bytes;
  }
  return -1;
}

std::string to_valid_utf8(std::string_view text) {
  if (first_invalid_utf8(text) < 0) return std::string(text);
  std::string out;
  out.reserve(text.size() + 8);
  for (size_t i = 0; i < text.size();) {
    const Scan s = scan_at(text, i);
    if (s.complete) {
      out.append(text.substr(i, s.bytes));
    } else {
      out.append("\xEF\xBF\xBD");  // U+FFFD REPLACEMENT CHARACTER
    }
    i += s.bytes;
  }
  return out;
}

}  // namespace strata
