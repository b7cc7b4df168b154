// Programmatic dependent launch (PDL, compute capability 9.0 on), shared by the CUDA
// backend's kernel files. A kernel launched with it (launch(..., overlap = true, ...)) may
// start while the kernel before it in the stream is still finishing: it reads no input of
// that kernel before wait_for_inputs(), which returns once that kernel has completed and its
// writes are visible. Launched without it, wait_for_inputs() returns at once, so a kernel
// that calls it first serves both launches. let_dependents_launch() lets the next such
// launch begin once every block of this one is running: the next kernel waits for this one
// to complete anyway, so the earlier it is called, the more of its launch is hidden.
#pragma once

#include <cuda_runtime.h>

namespace strata::cuda_kernels {
namespace {

__device__ void wait_for_inputs() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaGridDependencySynchronize();
#endif
}

__device__ void let_dependents_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaTriggerProgrammaticLaunchCompletion();
#endif
}

// Launches `kernel` over `grid` blocks of `threads` with `shared` bytes of dynamic shared
// memory, with programmatic dependent launch where `overlap` asks for it (the kernel must
// then call wait_for_inputs() before it reads anything an earlier kernel wrote).
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, unsigned threads, size_t shared, bool overlap,
            cudaStream_t s, Args... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = shared;
  config.stream = s;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attr;
  config.numAttrs = overlap ? 1 : 0;
  cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
}

}  // namespace
}  // namespace strata::cuda_kernels
