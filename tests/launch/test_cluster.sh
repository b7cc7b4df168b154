#!/usr/bin/env bash
# The cluster end to end under real mpirun (launch/local-cluster.sh), against the
# single-process `strata generate` as the reference.
#   test_cluster.sh STRATA MODEL CASE [ARGS...]
# Cases:
#   equal NP MODEL [serve options...]  result ids == strata generate (greedy), mixed
#                                      prompt and output lengths, a malformed line gets an
#                                      error result; run with --micro-batches 1 and with the
#                                      given options, both must match
#                                      (with --kv-budget: S3's supervisor preempted or
#                                      grew sequences on the way)
#   disk 3 STORIES [serve options...]  as equal, the options putting every weight on disk:
#                                      the bytes each stage read from disk and from a CPU
#                                      tier, by hand from stories260K's shape
#   budget NP MODEL BYTES [options...] every stage within BYTES (allocated, and the worker's peak
#                                      resident memory after load), the rest streamed from
#                                      disk, results equal to strata generate
#   nodes NP MODEL VARIANT             a node file (tiers: a device stand-in beside a CPU
#                                      rank; unequal: fast, slow and disk-streaming nodes;
#                                      small: two CPU nodes of unequal memory and speed;
#                                      MODEL family:NAME is tests/worker/families' model):
#                                      strata plan --nodes equals what each worker allocated,
#                                      each within its budgets, results equal
#   dead NP RANK                       a worker killed mid-run: rank 0 names it, exits
#                                      non-zero within a bounded time
#   refuse                             too many stages / over budget / HeteGen: clear refusal,
#                                      no hang
#   hostile                            a line of 100,000 nested arrays, invalid UTF-8, a line
#                                      past the size limit, a repeated id: each bad line gets
#                                      an error result, the rest run, the job ends cleanly
#   sigterm                            SIGTERM mid-run: the running requests get the grace
#                                      period, every line of the file gets a result, exit 143
#   launcher_signals                   stop signals storming local-cluster.sh's process group
#                                      (they reach its pgrep and rm too) while a rank
#                                      runs: the script still waits for mpirun and exits with
#                                      the ranks' status; a one-rank serve says it started
#   dead_coordinator                   rank 0 killed mid-run: every worker notices at once (its
#                                      liveness link closes) and ends the job naming it
#   schedule NP                        --latency-bound with --workload (RRA): the run profiles its
#                                      stages, plans, re-deploys the chosen layers and slots,
#                                      and its results equal strata generate; a second run
#                                      reuses the saved profile; a bound nothing meets is
#                                      refused before any request runs, naming the fastest
#                                      achievable latency
#   schedule_s3 NP                     --latency-bound with --kv-reserve max-new: the search plans
#                                      S3's packing, its positions are the run's KV budget, the
#                                      results equal strata generate; --kv-budget beside the
#                                      bound and predicted without --predict-eval are refused
#   dead_handover NP RANK ENCODERS     WAA with ENCODERS prefill ranks; RANK dies in its
#                                      second KV hand-over with the transfers posted: rank 0
#                                      names it and its side, every request line has a
#                                      result (the unfinished name the rank), bounded time
#   schedule_waa NP POLICY             --latency-bound inf --schedule-policy POLICY (waa-c or
#                                      waa-m): the search deploys that WAA split of the
#                                      workers, KV moves between the sides, results equal
#                                      strata generate
#   slow NP                            every step computes longer than the heartbeat
#                                      timeout: the workers answer pings meanwhile, the
#                                      results equal strata generate
set -euo pipefail
strata=$1
stories=$2
case_name=$3
shift 3
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export STRATA=$strata STRATA_LOG_LEVEL=${STRATA_LOG_LEVEL:-warn}
fail() { echo "FAIL: $*" >&2; exit 1; }

cluster() {  # NP serve-options... ; a hard guard under ctest's TIMEOUT
  local np=$1
  shift
  # A context that fits every test request: the run's KV cache is sized from it up front.
  timeout -k 5 60 bash "$root/launch/local-cluster.sh" "$np" --max-context 128 "$@"
}

# Requests with mixed prompt and output lengths, and one malformed line.
write_requests() {  # MODEL FILE
  if [ -f "$1/config.json" ] && [ ! -f "$1/tokenizer.json" ] && [ ! -f "$1/tokenizer.model" ]; then
    # A folder without a tokenizer (tests/worker/families' models, 256 ids): prompts as ids.
    cat >"$2" <<'JSON'
{"id": "a", "prompt_ids": [5, 100, 200, 7, 9, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67], "max_new_tokens": 40}
{"id": "b", "prompt_ids": [2, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], "max_new_tokens": 2}
{"id": "e", "prompt_ids": [9, 8, 7, 6, 5, 4, 3, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120, 130, 140, 150, 160, 170, 180, 190, 200, 210, 220, 230, 240, 250, 11, 22, 33, 44, 55, 66], "max_new_tokens": 8}
{"id": "c", "prompt": "3 11", "max_new_tokens": 4}
{"id": "bad", "prompt": "2 3", "max_new_tokens": "lots"}
JSON
  elif [ "${1#dummy:}" != "$1" ]; then
    cat >"$2" <<'JSON'
{"id": "a", "prompt": "2 100 200", "max_new_tokens": 5}
{"id": "b", "prompt_ids": [2, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], "max_new_tokens": 2}
{"id": "c", "prompt": "2 11", "max_new_tokens": 4}
{"id": "d", "prompt": "2 300 301 302 303", "max_new_tokens": 1}
{"id": "bad", "prompt": "2 3", "max_new_tokens": "lots"}
JSON
  else
    cat >"$2" <<'JSON'
{"id": "a", "prompt": "Once upon a time", "max_new_tokens": 40}
{"id": "b", "prompt": "The cat", "max_new_tokens": 3}
{"id": "c", "prompt": "Lily and Tom went to the park to play with a big red ball", "max_new_tokens": 24}
{"id": "d", "prompt": "One day", "max_new_tokens": 1}
{"id": "e", "prompt": "A", "max_new_tokens": 12}
{"id": "f", "prompt": "Sam", "max_new_tokens": 30}
not json at all
{"id": "g", "prompt": "The sun was hot", "max_new_tokens": 17}
JSON
  fi
}

