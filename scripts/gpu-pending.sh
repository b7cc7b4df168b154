#!/usr/bin/env bash
# Every device check that the stops since the last GPU session left ready (docs/GPU.md,
# "Built, not yet run on a GPU"; each stop's entry in docs/journal/gpu-history.md), over the
# archive scripts/gpu-bundle.sh made. Each part runs
# scripts/gpu-run.sh into OUT_DIR/<part>; a failing part is reported and the next runs.
# Issue 14's open item first: batch-1 decode of OPT-6.7B with each kernel variant.
#   scripts/gpu-pending.sh BUNDLE.tgz OUT_DIR            every part (about 12 minutes)
#   PARTS="engine-b1 tests" scripts/gpu-pending.sh ...   only those parts, in this order
set -uo pipefail
BUNDLE=$1
OUT=$2
PARTS=${PARTS:-engine-b1 tests tests-opt-in engine-q4-b1 engine-caches kernels}
HERE=$(dirname "$0")
ALL_GPU_TESTS="test_cuda_backend test_backend_ops test_layer_feeder_cuda test_stage_cuda"
ALL_GPU_TESTS+=" test_kv_swap_cuda test_tensor_parallel_cuda test_kv_handover_cuda"

# The environment of gpu-run.sh for part $1, into the array `vars`.
part_vars() {
  case $1 in
    engine-b1) vars=(ENGINE_RUNS=b1 "ENGINE_VARIANTS=fused norm norm4 decode fewest fewest4 pdlall"
      STEPS=engine) ;;
    tests) vars=(STEPS=tests "TESTS=$ALL_GPU_TESTS") ;;
    tests-opt-in) vars=(STRATA_CUDA_PDL=all STRATA_CUDA_NORM=fused STRATA_CUDA_NORM_ROWS=4
      STRATA_CUDA_DECODE=fused STEPS=tests "TESTS=test_cuda_backend test_backend_ops test_layer_feeder_cuda test_stage_cuda") ;;
    engine-q4-b1) vars=(ENGINE_RUNS=q4-b1 "ENGINE_VARIANTS=fused fewest fewest4" STEPS=engine) ;;
    engine-caches) vars=("ENGINE_RUNS=b16 kv16-b1 kv16-b16 cc-b16" ENGINE_VARIANTS=fused STEPS=engine) ;;
    kernels) vars=("KERNEL_FILTER=*DISABLED_NormLinearsThroughput*:*DISABLED_AttentionDecodeThroughput*"
      KERNEL_VARIANTS=fused STEPS=kernels) ;;
    *) return 1 ;;
  esac
}
vars=()
for p in $PARTS; do
  if ! part_vars "$p"; then
    echo "gpu-pending.sh: unknown part '$p' (engine-b1, tests, tests-opt-in, engine-q4-b1," \
      "engine-caches, kernels)" >&2
    exit 2
  fi
done

mkdir -p "$OUT"
for p in $PARTS; do
  echo "== $p ($(date -u +%H:%M:%S))"
  part_vars "$p"
  env "${vars[@]}" bash "$HERE/gpu-run.sh" "$BUNDLE" "$OUT/$p" || echo "gpu-pending.sh: part $p failed"
done 2>&1 | tee "$OUT/pending.log"
