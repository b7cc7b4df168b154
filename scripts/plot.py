#!/usr/bin/python3
"""Figures from the JSON that Strata records (docs/PLOTS.md shows them, with the commands).

  scripts/plot.py pareto OUT.png IN.json...   throughput against latency, Pareto frontier
  scripts/plot.py stages OUT.png IN.json...   busy / idle seconds of every pipeline stage
  scripts/plot.py tiers  OUT.png IN.json...   bytes moved between memory tiers
  scripts/plot.py timeline OUT.png IN.json... [--from S] [--to S]
                                              every step of every stage, one lane per rank
  scripts/plot.py kinds  IN.json...           the kind of each file and the plots it feeds

The kind of each input is read from its keys:

  bench          `strata bench` (scripts/bench-engine.sh, bench-gpu.sh): `result` holds the
                 prefill and decode seconds and the throughput; `policy`, `feed` (bytes moved
                 CPU->GPU and disk->GPU, bytes held per tier) and `disk_stream` (bytes read
                 from disk into host memory) where the run recorded them.
                 pareto: latency = prefill + decode seconds of one batch (FlexGen's latency),
                 throughput = generated tokens/s.  tiers: `feed` and `disk_stream`.
  serve-stats    `strata serve --stats-out` (scripts/bench-cluster.sh, bench-schedule.sh):
                 `stages` (per rank busy / idle seconds, bubble fraction); under
                 --latency-bound also `schedule` (the chosen schedule, measured throughput and
                 p99 latency) and, for WAA, `waa` (the KV hand-over).
                 stages: always (busy / idle sums per stage).  timeline: only with
                 `stages[i].step_spans_s` (each step's [start, end], seconds since the run's
                 first step, written by a strata that records step spans;
                 `step_spans_dropped` counts those past its cap), titled with
                 `schedule_in_force`.  pareto: only with `schedule` (the bound itself is not
                 in the file, only in its name).
  schedule-sim   scripts/schedule-tables.py (docs/bench/schedule-sim.json): a list of
                 {model, workers, task, runs}, each run `strata plan --workload` output.
                 pareto: every search's best schedule and the FT-style baseline, predicted.
  schedule-plan  `strata plan --workload ... --format json`: the list of runs above.
  offload-plan   `strata plan --format json` without --workload: FlexGen's cost model for
                 one policy (`total_time_s`, `throughput_token_s`) or its search (`cost`).
                 pareto: latency = the cost model's time for one block.
  vs-llamacpp    scripts/bench-vs-llamacpp.sh: per row, Strata's and llama.cpp's runs.
                 pareto: both engines, latency = prefill + decode seconds of one batch.

A file that lacks what a plot needs is refused with its name and the missing field, exit 2.
The figures need matplotlib (Debian's python3-matplotlib, hence /usr/bin/python3); the
Pareto frontier (`pareto_frontier`) needs nothing and can be imported alone.
"""
import argparse
import collections
import json
import math
import os
import sys

DPI = 100
LABEL_ALL_UP_TO = 12  # a subplot with more points labels only its frontier

Point = collections.namedtuple("Point", "group xlabel series label latency throughput from_stem")


class InputError(Exception):
    """Bad input: the message names the file and the field."""


# ---- reading the JSON -------------------------------------------------------------------


def need(obj, dotted, src, prefix=""):
    """obj's field at the dotted path ("result.prefill_seconds"), or InputError naming it."""
    cur = obj
    walked = prefix
    for key in dotted.split("."):
        walked = f"{walked}.{key}" if walked else key
        if not isinstance(cur, dict) or key not in cur:
            raise InputError(f"{src}: missing field '{walked}'")
        cur = cur[key]
    return cur


def num(obj, dotted, src, prefix=""):
    """A finite number at the dotted path, or InputError naming the field."""
    v = need(obj, dotted, src, prefix)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        name = f"{prefix}.{dotted}" if prefix else dotted
        raise InputError(f"{src}: field '{name}' is {json.dumps(v)}, not a finite number")
    return float(v)


def need_list(obj, dotted, src, prefix=""):
    v = need(obj, dotted, src, prefix)
    if not isinstance(v, list) or not v:
        name = f"{prefix}.{dotted}" if prefix else dotted
        raise InputError(f"{src}: field '{name}' is not a non-empty list")
    return v


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror}")
    except ValueError as e:
        raise InputError(f"{path}: not JSON: {e}")


