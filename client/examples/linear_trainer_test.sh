#!/usr/bin/env bash
# Runs the example trainer against a real dmuond on a free port.
set -euo pipefail
R=${TEST_SRCDIR:-$PWD/..}/dmuon
DIR=$(mktemp -d "${TEST_TMPDIR:-/tmp}/linear.XXXXXX")
"$R/daemon/dmuond" --listen=127.0.0.1:0 --port-file="$DIR/port" \
  --summary-every-secs=0 >"$DIR/dmuond.log" 2>&1 &
DAEMON=$!
trap 'kill -9 $DAEMON 2>/dev/null || true' EXIT
for _ in $(seq 200); do [[ -s $DIR/port ]] && break; sleep 0.05; done
[[ -s $DIR/port ]] || { cat "$DIR/dmuond.log"; exit 1; }
"$R/client/examples/linear_trainer" --server="127.0.0.1:$(cat "$DIR/port")" --steps=60
