#!/usr/bin/env bash
# Used by the Dockerfile's build stage: copies the given binaries to OUT/bin
# and every shared library they load to OUT/lib, except those the runtime
# image provides itself (glibc, libstdc++/libgcc from its distribution) or the
# NVIDIA container toolkit injects at run time (the driver: libcuda,
# libnvidia-*). cuBLAS, cuBLASLt and NCCL are copied: NVIDIA's "base" CUDA
# image does not carry them. Usage: bundle-libs.sh OUT BINARY...
set -euo pipefail
out=${1:?usage: bundle-libs.sh OUT BINARY...}
shift
mkdir -p "$out/bin" "$out/lib"
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|librt\.so|libpthread\.so|libutil\.so|libresolv\.so|libstdc\+\+\.so|libgcc_s\.so|libcuda\.so|libnvidia-)'
for b in "$@"; do
  cp -L "$b" "$out/bin/"
  if ldd "$b" | grep -v -E 'libcuda\.so' | grep -q 'not found'; then
    ldd "$b" >&2
    echo "bundle-libs.sh: $b has unresolved libraries" >&2
    exit 1
  fi
  ldd "$b" | awk '/=>/ && $3 ~ /^\// {print $1, $3}' | while read -r name file; do
    [[ $name =~ $skip ]] && continue
    [[ -f $out/lib/$name ]] || cp -L "$file" "$out/lib/$name"
  done
done
strip --strip-unneeded "$out"/bin/* 2>/dev/null || true
ls -l "$out/bin" "$out/lib" >&2
du -sh "$out" >&2