KINDS = {
    "bench": "strata bench",
    "serve-stats": "strata serve --stats-out",
    "schedule-sim": "scripts/schedule-tables.py",
    "schedule-plan": "strata plan --workload --format json",
    "offload-plan": "strata plan --format json",
    "vs-llamacpp": "scripts/bench-vs-llamacpp.sh",
    "queue": "scripts/bench-queue.py",
}


def kind_of(data):
    """The kind of a loaded file (a key of KINDS), or None."""
    if isinstance(data, list):
        if data and all(isinstance(x, dict) and "runs" in x for x in data):
            return "schedule-sim"
        if data and all(isinstance(x, dict) and "latency_bound_s" in x for x in data):
            return "schedule-plan"
        return None
    if not isinstance(data, dict):
        return None
    rows = data.get("rows")
    if isinstance(rows, list) and rows and isinstance(rows[0], dict) and "llamacpp" in rows[0]:
        return "vs-llamacpp"
    if "result" in data and "gen_len" in data:
        return "bench"
    if "stages" in data and "tokens_per_s" in data:
        return "serve-stats"
    if "throughput_token_s" in data or ("cost" in data and "policy" in data):
        return "offload-plan"
    if "burst" in data and "paced" in data:
        return "queue"
    return None


def stem(path):
    return os.path.splitext(os.path.basename(path))[0]


def model_name(spec):
    """'/x/models/stories260K' -> 'stories260K'; 'dummy:opt-125m' stays."""
    return os.path.basename(str(spec).rstrip("/")) or str(spec)


def shorten(stems):
    """Drops the dash-separated words every stem starts with: cluster-np3-mb1 -> mb1."""
    if len(stems) < 2:
        return list(stems)
    words = [s.split("-") for s in stems]
    common = 0
    while all(len(w) > common + 1 and w[common] == words[0][common] for w in words):
        common += 1
    return ["-".join(w[common:]) for w in words]


# ---- the Pareto frontier ------------------------------------------------------------------


def pareto_frontier(pairs):
    """Indices of the non-dominated (latency, throughput) pairs, by latency ascending.

    A pair is dominated when another has latency <= and throughput >= with one of them
    strict; of identical pairs the first is kept. Lower latency and higher throughput win.
    """
    order = sorted(range(len(pairs)), key=lambda i: (pairs[i][0], -pairs[i][1], i))
    frontier = []
    best = -math.inf
    for i in order:
        if pairs[i][1] > best:
            frontier.append(i)
            best = pairs[i][1]
    return frontier


def bench_points(d, src):
    r = need(d, "result", src)
    latency = num(r, "prefill_seconds", src, "result") + num(r, "decode_seconds", src, "result")
    throughput = num(r, "generation_tokens_per_s", src, "result")
    group = (f"{model_name(need(d, 'model', src))}, prompt {int(num(d, 'prompt_len', src))}, "
             f"gen {int(num(d, 'gen_len', src))}")
    label = stem(src) + (f"\n{d['policy']}" if d.get("policy") else "")
    return [Point(group, "latency: prefill + decode of one batch (s)",
                  f"batch {int(num(d, 'batch', src))}", label, latency, throughput, True)]


def serve_points(d, src):
    if "schedule" not in d:
        raise InputError(f"{src}: missing field 'schedule': a serve --stats-out run records a "
                         "latency only under --latency-bound (schedule.measured_p99_latency_s)")
    s = d["schedule"]
    latency = num(s, "measured_p99_latency_s", src, "schedule")
    throughput = num(s, "achieved_throughput_tok_s", src, "schedule")
    group = (f"{model_name(need(d, 'model', src))}, {int(num(d, 'ranks', src))} ranks: "
             f"{int(num(d, 'requests', src))} requests, {int(num(d, 'prompt_tokens', src))} "
             f"prompt + {int(num(d, 'generated_tokens', src))} generated tokens")
    return [Point(group, "p99 latency, measured over the steady window (s)",
                  str(need(s, "policy", src, "schedule")), stem(src), latency, throughput, True)]


def schedule_label(p):
    cv = p.get("control_variables", {})
    short = {"encode_batch": "B", "micro_batches": "K", "decode_iters": "N", "tp_degree": "TP"}
    parts = [f"{short[k]}{v}" for k, v in cv.items() if k in short and not (k == "tp_degree" and v == 1)]
    return " ".join([str(p.get("policy", cv.get("policy", "?")))] + parts)


