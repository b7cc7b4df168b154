#!/usr/bin/python3
"""Self-check of make_model.py and reference_forward.py (NumPy only, about a minute).

  selfcheck.py [--keep DIR]

For every family: writes a model, runs the reference on a 40-token prompt and asserts the
logits are finite, of a sane spread, and that the greedy ids are not all one token; that the
sharded and bfloat16 writes load; and that the features the test models are meant to exercise
really change the output (so a cross-check against them can catch their absence):
  mistral, gemma2  sliding window 16: logits equal to the window-disabled model's for
                   positions 0..15 (i - j < 16 always holds there) and different from 16 on;
  qwen2            the window only applies with use_sliding_window, on layers >= max_window_layers;
  phi3             short factors while the length <= original_max_position_embeddings (128):
                   a 128-token prompt's first 40 rows equal the 40-token prompt's; at 129 the
                   long factors apply to every position, so those rows change;
  gemma2           query_pre_attn_scalar, attention and final softcaps each move the logits;
  llama            llama3 rope scaling moves the logits;
  MoE families     (mixtral, qwen2moe, olmoe, qwen3moe) the routing is spread: several expert
                   sets per layer, most experts used, the router logit gap between the k-th and
                   (k+1)-th expert above 1e-4 everywhere (so an f32 engine picks the same
                   experts); num_experts_per_tok moves the logits; qwen2moe, olmoe and qwen3moe:
                   norm_topk_prob moves them (mixtral renormalises always: the flag is refused);
                   qwen2moe: closing the shared expert's gate moves them; olmoe: clip_qkv moves
                   them; decoder_sparse_step 2 / mlp_only_layers [1] are refused; --q4
                   compresses the experts' gate/up and leaves the router as stored.
Also: an unknown config field is refused (exit status 2 from the CLI), and the CLI's
--logits-out / --json-out match the in-process forward. Prints one line per check.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.dont_write_bytecode = True  # no __pycache__ left next to the scripts
sys.path.insert(0, HERE)
import make_model  # noqa: E402
import reference_forward as ref  # noqa: E402

PROMPT = [int(t) for t in np.random.default_rng(2024).integers(3, 256, 40)]
RESULTS = []


def check(name, ok, detail=""):
    RESULTS.append((name, bool(ok)))
    print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}")


def model_with(model_dir, **override):
    return ref.load_model(model_dir, override)


def max_diff(a, b):
    return float(np.max(np.abs(a - b)))


def check_basic(family, model_dir):
    m = ref.load_model(model_dir)
    logits = m.forward(PROMPT)
    m.check_all_used()
    greedy = m.greedy(PROMPT, 32)
    std = float(np.std(logits))
    check(f"{family}: finite logits [{logits.shape[0]}, {logits.shape[1]}]", np.isfinite(logits).all())
    check(f"{family}: logits std {std:.2f} in [0.3, 10]", 0.3 <= std <= 10)
    check(f"{family}: greedy not all one id", len(set(greedy)) > 1, f"{len(set(greedy))} distinct of 32")
    return logits


def check_layouts(family, tmp, logits):
    sharded = os.path.join(tmp, f"{family}-sharded")
    make_model.make_model(family, sharded, seed=0, shards=3)
    check(f"{family}: 3 shards load the same weights", max_diff(ref.load_model(sharded).forward(PROMPT), logits) == 0)
    bf16 = os.path.join(tmp, f"{family}-bf16")
    make_model.make_model(family, bf16, seed=0, dtype="bfloat16")
    if family in make_model.MOE_FAMILIES:
        check_moe_bf16(family, tmp, bf16, logits)
    else:
        d = max_diff(ref.load_model(bf16).forward(PROMPT), logits)
        check(f"{family}: bfloat16 weights load (max |diff| vs f32 {d:.3f})", 0 < d < 1)
    # Not a check: how far f32-sized weight noise moves the logits, a floor for the tolerance
    # of a cross-check against an f32 engine.
    m = ref.load_model(os.path.join(tmp, family))
    rng = np.random.default_rng(1)
    m.w = {k: v * (1 + rng.normal(0.0, 1e-6, v.shape)) for k, v in m.w.items()}
    m.head = m.lm_head_weight()
    print(f"info {family}: weights * (1 + N(0, 1e-6)) move the logits by {max_diff(m.forward(PROMPT), logits):.1e}")


def check_moe_bf16(family, tmp, bf16, logits):
    """bf16 rounding (~2e-3 relative) moves router logits by more than the smallest top-k gap,
    so a few tokens switch experts and their logits move by O(1): compare the positions whose
    experts are the f32 model's in every layer, and check the weights read are the f32 ones
    rounded to bf16 (to nearest even)."""
    f32 = ref.load_model(os.path.join(tmp, family))
    f32.forward(PROMPT)
    m = ref.load_model(bf16)
    got = m.forward(PROMPT)
    same = np.ones(len(PROMPT), dtype=bool)
    for a, b in zip(f32.routing, m.routing):
        same &= np.all(np.sort(a["chosen"], axis=1) == np.sort(b["chosen"], axis=1), axis=1)
    rounded = all(np.array_equal(m.w[n], (make_model.to_bf16_bits(w).astype(np.uint32) << 16).view(np.float32))
                  for n, w in f32.w.items())
    d = max_diff(got[same], logits[same]) if same.any() else float("nan")
    check(f"{family}: bfloat16 weights load as the f32 ones rounded (max |diff| vs f32 {d:.3f} on the "
          f"{int(same.sum())} of {len(PROMPT)} positions routed alike)", rounded and same.sum() >= len(PROMPT) // 2 and 0 < d < 1)


def check_window_boundary(family, model_dir, logits, window=16):
    full = model_with(model_dir, sliding_window=None).forward(PROMPT)
    row = np.max(np.abs(full - logits), axis=1)
    check(f"{family}: positions < {window} unaffected by the window", np.all(row[:window] == 0))
    check(f"{family}: window changes position {window} and 39", row[window] > 1e-6 and row[39] > 1e-6,
          f"|diff| {row[window]:.2e}, {row[39]:.2e}")


def check_qwen2_window(model_dir, logits):
    off = model_with(model_dir, sliding_window=4).forward(PROMPT)
    check("qwen2: sliding_window ignored without use_sliding_window", max_diff(off, logits) == 0)
    top = model_with(model_dir, sliding_window=4, use_sliding_window=True, max_window_layers=3).forward(PROMPT)
    check("qwen2: max_window_layers = num layers leaves every layer full", max_diff(top, logits) == 0)
    on = model_with(model_dir, sliding_window=4, use_sliding_window=True, max_window_layers=1).forward(PROMPT)
    check("qwen2: layers >= max_window_layers slide", max_diff(on, logits) > 1e-6)


def check_phi3_longrope(model_dir, logits):
    m = ref.load_model(model_dir)
    ids = [int(t) for t in np.random.default_rng(5).integers(3, 256, 129)]
    ids[:40] = PROMPT
    short = m.forward(ids[:128])[:40]
    long = m.forward(ids)[:40]
    check("phi3: length 128 keeps the short factors", max_diff(short, logits) < 1e-9)
    check("phi3: length 129 switches every position to the long factors", max_diff(long, logits) > 1e-6,
          f"|diff| {max_diff(long, logits):.2e}")
    rs = dict(m.cfg["rope_scaling"])
    flat = model_with(model_dir, rope_scaling=dict(rs, attention_factor=1.0)).forward(PROMPT)
    check("phi3: longrope cos/sin scale sqrt(1+ln(512/128)/ln(128)) matters", max_diff(flat, logits) > 1e-6)


def check_gemma2_features(model_dir, logits):
    for field, value in (("query_pre_attn_scalar", 24), ("attn_logit_softcapping", None),
                         ("final_logit_softcapping", None)):
        d = max_diff(model_with(model_dir, **{field: value}).forward(PROMPT), logits)
        check(f"gemma2: {field} -> {value} moves the logits", d > 1e-3, f"max |diff| {d:.3f}")


def check_llama_rope(model_dir, logits):
    d = max_diff(model_with(model_dir, rope_scaling=None).forward(PROMPT), logits)
    check("llama: llama3 rope scaling moves the logits", d > 1e-6, f"max |diff| {d:.2e}")


def check_refusal(tmp):
    bad = os.path.join(tmp, "bad")
    make_model.make_model("llama", bad)
    with open(os.path.join(bad, "config.json")) as f:
        cfg = json.load(f)
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 2.0}
    cfg["some_new_field"] = 1
    with open(os.path.join(bad, "config.json"), "w") as f:
        json.dump(cfg, f)
    r = subprocess.run([sys.executable, os.path.join(HERE, "reference_forward.py"), "--model", bad,
                        "--ids", "1 2 3"], capture_output=True, text=True)
    check("unknown config field refused (exit 2)", r.returncode == 2, r.stderr.strip())


def check_cli(family, model_dir, logits, tmp):
    lf, jf = os.path.join(tmp, "l.f32"), os.path.join(tmp, "r.json")
    r = subprocess.run([sys.executable, os.path.join(HERE, "reference_forward.py"), "--model", model_dir,
                        "--ids", " ".join(map(str, PROMPT)), "--new", "4", "--logits-out", lf,
                        "--json-out", jf], capture_output=True, text=True)
    raw = np.fromfile(lf, dtype="<f4").reshape(len(PROMPT), -1) if r.returncode == 0 else None
    with open(jf) as f:
        res = json.load(f) if r.returncode == 0 else {}
    ok = raw is not None and max_diff(raw, logits.astype(np.float32)) == 0
    ok = ok and res["greedy"] == ref.load_model(model_dir).greedy(PROMPT, 4)
    check(f"{family}: CLI --logits-out [n_prompt, vocab] f32 and --json-out match", ok, r.stderr.strip())


def check_moe(family, model_dir, logits):
    m = ref.load_model(model_dir)
    m.forward(PROMPT)
    k = m.cfg["num_experts_per_tok"]
    e = ref.n_experts(m.cfg)
    gap = min(float(r["margin"].min()) for r in m.routing)
    sets = [len({tuple(sorted(c)) for c in r["chosen"]}) for r in m.routing]
    used = [len(np.unique(r["chosen"])) for r in m.routing]
    check(f"{family}: top-{k} of {e} router logit gap >= 1e-4 on every token and layer", gap >= 1e-4, f"min {gap:.2e}")
    check(f"{family}: several expert sets a layer", min(sets) >= 8, f"distinct sets {sets} of {len(PROMPT)} tokens")
    check(f"{family}: most experts used in every layer", min(used) >= 0.75 * e, f"used {used} of {e}")
    d = max_diff(model_with(model_dir, num_experts_per_tok=k + 1).forward(PROMPT), logits)
    check(f"{family}: num_experts_per_tok {k} -> {k + 1} moves the logits", d > 1e-3, f"max |diff| {d:.3f}")
    if family != "mixtral":
        flag = bool(m.cfg["norm_topk_prob"])
        d = max_diff(model_with(model_dir, norm_topk_prob=not flag).forward(PROMPT), logits)
        check(f"{family}: norm_topk_prob {flag} -> {not flag} moves the logits", d > 1e-3, f"max |diff| {d:.3f}")
    for field, value in (("decoder_sparse_step", 2), ("mlp_only_layers", [1])):
        if field in m.cfg:
            try:
                model_with(model_dir, **{field: value})
                check(f"{family}: {field} {value} refused", False)
            except ref.Unsupported as err:
                check(f"{family}: {field} {value} refused", True, str(err))
    if family == "qwen2moe":
        shut = ref.load_model(model_dir)
        for name in [n for n in shut.w if n.endswith("mlp.shared_expert_gate.weight")]:
            shut.w[name] = np.full_like(shut.w[name], -1e3)  # sigmoid -> 0 on every token
        d = max_diff(shut.forward(PROMPT), logits)
        check("qwen2moe: the shared expert (sigmoid-gated) matters", d > 1e-3, f"max |diff| {d:.3f}")
    if family == "olmoe":
        d = max_diff(model_with(model_dir, clip_qkv=0.5).forward(PROMPT), logits)
        check("olmoe: clip_qkv 0.5 moves the logits", d > 1e-3, f"max |diff| {d:.3f}")
    q4 = ref.load_model(model_dir, q4=True).q4_compressed
    experts = [n for n in q4 if ".experts." in n]
    routers = [n for n in q4 if n.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight", "shared_expert_gate.weight"))]
    # the gate and up matrices (in = hidden = 64, whole groups) of every expert of every layer
    want = 2 * e * m.cfg["num_hidden_layers"]
    check(f"{family}: --q4 compresses the experts' gate/up ({want}), not the router", len(experts) == want and not routers,
          f"{len(experts)} expert matrices, routers {routers[:2]}")


EXTRA = {
    "mistral": lambda d, l, t: check_window_boundary("mistral", d, l),
    "gemma2": lambda d, l, t: (check_window_boundary("gemma2", d, l), check_gemma2_features(d, l)),
    "qwen2": lambda d, l, t: check_qwen2_window(d, l),
    "phi3": lambda d, l, t: check_phi3_longrope(d, l),
    "llama": lambda d, l, t: (check_llama_rope(d, l), check_cli("llama", d, l, t)),
}


for _family in make_model.MOE_FAMILIES:
    EXTRA[_family] = lambda d, l, t, f=_family: check_moe(f, d, l)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keep", help="write the models under DIR and keep them")
    a = p.parse_args(argv)
    tmp = a.keep or tempfile.mkdtemp(prefix="families-")
    try:
        for family in make_model.FAMILIES:
            model_dir = os.path.join(tmp, family)
            make_model.make_model(family, model_dir, seed=0)
            logits = check_basic(family, model_dir)
            check_layouts(family, tmp, logits)
            if family in EXTRA:
                EXTRA[family](model_dir, logits, tmp)
        check_refusal(tmp)
    finally:
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    failed = [n for n, ok in RESULTS if not ok]
    print(f"\n{len(RESULTS) - len(failed)}/{len(RESULTS)} checks passed" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
