// What accelerators this process can use. Built with CUDA, this asks the runtime; any
// runtime error (no driver, no device) means "no GPU" and the engine runs on the CPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace strata {

struct AcceleratorDevice {
  int index = 0;
  std::string name;
  size_t memory_bytes = 0;
  int compute_major = 0;
  int compute_minor = 0;
  int multiprocessors = 0;  // SMs
  // domain:bus:device.function; with the host name it tells whether two ranks share a GPU.
  std::string pci_bus_id;
};

struct AcceleratorInfo {
  bool cuda_built = false;  // this binary contains the CUDA backend
  std::vector<AcceleratorDevice> devices;
  std::string reason;  // why there is none, when devices is empty

  bool available() const { return !devices.empty(); }
  std::string str() const;
};

AcceleratorInfo probe_accelerators();

// Free memory of CUDA device `index` now (cudaMemGetInfo, which creates its context); -1
// where there is no such device or no CUDA backend.
int64_t accelerator_free_bytes(int index);

}  // namespace strata
