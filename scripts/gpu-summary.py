#!/usr/bin/env python3
"""One line per kernel benchmark of scripts/gpu-run.sh's kernels.jsonl (the device reply
carries only the end of the output)."""
import json
import sys

for line in open(sys.argv[1]):
    d = json.loads(line)
    if d.get("bench") == "cuda_decode_linear":
        print("%-7s %-4s %6d x %-6d %-5s %8.2f us %7.0f GB/s" % (
            d["variant"], d["dtype"], d["n"], d["k"], "acc" if d["accumulate"] else "store",
            d["us_per_call"], d["gb_per_s"]))
    else:
        print(d["variant"], {k: v for k, v in d.items() if k != "variant"})