def plan_run_points(runs, src, prefix, fallback_group):
    """Every feasible search's best and the baseline of each run of `strata plan --workload`."""
    out = []
    for i, r in enumerate(runs):
        where = f"{prefix}[{i}]"
        if not isinstance(r, dict):
            raise InputError(f"{src}: '{where}' is not an object")
        if not need(r, "feasible", src, where):
            continue
        w = r.get("workload", {})
        group = (f"{model_name(r['model'])} on {r['workers']} workers, task {w['name']}"
                 if "model" in r and "workers" in r and isinstance(w, dict) and "name" in w
                 else fallback_group)
        for j, p in enumerate(r.get("per_search") or [r]):
            if not p.get("feasible", True):
                continue
            pw = f"{where}.per_search[{j}]" if "per_search" in r else where
            out.append(Point(group, "p99 latency, predicted (s)", str(need(p, "policy", src, pw)),
                             schedule_label(p), num(p, "predicted_p99_latency_s", src, pw),
                             num(p, "predicted_throughput_tok_s", src, pw), False))
        b = r.get("baseline")
        if isinstance(b, dict) and b.get("feasible"):
            bw = f"{where}.baseline"
            out.append(Point(group, "p99 latency, predicted (s)", "FT baseline",
                             "FT " + " ".join(schedule_label(b).split()[1:]),
                             num(b, "predicted_p99_latency_s", src, bw),
                             num(b, "predicted_throughput_tok_s", src, bw), False))
    return out


def sim_points(d, src):
    out = []
    for i, case in enumerate(d):
        where = f"[{i}]"
        group = (f"{model_name(need(case, 'model', src, where))} on "
                 f"{need(case, 'workers', src, where)} workers, task {need(case, 'task', src, where)}")
        out += plan_run_points(need_list(case, "runs", src, where), src, f"{where}.runs", group)
    return out


def offload_plan_points(d, src):
    cost = d["cost"] if isinstance(d.get("cost"), dict) else d
    where = "cost" if cost is not d else ""
    model = f"{model_name(d['model'])}, " if "model" in d else ""
    group = (f"{model}prompt {int(num(cost, 'prompt_len', src, where))}, "
             f"gen {int(num(cost, 'gen_len', src, where))} (FlexGen's cost model)")
    return [Point(group, "latency: one block, cost model (s)", "cost model",
                  str(need(d, "policy", src)), num(cost, "total_time_s", src, where),
                  num(cost, "throughput_token_s", src, where), False)]


def vs_llamacpp_points(d, src):
    rows = need_list(d, "rows", src)
    model = model_name(rows[0].get("strata", {}).get("raw", {}).get("model", "?"))
    group = (f"{model} on {d.get('machine', '?')}: prompt {d.get('prompt', '?')}, "
             f"gen {d.get('gen', '?')}, Strata against llama.cpp")
    xlabel = "latency: prefill + decode of one batch (s)"
    out = []
    for i, row in enumerate(rows):
        where = f"rows[{i}]"
        name = str(need(row, "row", src, where))
        out.append(Point(group, xlabel, "llama.cpp", name, num(row, "llamacpp.raw.t", src, where),
                         num(row, "llamacpp.generation_tokens_per_s", src, where), False))
        res = need(row, "strata.raw.result", src, where)
        rw = f"{where}.strata.raw.result"
        out.append(Point(group, xlabel, "Strata", name,
                         num(res, "prefill_seconds", src, rw) + num(res, "decode_seconds", src, rw),
                         num(row, "strata.generation_tokens_per_s", src, where), False))
    return out


PARETO = {"bench": bench_points, "serve-stats": serve_points, "schedule-sim": sim_points,
          "schedule-plan": lambda d, src: plan_run_points(d, src, "", f"{stem(src)} (predicted)"),
          "offload-plan": offload_plan_points, "vs-llamacpp": vs_llamacpp_points}


# ---- stages: busy / idle per rank ------------------------------------------------------------


Run = collections.namedtuple("Run", "stem title stages handover")
Stage = collections.namedtuple("Stage", "name busy idle bubble")


def stage_roles(d):
    """rank -> "encode" / "decode" from a WAA run's `schedule.stages` (none for RRA)."""
    roles = {}
    sched = d.get("schedule") if isinstance(d.get("schedule"), dict) else {}
    for s in sched.get("stages", []):
        if isinstance(s, dict) and s.get("role") not in (None, "both"):
            roles[s.get("rank")] = s["role"]
    return roles


