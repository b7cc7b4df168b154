#!/usr/bin/env python3
"""One model family through Strata against the NumPy reference (reference_forward.py, written
from Hugging Face's modelling files and checked against llama.cpp where llama.cpp has the
family: tests/anchors/llamacpp).

    test_family.py STRATA FAMILY CASE

FAMILY: one of make_model.py's FAMILIES (llama, mistral, qwen2, qwen3, phi3, gemma2 and the
mixture-of-experts families mixtral, qwen2moe, olmoe, qwen3moe); the cases are the same for all.

CASE:
  single    strata score's logits of a 40-token prompt within 1e-4 x their std of the
            reference's, and strata generate's 32 greedy ids equal to the reference's
            (up to the first end-of-sequence id, where Strata stops)
  disk      the same with every weight streamed from disk and the KV cache on disk
            (--policy w=0/0/100,c=0/0/100)
  experts   MoE families: the same with one expert of each layer in host memory and the
            others on disk, read through two cache slots (--resident-experts 1
            --expert-cache 2), and strata bench's expert_stream showing they were read
  q4        4-bit weights (cw=1) against the reference on the same round-tripped weights
            (reference_forward.py --q4): 1e-4 x std and equal ids with the kernels that
            dequantise rows, 1e-2 x std with the int8-split panel kernels (docs/FAMILIES.md)
  cluster   a 3-rank cluster (launch/local-cluster.sh) serving the prompt: its ids equal
            the reference's (MoE families with one expert per layer resident, the rest on
            disk)
  refuse    the loader refuses, naming the tensor or field: an extra tensor, a missing
            bias, an unknown rope type, and (qwen2) the checkpoint relabelled llama

The prompt is 40 tokens: longer than the 16-position sliding window of the mistral and
gemma2 models, so the window is exercised; steps of 8 rows make mistral's KV slots hold the
window alone (25 rows, not 71), and generate's kv_cache_bytes is checked against that count.
"""
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
PY = sys.executable
PROMPT_LEN = 40
NEW = 32
# Rows of one step: the prompt is prefilled in chunks of 5 steps, and a KV slot of a model
# with a window on every layer (mistral's 16) holds W - 1 + STEP + ceil(W / 8) = 25 rows, so
# the 72 positions slide it every other step (kernels/backend.h KvWindow).
STEP = 8

sys.dont_write_bytecode = True  # no __pycache__ left next to the scripts
sys.path.insert(0, HERE)
from make_model import FAMILIES  # noqa: E402


# The MoE families' expert tensor names and expert-count fields (Hugging Face's).
MOE_EXPERT = {
    "mixtral": "model.layers.1.block_sparse_moe.experts.{j}.{part}.weight",
    "qwen2moe": "model.layers.1.mlp.experts.{j}.{part}.weight",
    "qwen3moe": "model.layers.1.mlp.experts.{j}.{part}.weight",
    "olmoe": "model.layers.1.mlp.experts.{j}.{part}.weight",
}
MOE_DOWN = {"mixtral": "w2", "qwen2moe": "down_proj", "qwen3moe": "down_proj", "olmoe": "down_proj"}
MOE_COUNT = {"mixtral": "num_local_experts", "qwen2moe": "num_experts", "qwen3moe": "num_experts",
             "olmoe": "num_experts"}


def fail(msg):
    sys.exit(f"FAIL: {msg}")


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, **kw)
    if r.returncode != 0:
        fail(f"{' '.join(cmd[:3])} ... exited {r.returncode}: {r.stderr[-2000:]}")
    return r.stdout


def make_model(family, out):
    run([PY, os.path.join(HERE, "make_model.py"), "--family", family, "--out", out, "--seed", "0"])
    with open(os.path.join(out, "config.json")) as f:
        return json.load(f)


def prompt_ids(vocab):
    rng = random.Random(1)
    return [rng.randrange(3, vocab) for _ in range(PROMPT_LEN)]


def reference(model, ids, tmp, extra=()):
    logits, js = os.path.join(tmp, "ref.f32"), os.path.join(tmp, "ref.json")
    run([PY, os.path.join(HERE, "reference_forward.py"), "--model", model, "--ids",
         " ".join(map(str, ids)), "--new", str(NEW), "--logits-out", logits, "--json-out", js,
         *extra])
    with open(js) as f:
        return np.fromfile(logits, dtype=np.float32), json.load(f)["greedy"]


def step_options(small_steps):
    """Steps of STEP rows a sequence (and of max(--max-batch, STEP) rows in all, the most one
    sequence may add: what a window's rows count); else the defaults (512-row steps), as the
    4-bit case's bounds were measured."""
    return ["--max-step-tokens", str(STEP), "--max-batch", "4"] if small_steps else []


