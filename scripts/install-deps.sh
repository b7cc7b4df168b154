#!/usr/bin/env bash
# Installs the Debian packages Strata builds, tests and runs with.
# Idempotent: packages already present are left alone; safe to run twice.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  libopenblas-openmp-dev
  libopenmpi-dev openmpi-bin
  libcapnp-dev capnproto
  libhiredis-dev redis-server
  libspdlog-dev libfmt-dev
  libgtest-dev libgmock-dev libbenchmark-dev  # tests/bench (kernel benchmarks)
  coinor-libclp-dev
  libsentencepiece-dev
  libpcre2-dev libutf8proc-dev  # tokenizer.json: pre-tokenizer regexes, Unicode normalisation
  python3-jinja2  # the chat-template reference (tests/worker/text)
  python3-numpy  # the model families' reference forward (tests/worker/families)
  nlohmann-json3-dev libcli11-dev
  liburing-dev libnuma-dev
  python3 python3-redis python3-matplotlib jq iproute2 util-linux clang-format
  slurm-wlm munge  # the Slurm test (tests/launch/test_slurm.py)
  clang libclang-rt-14-dev  # the libFuzzer harnesses (scripts/fuzz.sh)
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ "${#missing[@]}" -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
else
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  echo "install-deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# node and npm: Hugging Face's tokenizers (the text tests' reference) run under node. Debian's
# nodejs and npm when neither is there; a node installed otherwise is used as it is.
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get install -y -q --no-install-recommends nodejs npm
fi
bash "$(dirname "$0")/fetch-references.sh"
