// Device query for the CUDA backend. Any runtime error counts as "no GPU": on a machine
// with only the stub driver cudaGetDeviceCount returns cudaErrorInsufficientDriver.
#include <cuda_runtime.h>

#include <cstdio>

#include "kernels/accelerator.h"

namespace strata {

AcceleratorInfo probe_accelerators() {
  AcceleratorInfo info;
  info.cuda_built = true;
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    info.reason =
        std::string("CUDA runtime: ") + cudaGetErrorName(err) + ": " + cudaGetErrorString(err);
    cudaGetLastError();  // clear the sticky error so later calls start clean
    return info;
  }
  if (count == 0) {
    info.reason = "CUDA runtime reports 0 devices";
    return info;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    AcceleratorDevice d;
    d.index = i;
    d.name = prop.name;
    d.memory_bytes = prop.totalGlobalMem;
    d.compute_major = prop.major;
    d.compute_minor = prop.minor;
    d.multiprocessors = prop.multiProcessorCount;
    char bus[32];
    std::snprintf(bus, sizeof bus, "%04x:%02x:%02x.0", static_cast<unsigned>(prop.pciDomainID),
                  static_cast<unsigned>(prop.pciBusID), static_cast<unsigned>(prop.pciDeviceID));
    d.pci_bus_id = bus;
    info.devices.push_back(d);
  }
  if (info.devices.empty()) info.reason = "no CUDA device answered a properties query";
  return info;
}

int64_t accelerator_free_bytes(int index) {
  int current = 0;
  if (cudaGetDevice(&current) != cudaSuccess || cudaSetDevice(index) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  size_t free = 0, total = 0;
  const bool ok = cudaMemGetInfo(&free, &total) == cudaSuccess;
  if (!ok) cudaGetLastError();
  cudaSetDevice(current);
  return ok ? static_cast<int64_t>(free) : -1;
}

}  // namespace strata
