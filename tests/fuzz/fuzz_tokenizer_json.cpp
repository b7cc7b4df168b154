// tokenizer.json as bytes: whatever loads must encode a fixed text (and the input itself when
// it is UTF-8) to ids inside its vocabulary, and decode them again, with InputError the only
// way to say no.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "fuzz_common.h"
#include "worker/text.h"
#include "worker/text/hf_tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace strata;
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  fuzz::expect_input_error_or_success([&] {
    const auto tok = HfTokenizer::from_json(bytes, "fuzz/tokenizer.json");
    for (const std::string_view text :
         {std::string_view("Once upon a time, \xC3\xA9t\xC3\xA9 42! <s>\n\n  x"), bytes}) {
      if (first_invalid_utf8(text) >= 0) continue;
      for (const bool special : {false, true}) {
        const std::vector<int32_t> ids = tok->encode(text, special);
        for (int32_t id : ids)
          fuzz::require(id >= 0 && id < tok->vocab_size(), "id inside the vocabulary");
        (void)tok->decode(ids, false);
        (void)tok->decode(ids, true);
      }
    }
  });
  return 0;
}
