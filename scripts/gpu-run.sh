#!/usr/bin/env bash
# Runs on a lent GPU machine, from the checkout's root, over the archive that
# scripts/gpu-bundle.sh made (docs/GPU.md, "A session on a lent GPU"). Each step named in
# STEPS writes its log and JSON under OUT_DIR; a failing step is reported and the next runs.
#   STEPS="tests hetegen pie flexgen" scripts/gpu-run.sh BUNDLE.tgz OUT_DIR
set -uo pipefail
BUNDLE=$1
OUT=$2
STEPS=${STEPS:-tests}
B=/tmp/strata-bundle
mkdir -p "$B" "$OUT"
tar -C "$B" -xzf "$BUNDLE"
nccl=$(find / -xdev -name 'libnccl.so.2' -path '*nvidia*' 2>/dev/null | head -1)
export LD_LIBRARY_PATH="$B/lib:/usr/local/cuda/lib64:$(dirname "${nccl:-/x/x}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# The test binaries read stories260K where the build machine had it.
mkdir -p /work/shared/models
[ -d /work/shared/models/stories260K ] || cp -r "$B/model/stories260K" /work/shared/models/
export PATH="$B/bin:$PATH"
STRATA=$B/bin/strata
export STRATA_PROFILE_DIR=/tmp/strata-profile
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nproc
  free -g | head -2
  echo "nccl: ${nccl:-none}"
} 2>&1 | tee "$OUT/machine.txt"

step() { [[ " $STEPS " == *" $1 "* ]]; }

if step tests; then
  for t in "$B"/bin/test_*; do
    if [ -n "${TESTS:-}" ] && [[ " $TESTS " != *" $(basename "$t") "* ]]; then continue; fi
    name=$(basename "$t")
    (cd /tmp && timeout 300 "$t" --gtest_brief=1) >"$OUT/$name.log" 2>&1
    echo "$name: exit $? $(grep -E '^\[  (PASSED|FAILED|SKIPPED)' "$OUT/$name.log" | tr '\n' ' ')"
  done 2>&1 | tee "$OUT/tests.txt"
fi

if step kernels; then
  # The kernel benchmarks (JSON lines), fused kernels against what they replace: cuBLAS for
  # every linear (STRATA_CUDA_GEMV=off) and the one-block-per-(row, head) attention.
  t=$B/bin/test_cuda_backend
  f='--gtest_also_run_disabled_tests --gtest_filter=*DISABLED_*Throughput*'
  (cd /tmp && timeout 120 "$t" $f) 2>&1 | grep '^{' | sed 's/^{/{"variant": "fused", /' | tee "$OUT/kernels.jsonl"
  if [ "${KERNELS_BEFORE:-1}" = 1 ]; then
    (cd /tmp && STRATA_CUDA_GEMV=off STRATA_CUDA_ATTENTION=simple timeout 120 "$t" $f) 2>&1 |
      grep '^{' | sed 's/^{/{"variant": "before", /' | tee -a "$OUT/kernels.jsonl"
  fi
fi

if step engine; then
  # dummy:opt-6.7b f16 on the GPU, prompt 512, gen 32, with the new kernels and without.
  for variant in ${ENGINE_VARIANTS:-fused before}; do
    envs=()
    [ "$variant" = before ] && envs=(STRATA_CUDA_GEMV=off STRATA_CUDA_ATTENTION=simple)
    for run in "b1 --batch 1" "b16 --batch 16" "q4-b1 --batch 1 --policy w=100/0/0,cw=1" \
               "q4-b16 --batch 16 --policy w=100/0/0,cw=1"; do
      name=${run%% *}
      if [ -n "${ENGINE_RUNS:-}" ] && [[ " $ENGINE_RUNS " != *" $name "* ]]; then continue; fi
      env "${envs[@]}" timeout 200 "$STRATA" bench --model dummy:opt-6.7b --dtype f16 \
        --device cuda ${run#* } --prompt-len 512 --gen-len 32 --max-step-tokens 8192 --warmup 1 \
        --no-limits >"$OUT/engine-$variant-$name.json" 2>"$OUT/engine-$variant-$name.log"
      python3 -c "
import json,sys; d=json.load(open(sys.argv[1])); r=d['result']
print(sys.argv[2], sys.argv[3], 'gen %.1f tok/s, decode %.1f tok/s, step %.2f ms, prefill %.3f s' % (
  r['generation_tokens_per_s'], r['decode_tokens_per_s'], d['decode_step_seconds']*1e3, r['prefill_seconds']))
" "$OUT/engine-$variant-$name.json" "$variant" "$name" 2>&1 | tail -1
    done
  done | tee "$OUT/engine.txt"
fi

if step limits; then
  timeout 120 "$STRATA" limits --threads "$(nproc)" >"$OUT/cpu-limits.json" 2>"$OUT/cpu-limits.log"
  cat "$OUT/cpu-limits.json"
fi

if step flexgen; then
  # FlexGen itself and Strata with the same policy, prompt 512, gen 32 (issue 14 item 4).
  (cd "$B/flexgen" && timeout 300 python3 run_flexgen.py --model facebook/opt-6.7b \
    --percent 100 0 100 0 100 0 --gpu-batch-size 16 --prompt-len 512 --gen-len 32 \
    --offload-dir /tmp/fg --log-file "$OUT/flexgen-6.7b.log") >"$OUT/flexgen-6.7b.out" 2>&1
  tail -5 "$OUT/flexgen-6.7b.out"
  timeout 300 "$STRATA" bench --model dummy:opt-6.7b --dtype f16 --device cuda --batch 16 \
    --prompt-len 512 --gen-len 32 --warmup 1 --no-limits >"$OUT/strata-6.7b.json" \
    2>"$OUT/strata-6.7b.log"
  grep -E '"(generation|decode|prefill)_tokens_per_s"|prefill_seconds|decode_seconds' \
    "$OUT/strata-6.7b.json" | head -8
fi
if step hetegen; then
  DEVICE=cuda DTYPE=f16 THREADS=$(nproc) CPU_THREADS=${CPU_THREADS:-$(($(nproc) - 2))} \
    GEN=${HETEGEN_GEN:-16} timeout 420 bash scripts/bench-hetegen.sh "$STRATA" \
    "${HETEGEN_MODEL:-dummy:opt-6.7b}" "${HETEGEN_GPU_MEM:-8GiB}" 2>&1 | tee "$OUT/hetegen.jsonl"
fi

if step pie; then
  timeout 420 python3 scripts/bench-pie.py --strata "$STRATA" --device cuda --dtype f16 \
    --threads "$(nproc)" --model "${PIE_MODEL:-dummy:opt-6.7b}" --gpu-mem "${PIE_GPU_MEM:-24GiB}" \
    --batch "${PIE_BATCH:-32}" --small-batch "${PIE_SMALL_BATCH:-16}" \
    --host-layers "${PIE_M:-12}" --prompt-len 512 --gen-len "${PIE_GEN:-16}" \
    --max-step-tokens 4096 --out "$OUT/pie.jsonl" 2>&1 | tee "$OUT/pie.txt"
fi

echo "done: $STEPS"
