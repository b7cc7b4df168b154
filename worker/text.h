// UTF-8 at the edges: prompts that arrive as bytes and completions that a byte-level
// tokenizer may end in the middle of a character. Output must always be printable (JSON
// requires UTF-8), so invalid bytes are found or replaced here instead of failing a whole run.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace strata {

// The offset of the first byte that does not start or continue a well-formed UTF-8 sequence
// (Unicode 15, table 3-7: no overlong forms, no surrogates, nothing above U+10FFFF); -1 when
// the whole text is well-formed.
int64_t first_invalid_utf8(std::string_view text);

// `text` with each maximal ill-formed subpart replaced by U+FFFD, as the Unicode standard
// recommends (section 3.9, "U+FFFD Substitution of Maximal Subparts"); well-formed text is
// returned unchanged.
std::string to_valid_utf8(std::string_view text);

}  // namespace strata
