"""`strata serve --metrics-port` end to end: a 3-rank cluster under real mpirun
(launch/local-cluster.sh) over stories260K, /metrics scraped over HTTP while the run lasts
and once more after it (--metrics-linger), every counter and histogram checked against the
results file the same run wrote (docs/METRICS.md).

    test_metrics.py STRATA_BINARY MODEL_DIR
"""
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STRATA, MODEL = sys.argv[1], sys.argv[2]
N_OK, N_BAD = 24, 2

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def fail(msg):
    print(f"FAIL: {msg}", flush=True)
    sys.exit(1)


def parse(text):
    """Prometheus text format 0.0.4 -> {(name, frozenset(labels)): value}; TYPE per family."""
    samples, types = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
            continue
        if not line or line.startswith("#"):
            continue
        m = SAMPLE.match(line)
        if m is None:
            fail(f"not a sample line of the text format: {line!r}")
        labels = frozenset(LABEL.findall(m.group(3) or ""))
        samples[(m.group(1), labels)] = float(m.group(4))
    return samples, types


def value(samples, name, **labels):
    key = (name, frozenset(labels.items()))
    if key not in samples:
        fail(f"no sample {name}{labels}")
    return samples[key]


def series(samples, name):
    return {labels: v for (n, labels), v in samples.items() if n == name}


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        if "text/plain" not in r.headers.get("Content-Type", ""):
            fail(f"content type {r.headers.get('Content-Type')}")
        return parse(r.read().decode())


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_requests(path):
    with open(path, "w") as f:
        for i in range(N_OK):
            f.write(json.dumps({"id": f"r{i}", "prompt": "Once upon a time" + " a" * (i % 5),
                                "max_new_tokens": 8 + i % 13, "ignore_eos": i % 2 == 0}) + "\n")
        f.write('{"id": "bad-vocab", "prompt_ids": [99999]}\n')
        f.write('{"id": "bad-json", "prompt": \n')


def check_monotonic(before, after):
    for key, v in before[0].items():
        name = key[0]
        kind = before[1].get(name) or before[1].get(re.sub(r"_(bucket|sum|count)$", "", name))
        if kind in ("counter", "histogram") and after[0].get(key, -1) < v:
            fail(f"{name}{dict(key[1])} went down: {v} -> {after[0].get(key)}")


def check_histogram(samples, name, values):
    """_count, _sum and every cumulative bucket against the values the results carry."""
    if value(samples, name + "_count") != len(values):
        fail(f"{name}_count {value(samples, name + '_count')} != {len(values)} results")
    if not math.isclose(value(samples, name + "_sum"), sum(values), abs_tol=1e-5 * len(values)):
        fail(f"{name}_sum {value(samples, name + '_sum')} != {sum(values)} from the results")
    for labels, got in series(samples, name + "_bucket").items():
        le = float(dict(labels)["le"])
        # The results round to microseconds: a value that close to a bound may sit either side.
        sure = sum(1 for v in values if v <= le - 2e-6)
        maybe = sum(1 for v in values if v <= le + 2e-6)
        if not sure <= got <= maybe:
            fail(f"{name}_bucket le={le}: {got}, results say {sure}..{maybe}")


def main():
    tmp = tempfile.mkdtemp(prefix="strata-metrics-")
    requests, results = os.path.join(tmp, "requests.jsonl"), os.path.join(tmp, "results.jsonl")
    write_requests(requests)
    port = free_port()
    cmd = ["bash", os.path.join(ROOT, "launch/local-cluster.sh"), "3", "--model", MODEL,
           "--requests", requests, "--results", results, "--threads", "1",
           "--micro-batches", "2", "--max-batch", "8", "--decode-iters", "2",
           "--debug-step-delay", "0.01", "--heartbeat-interval", "0.2",
           # Half of each stage's weights on disk: the bytes moved per tier are not all zero.
           "--policy", "w=50/0/50,c=100/0/0", "--disk-dir", tmp,
           "--metrics-port", str(port), "--metrics-host", "127.0.0.1", "--metrics-linger", "60",
           "--stats-out", os.path.join(tmp, "stats.json")]
    log = open(os.path.join(tmp, "cluster.log"), "w")
    job = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                           env=dict(os.environ, STRATA=STRATA), start_new_session=True)
    try:
        scrapes, running_seen, live_stages = [], False, False
        deadline = time.time() + 180
        while time.time() < deadline:
            if job.poll() is not None:
                fail(f"the job ended (exit {job.returncode}) before its last scrape")
            try:
                s = scrape(port)
            except OSError:
                time.sleep(0.1)
                continue
            if scrapes:
                check_monotonic(scrapes[-1], s)
            scrapes.append(s)
            if value(s[0], "strata_run_finished") == 1:
                break
            running_seen |= value(s[0], "strata_num_requests_running") > 0
            busy = series(s[0], "strata_stage_busy_fraction")
            live_stages |= len(busy) == 2 and all(0 < v <= 1 for v in busy.values())
            time.sleep(0.1)
        else:
            fail("no final scrape within 180 s")
        print(f"{len(scrapes)} scrapes", flush=True)
        if not running_seen:
            fail("no scrape during the run saw a running request")
        if not live_stages:
            fail("no scrape during the run had both stages' busy fraction from their heartbeats")
        check_final(scrapes[-1][0], results)
        print(f"final scrape:\n" + "\n".join(
            f"  {n}{dict(l)} {v}" for (n, l), v in sorted(scrapes[-1][0].items(), key=str)
            if not n.endswith("_bucket")), flush=True)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGTERM)  # ends the linger
        try:
            rc = job.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            rc = job.wait()
        log.close()
    if rc != 0:
        print(open(os.path.join(tmp, "cluster.log")).read()[-3000:])
        fail(f"job exit {rc}")
    check_timeline(json.load(open(os.path.join(tmp, "stats.json"))))
    print("PASS")


