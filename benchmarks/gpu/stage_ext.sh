#!/usr/bin/env bash
# Stages what it takes to build the Python extension _dmuon for ANOTHER
# CPython than the one it is built for here (the GPU machine runs Python 3.12
# with torch 2.x; Debian here has 3.11): the pybind11 sources, the headers
# they include (ours and absl's), one archive of every other object Bazel
# linked into _dmuon.so, the link flags with the version script and static
# archives they name (OpenBLAS), and the shared libraries the
# extension loads that are not the base system's. build_ext.sh turns that
# into _dmuon.so with the target's Python headers and pybind11. The Python
# package (client/python/dmuon) and its tests travel too.
#   usage: stage_ext.sh OUT_DIR     (after bazel build //client/python:_dmuon.so)
set -euo pipefail
out=${1:?usage: stage_ext.sh OUT_DIR}
cd "$(dirname "$0")/../.."
params=bazel-bin/client/python/_dmuon.so-2.params
[[ -f $params ]] || { echo "stage_ext: $params missing: bazel build //client/python:_dmuon.so" >&2; exit 1; }
rm -rf "$out/ext" && mkdir -p "$out/ext/src" "$out/ext/include" "$out/lib" "$out/python"
cp client/python/*.cc client/python/*.h "$out/ext/src/"
# Our headers the bindings include (and theirs), then absl's.
for h in client/client.h kernels/kernels.h client/python/bindings.h; do
  mkdir -p "$out/ext/include/$(dirname "$h")" && cp "$h" "$out/ext/include/$h"
done
cp -r /usr/include/absl "$out/ext/include/"
# Every object but the bindings' own, as one archive (the linker then takes
# what the bindings need, as Bazel's --start-lib did).
mapfile -t objs < <(grep -E '\.o$' "$params" | grep -v '/client/python/_objs/')
ar rcs "$out/ext/libdmuon_core.a" "${objs[@]}"
# The link's flags, in Bazel's order: the -l flags and the -Wl ones that
# shape the extension (client/python/BUILD): the version script exporting
# PyInit__dmuon alone, the static archives (-l:libopenblas.a) and
# --as-needed. The script and the archives travel in ext/ (@EXT@ there).
grep -E '^(-l|-Wl,-l:|-Wl,--as-needed$|-Wl,--version-script=)' "$params" |
  sed 's|^-Wl,--version-script=.*/|-Wl,--version-script=@EXT@/|' |
  tr '\n' ' ' >"$out/ext/link_flags"
script=$(sed -n 's|^-Wl,--version-script=||p' "$params")
[[ -z $script ]] || cp "$script" "$out/ext/"
mapfile -t archives < <(sed -n 's|^-Wl,-l:||p' "$params")
for a in "${archives[@]}"; do
  cp -L "$(gcc -print-file-name="$a")" "$out/ext/$a"
done
# The shared libraries _dmuon.so loads, but the base system's and CUDA's.
benchmarks/gpu/copy_libs.sh "$out/lib" bazel-bin/client/python/_dmuon.so
cp -r client/python/dmuon client/python/tests client/python/examples "$out/python/"
find "$out/python" -name __pycache__ -prune -exec rm -rf {} +
cp benchmarks/gpu/build_ext.sh "$out/ext/"