# The reference: one `strata generate` over every prompt with the largest budget; a greedy
# request for n tokens must get the first n of them (or all of them if EOS came first).
reference() {  # MODEL REQUESTS OUT
  local args=() max=0
  while IFS= read -r line; do
    jq -e . >/dev/null 2>&1 <<<"$line" || continue
    [ "$(jq -r 'has("max_new_tokens") and (.max_new_tokens|type=="number")' <<<"$line")" = true ] || continue
    local p n
    p=$(jq -r 'if has("prompt") then .prompt else (.prompt_ids|map(tostring)|join(" ")) end' <<<"$line")
    n=$(jq -r .max_new_tokens <<<"$line")
    [ "$n" -gt "$max" ] && max=$n
    args+=(--prompt "$p")
  done <"$2"
  "$strata" generate --model "$1" --threads 1 --max-new-tokens "$max" --format json "${args[@]}" >"$3"
}

check_equal() {  # MODEL REQUESTS RESULTS
  local ref=$tmp/ref.jsonl
  [ -s "$ref" ] || reference "$1" "$2" "$ref"
  python3 - "$2" "$ref" "$3" <<'PY'
import json, sys
reqs, ref, res = sys.argv[1:4]
got = {}
for line in open(res):
    r = json.loads(line)
    if r["id"] in got: sys.exit(f"FAIL: result {r['id']} written twice")
    got[r["id"]] = r
refs = [json.loads(l) for l in open(ref)]
good = 0
for n, line in enumerate(open(reqs), 1):
    try:
        q = json.loads(line)
        ok = isinstance(q, dict) and isinstance(q.get("max_new_tokens"), int)
    except ValueError:
        ok = False
    if not ok:
        errs = [r for r in got.values() if r["stop_reason"] == "error" and f":{n}" in r.get("error", "")]
        if not errs: sys.exit(f"FAIL: malformed line {n} has no error result")
        continue
    r = refs[good]; good += 1
    want = r["output_ids"][: q["max_new_tokens"]]
    have = got.get(q["id"])
    if have is None: sys.exit(f"FAIL: no result for {q['id']}")
    if have["prompt_ids"] != r["prompt_ids"]: sys.exit(f"FAIL: {q['id']}: prompt ids {have['prompt_ids']} != {r['prompt_ids']}")
    if have["output_ids"] != want: sys.exit(f"FAIL: {q['id']}: {have['output_ids']} != generate's {want}")
print(f"{good} results equal to strata generate; {len(got) - good} error results")
PY
}

# equal NP MODEL [serve options...]: both runs equal to strata generate, the stats sane;
# the second run's stats left in $tmp/stats.json.
run_equal() {
  local np=$1 model=$2
  shift 2
  if [ "${model#family:}" != "$model" ]; then  # a random-weight model of that family
    /usr/bin/python3 "$root/tests/worker/families/make_model.py" --family "${model#family:}" \
      --out "$tmp/model" --seed 0 >/dev/null
    model=$tmp/model
  fi
  write_requests "$model" "$tmp/req.jsonl"
  cluster "$np" --model "$model" --threads 1 --requests "$tmp/req.jsonl" --results "$tmp/one.jsonl" \
    --micro-batches 1 --stats-out "$tmp/stats1.json"
  check_equal "$model" "$tmp/req.jsonl" "$tmp/one.jsonl"
  cluster "$np" --model "$model" --threads 1 --requests "$tmp/req.jsonl" --results "$tmp/many.jsonl" \
    --stats-out "$tmp/stats.json" "$@"
  check_equal "$model" "$tmp/req.jsonl" "$tmp/many.jsonl"
  jq -e --argjson np "$np" '.ranks == $np and (.stages | length) == $np - 1 and .generated_tokens > 0
      and ([.stages[] | .bubble_fraction >= 0 and .bubble_fraction <= 1 and .busy_seconds > 0] | all)' \
    "$tmp/stats.json" >/dev/null || fail "stats: $(cat "$tmp/stats.json")"
  # With a KV budget (S3) the supervisor must have preempted or grown sequences: the
  # results above equal generate's through those recomputes (the stories260K case
  # preempts; test_stories260k checks the counts).
  if [ "$(jq 'has("packing")' "$tmp/stats.json")" = true ]; then
    jq -e '.packing.counters.preemptions + .packing.counters.extensions > 0' \
      "$tmp/stats.json" >/dev/null || fail "no preemption: $(jq -c .packing "$tmp/stats.json")"
  fi
}

