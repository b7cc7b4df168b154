#!/usr/bin/env bash
# Runs a test binary under a real `mpirun -np NP` on this machine.
#   run_mpi.sh [--keep-going] NP BINARY [ARGS...]
# --keep-going: a rank that dies does not make mpirun kill the others (the peer-loss test
# needs the survivor to notice by itself).
# The Open MPI settings CI needs live here, not in anyone's head: running as root (CI
# containers) and more ranks than cores (2-core machines).
set -euo pipefail
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1

extra=()
if [ "${1:-}" = "--keep-going" ]; then
  extra+=(--mca orte_abort_on_non_zero_status 0)
  shift
fi
np=$1
shift
# timeout: a last guard under ctest's TIMEOUT; every wait in the code has its own deadline.
exec timeout -k 5 120 mpirun -np "$np" --oversubscribe --bind-to none "${extra[@]}" "$@"
