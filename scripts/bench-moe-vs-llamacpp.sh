#!/usr/bin/env bash
# Strata against llama.cpp on the same random weights of a Mixtral-shaped MoE model, in one
# run (the MoE counterpart of scripts/bench-vs-llamacpp.sh): "mixtral-mini" (hidden 1024,
# 8 layers, 16/4 heads, 8 experts top-2 of 3584, vocab 32000; scripts/make-moe-bench-model.py
# writes it once into ANCHOR_DIR as HF safetensors for Strata and as a llama-arch GGUF with
# stacked experts for llama.cpp), f32 weights, prompt 128, gen 64:
#   llama.cpp (llama-batched-bench) at batch 1 and 32 with its default KV cache (f16) and
#     again with -ctk f32 -ctv f32;
#   Strata at batch 1 and 32 (f32 cache), and batch 32 with policy cf16=1 (an f16 cache, as
#     llama.cpp's default);
#   Strata at batch 1 and 32 with every expert on disk (--resident-experts 0 --disk-dir
#     DISK_DIR --expert-cache 4; DISK_DIR must be a real disk, not tmpfs): the experts' read
#     rate against the O_DIRECT bound of the same disk (strata bench's expert_stream). The
#     disk rows generate DISK_GEN_B1 / DISK_GEN_B32 tokens (default 32 / 16: at about
#     0.5 GB/s a batch-32 step reads nearly all 64 experts, 2.8 GB), and skip the host-limit
#     probes (--no-limits), which are about memory, not disk.
# Before the rows, a conversion check: a tiny copy (2 layers, hidden 64) through both engines,
# greedy, 16 tokens from the same token ids; the ids must be equal or the script stops.
# Generation throughput is FlexGen's: generated tokens / (prefill + decode seconds).
# The Strata binary is copied first, so a rebuild during the run does not change it.
#   scripts/bench-moe-vs-llamacpp.sh [STRATA_BIN] [OUT_DIR] [ANCHOR_DIR]
#   (defaults: build/launch/strata, docs/bench, ~/.cache/strata-anchor; env: THREADS,
#   DISK_DIR (default /var/tmp/strata-moe-disk), DISK_GEN_B1, DISK_GEN_B32, STRATA_SHARED;
#   PROMPT, GEN and SHAPE=tiny only to try the script itself quickly)
# Writes OUT_DIR/moe-vs-llamacpp.json and prints one line a row.
set -euo pipefail
cd "$(dirname "$0")/.."
STRATA_SRC=${1:-build/launch/strata}
OUT=${2:-docs/bench}
ANCHOR=${3:-$HOME/.cache/strata-anchor}
SHARED=${STRATA_SHARED:-../shared}
THREADS=${THREADS:-$(nproc)}
DISK_DIR=${DISK_DIR:-/var/tmp/strata-moe-disk}
DISK_GEN_B1=${DISK_GEN_B1:-32}
DISK_GEN_B32=${DISK_GEN_B32:-16}
PROMPT=${PROMPT:-128}
GEN=${GEN:-64}
SHAPE=${SHAPE:-mixtral-mini}  # tiny: a quick run of the script itself, not a benchmark
PY=/usr/bin/python3
mkdir -p "$OUT" "$DISK_DIR"
if [ "$(df --output=fstype "$DISK_DIR" | tail -1)" = tmpfs ]; then
  echo "DISK_DIR $DISK_DIR is on tmpfs: the disk rows need a real disk" >&2
  exit 2
fi
bash "$SHARED/anchors/llamacpp/setup.sh" "$ANCHOR" >&2
L=$ANCHOR/llama.cpp
LLAMA=$L/build/bin/llama-batched-bench
tmp=$(mktemp -d)
trap 'rm -rf "$tmp" "$DISK_DIR"/strata-moe-bench.*' EXIT
STRATA=$tmp/strata
cp "$STRATA_SRC" "$STRATA"

# The model, once (3.2 GB per copy).
MODEL_ARGS=(--gguf-py "$L/gguf-py" --tokenizer "$SHARED/anchors/llamacpp/tokenizer.model")
"$PY" scripts/make-moe-bench-model.py "$ANCHOR" --shape "$SHAPE" "${MODEL_ARGS[@]}" >&2
HF=$ANCHOR/hf-$SHAPE
GGUF=$ANCHOR/$SHAPE-f32.gguf