def stage_run(d, src):
    """One serve --stats-out run: its stages' busy / idle seconds and a title."""
    roles = stage_roles(d)
    sched = d.get("schedule") if isinstance(d.get("schedule"), dict) else {}
    stages = []
    for i, s in enumerate(need_list(d, "stages", src)):
        where = f"stages[{i}]"
        rank = int(num(s, "rank", src, where))
        busy, idle = num(s, "busy_seconds", src, where), num(s, "idle_seconds", src, where)
        layers = s.get("layers")
        name = f"rank {rank}" + (f" {roles[rank]}" if rank in roles else "")
        if isinstance(layers, list) and len(layers) == 2:
            name += f"\n[{layers[0]}, {layers[1]})"
        bubble = (num(s, "bubble_fraction", src, where) if "bubble_fraction" in s
                  else idle / (busy + idle) if busy + idle > 0 else 0.0)
        stages.append(Stage(name, busy, idle, bubble))
    title = f"{num(d, 'tokens_per_s', src):.0f} tok/s"
    if "micro_batches" in d:
        title += f", {d['micro_batches']} micro-batch" + ("es" if d["micro_batches"] != 1 else "")
    if sched.get("policy"):
        title += f"\n{schedule_label(sched)}"
    waa = d.get("waa")
    handover = None
    if isinstance(waa, dict) and "handover_seconds" in waa:
        handover = num(waa, "handover_seconds", src, "waa")
    return Run(stem(src), title, stages, handover)


# ---- tiers: bytes moved ------------------------------------------------------------------------

MOVED = [("disk_stream.bytes_read", "disk \u2192 CPU"),
         ("feed.bytes_cpu_to_gpu", "CPU \u2192 GPU"),
         ("feed.bytes_disk_to_gpu", "disk \u2192 CPU \u2192 GPU")]
HELD = [("feed.bytes_on_gpu", "GPU"), ("feed.bytes_on_cpu", "CPU"), ("feed.bytes_on_disk", "disk")]
Tiers = collections.namedtuple("Tiers", "stem detail moved held")


def tier_run(d, src):
    """Bytes moved (and held) per tier of one bench run."""
    if "feed" not in d and "disk_stream" not in d:
        raise InputError(f"{src}: missing field 'feed' or 'disk_stream': this run records no "
                         "bytes moved between tiers (its weights stayed in one tier)")
    moved = {name: num(d, key, src) for key, name in MOVED if key.split(".")[0] in d}
    held = {name: num(d, key, src) for key, name in HELD if "feed" in d}
    detail = f"batch {int(num(d, 'batch', src))}, gen {int(num(d, 'gen_len', src))}"
    if d.get("policy"):
        detail += f", {d['policy']}"
    return Tiers(stem(src), detail, moved, held)


# ---- timeline: every step of every stage ---------------------------------------------------

TIMELINE_SPANS = 2000  # more steps than this in a lane: the default window is the first...
TIMELINE_FIRST_S = 2.0  # ...seconds, so that single steps stay visible

Lane = collections.namedtuple("Lane", "name spans dropped")
Timeline = collections.namedtuple("Timeline", "src stem title lanes")


def span_list(s, src, where):
    """A stage's `step_spans_s` as (start, end) pairs, or InputError naming the field."""
    field = f"{where}.step_spans_s"
    if not isinstance(s, dict) or "step_spans_s" not in s:
        raise InputError(f"{src}: missing field '{field}': the timeline needs a stats file "
                         "written by a strata that records step spans (serve --stats-out)")
    spans = s["step_spans_s"]
    if not isinstance(spans, list):
        raise InputError(f"{src}: field '{field}' is {json.dumps(spans)[:40]}, "
                         "not a list of [start, end] pairs")
    out = []
    for j, p in enumerate(spans):
        if not (isinstance(p, list) and len(p) == 2
                and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                        and math.isfinite(v) for v in p) and p[0] <= p[1]):
            raise InputError(f"{src}: field '{field}[{j}]' is {json.dumps(p)[:40]}, not a "
                             "[start, end] pair of seconds with start <= end")
        out.append((float(p[0]), float(p[1])))
    return out


def busy_fraction(spans, lo, hi):
    """The share of the window [lo, hi] that the (start, end) spans cover; a second that
    two spans share counts once. 0 for an empty window."""
    if hi <= lo:
        return 0.0
    busy, reached = 0.0, lo
    for start, end in sorted(spans):
        start, end = max(start, reached), min(end, hi)
        if end > start:
            busy += end - start
            reached = end
    return busy / (hi - lo)


