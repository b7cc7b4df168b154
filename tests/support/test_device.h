// The device a test built twice runs on: the CPU backend standing in for it (every CI run),
// or, compiled with STRATA_TEST_CUDA (the `gpu` label), the CUDA backend; and a scratch
// directory under the test's build tree for disk tiers.
#pragma once

#include <filesystem>
#include <memory>
#include <string>

#include "kernels/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/error.h"

namespace strata::testing {

// The device under test, or nullptr (and the test skips) when there is none.
inline std::unique_ptr<Backend> make_test_device() {
#ifdef STRATA_TEST_CUDA
  try {
    return make_cuda_backend(0);
  } catch (const Error& e) {
    // A mistyped STRATA_CUDA_* switch is the run's error, not a missing device.
    if (e.kind() == ErrorKind::kInvalidInput) throw;
    return nullptr;
  }
#else
  return std::make_unique<CpuBackend>(2);
#endif
}

// STRATA_TEST_TMP/<name>, created.
inline std::string test_tmp_dir(const std::string& name) {
  const std::filesystem::path d = std::filesystem::path(STRATA_TEST_TMP) / name;
  std::filesystem::create_directories(d);
  return d.string();
}

}  // namespace strata::testing
