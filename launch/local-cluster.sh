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
stopping=0
trap 'stopping=1' TERM INT HUP  # first: a stop while this script starts is not lost
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
if [ "$stopping" = 1 ]; then
  rm -rf "$STRATA_RANK_STATUS_DIR"
  exit 143  # stopped before anything started
fi
# shellcheck disable=SC2086
setsid mpirun -np "$np" --oversubscribe --bind-to none \
  --mca orte_abort_on_non_zero_status 0 ${MPIRUN_ARGS:-} "$strata" "$command" "$@" &
mpirun_pid=$!
# A signal is passed on to each rank once it is ready for it: a rank blocks stop signals
# before main() and says so with a file (launch/job_control.h); one signalled earlier,
# while the loader still maps its libraries, would die of it, and mpirun would then wait
# forever for ranks stuck in MPI_Init. A rank gone before its start was over (no
# started.PID file) stops the others (their start then ends within 5 s of the signal), and
# ranks that are all gone while mpirun stays (it does, when one died starting) are not
# waited for past 2 s.
signalled=" "
seen=""
start_failed=0
had_ranks=0
childless=0
forced=0
while kill -0 "$mpirun_pid" 2>/dev/null; do
  # A stop signal to this script's process group also reaches pgrep, which does not share
  # the trap: its death is a look missed, not the script's end (set -e would make it one and
  # leave mpirun running); pgrep says 1 for no rank. No command substitution: a subshell
  # would die the same way, and a trap run while bash parses one can break the parse.
  look=0
  pgrep -P "$mpirun_pid" >"$STRATA_RANK_STATUS_DIR/children" || look=$?
  [ "$look" -le 1 ] || continue
  mapfile -t listed <"$STRATA_RANK_STATUS_DIR/children"
  ranks=${listed[*]:-}
  for pid in $seen; do  # a rank gone before its start was over: the others cannot start
    case " $ranks " in *" $pid "*) continue ;; esac
    if [ ! -e "$STRATA_RANK_STATUS_DIR/started.$pid" ] && [ "$stopping" = 0 ]; then
      echo "$0: rank process $pid ended while the job started; stopping the others" >&2
      stopping=1
      start_failed=1
    fi
  done
  seen=$ranks
  if [ "$stopping" = 1 ]; then
    for pid in $ranks; do
      case "$signalled" in *" $pid "*) continue ;; esac
      if [ -e "$STRATA_RANK_STATUS_DIR/ready.$pid" ] && kill -TERM "$pid" 2>/dev/null; then
        signalled="$signalled$pid "
      fi
    done
  fi
  if [ -n "$ranks" ]; then
    had_ranks=1
  elif [ "$had_ranks" = 1 ]; then
    childless=$((childless + 1))
    if [ "$childless" -ge 10 ] && [ "$forced" = 0 ]; then
      echo "$0: every rank has ended but mpirun has not; ending it" >&2
      forced=1
      kill -KILL "$mpirun_pid" 2>/dev/null || true
    fi
  fi
  sleep 0.2 || true  # a signal to the whole group ends the sleep early (set -e)
done
rc=0
wait "$mpirun_pid" || rc=$?
# Rank 0 names the job's status when it leaves one (a dead worker: 1, not the 137 of the
# killed rank that mpirun reports); else the first failing rank's, or mpirun's.
status_in() {  # VAR FILE; read is a builtin: a second stop signal cannot end it, as above
  local value=1
  read -r value <"$2" || read -r value <"$2" || value=1
  printf -v "$1" '%s' "$value"
}
if [ -e "$STRATA_RANK_STATUS_DIR/rank.0" ]; then
  status_in rc "$STRATA_RANK_STATUS_DIR/rank.0"
else
  status=0
  for f in "$STRATA_RANK_STATUS_DIR"/rank.*; do
    [ -e "$f" ] || continue
    status_in status "$f"
    if [ "$rc" = 0 ] && [ "$status" -gt 0 ] 2>/dev/null; then rc=$status; fi
  done
fi
if [ "$start_failed" = 1 ]; then
  rc=1  # a rank died starting: the job failed, whatever the stopped ranks said
elif [ "$forced" = 1 ] && [ ! -e "$STRATA_RANK_STATUS_DIR/rank.0" ]; then
  rc=1
  if [ "$stopping" = 1 ]; then rc=143; fi
fi
# A stop signal may end rm as it ends pgrep: again, then leave the folder rather than the status.
rm -rf "$STRATA_RANK_STATUS_DIR" || rm -rf "$STRATA_RANK_STATUS_DIR" || true
exit "$rc"
