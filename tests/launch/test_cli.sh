#!/usr/bin/env bash
# The strata command line: bad input exits non-zero with one clear line on stderr; good
# input produces the documented JSON. Usage: test_cli.sh STRATA_BINARY STORIES_MODEL_DIR
set -u
STRATA=$1
MODEL=$2
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
failures=0
passes=0

# expect_error NAME PATTERN ARGS... : non-zero exit, exactly one stderr line matching PATTERN.
# With EXPECT_RC=N in its environment, the exit status must be N.
expect_error() {
  local name=$1 pattern=$2
  shift 2
  timeout 120 "$STRATA" "$@" >"$TMP/out" 2>"$TMP/err"
  local rc=$?
  local lines
  lines=$(grep -vc '^\[' "$TMP/err")  # log lines start with "[time]"; the error line does not
  if [ "$rc" -eq 0 ] || [ "$rc" -ne "${EXPECT_RC:-$rc}" ] || [ "$lines" -ne 1 ] ||
    ! grep -q -- "$pattern" "$TMP/err"; then
    echo "FAIL $name: rc=$rc, $lines non-log stderr lines, wanted /$pattern/:"
    cat "$TMP/err"
    failures=$((failures + 1))
  else
    echo "ok   $name: $(grep -v '^\[' "$TMP/err")"
    passes=$((passes + 1))
  fi
}

expect_error missing-model-dir "/no/such/model" generate --model /no/such/model --prompt hi
expect_error unknown-dummy "unknown dummy model 'opt-9z'" generate --model dummy:opt-9z --prompt "1 2"
expect_error negative-tokens "max-new-tokens: must be >= 0, got -5" generate --model "$MODEL" --prompt hi --max-new-tokens -5
: >"$TMP/empty.txt"
expect_error empty-prompt-file "empty.txt' is empty" generate --model "$MODEL" --prompt-file "$TMP/empty.txt"
expect_error missing-prompt-file "cannot open prompt file" generate --model "$MODEL" --prompt-file "$TMP/none.txt"
expect_error no-prompts "no prompts" generate --model "$MODEL"
expect_error bad-top-p "top_p must be in" generate --model "$MODEL" --prompt hi --top-p 1.5
expect_error bad-format "format" generate --model "$MODEL" --prompt hi --format xml
expect_error no-subcommand "subcommand" 
expect_error ids-for-tokenizerless "token ids" generate --model dummy:llama-110m --prompt "hello world" --max-new-tokens 1
expect_error bench-negative-batch "batch: must be > 0, got -1" bench --model "$MODEL" --batch -1
STRATA_CPU_ISA=sse9 expect_error bad-cpu-isa "STRATA_CPU_ISA='sse9': expected portable, avx2 or avx512" \
  generate --model "$MODEL" --prompt hi
STRATA_CPU_WEIGHTS=columns expect_error bad-cpu-weights "STRATA_CPU_WEIGHTS='columns': expected panels or rows" \
  generate --model "$MODEL" --prompt hi

# The host's weight layouts (kernels/gemm_panel.h, gemm_q4_panel.h): packed panels (the
# default) and the checkpoint's rows give the same greedy continuation, batch and prompt
# chunking included, in f32 and with FlexGen's 4-bit weights (panels where the CPU has
# AVX-512 VNNI; both sides split x the same way, only the order of the sums differs).
for weights in f32 q4; do
  policy=()
  [ "$weights" = q4 ] && policy=(--policy w=0/100/0,c=0/100/0,cw=1)
  for layout in panels rows; do
    STRATA_CPU_WEIGHTS=$layout "$STRATA" generate --model "$MODEL" --prompt "Once upon a time" \
      --prompt "The little dog ran" --max-new-tokens 24 --max-step-tokens 3 --format json \
      "${policy[@]}" >"$TMP/layout-$weights-$layout.jsonl" 2>"$TMP/err" || { cat "$TMP/err"; }
  done
  if [ -s "$TMP/layout-$weights-rows.jsonl" ] &&
    cmp -s "$TMP/layout-$weights-panels.jsonl" "$TMP/layout-$weights-rows.jsonl"; then
    echo "ok   weight-layouts-agree-$weights"; passes=$((passes + 1))
  else
    echo "FAIL weight-layouts-agree-$weights:"; cat "$TMP"/layout-"$weights"-*.jsonl
    failures=$((failures + 1))
  fi
done

# Good input: one JSON object per prompt with the documented fields, in order.
printf 'Once upon a time\nThe little dog\n' >"$TMP/prompts.txt"
if "$STRATA" generate --model "$MODEL" --prompt-file "$TMP/prompts.txt" --max-new-tokens 8 \
    --format json >"$TMP/out" 2>"$TMP/err"; then
  n=$(wc -l <"$TMP/out")
  first=$(head -1 "$TMP/out")
  case "$first" in
    '{"prompt":"Once upon a time","prompt_ids":[1,403,407,261,378],"output_ids":[432,383,286,261,376,298,315,421],"text":"Once upon a time, there was a little girl","completion":", there was a little girl","stop_reason":"length"}')
      if [ "$n" -eq 2 ] && grep -q '"summary"' "$TMP/err"; then
        echo "ok   json-output"; passes=$((passes + 1))
      else
        echo "FAIL json-output: $n lines or no summary"; failures=$((failures + 1))
      fi ;;
    *) echo "FAIL json-output: $first"; failures=$((failures + 1)) ;;
  esac
else
  echo "FAIL json-output: exit $?"; cat "$TMP/err"; failures=$((failures + 1))
fi

# score: teacher-forced logits through the CLI equal the llama2.c reference rows.
if "$STRATA" score --model "$MODEL" --prompt "Once upon a time" --logits-out "$TMP/logits.f32" \
    >"$TMP/score.json" 2>"$TMP/err" &&
  python3 - "$TMP/score.json" "$TMP/logits.f32" "$MODEL/reference/once_upon_a_time.logits.f32" <<'PY'
import json, struct, sys
s = json.loads(open(sys.argv[1]).read())
assert s["ids"] == [1, 403, 407, 261, 378], s["ids"]
assert len(s["logprobs"]) == 4 and all(lp < 0 for lp in s["logprobs"]), s["logprobs"]
got = open(sys.argv[2], "rb").read()
ref = open(sys.argv[3], "rb").read()[: len(got)]
assert len(got) == 5 * 512 * 4, len(got)
a = struct.unpack(f"<{len(got)//4}f", got)
b = struct.unpack(f"<{len(ref)//4}f", ref)
worst = max(abs(x - y) for x, y in zip(a, b))
assert worst < 1e-4, worst
PY
then
  echo "ok   score-logits"; passes=$((passes + 1))
else
  echo "FAIL score-logits"; cat "$TMP/err"; failures=$((failures + 1))
fi
expect_error score-no-text "give what to score" score --model "$MODEL"

# plan: FlexGen's OPT-30B / T4 example (its f16 cache) picks the paper's placement; a tiny
# budget is refused.
if "$STRATA" plan --model dummy:opt-30b --gpu-mem 16 --cpu-mem 208 --disk-mem 1500 --cache-f16 \
    --prompt-len 512 --gen-len 32 --format json >"$TMP/plan.json" 2>"$TMP/err" &&
  python3 - "$TMP/plan.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
