#!/usr/bin/env bash
# The scheduler against a real local cluster (docs/SCHEDULING.md, "Real runs"): for each
# task, requests whose lengths follow it (scripts/workload-requests.py), a run with
# --latency-bound inf (it profiles the stages and saves the profile), then runs at tighter
# bounds taken as the paper takes them (the FT-style baseline's latencies over its
# configurations, `strata plan --paper-bounds`, at the bottom 30% and 70%) on the same
# profile. Each run's summary (predicted and measured throughput and p99 latency) goes to
# OUT/schedule-MODEL-npNP-TASK-BOUND.json and a line is printed.
#   scripts/bench-schedule.sh [BUILD_DIR] [OUT_DIR]
# MODEL (dummy:opt-125m), NP (2), TASKS ("S C1"), SCALE (0.25), REQUESTS (200),
# MAX_BATCH (64), BOUNDS ("inf 0.7 0.3": inf and fractions of the baseline's latencies),
# POLICY (empty: what the search picks; rra, waa-c or waa-m: that allocation only, named in
# the file: schedule-MODEL-npNP-POLICY-TASK-BOUND.json).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
OUT=${2:-docs/bench}
MODEL=${MODEL:-dummy:opt-125m}
NP=${NP:-2}
SCALE=${SCALE:-0.25}
mkdir -p "$OUT"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
case "$MODEL" in dummy:llama*) vocab=32000 ;; dummy:*) vocab=50272 ;; *) vocab=512 ;; esac
tag=$(echo "${MODEL#dummy:}" | tr '/' '_' | sed 's/.*_//')
for task in ${TASKS:-S C1}; do
  req=$work/$task.jsonl
  python3 scripts/workload-requests.py --task "$task" --scale "$SCALE" \
    --requests "${REQUESTS:-200}" --vocab "$vocab" >"$req"
  context=$(python3 - "$req" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
# The simulator sizes the KV cache for the longest input plus the longest output.
print(max(len(r["prompt_ids"]) for r in rows) + max(r["max_new_tokens"] for r in rows))
PY
)
  profile=$work/profile-$task.json
  for bound in ${BOUNDS:-inf 0.7 0.3}; do
    seconds=$bound
    if [ "$bound" != inf ]; then
      seconds=$(STRATA_LOG_LEVEL=off "$BUILD/launch/strata" plan --model "$MODEL" --dtype f32 \
        --profile "$profile" --workload "$req" --paper-bounds --rra-only --host-compute \
        --max-batch "${MAX_BATCH:-64}" --format json | python3 -c '
import json, sys
runs = json.load(sys.stdin)
want = {"0.7": 2, "0.3": 1, "0.1": 0}[sys.argv[1]]
print(runs[want]["latency_bound_s"])' "$bound")
    fi
    name=$OUT/schedule-$tag-np$NP${POLICY:+-$POLICY}-$task-$bound.json
    policy=()
    [ -n "${POLICY:-}" ] && policy=(--schedule-policy "$POLICY")
    STRATA=$BUILD/launch/strata STRATA_LOG_LEVEL=warn bash launch/local-cluster.sh "$NP" \
      --model "$MODEL" --threads 1 --requests "$req" --results /dev/null --workload "$req" \
      --latency-bound "$seconds" --max-batch "${MAX_BATCH:-64}" --max-context "$context" \
      --layer-profile "$profile" --stats-out "$name" "${policy[@]}" 2>"$work/log" || {
      # A bound this allocation cannot meet is a result too: the refusal names the fastest.
      grep -o "cannot be met.*p99 latency is [0-9.]* s" "$work/log" >&2 && continue
      tail -20 "$work/log" >&2
      exit 1
    }
    python3 - "$name" "$task" "$bound" "$seconds" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
s = d["schedule"]
pt, mt = s["predicted_throughput_tok_s"], s["achieved_throughput_tok_s"]
pl, ml, ma = s["predicted_p99_latency_s"], s["measured_p99_latency_s"], s["measured_p99_all_latency_s"]
print(f"{sys.argv[2]:>3} bound {sys.argv[3]:>4} ({float(sys.argv[4]):.3f} s): {s['policy']} "
      f"{json.dumps(s['control_variables'])} layers {s['allocation_text']}: throughput predicted "
      f"{pt:.1f} measured {mt:.1f} tok/s ({100 * (mt / pt - 1):+.0f}%), p99 latency predicted "
      f"{pl:.3f} measured {ml:.3f} s ({100 * (ml / pl - 1):+.0f}%; p99 over every length {ma:.3f} s)"
      + (f"; KV hand-over {d['waa']['kv_bytes_per_sequence']:.0f} B/seq, "
         f"{1e3 * d['waa']['seconds_per_handover']:.2f} ms per hand-over of "
         f"{d['waa']['sequences'] / max(d['waa']['handovers'], 1):.2f} seqs" if "waa" in d else ""))
PY
  done
done