case $case_name in
  equal)
    run_equal "$@"
    ;;
  disk)  # NP=3 MODEL=stories260K [serve options putting every weight on disk]
    run_equal "$@"
    # What each stage read from disk, by hand. A stories260K layer: 64x64 + 2 x 64x32 + 64x64
    # (attention) + 3 x 64x172 (MLP) + 2 x 64 (norms) = 45,440 f32 = 181,760 B, read in
    # 4 KiB pages (O_DIRECT): 45 pages = 184,320 B. Rank 1 holds layers [0, 3) in two host
    # staging slots, so every step reads its three layers again, plus the first one once more:
    # the last layer's acquire prefetches layer 0 for the step after (FlexGen's overlap crosses
    # steps), and the last step's prefetch is read too. Rank 2's two layers fit its two slots
    # and are read once. Nothing comes from a CPU tier.
    # --cpu-mem 600KiB alone should put them there too: the cluster drops it today (issue 43),
    # so the policy does.
    jq -e '(.stages | map(.rank)) == [1, 2] and ([.stages[].bytes_from_cpu] | all(. == 0))
        and .stages[0].bytes_from_disk == (.stages[0].steps * 3 + 1) * 184320 and .stages[0].steps > 0
        and .stages[1].bytes_from_disk == 2 * 184320' "$tmp/stats.json" >/dev/null ||
      fail "bytes per tier: $(jq -c '[.stages[] | {rank, steps, bytes_from_cpu, bytes_from_disk}]' \
        "$tmp/stats.json")"
    echo "disk reads as placed: $(jq -c '[.stages[] | {rank, steps, bytes_from_disk}]' "$tmp/stats.json")"
    ;;
  budget)  # NP MODEL BYTES [serve options setting a budget of BYTES per stage...]
    # Each stage within the budget (what its worker allocated, and its own peak resident
    # memory after load over what it held before), the rest streamed from disk, results
    # equal to strata generate's.
    np=$1 model=$2 bytes=$3
    shift 3
    write_requests "$model" "$tmp/req.jsonl"
    mkdir -p "$tmp/disk"
    cluster "$np" --model "$model" --threads 1 --requests "$tmp/req.jsonl" --results "$tmp/r.jsonl" \
      --disk-dir "$tmp/disk" --stats-out "$tmp/stats.json" "$@"
    check_equal "$model" "$tmp/req.jsonl" "$tmp/r.jsonl"
    python3 - "$tmp/stats.json" "$bytes" <<'PY'
import json, sys
stats, budget = json.load(open(sys.argv[1])), int(sys.argv[2])
stages = stats["stages"]
for s in stages:
    held = s["allocated"]["gpu"] + s["allocated"]["cpu"]
    grown = s["peak_rss_bytes"] - s["rss_before_load_bytes"]
    if held <= 0 or held > budget: sys.exit(f"FAIL: rank {s['rank']} allocated {held} B, budget {budget}")
    if s["rss_before_load_bytes"] <= 0 or grown > budget:
        sys.exit(f"FAIL: rank {s['rank']} grew {grown} B resident after load, budget {budget}")
    print(f"rank {s['rank']} layers {s['layers']}: allocated {held} B, resident +{grown} B, "
          f"{s['allocated']['disk']} B on disk, read {s['bytes_from_disk']} B from it; budget {budget}")
if not any(s["bytes_from_disk"] > 0 for s in stages): sys.exit("FAIL: nothing streamed from disk")
PY
    ;;
  nodes)  # NP MODEL VARIANT: a node file (tiers: device stand-in beside CPU; unequal nodes)
    np=$1 model=$2 variant=$3
    mkdir -p "$tmp/disk"
    if [ "${model#family:}" != "$model" ]; then  # a random-weight model of that family
      /usr/bin/python3 "$root/tests/worker/families/make_model.py" --family "${model#family:}" \
        --out "$tmp/model" --seed 0 >/dev/null
      model=$tmp/model
    fi
    case $variant in
      small)  # two CPU nodes of unequal memory and speed (a small model's stages)
        cat >"$tmp/nodes.json" <<JSON
[{"rank": 1, "device": "cpu", "cpu-mem": "64MiB", "memory-read-gbs": 10},
 {"rank": 2, "device": "cpu", "cpu-mem": "8MiB", "memory-read-gbs": 5}]
JSON
        ;;
      tiers)  # rank 1 runs the device path with the CPU standing in, rank 2 computes on the
        # CPU, rank 3 is the fastest (its rates pinned), so it takes most layers, holds less
        # than them and keeps the rest on its disk
        cat >"$tmp/nodes.json" <<JSON
[{"rank": 1, "device": "host", "gpu-mem": "64MiB", "cpu-mem": "64MiB", "memory-read-gbs": 10},
 {"rank": 2, "device": "cpu", "cpu-mem": "64MiB", "memory-read-gbs": 10},
 {"rank": 3, "device": "cpu", "cpu-mem": "4300KiB", "disk-dir": "$tmp/disk",
  "memory-read-gbs": 40, "disk-read-gbs": 40}]
JSON
        ;;
      unequal)  # nodes of 2 GiB reading at 10 and 5 GB/s, and one of 200 MiB streaming
        cat >"$tmp/nodes.yaml" <<YAML
- rank: 1
  cpu-mem: 2GiB
  threads: 2
  memory-read-gbs: 10
- rank: 2
  cpu-mem: 200MiB
  disk-dir: $tmp/disk
  memory-read-gbs: 10
  disk-read-gbs: 4
- rank: 3
  cpu-mem: 2GiB
  memory-read-gbs: 5
