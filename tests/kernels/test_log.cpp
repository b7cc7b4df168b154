// log::printable: what a client or producer sent, made safe for a log line. Valid UTF-8
// stays (an id in any script reads as written); invalid bytes, control bytes and the
// backslash become \xHH, so nothing a request carries can forge or garble a log line.
#include <gtest/gtest.h>

#include "kernels/log.h"

namespace strata {
namespace {

TEST(LogPrintable, KeepsUtf8AndEscapesTheRest) {
  EXPECT_EQ(log::printable("req-1 ok"), "req-1 ok");
  EXPECT_EQ(log::printable("caf\xc3\xa9 \xe4\xb8\xad \xf0\x9f\x98\x80"),
            "caf\xc3\xa9 \xe4\xb8\xad \xf0\x9f\x98\x80");
  EXPECT_EQ(log::printable("a\nb\r\x1b[31m"), "a\\x0ab\\x0d\\x1b[31m");
  EXPECT_EQ(log::printable("back\\slash"), "back\\x5cslash");
  EXPECT_EQ(log::printable(std::string("nul\0x", 5)), "nul\\x00x");
  // Invalid: a lone continuation byte, a truncated sequence, an overlong '/', a surrogate,
  // past U+10FFFF, 0xff.
  EXPECT_EQ(log::printable("\x80"), "\\x80");
  EXPECT_EQ(log::printable("\xe4\xb8"), "\\xe4\\xb8");
  EXPECT_EQ(log::printable("\xc0\xaf"), "\\xc0\\xaf");
  EXPECT_EQ(log::printable("\xed\xa0\x80"), "\\xed\\xa0\\x80");
  EXPECT_EQ(log::printable("\xf4\x90\x80\x80"), "\\xf4\\x90\\x80\\x80");
  EXPECT_EQ(log::printable("GET /\xff HTTP"), "GET /\\xff HTTP");
}

}  // namespace
}  // namespace strata