def run_labels(d):
    """"WAA-C, 2 micro-batches, N_D 4" from `schedule_in_force` (the run's own fields where
    it is absent), with the run's tokens/s."""
    sif = d.get("schedule_in_force") if isinstance(d.get("schedule_in_force"), dict) else {}
    policy = sif.get("policy") or ("WAA" if isinstance(d.get("waa"), dict) else None)
    micro, n_d = sif.get("micro_batches", d.get("micro_batches")), sif.get("decode_iters",
                                                                            d.get("decode_iters"))
    parts = [str(policy)] if policy else []
    if micro is not None:
        parts.append(f"{micro} micro-batch" + ("" if str(micro) == "1" else "es"))
    if n_d is not None:
        parts.append(f"N_D {n_d}")
    if isinstance(d.get("tokens_per_s"), (int, float)):
        parts.append(f"{d['tokens_per_s']:.0f} tok/s")
    return ", ".join(parts)


def timeline_run(d, src):
    """One serve --stats-out run: every recorded step of each stage, a lane per rank."""
    roles = stage_roles(d)
    lanes = []
    for i, s in enumerate(need_list(d, "stages", src)):
        where = f"stages[{i}]"
        rank = int(num(s, "rank", src, where))
        spans = span_list(s, src, where)
        name = f"rank {rank}"
        layers = s.get("layers")
        if isinstance(layers, list) and len(layers) == 2:
            name += f" [{layers[0]}, {layers[1]})"
        if rank in roles:
            name += f"\n{roles[rank]}"
        dropped = (int(num(s, "step_spans_dropped", src, where))
                   if "step_spans_dropped" in s else 0)
        lanes.append((rank, Lane(name, sorted(spans), dropped)))
    if not any(lane.spans for _, lane in lanes):
        raise InputError(f"{src}: field 'stages[i].step_spans_s' is empty in every stage: "
                         "no step recorded")
    lanes = [lane for _, lane in sorted(lanes, key=lambda x: x[0])]
    return Timeline(src, stem(src), run_labels(d), lanes)


def window(lanes, start=None, stop=None, src="timeline"):
    """(from, to, note): the x range drawn. --from / --to where given; otherwise the whole
    run, or TIMELINE_FIRST_S seconds from its start when a lane has more than TIMELINE_SPANS
    steps (the note says so)."""
    first = min([0.0] + [lane.spans[0][0] for lane in lanes if lane.spans])
    last = max(end for lane in lanes for _, end in lane.spans)
    lo = first if start is None else start
    crowded = max(len(lane.spans) for lane in lanes) > TIMELINE_SPANS
    if stop is not None:
        hi, note = stop, f"{lo:g}\u2013{stop:g} s of {last:.3g} s"
    elif crowded and last > lo + TIMELINE_FIRST_S:
        hi = lo + TIMELINE_FIRST_S
        note = (f"{lo:g}\u2013{hi:g} s of {last:.3g} s: the default window, as a rank has more "
                f"than {TIMELINE_SPANS} steps (--from / --to for others)")
    else:
        hi = last
        note = (f"the whole run, {last:.3g} s" if start is None
                else f"{lo:g} s to the end, {last:.3g} s")
    if hi <= lo:
        raise InputError(f"{src}: the window {lo:g} to {hi:g} s is empty (the last recorded "
                         f"step ends at {last:.3f} s)")
    return lo, hi, note


# ---- drawing ---------------------------------------------------------------------------------------


def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise InputError("matplotlib is missing: install Debian's python3-matplotlib "
                         "(scripts/install-deps.sh) and run with /usr/bin/python3")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def grid(plt, n, width, height, cols=3, **kw):
    cols = min(n, cols)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False, **kw)
    flat = [a for row in axes for a in row]
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def layout(fig, title):
    if title:
        fig.suptitle(title)
    fig.tight_layout()


def write(fig, out):
    try:
        if os.path.dirname(out):
            os.makedirs(os.path.dirname(out), exist_ok=True)
        fig.savefig(out, dpi=DPI)
    except OSError as e:
        raise InputError(f"{out}: cannot write: {e.strerror}")


def save(fig, out, title):
    layout(fig, title)
    write(fig, out)


MARKERS = "osD^vP*Xh<>p"


OFFSETS = [(5, 3, "left", "bottom"), (5, -3, "left", "top"), (-5, 3, "right", "bottom"),
           (-5, -3, "right", "top"), (0, 8, "center", "bottom"), (0, -8, "center", "top")]


