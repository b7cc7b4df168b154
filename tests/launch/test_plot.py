#!/usr/bin/env python3
"""scripts/plot.py on hand-made JSON of every kind it reads: the figures are valid PNGs that
draw the hand-made numbers (read back from matplotlib's objects), the Pareto frontier is the hand-computed one (and the brute-force one on random
points), each kind's numbers are the fields the docs name, and bad input exits 2 with the file
and the field named, never a traceback.

    test_plot.py PATH/TO/scripts/plot.py
"""
import importlib.util
import json
import os
import random
import struct
import subprocess
import sys
import tempfile
import unittest

SCRIPT = None  # set from argv in main
plot = None  # the module, imported from SCRIPT


def bench(name, batch, prefill, decode, tok_s, **extra):
    d = {"model": "dummy:tiny", "prompt_len": 8, "gen_len": 4, "batch": batch,
         "result": {"prefill_seconds": prefill, "decode_seconds": decode,
                    "generation_tokens_per_s": tok_s}}
    d.update(extra)
    return name, d


def feed(cpu_to_gpu, disk_to_gpu=0):
    return {"bytes_cpu_to_gpu": cpu_to_gpu, "bytes_disk_to_gpu": disk_to_gpu,
            "bytes_on_gpu": 2e9, "bytes_on_cpu": 1e9, "bytes_on_disk": 0}


def stats(name, micro, tok_s, stages, schedule=None):
    d = {"model": "/m/tiny", "ranks": len(stages) + 1, "micro_batches": micro, "requests": 10,
         "prompt_tokens": 100, "generated_tokens": 40, "seconds": 2.0, "tokens_per_s": tok_s,
         "stages": [{"rank": r + 1, "layers": [2 * r, 2 * r + 2], "busy_seconds": b,
                     "idle_seconds": i, "window_seconds": b + i,
                     "bubble_fraction": i / (b + i)} for r, (b, i) in enumerate(stages)]}
    if schedule:
        policy, p99, thr = schedule
        d["schedule"] = {"policy": policy, "measured_p99_latency_s": p99,
                         "achieved_throughput_tok_s": thr,
                         "control_variables": {"encode_batch": 4, "micro_batches": micro},
                         "stages": [{"rank": 1, "role": "encode"}, {"rank": 2, "role": "decode"}]}
        d["waa"] = {"handover_seconds": 0.25}
    return name, d


def timeline_stats(name, spans, micro=1, dropped=None):
    """Stats whose stage r computed the steps spans[r] ([start, end] seconds), in rank order
    reversed (the figure puts rank 1 on top whatever the order)."""
    totals = [(sum(e - s for s, e in sp), 1.0) for sp in spans]
    name, d = stats(name, micro, 50.0, totals)
    for st, sp in zip(d["stages"], spans):
        st["step_spans_s"] = sp
        if dropped:
            st["step_spans_dropped"] = dropped
    d["stages"].reverse()
    d["schedule_in_force"] = {"policy": "RRA", "micro_batches": str(micro), "decode_iters": "1",
                              "stages": str(len(spans))}
    return name, d


def plan_run(bound, policy, lat, thr, base_lat, base_thr):
    return {"latency_bound_s": bound, "feasible": True, "policy": policy,
            "predicted_p99_latency_s": lat, "predicted_throughput_tok_s": thr,
            "control_variables": {"policy": policy, "encode_batch": 8, "micro_batches": 2},
            "per_search": [{"policy": policy, "feasible": True, "predicted_p99_latency_s": lat,
                            "predicted_throughput_tok_s": thr,
                            "control_variables": {"encode_batch": 8, "micro_batches": 2}},
                           {"policy": "RRA", "feasible": False}],
            "baseline": {"feasible": True, "predicted_p99_latency_s": base_lat,
                         "predicted_throughput_tok_s": base_thr,
                         "control_variables": {"policy": "FT", "encode_batch": 2,
                                               "micro_batches": 1}}}


