#include "launch/openmp_wait.h"

#include <unistd.h>

#include <cstdlib>

namespace strata::cli {

void settle_openmp_wait(char** argv) {
  if (std::getenv("GOMP_SPINCOUNT") != nullptr || std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  if (setenv("GOMP_SPINCOUNT", kOpenmpSpinCount, 1) != 0) return;
  execv("/proc/self/exe", argv);
  // Still here: the exec failed (no /proc). The variable reaches any child this run starts.
}

nlohmann::json openmp_wait_json() {
  nlohmann::json j;
  for (const char* name : {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"}) {
    const char* v = std::getenv(name);
    j[name] = v != nullptr ? nlohmann::json(v) : nlohmann::json(nullptr);
  }
  return j;
}

}  // namespace strata::cli
