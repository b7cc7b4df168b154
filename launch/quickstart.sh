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
./build/launch/strata generate --model "$MODEL" \
  --prompt "Once upon a time" --prompt "Lily wanted to" --prompt "The little dog" \
  --max-new-tokens 64 --format json "$@"
