#!/usr/bin/python3
"""Cross-check of the model families against llama.cpp, the independent reference.

For each family (default llama, mistral, qwen2, phi3, gemma2, mixtral, qwen2moe, olmoe): make a random-weight HF folder
(tests/worker/families/make_model.py, fixed seed), convert it to an f32 GGUF (hf_to_gguf.py),
evaluate a random prompt of ids in [3, vocab) with llama.cpp c392e5094 (llamacpp_eval.cpp,
KV cache f32, 2 threads) and with the NumPy forward (tests/worker/families/reference_forward.py),
and, when build/launch/strata exists, with `strata score` and `strata generate`. Prints one
JSON line per family: greedy ids equal?, max|dlogit| / std(logits) over every prompt position
(std of the NumPy logits), for llama.cpp vs NumPy, Strata vs NumPy and Strata vs llama.cpp.

llama.cpp comes from ../shared/anchors/llamacpp/llama.cpp-c392e5094.tar.xz, built on first use
into .refs/llamacpp/ (ignored; libllama + ggml only, Release, CPU, -j2, about 2 minutes on
2 cores); nothing of it is copied into the project.

Where llama.cpp c392e5094 lacks a feature the row says so in "notes" and is run where the
feature does not matter: it has no sliding window for the llama arch (Mistral) nor for phi3
(it never reads phi3's sliding_window from the GGUF) nor for qwen2, so for those the prompt
and generation are cut to fit in the window (an extra "<family>>window" row shows the full
length, where a disagreement is expected); it has no Qwen3 nor Qwen3-MoE (qwen3 and qwen3moe
are reported skipped).

The MoE families (mixtral: llama.cpp's llama arch with expert tensors; qwen2moe; olmoe) go
through the same comparison: llama.cpp's llm_build_moe_ffn routes as HF does (softmax over all
experts, top-k of the probabilities, weights renormalised for the llama arch only, matching
Mixtral's always and the test models' norm_topk_prob false for qwen2moe / olmoe).

  tests/anchors/llamacpp/check-families-llamacpp.py [--families llama,mistral,...] [--seed 0]
      [--prompt-len 40] [--new 32] [--work DIR] [--strata PATH] [--threads 2] [--keep]
  (--strata /nonexistent, or any path that is not an executable: llama.cpp vs NumPy only)
gemma2's GELU: ggml-cpu of this commit computes GELU through an fp16 table (ggml-cpu.c line 91,
#define GGML_GELU_FP16: input and output rounded to fp16), which alone puts llama.cpp 1.5e-3 to
1.6e-2 of std away from an f64 forward on the test models. So for gemma2 the script also builds
(once, ~20 s) a second ggml-cpu from the same tarball with only that #define removed (ggml's
own f32 ggml_gelu_f32 then), in .refs/llamacpp/exactgelu/, and runs llama.cpp with it too
(LD_LIBRARY_PATH): "llamacpp_exact_gelu_vs_numpy". That row is what gemma2 is judged by;
the stock row is reported beside it. --no-exact-gelu judges the stock one with --gemma2-tol.

Exit status 0 when every llama.cpp vs NumPy row has equal greedy ids and max|d|/std below
--tol (default 1e-3), 1 otherwise. Strata's rows never change the exit status.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
REFS = os.path.join(ROOT, ".refs", "llamacpp")
SRC = os.path.join(REFS, "llama.cpp")
LIBDIR = os.path.join(SRC, "build", "bin")
EVAL = os.path.join(REFS, "bin", "llamacpp_eval")
EXACT_SRC = os.path.join(REFS, "exactgelu", "llama.cpp")
EXACT_LIBDIR = os.path.join(EXACT_SRC, "build", "bin")
TARBALL_DIR = os.environ.get("STRATA_SHARED", os.path.join(os.path.dirname(ROOT), "shared"))
FAMILIES_DIR = os.path.join(ROOT, "tests", "worker", "families")
PY = "/usr/bin/python3"


def log(msg):
    print(f"check-families-llamacpp: {msg}", file=sys.stderr, flush=True)


def run(cmd, timeout=1800, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def ensure_llamacpp():
    if not os.path.exists(os.path.join(LIBDIR, "libllama.so")):
        tarball = os.path.join(TARBALL_DIR, "anchors", "llamacpp", "llama.cpp-c392e5094.tar.xz")
        os.makedirs(REFS, exist_ok=True)
        if not os.path.isdir(SRC):
            log(f"extracting {tarball}")
            subprocess.run(["tar", "-xJf", tarball, "-C", REFS], check=True)
        log("building libllama (Release, CPU, -j2; about 2 minutes)")
        t0 = time.time()
        with open(os.path.join(REFS, "configure.log"), "w") as f:
            subprocess.run(["cmake", "-S", SRC, "-B", os.path.join(SRC, "build"), "-DCMAKE_BUILD_TYPE=Release",
                            "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                            "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DGGML_CUDA=OFF",
                            "-DBUILD_SHARED_LIBS=ON"], check=True, stdout=f, stderr=subprocess.STDOUT)
        with open(os.path.join(REFS, "build.log"), "w") as f:
            subprocess.run(["cmake", "--build", os.path.join(SRC, "build"), "-j2", "--target", "llama"],
                           check=True, stdout=f, stderr=subprocess.STDOUT)
        log(f"built in {time.time() - t0:.0f} s")
    src = os.path.join(HERE, "llamacpp_eval.cpp")
    if not os.path.exists(EVAL) or os.path.getmtime(EVAL) < os.path.getmtime(src):
        os.makedirs(os.path.dirname(EVAL), exist_ok=True)
        subprocess.run(["g++", "-O2", "-std=c++17", "-I", os.path.join(SRC, "include"),
                        "-I", os.path.join(SRC, "ggml", "include"), src, "-o", EVAL, "-L", LIBDIR,
                        "-lllama", "-lggml", "-lggml-base", f"-Wl,-rpath,{LIBDIR}"], check=True)


def ensure_exact_gelu():
    """ggml-cpu with GGML_GELU_FP16 off (the one-line patch), for gemma2's diagnosis."""
    if os.path.exists(os.path.join(EXACT_LIBDIR, "libggml-cpu.so")):
        return EXACT_LIBDIR
    tarball = os.path.join(TARBALL_DIR, "anchors", "llamacpp", "llama.cpp-c392e5094.tar.xz")
    os.makedirs(os.path.dirname(EXACT_SRC), exist_ok=True)
    if not os.path.isdir(EXACT_SRC):
        subprocess.run(["tar", "-xJf", tarball, "-C", os.path.dirname(EXACT_SRC)], check=True)
    f = os.path.join(EXACT_SRC, "ggml", "src", "ggml-cpu", "ggml-cpu.c")
    text = open(f).read()
    if "\n#define GGML_GELU_FP16\n" in text:
        open(f, "w").write(text.replace("\n#define GGML_GELU_FP16\n",
                                        "\n// #define GGML_GELU_FP16  (off: exact GELU, diagnostic build)\n", 1))
    elif "// #define GGML_GELU_FP16" not in text:
        raise RuntimeError(f"{f}: no '#define GGML_GELU_FP16' line to turn off")
    log("building ggml-cpu with exact GELU (GGML_GELU_FP16 off) for gemma2")
    with open(os.path.join(REFS, "exactgelu", "build.log"), "w") as lf:
        subprocess.run(["cmake", "-S", EXACT_SRC, "-B", os.path.join(EXACT_SRC, "build"), "-DCMAKE_BUILD_TYPE=Release",
                        "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                        "-DLLAMA_BUILD_SERVER=OFF", "-DGGML_CUDA=OFF", "-DBUILD_SHARED_LIBS=ON"],
                       check=True, stdout=lf, stderr=subprocess.STDOUT)
        subprocess.run(["cmake", "--build", os.path.join(EXACT_SRC, "build"), "-j2", "--target", "ggml-cpu"],
                       check=True, stdout=lf, stderr=subprocess.STDOUT)
    return EXACT_LIBDIR


def read_f32(path, rows, vocab):
    a = np.fromfile(path, dtype="<f4")
    if a.size != rows * vocab:
        raise RuntimeError(f"{path}: {a.size} floats, expected {rows} x {vocab}")
    return a.reshape(rows, vocab)


def compare(a, b, ref_std):
    d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return {"max_abs": float(d.max()), "max_over_std": float(d.max() / ref_std),
            "argmax_equal_rows": int((a.argmax(1) == b.argmax(1)).sum())}


def greedy_cmp(a, b):
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))
    return {"equal": first is None, "first_diff": first}


