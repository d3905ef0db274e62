#!/usr/bin/env bash
# deploy/smoke/smoke.sh: the image smoke test that `./dmuon test` runs.
# Builds the images (`./dmuon image`'s deploy/image/build.sh: cached, seconds
# when nothing changed), the host's dmuonctl and the Python extension, then
# runs test_image.py (pytest, the project's .venv) against them.
#
# When podman cannot run a container at all (not installed, or the kernel or
# sandbox refuses it), the suite is reported as skipped with podman's reason,
# never passed. Last line: "image: N passed, M failed, K skipped"; exit
# status 1 on a failure.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# shellcheck source=deploy/image/lib.sh
source "$ROOT/deploy/image/lib.sh"
summary() { echo "image: $1 passed, $2 failed, $3 skipped"; }
fail() { echo "FAIL  image: $*"; summary 0 1 0; exit 1; }

skip_all() {
  echo "skip  image: podman cannot run a container here: ${1##*$'\n'}"
  summary 0 0 1
  exit 0
}
# Can podman run anything? First podman itself, then the base image (made by
# debootstrap, no registry), the smallest thing to run; making the base is
# the project's own work: its failure is a failure, not a skip.
[[ -f $(containers_conf) ]] || fail "no $(containers_conf): run ./dmuon setup"
why=$(podman_ info 2>&1 >/dev/null) || skip_all "$why"
base=$("$ROOT/deploy/image/make-base.sh" | tail -n 1) || fail "making the base image failed"
if ! why=$(podman_ run --rm --network=host "$base" true 2>&1); then
  skip_all "$why"
fi

refs=$("$ROOT/deploy/image/build.sh" all) || fail "./dmuon image failed"
export DMUON_IMAGE DMUON_CUDA_IMAGE
DMUON_IMAGE=$(tail -n 1 <<<"$refs")
DMUON_CUDA_IMAGE=$(grep '/dmuond-cuda:' <<<"$refs" || true)
out=$(cd "$ROOT" && bazel build //daemon:dmuonctl //client/python:_dmuon.so 2>&1) || {
  printf '%s\n' "$out"
  fail "building dmuonctl and the Python extension failed"
}

log=$(mktemp)
trap 'rm -f "$log"' EXIT
CONTAINERS_CONF=$(containers_conf) "$ROOT/.venv/bin/python" -m pytest -q -rs -p no:cacheprovider \
  "$HERE" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
line=$(grep -E '^(=+ )?[0-9]+ (passed|failed|errors?|skipped)' "$log" | tail -n 1)
count() { [[ $line =~ ([0-9]+)\ $1 ]] && echo "${BASH_REMATCH[1]}" || echo 0; }
p=$(count passed) f=$(($(count failed) + $(count error))) s=$(count skipped)
((rc == 0 || f > 0)) || f=1 # pytest itself failed (collection, usage)
summary "$p" "$f" "$s"
((rc == 0))