YAML
        mv "$tmp/nodes.yaml" "$tmp/nodes.json"  # YAML by its content, whatever the name
        ;;
      *) fail "unknown nodes variant $variant" ;;
    esac
    # A family's model runs steps of 8 rows, so a window on every layer (mistral's 16 of 128
    # positions) bounds each KV slot to W - 1 + 8 + ceil(W / 8) = 25 rows (kernels/backend.h).
    steps=()
    [ "$model" != "$tmp/model" ] || steps=(--max-step-tokens 8 --max-batch 4)
    write_requests "$model" "$tmp/req.jsonl"
    "$strata" plan --nodes "$tmp/nodes.json" --model "$model" --threads 1 --max-context 128 \
      "${steps[@]}" --format json >"$tmp/plan.json" 2>/dev/null
    cluster "$np" --model "$model" --threads 1 --nodes "$tmp/nodes.json" --requests "$tmp/req.jsonl" \
      --results "$tmp/r.jsonl" --stats-out "$tmp/stats.json" "${steps[@]}"
    check_equal "$model" "$tmp/req.jsonl" "$tmp/r.jsonl"
    python3 - "$tmp/plan.json" "$tmp/stats.json" "$variant" "$model" "${#steps[@]}" <<'PY'
import json, os, sys
plan, stats, variant = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), sys.argv[3]
ps, ss = plan["stages"], stats["stages"]
config_path = os.path.join(sys.argv[4], "config.json")
if int(sys.argv[5]) > 0 and os.path.exists(config_path):
    c = json.load(open(config_path))
    w = c.get("sliding_window") if c.get("model_type") == "mistral" else None
    rows = min(128, w - 1 + 8 + -(-w // 8)) if w else 128  # steps of max(8, 4 slots) rows
    for p in ps:
        if f"{rows} rows a slot" not in p["placement"]:
            sys.exit(f"FAIL: rank {p['rank']}'s KV slots should hold {rows} rows: {p['placement']}")
    print(f"KV slots of {rows} rows (of 128 positions) as planned")
if len(ps) != len(ss): sys.exit(f"FAIL: plan has {len(ps)} stages, the run {len(ss)}")
for p, s in zip(ps, ss):
    # strata plan --nodes is what each worker allocated, byte for byte.
    want = (p["rank"], p["layers"], p["device_compute"], p["gpu_bytes"], p["cpu_bytes"], p["disk_bytes"])
    have = (s["rank"], s["layers"], s["device_compute"], s["allocated"]["gpu"], s["allocated"]["cpu"],
            s["allocated"]["disk"])
    if want != have: sys.exit(f"FAIL: strata plan {want} but the worker {have}")
    budget = p["inventory"]["budget"]
    for tier in ("gpu", "cpu"):
        b = budget[f"{tier}_mem"]
        if b >= 0 and s["allocated"][tier] > b: sys.exit(f"FAIL: rank {s['rank']} {tier} over {b}")
    print(f"rank {s['rank']} layers {s['layers']} {'device' if s['device_compute'] else 'cpu'} compute: "
          f"allocated {s['allocated']} as planned; read {s['bytes_from_disk']} B from disk")
n = [s["layers"][1] - s["layers"][0] for s in ss]
if variant == "small":
    pass  # the byte-for-byte check above is the point
elif variant == "tiers":
    if [s["device_compute"] for s in ss] != [True, False, False]: sys.exit("FAIL: tiers not each rank's own")
    if ss[0]["allocated"]["gpu"] <= 0 or ss[1]["allocated"]["gpu"] != 0: sys.exit("FAIL: gpu tier bytes")
    # What it cannot hold (here its KV cache, as the planner moves it first) is on its disk.
    if ss[2]["allocated"]["disk"] <= 0: sys.exit("FAIL: rank 3 holds nothing on disk")
else:
    # Rank 1 reads twice as fast as rank 3 with the same memory (and fixed parts of about the
    # same size, the embedding and the tied head): more layers; rank 2 holds less than its
    # layers and streams the rest from its disk.
    if not n[0] > n[2]: sys.exit(f"FAIL: split {n} does not favour the faster node")
    if ss[1]["bytes_from_disk"] <= 0 or ss[1]["allocated"]["disk"] <= 0: sys.exit("FAIL: rank 2 did not stream")
print(f"split {n}")
PY
    ;;
  dead)  # NP RANK [serve options...]
    np=$1
    rank=$2
    shift 2
    write_requests "$stories" "$tmp/req.jsonl"
    start=$(date +%s)
    set +e
    cluster "$np" --model "$stories" --threads 1 --requests "$tmp/req.jsonl" --results "$tmp/r.jsonl" \
      --debug-kill-rank "$rank" --debug-kill-after-steps 2 --heartbeat-interval 0.2 --heartbeat-timeout 2 \
      "$@" >"$tmp/out" 2>&1
    rc=$?
    set -e
    took=$(($(date +%s) - start))
    [ "$rc" -ne 0 ] || fail "exit status 0 after rank $rank died"
    grep -q "worker rank $rank .*is dead" "$tmp/out" || { cat "$tmp/out"; fail "rank $rank not named"; }
    [ "$took" -le 20 ] || fail "took $took s"
    # Nothing is lost: every request line has a result, the unfinished ones an error that
    # says why (with the tokens they had).
    lines=$(wc -l <"$tmp/req.jsonl")
    [ "$(wc -l <"$tmp/r.jsonl")" -eq "$lines" ] || { cat "$tmp/r.jsonl"; fail "not one result per request"; }
    jq -se --arg r "worker rank $rank" '[.[] | select(.stop_reason == "error" and (.error | contains($r)))]
        | length > 0' "$tmp/r.jsonl" >/dev/null || { cat "$tmp/r.jsonl"; fail "no unfinished request names rank $rank"; }
    echo "rank $rank named, exit $rc after $took s, $lines results"
    ;;
  dead_handover)
    np=$1
    rank=$2
    encoders=$3
    write_requests "$stories" "$tmp/req.jsonl"
    start=$(date +%s)
    set +e
    cluster "$np" --model "$stories" --threads 1 --requests "$tmp/req.jsonl" --results "$tmp/r.jsonl" \
      --waa-encoders "$encoders" --waa-encode-batch 2 --micro-batches 2 --max-batch 4 \
      --debug-kill-rank "$rank" --debug-die-in-handover 2 --heartbeat-interval 0.2 --heartbeat-timeout 2 \
      >"$tmp/out" 2>&1
    rc=$?
    set -e
    took=$(($(date +%s) - start))
    [ "$rc" -ne 0 ] || fail "exit status 0 after rank $rank died"
    side=$([ "$rank" -le "$encoders" ] && echo prefill || echo decode)
    grep -q "worker rank $rank ($side stage layers .*is dead.*KV hand-overs were in progress" "$tmp/out" ||
      { cat "$tmp/out"; fail "rank $rank not named as a $side stage dying in a hand-over"; }
    [ "$took" -le 20 ] || fail "took $took s"
    lines=$(wc -l <"$tmp/req.jsonl")
    [ "$(wc -l <"$tmp/r.jsonl")" -eq "$lines" ] || { cat "$tmp/r.jsonl"; fail "not one result per request"; }
    jq -se --arg r "worker rank $rank" '[.[] | select(.stop_reason == "error" and (.error | contains($r)))]
        | length > 0' "$tmp/r.jsonl" >/dev/null || { cat "$tmp/r.jsonl"; fail "no unfinished request names rank $rank"; }
    echo "$side rank $rank died in a hand-over: named, exit $rc after $took s, $lines results"
    ;;
  schedule)
    np=$1
    write_requests "$stories" "$tmp/req.jsonl"
    plan=(--workload S --length-scale 0.1 --layer-profile "$tmp/profile.json" --schedule-policy rra)
    cluster "$np" --model "$stories" --threads 1 --requests "$tmp/req.jsonl" --results "$tmp/r1.jsonl" \
      "${plan[@]}" --latency-bound inf --stats-out "$tmp/s1.json"
    check_equal "$stories" "$tmp/req.jsonl" "$tmp/r1.jsonl"
    [ -s "$tmp/profile.json" ] || fail "no layer profile saved"
    # One stage per worker, or fewer where the search split stages over tensor-parallel groups.
    jq -e --arg p "$tmp/profile.json" --argjson n "$((np - 1))" '.schedule.profile == $p
        and (.schedule.control_variables | .tp_groups * (.tp_degree - 1))
            + (.schedule.allocation | length) == $n and (.schedule.allocation | add) == 5
        and .schedule.predicted_throughput_tok_s > 0 and .schedule.measured_requests > 0
        and .micro_batches == .schedule.control_variables.micro_batches' "$tmp/s1.json" >/dev/null ||
      fail "stats: $(cat "$tmp/s1.json")"
    sum=$(md5sum <"$tmp/profile.json")
    cluster "$np" --model "$stories" --threads 1 --requests "$tmp/req.jsonl" --results "$tmp/r2.jsonl" \
      "${plan[@]}" --latency-bound 1000 --stats-out "$tmp/s2.json"
    check_equal "$stories" "$tmp/req.jsonl" "$tmp/r2.jsonl"
    [ "$(md5sum <"$tmp/profile.json")" = "$sum" ] || fail "the saved profile was measured again"
    set +e
    cluster "$np" --model "$stories" --threads 1 --requests "$tmp/req.jsonl" --results "$tmp/r3.jsonl" \
      "${plan[@]}" --latency-bound 0.0001 >"$tmp/out" 2>&1
    rc=$?
    set -e
    [ "$rc" -ne 0 ] || fail "a bound of 0.1 ms was accepted"
    grep -q "cannot be met .* the fastest achievable p99 latency is" "$tmp/out" ||
      { cat "$tmp/out"; fail "no clear refusal of the bound"; }
    [ ! -s "$tmp/r3.jsonl" ] || fail "requests ran under a refused bound: $(cat "$tmp/r3.jsonl")"
    echo "planned, re-deployed, equal to generate; profile reused; unmeetable bound refused"
    ;;
  schedule_s3)
    np=$1
    write_requests "$stories" "$tmp/req.jsonl"
    plan=(--workload S --length-scale 0.1 --layer-profile "$tmp/profile.json" --schedule-policy rra
      --latency-bound inf)
    cluster "$np" --model "$stories" --threads 1 --requests "$tmp/req.jsonl" --results "$tmp/r1.jsonl" \
      "${plan[@]}" --kv-reserve max-new --stats-out "$tmp/s1.json"
    check_equal "$stories" "$tmp/req.jsonl" "$tmp/r1.jsonl"
    jq -e '.schedule.kv_positions > 0 and .packing.budget == .schedule.kv_positions
        and .packing.reserve == "max-new" and .packing.counters.admitted > 0' "$tmp/s1.json" >/dev/null ||
      fail "stats: $(jq -c '{schedule, packing}' "$tmp/s1.json")"
    # Planned for pooled admission, the run packs pooled into the budget its plan sized.
    cluster "$np" --model "$stories" --threads 1 --requests "$tmp/req.jsonl" --results "$tmp/r4.jsonl" \
      "${plan[@]}" --kv-reserve max-new --kv-admission pooled --stats-out "$tmp/s4.json"
    check_equal "$stories" "$tmp/req.jsonl" "$tmp/r4.jsonl"
    jq -e '.schedule.kv_positions > 0 and .packing.budget == .schedule.kv_positions
        and .packing.admission == "pooled" and (.schedule.kv_packing | test("pooled at 0.9"))
        and .packing.counters.admitted > 0' "$tmp/s4.json" \
      >/dev/null || fail "pooled stats: $(jq -c '{schedule, packing}' "$tmp/s4.json")"
    # A profile whose decode cost grows with the square of the batch: the search picks a
    # one-sequence batch and a small packed plan. Its share must still hold the whole context
    # (--max-context 128) -- a smaller one cut requests a, c and f short with "context".
    jq '.ranks |= map((.decode.y | length) as $ny | .decode.x as $x
        | .decode.seconds |= [to_entries[] | .value * 20 * ($x[(.key / $ny | floor)] | . * .)]
        | .prefill.seconds |= map(. * 20))' "$tmp/profile.json" >"$tmp/slow.json"
    cluster "$np" --model "$stories" --threads 1 --requests "$tmp/req.jsonl" --results "$tmp/r3.jsonl" \
      "${plan[@]/$tmp\/profile.json/$tmp/slow.json}" --kv-reserve max-new --stats-out "$tmp/s3.json"
    check_equal "$stories" "$tmp/req.jsonl" "$tmp/r3.jsonl"
    jq -e '(.schedule.profile | endswith("slow.json")) and .packing.budget == .schedule.kv_positions
        and .packing.budget >= 128 * .micro_batches' "$tmp/s3.json" >/dev/null ||
      fail "slow profile: $(jq -c '{schedule, packing}' "$tmp/s3.json")"
    # What the search sizes is not also given; a predicted rule needs what the search plans by.
    for bad in "--kv-budget 100|--kv-budget 100 with --latency-bound" \
      "--kv-reserve predicted|--kv-reserve predicted needs --predict-eval"; do
      set +e
      # shellcheck disable=SC2086
      cluster "$np" --model "$stories" --threads 1 --requests "$tmp/req.jsonl" \
        --results "$tmp/r2.jsonl" "${plan[@]}" ${bad%%|*} >"$tmp/out" 2>&1
      rc=$?
      set -e
      [ "$rc" -ne 0 ] || fail "${bad%%|*} under a latency bound was accepted"
      grep -q -- "${bad#*|}" "$tmp/out" || { cat "$tmp/out"; fail "no clear refusal of ${bad%%|*}"; }
      [ ! -s "$tmp/r2.jsonl" ] || fail "requests ran under a refused option: $(cat "$tmp/r2.jsonl")"
    done
    echo "packed under the bound: budget $(jq .packing.budget "$tmp/s1.json") positions as planned," \
      "equal to generate; a given budget and an unplannable rule refused"
    ;;
  schedule_waa)
    np=$1
    policy=$2
    write_requests "$stories" "$tmp/req.jsonl"
    cluster "$np" --model "$stories" --threads 1 --requests "$tmp/req.jsonl" --results "$tmp/r.jsonl" \
      --workload S --length-scale 0.1 --latency-bound inf --layer-profile "$tmp/profile.json" \
      --schedule-policy "$policy" --stats-out "$tmp/s.json"
    check_equal "$stories" "$tmp/req.jsonl" "$tmp/r.jsonl"
    want=$(tr a-z A-Z <<<"$policy")
    jq -e --arg p "$want" --argjson n "$((np - 1))" '.schedule.policy == $p
        and (.schedule.allocation | length) == $n and .waa.handovers > 0 and .waa.sequences > 0
        and .waa.kv_bytes > 0' "$tmp/s.json" >/dev/null || fail "stats: $(cat "$tmp/s.json")"
    echo "$want: $(jq -r .schedule.allocation_text "$tmp/s.json"), $(jq .waa.handovers "$tmp/s.json") hand-overs"
    ;;
  slow)
    np=$1
    cat >"$tmp/req.jsonl" <<'JSON'
{"id": "a", "prompt": "Once upon a time", "max_new_tokens": 3}
{"id": "b", "prompt": "The cat", "max_new_tokens": 2}
JSON
    start=$(date +%s)
    cluster "$np" --model "$stories" --threads 1 --requests "$tmp/req.jsonl" --results "$tmp/r.jsonl" \
      --debug-step-delay 1.2 --heartbeat-interval 0.2 --heartbeat-timeout 0.6 --step-timeout 20 \
      --stats-out "$tmp/stats.json"
    check_equal "$stories" "$tmp/req.jsonl" "$tmp/r.jsonl"
    jq -e '[.stages[] | .busy_seconds >= 1.2 * .steps] | all' "$tmp/stats.json" >/dev/null ||
      fail "steps were not slowed: $(cat "$tmp/stats.json")"
    echo "steps of 1.2 s under a 0.6 s heartbeat timeout: done in $(($(date +%s) - start)) s"
    ;;
  refuse)
    write_requests "$stories" "$tmp/req.jsonl"
    set +e
    cluster 7 --model "$stories" --requests "$tmp/req.jsonl" --results "$tmp/r.jsonl" >"$tmp/out" 2>&1
    rc=$?
    set -e
    [ "$rc" -ne 0 ] || fail "7 ranks for 5 layers accepted"
    grep -q "6 worker ranks but .* has only 5 layers" "$tmp/out" || { cat "$tmp/out"; fail "no clear refusal"; }
    set +e
    cluster 3 --model dummy:opt-125m --stage-mem 100MiB --requests "$tmp/req.jsonl" --results "$tmp/r.jsonl" \
      >"$tmp/out" 2>&1
    rc=$?
    set -e
    [ "$rc" -ne 0 ] || fail "over-budget plan accepted"
    # Its embedding alone is 150 MiB: no placement streams that; the refusal names the node.
    grep -q "does not fit: stage 1 (layers \[0, 6), rank 1 on .*): cpu needs" "$tmp/out" ||
      { cat "$tmp/out"; fail "no clear budget refusal"; }
    # A worker that cannot start (no such GPU here, with or without a GPU on this machine)
    # ends the job at once with its reason, rather than leaving rank 0 waiting for it.
    start=$(date +%s)
    set +e
    cluster 3 --model "$stories" --device cuda:99 --requests "$tmp/req.jsonl" --results "$tmp/r.jsonl" \
      >"$tmp/out" 2>&1
    rc=$?
    set -e
    [ "$rc" -ne 0 ] || fail "--device cuda:99 accepted"
    grep -q "device cuda:99: no" "$tmp/out" || { cat "$tmp/out"; fail "no clear device refusal"; }
    [ $(($(date +%s) - start)) -le 20 ] || fail "device refusal took too long"
    # refused WHAT PATTERN ARGS...: a cluster given ARGS fails with a message matching PATTERN.
    refused() {
      local what=$1 pattern=$2
      shift 2
      set +e
      cluster 3 --model "$stories" "$@" --requests "$tmp/req.jsonl" --results "$tmp/r.jsonl" \
        >"$tmp/out" 2>&1
      local rc=$?
      set -e
      [ "$rc" -ne 0 ] || fail "$what in a cluster accepted"
      grep -q -- "$pattern" "$tmp/out" || { cat "$tmp/out"; fail "no clear $what refusal"; }
    }
    # HeteGen's and Pie's flag forms are the single-process engine's (the policy's forms are
    # planned): refused at every rank alike, before anything loads.
    refused --hetegen-alpha "--hetegen-alpha is for single-process engine commands" \
      --hetegen-alpha 0.5
    refused --pie-host-layers "--pie-host-layers and --pie-adaptive are for single-process" \
      --pie-host-layers 2
    # Before the job starts: an unknown option, and serve's own checks. mpirun exits 0
    # whatever the ranks return (orte_abort_on_non_zero_status 0); the script must not.
    refused "an unknown option" "--no-such-option" --no-such-option
    refused "--kv-reserve without a budget" "--kv-reserve max-new needs a --kv-budget" \
      --kv-reserve max-new
    set +e
    cluster 3 --model "$stories" --requests "$tmp/req.jsonl" >"$tmp/out" 2>&1
    rc=$?
    set -e
    [ "$rc" = 2 ] || { cat "$tmp/out"; fail "--requests without --results: exit $rc, not 2"; }
    echo "refusals clear"
    ;;
  hostile)
    python3 - "$tmp/req.jsonl" <<'PY'
