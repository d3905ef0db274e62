#!/usr/bin/env bash
# deploy/image/build.sh [--base IMAGE] [--rebuild-base] [cpu|cuda|all]:
# `./dmuon image`. Builds the dmuond images with podman from binaries built
# here by Bazel, with deploy/docker/Dockerfile's runtime stage
# (BINARIES=prebuilt):
#
#   localhost/dmuond       dmuond (CPU executors) and dmuonctl
#   localhost/dmuond-cuda  dmuond_cuda (as dmuond: CUDA executors, CUDA IPC
#                          and NCCL transports) and dmuonctl, with cuBLAS,
#                          cuBLASLt and NCCL from $CUDA_HOME
#
# each with the shared libraries its binaries load (bundle-libs.sh; glibc,
# libstdc++ and libgcc are the base's) and their licences, run as uid 65532,
# on a base made here from Debian 12 (make-base.sh; --base names another,
# e.g. NVIDIA's CUDA image from a registry you can reach). Labels:
# org.opencontainers.image.{version,revision,source}.
#
# Tags: <version>-<content hash> and dev. The hash covers what goes in (the
# bundled files' bytes, the Dockerfile, the base image's id, the version
# and source labels), so a call with nothing changed finds the image and
# builds nothing; at a new commit over the same binaries the image is only
# relabelled with the new revision (relabel).
# "all" (the default) builds cuda, then cpu; without the CUDA toolkit, cpu
# only, with a warning. Each image's reference is printed on a line of its
# own, the CPU image's last: the last line is the image reference.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# shellcheck source=deploy/image/lib.sh
source "$HERE/lib.sh"
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
log() { printf 'image: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

base="" rebuild_base=() what=all
while (($#)); do
  case $1 in
    --base) base=${2:?--base needs an image reference}; shift ;;
    --base=*) base=${1#--base=} ;;
    --rebuild-base) rebuild_base=(--rebuild) ;;
    cpu | cuda | all) what=$1 ;;
    *) die "unknown argument '$1' (usage: ./dmuon image [--base IMAGE] [--rebuild-base] [cpu|cuda|all])" ;;
  esac
  shift
done
flavours=()
case $what in
  cpu) flavours=(cpu) ;;
  cuda) flavours=(cuda) ;;
  all)
    if [[ -x $CUDA_HOME/bin/nvcc ]]; then
      flavours=(cuda cpu)
    else
      log "warning: no CUDA toolkit at $CUDA_HOME: building the CPU image only"
      flavours=(cpu)
    fi
    ;;
esac
[[ $what != cuda || -x $CUDA_HOME/bin/nvcc ]] || die "the cuda image needs the CUDA toolkit at $CUDA_HOME"

cd "$ROOT"
version=$(sed -n 's/.*kDmuonVersion\[\] = "\([^"]*\)".*/\1/p' base/protocol.h)
[[ -n $version ]] || die "no kDmuonVersion in base/protocol.h"
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
[[ -z $(git status --porcelain --untracked-files=no 2>/dev/null) ]] || revision+=-dirty
source_url=${DMUON_IMAGE_SOURCE:-$(git remote get-url origin 2>/dev/null || echo unknown)}
REVISION_LABEL=org.opencontainers.image.revision

if [[ -z $base ]]; then
  base=$("$HERE/make-base.sh" "${rebuild_base[@]}" | tail -n 1)
elif ! podman_ image exists "$base"; then
  log "pulling the base $base"
  podman_ pull -q "$base" >/dev/null || die "cannot pull --base $base"
fi
base_id=$(podman_ image inspect --format '{{.Id}}' "$base") || die "no base image $base"

# The CUDA build first: the CPU one last leaves Bazel's analysis cache on the
# default configuration, which the tests use next.
bazel_build() {
  local out
  out=$(bazel build "$@" 2>&1) || { printf '%s\n' "$out" >&2; die "bazel build $* failed"; }
}
for f in "${flavours[@]}"; do
  if [[ $f == cuda ]]; then
    bazel_build --config=cuda //daemon:dmuond_cuda //daemon:dmuonctl
  else
    bazel_build //daemon:dmuond //daemon:dmuonctl
  fi
done

# remember_sha FILE: ${SHAS[${SHA_ID[FILE]}]} is its sha256, remembered per
# (path, size, mtime, inode) in the containers cache: the CUDA image's
# 915 MB need not be read again on every call (12 s on a loaded machine)
# when the files are the same ones.
SHA_CACHE=$(containers_cache)/file-sha256
declare -A SHAS=() SHA_ID=() NEW_SHAS=()
if [[ -f $SHA_CACHE ]]; then
  while read -r id sha; do SHAS[$id]=$sha; done <"$SHA_CACHE"
