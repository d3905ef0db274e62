#!/usr/bin/env bash
# The test a dmuon_fuzz_test runs: the harness over its seed corpus.
#   replay build (default): every seed once.
#   --config=fuzz (libFuzzer): fuzzing for DMUON_FUZZ_SECONDS (default 20)
#   from the seeds, new inputs kept in the test's scratch directory; a crash,
#   leak, timeout or out-of-memory fails the test and leaves the input in
#   $TEST_UNDECLARED_OUTPUTS_DIR (bazel-testlogs/.../test.outputs/).
set -euo pipefail
harness=$1
seeds=$(dirname "$2") # a seed file: its directory is the corpus
shift 2
if "$harness" -help=1 >/dev/null 2>&1; then
  work="${TEST_TMPDIR:-$(mktemp -d)}/corpus"
  artifacts="${TEST_UNDECLARED_OUTPUTS_DIR:-${TEST_TMPDIR:-/tmp}}/"
  mkdir -p "$work"
  exec "$harness" "$work" "$seeds" \
    -max_total_time="${DMUON_FUZZ_SECONDS:-20}" -seed=1 -rss_limit_mb=2048 \
    -timeout=10 -print_final_stats=1 -artifact_prefix="$artifacts" "$@"
fi
exec "$harness" "$seeds" "$@"
