# shellcheck shell=bash
# deploy/image/lib.sh: sourced by ./dmuon and the container scripts of
# deploy/image/ and deploy/smoke/. One place for where the project's
# containers.conf lives and how podman is called with it.
#
#   containers_conf          the path of the project's containers.conf copy
#   setup_containers_conf    write it there from deploy/image/containers.conf
#                            (./dmuon setup; idempotent)
#   podman_ ARGS...          podman with CONTAINERS_CONF set to it; fails with
#                            a clear message when podman or the file is missing
#
# The file lives in the project's cache (~/.cache/dmuon/containers, or
# $DMUON_CONTAINERS_CACHE), shared by every checkout on the machine, never in
# /etc: the machine's own podman configuration stays as it is.

DMUON_IMAGE_LIB_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

containers_cache() {
  printf '%s\n' "${DMUON_CONTAINERS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dmuon/containers}"
}

containers_conf() { printf '%s/containers.conf\n' "$(containers_cache)"; }

setup_containers_conf() {
  local src=$DMUON_IMAGE_LIB_DIR/containers.conf dst
  dst=$(containers_conf)
  cmp -s "$src" "$dst" 2>/dev/null && return 0
  mkdir -p "$(dirname "$dst")"
  # Written aside and renamed: a podman call of another checkout never reads
  # a half-written file.
  cp "$src" "$dst.tmp.$$" && mv -f "$dst.tmp.$$" "$dst"
}

podman_() {
  local conf
  conf=$(containers_conf)
  if ! command -v podman >/dev/null; then
    echo "podman is not installed: run ./dmuon setup" >&2
    return 127
  fi
  if [[ ! -f $conf ]]; then
    echo "no containers.conf at $conf: run ./dmuon setup" >&2
    return 1
  fi
  CONTAINERS_CONF=$conf podman "$@"
}