def check_timeline(stats):
    """--stats-out's per-stage step spans: one per step, in order, not overlapping, summing
    to the stage's busy time, inside the run (plus the clocks' slack)."""
    for st in stats["stages"]:
        spans = st["step_spans_s"]
        if len(spans) != st["steps"] or st["step_spans_dropped"] != 0:
            fail(f"rank {st['rank']}: {len(spans)} spans for {st['steps']} steps")
        for (a, b), (c, _) in zip(spans, spans[1:] + [[math.inf, 0]]):
            if not (-0.05 <= a <= b <= c):
                fail(f"rank {st['rank']}: spans out of order or overlapping at [{a}, {b}], next {c}")
        if spans[-1][1] > stats["seconds"] + 0.5:
            fail(f"rank {st['rank']}: a span ends at {spans[-1][1]} s, after the run's {stats['seconds']} s")
        busy = sum(b - a for a, b in spans)
        if not math.isclose(busy, st["busy_seconds"], rel_tol=0.01, abs_tol=1e-3):
            fail(f"rank {st['rank']}: spans sum to {busy} s, busy {st['busy_seconds']} s")


def check_final(s, results_path):
    rows = [json.loads(line) for line in open(results_path)]
    ok = [r for r in rows if r["status"] == "ok"]
    if len(ok) != N_OK or len(rows) != N_OK + N_BAD:
        fail(f"{len(ok)} ok of {len(rows)} results, want {N_OK} of {N_OK + N_BAD}")
    by_reason = {}
    for r in ok:
        by_reason[r["stop_reason"]] = by_reason.get(r["stop_reason"], 0) + 1
    for reason in ("eos", "length", "stop"):
        got = value(s, "strata_request_success_total", finished_reason=reason)
        if got != by_reason.get(reason, 0):
            fail(f"success {reason}: {got}, results {by_reason.get(reason, 0)}")
    if value(s, "strata_request_failure_total", reason="refused") != N_BAD:
        fail("refused requests miscounted")
    if value(s, "strata_request_failure_total", reason="unfinished") != 0:
        fail("unfinished requests counted in a run that finished them all")
    outputs = sum(len(r["output_ids"]) for r in ok)
    if value(s, "strata_generation_tokens_total") != outputs:
        fail(f"generation tokens {value(s, 'strata_generation_tokens_total')} != {outputs}")
    prompts = sum(r["prompt_tokens"] for r in ok)
    if value(s, "strata_prompt_tokens_total") != prompts:
        fail(f"prompt tokens {value(s, 'strata_prompt_tokens_total')} != {prompts}")
    check_histogram(s, "strata_time_to_first_token_seconds", [r["first_token_s"] for r in ok])
    check_histogram(s, "strata_e2e_request_latency_seconds", [r["total_s"] for r in ok])
    check_histogram(s, "strata_request_queue_time_seconds", [r["queue_wait_s"] for r in ok])
    gaps = sum(max(0, len(r["output_ids"]) - 1) for r in ok)
    if value(s, "strata_inter_token_latency_seconds_count") != gaps:
        fail(f"inter-token latencies {value(s, 'strata_inter_token_latency_seconds_count')} "
             f"!= {gaps} (tokens after each first)")
    itl_sum = value(s, "strata_inter_token_latency_seconds_sum")
    decode_span = sum(r["total_s"] - r["first_token_s"] for r in ok)
    if not math.isclose(itl_sum, decode_span, rel_tol=0.02, abs_tol=1e-3):
        fail(f"inter-token latencies sum to {itl_sum}, the results' first-to-last spans {decode_span}")
    steps = series(s, "strata_stage_steps_total")
    if len(steps) != 2 or min(steps.values()) <= 0:
        fail(f"stage steps {steps}")
    moved = series(s, "strata_stage_bytes_moved_total")
    from_disk = [v for labels, v in moved.items() if dict(labels)["tier"] == "disk"]
    if len(from_disk) != 2 or min(from_disk) <= 0:
        fail(f"bytes from disk {moved}: each stage streams half its layers from disk")
    info = series(s, "strata_schedule_info")
    labels = dict(next(iter(info)))
    if labels.get("micro_batches") != "2" or labels.get("policy") != "RRA":
        fail(f"schedule labels {labels}")
    if value(s, "strata_num_requests_running") != 0 or value(s, "strata_num_requests_waiting") != 0:
        fail("requests left running or waiting after the run")


if __name__ == "__main__":
    main()
