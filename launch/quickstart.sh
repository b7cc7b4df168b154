#!/usr/bin/env bash
# One command on a fresh Debian 12 machine: install what Strata needs, build it, and run the
# main job on the bundled model (stories260K, no GPU needed): a private redis-server on a
# free loopback port, a local cluster under mpirun (rank 0 coordinates, two pipeline stages)
# serving its request stream, sample prompts submitted with `strata submit --wait`, the
# results and the throughput printed. Everything it started is stopped at the end, also on
# Ctrl-C or a failure.
#   launch/quickstart.sh [extra `strata serve` options]
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${STRATA_MODEL:-../shared/models/stories260K}
REQUESTS=${STRATA_REQUESTS:-launch/quickstart-requests.jsonl}

bash scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)" --target strata
strata=build/launch/strata

work=$(mktemp -d)
redis_pid="" cluster_pid="" submit_pid=""
cleanup() {
  set +e
  [ -n "$submit_pid" ] && kill "$submit_pid" 2>/dev/null
  if [ -n "$cluster_pid" ] && kill -0 "$cluster_pid" 2>/dev/null; then
    kill -TERM "$cluster_pid" # the launcher forwards it: rank 0 finishes what runs, then exits
    wait "$cluster_pid" 2>/dev/null
  fi
  [ -n "$redis_pid" ] && kill "$redis_pid" 2>/dev/null && wait "$redis_pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
trap 'echo "quickstart: interrupted" >&2; exit 130' INT TERM

port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
url=redis://127.0.0.1:$port
redis-server --bind 127.0.0.1 --port "$port" --dir "$work" --save "" --appendonly yes \
  --appendfsync everysec --daemonize no >"$work/redis.log" 2>&1 &
redis_pid=$!
for _ in $(seq 100); do
  redis-cli -p "$port" ping >/dev/null 2>&1 && break
  sleep 0.1
done
redis-cli -p "$port" ping >/dev/null || { cat "$work/redis.log" >&2; exit 1; }
echo "quickstart: redis-server on $url (data in $work)" >&2

bash launch/local-cluster.sh 3 --model "$MODEL" --redis "$url" --micro-batches 2 --threads 1 \
  --grace-period 10 --stats-out "$work/stats.json" "$@" >"$work/cluster.log" 2>&1 &
cluster_pid=$!
echo "quickstart: cluster of 3 ranks serving stream strata:requests (log: $work/cluster.log)" >&2

"$strata" submit --redis "$url" --file "$REQUESTS" --wait --timeout 300 &
submit_pid=$!
while kill -0 "$submit_pid" 2>/dev/null; do
  if ! kill -0 "$cluster_pid" 2>/dev/null; then
    echo "quickstart: the cluster ended before the results came:" >&2
    tail -20 "$work/cluster.log" >&2
    exit 1
  fi
  sleep 0.2
done
wait "$submit_pid"
submit_pid=""

"$strata" collect --redis "$url" --out - 2>/dev/null |
  jq -c '{id, status, stop_reason, completion_tokens, text}'
kill -TERM "$cluster_pid"
wait "$cluster_pid" || true
cluster_pid=""
sed -n '/^run report:/,/^{/p' "$work/cluster.log" | grep -v '^{' >&2 || true
jq -r '"quickstart: \(.generated_tokens) tokens for \(.requests) requests in \(.seconds | . * 1000 | round / 1000) s of serving = \(.tokens_per_s | round) tok/s"' \
  "$work/stats.json"
