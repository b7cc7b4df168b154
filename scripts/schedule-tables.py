#!/usr/bin/env python3
"""Simulated schedules of docs/SCHEDULING.md: ExeGPT's scheduler against the FT-style
baseline for tasks S, T, C1 on modelled clusters (the paper's A40 cluster: OPT-13B on 4
workers, GPT-3 39B on 16), at the paper's four bounds (the baseline's bottom 10/30/70%
latencies and inf). Runs `strata plan --workload T --paper-bounds --format json` and prints
a markdown table; the JSON of every run goes to OUT (default docs/bench/schedule-sim.json).

  scripts/schedule-tables.py [--strata build/launch/strata] [--out docs/bench/schedule-sim.json]
"""
import argparse
import json
import subprocess

CLUSTERS = [("dummy:opt-13b", 4), ("dummy:gpt3-39b", 16)]
TASKS = ["S", "T", "C1"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--strata", default="build/launch/strata")
    p.add_argument("--out", default="docs/bench/schedule-sim.json")
    p.add_argument("--node", default="a40")
    a = p.parse_args()
    everything = []
    print("| model, workers | task | bound (s) | chosen schedule | layers | p99 latency (s) | "
          "tok/s | FT baseline | FT p99 (s) | FT tok/s | speed-up | points (B&B / grid) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    speedups = []
    for model, workers in CLUSTERS:
        for task in TASKS:
            cmd = [a.strata, "plan", "--model", model, "--workload", task, "--nodes", str(workers),
                   "--hardware", a.node, "--paper-bounds", "--format", "json"]
            res = subprocess.run(cmd, capture_output=True, text=True, env={"STRATA_LOG_LEVEL": "off"})
            runs = json.loads(res.stdout)
            everything.append({"model": model, "workers": workers, "task": task, "runs": runs})
            for r in runs:
                b = r["latency_bound_s"]
                bound = "inf" if b == "inf" else f"{b:.2f}"
                base = r["baseline"]
                if not r["feasible"]:
                    print(f"| {model[6:]}, {workers} | {task} | {bound} | none meets it "
                          f"(fastest {r['fastest_latency_s']:.2f} s) | | | | | | | | |")
                    continue
                cv = r["control_variables"]
                vars_ = ", ".join(f"{k}={v}" for k, v in cv.items() if k not in ("policy", "tp_degree"))
                line = (f"| {model[6:]}, {workers} | {task} | {bound} | {r['policy']} {vars_} | "
                        f"{r['schedule']['allocation_text']} | {r['predicted_p99_latency_s']:.2f} | "
                        f"{r['predicted_throughput_tok_s']:.0f} | ")
                if base["feasible"]:
                    bv = base["control_variables"]
                    sp = r["predicted_throughput_tok_s"] / base["predicted_throughput_tok_s"]
                    speedups.append(sp)
                    line += (f"batch {bv['encode_batch']}, {bv['micro_batches']} micro | "
                             f"{base['predicted_p99_latency_s']:.2f} | "
                             f"{base['predicted_throughput_tok_s']:.0f} | **{sp:.2f}x** | ")
                else:
                    line += "none meets it | | | | "
                line += f"{r['points_evaluated']} / {r['grid_points']} |"
                print(line)
    if speedups:
        mean = sum(speedups) / len(speedups)
        print(f"\nspeed-up over the baseline: mean {mean:.2f}x, max {max(speedups):.2f}x, "
              f"min {min(speedups):.2f}x over {len(speedups)} cases")
    with open(a.out, "w") as f:
        json.dump(everything, f, indent=1)


if __name__ == "__main__":
    main()
