#!/usr/bin/env bash
# Strata against llama.cpp on the same weights, in one run (docs/BENCHMARKS.md, issue 14's
# anchor): the random-weight Llama of stories110M's shape that ../shared/anchors/llamacpp/
# setup.sh makes (GGUF f32 and Q4_0 for llama.cpp, safetensors for Strata), prompt 128,
# gen 64, batch 1 and 32 in f32, batch 1 in 4-bit (Strata's group-wise weights against
# llama.cpp's Q4_0), and batch 1 and 32 again with Strata's KV cache in f16 (policy cf16=1,
# the cache llama.cpp keeps by default; set against the same llama.cpp runs). Each engine
# runs each row in its own process, one after the other.
# Generation throughput is FlexGen's: generated tokens / (prefill + decode seconds).
#   scripts/bench-vs-llamacpp.sh [BUILD_DIR] [OUT_DIR] [ANCHOR_DIR]
# Writes OUT_DIR/vs-llamacpp.json and prints one line a row with the ratio.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
OUT=${2:-docs/bench}
ANCHOR=${3:-$HOME/.cache/strata-anchor}
SHARED=${STRATA_SHARED:-../shared}
THREADS=${THREADS:-$(nproc)}
PROMPT=128
GEN=64
mkdir -p "$OUT"
bash "$SHARED/anchors/llamacpp/setup.sh" "$ANCHOR" >&2
LLAMA=$ANCHOR/llama.cpp/build/bin/llama-batched-bench
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# llama.cpp at its defaults (f16 KV cache, no flash attention), a context just large enough.
llama_row() {  # NAME GGUF BATCH
  local ctx=$(( ($3 * (PROMPT + GEN) + 255) / 256 * 256 ))
  "$LLAMA" -m "$2" -c "$ctx" -npp "$PROMPT" -ntg "$GEN" -npl "$3" -t "$THREADS" -tb "$THREADS" \
    --output-format jsonl 2>"$tmp/$1-llama.log" | grep '^{' | tail -1 >"$tmp/$1-llama.json"
  [ -s "$tmp/$1-llama.json" ] || { cat "$tmp/$1-llama.log" >&2; echo "llama.cpp row $1 failed" >&2; exit 1; }
}

strata_row() {  # NAME BATCH [strata bench options...]
  local name=$1 batch=$2
  shift 2
  "$BUILD/launch/strata" bench --model "$ANCHOR/hf-llama110m" --prompt-len "$PROMPT" --gen-len "$GEN" \
    --batch "$batch" --threads "$THREADS" --max-step-tokens 4096 "$@" >"$tmp/$name-strata.json" \
    2>"$tmp/$name-strata.log" || { cat "$tmp/$name-strata.log" >&2; exit 1; }
}

llama_row f32-b1 "$ANCHOR/llama110m-f32.gguf" 1
strata_row f32-b1 1
llama_row f32-b32 "$ANCHOR/llama110m-f32.gguf" 32
strata_row f32-b32 32
llama_row q4-b1 "$ANCHOR/llama110m-q4_0.gguf" 1
strata_row q4-b1 1 --policy w=0/100/0,c=0/100/0,cw=1
strata_row kv16-b1 1 --policy cf16=1
strata_row kv16-b32 32 --policy cf16=1

python3 - "$tmp" "$OUT/vs-llamacpp.json" "$THREADS" <<'PY'
import json, os, sys
tmp, out, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = []
# Strata's row and the llama.cpp run it is set against.
for name, anchor in [("f32-b1", "f32-b1"), ("f32-b32", "f32-b32"), ("q4-b1", "q4-b1"),
                     ("kv16-b1", "f32-b1"), ("kv16-b32", "f32-b32")]:
    ll = json.loads(open(os.path.join(tmp, f"{anchor}-llama.json")).read())
    st = json.load(open(os.path.join(tmp, f"{name}-strata.json")))
    # llama-batched-bench: t = prefill + decode seconds of pl sequences of tg tokens each.
    llama_gen = ll["pl"] * ll["tg"] / ll["t"]
    strata_gen = st["result"]["generation_tokens_per_s"]
    row = {"row": name, "llamacpp_row": anchor, "batch": ll["pl"], "threads": threads,
           "llamacpp": {"generation_tokens_per_s": llama_gen, "prefill_tokens_per_s": ll["speed_pp"],
                        "decode_tokens_per_s": ll["speed_tg"], "raw": ll},
           "strata": {"generation_tokens_per_s": strata_gen,
                      "decode_tokens_per_s": st["result"]["decode_tokens_per_s"],
                      "decode_fraction_of_read_bound": st.get("decode_fraction_of_read_bound"),
                      "decode_read_bound_paired": st.get("decode_read_bound_paired"),
                      "raw": st},
           "ratio_strata_over_llamacpp": strata_gen / llama_gen}
    rows.append(row)
    bound = row["strata"]["decode_fraction_of_read_bound"]
    paired = row["strata"]["decode_read_bound_paired"] or {}
    print(f"{name:>8}: strata {strata_gen:7.1f} tok/s, llama.cpp {llama_gen:7.1f} tok/s: "
          f"{strata_gen / llama_gen:.2f}x" +
          (f" (strata decode at {bound:.0%} of the read bound; paired with the read stream, "
           f"median {paired['median_fraction']:.0%}, quartiles {paired['p25_fraction']:.0%}-"
           f"{paired['p75_fraction']:.0%}; weights only {paired['weights_only']['median_fraction']:.0%})"
           if bound and paired else ""))
json.dump({"machine": os.uname().nodename, "prompt": 128, "gen": 64, "rows": rows}, open(out, "w"), indent=1)
print(f"wrote {out}")
PY
