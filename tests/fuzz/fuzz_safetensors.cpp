// A whole safetensors file as bytes. Whatever parses must describe a data section the
// tensors cover exactly, in order, each span its shape's size: what the loader relies on.
#include <cstddef>
#include <cstdint>

#include "fuzz_common.h"
#include "worker/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace strata;
  InputLimits limits;  // the defaults, as strata runs
  fuzz::expect_input_error_or_success([&] {
    const SafetensorsLayout layout = parse_safetensors("fuzz.safetensors", data, size, limits);
    fuzz::require(layout.data_begin >= 8 && layout.data_begin <= size, "data section in file");
    uint64_t cursor = 0;
    for (const SafetensorsTensor& t : layout.tensors) {
      fuzz::require(t.begin == cursor && t.begin <= t.end, "tensors contiguous and in order");
      const Tensor view{nullptr, t.dtype, t.shape};
      fuzz::require(view.bytes() == t.end - t.begin, "span equals the shape's bytes");
      fuzz::require(t.shape.rank <= limits.tensor_rank, "rank within its limit");
      cursor = t.end;
    }
    fuzz::require(cursor == size - layout.data_begin, "tensors end where the file does");
  });
  return 0;
}
