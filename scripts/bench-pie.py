#!/usr/bin/env python3
"""Pie's mechanics on an engine (docs/PIE_HETEGEN.md, "Pie on an engine"): `strata bench` at a
batch whose KV cache does not fit --gpu-mem beside the weights, run five ways under the same
budget:

  all-gpu        c=100/0/0 at the asked batch: refused (the check the others pass)
  pie-fixed      c=100/0/0 with --pie-host-layers M: the device keeps n - M layer buffers
  pie-adaptive   --pie-adaptive between --pie-min-host-layers M and n - 1 (the device keeps
                 n - M buffers, as fixed M does)
  flexgen-static c=50/50/0,cpu_attn=1: FlexGen's static split, half the layers' cache in
                 host memory, their attention delegated to the CPU
  all-gpu-small  c=100/0/0 at the largest batch that fits without Pie

and prints one JSON line per run and a table: tokens/s, KV bytes moved per step, and the
stall fraction (seconds compute waited for a swap-in over the steps' seconds).

With --device host (the default here) a CPU backend stands in for the device: its
"transfers" are plain copies on the calling thread, so they never overlap compute, a swap's
cost lands in the step time and the stall is zero by construction. The runs show the
mechanics -- what fits, what moves, how often -- not speed.

  scripts/bench-pie.py --out docs/bench/pie-mechanics.json
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench(a, name, policy, batch, extra=()):
    cmd = [a.strata, "bench", "--model", a.model, "--dtype", a.dtype, "--device", a.device, "--threads",
           str(a.threads), "--gpu-mem", a.gpu_mem, "--policy", policy, "--batch", str(batch),
           "--prompt-len", str(a.prompt_len), "--gen-len", str(a.gen_len), "--max-step-tokens",
           str(a.max_step_tokens), "--no-limits", "--warmup", "0", *extra]
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True)
    row = {"run": name, "policy": policy, "batch": batch, "options": " ".join(extra)}
    if p.returncode != 0:
        row["refused"] = p.stderr.strip().splitlines()[-1]
        return row
    d = json.loads(p.stdout)
    r = d["result"]
    steps = r["prefill_steps"] + r["decode_steps"]
    step_s = r["prefill_seconds"] + r["decode_seconds"]
    row["tokens_per_s"] = r["generation_tokens_per_s"]
    row["decode_tokens_per_s"] = r["decode_tokens_per_s"]
    n = int(d["shape"].split("layers=")[1].split(",")[0]) if "layers=" in d["shape"] else None
    if "pie" in d:
        pie = d["pie"]
        row["kv_bytes_per_step"] = pie["swapped_bytes_per_step"]
        row["stall_fraction"] = pie["stall_fraction"]
        row["stall_seconds"] = pie["stall_seconds"]
        row["swap_ins"] = pie["swap_ins"]
        row["early_swap_ins"] = pie["early_swap_ins"]
        row["host_layers_end"] = pie["host_layers"]
        row["adjustments"] = pie["adjustments"]
        row["device_kv_bytes"] = pie["device_bytes"]
        row["host_kv_bytes"] = pie["host_bytes"]
    else:
        # A static split moves no layer between steps; with cpu_attn=1 only each step's
        # q, k, v and the attention output cross (FlexGen's delegation), not counted here.
        layers = n or 1
        gpu = round(layers * int(policy.split("c=")[1].split("/")[0]) / 100)
        row["kv_bytes_per_step"] = 0
        row["stall_fraction"] = None
        row["device_kv_bytes"] = r["kv_cache_bytes"] * gpu // layers
        row["host_kv_bytes"] = r["kv_cache_bytes"] - row["device_kv_bytes"]
    row["steps"] = steps
    row["step_seconds"] = step_s
    row["generated_tokens"] = r["generated_tokens"]
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--strata", default=os.path.join(ROOT, "build/launch/strata"))
    p.add_argument("--model", default="dummy:llama-12m")
    p.add_argument("--device", default="host")
    p.add_argument("--dtype", default="f32", help="the weights' dtype (f16 on a GPU)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--gpu-mem", default="74MiB", help="the device budget every run shares")
    p.add_argument("--batch", type=int, default=16, help="the batch Pie and the static split run")
    p.add_argument("--small-batch", type=int, default=8, help="the all-GPU batch that fits")
    p.add_argument("--host-layers", type=int, default=2, help="Pie's m (adaptive: its minimum)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--max-step-tokens", type=int, default=256)
    p.add_argument("--out", help="append the runs' JSON lines here")
    a = p.parse_args()

    whole = "w=100/0/0,c=100/0/0"
    m = str(a.host_layers)
    rows = [
        bench(a, "all-gpu", whole, a.batch),
        bench(a, "pie-fixed", whole, a.batch, ("--pie-host-layers", m)),
        bench(a, "pie-adaptive", whole, a.batch, ("--pie-adaptive", "--pie-min-host-layers", m)),
        bench(a, "flexgen-static", "w=100/0/0,c=50/50/0,cpu_attn=1", a.batch),
        bench(a, "all-gpu-small", whole, a.small_batch),
    ]
    for r in rows:
        print(json.dumps(r))
    if a.out:
        with open(a.out, "a") as f:
            for r in rows:
                f.write(json.dumps(dict(r, model=a.model, gpu_mem=a.gpu_mem, device=a.device,
                                        prompt_len=a.prompt_len, gen_len=a.gen_len)) + "\n")
    print(f"\n{a.model}, --device {a.device}, --gpu-mem {a.gpu_mem}, prompt {a.prompt_len} + "
          f"{a.gen_len} generated\n")
    print("| run | batch | tokens/s | KV MiB moved / step | stall fraction | device KV MiB | "
          "host KV MiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "refused" in r:
            print(f"| {r['run']} | {r['batch']} | refused: does not fit | | | | |")
            continue
        stall = "n/a" if r["stall_fraction"] is None else f"{r['stall_fraction']:.4f}"
        print(f"| {r['run']} | {r['batch']} | {r['tokens_per_s']:.1f} | "
              f"{r['kv_bytes_per_step'] / 2**20:.1f} | {stall} | "
              f"{r['device_kv_bytes'] / 2**20:.1f} | {r['host_kv_bytes'] / 2**20:.1f} |")


if __name__ == "__main__":
    main()