def strata_logits(strata, model, ids, tmp, options, env=None, small_steps=True):
    out = os.path.join(tmp, "strata.f32")
    run([strata, "score", "--model", model, "--ids", " ".join(map(str, ids)), "--logits-out", out,
         "--threads", "2", *step_options(small_steps), *options], env=env)
    return np.fromfile(out, dtype=np.float32)


def strata_greedy(strata, model, ids, options, env=None, config=None, small_steps=True):
    cmd = [strata, "generate", "--model", model, "--prompt", " ".join(map(str, ids)),
           "--max-new-tokens", str(NEW), "--temperature", "0", "--format", "json",
           "--threads", "2", *step_options(small_steps), *options]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    if r.returncode != 0:
        fail(f"strata generate exited {r.returncode}: {r.stderr[-2000:]}")
    if config is not None:
        check_cache_bytes(config, r.stderr, options)
    return json.loads(r.stdout.strip().splitlines()[-1])["output_ids"]


def check_cache_bytes(config, stderr, options):
    """What the window promises: the KV cache holds each slot's window rows, counted here
    from the rule (f32, one slot of PROMPT_LEN + NEW - 1 positions)."""
    summary = next(json.loads(line)["summary"] for line in stderr.splitlines()
                   if line.startswith('{"summary"'))
    context = PROMPT_LEN + NEW - 1
    w = config.get("sliding_window") if config.get("model_type") == "mistral" else None
    rows = min(context, w - 1 + STEP + -(-w // 8)) if w else context
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    want = 2 * config["num_hidden_layers"] * rows * heads * head_dim * 4
    if any("cc=1" in o or "cf16=1" in o for o in options):
        return
    if summary["kv_cache_bytes"] != want:
        fail(f"kv_cache_bytes {summary['kv_cache_bytes']}, want {want} ({rows} rows a slot)")
    print(f"KV cache: {want} bytes, {rows} rows a slot of {context} positions")


def eos_ids(config):
    e = config.get("eos_token_id")
    return set(e if isinstance(e, list) else [] if e is None else [e])


def check_greedy(got, want, config, what):
    """Strata stops at an end-of-sequence id; the reference does not."""
    eos = eos_ids(config)
    stop = next((i + 1 for i, t in enumerate(want) if t in eos), len(want))
    if got != want[:stop]:
        fail(f"{what}: greedy ids {got} != reference {want[:stop]}")
    print(f"{what}: {len(got)} greedy ids equal")


def check_logits(got, want, bound, what):
    if got.shape != want.shape:
        fail(f"{what}: {got.size} logits, reference {want.size}")
    ratio = float(np.abs(got - want).max() / want.std())
    print(f"{what}: max|dlogit| / std = {ratio:.2e} (bound {bound:g})")
    if not ratio <= bound:
        fail(f"{what}: max|dlogit| / std = {ratio:.3e} above {bound:g}")


def case_engine(strata, family, tmp, options, ref_extra=(), bound=1e-4):
    model = os.path.join(tmp, family)
    config = make_model(family, model)
    ids = prompt_ids(config["vocab_size"])
    ref_logits, ref_greedy = reference(model, ids, tmp, ref_extra)
    check_logits(strata_logits(strata, model, ids, tmp, options), ref_logits, bound, family)
    check_greedy(strata_greedy(strata, model, ids, options, config=config), ref_greedy, config,
                 family)


def case_q4(strata, family, tmp):
    """4-bit weights: with the row-major kernels (STRATA_CPU_WEIGHTS=rows: each row dequantised
    to f32, FlexGen's way) the logits and ids are the f32 reference's on the round-tripped
    weights; the panel kernels (the default) multiply the codes by x split into two int8 parts
    (docs/OFFLOADING.md), within 1e-2 x std of it.

    A MoE layer's experts each see a few rows of the 40-row prefill, which the row-major path
    multiplies with the 4-bit GEMV of at most kGemvMaxRows rows (kernels/gemv_q4_kernel.h):
    it too splits x into two int8 parts (about 16 bits), so for MoE families the rows bound is
    3e-3 x std (measured 1.0e-4 to 1.6e-3), not the 1e-4 of a prefill GEMM that dequantises."""
    model = os.path.join(tmp, family)
    config = make_model(family, model)
    rows_bound = 3e-3 if family in MOE_EXPERT else 1e-4
    ids = prompt_ids(config["vocab_size"])
    ref_logits, ref_greedy = reference(model, ids, tmp, ["--q4"])
    options = ["--policy", "w=0/100/0,cw=1"]
    rows = dict(os.environ, STRATA_CPU_WEIGHTS="rows")
    check_logits(strata_logits(strata, model, ids, tmp, options, rows, False), ref_logits,
                 rows_bound, f"{family} 4-bit, rows")
    check_greedy(strata_greedy(strata, model, ids, options, rows, small_steps=False), ref_greedy,
                 config, f"{family} 4-bit, rows")
    check_logits(strata_logits(strata, model, ids, tmp, options, small_steps=False), ref_logits,
                 1e-2, f"{family} 4-bit, panels")


def check_read_from_disk(strata, family, tmp, options):
    """What the option promises: every layer came from disk (strata bench's streamer counts)."""
    model = os.path.join(tmp, family)
    with open(os.path.join(model, "config.json")) as f:
        layers = json.load(f)["num_hidden_layers"]
    out = json.loads(run([strata, "bench", "--model", model, "--prompt-len", "8", "--gen-len", "4",
                          "--threads", "2", *options]))
    read = out.get("disk_stream", {}).get("layers_read", 0)
    if read < layers * 4:  # every layer at least once per step (prefill + 3 decode steps)
        fail(f"{family}: {read} layer reads from disk over 4 steps of {layers} layers")
    print(f"{family}: {read} layer reads from disk")


def check_experts_from_disk(strata, family, tmp, options, resident):
    """What the option promises: each layer holds `resident` experts, the others were written to
    disk and the steps read the ones the router picked from there (strata bench's
    expert_stream counts), and the process's weights in host memory shrank accordingly."""
    model = os.path.join(tmp, family)
    with open(os.path.join(model, "config.json")) as f:
        c = json.load(f)
    experts = c.get("num_local_experts", c.get("num_experts"))
    out = json.loads(run([strata, "bench", "--model", model, "--prompt-len", "8", "--gen-len", "4",
                          "--threads", "2", *options]))
    stream = out.get("expert_stream")
    if stream is None:
        fail(f"{family}: no expert_stream in strata bench's output: nothing came from disk")
    want = c["num_hidden_layers"] * (experts - resident)
    if stream["disk_experts"] != want:
        fail(f"{family}: {stream['disk_experts']} experts on disk, expected {want}")
    if stream["reads"] <= 0 or stream["bytes_read"] != stream["reads"] * stream["expert_bytes"]:
        fail(f"{family}: expert reads {stream}")
    print(f"{family}: {stream['disk_experts']} experts on disk, {stream['reads']} read "
          f"({stream['cache_hits']} cache hits of {stream['requested']})")


def case_cluster(strata, family, tmp):
    model = os.path.join(tmp, family)
    config = make_model(family, model)
    ids = prompt_ids(config["vocab_size"])
    _, ref_greedy = reference(model, ids, tmp)
    reqs, res = os.path.join(tmp, "req.jsonl"), os.path.join(tmp, "res.jsonl")
    with open(reqs, "w") as f:
        f.write(json.dumps({"id": "a", "prompt_ids": ids, "max_new_tokens": NEW}) + "\n")
        f.write(json.dumps({"id": "b", "prompt_ids": ids[:20], "max_new_tokens": 4}) + "\n")
    env = dict(os.environ, STRATA=strata, STRATA_LOG_LEVEL="warn")
    # MoE families: each stage keeps one expert of a layer in host memory, the rest on disk.
    experts = []
    if family in MOE_EXPERT:
        disk = os.path.join(tmp, "disk")
        os.mkdir(disk)
        experts = ["--resident-experts", "1", "--disk-dir", disk]
    run(["timeout", "-k", "5", "120", "bash", os.path.join(ROOT, "launch", "local-cluster.sh"), "3",
         "--model", model, "--threads", "1", "--max-context", "128", *step_options(True), *experts,
         "--requests", reqs,
         "--results", res], env=env)
    got = {}
    with open(res) as f:
        for line in f:
            r = json.loads(line)
            got[r["id"]] = r
    if got.get("a", {}).get("stop_reason") == "error":
        fail(f"cluster: {got['a']}")
    check_greedy(got["a"]["output_ids"], ref_greedy, config, f"{family} on 3 ranks")
    _, short = reference(model, ids[:20], tmp)
    check_greedy(got["b"]["output_ids"], short[:4], config, f"{family} on 3 ranks, 20-token prompt")


# Refusals ------------------------------------------------------------------------------

def refused(strata, model, *needles):
    r = subprocess.run([strata, "score", "--model", model, "--ids", "3 4 5"], capture_output=True,
                       text=True, timeout=120)
    if r.returncode == 0:
        fail(f"{model}: loaded, expected a refusal naming {needles}")
    for n in needles:
        if n not in r.stderr:
            fail(f"{model}: the refusal does not name '{n}': {r.stderr[-600:]}")
    print(f"refused ({os.path.basename(model)}): {r.stderr.strip().splitlines()[-1][:200]}")


def edit_config(model, out, change):
    shutil.copytree(model, out)
    path = os.path.join(out, "config.json")
    with open(path) as f:
        c = json.load(f)
    change(c)
    with open(path, "w") as f:
        json.dump(c, f)
    return out


def rewrite_tensors(model, out, change):
    """The checkpoint with its tensor dict changed by `change(header, blobs)`."""
    shutil.copytree(model, out)
    path = os.path.join(out, "model.safetensors")
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", None)
    blobs = {k: data[v["data_offsets"][0]:v["data_offsets"][1]] for k, v in header.items()}
    change(header, blobs)
    offset, body, out_header = 0, b"", {"__metadata__": meta} if meta else {}
    for k in header:
        out_header[k] = dict(header[k], data_offsets=[offset, offset + len(blobs[k])])
        body += blobs[k]
        offset += len(blobs[k])
    text = json.dumps(out_header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + body)
    return out


def case_refuse(strata, family, tmp):
    model = os.path.join(tmp, family)
    make_model(family, model)
    # A tensor the model does not read.
    def extra(header, blobs):
        header["model.layers.0.mlp.extra.weight"] = {"dtype": "F32", "shape": [4]}
        blobs["model.layers.0.mlp.extra.weight"] = bytes(16)
    refused(strata, rewrite_tensors(model, os.path.join(tmp, "extra"), extra),
            "model.layers.0.mlp.extra.weight")
    # An unknown rope type.
    def rope(c):
        c["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    refused(strata, edit_config(model, os.path.join(tmp, "rope"), rope), "rope_scaling", "yarn")
    if family == "qwen2":
        # A missing bias.
        def drop_bias(header, blobs):
            del header["model.layers.1.self_attn.k_proj.bias"]
        refused(strata, rewrite_tensors(model, os.path.join(tmp, "nobias"), drop_bias),
                "model.layers.1.self_attn.k_proj.bias")
        # Relabelled llama: the q/k/v biases are not read by a llama without attention_bias.
        def relabel(c):
            c["model_type"], c["architectures"] = "llama", ["LlamaForCausalLM"]
        refused(strata, edit_config(model, os.path.join(tmp, "as_llama"), relabel),
                "_proj.bias", "not read by a llama model")
        # Half relabelled: model_type and architectures disagree.
        def half(c):
            c["model_type"] = "llama"
        refused(strata, edit_config(model, os.path.join(tmp, "half"), half), "Qwen2ForCausalLM")
    if family in MOE_EXPERT:
        # A missing expert, an expert beyond the config's count, and a router of the wrong shape.
        last = MOE_EXPERT[family].format(j=7, part=MOE_DOWN[family])
        def drop_expert(header, blobs):
            del header[last]
        refused(strata, rewrite_tensors(model, os.path.join(tmp, "noexpert"), drop_expert), last,
                "missing")
        def fewer(c):
            c[MOE_COUNT[family]] = 7
        refused(strata, edit_config(model, os.path.join(tmp, "fewer"), fewer), "experts.7.",
                "not read")
        def top_k(c):
            c["num_experts_per_tok"] = c[MOE_COUNT[family]] + 1
        refused(strata, edit_config(model, os.path.join(tmp, "topk"), top_k), "num_experts_per_tok")


def main():
    if len(sys.argv) != 4:
        fail("usage: test_family.py STRATA FAMILY CASE")
    strata, family, case = sys.argv[1:4]
    if family not in FAMILIES:
        fail(f"unknown family {family} (make_model.py has {', '.join(FAMILIES)})")
    tmp = tempfile.mkdtemp(prefix=f"strata-{family}-")
    try:
        if case == "single":
            case_engine(strata, family, tmp, [])
        elif case == "disk":
            disk = os.path.join(tmp, "disk")
            os.mkdir(disk)
            options = ["--policy", "w=0/0/100,c=0/0/100", "--disk-dir", disk]
            case_engine(strata, family, tmp, options)
            check_read_from_disk(strata, family, tmp, options)
        elif case == "q4":
            case_q4(strata, family, tmp)
        elif case == "experts":  # MoE: one expert per layer in host memory, the rest on disk
            disk = os.path.join(tmp, "disk")
            os.mkdir(disk)
            options = ["--resident-experts", "1", "--expert-cache", "2", "--disk-dir", disk]
            case_engine(strata, family, tmp, options)
            check_experts_from_disk(strata, family, tmp, options, 1)
        elif case == "cluster":
            case_cluster(strata, family, tmp)
        elif case == "refuse":
            case_refuse(strata, family, tmp)
        else:
            fail(f"unknown case {case}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
