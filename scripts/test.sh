#!/usr/bin/env bash
# Sets up this machine (Debian packages), builds Strata and runs the test suite.
#   scripts/test.sh              Release build in build/, all tests (GPU tests skip without a GPU)
#   scripts/test.sh --sanitize   ASan + UBSan build in build-asan/
#   scripts/test.sh --tsan       ThreadSanitizer build in build-tsan/ (no CUDA; OpenMP serial)
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=build
# Tests on explicitly: the build folder is shared with launch/quickstart.sh, and a cached
# option must not decide what this command runs.
CMAKE_ARGS=(-DCMAKE_BUILD_TYPE=Release -DSTRATA_WERROR=ON -DSTRATA_BUILD_TESTS=ON)
if [ "${1:-}" = "--sanitize" ]; then
  BUILD_DIR=build-asan
  CMAKE_ARGS=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTRATA_SANITIZE=ON -DSTRATA_WERROR=ON
    -DSTRATA_BUILD_TESTS=ON)
  # OpenMP's runtime keeps thread-local state that LeakSanitizer reports at exit.
  export ASAN_OPTIONS=detect_leaks=0
elif [ "${1:-}" = "--tsan" ]; then
  BUILD_DIR=build-tsan
  # No CUDA: nvcc's objects would not be instrumented, and the build takes half as long.
  CMAKE_ARGS=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTRATA_TSAN=ON -DSTRATA_ENABLE_CUDA=OFF
    -DSTRATA_WERROR=ON -DSTRATA_BUILD_TESTS=ON)
  export TSAN_OPTIONS="second_deadlock_stack=1 suppressions=$PWD/tests/support/tsan.supp"
fi

bash scripts/install-deps.sh
cmake -S . -B "$BUILD_DIR" -G Ninja "${CMAKE_ARGS[@]}"
cmake --build "$BUILD_DIR" -j "$(nproc)"
# --no-tests=error: a run that found no test is a failure, not a success.
ctest --test-dir "$BUILD_DIR" --output-on-failure --no-tests=error -j "$(nproc)" --timeout 600
