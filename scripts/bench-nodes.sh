#!/usr/bin/env bash
# A model larger than every node's host budget and than their sum (docs/BENCHMARKS.md,
# "A model no node holds"): NP-1 worker ranks each under --cpu-mem BUDGET streaming from a
# disk folder, against one worker streaming the same model under the same budget, the same
# requests. Prints and keeps one JSON: each run's throughput and requests, and each stage's
# layers, allocation, peak resident growth and disk reads against that node's measured
# O_DIRECT rate (the node cache the workers read, ~/.cache/strata/nodes: a disk is measured
# once; remove its entry to measure it again).
#   scripts/bench-nodes.sh [BUILD_DIR] [OUT_JSON]
# MODEL (dummy:opt-1.3b), DTYPE (f16), NP (4), BUDGET (512MiB), REQUESTS (200), PROMPT (16),
# GEN (8), MICRO (1: a streamed layer is read once per micro-batch, so more read it more
# often), MAX_BATCH (32), THREADS (1), DISK (a folder on the disk; /var/tmp).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
OUT=${2:-docs/bench/nodes-$(echo "${MODEL:-dummy:opt-1.3b}" | tr ':/' '__').json}
MODEL=${MODEL:-dummy:opt-1.3b}
NP=${NP:-4}
BUDGET=${BUDGET:-512MiB}
PROMPT=${PROMPT:-16}
GEN=${GEN:-8}
work=$(mktemp -d "${DISK:-/var/tmp}/strata-bench-nodes.XXXXXX")
trap 'rm -rf "$work"' EXIT
python3 - "${REQUESTS:-200}" "$PROMPT" "$GEN" >"$work/req.jsonl" <<'PY'
import json, sys
n, p, g = map(int, sys.argv[1:4])
for i in range(n):
    ids = [2] + [(i * 131 + j * 17) % 50000 + 3 for j in range(p - 1)]
    print(json.dumps({"id": f"r{i}", "prompt_ids": ids, "max_new_tokens": g, "ignore_eos": True}))
PY
run() {  # NAME NP MICRO
  mkdir -p "$work/$1"
  STRATA=$BUILD/launch/strata STRATA_LOG_LEVEL=warn bash launch/local-cluster.sh "$2" \
    --model "$MODEL" --dtype "${DTYPE:-f16}" --threads "${THREADS:-1}" --cpu-mem "$BUDGET" \
    --disk-dir "$work/$1" --max-batch "${MAX_BATCH:-32}" --micro-batches "$3" \
    --max-context $((PROMPT + GEN)) --requests "$work/req.jsonl" --results "$work/$1.jsonl" \
    --stats-out "$work/$1.stats.json" >"$work/$1.log" 2>&1 || { cat "$work/$1.log"; exit 1; }
}
run cluster "$NP" "${MICRO:-1}"
run one 2 1
python3 - "$work" "$MODEL" "$BUDGET" "${REQUESTS:-200}" "$OUT" <<'PY'
import glob, json, os, sys
work, model, budget, requests, out = sys.argv[1:6]
# The rates the workers used: kept per disk (device number), as worker/node_probe.cpp does.
rates = {}
for f in sorted(glob.glob(os.path.expanduser("~/.cache/strata/nodes/*.json")), key=os.path.getmtime):
    j = json.load(open(f))
    if "disk_device" in j: rates[j["disk_device"]] = j["disk_read_gbs"]
report = {"model": model, "budget_per_node": budget, "requests": int(requests)}
for name in ("cluster", "one"):
    s = json.load(open(f"{work}/{name}.stats.json"))
    results = [json.loads(l) for l in open(f"{work}/{name}.jsonl")]
    lost = int(requests) - sum(1 for r in results if r.get("stop_reason") in ("length", "eos"))
    stages = []
    for st in s["stages"]:
        disk_rate = rates.get(os.stat(work).st_dev, 0.0)
        read_gbs = st["bytes_from_disk"] / st["busy_seconds"] / 1e9 if st["busy_seconds"] > 0 else 0
        stages.append({"rank": st["rank"], "layers": st["layers"], "allocated": st["allocated"],
                       "peak_rss_growth_bytes": st["peak_rss_bytes"] - st["rss_before_load_bytes"],
                       "bytes_from_disk": st["bytes_from_disk"], "busy_seconds": st["busy_seconds"],
                       "disk_read_gbs_while_busy": read_gbs, "measured_o_direct_gbs": disk_rate,
                       "fraction_of_measured": read_gbs / disk_rate if disk_rate > 0 else None})
    report[name] = {"ranks": s["ranks"], "micro_batches": s["micro_batches"],
                    "tokens_per_s": s["tokens_per_s"], "steady_tokens_per_s": s["steady_tokens_per_s"],
                    "generated_tokens": s["generated_tokens"], "seconds": s["seconds"],
                    "results": len(results), "lost": lost, "stages": stages}
report["cluster_over_one"] = report["cluster"]["tokens_per_s"] / report["one"]["tokens_per_s"]
os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
json.dump(report, open(out, "w"), indent=2)
print(json.dumps(report, indent=2))
PY