p = j["policy"]
assert "ngb=3," in p and "w=20/80/0" in p and "c=0/100/0" in p and "h=0/100/0" in p, p
# Pie and HeteGen beside it (issue 17). The T4's cache crosses GPU -> CPU at 0.97 GiB/s, so a
# layer's swap outlasts a whole token's decode compute: Pie keeps every layer on the GPU.
pie, hw = j["pie"], j["hardware"]
assert pie["swap_s"] == pie["layer_cache_bytes"] / hw["gtoc_bdw_cache"], pie
assert pie["swap_s"] > 48 * pie["compute_s"] and pie["host_layers"] == 0, pie
# HeteGen at batch 1, eq. 5 from the T4's constants: fp16 over ctog, 2 FLOPs a parameter.
one = [e for e in j["hetegen"] if e["rows"] == 1][0]
v_cpu, v_gpu, v_com = hw["cpu_flops"] / 2, hw["mm_flops_decode"] / 2, hw["ctog_bdw"] / 2
alpha = 1 / (v_cpu / v_com + v_cpu / v_gpu + 1)
assert abs(one["alpha"] - alpha) < 1e-12 and one["split_s"] < one["stream_s"], (one, alpha)
PY
then
  echo "ok   plan-opt30b-t4"; passes=$((passes + 1))
else
  echo "FAIL plan-opt30b-t4"; cat "$TMP/plan.json" "$TMP/err"; failures=$((failures + 1))
fi
expect_error plan-infeasible "short by" plan --model dummy:opt-175b --gpu-mem 1 --cpu-mem 2 --disk-mem 10
# plan's budgets are sizes as the engine commands' are: units, or a bare number of GiB.
if "$STRATA" plan --model dummy:opt-30b --gpu-mem 16GiB --cpu-mem 212992MiB --disk-mem 1500G \
    --cache-f16 --prompt-len 512 --gen-len 32 --format json >"$TMP/plan-units.json" 2>"$TMP/err" &&
  python3 - "$TMP/plan.json" "$TMP/plan-units.json" <<'PY'
import json, sys
bare, units = (json.load(open(f)) for f in sys.argv[1:3])
hw = units["hardware"]
assert hw["gpu_mem"] == 16 * 2**30 and hw["cpu_mem"] == 208 * 2**30, hw
assert hw["disk_mem"] == 1500 * 2**30, hw
assert units == bare, "plan with sizes in units differs from the bare GiB numbers"
PY
then
  echo "ok   plan-size-units"; passes=$((passes + 1))
else
  echo "FAIL plan-size-units"; cat "$TMP/err"; failures=$((failures + 1))
fi
expect_error plan-bad-size "--gpu-mem: cannot read size '16GB'" plan --model dummy:opt-30b --gpu-mem 16GB
# strata plan --nodes FILE (issue 43): the file's mistakes name the file, the entry and the
# field; a budget beyond this machine names the node; ranks beyond the plan are refused.
printf '[{"rank": 1, "cpu-mem": "lots"}]' >"$TMP/nodes-bad.json"
expect_error plan-nodes-bad-size "nodes-bad.json: entry 1, cpu-mem: cannot read size 'lots'" \
  plan --nodes "$TMP/nodes-bad.json" --model dummy:opt-125m
printf -- '- rank: 1\n  cpu-mem: 900TiB\n' >"$TMP/nodes-big.yaml"
expect_error plan-nodes-too-big "rank 1 on .*: cpu-mem .* GiB is more than its .* GiB of available host memory" \
  plan --nodes "$TMP/nodes-big.yaml" --model dummy:opt-125m
printf '[{"rank": 3, "device": "cpu"}]' >"$TMP/nodes-rank.json"
expect_error plan-nodes-rank "an entry for rank 3 but the plan has worker ranks 1 to 2" \
  plan --nodes "$TMP/nodes-rank.json" --workers 2 --model dummy:opt-125m
printf '[{"rank": 1, "cpu-mem": "100MiB"}, {"rank": 2}]' >"$TMP/nodes-small.json"
expect_error plan-nodes-short "does not fit: stage 1 (layers \[0, .*), rank 1 on .*): cpu needs .* short by" \
  plan --nodes "$TMP/nodes-small.json" --model dummy:opt-125m --max-context 128
expect_error serve-nodes-one-process "--nodes is for a cluster" serve --nodes "$TMP/nodes-rank.json" \
  --model dummy:opt-125m --requests "$TMP/nodes-rank.json" --results "$TMP/r.jsonl"
# The search chooses HeteGen when the CPU can take a share (a 1.5 TFLOP/s CPU beside the T4's
# link, decode-heavy work) and not with --search none; the alpha is eq. 5's for its block.
python3 - "$TMP/plan.json" "$TMP/fastcpu.json" <<'PY'
import json, sys
hw = json.load(open(sys.argv[1]))["hardware"]
hw["cpu_flops"] = 1.5e12
json.dump(hw, open(sys.argv[2], "w"))
PY
if "$STRATA" plan --model dummy:opt-30b --hardware "$TMP/fastcpu.json" --prompt-len 32 --gen-len 512 \
    --format json >"$TMP/hg.json" 2>"$TMP/err" &&
  "$STRATA" plan --model dummy:opt-30b --hardware "$TMP/fastcpu.json" --prompt-len 32 --gen-len 512 \
    --search none --format json >"$TMP/fg.json" 2>>"$TMP/err" &&
  python3 - "$TMP/hg.json" "$TMP/fg.json" <<'PY'
import json, sys
hg, fg = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
assert "hetegen=" not in fg["policy"] and "pie=" not in fg["policy"], fg["policy"]
fields = dict(kv.split("=") for kv in hg["policy"].split(","))
bls = int(fields["gbs"]) * int(fields["ngb"])
hw = hg["hardware"]
v_cpu, v_gpu, v_com = hw["cpu_flops"] / (2 * bls), hw["mm_flops_decode"] / (2 * bls), hw["ctog_bdw"] / 2
alpha = 1 / (v_cpu / v_com + v_cpu / v_gpu + 1)
assert int(fields["hetegen"]) == round(alpha * 100), (fields, alpha)
assert hg["cost"]["throughput_token_s"] > 1.2 * fg["cost"]["throughput_token_s"], (hg["cost"], fg["cost"])
assert hg["cost"]["decode_per_layer"]["cpu_split_s"] > 0, hg["cost"]
PY
then
  echo "ok   plan-chooses-hetegen"; passes=$((passes + 1))
else
  echo "FAIL plan-chooses-hetegen"; cat "$TMP/err"; failures=$((failures + 1))
fi
expect_error plan-search-unknown "--search" plan --model dummy:opt-30b --search vllm
expect_error plan-pie-on-cpu-cache "Pie swaps a cache that lives on the GPU tier" plan --model dummy:opt-30b --policy c=0/100/0,pie=2

# plan --workload: ExeGPT's schedule for the paper's OPT-13B on four modelled A40s, as one
# JSON object with the documented keys, and better than the FT-style baseline it prints.
if "$STRATA" plan --model dummy:opt-13b --workload S --nodes 4 --hardware a40 --latency-bound 8 \
    --format json >"$TMP/sched.json" 2>"$TMP/err" &&
  python3 - "$TMP/sched.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