def overlap(a, b):
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return w * h if w > 0 and h > 0 else 0.0


def place_labels(fig, ax, items, taken):
    """Annotates (text, x, y) beside its point where it covers the least of `taken` (pixel
    boxes: points, legend, labels placed before) and stays inside the axes."""
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    for text, x, y in items:
        best = None
        for dx, dy, ha, va in OFFSETS:
            a = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points",
                            ha=ha, va=va, fontsize=6.5)
            box = a.get_window_extent(renderer)
            outside = box.width * box.height - overlap(box, frame)
            cost = sum(overlap(box, t) for t in taken) + 4 * outside
            if best is None or cost < best[0]:
                if best is not None:
                    best[1].remove()
                best = (cost, a, box)
            else:
                a.remove()
            if cost == 0:
                break
        taken.append(best[2])


def draw_pareto(points, out, title):
    plt = pyplot()
    from matplotlib.transforms import Bbox
    groups = list(dict.fromkeys(p.group for p in points))
    fig, axes = grid(plt, len(groups), 5.2, 4.2)
    series = list(dict.fromkeys(p.series for p in points))
    style = {s: (f"C{i % 10}", MARKERS[i % len(MARKERS)]) for i, s in enumerate(series)}
    todo = []
    for ax, g in zip(axes, groups):
        pts = list(dict.fromkeys(p for p in points if p.group == g))
        short = iter(shorten([p.label for p in pts if p.from_stem]))
        labels = [next(short) if p.from_stem else p.label for p in pts]
        front = pareto_frontier([(p.latency, p.throughput) for p in pts])
        for s in dict.fromkeys(p.series for p in pts):
            mine = [p for p in pts if p.series == s]
            ax.scatter([p.latency for p in mine], [p.throughput for p in mine], label=s,
                       color=style[s][0], marker=style[s][1], s=36, zorder=3)
        ax.plot([pts[i].latency for i in front], [pts[i].throughput for i in front], "-",
                color="0.35", lw=1.2, zorder=2, label="Pareto frontier")
        for axis, values in (("x", [p.latency for p in pts]), ("y", [p.throughput for p in pts])):
            if min(values) > 0 and max(values) / min(values) > 20:
                (ax.set_xscale if axis == "x" else ax.set_yscale)("log")
        ax.margins(0.2)
        ax.set_title(g, fontsize=8.5)
        ax.set_xlabel(pts[0].xlabel, fontsize=8)
        ax.set_ylabel("throughput (generated tokens/s)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5, loc="best")
        shown = range(len(pts)) if len(pts) <= LABEL_ALL_UP_TO else front
        todo.append((ax, pts, [(labels[i], pts[i].latency, pts[i].throughput) for i in shown]))
    layout(fig, title)
    renderer = fig.canvas.get_renderer()
    for ax, pts, items in todo:
        taken = [ax.get_legend().get_window_extent(renderer)]
        for p in pts:
            cx, cy = ax.transData.transform((p.latency, p.throughput))
            taken.append(Bbox([[cx - 4, cy - 4], [cx + 4, cy + 4]]))
        place_labels(fig, ax, items, taken)
    write(fig, out)


def draw_stages(runs, out, title):
    plt = pyplot()
    height = 1.2 + 0.55 * max(len(r.stages) for r in runs)
    fig, axes = grid(plt, len(runs), 4.2, height, cols=4, sharex=True)
    for ax, run, name in zip(axes, runs, shorten([r.stem for r in runs])):
        ys = range(len(run.stages))
        busy = [s.busy for s in run.stages]
        ax.barh(ys, busy, color="C0", label="busy")
        ax.barh(ys, [s.idle for s in run.stages], left=busy, color="C1", alpha=0.45,
                hatch="//", label="idle (bubble)")
        for y, s in zip(ys, run.stages):
            ax.text(s.busy + s.idle, y, f" {s.bubble:.0%}", va="center", fontsize=7)
        ax.set_yticks(list(ys), [s.name for s in run.stages], fontsize=7)
        ax.invert_yaxis()
        sub = f"{name}: {run.title}"
        if run.handover is not None:
            sub += f"\nKV hand-over {run.handover:.2f} s in all"
        ax.set_title(sub, fontsize=8)
        ax.set_xlabel("seconds in the stage's window (first to last step)", fontsize=7)
        ax.tick_params(axis="x", labelsize=7, labelbottom=True)
        ax.margins(x=0.15)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=7, frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.3 / fig.get_figheight(), 1, 1))
    write(fig, out)


