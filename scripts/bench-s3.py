#!/usr/bin/env python3
"""S3's packing benchmark (docs/S3.md): a local cluster under one fixed KV budget serves real
requests -- GSM8K or AlpacaEval prompts with their answers' true lengths enforced
(ignore_eos, max_new_tokens = the answer's length, as ../shared/datasets/README.md says) --
three times, each sequence reserving:

  worst   the whole context (ORCA / FasterTransformer, S3's baseline)
  s3      its prompt + the length predictor's reservation; the predictor is trained on rows
          the benchmark does not serve, learns online as requests finish, and never sees
          max_new_tokens (--no-length-hint: it carries the answer here)
  pooled  the same predictor and reservations, admitted by --kv-admission pooled: the
          positions the micro-batch is expected to fill at every future step within the
          budget at the confidence (docs/S3.md, "Pooled admission")
  oracle-pooled  the true lengths, admitted the pooled way (exact: no spread)

With --repeat N the policies run round-robin N times and the summary takes each policy's
median throughput (this VM's speed drifts by tens of percent between minutes).
  oracle  its prompt + its true output length

and prints throughput, mean decode batch and the preemption rate of each, one JSON line per
run and a summary (ratios within this one run).

  scripts/bench-s3.py --dataset ../shared/datasets/gsm8k/train.jsonl --train 0:6000 \\
      --serve 6000:6300 --policies worst,s3@0.5,s3@0.9,oracle --out docs/bench/s3-gsm8k.json
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rows(spec):
    a, b = spec.split(":")
    return int(a), int(b) - int(a)


def run(cmd, **kw):
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=True, **kw)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--strata", default=os.path.join(ROOT, "build/launch/strata"))
    p.add_argument("--dataset", required=True)
    p.add_argument("--tokenizer",
                   default=os.path.join(ROOT, "../shared/anchors/llamacpp/tokenizer.model"))
    p.add_argument("--train", default="0:6000", help="rows the predictor is trained on (a:b)")
    p.add_argument("--serve", default="6000:6400", help="rows served (a:b), never trained on")
    p.add_argument("--model", default="dummy:llama-12m")
    p.add_argument("--np", type=int, default=3, help="ranks: the coordinator and NP-1 stages")
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--budget", type=int, default=4096, help="KV positions over all sequences")
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--confidence", type=float, default=0.9)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--policies", default="worst,s3,oracle",
                   help="worst, s3 or s3@CONFIDENCE, pooled or pooled@CONFIDENCE, oracle")
    p.add_argument("--repeat", type=int, default=1, help="rounds of all policies (median)")
    p.add_argument("--out", help="append the runs' JSON lines here")
    a = p.parse_args()

    work = tempfile.mkdtemp(prefix="strata-s3-")
    try:
        pred = os.path.join(work, "predictor.bin")
        skip, limit = rows(a.train)
        run([a.strata, "predict", "train", "--data", a.dataset, "--tokenizer", a.tokenizer,
             "--skip", str(skip), "--limit", str(limit), "--epochs", str(a.epochs), "--out", pred])
        req = os.path.join(work, "requests.jsonl")
        skip, limit = rows(a.serve)
        run([a.strata, "predict", "requests", "--data", a.dataset, "--tokenizer", a.tokenizer,
             "--skip", str(skip), "--limit", str(limit), "--out", req])
        n_requests = sum(1 for _ in open(req))
        results = []
        for _ in range(a.repeat):
            for policy in a.policies.split(","):
                results.append(serve(a, work, policy, req, pred, n_requests))
        summary = summarize(a, results)
        print(json.dumps(summary, indent=1))
        if a.out:
            with open(a.out, "a") as f:
                for r in results + [summary]:
                    f.write(json.dumps(r) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def serve(a, work, policy, req, pred, n_requests):
    # s3@C: the predictor's reservation at confidence C (default --confidence).
    name, _, conf = policy.partition("@")
    # worst and s3 are not told the lengths (max_new_tokens carries the answer here).
    predicted = ["--kv-reserve", "predicted", "--no-length-hint",
                 "--predict-confidence", conf or str(a.confidence)]
    reserve = {"worst": ["--kv-reserve", "context", "--no-length-hint"],
               "oracle": ["--kv-reserve", "max-new"],
               "oracle-pooled": ["--kv-reserve", "max-new", "--kv-admission", "pooled"],
               "s3": predicted,
               "pooled": predicted + ["--kv-admission", "pooled"]}[name]
    if name in ("s3", "pooled"):  # a fresh copy: the run learns online and writes it back
        shutil.copy(pred, os.path.join(work, "run-predictor.bin"))
        reserve += ["--predictor", os.path.join(work, "run-predictor.bin")]
    stats = os.path.join(work, f"{policy}.json")
    res = os.path.join(work, f"{policy}-results.jsonl")
    env = dict(os.environ, STRATA=a.strata, STRATA_LOG_LEVEL="warn")
    t0 = time.time()
    run(["bash", os.path.join(ROOT, "launch/local-cluster.sh"), str(a.np), "--model", a.model,
         "--threads", "1", "--requests", req, "--results", res, "--stats-out", stats,
         "--micro-batches", str(a.micro_batches), "--decode-iters", "1",
         "--max-context", str(a.max_context), "--max-batch", str(a.max_batch),
         "--kv-budget", str(a.budget)] + reserve, env=env, stdout=subprocess.DEVNULL)
    wall = time.time() - t0
    s = json.load(open(stats))
    lengths_ok = check_lengths(req, res)
    pk = s["packing"]
    c = pk["counters"]
    out = {"kind": "s3-run", "policy": policy, "dataset": os.path.basename(a.dataset),
           "serve_rows": a.serve, "model": a.model, "np": a.np, "budget": a.budget,
           "max_context": a.max_context, "requests": s["requests"], "finished": s["finished"],
           "generated_tokens": s["generated_tokens"], "seconds": s["seconds"],
           "tokens_per_s": s["tokens_per_s"], "wall_s": wall,
           "mean_decode_batch": c["mean_decode_batch"], "preemptions": c["preemptions"],
           "preempted_sequences": c["preempted_sequences"], "extensions": c["extensions"],
           "preempted_share": c["preempted_sequences"] / max(1, n_requests),
           "recomputed_tokens": c["recomputed_tokens"], "lengths_enforced": lengths_ok}
    if "prediction" in pk:
        out["prediction"] = pk["prediction"]
    print(json.dumps(out), file=sys.stderr)
    return out


def check_lengths(req, res):
    want = {}
    for line in open(req):
        q = json.loads(line)
        want[q["id"]] = q["max_new_tokens"]
    got = {}
    for line in open(res):
        r = json.loads(line)
        got[r["id"]] = len(r.get("output_ids", []))
    return got == want


def summarize(a, results):
    by = {}
    for r in results:
        by.setdefault(r["policy"], []).append(r)
    s = {"kind": "s3-summary", "dataset": os.path.basename(a.dataset), "serve_rows": a.serve,
         "budget": a.budget, "model": a.model, "rounds": a.repeat}
    tps = {k: statistics.median(r["tokens_per_s"] for r in rs) for k, rs in by.items()}
    for k, rs in by.items():
        s[f"{k}_tokens_per_s"] = tps[k]
        s[f"{k}_mean_decode_batch"] = statistics.median(r["mean_decode_batch"] for r in rs)
        s[f"{k}_preempted_share"] = max(r["preempted_share"] for r in rs)
    for base in ("oracle", "oracle-pooled"):
        if tps.get(base, 0) > 0:
            for k in by:
                s[f"{k}_vs_{base}"] = tps[k] / tps[base]
    if tps.get("worst", 0) > 0:
        for k in by:
            if k.startswith("s3") or k.startswith("pooled"):
                s[f"{k}_vs_worst"] = tps[k] / tps["worst"]
    return s


if __name__ == "__main__":
    main()