FIXTURES = dict([
    bench("gpu-resident-b1", 1, 0.1, 0.3, 10.0, feed=feed(0)),
    bench("gpu-resident-b8", 8, 0.2, 0.6, 40.0, feed=feed(0), policy="w=100/0/0"),
    bench("gpu-stream-b8", 8, 0.5, 1.5, 16.0, feed=feed(5e10), policy="w=0/100/0"),
    bench("cpu-disk-b2", 2, 1.0, 3.0, 2.0,
          disk_stream={"bytes_read": 7e9, "layers_read": 10, "overlap": True}),
    bench("cpu-plain-b1", 1, 0.1, 0.4, 8.0),
    stats("cluster-mb1", 1, 90.0, [(1.0, 1.5), (1.6, 0.9)]),
    stats("cluster-mb2", 2, 120.0, [(1.1, 0.8), (1.8, 0.1)]),
    stats("schedule-waa-0.5", 1, 300.0, [(1.5, 0.2), (0.9, 0.8)], ("WAA-C", 0.05, 310.0)),
    stats("schedule-rra-inf", 2, 400.0, [(1.2, 0.5), (1.5, 0.2)], ("RRA", 0.12, 420.0)),
    # rank 1 busy [0, 1], [2, 3]; rank 2 [1, 2], [3, 4]: they take turns
    timeline_stats("timeline-mb1", [[[0, 1], [2, 3]], [[1, 2], [3, 4]]]),
    timeline_stats("timeline-mb2", [[[0, 0.5], [0.6, 1.1], [1.2, 1.7]],
                                    [[0.5, 1.0], [1.1, 1.6], [1.7, 2.2]]], micro=2, dropped=40),
    ("sim", [{"model": "dummy:big", "workers": 4, "task": "S",
              "runs": [plan_run(5.0, "WAA-C", 4.0, 500.0, 4.5, 20.0),
                       plan_run("inf", "RRA", 12.0, 900.0, 9.0, 450.0),
                       {"latency_bound_s": 1.0, "feasible": False,
                        "baseline": {"feasible": False}}]}]),
    ("offload-plan", {"policy": "gbs=8,ngb=2,w=20/80/0", "model": "dummy:tiny", "prompt_len": 8,
                      "gen_len": 4, "total_time_s": 3.0, "throughput_token_s": 21.3}),
    ("offload-search", {"policy": "gbs=4,ngb=1,w=0/100/0", "schedules_tried": 9,
                        "cost": {"prompt_len": 8, "gen_len": 4, "total_time_s": 1.5,
                                 "throughput_token_s": 10.7}}),
    ("vs", {"machine": "vm", "prompt": 8, "gen": 4,
            "rows": [{"row": "f32-b1",
                      "llamacpp": {"generation_tokens_per_s": 60.0, "raw": {"t": 1.1}},
                      "strata": {"generation_tokens_per_s": 65.0,
                                 "raw": {"model": "/x/tiny",
                                         "result": {"prefill_seconds": 0.2,
                                                    "decode_seconds": 0.8}}}}]}),
])


def png_size(path):
    """(width, height) from a PNG's IHDR, after checking the signature."""
    with open(path, "rb") as f:
        head = f.read(24)
    if head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        raise AssertionError(f"{path} is not a PNG: {head[:16]!r}")
    return struct.unpack(">II", head[16:24])


def dominated(p, q):
    """q dominates p: latency no higher, throughput no lower, one strictly better."""
    return q[0] <= p[0] and q[1] >= p[1] and (q[0] < p[0] or q[1] > p[1])


