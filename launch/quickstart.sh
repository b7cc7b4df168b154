#!/usr/bin/env bash
# One command on a fresh Debian 12 machine: install what Strata needs, build it, and run
# the main job on the bundled model (stories260K, no GPU needed).
#   launch/quickstart.sh [extra `strata generate` options]
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${STRATA_MODEL:-../shared/models/stories260K}

bash scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DSTRATA_BUILD_TESTS=OFF >/dev/null
cmake --build build -j "$(nproc)" --target strata
# The main job: a local 3-rank cluster (rank 0 coordinates, two pipeline stages) over the
# bundled model, fed from a JSONL request file; results go to stdout as JSONL.
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cat >"$WORK/requests.jsonl" <<'JSON'
{"id": "1", "prompt": "Once upon a time", "max_new_tokens": 64}
{"id": "2", "prompt": "Lily wanted to", "max_new_tokens": 48}
{"id": "3", "prompt": "The little dog", "max_new_tokens": 32, "temperature": 0.8, "top_p": 0.95, "seed": 7}
JSON
bash launch/local-cluster.sh "${STRATA_RANKS:-3}" --model "$MODEL" --requests "$WORK/requests.jsonl" \
  --results "$WORK/results.jsonl" --micro-batches 2 --threads 1 "$@"
cat "$WORK/results.jsonl"
