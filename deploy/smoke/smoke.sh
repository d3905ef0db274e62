#!/usr/bin/env bash
# deploy/smoke/smoke.sh: the image smoke test that `./dmuon test` runs.
# Builds the images (`./dmuon image all`, as a user runs it: cached, seconds
# when nothing changed), the host's dmuonctl and the Python extension, then
# runs test_image.py (pytest, the project's .venv) against them, by image id
# ($DMUON_IMAGE, $DMUON_CUDA_IMAGE; the references in $DMUON_IMAGE_REF,
# $DMUON_CUDA_IMAGE_REF).
#
# When podman cannot run a container at all (the kernel or sandbox refuses
# it), the suite is reported as skipped with podman's reason, never passed;
# podman missing, or any skip under $CI, is a failure (lib.sh's
# require_podman). Every container it starts carries the label
# dmuon.run=<this run>, and all are removed on exit, also when a step fails
# or the run is interrupted. Last line: "image: N passed, M failed, K
# skipped"; exit status 1 on a failure.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# shellcheck source=deploy/image/lib.sh
source "$ROOT/deploy/image/lib.sh"
summary() { echo "image: $1 passed, $2 failed, $3 skipped"; }
fail() { echo "FAIL  image: $*"; summary 0 1 0; exit 1; }

require_podman image
start_run smoke dmuon-smoke-

# `./dmuon image` itself, as deploy/README.md shows it; its last line is the
# CPU image's reference.
refs=$("$ROOT/dmuon" image all) || fail "./dmuon image failed"
ref=$(tail -n 1 <<<"$refs")
[[ $ref =~ ^localhost/dmuond: ]] || fail "./dmuon image's last line is '$ref', not localhost/dmuond:..."
cuda_ref=$(grep '^localhost/dmuond-cuda:' <<<"$refs" || true)
# The tests run the images by id: a run at another commit may relabel (move)
# or prune these tags meanwhile; an id stays what was built here.
image_id() { podman_within 60 image inspect --format '{{.Id}}' "$1"; }
export DMUON_IMAGE DMUON_IMAGE_REF=$ref DMUON_CUDA_IMAGE="" DMUON_CUDA_IMAGE_REF=$cuda_ref
DMUON_IMAGE=$(image_id "$ref") || fail "no image $ref after ./dmuon image"
if [[ -n $cuda_ref ]]; then
  DMUON_CUDA_IMAGE=$(image_id "$cuda_ref") || fail "no image $cuda_ref after ./dmuon image"
fi
out=$(cd "$ROOT" && bazel build //daemon:dmuonctl //client/python:_dmuon.so 2>&1) || {
  printf '%s\n' "$out"
  fail "building dmuonctl and the Python extension failed"
}

log=$(mktemp)
RUN_TEMP+=("$log")
CONTAINERS_CONF=$(containers_conf) "$ROOT/.venv/bin/python" -m pytest -q -rs -p no:cacheprovider \
  "$HERE" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
line=$(grep -E '^(=+ )?[0-9]+ (passed|failed|errors?|skipped)' "$log" | tail -n 1)
count() { [[ $line =~ ([0-9]+)\ $1 ]] && echo "${BASH_REMATCH[1]}" || echo 0; }
p=$(count passed) f=$(($(count failed) + $(count error))) s=$(count skipped)
((rc == 0 || f > 0)) || f=1 # pytest itself failed (collection, usage)
summary "$p" "$f" "$s"
((rc == 0))
