#!/usr/bin/env bash
# Runs on a lent GPU machine, from the checkout's root, over the archive that
# scripts/gpu-bundle.sh made (docs/GPU.md, "A session on a lent GPU"). Each step named in
# STEPS writes its log and JSON under OUT_DIR; a failing step is reported and the next runs.
#   STEPS="tests hetegen pie flexgen" scripts/gpu-run.sh BUNDLE.tgz OUT_DIR
set -uo pipefail
BUNDLE=$1
OUT=$2
STEPS=${STEPS:-tests}
# Benchmark switches of the CUDA backend (docs/GPU.md), by variant name:
#   before: cuBLAS for every linear, one block per (row, head) attention (before 2026-11-25)
#   plain:  the fused GEMVs, the ops after a linear on their own, q, k and v apart
#   fused:  the default: the ReLU and residual add folded into the GEMV's store, q, k and v
#           (gate and up) in one launch, decode attention with warps over keys, GEMVs with
#           programmatic dependent launch
#   tiled:  as fused, decode attention by the tiled kernel (2026-11-28 call 2)
#   nopdl:  as fused, no programmatic dependent launch
#   early:  as fused, a GEMV's first weight loads before it waits for the kernel before
#   norm:   as fused, a pre-norm layer's norm folded into the GEMV that reads it (opt-in)
#   decode: as fused, a decode step's kv_store, attention and split combine as one kernel,
#           launched with programmatic dependent launch (opt-in)
#   fewest: norm and decode together: five kernels an OPT layer (opt-in)
#   norm4, fewest4: as norm and fewest, each warp of a GEMV with the norm taking 4 weight
#           rows, so a block's norm prologue serves 16 rows, not 4 (opt-in)
#   pdlall: as fused, the norms, kv_store and attention's kernels launched with programmatic
#           dependent launch too (opt-in): nine kernels a layer, all overlapping
variant_env() {
  case $1 in
    before) echo STRATA_CUDA_GEMV=off STRATA_CUDA_ATTENTION=simple STRATA_CUDA_PDL=off ;;
    plain) echo STRATA_CUDA_EPILOGUE=off STRATA_CUDA_PDL=off ;;
    fused) echo ;;
    tiled) echo STRATA_CUDA_ATTENTION=tiled ;;
    nopdl) echo STRATA_CUDA_PDL=off ;;
    early) echo STRATA_CUDA_PDL=early ;;
    norm) echo STRATA_CUDA_NORM=fused ;;
    decode) echo STRATA_CUDA_DECODE=fused ;;
    fewest) echo STRATA_CUDA_NORM=fused STRATA_CUDA_DECODE=fused ;;
    norm4) echo STRATA_CUDA_NORM=fused STRATA_CUDA_NORM_ROWS=4 ;;
    fewest4) echo STRATA_CUDA_NORM=fused STRATA_CUDA_NORM_ROWS=4 STRATA_CUDA_DECODE=fused ;;
    pdlall) echo STRATA_CUDA_PDL=all ;;
  esac
}
# A mistyped variant would run the default under another name: refuse it before any step.
for v in ${KERNEL_VARIANTS:-} ${ENGINE_VARIANTS:-} ${NCU_VARIANT:-}; do
  case $v in
    before | plain | fused | tiled | nopdl | early | norm | decode | fewest | norm4 | fewest4 | \
      pdlall) ;;
    *) echo "gpu-run.sh: unknown variant '$v' (before, plain, fused, tiled, nopdl, early, norm," \
      "decode, fewest, norm4, fewest4, pdlall)" >&2
      exit 2 ;;
  esac
done

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
  # The kernel benchmarks (JSON lines), one pass per variant in KERNEL_VARIANTS.
  t=$B/bin/test_cuda_backend
  f="--gtest_also_run_disabled_tests --gtest_filter=${KERNEL_FILTER:-*DISABLED_*Throughput*}"
  for variant in ${KERNEL_VARIANTS:-fused before}; do
    (cd /tmp && env $(variant_env "$variant") timeout 120 "$t" $f) 2>&1 | grep '^{' |
      sed "s/^{/{\"variant\": \"$variant\", /" | tee -a "$OUT/kernels.jsonl"
  done
