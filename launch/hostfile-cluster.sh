#!/usr/bin/env bash
# A cluster over the hosts of an Open MPI hostfile (one "host slots=N" per line): rank 0,
# the coordinator, runs on the first slot, the pipeline stages on the rest in order.
#   launch/hostfile-cluster.sh HOSTFILE NP [strata serve options...]
# Every host needs the strata binary at the same path (STRATA, default: this checkout's
# build/launch/strata) and the model at the path given by --model. Traffic goes over TCP
# (MPI_TCP_IF: the interface or subnet to use, e.g. eth0 or 10.0.0.0/24; default: Open MPI
# picks). MPIRUN_ARGS: more mpirun options (e.g. --mca plm_rsh_agent SCRIPT).
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 HOSTFILE NP [strata serve options...]" >&2
  exit 2
fi
hostfile=$1
np=$2
shift 2
[ -r "$hostfile" ] || { echo "$0: cannot read hostfile '$hostfile'" >&2; exit 2; }
here=$(cd "$(dirname "$0")/.." && pwd)
strata=${STRATA:-$here/build/launch/strata}
if [ "$(id -u)" = 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# shellcheck source=launch/redis-password.sh
. "$here/launch/redis-password.sh"
strip_redis_passwords "$@"
set -- ${redis_args[@]+"${redis_args[@]}"}
secret=()  # the environment of the remote ranks
if [ -n "${STRATA_REDIS_PASSWORD:-}" ]; then secret=(-x STRATA_REDIS_PASSWORD); fi
net=()
if [ -n "${MPI_TCP_IF:-}" ]; then
  net=(--mca pml ob1 --mca btl self,tcp --mca btl_tcp_if_include "$MPI_TCP_IF"
       --mca oob_tcp_if_include "$MPI_TCP_IF")
fi
# shellcheck disable=SC2086
exec mpirun -np "$np" --hostfile "$hostfile" --map-by slot --bind-to none \
  --mca orte_abort_on_non_zero_status 0 ${net[@]+"${net[@]}"} ${secret[@]+"${secret[@]}"} \
  ${MPIRUN_ARGS:-} \
  "$strata" serve "$@"
