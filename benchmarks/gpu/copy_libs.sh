#!/usr/bin/env bash
# Copies into LIB_DIR every shared library the given binaries load (as the
# loader resolves them here) that the GPU machine's image lacks: all but the
# base system's (glibc, libstdc++) and CUDA's (cuBLAS/cuBLASLt, NCCL and the
# runtime come from that machine's own toolkit or torch wheels: far too large
# to carry). Used by make_bundle.sh and stage_ext.sh.
#   usage: copy_libs.sh LIB_DIR BINARY...
set -euo pipefail
lib=${1:?usage: copy_libs.sh LIB_DIR BINARY...}
shift
mkdir -p "$lib"
skip='^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|librt\.|libpthread\.|libstdc\+\+|libgcc_s|libcuda\.|libcublas|libcublasLt|libnccl|libcudart)'
for b in "$@"; do
  ldd "$b" | awk '/=>/ {print $1, $3}' | while read -r name file; do
    [[ $name =~ $skip ]] && continue
    [[ -f $file ]] || { echo "copy_libs: $name not found here (needed by $(basename "$b"))" >&2; continue; }
    [[ -f $lib/$name ]] || cp -L "$file" "$lib/$name"
  done
done
