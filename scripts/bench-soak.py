#!/usr/bin/python3
"""Soak benchmark: a long stream of short requests through Redis into one standing cluster,
rank 0's resident memory sampled every second (docs/BENCHMARKS.md, "Soak").

    scripts/bench-soak.py [--requests 1000000] [--ranks 2] [--out docs/bench/soak.json]

A producer keeps a backlog of about --backlog entries in the request stream (as producers
feeding a service for weeks do), a collector reads the results as they come, checks one
per id, and trims both streams behind itself (docs/QUEUE.md, "Never trimmed"), so Redis
holds a window, not the history. The cluster (launch/local-cluster.sh, stories260K, short
outputs) runs `serve --redis` without --exit-when-drained, as a service does, and is
stopped with SIGTERM once every result is in.

Reported (JSON): rank 0's RSS every second against the results stored; its growth per
100,000 requests after the warm-up (a least-squares line over the samples past
--warmup of the requests); the requests lost (ids without a result) and answered twice;
p50 / p99 / max queue wait (the results' queue_wait_s); requests/s.
"""
import argparse
import faulthandler
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time

import redis

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STRATA = os.environ.get("STRATA", os.path.join(ROOT, "build/launch/strata"))
MODEL = os.environ.get("STRATA_MODEL", os.path.join(ROOT, "../shared/models/stories260K"))
REQ, RES = "soak:requests", "soak:results"


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def descendants(pid):
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    kids = [int(p) for p in out]
    return kids + [d for k in kids for d in descendants(k)]


def rank_pid(root, rank, seconds=60):
    deadline = time.time() + seconds
    while time.time() < deadline:
        for p in descendants(root):
            try:
                env = open(f"/proc/{p}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            if f"PMIX_RANK={rank}".encode() in env:
                return p
        time.sleep(0.05)
    raise SystemExit(f"no rank {rank} process")


def rss_kib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def slope(points):
    """Least-squares slope of y over x."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx > 0 else 0.0


class Producer(threading.Thread):
    """Keeps about `backlog` entries not yet delivered, until `total` are queued."""

    def __init__(self, port, total, backlog, max_new):
        super().__init__(daemon=True)
        self.r = redis.Redis(port=port)
        self.total, self.backlog, self.max_new = total, backlog, max_new
        self.queued = 0
        self.results_seen = lambda: 0

    def run(self):
        while self.queued < self.total:
            waiting = self.queued - self.results_seen()
            if waiting >= self.backlog:
                time.sleep(0.01)
                continue
            n = min(2000, self.total - self.queued, self.backlog - waiting)
            pipe = self.r.pipeline(transaction=False)
            for i in range(self.queued, self.queued + n):
                pipe.xadd(REQ, {"id": f"s{i}", "prompt": f"Once upon a time {i % 997}",
                                "max_new_tokens": str(self.max_new)})
            pipe.execute()
            self.queued += n


def trim_requests(r):
    """Below the oldest pending entry, or up to the last delivered one when none is pending,
    every entry is acknowledged."""
    try:
        pending = r.xpending(REQ, "strata")
    except redis.exceptions.ResponseError:  # NOGROUP: the cluster has not read yet
        return
    if pending["pending"]:
        oldest = pending["min"]
    else:
        groups = [g for g in r.xinfo_groups(REQ) if g["name"] in (b"strata", "strata")]
        oldest = groups[0]["last-delivered-id"] if groups else None
    if oldest:
        r.xtrim(REQ, minid=oldest.decode() if isinstance(oldest, bytes) else oldest)


def main():
    faulthandler.register(signal.SIGUSR1)
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--backlog", type=int, default=4000)
    ap.add_argument("--max-new-tokens", type=int, default=2)
    ap.add_argument("--warmup", type=float, default=0.1, help="fraction of the requests")
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="strata-soak-")
    port = free_port()
    server = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--dir", tmp,
                               "--save", "", "--appendonly", "no", "--logfile", os.path.join(tmp, "redis.log")])
    r = redis.Redis(port=port)
    for _ in range(200):
        try:
            r.ping()
            break
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
    log_path = os.path.join(tmp, "cluster.log")
    env = dict(os.environ, STRATA=STRATA, STRATA_LOG_LEVEL="warn")
    cluster = subprocess.Popen(
        ["bash", os.path.join(ROOT, "launch/local-cluster.sh"), str(args.ranks), "--model", MODEL,
         "--redis", f"redis://127.0.0.1:{port}", "--request-stream", REQ, "--result-stream", RES,
         "--threads", "1", "--max-batch", "32", "--consumer", "soak"],
        env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    try:
        run(args, r, port, cluster, log_path)
    finally:
        for p in descendants(cluster.pid) + [cluster.pid]:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        server.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def run(args, r, port, cluster, log_path):
    rank0 = rank_pid(cluster.pid, 0)

    seen = bytearray(args.requests)
    state = {"results": 0, "twice": 0}
    producer = Producer(port, args.requests, args.backlog, args.max_new_tokens)
    producer.results_seen = lambda: state["results"]
    producer.start()
    waits, samples = [], []
    last, t0, next_sample = "0-0", time.time(), 0.0
    while state["results"] < args.requests:
        if cluster.poll() is not None:
            raise SystemExit(f"the cluster ended early ({cluster.returncode}):\n" + open(log_path).read()[-3000:])
        got = r.xread({RES: last}, count=5000, block=200) or []
        for _, entries in got:
            for entry_id, fields in entries:
                last = entry_id
                i = int(fields[b"id"][1:])
                if seen[i]:
                    state["twice"] += 1
                seen[i] = 1
                state["results"] += 1
                waits.append(float(fields.get(b"queue_wait_s", b"0")))
        if got:
            r.xtrim(RES, minid=last.decode() if isinstance(last, bytes) else last)
        now = time.time() - t0
        if now >= next_sample:
            samples.append({"t_s": round(now, 1), "results": state["results"], "rss_kib": rss_kib(rank0)})
            next_sample += 1.0
            trim_requests(r)
    seconds = time.time() - t0
    samples.append({"t_s": round(seconds, 1), "results": state["results"], "rss_kib": rss_kib(rank0)})
    cluster.send_signal(signal.SIGTERM)
    rc = cluster.wait(120)
    warm = [(s["results"], s["rss_kib"]) for s in samples if s["results"] >= args.warmup * args.requests]
    growth = slope(warm) * 100_000 / 1024 if len(warm) > 2 else None
    lost = args.requests - sum(seen)
    out = {
        "machine": platform.node(), "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
        "requests": args.requests, "ranks": args.ranks, "max_new_tokens": args.max_new_tokens,
        "backlog": args.backlog, "seconds": round(seconds, 1),
        "requests_per_s": round(args.requests / seconds, 1),
        "lost": lost, "answered_twice": state["twice"], "exit_status": rc,
        "queue_wait_p50_s": pct(waits, 50), "queue_wait_p99_s": pct(waits, 99), "queue_wait_max_s": max(waits),
        "rss_warm_start_mib": round(warm[0][1] / 1024, 1) if warm else None,
        "rss_end_mib": round(samples[-1]["rss_kib"] / 1024, 1),
        "rss_peak_mib": round(max(s["rss_kib"] for s in samples) / 1024, 1),
        "rss_growth_mib_per_100k_requests": round(growth, 3) if growth is not None else None,
        "samples": samples,
    }
    text = json.dumps(out, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    summary = {k: v for k, v in out.items() if k != "samples"}
    print(json.dumps(summary, indent=1))
    if lost or state["twice"]:
        raise SystemExit(f"{lost} requests lost, {state['twice']} answered twice")


if __name__ == "__main__":
    main()
