#!/usr/bin/env bash
# tests/deps_check.sh on a small tree of its own: it passes on a clean tree
# (server/cuda/ may include CUDA headers), and fails on each planted
# violation of a rule of docs/design.md ("Dependency rules"), naming the file
# and the include.
set -euo pipefail

here=$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")
check=$here/deps_check.sh
tmp=$(mktemp -d "${TEST_TMPDIR:-/tmp}/deps_check_test.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

fresh_tree() {
  rm -rf "$tmp/t"
  mkdir -p "$tmp/t"/{proto,base,planner,kernels,transport,server/cuda,daemon,client}
  touch "$tmp/t/WORKSPACE"
  echo '#include "kernels/types.h"' >"$tmp/t/kernels/k.cc"
  echo '#include "server/service.h"' >"$tmp/t/server/s.cc"
  printf '#include <cuda_runtime_api.h>\n#include "nccl.h"\n' >"$tmp/t/server/cuda/e.cc"
  echo '#include <grpcpp/grpcpp.h>' >"$tmp/t/daemon/d.cc"
}

failures=0
fresh_tree
if ! out=$(bash "$check" "$tmp/t" 2>&1); then
  echo "FAIL: a clean tree was refused: $out"
  failures=$((failures + 1))
fi

# file|line planted
plants=(
  'server/s.cc|#include <grpcpp/grpcpp.h>'
  'server/s.cc|#include <grpc/grpc.h>'
  'server/s.cc|#include <cuda_runtime_api.h>'
  'server/s.cc|#include <cuda.h>'
  'server/s.cc|#include <cublasLt.h>'
  'server/s.cc|#include "nccl.h"'
  'server/s.cc|#include "daemon/config.h"'
  'proto/p.proto|import "daemon/x.proto";'
  'base/b.cc|#include "daemon/config.h"'
  'planner/p.cc|#include "daemon/config.h"'
  'kernels/k.cc|#include "daemon/config.h"'
  'transport/t.cc|#include "daemon/config.h"'
  'client/c.cc|#include "daemon/config.h"'
)
for plant in "${plants[@]}"; do
  IFS='|' read -r file line <<<"$plant"
  fresh_tree
  echo "$line" >>"$tmp/t/$file"
  inc=$(sed -E 's/^[^"<]*["<]([^">]+)[">].*/\1/' <<<"$line")
  if out=$(bash "$check" "$tmp/t" 2>&1); then
    echo "FAIL: $file planting '$line' passed: $out"
    failures=$((failures + 1))
  elif [[ $out != *"$file:"*"includes \"$inc\""* ]]; then
    echo "FAIL: $file planting '$line': the output does not name it: $out"
    failures=$((failures + 1))
  fi
done

if ((failures)); then
  echo "deps_check_test: $failures failed"
  exit 1
fi
echo "deps_check_test: a clean tree passes, ${#plants[@]} planted violations refused"