fi

if step engine; then
  # dummy:opt-6.7b on the GPU, prompt 512, gen 32, per variant in ENGINE_VARIANTS. The
  # fraction is of the device bound: a step's weights and KV rows at the copy rate.
  for variant in ${ENGINE_VARIANTS:-fused before}; do
    for run in "b1 --batch 1" "b16 --batch 16" "q4-b1 --batch 1 --policy w=100/0/0,cw=1" \
               "q4-b16 --batch 16 --policy w=100/0/0,cw=1" \
               "cc-b16 --batch 16 --policy w=100/0/0,c=100/0/0,cc=1" \
               "kv16-b1 --batch 1 --policy w=100/0/0,c=100/0/0,cf16=1" \
               "kv16-b16 --batch 16 --policy w=100/0/0,c=100/0/0,cf16=1"; do
      name=${run%% *}
      if [ -n "${ENGINE_RUNS:-}" ] && [[ " $ENGINE_RUNS " != *" $name "* ]]; then continue; fi
      env $(variant_env "$variant") timeout 200 "$STRATA" bench --model dummy:opt-6.7b \
        --dtype f16 --device cuda ${run#* } --prompt-len 512 --gen-len 32 \
        --max-step-tokens 8192 --warmup 1 --no-limits \
        >"$OUT/engine-$variant-$name.json" 2>"$OUT/engine-$variant-$name.log"
      python3 -c "
import json,sys; d=json.load(open(sys.argv[1])); r=d['result']; b=d.get('decode_device_bound', {})
print(sys.argv[2], sys.argv[3], 'gen %.1f tok/s, decode %.1f tok/s, step %.3f ms, prefill %.3f s, '
  'device bound %.3f ms: %.1f%% (weights only %.1f%%)' % (
  r['generation_tokens_per_s'], r['decode_tokens_per_s'], d['decode_step_seconds']*1e3,
  r['prefill_seconds'], b.get('bound_step_seconds', 0)*1e3, 100*b.get('fraction', 0),
  100*b.get('fraction_weights_only', 0)))
" "$OUT/engine-$variant-$name.json" "$variant" "$name" 2>&1 | tail -1
    done
  done | tee -a "$OUT/engine.txt"
fi

if step ncu; then
  # Every kernel of a stretch of batch-1 f16 decode steps, timed one by one by Nsight Compute
  # (clocks left alone): which kernels the step's time goes to, beside the step time.
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  env $(variant_env "${NCU_VARIANT:-fused}") timeout 150 "$ncu" --clock-control none \
    --launch-skip "${NCU_SKIP:-3000}" --launch-count "${NCU_COUNT:-60}" \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum -f -o /tmp/decode \
    "$STRATA" bench --model dummy:opt-6.7b --dtype f16 --device cuda --batch 1 \
    --prompt-len 512 --gen-len 16 --warmup 0 --no-limits >"$OUT/ncu-bench.json" 2>"$OUT/ncu.log"
  "$ncu" --import /tmp/decode.ncu-rep --csv --page raw >"$OUT/ncu.csv" 2>>"$OUT/ncu.log"
  python3 - "$OUT/ncu.csv" <<'PY' | tee "$OUT/ncu.txt"
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
i = next(i for i, r in enumerate(rows) if 'Kernel Name' in r)
head, units = rows[i], rows[i + 1]; rows = [r for r in rows[i + 1:] if r and r[0].isdigit()]
name = head.index('Kernel Name'); t = head.index('gpu__time_duration.sum')
b = head.index('dram__bytes_read.sum')
agg = collections.OrderedDict()
def num(v): return float(v.replace(',', '')) if v.replace(',', '').replace('.', '').isdigit() else 0.0
for r in rows:
    k = r[name].split('(')[0][:60]
    a = agg.setdefault(k, [0, 0.0, 0.0]); a[0] += 1; a[1] += num(r[t]); a[2] += num(r[b])
print('kernels: %d; calls, time (%s), DRAM read (%s), kernel' % (len(rows), units[t], units[b]))
for k, (n, tt, bb) in agg.items(): print('%4d %12.1f %14.0f  %s' % (n, tt, bb, k))
PY
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
