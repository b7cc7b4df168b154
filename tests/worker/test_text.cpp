// UTF-8 checks and repair (issue 10, failure 5): expected values from the Unicode standard.
#include <gtest/gtest.h>

#include "worker/text.h"

namespace strata {
namespace {

const std::string kFffd = "\xEF\xBF\xBD";

TEST(Text, WellFormedTextIsUntouched) {
  // 1-, 2-, 3- and 4-byte characters: a, e-acute, euro sign, musical G clef (U+1D11E).
  const std::string s = "a\xC3\xA9\xE2\x82\xAC\xF0\x9D\x84\x9E";
  EXPECT_EQ(first_invalid_utf8(s), -1);
  EXPECT_EQ(to_valid_utf8(s), s);
  EXPECT_EQ(first_invalid_utf8(""), -1);
}

// Table 3-7's exclusions: overlong forms, surrogates, code points above U+10FFFF, stray
// continuation bytes, bytes that never occur, and a sequence cut short.
TEST(Text, FindsTheFirstIllFormedByte) {
  EXPECT_EQ(first_invalid_utf8("ab\xC0\x80"), 2);         // overlong NUL
  EXPECT_EQ(first_invalid_utf8("\xE0\x80\xAF"), 0);       // overlong '/'
  EXPECT_EQ(first_invalid_utf8("x\xED\xA0\x80"), 1);      // surrogate U+D800
  EXPECT_EQ(first_invalid_utf8("\xF4\x90\x80\x80"), 0);   // U+110000
  EXPECT_EQ(first_invalid_utf8("ok\x80"), 2);             // lone continuation byte
  EXPECT_EQ(first_invalid_utf8("\xFF"), 0);               // never in UTF-8
  EXPECT_EQ(first_invalid_utf8("abc\xE2\x82"), 3);        // euro sign cut short
  EXPECT_EQ(first_invalid_utf8("\xF4\x8F\xBF\xBF"), -1);  // U+10FFFF, the last code point
  EXPECT_EQ(first_invalid_utf8("\xED\x9F\xBF"), -1);      // U+D7FF, just below surrogates
}

// The Unicode standard's own example (section 3.9, table 3-8): each maximal subpart of an
// ill-formed sequence becomes one U+FFFD.
TEST(Text, ReplacesMaximalSubpartsAsTheStandardShows) {
  const std::string in = "\x61\xF1\x80\x80\xE1\x80\xC2\x62\x80\x63\x80\xBF\x64";
  const std::string want = "a" + kFffd + kFffd + kFffd + "b" + kFffd + "c" + kFffd + kFffd + "d";
  EXPECT_EQ(to_valid_utf8(in), want);
  EXPECT_EQ(first_invalid_utf8(to_valid_utf8(in)), -1);
  EXPECT_EQ(to_valid_utf8("x\xE2\x82"), "x" + kFffd);  // a truncated tail is one subpart
}

}  // namespace
}  // namespace strata
