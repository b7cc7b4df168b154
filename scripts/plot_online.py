#!/usr/bin/python3
"""The online-learning curve of S3's length predictor (docs/S3.md).

  scripts/plot_online.py OUT.png IN.json [IN.json ...] [--baseline ACC] [--title T]

Each IN.json is `strata predict online --json` output: `windows`, a list of {from, to,
accuracy, mean_reservation, ...}, each window's rows predicted before they were learned. Two
panels: the accuracy per window and the mean reservation per window (output tokens reserved
at the run's confidence), one line per file labelled with its stem; --baseline draws a
horizontal line on the first (e.g. the majority bucket's accuracy). A file that lacks a field is refused naming the file and the field,
exit 2. Needs matplotlib (Debian's python3-matplotlib, hence /usr/bin/python3).
"""
import argparse
import json
import os
import sys


def fail(message):
    print(f"plot_online.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def read_windows(path):
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        fail(f"{path}: {e}")
    windows = data.get("windows") if isinstance(data, dict) else None
    if not isinstance(windows, list) or not windows:
        fail(f"{path}: no 'windows' list (strata predict online --json)")
    xs, acc, res = [], [], []
    for i, w in enumerate(windows):
        for key in ("to", "accuracy", "mean_reservation"):
            if not isinstance(w, dict) or not isinstance(w.get(key), (int, float)):
                fail(f"{path}: windows[{i}].{key} missing or not a number")
        xs.append(w["to"])
        acc.append(100 * w["accuracy"])
        res.append(w["mean_reservation"])
    return xs, acc, res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--baseline", type=float, help="accuracy (0..1) to draw as a line")
    ap.add_argument("--baseline-label", default="majority bucket")
    ap.add_argument("--title", default="Online learning: accuracy of each window, predicted before learning")
    a = ap.parse_args(argv)
    curves = [(os.path.splitext(os.path.basename(p))[0], read_windows(p)) for p in a.inputs]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 6.5), dpi=100, sharex=True)
    for label, (xs, acc, res) in curves:
        ax.plot(xs, acc, marker="o", markersize=3, label=label)
        ax2.plot(xs, res, marker="o", markersize=3, label=label)
    if a.baseline is not None:
        ax.axhline(100 * a.baseline, color="grey", linestyle="--", label=a.baseline_label)
    ax.set_ylabel("bucket accuracy in the window (%)")
    ax.set_ylim(bottom=0)
    ax.set_title(a.title, fontsize=10)
    ax2.set_ylabel("mean reservation (tokens)")
    ax2.set_ylim(bottom=0)
    ax2.set_xlabel("requests completed (end of window)")
    for x in (ax, ax2):
        x.grid(alpha=0.3)
        x.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out)
    print(a.out)


if __name__ == "__main__":
    main()
