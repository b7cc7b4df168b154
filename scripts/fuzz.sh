#!/usr/bin/env bash
# Builds the libFuzzer harnesses of tests/fuzz (clang, ASan + UBSan) in their own
# configuration and runs each for SECONDS on its seed corpus (tests/fuzz/corpus/NAME).
# Exits non-zero on any finding; the input that caused it is kept under BUILD_DIR/findings.
#   scripts/fuzz.sh [SECONDS [BUILD_DIR [NAME...]]]    defaults: 30, build-fuzz, every harness
# A harness is one line in tests/fuzz/CMakeLists.txt (strata_fuzzer(NAME)), a fuzz_NAME.cpp
# and a corpus/NAME/ folder; this script needs no change to run it.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=${1:-30}
BUILD=${2:-build-fuzz}
shift $(($# < 2 ? $# : 2))
ONLY=("$@")

probe=$(mktemp)
trap 'rm -f "$probe"' EXIT
if ! command -v clang++ >/dev/null ||
  ! echo 'extern "C" int LLVMFuzzerTestOneInput(const char*, unsigned long) { return 0; }' |
  clang++ -x c++ -fsanitize=fuzzer - -o "$probe" 2>/dev/null; then
  echo "fuzz: clang++ with libFuzzer not found (scripts/install-deps.sh installs it); skipping" >&2
  exit 77
fi
# Fresh machines (CI) build from nothing: -j the cores, Release-like code with debug info.
cmake -S . -B "$BUILD" -G Ninja -DSTRATA_FUZZ=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ >/dev/null
cmake --build "$BUILD" -j "$(nproc)" >/dev/null

status=0
while read -r name dict; do
  [ -n "$name" ] || continue
  if [ ${#ONLY[@]} -gt 0 ] && [[ ! " ${ONLY[*]} " =~ " $name " ]]; then continue; fi
  work="$BUILD/corpus/$name"  # grows as the fuzzer finds new paths; the repo's seeds stay put
  findings="$BUILD/findings"
  mkdir -p "$work" "$findings"
  args=(-max_total_time="$SECONDS_EACH" -timeout=10 -rss_limit_mb=2048 -max_len=65536
        -print_final_stats=1 -artifact_prefix="$findings/$name-")
  [ -n "${dict:-}" ] && args+=(-dict="$dict")
  echo "fuzz: $name for ${SECONDS_EACH}s"
  log="$BUILD/fuzz-$name.log"
  # UBSan reports abort (no recovery); leaks inside sentencepiece's globals are not ours.
  if ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    "$BUILD/tests/fuzz/fuzz_$name" "${args[@]}" "$work" "tests/fuzz/corpus/$name" >"$log" 2>&1; then
    grep -E "^stat::(number_of_executed_units|average_exec_per_sec|new_units_added)|cov: .*ft:" "$log" |
      tail -4 | sed "s/^/fuzz: $name: /"
  else
    echo "fuzz: $name: FINDING (log: $log; inputs: $findings/$name-*)" >&2
    tail -40 "$log" >&2
    status=1
  fi
done <"$BUILD/fuzzers.txt"
exit $status
