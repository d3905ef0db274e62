#!/usr/bin/env bash
# Builds _dmuon.so for the python3 at hand from what stage_ext.sh staged
# (run on the GPU machine, whose CPython differs from Debian's): compiles the
# pybind11 sources against that Python's headers and its pybind11, and
# links them with the staged archive and libraries as Bazel did (the same
# flags: PyInit__dmuon the one export, OpenBLAS static). Exit 3: this Python
# has no headers or no pybind11 (the caller skips what needs the extension).
#   usage: build_ext.sh STAGED_DIR OUT_DIR [PYTHON]
set -euo pipefail
root=${1:?usage: build_ext.sh STAGED_DIR OUT_DIR [PYTHON]}
out=${2:?usage: build_ext.sh STAGED_DIR OUT_DIR [PYTHON]}
py=${3:-python3}
ext=$root/ext lib=$root/lib
inc=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
[[ -f $inc/Python.h ]] || { echo "build_ext: $("$py" -V 2>&1) has no Python.h (looked in $inc)"; exit 3; }
pyb=$("$py" -c 'import pybind11; print(pybind11.get_include())' 2>/dev/null || true)
[[ -n $pyb && -f $pyb/pybind11/pybind11.h ]] || pyb=/usr/include
[[ -f $pyb/pybind11/pybind11.h ]] || { echo "build_ext: no pybind11 headers for $py"; exit 3; }
# -isystem /usr/include would break libstdc++'s #include_next <stdlib.h>:
# the compiler searches it anyway.
sys_inc=()
for d in "$inc" "$pyb"; do
  [[ $d == /usr/include ]] || sys_inc+=(-isystem "$d")
done
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# -lNAME finds libNAME.so: point one at each staged versioned library.
mkdir -p "$work/links"
for f in "$lib"/*.so.*; do
  [[ -e $f ]] || continue
  b=$(basename "$f")
  ln -sf "$f" "$work/links/${b%%.so.*}.so"
done
pids=()
for src in "$ext"/src/*.cc; do
  g++ -std=c++17 -O2 -DNDEBUG -fPIC -fvisibility=hidden -w \
    -I"$ext/include" "${sys_inc[@]}" \
    -c "$src" -o "$work/$(basename "$src" .cc).o" &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
# shellcheck disable=SC2046
g++ -shared -o "$out/_dmuon.so" "$work"/*.o "$ext/libdmuon_core.a" \
  -L"$work/links" -L"$lib" -L"$ext" $(sed "s|@EXT@|$ext|g" "$ext/link_flags") \
  -Wl,-rpath,"$lib"
echo "build_ext: $out/_dmuon.so for $("$py" -V 2>&1)"