# Conversion check: greedy ids of a tiny copy, llama.cpp (a 30-line program on libllama, f32
# KV cache) against strata generate (no tokenizer in its folder, so the prompt is ids).
CHECK=$ANCHOR/moe-check
mkdir -p "$CHECK"
"$PY" scripts/make-moe-bench-model.py "$CHECK" --shape tiny --no-hf-tokenizer "${MODEL_ARGS[@]}" >&2
if [ ! -x "$CHECK/greedy" ]; then
  cat >"$CHECK/greedy.cpp" <<'CPP'
// greedy MODEL N_NEW ID...: llama.cpp's greedy ids for a prompt of token ids, as a JSON list.
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "llama.h"
int main(int argc, char** argv) {
  if (argc < 4) { std::fprintf(stderr, "usage: greedy MODEL N_NEW ID...\n"); return 2; }
  llama_backend_init();
  llama_model* model = llama_model_load_from_file(argv[1], llama_model_default_params());
  if (!model) return 1;
  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = 512; cp.n_batch = 512; cp.n_threads = cp.n_threads_batch = 2;
  cp.type_k = GGML_TYPE_F32; cp.type_v = GGML_TYPE_F32;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (!ctx) return 1;
  const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
  std::vector<llama_token> toks;
  for (int i = 3; i < argc; ++i) toks.push_back(std::atoi(argv[i]));
  std::printf("[");
  for (int n = 0, n_new = std::atoi(argv[2]); n < n_new; ++n) {
    if (llama_decode(ctx, llama_batch_get_one(toks.data(), (int)toks.size()))) return 1;
    const float* logits = llama_get_logits_ith(ctx, -1);
    llama_token best = 0;
    for (int v = 1; v < n_vocab; ++v) if (logits[v] > logits[best]) best = v;
    std::printf(n ? ", %d" : "%d", best);
    toks.assign(1, best);
  }
  std::printf("]\n");
  llama_free(ctx);
  llama_model_free(model);
  return 0;
}
CPP
  g++ -O1 -std=c++17 -I"$L/include" -I"$L/ggml/include" "$CHECK/greedy.cpp" -o "$CHECK/greedy" \
    -L"$L/build/bin" -lllama -lggml -lggml-base -Wl,-rpath,"$L/build/bin"
fi
CHECK_IDS="1 450 4996 17354 1701 29916 432 17204 975 278 17366 11203"
"$CHECK/greedy" "$CHECK/tiny-f32.gguf" 16 $CHECK_IDS 2>"$tmp/check-llama.log" >"$tmp/check-llama.json" \
  || { cat "$tmp/check-llama.log" >&2; exit 1; }
"$STRATA" generate --model "$CHECK/hf-tiny" --prompt "$CHECK_IDS" --max-new-tokens 16 --temperature 0 \
  --threads "$THREADS" --format json 2>"$tmp/check-strata.log" | grep '"output_ids"' >"$tmp/check-strata.json" \
  || { cat "$tmp/check-strata.log" >&2; exit 1; }
"$PY" - "$tmp" <<'PY'
import json, sys
tmp = sys.argv[1]
ll = json.load(open(f"{tmp}/check-llama.json"))
st = json.loads(open(f"{tmp}/check-strata.json").read())["output_ids"]
json.dump({"llamacpp_ids": ll, "strata_ids": st, "match": ll == st}, open(f"{tmp}/check.json", "w"))
print(f"conversion check: llama.cpp {ll}\n                  strata    {st}: " +
      ("equal" if ll == st else "DIFFERENT"))
sys.exit(0 if ll == st else 1)
PY

