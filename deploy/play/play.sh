#!/usr/bin/env bash
# deploy/play/play.sh: the chart's pods played with `podman kube play`, what
# `./dmuon test` runs after the image smoke test (play.py says what is
# played and checked; deploy/README.md lists what podman cannot model).
# Uses the CPU image of `./dmuon image cpu` (as deploy/README.md shows it: cached,
# seconds when nothing changed), or $DMUON_PLAY_IMAGE when set, and the
# host's dmuonctl and client/examples/linear_trainer (the sidecar's trainer).
#
# When podman cannot run a container at all (the kernel or sandbox refuses
# it) the suite is reported as skipped with podman's reason, never passed;
# podman missing, or any skip under $CI, is a failure (lib.sh's
# require_podman, the same probe as the image smoke test). Every pod carries
# the label dmuon.run=<this run>, and all are removed on exit, also when the
# run is interrupted. Last line: "play: N passed, M failed, K skipped"; exit
# status 1 on a failure.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# shellcheck source=deploy/image/lib.sh
source "$ROOT/deploy/image/lib.sh"
fail() { echo "FAIL  play: $*"; echo "play: 0 passed, 1 failed, 0 skipped"; exit 1; }

require_podman play
# DMUON_PLAY_KEEP (leave the pods running): nothing removed on exit.
[[ -n ${DMUON_PLAY_KEEP:-} ]] || start_run play dmuond-play-
ref=${DMUON_PLAY_IMAGE:-}
if [[ -z $ref ]]; then
  ref=$("$ROOT/dmuon" image cpu | tail -n 1) || fail "./dmuon image cpu failed"
fi
# A tag of this run's own on the image's id (pods name an image by
# repository and tag): a run at another commit may move or prune $ref
# meanwhile, never this tag; it is removed on exit.
id=$(podman_within 60 image inspect --format '{{.Id}}' "$ref") || fail "no image $ref"
image=localhost/dmuond:play-${DMUON_RUN_ID:-keep-$$}
podman_within 60 tag "$id" "$image" || fail "cannot tag $id as $image"
RUN_TAGS+=("$image")
out=$(cd "$ROOT" && bazel build //daemon:dmuonctl //client/examples:linear_trainer 2>&1) || {
  printf '%s\n' "$out"
  fail "building dmuonctl and linear_trainer failed"
}
CONTAINERS_CONF=$(containers_conf) DMUONCTL=$ROOT/bazel-bin/daemon/dmuonctl \
  "$ROOT/.venv/bin/python" "$HERE/play.py" --image "$image" \
  --trainer "$ROOT/bazel-bin/client/examples/linear_trainer" "$@"
