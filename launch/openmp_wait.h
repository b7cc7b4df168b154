// How long an idle OpenMP thread spins before it sleeps, settled before the runtime starts.
#pragma once

#include <nlohmann/json.hpp>

namespace strata::cli {

// GOMP_SPINCOUNT where the user set neither it nor OMP_WAIT_POLICY. libgomp's own default
// (300000 spins, milliseconds) holds a core at every barrier: on a node where anything else
// runs, the spinning thread takes the core its peer needs, and a 2-thread decode step
// took many times its idle time (docs/BENCHMARKS.md, "OpenMP threads on a shared node"). 1000 is
// libgomp's own count for oversubscribed teams, and costs nothing measurable on an idle node.
inline constexpr const char* kOpenmpSpinCount = "1000";

// libgomp reads its environment once, as it loads, before main. So where neither variable is
// set, this sets GOMP_SPINCOUNT and executes this binary again with the same arguments (same
// process, same pid: mpirun and Slurm see nothing). It returns where the user chose, where the
// count is already set (the second time through), or where the exec failed; the run then goes
// on with the environment it has.
void settle_openmp_wait(char** argv);

// {"GOMP_SPINCOUNT": ..., "OMP_WAIT_POLICY": ...} as this process runs (null where unset),
// for a benchmark's record.
nlohmann::json openmp_wait_json();

}  // namespace strata::cli
