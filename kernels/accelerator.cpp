#include "kernels/accelerator.h"

#include <fmt/format.h>

namespace strata {

#if !STRATA_HAVE_CUDA
AcceleratorInfo probe_accelerators() {
  AcceleratorInfo info;
  info.cuda_built = false;
  info.reason = "this binary was built without the CUDA backend (nvcc not found at configure time)";
  return info;
}

int64_t accelerator_free_bytes(int /*index*/) {
  return -1;
}
#endif

std::string AcceleratorInfo::str() const {
  if (devices.empty()) return fmt::format("no GPU ({})", reason);
  std::string s;
  for (const auto& d : devices) {
    if (!s.empty()) s += "; ";
    s += fmt::format("cuda:{} {} ({:.1f} GiB, sm_{}{})", d.index, d.name,
                     static_cast<double>(d.memory_bytes) / (1024.0 * 1024 * 1024), d.compute_major,
                     d.compute_minor);
  }
  return s;
}

}  // namespace strata