# llama.cpp, a context just large enough (each row in its own process).
llama_row() {  # NAME BATCH [llama-batched-bench options...]
  local name=$1 batch=$2
  shift 2
  local ctx=$(( (batch * (PROMPT + GEN) + 255) / 256 * 256 ))
  "$LLAMA" -m "$GGUF" -c "$ctx" -npp "$PROMPT" -ntg "$GEN" -npl "$batch" -t "$THREADS" -tb "$THREADS" \
    "$@" --output-format jsonl 2>"$tmp/$name-llama.log" | grep '^{' | tail -1 >"$tmp/$name-llama.json"
  [ -s "$tmp/$name-llama.json" ] || { cat "$tmp/$name-llama.log" >&2; echo "llama.cpp row $name failed" >&2; exit 1; }
  echo "llama.cpp $name done" >&2
}

strata_row() {  # NAME BATCH GEN [strata bench options...]
  local name=$1 batch=$2 gen=$3
  shift 3
  "$STRATA" bench --model "$HF" --prompt-len "$PROMPT" --gen-len "$gen" --batch "$batch" \
    --threads "$THREADS" --max-step-tokens 4096 "$@" >"$tmp/$name-strata.json" \
    2>"$tmp/$name-strata.log" || { cat "$tmp/$name-strata.log" >&2; exit 1; }
  echo "strata $name done" >&2
}

disk_row() {  # NAME BATCH GEN
  local d
  d=$(mktemp -d "$DISK_DIR/strata-moe-bench.XXXXXX")
  strata_row "$1" "$2" "$3" --resident-experts 0 --disk-dir "$d" --expert-cache 4 --no-limits
  rm -rf "$d"
}

llama_row f32-b1 1
llama_row f32-b32 32
llama_row kvf32-b1 1 -ctk f32 -ctv f32
llama_row kvf32-b32 32 -ctk f32 -ctv f32
strata_row f32-b1 1 "$GEN"
strata_row f32-b32 32 "$GEN"
strata_row kv16-b32 32 "$GEN" --policy cf16=1
disk_row disk-b1 1 "$DISK_GEN_B1"
disk_row disk-b32 32 "$DISK_GEN_B32"

"$PY" - "$tmp" "$OUT/moe-vs-llamacpp.json" "$THREADS" "$PROMPT" "$GEN" "$HF" "$STRATA_SRC" "$DISK_DIR" <<'PY'
import hashlib, json, os, subprocess, sys
tmp, out, threads, prompt, gen, hf, strata_src, disk_dir = sys.argv[1:]
threads, prompt, gen = int(threads), int(prompt), int(gen)

def load(name, engine):
    text = open(os.path.join(tmp, f"{name}-{engine}.json")).read()
    return json.loads(text)

llama = {}
for name, kv in [("f32-b1", "f16 (default)"), ("f32-b32", "f16 (default)"),
                 ("kvf32-b1", "f32"), ("kvf32-b32", "f32")]:
    ll = load(name, "llama")
    # llama-batched-bench: t = prefill + decode seconds of pl sequences of tg tokens each.
    llama[name] = {"row": name, "batch": ll["pl"], "kv_cache": kv,
                   "generation_tokens_per_s": ll["pl"] * ll["tg"] / ll["t"],
                   "prefill_tokens_per_s": ll["speed_pp"], "decode_tokens_per_s": ll["speed_tg"],
                   "raw": ll}
    print(f"llama.cpp {name:>9}: {llama[name]['generation_tokens_per_s']:7.2f} tok/s "
          f"(batch {ll['pl']}, KV {kv})")

def strata(name):
    st = load(name, "strata")
    r = st["result"]
    return st, {"generation_tokens_per_s": r["generation_tokens_per_s"],
                "decode_tokens_per_s": r["decode_tokens_per_s"],
                "gen": st["gen_len"], "batch": st["batch"]}

