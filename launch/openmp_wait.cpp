#include "launch/openmp_wait.h"

#include <unistd.h>

#include <cstdlib>

#include "kernels/tunables.h"

namespace strata::cli {

void settle_openmp_wait(char** argv) {
  if (foreign_variable("GOMP_SPINCOUNT") || foreign_variable("OMP_WAIT_POLICY")) return;
  if (setenv("GOMP_SPINCOUNT", kOpenmpSpinCount, 1) != 0) return;
  execv("/proc/self/exe", argv);
  // Still here: the exec failed (no /proc). The variable reaches any child this run starts.
}

nlohmann::json openmp_wait_json() {
  nlohmann::json j;
  for (const char* name : {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"}) {
    const std::optional<std::string> v = foreign_variable(name);
    j[name] = v ? nlohmann::json(*v) : nlohmann::json(nullptr);
  }
  return j;
}

}  // namespace strata::cli
