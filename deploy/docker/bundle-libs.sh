#!/usr/bin/env bash
# Copies the given binaries to OUT/bin, every shared library they load to
# OUT/lib, and the licence of each library to OUT/licenses/<package>/, except
# the libraries the runtime image provides itself (glibc, libstdc++/libgcc
# from its distribution) or the NVIDIA container toolkit injects at run time
# (the driver: libcuda, libnvidia-*). cuBLAS, cuBLASLt and NCCL are copied:
# neither NVIDIA's "base" CUDA image nor Debian carry them.
#
# Used by the Dockerfile's build stage and by `./dmuon image`
# (deploy/image/build.sh), which first asks for --list to hash what would be
# bundled without copying it.
#
#   bundle-libs.sh OUT BINARY...        copy
#   bundle-libs.sh --list BINARY...     print "SOURCE DEST" per file, DEST
#                                       relative to OUT; copies nothing
#
# A library's licence: its Debian package's copyright file (dpkg -S); for
# the CUDA toolkit ($CUDA_HOME, /usr/local/cuda), the licence files of the
# NVIDIA wheel whose RECORD lists it (the toolkit installed from NVIDIA's
# wheels keeps their dist-info in $CUDA_HOME/dist-info), else the toolkit's
# EULA.txt; a binary linking a CUDA library also links the static CUDA
# runtime (third_party/cuda.BUILD), whose licence comes with it. A library
# with no licence found fails with --strict-licenses (./dmuon image), and is
# reported otherwise.
set -euo pipefail
list=0 strict=0
while [[ ${1:-} == --* ]]; do
  case $1 in
    --list) list=1 ;;
    --strict-licenses) strict=1 ;;
    *) echo "bundle-libs.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
if ((list)); then out=""; else out=${1:?usage: bundle-libs.sh [--strict-licenses] OUT BINARY... | --list BINARY...}; shift; fi
(($#)) || { echo "bundle-libs.sh: no binaries given" >&2; exit 2; }
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
cuda_real=$(readlink -f "$CUDA_HOME" 2>/dev/null || echo "$CUDA_HOME")
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|librt\.so|libpthread\.so|libutil\.so|libresolv\.so|libstdc\+\+\.so|libgcc_s\.so|libcuda\.so|libnvidia-)'

# Debian package of each library, from one dpkg-query call (one call per
# file would read dpkg's database each time: minutes for a CUDA daemon).
# A library's path as ldd shows it may be the /usr-less (merged-/usr) twin or
# a link of the file that dpkg lists: every variant is asked.
declare -A PKG=()
index_packages() {
  local f v paths=() line
  for f in "$@"; do
    for v in "$f" "$(readlink -f "$f")"; do paths+=("$v" "/usr$v"); done
  done
  while IFS= read -r line; do
    [[ $line == *": /"* ]] || continue
    PKG[${line#*: }]=${line%%:*}
  done < <(dpkg-query -S "${paths[@]}" 2>/dev/null || true)
}

# "SOURCE DEST" lines of a library's licence files; nothing if none found.
licence_of() {
  local lib=$1 real pkg p rec d
  real=$(readlink -f "$lib")
  for p in "$lib" "$real" "/usr$lib" "/usr$real"; do
    pkg=${PKG[$p]:-}
    if [[ -n $pkg && -f /usr/share/doc/$pkg/copyright ]]; then
      echo "/usr/share/doc/$pkg/copyright licenses/$pkg/copyright"
      return
    fi
  done
  [[ $real == "$cuda_real"/* ]] || return 0
  for rec in "$cuda_real"/dist-info/*/RECORD; do
    [[ -f $rec ]] || continue
    if grep -q -E "(^|/)${lib##*/}," "$rec"; then
      d=$(dirname "$rec")
      find "$d" -path '*/licenses/*' -type f | sort | while read -r p; do
        echo "$p licenses/$(basename "$d" .dist-info)/${p#"$d"/licenses/}"
      done
      return
    fi
  done
  if [[ -f $cuda_real/EULA.txt ]]; then
    echo "$cuda_real/EULA.txt licenses/cuda/EULA.txt"
  fi
}

# Every "SOURCE DEST" of the bundle, once each.
plan() {
  local b name file cuda=0 lic names=() files=() i
  for b in "$@"; do
    if ldd "$b" | grep -v -E 'libcuda\.so' | grep -q 'not found'; then
      ldd "$b" >&2
      echo "bundle-libs.sh: $b has unresolved libraries" >&2
      return 1
    fi
    echo "$(readlink -f "$b") bin/$(basename "$b")"
    while read -r name file; do
      [[ $name =~ $skip ]] && continue
      names+=("$name")
      files+=("$file")
    done < <(ldd "$b" | awk '/=>/ && $3 ~ /^\// {print $1, $3}')
  done
  ((${#files[@]})) && index_packages "${files[@]}"
  for i in "${!files[@]}"; do
    file=${files[$i]}
    echo "$(readlink -f "$file") lib/${names[$i]}"
    [[ $(readlink -f "$file") == "$cuda_real"/* ]] && cuda=1
    lic=$(licence_of "$file")
    if [[ -n $lic ]]; then
      echo "$lic"
    else
      echo "bundle-libs.sh: no licence found for $file" >&2
      ((strict == 0)) || return 1
    fi
  done
  if ((cuda)); then
    lic=$(licence_of "$cuda_real/lib64/libcudart_static.a")
    [[ -n $lic ]] && echo "$lic"
  fi
  return 0
}

lines=$(plan "$@") || exit 1
lines=$(awk '!seen[$2]++' <<<"$lines")
if ((list)); then
  printf '%s\n' "$lines"
  exit 0
fi
mkdir -p "$out/bin" "$out/lib" "$out/licenses"
while read -r src dest; do
  mkdir -p "$(dirname "$out/$dest")"
  cp -L "$src" "$out/$dest"
done <<<"$lines"
strip --strip-unneeded "$out"/bin/* 2>/dev/null || true
ls -l "$out/bin" "$out/lib" >&2
du -sh "$out" >&2
