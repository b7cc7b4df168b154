#!/usr/bin/env bash
# The offloading engine on a GPU (docs/GPU.md): dummy:opt-6.7b in f16 (13.4 GB of weights)
# with every weight placement FlexGen's policy can name at layer granularity, overlap on and
# off, and the KV cache off the device with and without CPU attention. One JSON per run.
#   scripts/bench-gpu.sh STRATA_BINARY OUT_DIR [MODEL]
set -uo pipefail
BIN=$1
OUT=$2
MODEL=${3:-dummy:opt-6.7b}
mkdir -p "$OUT"
common=(--model "$MODEL" --dtype f16 --device cuda --prompt-len 128 --warmup 1 --no-limits --disk-dir "${DISK_DIR:-/tmp}")
run() {  # name, extra args...
  local name=$1
  shift
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  echo "== $name: $*"
  timeout 300 "$BIN" bench "${common[@]}" "$@" >"$OUT/$name.json" 2>"$OUT/$name.log" || {
    echo "   FAILED (exit $?)"
    tail -3 "$OUT/$name.log"
    return
  }
  python3 - "$OUT/$name.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
r = d["result"]
f = d.get("feed", {})
print(f"   {d['weight_placement']}")
print(f"   generation {r['generation_tokens_per_s']:.1f} tok/s, decode {r['decode_tokens_per_s']:.1f} tok/s, "
      f"decode step {d['decode_step_seconds']*1e3:.1f} ms, prefill {r['prefill_seconds']:.2f} s; "
      f"h2d {d.get('device_limits', {}).get('host_to_device_gbs', 0):.1f} GB/s, "
      f"streamed {(f.get('bytes_cpu_to_gpu', 0) + f.get('bytes_disk_to_gpu', 0))/1e9:.1f} GB, "
      f"h2d bound {f.get('host_to_device_bound_seconds', 0):.2f} s of {r['prefill_seconds'] + r['decode_seconds']:.2f} s "
      f"= {f.get('fraction_of_host_to_device_bound', 0):.0%}; compute bound {d.get('compute_bound_seconds', 0):.3f} s "
      f"({d.get('device_limits', {}).get('linear_f16_tflops', 0):.0f} TFLOP/s f16 linear)")
PY
}
run resident-b16 --batch 16 --gen-len 32
run resident-b1 --batch 1 --gen-len 32
run cpu100-overlap-b16 --batch 16 --gen-len 8 --policy w=0/100/0
run cpu100-nooverlap-b16 --batch 16 --gen-len 8 --policy w=0/100/0,overlap=0
run gpu50-cpu50-b16 --batch 16 --gen-len 8 --policy w=50/50/0
run cache-cpu-attn-b16 --batch 16 --gen-len 32 --policy w=100/0/0,c=0/100/0,cpu_attn=1
run cache-cpu-staged-b16 --batch 16 --gen-len 8 --policy w=100/0/0,c=0/100/0,cpu_attn=0
run disk40-b16 --batch 16 --gen-len 4 --policy w=20/40/40
# 4-bit weights: a streamed layer moves 0.625 bytes per weight instead of 2.
run cpu100-q4-b16 --batch 16 --gen-len 8 --policy w=0/100/0,cw=1
run resident-q4-b16 --batch 16 --gen-len 32 --policy w=100/0/0,cw=1
# 4-bit KV cache on the GPU and on the host with CPU attention.
run cache-q4-gpu-b16 --batch 16 --gen-len 32 --policy w=100/0/0,c=100/0/0,cc=1
run cache-q4-cpu-attn-b16 --batch 16 --gen-len 32 --policy w=100/0/0,c=0/100/0,cc=1,cpu_attn=1
# Zig-zag: 32 sequences as 2 GPU batches of 16 share one fetch of each layer.
run block-2x16-cpu100 --batch 32 --gen-len 8 --policy gbs=16,ngb=2,w=0/100/0
