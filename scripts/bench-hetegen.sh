#!/usr/bin/env bash
# HeteGen's mechanics on a CPU-only machine (docs/PIE_HETEGEN.md, "HeteGen on an engine:
# measured mechanics"): decode at batch 1 of a model whose weights do not fit --gpu-mem, with
# --device host (a CPU backend standing in for the device, one core; the CPU shares on the
# other). Runs FlexGen's whole-layer streaming, HeteGen at two fixed alphas, at the alphas the
# alpha benchmark chooses, and with the module scheduler; prints one JSON object per run:
# bytes copied host -> device per step, the CPU share's time per step, tokens/s. The copies
# are host memcpys here, so these show bytes and mechanics, not speed.
# On a GPU: DEVICE=cuda DTYPE=f16 THREADS=16 CPU_THREADS=14 scripts/bench-hetegen.sh BIN MODEL MEM
# (the copies are then real PCIe transfers and the CPU shares run beside them).
# RUNS="name ..." runs only those. Usage: scripts/bench-hetegen.sh [STRATA_BINARY] [MODEL] [GPU_MEM]
set -euo pipefail
STRATA=${1:-build-hg/launch/strata}
MODEL=${2:-dummy:llama-12m}
GPU_MEM=${3:-42MiB}
GEN=${GEN:-64}
DEVICE=${DEVICE:-host}
DTYPE=${DTYPE:-f32}
THREADS=${THREADS:-1}
CPU_THREADS=${CPU_THREADS:-1}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
export STRATA_PROFILE_DIR=${STRATA_PROFILE_DIR:-$TMP/profile}

run() {
  local name=$1
  shift
  if [ -n "${RUNS:-}" ] && [[ " $RUNS " != *" $name "* ]]; then return 0; fi
  "$STRATA" bench --model "$MODEL" --dtype "$DTYPE" --device "$DEVICE" --threads "$THREADS" \
    --max-step-tokens 16 --batch 1 \
    --prompt-len 8 --gen-len "$GEN" --warmup 0 --gpu-mem "$GPU_MEM" "$@" \
    >"$TMP/$name.json" 2>"$TMP/$name.err" || {
    echo "{\"run\": \"$name\", \"failed\": \"$(tail -1 "$TMP/$name.err" | tr -d '"\\')\"}"
    return 0
  }
  python3 - "$name" "$TMP/$name.json" "$TMP/$name.err" "$*" <<'PY'
import json, re, sys
name, out, err, args = sys.argv[1:]
j = json.load(open(out))
r, f = j["result"], j.get("feed", {})
steps = r["prefill_steps"] + r["decode_steps"]
copied = f.get("bytes_cpu_to_gpu", 0) + f.get("bytes_disk_to_gpu", 0) + f.get("bytes_alpha_shares_to_gpu", 0)
log = open(err).read()
alphas = {m.group(1): float(m.group(2)) for m in
          re.finditer(r"alpha benchmark: (\w+) module .*?: alpha ([0-9.]+)", log)}
sched = re.search(r"module scheduler: (\d+) of (\d+) modules whole", log)
print(json.dumps({
    "run": name,
    "options": args,
    "layers_gpu_cpu_disk": f.get("layers_gpu_cpu_disk"),
    "alpha": alphas or f.get("hetegen_alpha"),
    "modules_whole": f"{sched.group(1)}/{sched.group(2)}" if sched else None,
    "bytes_to_device_per_step": round(copied / steps),
    "alpha_share_bytes_per_pass": f.get("alpha_share_bytes_per_pass", 0),
    "cpu_share_ms_per_step": round(1e3 * f.get("cpu_share_seconds", 0) / steps, 3),
    "decode_step_ms": round(1e3 * j["decode_step_seconds"], 3),
    "h2d_gbs": j.get("device_limits", {}).get("host_to_device_gbs"),
    "pcie_bound_ms_per_step": round(copied / steps / j["device_limits"]["host_to_device_gbs"] / 1e6, 3)
    if j.get("device_limits", {}).get("host_to_device_gbs") else None,
    "decode_tokens_per_s": r["decode_tokens_per_s"],
}))
PY
}

run flexgen-stream --policy w=0/100/0
run hetegen-0.3 --policy w=0/100/0 --hetegen-alpha 0.3 --hetegen-cpu-threads "$CPU_THREADS"
run hetegen-0.7 --policy w=0/100/0 --hetegen-alpha 0.7 --hetegen-cpu-threads "$CPU_THREADS"
run hetegen-auto --policy w=0/100/0 --hetegen-alpha auto --hetegen-cpu-threads "$CPU_THREADS"
run hetegen-auto-scheduler --hetegen-alpha auto --hetegen-cpu-threads "$CPU_THREADS"
