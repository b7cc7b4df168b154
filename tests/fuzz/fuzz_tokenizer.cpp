// tokenizer.model as bytes (sentencepiece's serialized ModelProto). sentencepiece itself is
// Debian's uninstrumented build: ASan sees our side of every call and crashes inside it,
// not its internal reads. Whatever loads must encode to ids inside its pieces and decode
// back without error.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "fuzz_common.h"
#include "worker/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace strata;
  ModelConfig config;
  config.source = "fuzz/config.json";
  config.vocab = 1 << 20;
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  fuzz::expect_input_error_or_success([&] {
    const auto tok = Tokenizer::from_bytes(bytes, config, "fuzz/tokenizer.model");
    const std::vector<int32_t> ids = tok->encode("Once upon a time, \xC3\xA9t\xC3\xA9 42!");
    for (int32_t id : ids) fuzz::require(id >= 0 && id < config.vocab, "id inside vocabulary");
    (void)tok->decode(ids);
    (void)tok->completion(ids, ids);
  });
  return 0;
}
