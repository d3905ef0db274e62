#!/usr/bin/env bash
# deploy/play/play.sh: the chart's pods played with `podman kube play`, what
# `./dmuon test` runs after the image smoke test (play.py says what is
# played and checked; deploy/README.md lists what podman cannot model).
# Uses the CPU image of `./dmuon image` (deploy/image/build.sh cpu: cached,
# seconds when nothing changed), or $DMUON_PLAY_IMAGE when set, and the
# host's dmuonctl and client/examples/linear_trainer (the sidecar's trainer).
#
# When podman cannot run a container at all the suite is reported as
# skipped with podman's reason, never passed. Last line: "play: N passed, M
# failed, K skipped"; exit status 1 on a failure.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# shellcheck source=deploy/image/lib.sh
source "$ROOT/deploy/image/lib.sh"
fail() { echo "FAIL  play: $*"; echo "play: 0 passed, 1 failed, 0 skipped"; exit 1; }

if ! why=$(podman_ info --format '{{.Host.OCIRuntime.Name}}' 2>&1); then
  echo "skip  play: podman cannot run here: ${why##*$'\n'}"
  echo "play: 0 passed, 0 failed, 1 skipped"
  exit 0
fi
image=${DMUON_PLAY_IMAGE:-}
if [[ -z $image ]]; then
  image=$("$ROOT/deploy/image/build.sh" cpu | tail -n 1) || fail "./dmuon image cpu failed"
fi
out=$(cd "$ROOT" && bazel build //daemon:dmuonctl //client/examples:linear_trainer 2>&1) || {
  printf '%s\n' "$out"
  fail "building dmuonctl and linear_trainer failed"
}
CONTAINERS_CONF=$(containers_conf) DMUONCTL=$ROOT/bazel-bin/daemon/dmuonctl \
  "$ROOT/.venv/bin/python" "$HERE/play.py" --image "$image" \
  --trainer "$ROOT/bazel-bin/client/examples/linear_trainer" "$@"
