#!/usr/bin/env bash
# Runs a test binary under a real `mpirun -np NP` on this machine.
#   run_mpi.sh [--keep-going] [--verdict-file] NP BINARY [ARGS...]
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
# --verdict-file: rank 0 writes its result to $STRATA_MPI_VERDICT and ends without
# MPI_Finalize (which may wait forever for a crashed peer); that file, not mpirun's status,
# is the test's result.
verdict=
if [ "${1:-}" = "--verdict-file" ]; then
  verdict=$(mktemp)
  trap 'rm -f "$verdict"' EXIT
  export STRATA_MPI_VERDICT=$verdict
  shift
fi
np=$1
shift
# timeout: a last guard under ctest's TIMEOUT; every wait in the code has its own deadline.
if [ -z "$verdict" ]; then
  exec timeout -k 5 80 mpirun -np "$np" --oversubscribe --bind-to none "${extra[@]}" "$@"
fi
timeout -k 5 60 mpirun -np "$np" --oversubscribe --bind-to none "${extra[@]}" "$@" || true
[ -s "$verdict" ] || { echo "run_mpi.sh: rank 0 left no verdict" >&2; exit 1; }
exit "$(cat "$verdict")"
