#!/usr/bin/env bash
# The cluster benchmark of docs/BENCHMARKS.md: NP ranks (rank 0 coordinates, NP-1 pipeline
# stages) on one machine, the same requests with 1 and with several micro-batches in flight;
# prints throughput and the bubble fraction of every stage, and keeps each run's JSON.
#   scripts/bench-cluster.sh [BUILD_DIR] [OUT_DIR]
# MODEL (default dummy:opt-125m), NP (3), REQUESTS (16), PROMPT (32), GEN (32),
# MICRO ("1 2 4"), DECODE_ITERS (8), THREADS (1 per rank), SERVE_ARGS (more serve options,
# e.g. "--device cuda --dtype f16 --policy w=0/100/0" for GPU stages), TAG (added to the
# JSON names).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
OUT=${2:-docs/bench}
MODEL=${MODEL:-dummy:opt-125m}
NP=${NP:-3}
mkdir -p "$OUT"
req=$(mktemp)
trap 'rm -f "$req"' EXIT
python3 - "${REQUESTS:-16}" "${PROMPT:-32}" "${GEN:-32}" >"$req" <<'PY'
import json, sys
n, p, g = map(int, sys.argv[1:4])
for i in range(n):
    ids = [2] + [(i * 131 + j * 17) % 50000 + 3 for j in range(p - 1)]
    print(json.dumps({"id": i, "prompt_ids": ids, "max_new_tokens": g, "ignore_eos": True}))
PY
for k in ${MICRO:-1 2 4}; do
  name=$OUT/cluster-$(echo "${MODEL#dummy:}" | tr '/' '_')-np$NP${TAG:+-$TAG}-mb$k.json
  STRATA=$BUILD/launch/strata STRATA_LOG_LEVEL=warn bash launch/local-cluster.sh "$NP" --model "$MODEL" \
    --threads "${THREADS:-1}" --requests "$req" --results /dev/null --micro-batches "$k" \
    --decode-iters "${DECODE_ITERS:-8}" --max-context $((${PROMPT:-32} + ${GEN:-32})) \
    --stats-out "$name" ${SERVE_ARGS:-} 2>/dev/null
  python3 - "$name" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
stages = ", ".join(f"rank {s['rank']} {s['bubble_fraction']:.0%}" for s in d["stages"])
print(f"{d['micro_batches']} micro-batches: {d['tokens_per_s']:.1f} tok/s ({d['generated_tokens']} tokens in "
      f"{d['seconds']:.2f} s, {d['prefill_steps']} prefill + {d['decode_steps']} decode steps); bubble: {stages}")
PY
done
