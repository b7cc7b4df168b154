#!/usr/bin/env bash
# Packs what a lent GPU machine needs to run the `gpu` tests and the GPU benchmarks
# (docs/GPU.md, "A session on a lent GPU"): the binaries of a build made here for sm_90 and
# x86-64-v3, the shared libraries they load that such a machine lacks (not glibc, libstdc++,
# CUDA's own: it has newer ones; not NCCL: it has PyTorch's), stories260K, the scripts and
# FlexGen's anchor. The device tool carries only the checkout and 64 MiB, so the result is
# one compressed archive in an ignored folder.
#   scripts/gpu-bundle.sh BUILD_DIR OUT_DIR [SHARED_DIR]
set -euo pipefail
BUILD=$1
OUT=$2
SHARED=${3:-$(dirname "$0")/../../shared}
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/bin" "$STAGE/lib" "$STAGE/model" "$OUT"

bins=("$BUILD/launch/strata")
while IFS= read -r t; do bins+=("$t"); done < <(find "$BUILD/tests" -type f -perm -u+x \
  \( -name 'test_*_cuda' -o -name test_cuda_backend -o -name test_backend_ops \))
for b in "${bins[@]}"; do
  strip -o "$STAGE/bin/$(basename "$b")" "$b"
done

# Libraries the GPU machine's image has (newer) or must not take from here.
skip='^(linux-vdso|ld-linux|libc\.|libm\.|libpthread|libdl\.|librt\.|libstdc\+\+|libgcc_s|libcuda\.|libcublas|libcudart|libnccl)'
for b in "$STAGE"/bin/*; do
  ldd "$b" | awk '$3 ~ /^\// {print $1, $3}'
done | sort -u | while read -r name path; do
  if ! [[ $name =~ $skip ]]; then cp -L "$path" "$STAGE/lib/$name"; fi
done

cp -r "$SHARED/models/stories260K" "$STAGE/model/"
cp -r "$SHARED/anchors/flexgen" "$STAGE/flexgen"
chmod -R u+w "$STAGE"
tar -C "$STAGE" -czf "$OUT/bundle.tgz" .
du -h "$OUT/bundle.tgz"
