#!/usr/bin/env bash
# Stages what it takes to build the Python extension _dmuon for ANOTHER
# CPython than the one it is built for here (the GPU machine runs Python 3.12
# with torch 2.x; Debian here has 3.11): the pybind11 sources, the headers
# they include (ours as the compiler finds them, and absl's), one archive of
# every other object Bazel linked into _dmuon.so, the link flags with the
# version script and static archives they name (OpenBLAS), and the shared
# libraries the extension loads that are not the base system's. build_ext.sh turns that
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
# Our headers the bindings reach, as the compiler finds them (-MM: every
# header but the system's, with the include paths Bazel gives them: the
# repository root, and bazel-bin for generated headers such as protobuf's),
# staged at their include paths. A header outside those roots is an error:
# the device could not rebuild the extension from the bundle.
py=${PYTHON:-.venv/bin/python}
[[ -x $py ]] || py=python3
pyinc=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
pyb=$("$py" -c 'import pybind11; print(pybind11.get_include())' 2>/dev/null || echo /usr/include)
deps=$(g++ -std=c++17 -MM -I. -Ibazel-bin -isystem "$pyinc" -isystem "$pyb" \
  client/python/*.cc) || { echo "stage_ext: g++ -MM over client/python/*.cc failed" >&2; exit 1; }
mapfile -t headers < <(tr ' ' '\n' <<<"${deps//\\/}" |
  grep -E '\.(h|hh|hpp|inc)$' | sort -u)
((${#headers[@]})) || { echo "stage_ext: g++ -MM found no header of the bindings" >&2; exit 1; }
for h in "${headers[@]}"; do
  rel=${h#bazel-bin/}
  [[ $rel != /* && $rel != ../* ]] ||
    { echo "stage_ext: $h is outside the repository and bazel-bin: not staged" >&2; exit 1; }
  mkdir -p "$out/ext/include/$(dirname "$rel")" && cp "$h" "$out/ext/include/$rel"
done
echo "stage_ext: ${#headers[@]} headers: ${headers[*]}" >&2
# absl's whole tree (Debian's, the version of the libabsl_*.so staged in
# lib/): which of its headers a compile reaches depends on the compiler's
# version (absl/base/config.h), and the device's g++ need not be this one.
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