for k in ("feasible", "policy", "control_variables", "allocation", "predicted_throughput_tok_s",
          "predicted_p99_latency_s", "baseline", "points_evaluated"):
    assert k in j, k
assert j["feasible"] and j["predicted_p99_latency_s"] <= 8, j
assert j["policy"] in ("RRA", "WAA-C", "WAA-M"), j["policy"]
assert sum(j["allocation"]) % 40 == 0, j["allocation"]  # OPT-13B's 40 layers (twice for WAA)
b = j["baseline"]
assert b["feasible"] and b["predicted_p99_latency_s"] <= 8, b
assert j["predicted_throughput_tok_s"] >= b["predicted_throughput_tok_s"], (j, b)
assert 0 < j["points_evaluated"] < j["grid_points"], j
PY
then
  echo "ok   plan-schedule-opt13b-a40"; passes=$((passes + 1))
else
  echo "FAIL plan-schedule-opt13b-a40"; cat "$TMP/sched.json" "$TMP/err"; failures=$((failures + 1))
fi
expect_error plan-unmeetable-bound "fastest achievable p99 latency is" plan --model dummy:opt-13b \
  --workload S --nodes 4 --hardware a40 --latency-bound 0.001
expect_error plan-unknown-task "not a task of the paper's Table 3" plan --model dummy:opt-13b \
  --workload Q --nodes 4 --hardware a40
expect_error plan-bad-bound "need seconds" plan --model dummy:opt-13b --workload S --nodes 4 \
  --hardware a40 --latency-bound -3
expect_error plan-workload-past-context "shrink it with --length-scale" plan \
  --model "$MODEL" --workload C2 --nodes 2 --hardware a40 --latency-bound inf
expect_error plan-bad-policy "gbs" plan --model dummy:opt-30b --policy gbs=0,ngb=1

# profile: measures the disk around the page cache and says so.
# The rates must agree with what the test can see for itself: the bytes moved are 16 MiB
# rounded up to whole 64 MiB requests; the write and read times the rates imply
# (bytes / rate) cannot add up to more than the command's wall time, and neither rate can
# be above 200 GB/s (no host memory, let alone a disk, is that fast for one thread).
t0=$(date +%s.%N)
if "$STRATA" profile --disk-dir "$TMP" --disk-mib 16 --out "$TMP/profile.json" >/dev/null 2>"$TMP/err" &&
  python3 - "$TMP/profile.json" "$t0" "$(date +%s.%N)" "$TMP" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))["disk"]