def strata_help(strata, sub):
    r = run([strata, sub, "--help"], timeout=60)
    return r.stdout + r.stderr


def failure(r):
    """The exit status (a signal by name) and the last lines of what it printed."""
    rc = r.returncode
    what = f"exit status {rc}"
    if rc < 0 or rc > 128:
        try:
            import signal
            what += f" ({signal.Signals(-rc if rc < 0 else rc - 128).name})"
        except ValueError:
            pass
    tail = "\n".join((r.stderr.strip() or r.stdout.strip()).splitlines()[-6:])
    return f"{what}: {tail}"[-2000:]


def run_strata(strata, model, ids, n_new, threads, vocab, work):
    out = {}
    ids_s = " ".join(map(str, ids))
    lf = os.path.join(work, "strata-logits.f32")
    h = strata_help(strata, "score")
    cmd = [strata, "score", "--model", model, "--ids", ids_s, "--logits-out", lf]
    if "--threads" in h:
        cmd += ["--threads", str(threads)]
    r = run(cmd)
    if r.returncode != 0:
        out["score_error"] = failure(r)
    else:
        try:
            out["logits"] = read_f32(lf, len(ids), vocab)
        except RuntimeError as e:
            out["score_error"] = str(e)
    h = strata_help(strata, "generate")
    cmd = [strata, "generate", "--model", model, "--max-new-tokens", str(n_new), "--temperature", "0",
           "--format", "json"]
    # `strata generate` takes ids as --prompt for models without a tokenizer; --ids if it has one.
    cmd += ["--ids", ids_s] if re.search(r"(^|\s)--ids\b", h) else ["--prompt", ids_s]
    if "--threads" in h:
        cmd += ["--threads", str(threads)]
    if "--ignore-eos" in h:
        cmd += ["--ignore-eos"]
    r = run(cmd)
    if r.returncode != 0:
        out["generate_error"] = failure(r)
    else:
        try:
            line = [ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1]
            j = json.loads(line)
            out["greedy"] = j["output_ids"]
            out["stop_reason"] = j.get("stop_reason")
            if j.get("prompt_ids") is not None and list(j["prompt_ids"]) != list(ids):
                out["generate_error"] = f"strata read the prompt as {j['prompt_ids'][:8]}..., not the ids"
        except (IndexError, KeyError, ValueError) as e:
            out["generate_error"] = f"cannot parse strata generate output ({e}): {r.stdout[-500:]}"
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="llama,mistral,qwen2,phi3,gemma2,mixtral,qwen2moe,olmoe")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tol", type=float, default=1e-3, help="max|d|/std bound for llama.cpp vs NumPy")
    ap.add_argument("--no-exact-gelu", action="store_true",
                    help="gemma2: no exact-GELU ggml-cpu run; judge stock llama.cpp with --gemma2-tol")
    ap.add_argument("--gemma2-tol", type=float, default=5e-2,
                    help="max|d|/std bound for stock llama.cpp's gemma2 (fp16 GELU) with --no-exact-gelu")
    ap.add_argument("--work", help="keep models, GGUFs and logits here (default: a temporary folder)")
    ap.add_argument("--strata", default=os.path.join(ROOT, "build", "launch", "strata"))
    ap.add_argument("--no-phi3-long-row", action="store_true",
                    help="no extra phi3 row past original_max_position_embeddings (longrope's long factors)")
    ap.add_argument("--no-full-window-row", action="store_true",
                    help="no extra full-length row where llama.cpp lacks the family's sliding window")
    args = ap.parse_args()

    make_model = os.path.join(FAMILIES_DIR, "make_model.py")
    ref_fwd = os.path.join(FAMILIES_DIR, "reference_forward.py")
    for p in (make_model, ref_fwd):
        if not os.path.exists(p):
            sys.exit(f"check-families-llamacpp: {p} missing")
    ensure_llamacpp()
    work = args.work or tempfile.mkdtemp(prefix="families-llamacpp-")
    os.makedirs(work, exist_ok=True)
    strata = args.strata if os.access(args.strata, os.X_OK) else None
    if strata is None:
        log(f"no Strata binary at {args.strata}: llama.cpp vs NumPy only")
    ok = True
    try:
        for fam in args.families.split(","):
            fam = fam.strip()
            row = {"family": fam}
            notes = []
            fdir = os.path.join(work, fam)
            model = os.path.join(fdir, "hf")
            os.makedirs(fdir, exist_ok=True)
            r = run([PY, make_model, "--family", fam, "--out", model, "--seed", str(args.seed)])
            if r.returncode != 0:
                row["error"] = f"make_model: {r.stderr.strip()[-1500:]}"
                print(json.dumps(row), flush=True)
                ok = False
                continue
            cfg = json.load(open(os.path.join(model, "config.json")))
            vocab = cfg["vocab_size"]
            arch = (cfg.get("architectures") or ["?"])[0]
            row["architecture"] = arch
            if arch.startswith("Qwen3"):
                row["skipped"] = f"llama.cpp c392e5094 has no {arch[:-len('ForCausalLM')]} architecture"
                print(json.dumps(row), flush=True)
                continue
            gguf_path = os.path.join(fdir, "model-f32.gguf")
            r = run([PY, os.path.join(HERE, "hf_to_gguf.py"), "--model", model, "--out", gguf_path])
            if r.returncode != 0:
                row["error"] = f"hf_to_gguf: {r.stderr.strip()[-1500:]}"
                print(json.dumps(row), flush=True)
                ok = False
                continue
            notes += json.loads(r.stdout.strip().splitlines()[-1])["notes"]

            # Sliding windows llama.cpp c392e5094 does not apply: fit the whole run inside.
            sw = cfg.get("sliding_window")
            unsupported_sw = sw and (arch in ("MistralForCausalLM", "LlamaForCausalLM", "Phi3ForCausalLM",
                                              "MixtralForCausalLM")
                                     or (arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
                                         and cfg.get("use_sliding_window")))
            runs = [(args.prompt_len, args.new, fam)]
            if unsupported_sw and args.prompt_len + args.new > sw:
                n_new = min(args.new, max(1, sw // 2))
                n_prompt = min(args.prompt_len, sw - n_new)
                notes.append(f"llama.cpp c392e5094 ignores {arch}'s sliding_window={sw}: prompt {n_prompt} "
                             f"+ {n_new} new ids to stay inside it")
                runs = [(n_prompt, n_new, fam)]
                if not args.no_full_window_row:
                    runs.append((args.prompt_len, args.new, fam + ">window"))
            rs = cfg.get("rope_scaling") or {}
            orig = cfg.get("original_max_position_embeddings")
            if (arch == "Phi3ForCausalLM" and rs.get("type") in ("longrope", "su") and orig
                    and not args.no_phi3_long_row and orig + 20 <= cfg["max_position_embeddings"]):
                # Past original_max_position_embeddings HF takes the long factors for the whole
                # sequence; llama.cpp when n_ctx exceeds it, which it then does: comparable.
                runs.append((orig + 12, 8, fam + "-long"))
            for n_prompt, n_new, name in runs:
                rrow = dict(row, family=name, n_prompt=n_prompt, n_new=n_new, vocab=vocab, seed=args.seed)
                if name.endswith(">window"):
                    rnotes = [f"{n_prompt}+{n_new} > sliding_window={sw}, which llama.cpp ignores: a difference is expected"]
                elif name.endswith("-long"):
                    rnotes = notes + [f"prompt {n_prompt} > original_max_position_embeddings={orig}: longrope's long factors"]
                else:
                    rnotes = list(notes)
                rng = np.random.default_rng(args.seed)
                ids = [int(x) for x in rng.integers(3, vocab, size=n_prompt)]
                ids_s = " ".join(map(str, ids))
                tag = f"p{n_prompt}n{n_new}"
                ll_logits = os.path.join(fdir, f"llamacpp-{tag}.f32")
                t0 = time.time()
                r = run([EVAL, "--model", gguf_path, "--ids", ids_s, "--new", str(n_new),
                         "--logits-out", ll_logits, "--threads", str(args.threads)])
                rrow["llamacpp_s"] = round(time.time() - t0, 2)
                if r.returncode != 0:
                    rrow["error"] = f"llama.cpp: {r.stderr.strip()[-1500:]}"
                    rrow["notes"] = rnotes
                    print(json.dumps(rrow), flush=True)
                    ok = False
                    continue
                ll = json.loads(r.stdout.strip().splitlines()[-1])
                np_logits, np_json = os.path.join(fdir, f"numpy-{tag}.f32"), os.path.join(fdir, f"numpy-{tag}.json")
                t0 = time.time()
                r = run([PY, ref_fwd, "--model", model, "--ids", ids_s, "--new", str(n_new),
                         "--logits-out", np_logits, "--json-out", np_json])
                rrow["numpy_s"] = round(time.time() - t0, 2)
                if r.returncode != 0:
                    rrow["error"] = f"reference_forward: {r.stderr.strip()[-1500:]}"
                    rrow["notes"] = rnotes
                    print(json.dumps(rrow), flush=True)
                    ok = False
                    continue
                npj = json.load(open(np_json))
                L_ll = read_f32(ll_logits, n_prompt, vocab)
                L_np = read_f32(np_logits, n_prompt, vocab)
                std = float(L_np.astype(np.float64).std())
                rrow["std_logits"] = std
                rrow["llamacpp_vs_numpy"] = dict(greedy=greedy_cmp(ll["greedy"], npj["greedy"]), **compare(L_ll, L_np, std))
                judged, tol = rrow["llamacpp_vs_numpy"], args.tol
                if arch == "Gemma2ForCausalLM" and args.no_exact_gelu:
                    tol = args.gemma2_tol
                elif arch == "Gemma2ForCausalLM":
                    ex_logits = os.path.join(fdir, f"llamacpp-exactgelu-{tag}.f32")
                    r = run([EVAL, "--model", gguf_path, "--ids", ids_s, "--new", str(n_new),
                             "--logits-out", ex_logits, "--threads", str(args.threads)],
                            env=dict(os.environ, LD_LIBRARY_PATH=ensure_exact_gelu()))
                    if r.returncode != 0:
                        rrow["error"] = f"llama.cpp (exact GELU): {r.stderr.strip()[-1500:]}"
                        judged = {"greedy": {"equal": False}, "max_over_std": float("inf")}
                    else:
                        ex = json.loads(r.stdout.strip().splitlines()[-1])
                        judged = dict(greedy=greedy_cmp(ex["greedy"], npj["greedy"]),
                                      **compare(read_f32(ex_logits, n_prompt, vocab), L_np, std))
                        rrow["llamacpp_exact_gelu_vs_numpy"] = judged
                        rnotes.append("judged by llama.cpp with exact GELU (GGML_GELU_FP16 off); the stock "
                                      "llamacpp_vs_numpy row differs by ggml's fp16 GELU table")
                rrow["tol"] = tol
                good = judged["greedy"]["equal"] and judged["max_over_std"] < tol
                rrow["agree"] = bool(good)
                if not name.endswith(">window") and not good:
                    ok = False
                rrow["greedy_llamacpp"] = ll["greedy"]
                rrow["greedy_numpy"] = npj["greedy"]
                if strata:
                    s = run_strata(strata, model, ids, n_new, args.threads, vocab, fdir)
                    st = {}
                    if "logits" in s:
                        st["vs_numpy"] = compare(s["logits"], L_np, std)
                        st["vs_llamacpp"] = compare(s["logits"], L_ll, std)
                    if "greedy" in s:
                        n = len(s["greedy"])
                        # `strata generate` has no --ignore-eos: ended early (the config's
                        # eos_token_id came up), compare what it made.
                        st["stop_reason"] = s.get("stop_reason")
                        if n < n_new:
                            st["compared_prefix"] = n
                        st["greedy_vs_numpy"] = greedy_cmp(s["greedy"], npj["greedy"][:n] if n < n_new else npj["greedy"])
                        st["greedy_vs_llamacpp"] = greedy_cmp(s["greedy"], ll["greedy"][:n] if n < n_new else ll["greedy"])
                        st["greedy"] = s["greedy"]
                    for k in ("score_error", "generate_error"):
                        if k in s:
                            st[k] = s[k]
                            log(f"{name}: strata {k.split('_')[0]}: {s[k].splitlines()[0][:40]} ... {s[k].splitlines()[-1][:200]}")
                    rrow["strata"] = st
                rrow["notes"] = rnotes
                print(json.dumps(rrow), flush=True)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
