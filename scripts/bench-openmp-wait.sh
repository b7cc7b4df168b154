#!/usr/bin/env bash
# Decode on a shared node (docs/BENCHMARKS.md, "OpenMP threads on a shared node"): strata's
# spin count (GOMP_SPINCOUNT=1000, set by strata itself) against libgomp's default (300000),
# with 0, 1 and 2 busy processes beside a run of `nproc` threads, interleaved REPS times.
# dummy:llama-110m in f32, prompt 128, gen 32, batch BATCH (1). One JSON line per run.
#   scripts/bench-openmp-wait.sh [BUILD_DIR] > OUT.jsonl
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
THREADS=${THREADS:-$(nproc)}
hogs=()
stop_hogs() {
  for p in "${hogs[@]}"; do kill "$p" 2>/dev/null; done
  hogs=()
}
trap stop_hogs EXIT
for rep in $(seq "${REPS:-3}"); do
  for busy in 0 1 2; do
    for _ in $(seq "$busy"); do
      (while :; do :; done) &
      hogs+=($!)
    done
    for spin in 1000 300000; do
      GOMP_SPINCOUNT=$spin timeout 600 "$BUILD/launch/strata" bench --model dummy:llama-110m \
        --dtype f32 --prompt-len 128 --gen-len 32 --batch "${BATCH:-1}" --threads "$THREADS" \
        --warmup 1 --no-limits 2>/dev/null |
        python3 -c "
import json, sys
d = json.load(sys.stdin)
print(json.dumps({'rep': int(sys.argv[1]), 'busy_processes': int(sys.argv[2]),
                  'GOMP_SPINCOUNT': d['openmp_wait']['GOMP_SPINCOUNT'], 'threads': d['threads'],
                  'batch': d['batch'], 'decode_step_ms': round(d['decode_step_seconds'] * 1e3, 2)}))
" "$rep" "$busy"
    done
    stop_hogs
  done
done
