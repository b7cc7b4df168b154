#!/usr/bin/env python3
"""Requests whose lengths follow one of ExeGPT's tasks (Table 3: mean, std, max of the input
and output lengths), scaled by --scale, as Strata JSONL request lines (prompt ids, and
max_new_tokens with ignore_eos so the output length is enforced, as the paper does).

  scripts/workload-requests.py --task S --scale 0.25 --requests 300 --vocab 512 > req.jsonl
"""
import argparse
import json
import random

TASKS = {  # input (mean, std, max), output (mean, std, max)
    "S": ((256, 252, 512), (32, 13, 80)),
    "T": ((128, 81, 256), (128, 68, 320)),
    "G": ((64, 23, 128), (192, 93, 480)),
    "C1": ((256, 115, 512), (64, 30, 160)),
    "C2": ((512, 252, 1024), (256, 134, 640)),
}


def draw(rng, mean, std, top, scale):
    # A normal truncated to [1, max] (by rejection), then scaled.
    while True:
        v = round(rng.gauss(mean, std))
        if 1 <= v <= top:
            return max(1, round(v * scale))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--task", choices=sorted(TASKS), required=True)
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    rng = random.Random(a.seed)
    (im, isd, imax), (om, osd, omax) = TASKS[a.task]
    for i in range(a.requests):
        n_in = draw(rng, im, isd, imax, a.scale)
        n_out = draw(rng, om, osd, omax, a.scale)
        ids = [1] + [rng.randrange(3, a.vocab) for _ in range(n_in - 1)]
        print(json.dumps({"id": f"{a.task}-{i}", "prompt_ids": ids, "max_new_tokens": n_out,
                          "ignore_eos": True}))


if __name__ == "__main__":
    main()
