#!/usr/bin/env bash
# The single-node engine benchmark of docs/BENCHMARKS.md: dummy:llama-110m in f32, prompt
# 128, gen 64, batch 1 and 32, this machine's limits measured in the same run.
#   scripts/bench-engine.sh [BUILD_DIR] [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
OUT=${2:-docs/bench}
THREADS=${THREADS:-$(nproc)}
mkdir -p "$OUT"
for batch in 1 32; do
  "$BUILD/launch/strata" bench --model dummy:llama-110m --dtype f32 --prompt-len 128 --gen-len 64 \
    --batch "$batch" --threads "$THREADS" --max-step-tokens 4096 >"$OUT/llama-110m-f32-b$batch.json"
  python3 - "$OUT/llama-110m-f32-b$batch.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
r, l = d["result"], d["limits"]
print(f"batch {d['batch']:>2}: generation {r['generation_tokens_per_s']:.1f} tok/s, decode {r['decode_tokens_per_s']:.1f} tok/s, "
      f"prefill {r['prefill_seconds']:.3f} s, decode step {d['decode_step_seconds']*1e3:.2f} ms "
      f"(read bound {d['decode_read_bound_step_seconds']*1e3:.2f} ms = {d['decode_fraction_of_read_bound']:.0%}, "
      f"paired with the read stream {d['decode_read_bound_paired']['median_fraction']:.0%} "
      f"(weights only {d['decode_read_bound_paired']['weights_only']['median_fraction']:.0%}), "
      f"triad bound {d['decode_fraction_of_bandwidth_bound']:.0%}), {d['achieved_gflops']:.1f} GFLOP/s = "
      f"{d['generation_fraction_of_gemm_peak']:.0%} of GEMM peak {l['gemm_gflops']:.0f}, peak RSS {d['peak_rss_bytes']/2**20:.0f} MiB")
PY
done
