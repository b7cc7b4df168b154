#include "kernels/cpu_isa.h"

#include <algorithm>

#include "kernels/error.h"
#include "kernels/tunables.h"

namespace strata {

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512:
      return "avx512";
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kPortable:
      break;
  }
  return "portable";
}

CpuIsa detected_cpu_isa() {
  static const CpuIsa detected = [] {
#if STRATA_X86_KERNELS
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return CpuIsa::kAvx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
      return CpuIsa::kAvx2;
#endif
    return CpuIsa::kPortable;
  }();
  return detected;
}

bool cpu_has_avx512_vnni() {
  static const bool has = [] {
#if STRATA_X86_KERNELS
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
#else
    return false;
#endif
  }();
  return has;
}

CpuIsa active_cpu_isa() {
  static const CpuIsa active = [] {
    // The table's choices are in CpuIsa's order.
    const std::optional<int> cap = tunable_choice_if_set(TunableId::kCpuIsa);
    const CpuIsa detected = detected_cpu_isa();
    if (!cap) return detected;
    return std::min(detected, static_cast<CpuIsa>(*cap));
  }();
  return active;
}

}  // namespace strata