import sys
with open(sys.argv[1], "wb") as f:
    f.write(b"[" * 100000 + b"]" * 100000 + b"\n")
    f.write(b'{"id": "a", "prompt": "Once upon a time", "max_new_tokens": 8}\n')
    f.write(b'{"id": "utf", "prompt": "caf\xc3\x28"}\n')
    f.write(b'{"id": "big", "prompt": "' + b"x" * (2 << 20) + b'"}\n')
    f.write(b'{"id": "a", "prompt": "The cat", "max_new_tokens": 4}\n')
PY
    start=$(date +%s)
    cluster 3 --model "$stories" --threads 1 --requests "$tmp/req.jsonl" --results "$tmp/r.jsonl" \
      >"$tmp/out" 2>&1 || { cat "$tmp/out"; fail "exit $? on hostile lines"; }
    [ "$(wc -l <"$tmp/r.jsonl")" -eq 5 ] || { cat "$tmp/r.jsonl"; fail "not one result per line"; }
    for want in "1:.*nested deeper than" "3:.*not valid JSON" "4: request: bytes = 2097179 is above the limit"; do
      jq -r 'select(.status == "error") | .error' "$tmp/r.jsonl" | grep -q "req.jsonl:$want" ||
        { cat "$tmp/r.jsonl"; fail "no error result matching '$want'"; }
    done
    [ "$(jq -s '[.[] | select(.status == "ok")] | length' "$tmp/r.jsonl")" -eq 2 ] || fail "the valid lines did not run"
    grep -q "request id a was seen before" "$tmp/out" || { cat "$tmp/out"; fail "the repeated id was not reported"; }
    echo "hostile lines answered in $(($(date +%s) - start)) s"
    ;;
  sigterm)
    for i in $(seq 40); do echo "{\"id\": \"$i\", \"prompt\": \"Once upon a time $i\", \"max_new_tokens\": 100}"; done >"$tmp/req.jsonl"
    cluster 3 --model "$stories" --threads 1 --requests "$tmp/req.jsonl" --results "$tmp/r.jsonl" \
      --debug-step-delay 0.05 --max-batch 8 --grace-period 1 >"$tmp/out" 2>&1 &
    job=$!
    for _ in $(seq 300); do [ -s "$tmp/r.jsonl" ] && break; sleep 0.1; done
    start=$(date +%s)
    pkill -TERM -f "local-cluster.sh 3 --max-context 128 --model $stories --threads 1 --requests $tmp/req.jsonl"
    rc=0
    wait "$job" || rc=$?
    [ "$rc" -ne 0 ] || fail "stopped with requests cut, but exit 0"
    [ $(($(date +%s) - start)) -le 15 ] || fail "took $(($(date +%s) - start)) s to stop with a 1 s grace period"
    [ "$(wc -l <"$tmp/r.jsonl")" -eq 40 ] || { cat "$tmp/out"; fail "$(wc -l <"$tmp/r.jsonl") results for 40 lines"; }
    [ "$(jq -r .id "$tmp/r.jsonl" | sort -u | wc -l)" -eq 40 ] || fail "a line answered twice"
    jq -r 'select(.status == "error") | .error' "$tmp/r.jsonl" | grep -q "interrupted\|not started" ||
      fail "no interrupted or not-started results"
    echo "SIGTERM: exit $rc, 40 lines answered ($(jq -s '[.[] | select(.status == "ok")] | length' "$tmp/r.jsonl") finished)"
    ;;
  launcher_signals)
    # The script's own loop under a storm of SIGTERM and SIGHUP, with a stand-in rank (a
    # unit test of the script: the rank is not the point) that takes no signal, since it
    # never says it is ready for one, and ends with status 0 after 3 s.
    cat >"$tmp/rank.sh" <<'RANK'