def draw_tiers(runs, out, title):
    plt = pyplot()
    with_held = any(r.held for r in runs)
    fig, axes = plt.subplots(1, 2 if with_held else 1, squeeze=False, sharey=True,
                             figsize=(11 if with_held else 6.5, 1.2 + 0.45 * len(runs)))
    ys = range(len(runs))
    # Bytes moved: a bar per tier link, side by side; links at zero in every run only named.
    ax = axes[0][0]
    links = [n for _, n in MOVED if any(n in r.moved for r in runs)]
    drawn = [n for n in links if any(r.moved.get(n, 0) > 0 for r in runs)] or links
    h = 0.8 / len(drawn)
    for k, link in enumerate(drawn):
        pos = [y - 0.4 + h * (k + 0.5) for y in ys]
        vals = [r.moved.get(link, 0) / 1e9 for r in runs]
        ax.barh(pos, vals, height=h, label=link, color=f"C{k}")
        for y, v, r in zip(pos, vals, runs):
            if link in r.moved:
                ax.text(v, y, f" {v:.1f}", va="center", fontsize=6)
    zero = [n for n in links if n not in drawn]
    ax.set_xlabel("weight bytes moved, whole run (GB)"
                  + (f"; {', '.join(zero)}: 0 in every run" if zero else ""), fontsize=8)
    # Bytes held: one stacked bar per run.
    if with_held:
        hx = axes[0][1]
        left = [0.0] * len(runs)
        for k, (_, tier) in enumerate(HELD):
            vals = [r.held.get(tier, 0) / 1e9 for r in runs]
            hx.barh(ys, vals, left=left, height=0.6, label=tier, color=f"C{k + 3}")
            left = [a + b for a, b in zip(left, vals)]
        hx.set_xlim(0, 1.1 * max(left + [1e-9]))
        hx.set_xlabel("weight bytes placed per tier, with staging slots (GB)", fontsize=8)
    for a in axes[0]:
        a.tick_params(labelsize=7)
        a.margins(x=0.12)
        a.legend(fontsize=7, loc="lower right")
        a.grid(axis="x", alpha=0.3)
    names = [f"{s}\n{r.detail}" for s, r in zip(shorten([r.stem for r in runs]), runs)]
    ax.set_yticks(list(ys), names, fontsize=6.5)
    ax.invert_yaxis()
    save(fig, out, title)


def draw_timeline(runs, windows, out, title):
    plt = pyplot()
    from matplotlib.patches import Patch
    heights = [1.1 + 0.42 * len(r.lanes) for r in runs]
    fig, axes = plt.subplots(len(runs), 1, squeeze=False, figsize=(10, sum(heights) + 0.4),
                             gridspec_kw={"height_ratios": heights})
    for ax, run, (lo, hi, note) in zip(axes[:, 0], runs, windows):
        for y, lane in enumerate(run.lanes):
            ax.broken_barh([(lo, hi - lo)], (y - 0.35, 0.7), color="0.9", lw=0)
            shown = [(max(a, lo), min(b, hi) - max(a, lo)) for a, b in lane.spans
                     if b > lo and a < hi]
            ax.broken_barh(shown, (y - 0.35, 0.7), color="C0", lw=0)
            text = f" busy {busy_fraction(lane.spans, lo, hi):.0%}"
            if lane.dropped:
                text += f"\n {lane.dropped} steps not recorded"
            ax.text(1.0, y, text, transform=ax.get_yaxis_transform(), va="center", fontsize=7)
        ax.set_yticks(range(len(run.lanes)), [lane.name for lane in run.lanes], fontsize=7)
        ax.set_ylim(len(run.lanes) - 0.5, -0.5)  # rank 1 at the top
        ax.set_xlim(lo, hi)
        ax.set_title(f"{run.stem}: {run.title}\n{note}" if run.title else f"{run.stem}\n{note}",
                     fontsize=8)
        ax.set_xlabel("seconds since the first step", fontsize=7)
        ax.tick_params(axis="x", labelsize=7)
    handles = [Patch(color="C0", label="a step computed"), Patch(color="0.9", label="idle")]
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=7, frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.3 / fig.get_figheight(), 1, 1))
    write(fig, out)


# ---- the command line ---------------------------------------------------------------------------------