class Plot(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.dir = cls.tmp.name
        for name, data in FIXTURES.items():
            with open(cls.path(name), "w") as f:
                json.dump(data, f)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    @classmethod
    def path(cls, name):
        return os.path.join(cls.dir, name + ".json")

    def run_plot(self, *args):
        return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                              timeout=100)

    def write(self, name, data):
        with open(self.path(name), "w") as f:
            f.write(data if isinstance(data, str) else json.dumps(data))
        return self.path(name)

    def assert_png(self, out, min_w=300, min_h=150):
        self.assertTrue(os.path.isfile(out), out)
        w, h = png_size(out)
        self.assertGreaterEqual(w, min_w)
        self.assertGreaterEqual(h, min_h)
        self.assertLessEqual(max(w, h), 3000)

    def figure(self, *args):
        """plot.py run in this process on ARGS (a command, its output, its inputs): the
        figure it wrote, so the test reads back what was drawn."""
        figs = []
        real = plot.write

        def keep(fig, out):
            figs.append(fig)
            real(fig, out)

        plot.write = keep
        try:
            self.assertEqual(plot.main(list(args)), 0)
        finally:
            plot.write = real
        self.assertEqual(len(figs), 1)
        self.assert_png(args[1])
        self.addCleanup(plot.pyplot().close, figs[0])
        return figs[0]

    @staticmethod
    def bars(ax):
        """{legend label: [(left, width), ...]} of each bar series, in draw order."""
        return {c.get_label(): [(round(r.get_x(), 9), round(r.get_width(), 9)) for r in c]
                for c in ax.containers}

    @staticmethod
    def intervals(collection):
        """A broken_barh's rectangles as (start, end, lane) with the lane their y centre."""
        out = []
        for p in collection.get_paths():
            xs, ys = p.vertices[:, 0], p.vertices[:, 1]
            out.append((round(xs.min(), 9), round(xs.max(), 9), round((ys.min() + ys.max()) / 2)))
        return out

    # ---- the frontier ----

    def test_frontier_hand_example(self):
        pairs = [(1.0, 10.0),  # 0: frontier
                 (2.0, 30.0),  # 1: frontier
                 (2.0, 25.0),  # 2: same latency as 1, less throughput
                 (3.0, 20.0),  # 3: slower and less than 1
                 (4.0, 50.0),  # 4: frontier
                 (0.5, 5.0),   # 5: frontier (fastest)
                 (4.0, 50.0),  # 6: a copy of 4: only the first is kept
                 (5.0, 50.0),  # 7: as much as 4, slower
                 (6.0, 49.0)]  # 8: slower and less than 4
        self.assertEqual(plot.pareto_frontier(pairs), [5, 0, 1, 4])
        self.assertEqual(plot.pareto_frontier([]), [])
        self.assertEqual(plot.pareto_frontier([(3.0, 1.0)]), [0])
        self.assertEqual(plot.pareto_frontier([(1.0, 5.0), (1.0, 9.0), (1.0, 7.0)]), [1])
        self.assertEqual(plot.pareto_frontier([(3.0, 9.0), (2.0, 9.0), (1.0, 9.0)]), [2])

    def test_frontier_against_brute_force(self):
        rng = random.Random(15)
        for _ in range(200):
            pairs = [(rng.randint(1, 8) / 2, rng.randint(1, 8) * 10.0)
                     for _ in range(rng.randint(1, 12))]
            want = sorted({p for p in pairs if not any(dominated(p, q) for q in pairs)})
            got = plot.pareto_frontier(pairs)
            self.assertEqual([pairs[i] for i in got], want, pairs)
            self.assertEqual(len(set(pairs[i] for i in got)), len(got), "a duplicate kept")

    # ---- what each kind contributes ----

    def test_points_are_the_documented_fields(self):
        b = plot.bench_points(FIXTURES["gpu-stream-b8"], "gpu-stream-b8.json")[0]
        self.assertEqual((b.latency, b.throughput), (2.0, 16.0))  # prefill + decode seconds
        self.assertIn("w=0/100/0", b.label)
        s = plot.serve_points(FIXTURES["schedule-waa-0.5"], "s.json")[0]
        self.assertEqual((s.latency, s.throughput, s.series), (0.05, 310.0, "WAA-C"))
        sim = plot.sim_points(FIXTURES["sim"], "sim.json")
        self.assertEqual(sorted((p.series, p.latency, p.throughput) for p in sim),
                         [("FT baseline", 4.5, 20.0), ("FT baseline", 9.0, 450.0),
                          ("RRA", 12.0, 900.0), ("WAA-C", 4.0, 500.0)])  # infeasible left out
        o = plot.offload_plan_points(FIXTURES["offload-search"], "o.json")[0]
        self.assertEqual((o.latency, o.throughput, o.label), (1.5, 10.7, "gbs=4,ngb=1,w=0/100/0"))
        v = plot.vs_llamacpp_points(FIXTURES["vs"], "vs.json")
        self.assertEqual(sorted((p.series, p.latency, p.throughput) for p in v),
                         [("Strata", 1.0, 65.0), ("llama.cpp", 1.1, 60.0)])
        t = plot.tier_run(FIXTURES["gpu-stream-b8"], "t.json")
        self.assertEqual(t.moved, {"CPU \u2192 GPU": 5e10, "disk \u2192 CPU \u2192 GPU": 0.0})
        t = plot.tier_run(FIXTURES["cpu-disk-b2"], "t.json")
        self.assertEqual((t.moved, t.held), ({"disk \u2192 CPU": 7e9}, {}))
        run = plot.stage_run(FIXTURES["schedule-waa-0.5"], "r.json")
        self.assertEqual([(s.name.split("\n")[0], s.busy, s.idle) for s in run.stages],
                         [("rank 1 encode", 1.5, 0.2), ("rank 2 decode", 0.9, 0.8)])
        self.assertEqual(plot.shorten(["cluster-np3-mb1", "cluster-np3-mb2"]), ["mb1", "mb2"])
        self.assertEqual(plot.shorten(["a-b", "a-b"]), ["b", "b"])

    # ---- the figures ----

    def test_figures_are_pngs(self):
        every_pareto = [self.path(n) for n in FIXTURES
                        if n not in ("cluster-mb1", "cluster-mb2", "timeline-mb1",
                                     "timeline-mb2")]
        cases = {
            "pareto": every_pareto,
            "stages": [self.path(n) for n in ("cluster-mb1", "cluster-mb2", "schedule-waa-0.5")],
            "tiers": [self.path(n) for n in ("gpu-resident-b1", "gpu-stream-b8", "cpu-disk-b2")],
            "timeline": [self.path(n) for n in ("timeline-mb1", "timeline-mb2")],
        }
        for command, inputs in cases.items():
            with self.subTest(command=command):
                out = os.path.join(self.dir, "figs", f"{command}.png")  # the folder is made
                r = self.run_plot(command, out, *inputs, "--title", f"test {command}")
                self.assertEqual(r.returncode, 0, r.stderr)
                self.assert_png(out)
        r = self.run_plot("kinds", *[self.path(n) for n in FIXTURES])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("schedule-sim", r.stdout)
        self.assertIn("not pareto (missing field 'schedule'", r.stdout)
        lines = dict(line.split(": ", 1) for line in r.stdout.splitlines())
        self.assertTrue(lines[self.path("timeline-mb1")].endswith("stages; timeline"),
                        lines[self.path("timeline-mb1")])
        self.assertIn("not timeline (missing field 'stages[0].step_spans_s'",
                      lines[self.path("cluster-mb1")])
        self.assertNotIn("timeline", lines[self.path("gpu-resident-b1")])

    # ---- the timeline ----

    def test_busy_fraction_hand_computed(self):
        lanes = plot.timeline_run(FIXTURES["timeline-mb1"], "t.json").lanes
        rank1, rank2 = lanes[0].spans, lanes[1].spans
        self.assertEqual((rank1, rank2), ([(0, 1), (2, 3)], [(1, 2), (3, 4)]))  # rank 1 first
        cases = [((0.5, 3.5), (0.5 + 1.0) / 3.0, (1.0 + 0.5) / 3.0),
                 ((0.0, 4.0), 0.5, 0.5),
                 ((0.0, 1.0), 1.0, 0.0),
                 ((0.25, 2.5), (0.75 + 0.5) / 2.25, 1.0 / 2.25),
                 ((1.5, 2.25), 0.25 / 0.75, 0.5 / 0.75),
                 ((4.0, 6.0), 0.0, 0.0),     # after the last step
                 ((-1.0, 1.0), 0.5, 0.0)]    # before the first
        for (lo, hi), want1, want2 in cases:
            with self.subTest(window=(lo, hi)):
                self.assertAlmostEqual(plot.busy_fraction(rank1, lo, hi), want1)
                self.assertAlmostEqual(plot.busy_fraction(rank2, lo, hi), want2)
        self.assertEqual(plot.busy_fraction(rank1, 2.0, 2.0), 0.0)  # an empty window
        self.assertEqual(plot.busy_fraction([], 0.0, 1.0), 0.0)
        # Overlapping spans (which strata does not write) count each second once.
        self.assertAlmostEqual(plot.busy_fraction([(1, 3), (0, 2), (2.5, 2.7)], 0, 4), 0.75)

    def test_timeline_run_and_window(self):
        run = plot.timeline_run(FIXTURES["timeline-mb2"], "x/timeline-mb2.json")
        self.assertEqual(run.stem, "timeline-mb2")
        self.assertIn("RRA, 2 micro-batches, N_D 1", run.title)
        self.assertEqual([lane.name for lane in run.lanes], ["rank 1 [0, 2)", "rank 2 [2, 4)"])
        self.assertEqual([lane.dropped for lane in run.lanes], [40, 40])
        lo, hi, note = plot.window(run.lanes)
        self.assertEqual((lo, hi), (0.0, 2.2))  # the whole run
        self.assertIn("whole run", note)
        self.assertEqual(plot.window(run.lanes, 0.4, 1.0)[:2], (0.4, 1.0))
        self.assertEqual(plot.window(run.lanes, 0.4)[:2], (0.4, 2.2))
        with self.assertRaises(plot.InputError):
            plot.window(run.lanes, 3.0)  # past the last step
        # More steps than TIMELINE_SPANS in a lane: the first TIMELINE_FIRST_S seconds.
        n = plot.TIMELINE_SPANS + 1
        crowded = [plot.Lane("rank 1", [(k * 0.01, k * 0.01 + 0.005) for k in range(n)], 0)]
        lo, hi, note = plot.window(crowded)
        self.assertEqual((lo, hi), (0.0, plot.TIMELINE_FIRST_S))
        self.assertIn("default window", note)
        self.assertEqual(plot.window(crowded, 5.0)[:2], (5.0, 5.0 + plot.TIMELINE_FIRST_S))
        self.assertEqual(plot.window(crowded, None, 20.0)[:2], (0.0, 20.0))

    def test_timeline_figures(self):
        mb1, mb2 = self.path("timeline-mb1"), self.path("timeline-mb2")
        for args in ([mb1], [mb1, mb2, "--from", "0.5", "--to", "3.5"], [mb2, "--from", "1"]):
            with self.subTest(args=args):
                out = os.path.join(self.dir, "timeline.png")
                if os.path.exists(out):
                    os.remove(out)
                r = self.run_plot("timeline", out, *args, "--title", "test timeline")
                self.assertEqual(r.returncode, 0, r.stderr)
                self.assert_png(out)
        # A run with more steps than TIMELINE_SPANS per lane: only the steps that start in the
        # first TIMELINE_FIRST_S seconds are drawn.
        lanes = [[[k * 0.001, k * 0.001 + 0.0006] for k in range(3000)],
                 [[k * 0.001 + 0.0005, k * 0.001 + 0.0009] for k in range(3000)]]
        f = self.write("timeline-crowded", timeline_stats("x", lanes)[1])
        fig = self.figure("timeline", os.path.join(self.dir, "crowded.png"), f)
        ax = fig.axes[0]
        self.assertEqual(ax.get_xlim(), (0.0, plot.TIMELINE_FIRST_S))
        for lane, spans in enumerate(lanes):
            want = sum(1 for a, _ in spans if a < plot.TIMELINE_FIRST_S)
            self.assertLessEqual(want, plot.TIMELINE_SPANS)
            self.assertEqual(len(self.intervals(ax.collections[2 * lane + 1])), want)

    # ---- what the figures draw ----

    def test_pareto_draws_every_point_and_the_frontier_through_the_best(self):
        # sim: WAA-C (4, 500) and RRA (12, 900) searched, the FT baselines (4.5, 20) and
        # (9, 450) slower and less than WAA-C; the frontier is WAA-C then RRA.
        ax, = [a for a in self.figure("pareto", os.path.join(self.dir, "p1.png"),
                                      self.path("sim")).axes if a.get_visible()]
        self.assertEqual({c.get_label(): c.get_offsets().tolist() for c in ax.collections},
                         {"WAA-C": [[4.0, 500.0]], "RRA": [[12.0, 900.0]],
                          "FT baseline": [[4.5, 20.0], [9.0, 450.0]]})
        line, = ax.lines
        self.assertEqual((line.get_label(), list(line.get_xdata()), list(line.get_ydata())),
                         ("Pareto frontier", [4.0, 12.0], [500.0, 900.0]))
        # The five bench runs, one model and workload: latency prefill + decode, a series per
        # batch. (0.4, 10) and (0.8, 40) are the frontier; (0.5, 8), (2.0, 16) and (4.0, 2)
        # are each slower and less than one of them.
        benches = ["gpu-resident-b1", "gpu-resident-b8", "gpu-stream-b8", "cpu-disk-b2",
                   "cpu-plain-b1"]
        ax, = [a for a in self.figure("pareto", os.path.join(self.dir, "p2.png"),
                                      *[self.path(n) for n in benches]).axes if a.get_visible()]
        got = {c.get_label(): sorted((round(x, 9), y) for x, y in c.get_offsets().tolist())
               for c in ax.collections}
        self.assertEqual(got, {"batch 1": [(0.4, 10.0), (0.5, 8.0)],
                               "batch 8": [(0.8, 40.0), (2.0, 16.0)], "batch 2": [(4.0, 2.0)]})
        line, = ax.lines
        self.assertEqual([round(x, 9) for x in line.get_xdata()], [0.4, 0.8])
        self.assertEqual(list(line.get_ydata()), [10.0, 40.0])

    def test_stages_draw_busy_then_idle_stacked(self):
        fig = self.figure("stages", os.path.join(self.dir, "s.png"), self.path("cluster-mb1"),
                          self.path("cluster-mb2"))
        mb1, mb2 = [a for a in fig.axes if a.get_visible()]
        # (busy, idle) per rank: mb1 (1.0, 1.5), (1.6, 0.9); mb2 (1.1, 0.8), (1.8, 0.1).
        self.assertEqual(self.bars(mb1), {"busy": [(0, 1.0), (0, 1.6)],
                                          "idle (bubble)": [(1.0, 1.5), (1.6, 0.9)]})
        self.assertEqual(self.bars(mb2), {"busy": [(0, 1.1), (0, 1.8)],
                                          "idle (bubble)": [(1.1, 0.8), (1.8, 0.1)]})
        # Bubbles idle / (busy + idle): 1.5 / 2.5, 0.9 / 2.5; 0.8 / 1.9, 0.1 / 1.9.
        self.assertEqual([t.get_text() for t in mb1.texts], [" 60%", " 36%"])
        self.assertEqual([t.get_text() for t in mb2.texts], [" 42%", " 5%"])

    def test_tiers_draw_the_bytes_moved_and_held(self):
        fig = self.figure("tiers", os.path.join(self.dir, "t.png"),
                          *[self.path(n) for n in ("gpu-resident-b1", "gpu-stream-b8",
                                                   "cpu-disk-b2")])
        moved, held = fig.axes
        # GB per run (gpu-resident-b1, gpu-stream-b8, cpu-disk-b2): 5e10 B CPU -> GPU in the
        # second, 7e9 B disk -> CPU in the third; disk -> CPU -> GPU is 0 in all, only named.
        self.assertEqual({k: [w for _, w in v] for k, v in self.bars(moved).items()},
                         {"disk \u2192 CPU": [0, 0, 7.0], "CPU \u2192 GPU": [0, 50.0, 0]})
        self.assertIn("disk \u2192 CPU \u2192 GPU: 0 in every run", moved.get_xlabel())
        # Held, stacked: 2 GB GPU then 1 GB CPU in the two runs with a feed, none in the third.
        self.assertEqual(self.bars(held), {"GPU": [(0, 2.0), (0, 2.0), (0, 0)],
                                           "CPU": [(2.0, 1.0), (2.0, 1.0), (0, 0)],
                                           "disk": [(3.0, 0), (3.0, 0), (0, 0)]})

    def test_timeline_draws_the_steps_inside_the_window(self):
        fig = self.figure("timeline", os.path.join(self.dir, "tl.png"), self.path("timeline-mb1"),
                          "--from", "0.5", "--to", "3.5")
        ax, = fig.axes
        self.assertEqual(ax.get_xlim(), (0.5, 3.5))
        # Per lane: the window's background, then its steps cut to the window. Rank 1 computed
        # [0, 1] and [2, 3], rank 2 [1, 2] and [3, 4]; each busy 1.5 s of the 3.
        got = [self.intervals(c) for c in ax.collections]
        self.assertEqual(got, [[(0.5, 3.5, 0)], [(0.5, 1.0, 0), (2.0, 3.0, 0)],
                               [(0.5, 3.5, 1)], [(1.0, 2.0, 1), (3.0, 3.5, 1)]])
        self.assertEqual([t.get_text() for t in ax.texts], [" busy 50%", " busy 50%"])

    def test_help(self):
        r = self.run_plot("--help")
        self.assertEqual(r.returncode, 0)
        for word in ("pareto", "stages", "tiers", "timeline", "serve-stats", "bench"):
            self.assertIn(word, r.stdout)

    # ---- bad input ----

    def assert_refused(self, args, *words):
        r = self.run_plot(*args)
        self.assertEqual(r.returncode, 2, (r.stdout, r.stderr))
        self.assertNotIn("Traceback", r.stderr)
        for w in words:
            self.assertIn(w, r.stderr)
        out = args[1] if len(args) > 1 else ""
        self.assertFalse(out.endswith(".png") and os.path.exists(out), "a figure of bad input")

    def test_bad_input_exits_2_naming_file_and_field(self):
        out = os.path.join(self.dir, "bad.png")
        _, st = stats("x", 1, 1.0, [(1.0, 1.0), (1.0, 1.0)])
        del st["stages"][1]["busy_seconds"]
        f = self.write("no-busy", st)
        self.assert_refused(["stages", out, self.path("cluster-mb1"), f], f,
                            "'stages[1].busy_seconds'")
        # A run without --latency-bound has no latency for the frontier.
        f = self.path("cluster-mb1")
        self.assert_refused(["pareto", out, f], f, "'schedule'")
        # A bench run with all its weights in one tier moved nothing to count.
        f = self.path("cpu-plain-b1")
        self.assert_refused(["tiers", out, f], f, "'feed' or 'disk_stream'")
        _, b = bench("x", 1, 0.1, "0.5", 3.0)
        f = self.write("string-seconds", b)
        self.assert_refused(["pareto", out, f], f, "'result.decode_seconds'", "not a finite")
        _, b = bench("x", 1, 0.1, 0.5, 3.0)
        del b["result"]["generation_tokens_per_s"]
        f = self.write("no-throughput", b)
        self.assert_refused(["pareto", out, f], f, "'result.generation_tokens_per_s'")
        sim = json.loads(json.dumps(FIXTURES["sim"]))
        del sim[0]["runs"][1]["per_search"][0]["predicted_p99_latency_s"]
        f = self.write("sim-bad", sim)
        self.assert_refused(["pareto", out, f], f,
                            "'[0].runs[1].per_search[0].predicted_p99_latency_s'")
        f = self.write("not-json", "{\"model\": ")
        self.assert_refused(["pareto", out, f], f, "not JSON")
        f = self.write("other", {"hello": 1})
        self.assert_refused(["pareto", out, f], f, "not a kind")
        self.assert_refused(["stages", out, self.path("sim")], self.path("sim"), "schedule-sim",
                            "nothing for 'stages'")
        f = self.path("cluster-mb1")  # written by a strata that records no step spans
        self.assert_refused(["timeline", out, f], f, "'stages[0].step_spans_s'",
                            "records step spans")
        _, st = timeline_stats("x", [[[0, 1]], [[1, 2]]])
        del st["stages"][1]["step_spans_s"]
        f = self.write("timeline-no-spans", st)
        self.assert_refused(["timeline", out, self.path("timeline-mb1"), f], f,
                            "missing field 'stages[1].step_spans_s'", "records step spans")
        for bad in ([1.0], [2.0, 1.0], ["0.5", 1.0], [True, 1.0], [0.5, None], [0, 1, 2],
                    "0.5", {"start": 0, "end": 1}):
            with self.subTest(span=bad):
                _, st = timeline_stats("x", [[[0, 1], [3, 4]], [[1, 2]]])
                st["stages"][1]["step_spans_s"][1] = bad  # stages[1] is rank 1
                f = self.write("timeline-bad-span", st)
                self.assert_refused(["timeline", out, f], f, "'stages[1].step_spans_s[1]'",
                                    "[start, end]")
        self.write("timeline-nan", '{"tokens_per_s": 1, "stages": [{"rank": 1, '
                   '"step_spans_s": [[0, NaN]]}]}')
        self.assert_refused(["timeline", out, self.path("timeline-nan")],
                            self.path("timeline-nan"), "'stages[0].step_spans_s[0]'")
        _, st = timeline_stats("x", [[[0, 1]], [[1, 2]]])
        st["stages"][0]["step_spans_s"] = {"0": [0, 1]}
        f = self.write("timeline-not-list", st)
        self.assert_refused(["timeline", out, f], f, "'stages[0].step_spans_s'", "not a list")
        _, st = timeline_stats("x", [[], []])
        f = self.write("timeline-empty", st)
        self.assert_refused(["timeline", out, f], f, "step_spans_s", "no step recorded")
        f = self.path("timeline-mb1")
        self.assert_refused(["timeline", out, f, "--from", "2", "--to", "1"], "--from 2",
                            "not below --to 1")
        self.assert_refused(["timeline", out, f, "--from", "9"], f, "is empty")
        self.assert_refused(["timeline", out, f, "--to", "nan"], "--to nan", "not a finite")
        self.assert_refused(["timeline", out, self.path("gpu-resident-b1")],
                            self.path("gpu-resident-b1"), "nothing for 'timeline'")
        missing = os.path.join(self.dir, "absent.json")
        self.assert_refused(["tiers", out, missing], missing, "cannot read")
        r = self.run_plot("pareto", out)  # no input at all: argparse's usage error
        self.assertEqual(r.returncode, 2)
        self.assertIn("usage", r.stderr)
        r = self.run_plot("timeline", "--help")
        self.assertEqual(r.returncode, 0)
        self.assertIn("--from S", r.stdout)


def main():
    global SCRIPT, plot
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    SCRIPT = os.path.abspath(sys.argv[1])
    sys.dont_write_bytecode = True  # no __pycache__ in scripts/
    spec = importlib.util.spec_from_file_location("plot", SCRIPT)
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    unittest.main(argv=[sys.argv[0]], verbosity=2)


if __name__ == "__main__":
    main()