#!/usr/bin/env bash
echo >"$STRATA_RANK_STATUS_DIR/started.$$"
echo >"$RANK_MARK"
sleep 3
RANK
    chmod +x "$tmp/rank.sh"
    RANK_MARK=$tmp/rank-running STRATA=$tmp/rank.sh setsid bash "$root/launch/local-cluster.sh" 1 \
      >"$tmp/out" 2>&1 &
    job=$!
    for _ in $(seq 300); do [ -e "$tmp/rank-running" ] && break; sleep 0.1; done
    [ -e "$tmp/rank-running" ] || { cat "$tmp/out"; fail "the stand-in rank never ran"; }
    # The script leads its own process group (setsid did not fork), or the storm hits nothing.
    kill -0 -- "-$job" 2>/dev/null || fail "the launch script is not its process group's leader"
    sent=0
    while kill -0 "$job" 2>/dev/null && [ "$sent" -lt 3000 ]; do
      kill -TERM -- "-$job" 2>/dev/null || true
      kill -HUP -- "-$job" 2>/dev/null || true
      sent=$((sent + 1))
      sleep 0.002
    done
    rc=0
    wait "$job" || rc=$?
    [ "$rc" -eq 0 ] || { cat "$tmp/out"; fail "the script exited $rc under $sent signal pairs; the rank ended 0"; }
    ! pgrep -f "$tmp/rank.sh" >/dev/null || fail "the stand-in rank outlived the script"
    echo "the script waited out its rank under $sent signal pairs and exited 0"
    # A single process (mpirun -np 1) says its start is over, as every rank of a cluster
    # does: else the script takes its end, when mpirun is slow to follow, for a death while
    # starting.
    echo '{"id": "a", "prompt": "Once upon a time", "max_new_tokens": 4}' >"$tmp/req.jsonl"
    mkdir "$tmp/status"
    STRATA_RANK_STATUS_DIR=$tmp/status "$strata" serve --model "$stories" --threads 1 \
      --requests "$tmp/req.jsonl" --results "$tmp/r.jsonl" >"$tmp/out" 2>&1 ||
      { cat "$tmp/out"; fail "serve failed"; }
    compgen -G "$tmp/status/started.*" >/dev/null || { ls "$tmp/status"; fail "serve of one process left no started file"; }
    echo "a one-process serve said it started"
    ;;
  dead_coordinator)
    # Long enough (200 steps of >= 0.1 s) that rank 0 dies mid-run however loaded the machine.
    for i in $(seq 40); do echo "{\"id\": \"$i\", \"prompt\": \"Once upon a time $i\", \"max_new_tokens\": 100}"; done >"$tmp/req.jsonl"
    STRATA_LOG_LEVEL=info cluster 3 --model "$stories" --threads 1 --requests "$tmp/req.jsonl" \
      --results "$tmp/r.jsonl" --debug-step-delay 0.1 --heartbeat-interval 0.2 --heartbeat-timeout 3 \
      >"$tmp/out" 2>&1 &
    job=$!
    rank0=""
    for _ in $(seq 600); do  # the coordinator, once every stage is loaded and serving
      for p in $(pgrep -f "strata serve.*$tmp/req.jsonl" || true); do  # this test's ranks only
        tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx OMPI_COMM_WORLD_RANK=0 && rank0=$p
      done
      [ -n "$rank0" ] && grep -q "all 2 stages loaded" "$tmp/out" && break
      sleep 0.1
    done
    grep -q "all 2 stages loaded" "$tmp/out" || { cat "$tmp/out"; fail "the stages never loaded"; }
    [ -n "$rank0" ] || fail "no rank 0 found"
    sleep 1
    kill -9 "$rank0"
    start=$(date +%s)
    while pgrep -f "strata serve.*$tmp/req.jsonl" >/dev/null; do
      [ $(($(date +%s) - start)) -le 15 ] || { cat "$tmp/out"; fail "workers still running 15 s after rank 0 died"; }
      sleep 0.2
    done
    wait "$job" || true
    [ ! -s "$tmp/r.jsonl" ] || [ "$(wc -l <"$tmp/r.jsonl")" -lt 40 ] || fail "the run ended before rank 0 was killed"
    grep -q "rank 0 (the coordinator) is gone: its liveness link closed" "$tmp/out" || { cat "$tmp/out"; fail "no worker named rank 0"; }
    echo "workers ended $(($(date +%s) - start)) s after rank 0 died"
    ;;
  *)
    fail "unknown case '$case_name'"
    ;;
esac