def gather(paths, extract, plot):
    """Each file loaded, its kind checked against `extract` (kind -> function), extracted."""
    got = []
    for path in paths:
        data = load(path)
        kind = kind_of(data)
        if kind is None:
            keys = ", ".join(list(data)[:8]) if isinstance(data, dict) else type(data).__name__
            raise InputError(f"{path}: not a kind of JSON plot.py reads (top level: {keys})")
        if kind not in extract:
            raise InputError(f"{path}: {kind} JSON ({KINDS[kind]}) has nothing for '{plot}'; "
                             f"it reads {', '.join(sorted(extract))}")
        try:
            got.append(extract[kind](data, path))
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            raise InputError(f"{path}: unexpected {kind} JSON: {type(e).__name__} {e}")
    return got


def cmd_pareto(a):
    points = [p for ps in gather(a.inputs, PARETO, "pareto") for p in ps]
    if not points:
        raise InputError("pareto: no feasible point in " + ", ".join(a.inputs))
    draw_pareto(points, a.out, a.title)


def cmd_stages(a):
    draw_stages(gather(a.inputs, {"serve-stats": stage_run}, "stages"), a.out, a.title)


def cmd_tiers(a):
    draw_tiers(gather(a.inputs, {"bench": tier_run}, "tiers"), a.out, a.title)


def cmd_timeline(a):
    for flag, v in (("--from", a.start), ("--to", a.stop)):
        if v is not None and not math.isfinite(v):
            raise InputError(f"timeline: {flag} {v} is not a finite number of seconds")
    if a.start is not None and a.stop is not None and a.start >= a.stop:
        raise InputError(f"timeline: --from {a.start:g} is not below --to {a.stop:g}")
    runs = gather(a.inputs, {"serve-stats": timeline_run}, "timeline")
    windows = [window(r.lanes, a.start, a.stop, r.src) for r in runs]
    draw_timeline(runs, windows, a.out, a.title)


def cmd_kinds(a):
    readers = {"pareto": PARETO, "stages": {"serve-stats": stage_run}, "tiers": {"bench": tier_run},
               "timeline": {"serve-stats": timeline_run}}
    bad = []
    for path in a.inputs:
        try:
            data = load(path)
        except InputError as e:
            print(e)
            bad.append(path)
            continue
        kind = kind_of(data)
        plots = []
        for plot, extract in readers.items():
            if kind in extract:
                try:
                    extract[kind](data, path)
                    plots.append(plot)
                except InputError as e:
                    plots.append(f"not {plot} ({str(e)[len(path) + 2:]})")
                except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
                    plots.append(f"not {plot} (unexpected {kind} JSON: {type(e).__name__} {e})")
        print(f"{path}: {kind or 'unknown'}: {'; '.join(plots) or 'no plot reads it'}")
    if bad:
        raise InputError(f"kinds: {len(bad)} file(s) not read: {', '.join(bad)}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    sub = p.add_subparsers(dest="command", required=True)
    helps = {"pareto": "throughput against latency, one point per policy or schedule, the "
                       "Pareto frontier drawn (one subplot per model and workload)",
             "stages": "busy and idle (bubble) seconds of each stage, one subplot per run",
             "tiers": "bytes moved between memory tiers (and held per tier), one row per run",
             "timeline": "every recorded step of each stage, a lane per rank with its busy "
                         "share in the window, one subplot per run"}
    for name, fn in (("pareto", cmd_pareto), ("stages", cmd_stages), ("tiers", cmd_tiers),
                     ("timeline", cmd_timeline)):
        sp = sub.add_parser(name, help=helps[name], description=helps[name])
        sp.add_argument("out", metavar="OUT.png")
        sp.add_argument("inputs", metavar="IN.json", nargs="+")
        sp.add_argument("--title", help="a title over the whole figure")
        sp.set_defaults(fn=fn)
        if name == "timeline":
            sp.add_argument("--from", dest="start", type=float, metavar="S",
                            help="where the window starts, seconds since the first step "
                                 "(default: the first step)")
            sp.add_argument("--to", dest="stop", type=float, metavar="S",
                            help=f"where it ends (default: the last step, or "
                                 f"{TIMELINE_FIRST_S:g} s after its start when a rank has "
                                 f"more than {TIMELINE_SPANS} steps)")
    sp = sub.add_parser("kinds", help="print each file's kind and the plots it can feed")
    sp.add_argument("inputs", metavar="IN.json", nargs="+")
    sp.set_defaults(fn=cmd_kinds)
    a = p.parse_args(argv)
    try:
        a.fn(a)
    except InputError as e:
        print(f"plot.py: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
