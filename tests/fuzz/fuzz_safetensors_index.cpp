// model.safetensors.index.json as text: whatever parses maps tensors to plain file names.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "fuzz_common.h"
#include "worker/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace strata;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  fuzz::expect_input_error_or_success([&] {
    const auto map = parse_safetensors_index("fuzz/model.safetensors.index.json", text);
    for (const auto& [name, shard] : map) {
      fuzz::require(
          !shard.empty() && shard.find('/') == std::string::npos && shard != "." && shard != "..",
          "shard is a file name inside the model directory");
    }
  });
  return 0;
}
