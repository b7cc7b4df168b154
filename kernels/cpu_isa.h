// Which vector instruction set the CPU kernels use, chosen at run time: the widest the CPU
// has among those the build compiled (every x86-64 build compiles AVX2 and AVX-512 kernels,
// whatever its own machine), capped by STRATA_CPU_ISA=portable|avx2|avx512 for comparisons.
#pragma once

#include <string>

namespace strata {

enum class CpuIsa { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

const char* cpu_isa_name(CpuIsa isa);

// What this CPU can run (cpuid, asked once), ignoring the environment.
CpuIsa detected_cpu_isa();

// Whether the CPU has AVX-512 BW and VNNI (byte dot products), which the AVX-512 4-bit
// GEMV needs on top of CpuIsa::kAvx512; without them that GEMV runs its AVX2 kernel.
bool cpu_has_avx512_vnni();

// What the kernels use: detected_cpu_isa(), capped by STRATA_CPU_ISA. Decided once per
// process; an unknown value of the variable is an error naming it, thrown by the first
// call (CpuBackend's constructor makes it, outside any parallel region).
CpuIsa active_cpu_isa();

}  // namespace strata