fi
remember_sha() {
  local id
  id="$(readlink -f "$1"):$(stat -L -c '%s:%Y:%i' "$1")"
  SHA_ID[$1]=$id
  if [[ -z ${SHAS[$id]:-} ]]; then
    SHAS[$id]=$(sha256sum "$1" | cut -d' ' -f1)
    NEW_SHAS[$id]=1
  fi
}
save_shas() {
  ((${#NEW_SHAS[@]})) || return 0
  local id
  mkdir -p "$(dirname "$SHA_CACHE")"
  # Only entries whose file is still that file: the cache does not grow
  # with every binary ever built.
  for id in "${!SHAS[@]}"; do
    [[ "${id%%:*}:$(stat -L -c '%s:%Y:%i' "${id%%:*}" 2>/dev/null)" == "$id" ]] &&
      printf '%s %s\n' "$id" "${SHAS[$id]}"
  done >"$SHA_CACHE.$$"
  mv -f "$SHA_CACHE.$$" "$SHA_CACHE"
  NEW_SHAS=()
}

# build_one NAME DMUOND: the image NAME from DMUOND and dmuonctl; prints its
# reference.
build_one() {
  local name=$1 daemon=$2 plan key ref stage t=$SECONDS
  plan=$("$HERE/../docker/bundle-libs.sh" --strict-licenses --list "$daemon" bazel-bin/daemon/dmuonctl) ||
    die "bundling $daemon: a library is unresolved or has no licence"
  while read -r src dest; do remember_sha "$src"; done <<<"$plan"
  save_shas
  key=$({
    printf '%s\n' "$base_id" "$version" "$source_url"
    sha256sum deploy/docker/Dockerfile | cut -d' ' -f1
    while read -r src dest; do
      printf '%s %s\n' "$dest" "${SHAS[${SHA_ID[$src]}]}"
    done <<<"$plan"
  } | sha256sum | cut -c1-12)
  ref=localhost/$name:$version-$key
  if podman_ image exists "$ref"; then
    if [[ $(podman_ image inspect --format "{{index .Labels \"$REVISION_LABEL\"}}" "$ref") != "$revision" ]]; then
      relabel "$ref"
    fi
    podman_ tag "$ref" "localhost/$name:dev"
    log "$ref is up to date"
    echo "$ref"
    return
  fi
  stage=$(mktemp -d "${TMPDIR:-/tmp}/dmuon-image.XXXXXX")
  STAGES+=("$stage") # removed on exit, also when a step dies (~900 MB for CUDA)
  "$HERE/../docker/bundle-libs.sh" --strict-licenses "$stage/image-bundle" "$daemon" bazel-bin/daemon/dmuonctl \
    >"$stage/bundle.log" 2>&1 || { cat "$stage/bundle.log" >&2; die "bundle-libs.sh for $daemon failed"; }
  [[ $daemon == */dmuond ]] || mv "$stage/image-bundle/bin/$(basename "$daemon")" "$stage/image-bundle/bin/dmuond"
  log "building $ref on $base ($(du -sh "$stage/image-bundle" | cut -f1) of binaries and libraries)"
  # --layers=false: no intermediate image per stage or step is kept (each
  # build left its build stage behind, dangling: 63 MB CPU, 878 MB CUDA);
  # the content key above is the cache. The labels are also given as
  # --label: buildah 1.28 reuses a cached LABEL layer whose build arguments
  # changed, so the Dockerfile's LABEL of a new revision alone would keep
  # the old one.
  if ! podman_ build --quiet --layers=false --network=host --format=oci -f deploy/docker/Dockerfile \
    --build-arg BINARIES=prebuilt --build-arg BUNDLE=image-bundle --build-arg RUNTIME_IMAGE="$base" \
    --build-arg VERSION="$version" --build-arg REVISION="$revision" --build-arg SOURCE="$source_url" \
    --label org.opencontainers.image.version="$version" \
    --label org.opencontainers.image.revision="$revision" \
    --label org.opencontainers.image.source="$source_url" \
    -t "$ref" -t "localhost/$name:dev" "$stage" >"$stage/build.log" 2>&1; then
    grep -v '^HEALTHCHECK is not supported' "$stage/build.log" >&2
    die "podman build of $ref failed"
  fi
  log "built $ref in $((SECONDS - t)) s, $(podman_ image inspect --format '{{.Size}}' "$ref" | awk '{printf "%.0f MB", $1 / 1e6}')"
  prune "$name" "$ref"
  echo "$ref"
}

# relabel REF: REF again with this revision's label, the rest as it is (the
# same binaries, base and Dockerfile at another commit): one config-only
# image, a second or two, instead of staging and hashing the bundle again.
relabel() {
  local empty
  empty=$(mktemp -d "${TMPDIR:-/tmp}/dmuon-relabel.XXXXXX")
  printf 'FROM %s\n' "$1" >"$empty/Containerfile"
  podman_ build --quiet --layers=false --network=host --format=oci -f "$empty/Containerfile" \
    --label "$REVISION_LABEL=$revision" -t "$1" -t "${1%:*}:dev" "$empty" >/dev/null ||
    { rm -rf "$empty"; die "relabelling $1 failed"; }
  rm -rf "$empty"
  log "$1: the same content, labelled with revision $revision"
}

# prune NAME REF: removes the builds of NAME older than a day, never REF
# (just built) or dev: another checkout may be testing one (smoke.sh and
# play.sh run an image by its id, which a removed tag does not take away, but
# a removed image does). Also this project's untagged images older than an
# hour: those a relabel left behind and the intermediate stages of builds
# before --layers=false. One in use by a container stays.
prune() {
  local keep id tag
  keep=$(podman_ image inspect --format '{{.Id}}' "$2")
  podman_ images --filter reference="localhost/$1" --filter until=24h --format '{{.ID}} {{.Tag}}' |
    while read -r id tag; do
      [[ $tag == dev || ${keep:0:12} == "$id" ]] && continue
      podman_ rmi "localhost/$1:$tag" >/dev/null 2>&1 || true
    done
  podman_ images -q --filter dangling=true --filter label=org.opencontainers.image.version \
    --filter until=1h | while read -r id; do podman_ rmi "$id" >/dev/null 2>&1 || true; done
}

STAGES=()
# shellcheck disable=SC2317 # called by the trap
remove_stages() { ((${#STAGES[@]} == 0)) || rm -rf "${STAGES[@]}"; }
trap remove_stages EXIT

for f in "${flavours[@]}"; do
  if [[ $f == cuda ]]; then
    build_one dmuond-cuda bazel-bin/daemon/dmuond_cuda
  else
    build_one dmuond bazel-bin/daemon/dmuond
  fi
done
