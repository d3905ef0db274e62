#!/usr/bin/env bash
# The dependency rules of docs/design.md ("Dependency rules"), checked on the
# #include (and .proto import) lines of every first-party source file. Each
# rule is "files under FOLDER (but for one exempt subfolder, if it names
# one) never include PREFIX"; a violation prints the file, the line, the
# forbidden include and the rule, and the script exits 1.
# tests/deps_check_test.sh plants a violation of each rule in a tree of its
# own.
#
#   tests/deps_check.sh [REPO_ROOT]      # default: the repository this file is in
#
# Under Bazel (//tests:deps_check, run by ./dmuon test) it finds the source
# tree through its own runfiles link, so it always scans the whole tree as it
# is, new folders and files included (the target is tagged "external": never
# cached). A rule changes here and in docs/design.md together.
set -euo pipefail

if [[ $# -ge 1 ]]; then
  root=$1
else
  self=${BASH_SOURCE[0]}
  if [[ -n "${TEST_SRCDIR:-}" && -e "$TEST_SRCDIR/${TEST_WORKSPACE:-dmuon}/tests/deps_check.sh" ]]; then
    self=$TEST_SRCDIR/${TEST_WORKSPACE:-dmuon}/tests/deps_check.sh
  fi
  root=$(cd "$(dirname "$(readlink -f "$self")")/.." && pwd)
fi
if [[ ! -f "$root/WORKSPACE" || ! -d "$root/kernels" ]]; then
  echo "deps_check: $root does not look like the dmuon source tree" >&2
  exit 2
fi
cd "$root"

# FOLDER|FORBIDDEN PREFIXES (space-separated)|why[|SUBFOLDER EXEMPT]
RULES=(
  "proto/|kernels/ transport/ planner/ base/ server/ daemon/ client/ tests/ benchmarks/|proto/ is the wire contract and depends on nothing first-party"
  "base/|kernels/ transport/ planner/ server/ daemon/ client/ proto/ tests/ benchmarks/|base/ is the bottom layer"
  "planner/|kernels/ transport/ base/ proto/ server/ daemon/ client/ tests/ benchmarks/|planner/ is plain C++ with no deps: the daemon, the pool client and the simulator all plan with it"
  "kernels/|transport/ planner/ proto/ server/ daemon/ client/ tests/ benchmarks/|kernels/ is pure compute (its one file is the autotuner's cache)"
  "transport/|kernels/ planner/ proto/ server/ daemon/ client/ tests/ benchmarks/|transport/ moves bytes; its CUDA-status macro comes from base/, not kernels/cuda/check.h"
  "server/|daemon/ client/ tests/ benchmarks/ prometheus/|server/ is the service logic: the process (daemon/) depends on it, never the reverse; server/ and client/ are peers; tests live in tests/; metrics go through ServiceMetrics (server/service_metrics.h), Prometheus is daemon/'s"
  "server/|grpcpp/ grpc/ cuda_runtime cuda.h cublas nccl.h|server/ outside server/cuda/ has no gRPC types (daemon/grpc_service.cc is the only place a Status becomes a grpc::Status) and no CUDA types (GPU transports are seen through device_transport.h)|server/cuda"
  "daemon/|client/ tests/ benchmarks/|daemon/ is the process around the service (main, flags, gRPC adapter); it never depends on clients; tests live in tests/"
  "client/|server/ daemon/ tests/ benchmarks/|client/ and server/ are peers that share only proto/, planner/, kernels/, transport/ and base/; tests live in tests/"
)

fail=0
declare -A checked=()
for rule in "${RULES[@]}"; do
  IFS='|' read -r folder forbidden why exempt <<<"$rule"
  folder=${folder%/}
  [[ -d "$folder" ]] || continue
  prune=()
  [[ -n "$exempt" ]] && prune=(-path "${exempt%/}" -prune -o)
  while IFS= read -r -d '' f; do
    checked[$f]=1
    # '#include "x/..."' or '#include <x/...>' in C++/CUDA, 'import "x/..."'
    # in .proto files.
    while IFS=: read -r line inc; do
      [[ -n "$inc" ]] || continue
      for p in $forbidden; do
        if [[ "$inc" == "$p"* ]]; then
          echo "deps_check: $f:$line includes \"$inc\": $folder/${exempt:+ (outside $exempt/)} never includes $p ($why)"
          fail=1
        fi
      done
    done < <(grep -n -E '^[[:space:]]*(#[[:space:]]*include|import)[[:space:]]+["<]' "$f" |
               sed -E 's/^([0-9]+):[^"<]*["<]([^">]+)[">].*/\1:\2/' || true)
  done < <(find "$folder" "${prune[@]}" -type f \( -name '*.h' -o -name '*.cc' \
             -o -name '*.cu' -o -name '*.cuh' -o -name '*.proto' \) -print0 | sort -z)
done

if [[ ${#checked[@]} -eq 0 ]]; then
  echo "deps_check: no source files found under $root" >&2
  exit 2
fi
if [[ $fail -ne 0 ]]; then
  echo "deps_check: FAILED (rules: docs/design.md, \"Dependency rules\")"
  exit 1
fi
echo "deps_check: ${#checked[@]} files, every dependency rule holds"