rows = []
# Strata's row, the llama.cpp run it is set against (llama.cpp's default, as in
# vs-llamacpp.json) and the one with the same KV cache type.
for name, anchor, same_kv in [("f32-b1", "f32-b1", "kvf32-b1"), ("f32-b32", "f32-b32", "kvf32-b32"),
                              ("kv16-b32", "f32-b32", "f32-b32")]:
    st, s = strata(name)
    a, k = llama[anchor], llama[same_kv]
    row = {"row": name, "batch": s["batch"], "threads": threads,
           "kv_cache": "f16" if name.startswith("kv16") else "f32",
           "llamacpp_row": anchor, "llamacpp_same_kv_row": same_kv,
           "strata": {**s, "decode_fraction_of_read_bound": st.get("decode_fraction_of_read_bound"),
                      "peak_rss_bytes": st.get("peak_rss_bytes"), "raw": st},
           "llamacpp_generation_tokens_per_s": a["generation_tokens_per_s"],
           "ratio_strata_over_llamacpp": s["generation_tokens_per_s"] / a["generation_tokens_per_s"],
           "ratio_strata_over_llamacpp_same_kv": s["generation_tokens_per_s"] / k["generation_tokens_per_s"]}
    rows.append(row)
    print(f"strata    {name:>9}: {s['generation_tokens_per_s']:7.2f} tok/s: "
          f"{row['ratio_strata_over_llamacpp']:.2f}x llama.cpp {anchor}, "
          f"{row['ratio_strata_over_llamacpp_same_kv']:.2f}x {same_kv} (same KV type)")

disk = []
for name, resident in [("disk-b1", "f32-b1"), ("disk-b32", "f32-b32")]:
    st, s = strata(name)
    xs = st.get("expert_stream", {})
    res = next(r for r in rows if r["row"] == resident)
    disk.append({"row": name, "batch": s["batch"], "gen": s["gen"], "threads": threads,
                 "options": "--resident-experts 0 --expert-cache 4 --no-limits",
                 "strata": {**s, "peak_rss_bytes": st.get("peak_rss_bytes"), "raw": st},
                 "expert_stream": xs,
                 "fraction_of_resident": s["generation_tokens_per_s"] /
                                         res["strata"]["generation_tokens_per_s"]})
    print(f"strata    {name:>9}: {s['generation_tokens_per_s']:7.2f} tok/s (gen {s['gen']}): experts read "
          f"at {xs.get('read_gbs', 0):.2f} GB/s, O_DIRECT bound {xs.get('o_direct_bound_gbs', 0):.2f} GB/s "
          f"({xs.get('fraction_of_bound', 0):.0%}); {xs.get('reads')} reads, {xs.get('cache_hits')} hits "
          f"of {xs.get('requested')}")

cfg = json.load(open(os.path.join(hf, "config.json")))
def lscpu(field):
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith(field + ":"):
            return line.split(":", 1)[1].strip()
    return None
df = subprocess.run(["df", "-T", disk_dir], capture_output=True, text=True).stdout.splitlines()[-1].split()
by = {r["row"]: r for r in rows}
result = {
    "machine": os.uname().nodename, "cpu": lscpu("Model name"), "cores": os.cpu_count(),
    "threads": threads, "prompt": prompt, "gen": gen,
    "model": {"name": os.path.basename(hf)[len("hf-"):], "weights": "f32, random (scripts/make-moe-bench-model.py --seed 0)",
              **{k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                     "num_key_value_heads", "num_local_experts", "num_experts_per_tok",
                                     "intermediate_size", "vocab_size")},
              "safetensors_bytes": os.path.getsize(os.path.join(hf, "model.safetensors"))},
    "strata_binary": {"path": strata_src,
                      "sha256": hashlib.sha256(open(os.path.join(tmp, "strata"), "rb").read()).hexdigest()},
    "llamacpp": {"commit": "c392e5094", "tool": "llama-batched-bench"},
    "disk_dir": {"path": disk_dir, "device": df[0], "fstype": df[1]},
    "conversion_check": json.load(open(os.path.join(tmp, "check.json"))),
    "ratios": {"b1": by["f32-b1"]["ratio_strata_over_llamacpp"],
               "b32": by["f32-b32"]["ratio_strata_over_llamacpp"],
               "b32_kv16": by["kv16-b32"]["ratio_strata_over_llamacpp"],
               "b1_same_kv": by["f32-b1"]["ratio_strata_over_llamacpp_same_kv"],
               "b32_same_kv": by["f32-b32"]["ratio_strata_over_llamacpp_same_kv"]},
    "llamacpp_rows": list(llama.values()),
    "rows": rows,
    "disk_rows": disk,
}
json.dump(result, open(out, "w"), indent=1)
print(f"wrote {out}")
PY
