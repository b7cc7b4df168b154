// A control message as it arrives from another rank: any bytes. decode() either refuses
// them with an Error or returns a message that encodes and decodes back to itself.
#include <cstddef>
#include <cstdint>
#include <span>

#include "fuzz_common.h"
#include "transport/messages.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace strata;
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  ControlMessage m;
  try {
    m = decode(bytes);
  } catch (const Error&) {
    return 0;  // refused: what a corrupt message must get
  }
  // Compared as bytes: a float field may hold NaN, which no == holds equal to itself.
  const std::vector<std::byte> again = encode(m);
  fuzz::require(encode(decode(again)) == again, "a decoded message round-trips");
  (void)str(m);
  return 0;
}
