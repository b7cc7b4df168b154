#!/usr/bin/env bash
# A cluster on this machine: rank 0 coordinates, ranks 1..NP-1 are pipeline stages.
#   launch/local-cluster.sh NP [strata serve options...]
#   launch/local-cluster.sh NP profile-layers [options...]   (the stages' layer profile)
#   launch/local-cluster.sh 3 --model ../shared/models/stories260K --redis redis://127.0.0.1:6379
#   launch/local-cluster.sh 3 --model ../shared/models/stories260K \
#       --requests requests.jsonl --results results.jsonl --micro-batches 2
# STRATA: the strata binary (default: build/launch/strata). MPIRUN_ARGS: more mpirun options.
# The Open MPI settings live here, not in users' heads: running as root (containers, CI),
# more ranks than cores (oversubscription), no core binding (ranks share the cores), and
# --mca orte_abort_on_non_zero_status 0 so that when a worker dies the coordinator itself
# says which rank it was before the job ends (docs/CLUSTER.md).
#
# Stopping: SIGTERM or SIGINT (Ctrl-C) to this script reaches the ranks as SIGTERM, and
# rank 0 finishes the running requests within --grace-period before the job exits. mpirun
# runs in a session of its own so that Ctrl-C does not reach it: on a signal of its own,
# mpirun kills the job (SIGCONT, then SIGTERM and SIGKILL each odls_base_sigkill_timeout
# apart, 1 s by default), which leaves no time to finish. Raising that timeout is no cure:
# mpirun uses the same sequence after MPI_Abort, so every failing job would take as long.
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 NP [strata serve options...]" >&2
  exit 2
fi
np=$1
shift
command=serve
if [ "${1:-}" = profile-layers ]; then
  command=$1
  shift
fi
here=$(cd "$(dirname "$0")/.." && pwd)
strata=${STRATA:-$here/build/launch/strata}
if [ "$(id -u)" = 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
export OMPI_MCA_rmaps_base_oversubscribe=1
# shellcheck source=launch/redis-password.sh
. "$here/launch/redis-password.sh"
strip_redis_passwords "$@"
set -- ${redis_args[@]+"${redis_args[@]}"}
# Under orte_abort_on_non_zero_status 0 mpirun exits 0 whatever the ranks return; a rank
# that fails before the job starts (a bad option) leaves its status here (launch/main.cpp).
STRATA_RANK_STATUS_DIR=$(mktemp -d "${TMPDIR:-/tmp}/strata-ranks.XXXXXX")
export STRATA_RANK_STATUS_DIR
# shellcheck disable=SC2086
setsid mpirun -np "$np" --oversubscribe --bind-to none \
  --mca orte_abort_on_non_zero_status 0 ${MPIRUN_ARGS:-} "$strata" "$command" "$@" &
mpirun_pid=$!
# A signal is passed on once the ranks exist (one that comes while mpirun still starts them
# waits for them).
stopping=0
trap 'stopping=1' TERM INT HUP
while kill -0 "$mpirun_pid" 2>/dev/null; do
  if [ "$stopping" = 1 ] && pkill -TERM -P "$mpirun_pid" 2>/dev/null; then stopping=2; fi
  sleep 0.2 || true  # a signal to the whole group ends the sleep early (set -e)
done
rc=0
wait "$mpirun_pid" || rc=$?
for f in "$STRATA_RANK_STATUS_DIR"/rank.*; do
  [ -e "$f" ] || continue
  status=$(cat "$f")
  if [ "$rc" = 0 ] && [ "$status" -gt 0 ] 2>/dev/null; then rc=$status; fi
done
rm -rf "$STRATA_RANK_STATUS_DIR"
exit "$rc"
