#!/usr/bin/env bash
# A 3-rank cluster whose ranks are separate hosts: three network namespaces on a bridge,
# each rank in its own namespace with its own hostname, MPI over TCP only (no shared
# memory), started through launch/hostfile-cluster.sh with a launcher that enters the
# namespace instead of ssh (../shared/ENVIRONMENT.md). Results must equal the
# single-process run. Exits 77 (ctest: skipped) with the reason where namespaces cannot be
# made (not root, no `ip`, a container without CAP_NET_ADMIN).
#   test_cluster_netns.sh STRATA MODEL_DIR
set -euo pipefail
strata=$1
model=$2
root=$(cd "$(dirname "$0")/../.." && pwd)
skip() { echo "SKIP: $*"; exit 77; }
[ "$(id -u)" = 0 ] || skip "creating network namespaces needs root"
command -v ip >/dev/null || skip "no 'ip' command (iproute2)"
command -v unshare >/dev/null || skip "no 'unshare' command (util-linux)"

tag=st$(($$ % 10000))
net=10.231.$(($$ % 250))
tmp=$(mktemp -d)
cleanup() {
  for i in 0 1 2; do ip netns del "${tag}h$i" 2>/dev/null || true; done
  ip link del "br$tag" 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT
ip netns add "${tag}h0" 2>/dev/null || skip "cannot create network namespaces here (ip netns add failed)"
ip link add "br$tag" type bridge || skip "cannot create a bridge here"
ip addr add "$net.1/24" dev "br$tag"
ip link set "br$tag" up
for i in 0 1 2; do
  ns=${tag}h$i
  [ "$i" = 0 ] || ip netns add "$ns"
  ip link add "v$tag$i" type veth peer name eth0 netns "$ns"
  ip link set "v$tag$i" master "br$tag" up
  ip -n "$ns" addr add "$net.$((10 + i))/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  echo "$net.$((10 + i)) slots=1" >>"$tmp/hosts"
done
# Open MPI's "ssh": run the daemon for host $1 inside its namespace, under its own hostname.
cat >"$tmp/agent.sh" <<AGENT
#!/bin/sh
host=\$1
shift
i=\${host##*.}
exec ip netns exec "${tag}h\$((i - 10))" unshare --uts sh -c "hostname node\$((i - 10)); \$*"
AGENT
chmod +x "$tmp/agent.sh"

cat >"$tmp/req.jsonl" <<'JSON'
{"id": "a", "prompt": "Once upon a time", "max_new_tokens": 24}
{"id": "b", "prompt": "The cat sat", "max_new_tokens": 6}
{"id": "c", "prompt": "Lily and Tom went to the park", "max_new_tokens": 16}
JSON
export STRATA_LOG_LEVEL=${STRATA_LOG_LEVEL:-warn}
"$strata" serve --model "$model" --threads 1 --requests "$tmp/req.jsonl" --results "$tmp/one.jsonl" 2>/dev/null
STRATA=$strata STRATA_LOG_LEVEL=info MPI_TCP_IF="$net.0/24" \
  MPIRUN_ARGS="--mca plm_rsh_agent $tmp/agent.sh --mca plm_rsh_no_tree_spawn 1 --mca btl_tcp_disable_family 6" \
  timeout -k 5 60 bash "$root/launch/hostfile-cluster.sh" "$tmp/hosts" 3 --model "$model" --threads 1 \
  --requests "$tmp/req.jsonl" --results "$tmp/three.jsonl" --micro-batches 2 2>"$tmp/err" ||
  { cat "$tmp/err"; exit 1; }
for r in 0 1 2; do  # each rank on its own host
  grep -q "rank $r/3 on node$r" "$tmp/err" || { cat "$tmp/err"; echo "FAIL: rank $r not on node$r"; exit 1; }
done
a=$(jq -c '[.id, .output_ids]' "$tmp/one.jsonl" | sort)
b=$(jq -c '[.id, .output_ids]' "$tmp/three.jsonl" | sort)
[ "$a" = "$b" ] || { echo "FAIL: across namespaces"; echo "$b"; echo "single process:"; echo "$a"; exit 1; }
echo "3 ranks on 3 network namespaces (TCP over veth): $(wc -l <"$tmp/three.jsonl") results equal the single process"