wall = float(sys.argv[3]) - float(sys.argv[2])
total = -(-16 * 2**20 // (64 * 2**20)) * 64 * 2**20  # ceil to 64 MiB requests
assert d["bytes"] == total == 67108864, d
assert d["dir"] == sys.argv[4], d
for k in ("read_gbs", "write_gbs"):
    assert 0 < d[k] < 200, (k, d)
implied = total / (d["read_gbs"] * 1e9) + total / (d["write_gbs"] * 1e9)
assert implied <= wall, (implied, wall, d)
PY
then
  echo "ok   profile"; passes=$((passes + 1))
else
  echo "FAIL profile"; cat "$TMP/err"; failures=$((failures + 1))
fi
expect_error profile-bad-dir "not a directory" profile --disk-dir /no/such/dir --disk-mib 1

# The offloading options: refusals that name the option, and placements that change nothing.
expect_error device-unknown "expected auto, cpu, host, cuda" generate --model "$MODEL" --prompt hi --device tpu
expect_error policy-bad-shares "sum to 100" generate --model "$MODEL" --prompt hi --policy w=50/60/0
expect_error policy-activations "activations live on the compute tier" generate --model "$MODEL" --prompt hi --policy h=0/0/100
expect_error cpu-mem-too-small "short by" generate --model "$MODEL" --prompt hi --device cpu --cpu-mem 10KiB
expect_error disk-mem-too-small "--disk-mem" generate --model "$MODEL" --prompt hi --device cpu --policy w=0/0/100 --disk-mem 100KiB
if ! nvidia-smi -L >/dev/null 2>&1; then
  expect_error device-cuda-missing "--device cuda" generate --model "$MODEL" --prompt hi --device cuda
fi
"$STRATA" generate --model "$MODEL" --prompt "Once upon a time" --max-new-tokens 24 --format json --device cpu \
  >"$TMP/plain.json" 2>/dev/null
"$STRATA" generate --model "$MODEL" --prompt "Once upon a time" --max-new-tokens 24 --format json --device cpu \
  --policy w=0/0/100,c=0/40/60,gbs=1,ngb=2 --disk-dir "$TMP" >"$TMP/disk.json" 2>"$TMP/err"
if [ -s "$TMP/plain.json" ] && cmp -s "$TMP/plain.json" "$TMP/disk.json"; then
  echo "ok   policy-disk-placement-same-output"; passes=$((passes + 1))
else
  echo "FAIL policy-disk-placement-same-output"; cat "$TMP/err"; failures=$((failures + 1))
fi
# HeteGen (docs/OFFLOADING.md): a bad alpha or thread count is bad input (exit 2, one line
# naming the option) on any machine; a good one on an engine computing on the CPU is ignored
# with a warning, as --gpu-mem is, and changes nothing.
for alpha in 0 -0.3 1.5 nan inf abc; do
  EXPECT_RC=2 expect_error "hetegen-alpha-$alpha" "--hetegen-alpha: .*$alpha" \
    generate --model "$MODEL" --prompt hi --hetegen-alpha "$alpha"
done
EXPECT_RC=2 expect_error hetegen-alpha-bench "--hetegen-alpha: must be in (0, 1], got 2" \
  bench --model "$MODEL" --hetegen-alpha 2
EXPECT_RC=2 expect_error hetegen-threads-alone "--hetegen-cpu-threads requires --hetegen-alpha (or a policy's hetegen=)" \
  generate --model "$MODEL" --prompt hi --hetegen-cpu-threads 2
EXPECT_RC=2 expect_error hetegen-threads-negative "--hetegen-cpu-threads: must be a whole number >= 0, got -1" \
  generate --model "$MODEL" --prompt hi --hetegen-alpha 0.5 --hetegen-cpu-threads -1
"$STRATA" generate --model "$MODEL" --prompt "Once upon a time" --max-new-tokens 24 --format json --device cpu \
  --hetegen-alpha 0.3 --hetegen-cpu-threads 1 >"$TMP/hetegen.json" 2>"$TMP/err"
if cmp -s "$TMP/plain.json" "$TMP/hetegen.json" &&
  grep -q -- "--hetegen-alpha ignored: the engine computes on the CPU" "$TMP/err"; then
  echo "ok   hetegen-on-cpu-ignored"; passes=$((passes + 1))
else
  echo "FAIL hetegen-on-cpu-ignored"; cat "$TMP/err"; failures=$((failures + 1))
fi
# --device host: a CPU backend standing in for the device runs the device path (weights
# streamed past --gpu-mem, HeteGen's split of the CPU-tier layers) with the same output.
"$STRATA" generate --model "$MODEL" --prompt "Once upon a time" --max-new-tokens 24 --format json --device host \
  --gpu-mem 0.6MiB --hetegen-alpha 0.3 >"$TMP/host.json" 2>"$TMP/err"
if cmp -s "$TMP/plain.json" "$TMP/host.json" && grep -q "the CPU stands in for a device" "$TMP/err" &&
  grep -q "gpu/cpu/disk 0/5/0.*5 CPU-tier layers split" "$TMP/err" &&
  grep -q "module scheduler: [0-9]* of 35 modules whole on the device" "$TMP/err"; then
  echo "ok   device-host-hetegen-same-output"; passes=$((passes + 1))
else
  echo "FAIL device-host-hetegen-same-output"; cat "$TMP/err"; failures=$((failures + 1))
fi
# --hetegen-alpha auto: the alpha benchmark runs once per module shape and is saved in the
# node profile; a second run reuses it (nothing measured), and both give the plain output.
for run in first second; do
  STRATA_PROFILE_DIR="$TMP/profile" "$STRATA" generate --model "$MODEL" --prompt "Once upon a time" \
    --max-new-tokens 24 --format json --device host --gpu-mem 0.6MiB --hetegen-alpha auto \
    >"$TMP/auto-$run.json" 2>"$TMP/err-$run"
done
if cmp -s "$TMP/plain.json" "$TMP/auto-first.json" && cmp -s "$TMP/plain.json" "$TMP/auto-second.json" &&
  [ "$(grep -c 'alpha benchmark: .* measured, saved to' "$TMP/err-first")" -ge 4 ] &&
  [ "$(grep -c 'alpha benchmark: .* reused from' "$TMP/err-second")" -eq 7 ] &&
  ! grep -q "measured, saved to" "$TMP/err-second" &&
  python3 -c "import json,sys; j=json.load(open(sys.argv[1])); assert len(j['modules']) == 4" \
    "$TMP/profile/hetegen-alpha.json"; then
  echo "ok   hetegen-alpha-auto-cached"; passes=$((passes + 1))
else
  echo "FAIL hetegen-alpha-auto-cached"; cat "$TMP/err-first" "$TMP/err-second"; failures=$((failures + 1))
fi
# The benchmark runs at the engine's decode batch (--max-batch, 32 above): another batch is
# measured anew and kept beside the first, and the output stays the plain one.
STRATA_PROFILE_DIR="$TMP/profile" "$STRATA" generate --model "$MODEL" --prompt "Once upon a time" \
  --max-new-tokens 24 --format json --device host --gpu-mem 0.6MiB --hetegen-alpha auto \
  --max-batch 2 >"$TMP/auto-b2.json" 2>"$TMP/err-b2"
if cmp -s "$TMP/plain.json" "$TMP/auto-b2.json" &&
  [ "$(grep -c 'alpha benchmark: .* rows=2 .* measured, saved to' "$TMP/err-b2")" -ge 4 ] &&
  ! grep -q "rows=32" "$TMP/err-b2" && grep -q "rows=32" "$TMP/err-first" &&
  python3 -c "import json,sys; j=json.load(open(sys.argv[1])); assert len(j['modules']) == 8" \
    "$TMP/profile/hetegen-alpha.json"; then
  echo "ok   hetegen-alpha-at-the-decode-batch"; passes=$((passes + 1))
else
  echo "FAIL hetegen-alpha-at-the-decode-batch"; cat "$TMP/err-b2"; failures=$((failures + 1))
fi
# Pie (docs/PIE_HETEGEN.md): the KV cache swapping layer by layer through host memory on the
# device path gives the plain run's output, fixed m and adaptive; the summary's counters say
# swaps happened, each moving one layer's K, the gap to V's 256-byte alignment, and V --
# bytes computed here from the model's shape, not taken from the program.
for mode in "fixed:--pie-host-layers 2" "adaptive:--pie-adaptive"; do
  name=${mode%%:*}
  # shellcheck disable=SC2086 # the options are two words
  "$STRATA" generate --model "$MODEL" --prompt "Once upon a time" --max-new-tokens 24 --format json \
    --device host --gpu-mem 4MiB ${mode#*:} >"$TMP/pie-$name.json" 2>"$TMP/err"
  if cmp -s "$TMP/plain.json" "$TMP/pie-$name.json" && grep '"summary"' "$TMP/err" >"$TMP/summary" &&
    python3 - "$TMP/plain.json" "$TMP/summary" "$name" <<'PY'; then
import json, sys
out = json.load(open(sys.argv[1]))
s = json.load(open(sys.argv[2]))["summary"]
p = s["pie"]
# stories260K: 5 layers, 4 KV heads x 8 dims; one sequence of its prompt and 23 fed-back tokens.
positions = len(out["prompt_ids"]) + 24 - 1
layer = 1 * positions * 4 * 8 * 4  # K (or V) of one layer, f32
swap = (layer + 255) // 256 * 256 + layer
assert s["kv_cache_bytes"] == 2 * 5 * layer, s
assert p["swap_ins"] > 0 and p["swap_outs"] > 0 and p["steps"] == 24, p
assert p["bytes_in"] == p["swap_ins"] * swap and p["bytes_out"] == p["swap_outs"] * swap, (p, swap)
if sys.argv[3] == "fixed":
    assert p["host_layers"] == 2 and p["adjustments"] == 0, p
else:
    assert p["adjustments"] > 0 and 0 <= p["host_layers"] <= 4, p
PY
    echo "ok   pie-$name-same-output-and-swaps"; passes=$((passes + 1))
  else
    echo "FAIL pie-$name-same-output-and-swaps"; cat "$TMP/err"; failures=$((failures + 1))
  fi
done
# Plain output has no Pie object.
if ! grep -q '"pie"' "$TMP/host.json"; then
  echo "ok   pie-absent-when-off"; passes=$((passes + 1))
else
  echo "FAIL pie-absent-when-off"; failures=$((failures + 1))
fi
# Memory: under a policy, --gpu-mem bounds the device's weights, KV cache and buffers. At
# 2.2 MiB the cache of 8 sequences x 106 positions does not fit beside the weights; with 3
# of the 5 layers on the host (the device keeps 2 layer buffers) it does, and the output is
# the plain CPU run's.
printf 'Once upon a time\nThe little dog\nLily wanted to\nTom had a ball\nOne day\nThe sun was\nA cat sat\nThey went to\n' \
  >"$TMP/pie-prompts.txt"
pie_mem=(generate --model "$MODEL" --prompt-file "$TMP/pie-prompts.txt" --max-new-tokens 100 --max-batch 8
  --max-step-tokens 64 --format json)
EXPECT_RC=2 expect_error pie-memory-without-pie \
  "--gpu-mem 2.2 MiB is too small for the KV cache of 8 sequences x 106 positions" \
  "${pie_mem[@]}" --device host --policy w=100/0/0,c=100/0/0 --gpu-mem 2.2MiB
"$STRATA" "${pie_mem[@]}" --device cpu >"$TMP/pie-mem-plain.json" 2>/dev/null
"$STRATA" "${pie_mem[@]}" --device host --policy w=100/0/0,c=100/0/0 --gpu-mem 2.2MiB \
  --pie-host-layers 3 >"$TMP/pie-mem.json" 2>"$TMP/err"
if [ -s "$TMP/pie-mem-plain.json" ] && cmp -s "$TMP/pie-mem-plain.json" "$TMP/pie-mem.json"; then
  echo "ok   pie-memory-fits-with-pie"; passes=$((passes + 1))
else
  echo "FAIL pie-memory-fits-with-pie"; cat "$TMP/err"; failures=$((failures + 1))
fi
# Under a policy --cpu-mem and --disk-mem bound everything on their tier too. By hand: the
# cache of 8 x 106 positions over 4 KV heads of 8 floats is 8*106*4*8*4 = 108544 bytes for
# K or V of a layer, 5 layers: 1085440 bytes (1.0 MiB) in memory; on disk each is padded to
# 27 pages (110592), 5 * 2 * 110592 = 1105920 bytes (1.1 MiB). f32 weights of ~260K
# parameters take 1.0 MiB, so at 2 MiB the host cannot hold the cache beside them.
EXPECT_RC=2 expect_error cpu-mem-bounds-the-cache \
  "--cpu-mem 2.0 MiB is too small for the KV cache of 8 sequences x 106 positions .*host memory needs .*(weights 1.0, KV cache 1.0," \
  "${pie_mem[@]}" --device cpu --policy w=100/0/0,c=100/0/0 --cpu-mem 2MiB
EXPECT_RC=2 expect_error disk-mem-bounds-the-cache \
  "--disk-mem 0.5 MiB is too small for the KV cache of 8 sequences x 106 positions .*the disk needs 1.1 MiB (weights 0.0, KV cache 1.1," \
  "${pie_mem[@]}" --device cpu --policy w=100/0/0,c=0/0/100 --cpu-mem 2MiB --disk-mem 0.5MiB \
  --disk-dir "$TMP"
# The cache moved to disk as the message says: the same 2 MiB then suffices, same output.
"$STRATA" "${pie_mem[@]}" --device cpu --policy w=100/0/0,c=0/0/100 --cpu-mem 2MiB \
  --disk-dir "$TMP" >"$TMP/cache-on-disk.json" 2>"$TMP/err"
if [ -s "$TMP/pie-mem-plain.json" ] && cmp -s "$TMP/pie-mem-plain.json" "$TMP/cache-on-disk.json"; then
  echo "ok   cpu-mem-fits-with-cache-on-disk"; passes=$((passes + 1))
else
  echo "FAIL cpu-mem-fits-with-cache-on-disk"; cat "$TMP/err"; failures=$((failures + 1))
fi
# Without a policy --cpu-mem bounds the weights alone; the run goes on and says so.
"$STRATA" "${pie_mem[@]}" --device cpu --cpu-mem 2MiB >"$TMP/out" 2>"$TMP/err"
if cmp -s "$TMP/pie-mem-plain.json" "$TMP/out" &&
  grep -q -- "--cpu-mem 2.0 MiB bounds the weights alone (no --policy)" "$TMP/err"; then
  echo "ok   cpu-mem-without-policy-warns"; passes=$((passes + 1))
else
  echo "FAIL cpu-mem-without-policy-warns"; cat "$TMP/err"; failures=$((failures + 1))
fi
# Bad Pie options are bad input naming the option and the value; on an engine computing on
# the CPU they are ignored with a warning, as --gpu-mem is.
for m in -1 abc 1.5; do
  EXPECT_RC=2 expect_error "pie-host-layers-$m" "--pie-host-layers: must be a whole number >= 0, got $m" \
    generate --model "$MODEL" --prompt hi --device host --pie-host-layers "$m"
done
EXPECT_RC=2 expect_error pie-host-layers-all "--pie-host-layers 5: .* has 5 KV-cache layers; at most 4" \
  generate --model "$MODEL" --prompt hi --device host --pie-host-layers 5
EXPECT_RC=2 expect_error pie-max-needs-adaptive "--pie-max-host-layers requires --pie-adaptive" \
  generate --model "$MODEL" --prompt hi --device host --pie-max-host-layers 2
EXPECT_RC=2 expect_error pie-max-host-layers-5 "--pie-max-host-layers 5: .* has 5 KV-cache layers" \
  bench --model "$MODEL" --device host --pie-adaptive --pie-max-host-layers 5
EXPECT_RC=2 expect_error pie-min-above-max "--pie-min-host-layers 3: above the most host layers, 2" \
  generate --model "$MODEL" --prompt hi --device host --pie-adaptive --pie-min-host-layers 3 --pie-max-host-layers 2
EXPECT_RC=2 expect_error pie-cache-split "--pie-host-layers 2: the policy 'w=100/0/0,c=50/50/0.*' puts 50% of the KV cache off the GPU tier" \
  generate --model "$MODEL" --prompt hi --device host --pie-host-layers 2 --policy w=100/0/0,c=50/50/0
"$STRATA" generate --model "$MODEL" --prompt "Once upon a time" --max-new-tokens 24 --format json --device cpu \
  --pie-host-layers 2 >"$TMP/pie-cpu.json" 2>"$TMP/err"
if cmp -s "$TMP/plain.json" "$TMP/pie-cpu.json" &&
  grep -q -- "--pie-host-layers 2 ignored: the engine computes on the CPU" "$TMP/err" &&
  ! grep -q '"pie"' "$TMP/err"; then
  echo "ok   pie-on-cpu-ignored"; passes=$((passes + 1))
else
  echo "FAIL pie-on-cpu-ignored"; cat "$TMP/err"; failures=$((failures + 1))
fi
# bench's "pie" object and serve's report (--stats-out) carry the same counters.
if "$STRATA" bench --model "$MODEL" --device host --pie-host-layers 3 --batch 2 --prompt-len 8 --gen-len 4 \
  --no-limits --warmup 0 >"$TMP/pie-bench.json" 2>"$TMP/err" &&
  printf '{"id": "a", "prompt": "Once upon a time", "max_new_tokens": 6}\n' >"$TMP/pie-req.jsonl" &&
  "$STRATA" serve --model "$MODEL" --device host --pie-host-layers 3 --max-batch 2 --max-context 16 \
    --requests "$TMP/pie-req.jsonl" --results "$TMP/pie-res.jsonl" --stats-out "$TMP/pie-stats.json" \
    2>>"$TMP/err" && python3 - "$TMP/pie-bench.json" "$TMP/pie-stats.json" <<'PY'; then
import json, sys
b = json.load(open(sys.argv[1]))
p = b["pie"]
layer = 2 * (8 + 4 - 1) * 4 * 8 * 4  # 2 sequences x 11 positions x 4 heads x 8 dims, f32
stride = (layer + 255) // 256 * 256
assert p["host_layers"] == 3 and p["swap_ins"] > 0 and p["steps"] == 4, p
assert p["layer_bytes"] == layer and p["swap_bytes"] == stride + layer, p
assert p["device_buffers"] == 2 and p["host_buffers"] == 5 and p["device_bytes"] == 2 * 2 * stride, p
assert p["bytes_in"] == p["swap_ins"] * (stride + layer), p
assert b["result"]["pie"]["swap_ins"] == p["swap_ins"], b["result"]
s = json.load(open(sys.argv[2]))["pie"]
layer = 2 * 16 * 4 * 8 * 4  # --max-batch 2 slots x --max-context 16
assert s["host_layers"] == 3 and s["steps"] == 6 and s["bytes_in"] == s["swap_ins"] * 2 * layer, s
PY
  echo "ok   pie-bench-and-serve-report"; passes=$((passes + 1))
else
  echo "FAIL pie-bench-and-serve-report"; cat "$TMP/err"; failures=$((failures + 1))
fi
# A policy's hetegen= (what `strata plan` chooses) runs HeteGen at that alpha, same output.
"$STRATA" generate --model "$MODEL" --prompt "Once upon a time" --max-new-tokens 24 --format json --device host \
  --policy w=0/100/0,hetegen=30 --threads 1 --hetegen-cpu-threads 1 >"$TMP/hgpolicy.json" 2>"$TMP/err"
if cmp -s "$TMP/plain.json" "$TMP/hgpolicy.json" && grep -q "split at alpha 0.3," "$TMP/err" &&
  grep -q "gpu/cpu/disk 0/5/0.*HeteGen alpha 0.300: 5 CPU-tier layers split" "$TMP/err"; then
  echo "ok   policy-hetegen-same-output"; passes=$((passes + 1))
else
  echo "FAIL policy-hetegen-same-output"; cat "$TMP/err"; failures=$((failures + 1))
fi
EXPECT_RC=2 expect_error policy-hetegen-twice "give alpha once" \
  generate --model "$MODEL" --prompt hi --device host --policy w=0/100/0,hetegen=30 --hetegen-alpha 0.5
if "$STRATA" bench --model dummy:opt-125m --dtype f16 --device host --policy auto --gpu-mem 1GiB --cpu-mem 4GiB \
  --prompt-len 8 --gen-len 2 --no-limits --threads 2 >"$TMP/auto.json" 2>"$TMP/err" &&
  python3 - "$TMP/auto.json" <<'PY'
import json, sys
# What ran must be the searched placement with the activations on the compute tier (the
# device the CPU stands in for), at the block size it chose; parsed here, not taken from
# the program.
d = json.load(open(sys.argv[1]))
def fields(text):
    f = dict(kv.split("=") for kv in text.split(","))
    for k in ("w", "c", "h"):
        if k in f:
            f[k] = [int(x) for x in f[k].split("/")]
            assert sum(f[k]) == 100, (k, text)
    return f
searched = fields(d["policy_search"]["policy"])
ran = fields(d["policy"])
# By hand, what these options should produce: opt-125m in f16 (0.25 GB of weights) fits the
# 1 GiB GPU whole, so weights and cache stay there; a run all on the GPU is compute-bound,
# its time linear in the block, so every block ties and the tie goes to the smallest (1x1);
# neither --compress-weight nor --cache-f16; CPU attention and overlap as bench defaults them.
want = "gbs=1,ngb=1,w=100/0/0,c=100/0/0,h=100/0/0,cw=0,cc=0,cpu_attn=1,overlap=1"
assert d["policy"] == want and d["policy_search"]["running"] == want, (
    d["policy"], d["policy_search"]["running"], want)
assert ran["h"] == [100, 0, 0], ran
for k in ("gbs", "ngb", "w", "c"):
    assert ran[k] == searched[k], (k, ran, searched)
block = int(ran["gbs"]) * int(ran["ngb"])
assert d["batch"] == block, (d["batch"], block)
assert d["generated_tokens"] == block * 2, d  # --gen-len 2 for every sequence of the block
PY
then
  echo "ok   bench-policy-auto"; passes=$((passes + 1))
else
  echo "FAIL bench-policy-auto"; cat "$TMP/err"; failures=$((failures + 1))
fi
# On an engine computing on the CPU the search (a GPU node's cost model) is refused: its GPU
# and CPU tiers would both be host memory (opt-1.3b in f32 at 2 GiB needed 5 GiB there).
EXPECT_RC=2 expect_error bench-policy-auto-on-the-cpu \
  "--policy auto: FlexGen's search places weights and KV cache for a GPU node, and this run computes on the CPU (--device cpu)" \
  bench --model dummy:opt-125m --device cpu --policy auto --cpu-mem 2GiB --no-limits
# The search's own switches (as `strata plan`'s): 4-bit weights and an f16 cache are fixed for
# the whole search, so the policy that ran carries both; without --policy auto they are refused.
if "$STRATA" bench --model dummy:opt-125m --dtype f16 --device host --policy auto --gpu-mem 1GiB --cpu-mem 4GiB \
  --compress-weight --cache-f16 --prompt-len 8 --gen-len 2 --no-limits --threads 2 \
  >"$TMP/auto-flags.json" 2>"$TMP/err" &&
  python3 - "$TMP/auto-flags.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
ran = dict(kv.split("=") for kv in d["policy"].split(","))
assert ran.get("cw") == "1" and ran.get("cf16") == "1", d["policy"]
# As above, with 4-bit weights (cw=1) and an f16 cache (cf16=1) and nothing else changed: the
# cache itself is not compressed (cc=0, no --compress-cache).
want = "gbs=1,ngb=1,w=100/0/0,c=100/0/0,h=100/0/0,cw=1,cc=0,cpu_attn=1,overlap=1,cf16=1"
assert d["policy"] == want and d["policy_search"]["running"] == want, (
    d["policy"], d["policy_search"]["running"], want)
PY
then
  echo "ok   bench-policy-auto-search-flags"; passes=$((passes + 1))
else
  echo "FAIL bench-policy-auto-search-flags"; cat "$TMP/err"; failures=$((failures + 1))
fi
expect_error bench-search-flags-need-auto "shape the search of --policy auto" \
  bench --model "$MODEL" --policy w=100/0/0 --cache-f16 --no-limits

# OpenMP's idle spin (launch/openmp_wait.h): with neither GOMP_SPINCOUNT nor OMP_WAIT_POLICY
# set, strata runs (the same process, executed again) with GOMP_SPINCOUNT=1000; a count or a
# policy the user set is left as it is, and the bench records what the run had.
omp_wait() {
  env -u GOMP_SPINCOUNT -u OMP_WAIT_POLICY "$@" "$STRATA" bench --model "$MODEL" --prompt-len 4 \
    --gen-len 2 --no-limits --threads 1 2>"$TMP/err" |
    python3 -c "import json, sys; w = json.load(sys.stdin)['openmp_wait']; print(w['GOMP_SPINCOUNT'], w['OMP_WAIT_POLICY'])"
}
got="$(omp_wait) / $(omp_wait GOMP_SPINCOUNT=5000) / $(omp_wait OMP_WAIT_POLICY=active)"
if [ "$got" = "1000 None / 5000 None / None active" ]; then
  echo "ok   openmp-spin-count: $got"; passes=$((passes + 1))
else
  echo "FAIL openmp-spin-count: $got"; cat "$TMP/err"; failures=$((failures + 1))
fi

# Issue 10: bounded reads (failure 4), results never lost to one bad prompt (5), a bench that
# reports only what it did (6), sizes and threads that must make sense (6), limits printed (3).
expect_error prompt-file-dev-zero "input limit prompt_bytes" generate --model "$MODEL" --prompt-file /dev/zero
python3 -c "import sys; open(sys.argv[1], 'w').write('a' * 5000000 + '\n')" "$TMP/long.txt"
expect_error prompt-line-too-long "long.txt: bytes of the prompt on line 1 (at least) = [0-9]* is above the limit of 4194304" \
  generate --model "$MODEL" --prompt-file "$TMP/long.txt"
expect_error prompt-file-too-large "prompt file size in bytes = 5000001 is above the limit of 1000" \
  generate --model "$MODEL" --prompt-file "$TMP/long.txt" --limit prompt_file_bytes=1000
# serve --requests /dev/zero: one error result saying there is no line end, then the job ends.
timeout 60 "$STRATA" serve --model "$MODEL" --threads 1 --requests /dev/zero --results "$TMP/zero.jsonl" \
  >/dev/null 2>"$TMP/err"
rc=$?
if [ "$rc" -ne 124 ] && [ "$(wc -l <"$TMP/zero.jsonl")" -eq 1 ] &&
  grep -q '"status":"error".*/dev/zero:1: no line end within 16777216 bytes' "$TMP/zero.jsonl"; then
  echo "ok   serve-requests-dev-zero"; passes=$((passes + 1))
else
  echo "FAIL serve-requests-dev-zero: rc=$rc"; head -c 600 "$TMP/zero.jsonl"; tail -3 "$TMP/err"
  failures=$((failures + 1))
fi
# 2,000 prompts, number 999 not UTF-8: every result printed, that one an error naming it.
python3 - "$TMP/many.txt" <<'PY'
import sys
with open(sys.argv[1], "wb") as f:
    for i in range(2000):
        f.write(b"Once upon a \xff\xfe time\n" if i == 999 else b"The dog %d\n" % i)
PY
timeout 300 "$STRATA" generate --model "$MODEL" --prompt-file "$TMP/many.txt" --max-new-tokens 2 --format json \
  >"$TMP/many.jsonl" 2>"$TMP/err"
rc=$?
if [ "$rc" -eq 1 ] && python3 - "$TMP/many.jsonl" <<'PY'
import json, sys
lines = open(sys.argv[1], "rb").read().decode("utf-8").splitlines()
assert len(lines) == 2000, len(lines)
rows = [json.loads(l) for l in lines]
bad = [i for i, r in enumerate(rows) if "error" in r]
assert bad == [999], bad
assert rows[999]["error"].startswith("prompt 999: not valid UTF-8"), rows[999]
assert rows[999]["prompt"] == "Once upon a \ufffd\ufffd time", rows[999]["prompt"]
assert rows[1000]["prompt"] == "The dog 1000" and len(rows[1000]["output_ids"]) == 2, rows[1000]
PY
then
  echo "ok   invalid-utf8-prompt-own-error"; passes=$((passes + 1))
else
  echo "FAIL invalid-utf8-prompt-own-error: rc=$rc"; tail -3 "$TMP/err"; failures=$((failures + 1))
fi
expect_error bench-gen-len-past-context "need 100000007 positions but .* has a context of 512" \
  bench --model "$MODEL" --prompt-len 8 --gen-len 100000000 --no-limits
if "$STRATA" bench --model "$MODEL" --prompt-len 8 --gen-len 5 --batch 2 --no-limits --threads 1 \
    >"$TMP/bench.json" 2>"$TMP/err" &&
  python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
assert d['generated_tokens'] == 10 and d['generated_tokens_expected'] == 10, d
# By hand for stories260K (h 64, ffn 172, 5 layers, 8 heads of 8, 4 KV heads, vocab 512):
# the linears 2 x 5 x (64x64 + 2 x 64x32 + 64x64 + 3 x 64x172) = 453,120 FLOPs a token;
# attention 4 x 5 x 8 x 8 = 1,280 FLOPs a position attended; the head 2 x 512 x 64 = 65,536.
# A sequence: prompt rows 1..8 (8 x 453,120 + 1,280 x 36) and the head once = 3,736,576;
# 4 decode rows at 9..12 positions (the 5th token is never fed back):
# 4 x (453,120 + 65,536) + 1,280 x 42 = 2,128,384. Two sequences: 11,729,920 FLOPs.
assert abs(d['executed_gflop'] - 0.01172992) <= 1e-9 * 0.01172992, d['executed_gflop']" "$TMP/bench.json"; then
  echo "ok   bench-reports-generated"; passes=$((passes + 1))
else
  echo "FAIL bench-reports-generated"; cat "$TMP/err"; failures=$((failures + 1))
fi
# With the machine's limits: every decode step paired with read-stream passes around it.
if "$STRATA" bench --model "$MODEL" --prompt-len 8 --gen-len 6 --batch 1 --threads 1 \
    >"$TMP/bench-limits.json" 2>"$TMP/err" &&
  python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
p = d['decode_read_bound_paired']
assert p['steps'] == d['result']['decode_steps'] == 5, d
assert 0 < p['p25_fraction'] <= p['median_fraction'] <= p['p75_fraction'], p
assert p['weights_only']['median_fraction'] < p['median_fraction'], p
assert p['median_probe_gbs'] > 0 and d['limits']['memory_read_gbs'] > 0, d
# The KV bytes of a step: one sequence over 9..13 positions (prompt 8, 5 decode steps),
# K and V of every layer of stories260K (5 layers, 4 KV heads of 8, f32): 1280 B a position.
assert p['kv_bytes_per_step'] == 11 * 5 * 2 * 4 * 8 * 4, p" "$TMP/bench-limits.json"; then
  echo "ok   bench-paired-read-bound"; passes=$((passes + 1))
else
  echo "FAIL bench-paired-read-bound"; cat "$TMP/err"; failures=$((failures + 1))
fi
for size in inf nan -1 1e30 0x10 " 5" 5XB; do
  expect_error "cpu-mem-$size" "cpu-mem" bench --model "$MODEL" --cpu-mem "$size" --no-limits
done
expect_error threads-1000 "1000 CPU threads requested: the limit is" generate --model "$MODEL" --prompt hi --threads 1000
expect_error limits-threads-1000 "1000 CPU threads requested" limits --threads 1000
expect_error max-batch-limit "--max-batch = 100000 is above the limit of 65536" generate --model "$MODEL" --prompt hi --max-batch 100000
expect_error bad-limit-name "unknown input limit 'bogus'" generate --model "$MODEL" --prompt hi --limit bogus=1
if STRATA_LIMIT_VOCAB=77 "$STRATA" limits --input --limit layers=5 >"$TMP/limits.json" 2>"$TMP/err" &&
  python3 -c "
import json, sys
d = {f['name']: f for f in json.load(open(sys.argv[1]))}
assert len(d) == 20, sorted(d)
assert d['request_bytes']['default'] == 1 << 20 and d['json_depth']['max'] == 1024, d['json_depth']
assert d['layers']['value'] == 5 and d['layers']['default'] == 1024, d['layers']
assert d['vocab']['value'] == 77 and d['vocab']['env'] == 'STRATA_LIMIT_VOCAB', d['vocab']
assert d['context']['default'] >= 131072 and d['hidden']['default'] >= 16384, d
" "$TMP/limits.json" &&
  "$STRATA" limits --threads 1 --gemm-n 64 >"$TMP/machine.json" 2>/dev/null &&
  python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
assert sorted(d) == ['gemm_gflops', 'gemm_n', 'memory_bandwidth_gbs', 'memory_read_gbs', 'threads'], d
" "$TMP/machine.json"; then
  echo "ok   limits-input"; passes=$((passes + 1))
else
  echo "FAIL limits-input"; cat "$TMP/err" "$TMP/limits.json"; failures=$((failures + 1))
fi
# The table of tunables (kernels/tunables.h): every STRATA_* variable once, with its type,
# default and the value this environment gives it.
if env -u STRATA_CPU_WEIGHTS STRATA_CUDA_PDL=early STRATA_LIMIT_LAYERS=9 \
  "$STRATA" limits --tunables >"$TMP/tunables.json" 2>"$TMP/err" &&
  python3 -c "
import json, sys
rows = json.load(open(sys.argv[1]))
d = {r['name']: r for r in rows}
assert len(d) == len(rows) == 15, sorted(d)
for r in rows:
    keys = ['name', 'type', 'default', 'current', 'description'] + (['choices'] if r['type'] == 'choice' else [])
    assert list(r) == keys and r['description'], r
pdl = d['STRATA_CUDA_PDL']
assert pdl['current'] == 'early' and pdl['default'] == 'on' and pdl['choices'] == ['on', 'off', 'early', 'all'], pdl
assert d['STRATA_CPU_WEIGHTS']['current'] is None and d['STRATA_CPU_WEIGHTS']['default'] == 'panels', d['STRATA_CPU_WEIGHTS']
assert d['STRATA_LIMIT_<NAME>']['current'] == {'STRATA_LIMIT_LAYERS': '9'}, d['STRATA_LIMIT_<NAME>']
assert d['STRATA_BENCH_THREADS']['type'] == 'int' and d['STRATA_BENCH_THREADS']['default'] == '2'
assert d['STRATA_PROFILE_DIR']['type'] == 'path'
" "$TMP/tunables.json"; then
  echo "ok   limits-tunables"; passes=$((passes + 1))
else
  echo "FAIL limits-tunables"; cat "$TMP/err" "$TMP/tunables.json"; failures=$((failures + 1))
fi
expect_error limits-tunables-and-input "excludes" limits --tunables --input

# strata tokenize: llama2.c's own tokenization of the reference prompts (BOS included), the
# ids back to text, and its refusals.
REF="$MODEL/reference/greedy.jsonl"
python3 -c 'import json,sys; [print(json.dumps({"text": json.loads(l)["prompt"]})) for l in open(sys.argv[1])]' \
  "$REF" >"$TMP/tok-in.jsonl"
if "$STRATA" tokenize --tokenizer "$MODEL" --add-special --file "$TMP/tok-in.jsonl" >"$TMP/tok-out.jsonl" &&
  python3 - "$REF" "$TMP/tok-out.jsonl" <<'PY'
import json, sys
want = [json.loads(l)["prompt_ids"] for l in open(sys.argv[1])]
got = [json.loads(l)["ids"] for l in open(sys.argv[2])]
assert got == want, (got, want)
PY
then
  echo "ok   tokenize-equals-llama2c"; passes=$((passes + 1))
else
  echo "FAIL tokenize-equals-llama2c"; failures=$((failures + 1))
fi
if [ "$("$STRATA" tokenize --tokenizer "$MODEL" --decode --text '[1, 403, 407, 261, 378]')" = '{"text":"Once upon a time"}' ] &&
  [ "$("$STRATA" tokenize --tokenizer "$MODEL" --text '<s>hi</s>' | python3 -c 'import json,sys; print(json.load(sys.stdin)["ids"][0])')" = 1 ]; then
  echo "ok   tokenize-decode-and-specials"; passes=$((passes + 1))
else
  echo "FAIL tokenize-decode-and-specials"; failures=$((failures + 1))
fi
expect_error tokenize-no-tokenizer "no tokenizer.json" tokenize --tokenizer "$TMP" --text hi
expect_error tokenize-missing "no such tokenizer file" tokenize --tokenizer "$TMP/none.json" --text hi
expect_error tokenize-both "exactly one of --text and --file" tokenize --tokenizer "$MODEL"
printf '{"txt": "a"}\n' >"$TMP/tok-bad.jsonl"
expect_error tokenize-bad-line "tok-bad.jsonl:1: a line needs a" tokenize --tokenizer "$MODEL" --file "$TMP/tok-bad.jsonl"
expect_error tokenize-no-chat-template "has no chat template" tokenize --tokenizer "$MODEL" \
  --file <(printf '{"messages": [{"role": "user", "content": "hi"}]}\n')
echo '{"model_type": "llama"}' >"$TMP/tokenizer.json"
expect_error tokenize-corrupt-json "tokenizer.json" tokenize --tokenizer "$TMP/tokenizer.json" --text hi
rm -f "$TMP/tokenizer.json"

# Models where users keep them (worker/model_path.h): a Hugging Face hub cache laid out as
# huggingface_hub writes one (blobs/, snapshots/REV/ of relative links, refs/main), found
# offline as ORG/NAME through HF_HOME; the same ids as the folder, and a name that is not
# there refused naming where it looked.
HUB_REPO="$TMP/hf-home/hub/models--strata-test--stories260K"
HUB_REV=0123456789abcdef0123456789abcdef01234567
mkdir -p "$HUB_REPO/blobs" "$HUB_REPO/refs" "$HUB_REPO/snapshots/$HUB_REV"
for f in config.json generation_config.json model.safetensors tokenizer.model tokenizer_config.json; do
  blob=$(sha256sum "$MODEL/$f" | cut -d' ' -f1)
  cp "$MODEL/$f" "$HUB_REPO/blobs/$blob"
  ln -s "../../blobs/$blob" "$HUB_REPO/snapshots/$HUB_REV/$f"
done
printf '%s' "$HUB_REV" >"$HUB_REPO/refs/main"
hub_gen=(generate --prompt "Once upon a time" --max-new-tokens 16 --format json)
"$STRATA" "${hub_gen[@]}" --model "$MODEL" 2>/dev/null | grep -v summary >"$TMP/hub-folder.jsonl"
HF_HUB_CACHE= HUGGINGFACE_HUB_CACHE= HF_HOME="$TMP/hf-home" "$STRATA" "${hub_gen[@]}" --model strata-test/stories260K \
  2>"$TMP/err" | grep -v summary >"$TMP/hub-name.jsonl"
if [ -s "$TMP/hub-folder.jsonl" ] && cmp -s "$TMP/hub-folder.jsonl" "$TMP/hub-name.jsonl" &&
  [ "$(HF_HUB_CACHE="$TMP/hf-home/hub" "$STRATA" tokenize --tokenizer strata-test/stories260K@$HUB_REV \
        --text "Once upon a time")" = "$("$STRATA" tokenize --tokenizer "$MODEL" --text "Once upon a time")" ]; then
  echo "ok   hub-cache-org-name"; passes=$((passes + 1))
else
  echo "FAIL hub-cache-org-name:"; cat "$TMP/hub-folder.jsonl" "$TMP/hub-name.jsonl" "$TMP/err"
  failures=$((failures + 1))
fi
HF_HUB_CACHE= HUGGINGFACE_HUB_CACHE= HF_HOME="$TMP/hf-home" expect_error hub-cache-missing \
  "model 'strata-test/nope' not found: looked for the folder .*/strata-test/nope and for $TMP/hf-home/hub/models--strata-test--nope .*HF_HOME=$TMP/hf-home.*does not download" \
  generate --model strata-test/nope --prompt hi

echo "$passes passed, $failures failed"
[ "$failures" -eq 0 ]
