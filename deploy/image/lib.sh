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
#   podman_within S ARGS...  podman_ ARGS, killed after S seconds (timeout)
#   require_podman SUITE     the suites' probe (deploy/smoke/, deploy/play/):
#                            returns when podman runs a container here, else
#                            prints SUITE's FAIL or skip line and summary and
#                            exits (podman missing, or anything under $CI: fail)
#   start_run SUITE PREFIX   a run id for SUITE's containers and pods
#                            (label dmuon.run=$DMUON_RUN_ID, exported); an
#                            EXIT trap removes them (and RUN_TEMP's paths,
#                            RUN_TAGS's tags);
#                            leftovers named PREFIX* over an hour old (a
#                            killed run's) removed now
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

podman_within() {
  local seconds=$1
  shift
  CONTAINERS_CONF=$(containers_conf) timeout --kill-after=10 "$seconds" podman "$@"
}

# podman_probe: prints why podman cannot run a container here; status 0 (it
# can), 1 (the kernel or sandbox refuses: a skip, outside CI) or 2 (a
# failure anywhere: what ./dmuon setup installs is missing, or the project's
# own base image cannot be made).
podman_probe() {
  local why base
  command -v podman >/dev/null || { echo "podman is not installed: run ./dmuon setup"; return 2; }
  [[ -f $(containers_conf) ]] || { echo "no $(containers_conf): run ./dmuon setup"; return 2; }
  why=$(podman_within 60 info 2>&1 >/dev/null) || { echo "podman info: ${why##*$'\n'}"; return 1; }
  base=$("$DMUON_IMAGE_LIB_DIR/make-base.sh" 2>&1 | tail -n 1)
  if [[ $base != localhost/* ]]; then
    echo "making the base image (deploy/image/make-base.sh) failed: $base"
    return 2
  fi
  why=$(podman_within 60 run --rm --network=host "$base" true 2>&1) ||
    { echo "podman run $base true (exit $?): ${why##*$'\n'}"; return 1; }
}

require_podman() {
  local suite=$1 why rc=0
  why=$(podman_probe) || rc=$?
  ((rc == 0)) && return 0
  if ((rc == 2)) || [[ -n ${CI:-} ]]; then
    echo "FAIL  $suite: $why${CI:+ (under \$CI the suite must run: no skip)}"
    echo "$suite: 0 passed, 1 failed, 0 skipped"
    exit 1
  fi
  echo "skip  $suite: podman cannot run a container here: $why"
  echo "$suite: 0 passed, 0 failed, 1 skipped"
  exit 0
}

# remove_labelled LABEL [UNTIL]: the pods and containers with LABEL (created
# before UNTIL ago, e.g. 1h, when given).
remove_labelled() {
  local filters=(--filter "$1") id
  [[ -z ${2:-} ]] || filters+=(--filter "until=$2")
  podman_within 60 pod ps -q "${filters[@]}" 2>/dev/null | while read -r id; do
    podman_within 60 pod rm -f "$id" >/dev/null 2>&1 || true
  done
  podman_within 60 ps -aq "${filters[@]}" 2>/dev/null | while read -r id; do
    podman_within 60 rm -f "$id" >/dev/null 2>&1 || true
  done
}

RUN_TEMP=()  # files and folders end_run removes too
RUN_TAGS=()  # image tags of this run only, which end_run removes (untags)
start_run() {
  DMUON_RUN_ID=$1-$(date +%s)-$$
  export DMUON_RUN_ID
  trap end_run EXIT
  remove_labelled "name=^$2" 1h
}
# shellcheck disable=SC2317 # called by the trap
end_run() {
  remove_labelled "label=dmuon.run=$DMUON_RUN_ID"
  ((${#RUN_TEMP[@]} == 0)) || rm -rf "${RUN_TEMP[@]}"
  local tag
  for tag in "${RUN_TAGS[@]}"; do podman_within 60 untag "$tag" "$tag" >/dev/null 2>&1 || true; done
}
