#!/usr/bin/python3
"""Load benchmark of the request queue: N short requests through a local cluster fed from
Redis, against the same requests from a JSONL file (docs/BENCHMARKS.md, "Request queue").

    scripts/bench-queue.py [--requests 5000] [--out docs/bench/queue.json]

Three runs on one machine, one after the other, the same cluster settings each time:
  burst   every request queued at once into a serving cluster (throughput; latency is
          then mostly waiting in the queue)
  paced   requests arriving at a fixed rate, PACE x the burst throughput (latency under load)
  jsonl   the same requests from a file (`serve --requests`): the intake without Redis
Per run: requests/s over the coordinator's serving time (first step to last result, the
same clock for every run), p50/p99 queue wait and end-to-end latency (the results' own
timings), and the coordinator's cost per request: its loop's time in intake and result
hand-over, plus the CPU time of the queue's two I/O threads.
Redis runs with appendonly yes, appendfsync always (the setting the crash tests rely on).
"""
import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import tempfile
import time

import redis

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STRATA = os.environ.get("STRATA", os.path.join(ROOT, "build/launch/strata"))
MODEL = os.environ.get("STRATA_MODEL", os.path.join(ROOT, "../shared/models/stories260K"))
CLUSTER = ["--model", MODEL, "--threads", "1", "--micro-batches", "2", "--max-batch", "32"]


def requests(n, max_new):
    return [{"id": f"q{i}", "prompt": f"Once upon a time {i}", "max_new_tokens": max_new} for i in range(n)]


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def latency(results):
    waits = [r["queue_wait_s"] for r in results]
    totals = [r["total_s"] for r in results]
    return {"queue_wait_p50_s": pct(waits, 50), "queue_wait_p99_s": pct(waits, 99),
            "end_to_end_p50_s": pct(totals, 50), "end_to_end_p99_s": pct(totals, 99),
            "end_to_end_mean_s": statistics.mean(totals)}


def summary_of(log_path):
    for line in open(log_path, errors="replace"):
        if line.startswith('{"summary"'):
            return json.loads(line)
    raise SystemExit(f"no summary in {log_path}:\n" + open(log_path).read()[-3000:])


def overhead(summary, n):
    s = summary["summary"]
    q = summary.get("queue", {})
    io = q.get("reader_cpu_seconds", 0) + q.get("writer_cpu_seconds", 0)
    return {"coordinator_loop_us_per_request": 1e6 * (s["intake_seconds"] + s["result_seconds"]) / n,
            "intake_us_per_request": 1e6 * s["intake_seconds"] / n,
            "result_us_per_request": 1e6 * s["result_seconds"] / n,
            "queue_io_cpu_us_per_request": 1e6 * io / n,
            "serving_seconds": s["seconds"], "generated_tokens": s["generated_tokens"]}


class Server:
    def __init__(self, tmp):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        self.proc = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(self.port),
                                      "--dir", tmp, "--save", "", "--appendonly", "yes",
                                      "--appendfsync", "always", "--logfile", os.path.join(tmp, "redis.log")])
        self.r = redis.Redis(port=self.port, decode_responses=True)
        for _ in range(100):
            try:
                self.r.ping()
                break
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)

    def stop(self):
        self.proc.kill()
        self.proc.wait()


def cluster(args, log_path):
    env = dict(os.environ, STRATA=STRATA, STRATA_LOG_LEVEL="warn")
    return subprocess.Popen(["bash", os.path.join(ROOT, "launch/local-cluster.sh"), "3", *CLUSTER, *args],
                            env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)


def redis_run(reqs, tmp, name, rate=None):
    tmp = os.path.join(tmp, name)
    os.makedirs(tmp)
    srv = Server(tmp)
    log_path = os.path.join(tmp, f"{name}.log")
    c = cluster(["--redis", f"redis://127.0.0.1:{srv.port}", "--consumer", name], log_path)
    # Ready when the group exists and the cluster has read nothing yet: a probe request.
    srv.r.xadd("strata:requests", {"id": "warmup", "prompt": "Hi", "max_new_tokens": 1})
    deadline = time.time() + 60
    while srv.r.xlen("strata:results") < 1 and time.time() < deadline:
        time.sleep(0.02)
    start = time.time()
    pipe = srv.r.pipeline(transaction=False)
    for i, q in enumerate(reqs):
        if rate is not None:
            due = start + i / rate
            if due > time.time():
                pipe.execute()
                time.sleep(max(0.0, due - time.time()))
        pipe.xadd("strata:requests", {k: str(v) for k, v in q.items()})
    pipe.execute()
    n = len(reqs) + 1
    while srv.r.xlen("strata:results") < n and time.time() < deadline + 3600:
        time.sleep(0.01)
    wall = time.time() - start
    c.send_signal(signal.SIGTERM)
    c.wait(60)
    results = []
    for _, f in srv.r.xrange("strata:results", "-", "+"):
        if f["id"] != "warmup":
            results.append({k: json.loads(f[k]) for k in ("queue_wait_s", "total_s")} | {"status": f["status"]})
    srv.stop()
    ok = sum(r["status"] == "ok" for r in results)
    s = summary_of(log_path)
    return {"requests": len(results), "ok": ok, "client_wall_seconds": wall,
            "requests_per_s": (len(results) + 1) / s["summary"]["seconds"], **latency(results),
            **overhead(s, len(reqs) + 1)}


def jsonl_run(reqs, tmp):
    path, out, log_path = (os.path.join(tmp, f) for f in ("req.jsonl", "res.jsonl", "jsonl.log"))
    with open(path, "w") as f:
        for q in reqs:
            f.write(json.dumps(q) + "\n")
    start = time.time()
    c = cluster(["--requests", path, "--results", out], log_path)
    c.wait(3600)
    wall = time.time() - start
    results = [json.loads(line) for line in open(out)]
    s = summary_of(log_path)
    serving = s["summary"]["seconds"]
    return {"requests": len(results), "ok": sum(r["status"] == "ok" for r in results),
            "wall_seconds_with_startup": wall, "requests_per_s": len(results) / serving,
            **latency(results), **overhead(s, len(reqs))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--pace", type=float, default=0.6)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    reqs = requests(a.requests, a.max_new_tokens)
    report = {"machine": f"{platform.node()}, {os.cpu_count()} cores", "model": os.path.basename(MODEL),
              "cluster": "3 ranks (coordinator + 2 stages), " + " ".join(CLUSTER[2:]),
              "requests": a.requests, "prompt": "Once upon a time {i}", "max_new_tokens": a.max_new_tokens,
              "redis": "appendonly yes, appendfsync always"}
    with tempfile.TemporaryDirectory() as tmp:
        report["burst"] = redis_run(reqs, tmp, "burst")
        rate = a.pace * report["burst"]["requests_per_s"]
        report["paced"] = redis_run([q | {"id": "p" + q["id"]} for q in reqs], tmp, "paced", rate) | {
            "arrival_rate_per_s": rate}
        report["jsonl"] = jsonl_run(reqs, tmp)
    report["redis_vs_jsonl_throughput"] = report["burst"]["requests_per_s"] / report["jsonl"]["requests_per_s"]
    text = json.dumps(report, indent=2)
    print(text)
    if a.out:
        open(a.out, "w").write(text + "\n")


if __name__ == "__main__":
    main()
