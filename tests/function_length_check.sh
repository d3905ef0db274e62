#!/usr/bin/env bash
# //tests:function_length_check: no production function over 100 lines in
# server/, daemon/, client/ (tests/function_length.py), on the source tree as
# it is (found through this script's runfiles link, as deps_check.sh does).
set -euo pipefail
self=${BASH_SOURCE[0]}
if [[ -n "${TEST_SRCDIR:-}" && -e "$TEST_SRCDIR/${TEST_WORKSPACE:-dmuon}/tests/function_length_check.sh" ]]; then
  self=$TEST_SRCDIR/${TEST_WORKSPACE:-dmuon}/tests/function_length_check.sh
fi
root=$(cd "$(dirname "$(readlink -f "$self")")/.." && pwd)
exec /usr/bin/python3 "$root/tests/function_length.py" "$root" "$@"
