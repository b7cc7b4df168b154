#!/usr/bin/env bash
# strata predict (docs/S3.md) end to end through the real binary: train, eval and online on
# GSM8K rows with stories260K's tokenizer, their JSON, and bad input refused with exit 2 and
# one line naming the file and the field.
# Usage: test_predict_cli.sh STRATA_BINARY STORIES_MODEL_DIR SHARED_DIR
set -u
STRATA=$1
MODEL=$2
DATA=$3/datasets/gsm8k/train.jsonl
[ -f "$DATA" ] || { echo "skip: no $DATA"; exit 77; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
failures=0

ok() { echo "ok   $1"; }
bad() { echo "FAIL $1"; cat "$TMP/err"; failures=$((failures + 1)); }

# expect_error NAME PATTERN ARGS...: exit 2, exactly one stderr line, matching PATTERN.
expect_error() {
  local name=$1 pattern=$2
  shift 2
  "$STRATA" "$@" >"$TMP/out" 2>"$TMP/err"
  local rc=$?
  if [ "$rc" -eq 2 ] && [ "$(wc -l <"$TMP/err")" -eq 1 ] && grep -q -- "$pattern" "$TMP/err"; then
    ok "$name: $(cat "$TMP/err")"
  else
    bad "$name: rc=$rc, wanted one line matching /$pattern/"
  fi
}

if "$STRATA" predict train --data "$DATA" --tokenizer "$MODEL" --limit 300 --epochs 2 \
    --hash-bits 12 --out "$TMP/m.bin" >"$TMP/out" 2>"$TMP/err" &&
  grep -q "trained on 300 examples" "$TMP/out"; then
  ok train
else
  bad train
fi

if "$STRATA" predict eval --model "$TMP/m.bin" --data "$DATA" --tokenizer "$MODEL/tokenizer.model" \
    --skip 300 --limit 100 --confidence 0.8 --json "$TMP/eval.json" >"$TMP/out" 2>"$TMP/err" &&
  python3 - "$TMP/eval.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
assert j["n"] == 100 and j["buckets"] == 10 and j["confidence"] == 0.8, j
assert 0 <= j["accuracy"] <= 1 and 0 <= j["reservation_cover"] <= 1, j
rows = j["confusion"]
assert len(rows) == 10 and all(len(r) == 10 for r in rows), rows
assert sum(map(sum, rows)) == 100
assert abs(sum(rows[i][i] for i in range(10)) / 100 - j["accuracy"]) < 1e-12
res = j["reservation_matrix"]  # the same rows (true buckets), reserved buckets as columns
assert [sum(r) for r in res] == [sum(r) for r in rows], (res, rows)
PY
then
  ok eval-json
else
  bad eval-json
fi

if "$STRATA" predict online --data "$DATA" --tokenizer "$MODEL" --limit 250 --window 100 \
    --hash-bits 12 --json "$TMP/online.json" >"$TMP/out" 2>"$TMP/err" &&
  python3 - "$TMP/online.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
w = j["windows"]
assert j["examples"] == 250 and [(x["from"], x["to"]) for x in w] == [(0, 100), (100, 200), (200, 250)], w
mean = sum(x["accuracy"] * (x["to"] - x["from"]) for x in w) / 250
assert abs(mean - j["accuracy"]) < 1e-12, (mean, j["accuracy"])
PY
then
  ok online-json
else
  bad online-json
fi

# Rows as requests with their lengths enforced, served with S3's packing by the predictor
# trained above: every request finishes at its length, each is learned online, and the file
# is written back changed.
cp "$TMP/m.bin" "$TMP/served.bin"
if "$STRATA" predict requests --data "$DATA" --tokenizer "$MODEL" --skip 300 --limit 6 \
    --out "$TMP/req.jsonl" >"$TMP/out" 2>"$TMP/err" &&
  "$STRATA" serve --model "$MODEL" --threads 1 --requests "$TMP/req.jsonl" --results "$TMP/res.jsonl" \
    --max-context 512 --kv-budget 1024 --predictor "$TMP/served.bin" --no-length-hint \
    --stats-out "$TMP/stats.json" >"$TMP/out" 2>"$TMP/err" &&
  ! cmp -s "$TMP/m.bin" "$TMP/served.bin" &&
  python3 - "$TMP/req.jsonl" "$TMP/res.jsonl" "$TMP/stats.json" <<'PY'
import json, sys
req = [json.loads(l) for l in open(sys.argv[1])]
assert [q["id"] for q in req] == [f"row-{i}" for i in range(300, 306)], req
assert all(q["ignore_eos"] and q["max_new_tokens"] >= 1 and q["prompt_ids"][0] == 1 for q in req)
res = {r["id"]: r for r in map(json.loads, open(sys.argv[2]))}
for q in req:  # the length, or the context's end
    n = len(res[q["id"]]["output_ids"])
    assert n == q["max_new_tokens"] or len(q["prompt_ids"]) + n >= 512, (q["id"], n)
p = json.load(open(sys.argv[3]))["packing"]
assert p["reserve"] == "predicted" and p["prediction"]["learned"] == 6, p
PY
then
  ok requests-and-serve
else
  bad requests-and-serve
fi

printf '{"question": "a", "answer": "b"}\n{"question": "c"}\n' >"$TMP/bad.jsonl"
expect_error missing-output "bad.jsonl:2: no output field" \
  predict train --data "$TMP/bad.jsonl" --tokenizer "$MODEL" --out "$TMP/x.bin"
expect_error missing-given-field "no prompt field 'text'" \
  predict eval --model "$TMP/m.bin" --data "$TMP/bad.jsonl" --tokenizer "$MODEL" --prompt-field text
printf 'not a model at all, long enough to hold a header of sixty-eight bytes..........\n' \
  >"$TMP/junk.bin"
expect_error wrong-magic "junk.bin: not a length predictor (wrong magic" \
  predict eval --model "$TMP/junk.bin" --data "$DATA" --tokenizer "$MODEL"
head -c 1000 "$TMP/m.bin" >"$TMP/cut.bin"
expect_error truncated "cut.bin: length predictor has 1000 bytes.*(truncated)" \
  predict eval --model "$TMP/cut.bin" --data "$DATA" --tokenizer "$MODEL"
expect_error no-tokenizer "/no/such/tok" \
  predict train --data "$DATA" --tokenizer /no/such/tok --out "$TMP/x.bin"
expect_error no-rows "no rows selected" \
  predict train --data "$DATA" --tokenizer "$MODEL" --skip 100000 --out "$TMP/x.bin"
expect_error bad-buckets "bucket count must be in" \
  predict train --data "$DATA" --tokenizer "$MODEL" --limit 10 --buckets 1 --out "$TMP/x.bin"
expect_error bad-confidence "confidence" \
  predict eval --model "$TMP/m.bin" --data "$DATA" --tokenizer "$MODEL" --confidence 0
# strata plan with S3's packing (issue 16 item 4): GSM8K's lengths on two CPU workers whose
# 2 MiB each hold a few whole KV slots of 399 positions; reserving prompt + output (max-new,
# the oracle) or what the predictor above reserves lets the planned decode batch grow, with
# fewer positions than its slots would take whole.
for reserve in max-new predicted; do
  extra=()
  [ "$reserve" = predicted ] && extra=(--predict-eval "$TMP/eval.json")
  if "$STRATA" plan --model "$MODEL" --workload "$DATA" --host-compute --nodes 2 --stage-mem 0.002 \
      --rra-only --kv-reserve "$reserve" "${extra[@]}" --format json >"$TMP/plan.json" 2>"$TMP/err" &&
    python3 - "$TMP/plan.json" "$reserve" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
p = j["packing"]
assert p["reserve"] == sys.argv[2] and p["kv_capacity"] == 399, p
whole, packed = j["schedule"], p["choice"]["schedule"]
assert whole["kv_positions"] == 0, whole
# More sequences decode together, in fewer positions than their slots whole.
assert packed["decode_batch"] > 2 * whole["decode_batch"], (packed["decode_batch"], whole["decode_batch"])
assert 0 < packed["kv_positions"] < packed["kv_slots"] * 399, packed
if sys.argv[2] == "max-new":
    assert packed["reservations_exceeded"] == 0, packed
PY
  then
    ok "plan-packing-$reserve"
  else
    bad "plan-packing-$reserve"
  fi
  # Planned for pooled admission (what the members fill, the sum's quantile), the same memory
  # holds a decode batch at least as large, and the command it prints runs it so.
  if "$STRATA" plan --model "$MODEL" --workload "$DATA" --host-compute --nodes 2 --stage-mem 0.002 \
      --rra-only --kv-reserve "$reserve" "${extra[@]}" --kv-admission pooled --format json \
      >"$TMP/pooled.json" 2>"$TMP/err" &&
    "$STRATA" plan --model "$MODEL" --workload "$DATA" --host-compute --nodes 2 --stage-mem 0.002 \
      --rra-only --kv-reserve "$reserve" "${extra[@]}" --kv-admission pooled 2>/dev/null |
      grep -q -- "--kv-admission pooled --predict-confidence 0.9" &&
    python3 - "$TMP/plan.json" "$TMP/pooled.json" <<'PY'
import json, sys
reserved = json.load(open(sys.argv[1]))["packing"]
pooled = json.load(open(sys.argv[2]))["packing"]
assert reserved["admission"] == "reserved" and pooled["admission"] == "pooled", pooled
assert pooled["confidence"] == 0.9, pooled
r, p = reserved["choice"]["schedule"], pooled["choice"]["schedule"]
assert p["decode_batch"] >= r["decode_batch"], (p["decode_batch"], r["decode_batch"])
assert 0 < p["kv_positions"] < p["kv_slots"] * 399, p
PY
  then
    ok "plan-packing-$reserve-pooled"
  else
    bad "plan-packing-$reserve-pooled"
  fi
done
expect_error plan-pooled-without-packing "--kv-admission pooled plans packing" \
  plan --model "$MODEL" --workload S --length-scale 0.1 --host-compute --kv-admission pooled
expect_error plan-predicted-without-eval "--kv-reserve predicted needs --predict-eval" \
  plan --model "$MODEL" --workload S --length-scale 0.1 --host-compute --kv-reserve predicted
echo '{"accuracy": 1}' >"$TMP/noeval.json"
expect_error plan-eval-without-matrix "noeval.json: no \"reservation_matrix\"" \
  plan --model "$MODEL" --workload S --length-scale 0.1 --host-compute --kv-reserve predicted \
  --predict-eval "$TMP/noeval.json"

# The packing options refuse what cannot run, naming the option.
printf '{"id": "a", "prompt": "Once", "max_new_tokens": 2}\n' >"$TMP/one.jsonl"
expect_error predictor-without-budget "--predictor .* needs a --kv-budget" \
  serve --model "$MODEL" --requests "$TMP/one.jsonl" --results "$TMP/o.jsonl" --predictor "$TMP/m.bin"
expect_error tiny-budget "--kv-budget 1 .*fewer than 2 KV positions" \
  generate --model "$MODEL" --prompt Once --kv-budget 1
expect_error bad-predict-confidence "--predict-confidence must be in (0, 1\], got 2" \
  generate --model "$MODEL" --prompt Once --kv-budget 64 --predict-confidence 2
expect_error model-and-buckets "excludes" \
  predict online --model "$TMP/m.bin" --buckets 5 --data "$DATA" --tokenizer "$MODEL"

[ "$failures" -eq 0 ] || { echo "$failures failures"; exit 1; }
echo "all passed"
