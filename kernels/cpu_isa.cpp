#include "kernels/cpu_isa.h"

#include <algorithm>
#include <cstdlib>

#include "kernels/error.h"

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

CpuIsa parse_cpu_isa(const std::string& name) {
  for (CpuIsa isa : {CpuIsa::kPortable, CpuIsa::kAvx2, CpuIsa::kAvx512})
    if (name == cpu_isa_name(isa)) return isa;
  fail_input("STRATA_CPU_ISA='{}': expected portable, avx2 or avx512", name);
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
    const char* cap = std::getenv("STRATA_CPU_ISA");
    const CpuIsa detected = detected_cpu_isa();
    if (cap == nullptr || *cap == '\0') return detected;
    return std::min(detected, parse_cpu_isa(cap));
  }();
  return active;
}

}  // namespace strata
